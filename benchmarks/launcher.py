"""One training launch of a benchmark configuration inside the link's namespace: the deepspeed launcher's 2 ranks, or
the ranks of two nodes (:mod:`benchmarks.two_nodes`); rank 0's summary is the result."""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import two_nodes
from benchmarks.configs import BenchConfig, ds_config_for
from benchmarks.netlink import Namespace

ROOT = Path(__file__).resolve().parent.parent
TRAIN_SCRIPT = ROOT / "examples" / "train_char_gpt.py"
# run as a module from the repository root (``python -m``): it imports the main job from examples/
DDP_MODULE = "benchmarks.ddp_powersgd"


def launch(ns: Namespace, config: BenchConfig, args: argparse.Namespace, steps: int, eval_interval: int,
           eval_batches: int, tag: str, holdout: bool = False, seed: int | None = None) -> dict:
    """Run one training launch of ``config`` in the namespace; returns rank 0's summary dict. ``holdout``: the run also
    scores the whole validation split after its last step (``--holdout-eval``); ``seed``: the run's (default --seed).

    Raises RuntimeError when the launch fails, times out or writes no summary.
    """
    summary_path = args.out_dir / f"{tag}.json"
    summary_path.unlink(missing_ok=True)
    model_args = ["--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd), "--n-head", str(args.n_head),
                  "--block-size", str(args.block_size)]
    common = ["--max-steps", str(steps), "--seed", str(args.seed if seed is None else seed), "--eval-interval", str(eval_interval),
              "--eval-batches", str(eval_batches), "--summary-json", str(summary_path), "--net-iface", "lo"]
    if holdout:
        common.append("--holdout-eval")
    if args.nodes:  # the shaped path's two classes count what crossed between the nodes
        common[common.index("--net-iface"):common.index("--net-iface") + 2] = ["--net-tc-classes",
                                                                               ",".join(two_nodes_classes())]
    launcher = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_addr", "127.0.0.1",
                "--master_port", "29700"]
    if config.ddp:
        cmd = launcher + ["--module", DDP_MODULE, "--micro-batch", str(args.micro_batch)] + model_args + common
    else:
        config_path = args.out_dir / "configs" / f"{config.name}.json"
        config_path.parent.mkdir(parents=True, exist_ok=True)
        config_path.write_text(json.dumps(ds_config_for(config, args.micro_batch, args.ranks_per_node, args.prefetch_bucket_size), indent=2) + "\n")
        cmd = launcher + [str(TRAIN_SCRIPT), "--deepspeed_config", str(config_path)] + model_args + common
    log_path = args.out_dir / "logs" / f"{tag}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    shown = cmd[cmd.index(str(TRAIN_SCRIPT)):] if args.nodes else cmd[3:]
    print(f"  {tag}: {' '.join(shown)}" + (f" (x {2 * args.ranks_per_node} ranks on 2 nodes)" if args.nodes else ""),
          flush=True)
    with open(log_path, "w") as log:
        try:
            if args.nodes:
                codes = launch_on_nodes(ns, cmd[cmd.index(str(TRAIN_SCRIPT)):], args.ranks_per_node, log,
                                        args.launch_timeout_s)
                returncode = next((c for c in codes if c != 0), 0)
            else:
                returncode = subprocess.run(ns.prefix() + cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                            timeout=args.launch_timeout_s, start_new_session=True).returncode
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{tag} ran longer than {args.launch_timeout_s} s (log: {log_path})") from None
    if returncode != 0 or not summary_path.exists():
        raise RuntimeError(f"{tag} failed with exit code {returncode} (log: {log_path})")
    return json.loads(summary_path.read_text())


def two_nodes_classes() -> list[str]:
    """The htb classes of benchmarks/two_nodes.py's shaped path (A -> B, B -> A)."""
    return list(two_nodes.SHAPED_CLASSES.values())


def launch_on_nodes(link, script_cmd: list[str], ranks_per_node: int, log, timeout_s: float) -> list[int]:
    """Start ``2 * ranks_per_node`` ranks of ``script_cmd`` (a script and its arguments) in ``link``'s namespace, the
    first ``ranks_per_node`` on node A and the others on node B (each with its node's address:
    :meth:`two_nodes.TwoNodeLink.node_env`), with the environment the deepspeed launcher sets (``RANK``,
    ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_SIZE``, the store on node A); wait for all. Returns their exit codes;
    on a timeout every rank is killed and ``subprocess.TimeoutExpired`` raised."""
    world = 2 * ranks_per_node
    procs = []
    for rank in range(world):
        node = "A" if rank < ranks_per_node else "B"
        env = dict(os.environ, **link.node_env(node), RANK=str(rank), LOCAL_RANK=str(rank % ranks_per_node),
                   WORLD_SIZE=str(world), LOCAL_SIZE=str(ranks_per_node), CROSS_RANK=str(rank // ranks_per_node),
                   CROSS_SIZE="2", MASTER_ADDR=two_nodes_address("A"), MASTER_PORT="29700",
                   OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        procs.append(subprocess.Popen(link.prefix() + [sys.executable, "-u"] + script_cmd, env=env, cwd=ROOT,
                                      stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.time() + timeout_s
    try:
        return [p.wait(timeout=max(1.0, deadline - time.time())) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise


def two_nodes_address(node: str) -> str:
    return two_nodes.NODE_ADDRESSES[node]
