"""End-to-end speed of compressed ZeRO-3 on a real, rate-limited link, against stock and PowerSGD.

Run from the repository root as root (``make bench``)::

    python benchmarks/bench_network.py --rates 100mbit 1gbit --json runs/bench_network/results.json

What it does:

1. Creates a private network namespace whose loopback is rate-limited with ``tc tbf`` and runs
   every job inside it on 127.0.0.1 only. The limit is shared by all flows in the namespace (a
   shared bus, not a full-duplex link per pair). The namespace is deleted afterwards, also on
   Ctrl-C, SIGTERM or failure. Without root, ``ip`` or ``tc`` it says so and exits with status 2.
2. Model: the main job's char GPT at about 10M parameters (6 layers x 384, 128-character context),
   2 ranks, 8 sequences per rank per step, ``stage3_param_persistence_threshold: 0`` so that
   weights are gathered as in a large model, and ``stage3_prefetch_bucket_size`` (``--prefetch-bucket-size``)
   about two layers' matrices for every ZeRO-3 configuration, stock's too, so that the gathers overlap the
   forward. Same data, seed and steps for every configuration.
3. Convergence: each configuration trains once for ``--converge-steps`` steps on the unlimited
   loopback of the namespace (losses do not depend on the link; CPU runs are deterministic),
   evaluating every ``--eval-interval`` steps on ``--eval-batches`` random validation batches, and
   after the last step on the whole validation split (``--holdout-eval``: the loss the tables compare;
   4 batches of 8 x 128 tokens did not resolve 1% between two runs); with ``--seeds N``, N runs per
   configuration at consecutive seeds, the tables comparing their means. A configuration whose choices
   depend on the link (``policy_auto``) trains once more at every rate, and its loss at a rate is that run's.
4. Timing: for every rate and then without a limit (the ceiling), ``--repeats`` rounds; each
   round launches every configuration once
   (``--warmup-steps`` + ``--timed-steps`` steps), the order rotated between rounds. Step time
   is rank 0's wall time of a training step (forward, backward, optimizer step, ending in a
   collective), without evaluation; bytes on the wire are the namespace loopback's tx counter
   over the same step (all ranks, TCP/IP headers included). Medians over the timed steps, then
   over rounds; speed-ups are medians of the per-round ratios (same round, same drift).
5. Time to target: the target is stock fp32's validation loss at ``--target-step`` (default: the last
   evaluation at or before half of ``--converge-steps``); a configuration's time to target at a rate is the first evaluation step at
   which its validation loss is at or below the target, times its median step time at that rate
   (evaluation not counted). Link use: wire bytes per step / (rate x step time).

Outputs under ``--out-dir``: one JSON per launch, ``results.md`` (the tables), ``bench_network.png``
(one panel per rate: validation loss against modelled wall-clock time; step time per configuration and rate),
and ``--json PATH`` with everything.
"""

import argparse
import copy
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRAIN_SCRIPT = ROOT / "examples" / "train_char_gpt.py"
DDP_SCRIPT = ROOT / "benchmarks" / "ddp_powersgd.py"
BASE_CONFIG = ROOT / "configs" / "zero3_p0_baseline.json"
# stage3_prefetch_bucket_size of every ZeRO-3 configuration (--prefetch-bucket-size): about two of the model's
# 6 x 1.77M-parameter layers' matrices, so that each gather overlaps the forward of the layer before (DeepSpeed's
# default, 5e7, gathers all 10.7M parameters at once before the first layer; results/bench_time_to_target.md).
PREFETCH_BUCKET_SIZE = 1_000_000


@dataclass(frozen=True)
class BenchConfig:
    """One configuration: ``dgc`` is the ds_config "dgc" section (None: stock), ``ds_extra`` other
    top-level ds_config keys; ``ddp`` runs benchmarks/ddp_powersgd.py instead of ZeRO-3."""
    name: str
    label: str
    dgc: dict | None = None
    ds_extra: dict = field(default_factory=dict)
    ddp: bool = False
    grads_only: bool = False  # compresses gradients only (weights gathered as stock)
    # --nodes only: the hierarchical topology and hpZ over the node (dgc.ranks_per_node and
    # zero_hpz_partition_size = the node size, set at launch)
    node_level: bool = False
    # what it sends depends on the link (policy "auto"): its loss is trained at every rate, not once
    loss_per_rate: bool = False


def _dgc(density: float | str, error_feedback: bool = True, weights: str | None = None) -> dict:
    # fp32 residuals, as when results/bench_network*.md were measured (the default "auto" stores fp8 on the flat
    # topology since; on this CPU storing and reading back 10M residuals in fp8 costs about 0.15 s per step)
    section = {"enabled": True, "density": density, "quantization": "int4", "group_size": 128,
               "error_feedback": error_feedback, "residual_dtype": "fp32", "min_numel": 2048,
               "stats_interval": 1000000}
    if weights:
        section["weights"] = {"quantization": weights, "group_size": 256}
    return section


RECOMMENDED_ADAM = {"enabled": True, "stats_interval": 1000000,
                    "decoupled_momentum": {"chunk": 64, "topk": 2, "quantization": "int2"}}  # configs/zero3_dgc_adam.json
# in both pools (with --nodes, node_level adds hpZ over the node and the two hops)
ZEROPP_LIKE = BenchConfig("zeropp_like", "ZeRO++-like: INT8 weights + dense INT4 gradients, no error feedback "
                          "(with --nodes: hpZ over the node, two hops)",
                          dict(_dgc(1.0, error_feedback=False, weights="int8")), node_level=True)
DGC_ADAM_FLAT = BenchConfig("dgc_adam_flat", "DGC, recommended Adam setting (decoupled momentum INT2) + INT4 weights, "
                            "flat", dict(RECOMMENDED_ADAM, weights={"quantization": "int4", "group_size": 256}))
CONFIGS = [
    BenchConfig("stock_fp32", "stock ZeRO-3, fp32 communication"),
    BenchConfig("stock_bf16", "stock ZeRO-3, communication_data_type bf16", ds_extra={"communication_data_type": "bf16"}),
    BenchConfig("int4_grads", "dense INT4 gradients, no error feedback (qgZ stand-in)", _dgc(1.0, error_feedback=False),
                grads_only=True),
    BenchConfig("int4_ef_wint4", "dense INT4 gradients + error feedback, INT4 weights", _dgc(1.0, weights="int4")),
    BenchConfig("dgc_d001", "DGC gradients (top-k 0.01, INT4)", _dgc(0.01), grads_only=True),
    BenchConfig("dgc_auto", "DGC gradients (top-k auto, INT4)", _dgc("auto"), grads_only=True),
    BenchConfig("dgc_d001_wint8", "DGC gradients (0.01) + INT8 weights", _dgc(0.01, weights="int8")),
    BenchConfig("dgc_d001_wfp8", "DGC gradients (0.01) + FP8 e4m3 weights", _dgc(0.01, weights="fp8_e4m3")),
    BenchConfig("dgc_d001_wint4", "DGC gradients (0.01) + INT4 weights", _dgc(0.01, weights="int4")),
    BenchConfig("dgc_d01_wint4", "DGC gradients (top-k 0.1, INT4) + INT4 weights", _dgc(0.1, weights="int4")),
    BenchConfig("ddp_powersgd", "PyTorch DDP + PowerSGD hook (rank 4, one bucket)", ddp=True),
    ZEROPP_LIKE,
    DGC_ADAM_FLAT,
    BenchConfig("policy_auto", "policy auto: per bucket and gather, stock or dense INT4 + EF / INT4 weights, measured",
                dict(_dgc(1.0, weights="int4"), policy="auto"), loss_per_rate=True),
]
# the configurations of --nodes (two nodes, each of L ranks, a rate-limited path between them)
NODE_CONFIGS = [
    BenchConfig("stock_fp32", "stock ZeRO-3, fp32 communication"),
    BenchConfig("stock_bf16", "stock ZeRO-3, communication_data_type bf16", ds_extra={"communication_data_type": "bf16"}),
    ZEROPP_LIKE,
    BenchConfig("dgc_int4_hier", "DGC, the default (dense INT4 + error feedback) + INT4 weights, hierarchical + hpZ",
                dict(_dgc(1.0, weights="int4"), residual_dtype="fp8"), node_level=True),
    DGC_ADAM_FLAT,
    BenchConfig("dgc_adam_hier", "DGC, recommended Adam setting (bf16 momentum) + INT4 weights, hierarchical + hpZ",
                dict(RECOMMENDED_ADAM, decoupled_momentum=dict(RECOMMENDED_ADAM["decoupled_momentum"], storage="bf16"),
                     weights={"quantization": "int4", "group_size": 256}), node_level=True),
]
BY_NAME = {c.name: c for c in CONFIGS + NODE_CONFIGS}
UNLIMITED = "unlimited"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", nargs="+", default=["100mbit", "1gbit"],
                        help="tc rates, e.g. 10mbit 100mbit 1gbit (the unlimited ceiling is always measured)")
    parser.add_argument("--nodes", metavar="2xL",
                        help="two nodes of L ranks each (benchmarks/two_nodes.py): only the path between the nodes is "
                        "rate-limited, one limit per direction; bytes are those that crossed it; configurations "
                        f"{', '.join(c.name for c in NODE_CONFIGS)} by default")
    parser.add_argument("--configs", nargs="+", default=None,
                        help=f"subset of: {', '.join(BY_NAME)} (stock_fp32 and stock_bf16 are always included)")
    parser.add_argument("--converge-steps", type=int, default=80, help="the fixed step of the loss comparison")
    parser.add_argument("--target-steps", "--target-step", dest="target_steps", type=int, nargs="+", metavar="STEP",
                        help="the target losses of the time to target: stock fp32's validation loss at each of these "
                        "evaluation steps; the first is the tables' (default: the last evaluation at or before half of "
                        "--converge-steps, or the first evaluation where none is)")
    parser.add_argument("--eval-interval", type=int, default=10)
    parser.add_argument("--eval-batches", type=int, default=4, help="validation batches per evaluation")
    parser.add_argument("--warmup-steps", type=int, default=3,
                        help="untimed steps at the start of a timing launch (>= 2: the first steps build caches)")
    parser.add_argument("--timed-steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2, help="rounds of timing launches per rate")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--seeds", type=int, default=None, metavar="N",
                        help="loss runs per configuration (and rate, where it has its own), at seeds --seed, "
                        "--seed + 1, ..., --seed + N - 1; the tables compare the means of their losses and time to "
                        "target on the mean curves (one run's loss at step 200 moved by about 1%% with the host's "
                        "numerics). Timing launches use --seed. With --reanalyse: the seeds to look for in DIR "
                        "(default: the run's); a configuration takes those of its runs that are there")
    parser.add_argument("--n-layer", type=int, default=6)
    parser.add_argument("--n-embd", type=int, default=384)
    parser.add_argument("--n-head", type=int, default=6)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--prefetch-bucket-size", type=int, default=PREFETCH_BUCKET_SIZE, metavar="ELEMENTS",
                        help="stage3_prefetch_bucket_size of every ZeRO-3 configuration, stock's too (DeepSpeed's "
                        "default, 5e7, gathers this whole model in one all-gather that the first layer waits for; "
                        "about a layer's worth lets the gathers overlap the forward); 0: DeepSpeed's default")
    parser.add_argument("--out-dir", type=Path, default=Path("runs/bench_network"))
    parser.add_argument("--json", type=Path, help="write all results here too")
    parser.add_argument("--launch-timeout-s", type=float, default=1800.0, help="kill a launch that runs longer")
    parser.add_argument("--converge-only", action="store_true",
                        help="train the convergence runs only (for a later --reuse-convergence, or for the loss at a "
                        "longer --converge-steps than the timing run's), print their losses, time nothing")
    parser.add_argument("--reanalyse", type=Path, metavar="DIR",
                        help="measure nothing: make the tables and plot again from the launches of an earlier run in "
                        "DIR (its results.json and converge_*.json), e.g. with other --target-steps; the run's steps, "
                        "rates and configurations are taken from it; outputs go to --out-dir")
    parser.add_argument("--reuse-convergence", type=Path, metavar="DIR",
                        help="take the convergence runs from DIR/converge_<configuration>.json (and "
                        "converge_<configuration>_seed<S>.json, --seeds) of an earlier run (same --converge-steps, model "
                        "and seeds) instead of training them again; runs it lacks are trained, runs of another seed or "
                        "length are refused (drop this option to train them all)")
    args = parser.parse_args(argv)
    args.ranks_per_node = None
    if args.nodes is not None:
        n, _, l = args.nodes.partition("x")
        if n != "2" or not l.isdigit() or int(l) < 1:
            parser.error(f"--nodes: {args.nodes!r} is not 2xL (two nodes of L ranks, e.g. 2x2)")
        args.ranks_per_node = int(l)
    pool = NODE_CONFIGS if args.nodes else CONFIGS
    if args.configs is None:
        args.configs = [c.name for c in pool]
    unknown = [name for name in args.configs if name not in {c.name for c in pool}]
    if unknown:
        parser.error(f"--configs: unknown {unknown}{' with --nodes' if args.nodes else ''}; choose from "
                     f"{[c.name for c in pool]}")
    # the stock baselines are always run (the loss reference only, with --converge-only)
    forced = {"stock_fp32"} if args.converge_only else {"stock_fp32", "stock_bf16"}
    args.configs = [c.name for c in pool if c.name in set(args.configs) | forced]
    for rate in args.rates:
        if parse_rate_bits(rate) is None:
            parser.error(f"--rates: {rate!r} is not a tc rate like 100mbit, 1gbit or 500kbit")
    seeds_given = args.seeds is not None
    args.seeds = args.seeds if seeds_given else 1
    for name in ("converge_steps", "eval_interval", "eval_batches", "timed_steps", "repeats", "micro_batch", "seeds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.converge_steps < args.eval_interval:
        parser.error(f"--converge-steps {args.converge_steps} is shorter than --eval-interval {args.eval_interval}: the "
                     "loss runs would evaluate only at their end, with no step of the target before it")
    if args.reuse_convergence is not None and not args.reuse_convergence.is_dir():
        parser.error(f"--reuse-convergence {args.reuse_convergence}: no such directory")
    if args.reanalyse is not None:
        ran = reanalysed_run(args.reanalyse)  # the run's own steps, rates and configurations
        for key in ("converge_steps", "eval_interval", "timed_steps", "warmup_steps", "repeats", "micro_batch",
                    "block_size", "n_layer", "n_embd", "n_head", "rates", "configs", "seed"):
            setattr(args, key, ran["args"][key])
        if not seeds_given:
            args.seeds = ran["args"].get("seeds", 1)  # runs of before --seeds had one
    if args.target_steps is None:
        args.target_steps = [max(args.eval_interval,
                                 args.converge_steps // 2 // args.eval_interval * args.eval_interval)]
    args.target_steps = list(dict.fromkeys(args.target_steps))
    for step in args.target_steps:
        if step % args.eval_interval or not args.eval_interval <= step <= args.converge_steps:
            parser.error(f"--target-step {step}: not an evaluation step (a multiple of --eval-interval "
                         f"{args.eval_interval}, at most --converge-steps {args.converge_steps})")
    args.target_step = args.target_steps[0]
    if args.warmup_steps < 2:
        parser.error("--warmup-steps must be >= 2 (the first steps build caches; PowerSGD compresses from step 3)")
    return args


def parse_rate_bits(rate: str) -> float | None:
    """Bits per second of a tc rate string (``100mbit``, ``1gbit``, ``500kbit``, ``10mbit``); None if not one."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    for unit, scale in units.items():
        if rate.lower().endswith(unit):
            try:
                value = float(rate[:-len(unit)])
            except ValueError:
                return None
            return value * scale if 0 < value < float("inf") else None
    return None


class Namespace:
    """A private network namespace with its loopback up; ``set_rate`` puts a tbf qdisc on it.

    Use as a context manager: the namespace is deleted on exit, also after an exception, Ctrl-C or
    SIGTERM (turned into SystemExit while it exists).
    """

    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        subprocess.run(["ip", "netns", "add", self.name], check=True)
        self._old_term = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        try:
            subprocess.run(["ip", "-n", self.name, "link", "set", "lo", "up"], check=True)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc):
        subprocess.run(["ip", "netns", "del", self.name], check=False)
        signal.signal(signal.SIGTERM, self._old_term)
        return False

    def set_rate(self, rate: str | None) -> None:
        """Limit the loopback to ``rate`` (tc syntax), or remove the limit when None."""
        subprocess.run(["tc", "-n", self.name, "qdisc", "del", "dev", "lo", "root"], check=False,
                       stderr=subprocess.DEVNULL)
        if rate is not None:
            subprocess.run(["tc", "-n", self.name, "qdisc", "add", "dev", "lo", "root", "tbf", "rate", rate,
                            "burst", "128kb", "latency", "100ms"], check=True)

    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]


def check_privileges() -> str | None:
    """Why the benchmark cannot create a rate-limited namespace here, or None if it can."""
    if os.geteuid() != 0:
        return "needs root (it creates a network namespace and a tc qdisc)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"needs {' and '.join(missing)} (iproute2) on PATH"
    return None


def ds_config_for(config: BenchConfig, micro_batch: int, ranks_per_node: int | None = None,
                  prefetch_bucket_size: int = PREFETCH_BUCKET_SIZE) -> dict:
    """The ds_config of a ZeRO-3 configuration: configs/zero3_p0_baseline.json (persistence threshold 0)
    with this micro-batch and ``stage3_prefetch_bucket_size`` (elements; 0: DeepSpeed's default), plus the
    configuration's keys; a ``node_level`` one with ``ranks_per_node`` also gets the hierarchical topology and hpZ
    over the node."""
    ds = json.loads(BASE_CONFIG.read_text())
    ds["train_micro_batch_size_per_gpu"] = micro_batch
    if prefetch_bucket_size:
        ds["zero_optimization"]["stage3_prefetch_bucket_size"] = prefetch_bucket_size
    ds.update(copy.deepcopy(config.ds_extra))
    if config.dgc is not None:
        ds["dgc"] = copy.deepcopy(config.dgc)
    if config.node_level and ranks_per_node:
        ds["dgc"].update(topology="hierarchical", ranks_per_node=ranks_per_node)
        ds["zero_optimization"]["zero_hpz_partition_size"] = ranks_per_node
    return ds


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
        cmd = launcher + [str(DDP_SCRIPT), "--micro-batch", str(args.micro_batch)] + model_args + common
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
    import two_nodes
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
    import two_nodes
    return two_nodes.NODE_ADDRESSES[node]


def reanalysed_run(run_dir: Path) -> dict:
    """The meta of the earlier run in ``run_dir`` (``--reanalyse``); SystemExit when there is none."""
    path = run_dir / "results.json"
    if not path.is_file():
        raise SystemExit(f"bench_network.py: --reanalyse {run_dir}: no results.json there (a finished run's --out-dir)")
    return json.loads(path.read_text())["meta"]


def converge_tag(config: BenchConfig, rate: str | None = None, extra_seed: int | None = None) -> str:
    """The launch tag of a convergence run: ``converge_<name>`` on the unlimited link, ``converge_<rate>_<name>`` for
    a ``loss_per_rate`` configuration at a rate; ``_seed<S>`` after it for the runs at a seed other than --seed."""
    tag = f"converge_{config.name}" if rate is None else f"converge_{rate}_{config.name}"
    return tag if extra_seed is None else f"{tag}_seed{extra_seed}"


def loss_seeds(args: argparse.Namespace) -> list[tuple[int, int | None]]:
    """(seed, extra_seed for converge_tag) of each loss run of a configuration: --seed, then --seeds - 1 more."""
    return [(args.seed + i, None if i == 0 else args.seed + i) for i in range(args.seeds)]


def reused(args: argparse.Namespace, config: BenchConfig, rate: str | None = None,
           extra_seed: int | None = None) -> dict | None:
    """The convergence summary of ``config`` (at ``rate``, at ``extra_seed`` or else --seed) from
    ``--reuse-convergence`` (None when that run has none: it is then trained); SystemExit if it was made with other
    steps or seed (the model size is the caller's to keep the same)."""
    tag = converge_tag(config, rate, extra_seed)
    seed = args.seed if extra_seed is None else extra_seed
    path = args.reuse_convergence / f"{tag}.json"
    if not path.is_file():
        print(f"  {tag}: not in {args.reuse_convergence}, training it", flush=True)
        return None
    s = json.loads(path.read_text())
    if s.get("steps") != args.converge_steps or s.get("seed") != seed:
        raise SystemExit(f"bench_network.py: {path} has steps {s.get('steps')} and seed {s.get('seed')}, this run "
                         f"{args.converge_steps} and {seed}")
    print(f"  {tag}: reusing {path}", flush=True)
    return s


def mean_over_seeds(runs: list[dict]) -> dict:
    """One configuration's loss runs at several seeds as one summary: the first run's, with the validation curve,
    ``final_val_loss`` and ``holdout_val_loss`` (None unless every run has one) replaced by their means over the runs
    and ``seeds`` listing each run's seed and losses. One run is returned as it is. SystemExit when the runs did not
    evaluate at the same steps."""
    if len(runs) == 1:
        return runs[0]
    steps = [st for st, _ in runs[0]["val_losses"]]
    if any([st for st, _ in r["val_losses"]] != steps for r in runs):
        raise SystemExit(f"bench_network.py: the loss runs at seeds {[r.get('seed') for r in runs]} did not evaluate at "
                         "the same steps")
    holdouts = [r.get("holdout_val_loss") for r in runs]
    return dict(runs[0],
                val_losses=[[st, statistics.fmean(r["val_losses"][i][1] for r in runs)] for i, st in enumerate(steps)],
                final_val_loss=statistics.fmean(r["final_val_loss"] for r in runs),
                holdout_val_loss=None if None in holdouts else statistics.fmean(holdouts),
                seeds=[{"seed": r.get("seed"), "final_val_loss": r["final_val_loss"],
                        "holdout_val_loss": r.get("holdout_val_loss")} for r in runs])


def timed(summary: dict, warmup_steps: int) -> tuple[float, float]:
    """(median step time s, median bytes on the wire per step) over the steps after the warm-up."""
    times = summary["step_times_s"][warmup_steps:]
    net = summary["step_net_tx_bytes"][warmup_steps:]
    return statistics.median(times), statistics.median(net)


def final_losses(summaries: list[dict]) -> tuple[str, list[float]]:
    """The loss each loss run ended with, compared across configurations: the whole validation split's
    (``holdout_val_loss``) where every run has one, else the last periodic evaluation's (runs of before it, or
    reused ones without it: one kind for all, never mixed). Returns (the key used, the losses in order)."""
    key = "holdout_val_loss" if all(s.get("holdout_val_loss") is not None for s in summaries) else "final_val_loss"
    return key, [s[key] for s in summaries]


def steps_to_loss(val_losses: list[list[float]], target: float) -> int | None:
    """The first evaluation step with validation loss <= ``target``; None if none reaches it."""
    return next((step for step, loss in val_losses if loss <= target), None)


def loss_at(val_losses: list[list[float]], step: int) -> float:
    """The validation loss evaluated at ``step``; SystemExit if that run did not evaluate there."""
    for at, loss in val_losses:
        if at == step:
            return loss
    raise SystemExit(f"bench_network.py: no evaluation at step {step} (evaluated at {[s for s, _ in val_losses]})")


def analyse(args: argparse.Namespace, convergence: dict, timing: dict, per_rate: dict | None = None) -> dict:
    """Reduce the launches to per-rate, per-configuration results (see the module docstring).

    ``convergence``: name -> summary of its run on the unlimited link; ``per_rate``: rate -> name -> summary of the
    ``loss_per_rate`` configurations' runs at that rate (their loss there; the unlimited run stands for the unlimited
    link); ``timing``: rate -> rounds -> name -> (step s, wire bytes per step).
    """
    per_rate = per_rate or {}
    loss_runs = [convergence[n] for n in args.configs] + [s for runs in per_rate.values() for s in runs.values()]
    loss_key, _ = final_losses(loss_runs)
    stock_loss = convergence["stock_fp32"][loss_key]
    targets = [{"step": st, "loss": loss_at(convergence["stock_fp32"]["val_losses"], st), "of": "stock_fp32"}
               for st in args.target_steps]
    results = {"rates": {}, "configs": {}, "target": targets[0], "targets": targets, "loss_key": loss_key,
               "holdout_tokens": convergence["stock_fp32"].get("holdout_tokens") if loss_key == "holdout_val_loss" else None}
    for name in args.configs:
        c = convergence[name]
        steps = c["steps"]
        grad = c.get("grad_wire_bytes_total")
        param = c.get("param_wire_bytes_total")
        measured_dgc = c.get("dgc_stats") is not None
        results["configs"][name] = {
            "label": BY_NAME[name].label,
            "val_loss": c[loss_key],
            "val_gap_pct": 100.0 * (c[loss_key] - stock_loss) / stock_loss,
            "val_loss_last_evaluation": c["final_val_loss"],  # the periodic evaluation's --eval-batches
            "seeds": c.get("seeds"),  # each seed's losses, where the run had several (mean_over_seeds)
            "val_losses": c["val_losses"],
            # rank 0's bytes sent through the extension per step (gradients, parameters); None where not counted
            "grad_bytes_per_step": grad / steps if measured_dgc else None,
            "param_bytes_per_step": param / steps if measured_dgc and param else None,
            "grad_compression_ratio": c.get("compression_ratio") if measured_dgc else None,
        }
    for rate, rounds in timing.items():
        per = {}
        rate_bits = parse_rate_bits(rate) if rate != UNLIMITED else None
        for name in args.configs:
            runs = [r[name] for r in rounds]
            step_s = statistics.median(t for t, _ in runs)
            net = statistics.median(b for _, b in runs)
            vs_fp32 = statistics.median(r["stock_fp32"][0] / r[name][0] for r in rounds)
            vs_bf16 = statistics.median(r["stock_bf16"][0] / r[name][0] for r in rounds)
            own = per_rate.get(rate, {}).get(name)  # a loss_per_rate configuration's own run at this rate
            val_losses = own["val_losses"] if own else results["configs"][name]["val_losses"]
            val_loss = own[loss_key] if own else results["configs"][name]["val_loss"]
            reached = [steps_to_loss(val_losses, t["loss"]) for t in targets]
            per[name] = {"step_s": step_s, "net_bytes_per_step": net, "speedup_vs_fp32": vs_fp32,
                         "speedup_vs_bf16": vs_bf16,
                         "val_losses": val_losses, "val_loss": val_loss,
                         "val_gap_pct": 100.0 * (val_loss - stock_loss) / stock_loss,
                         "loss_run": "this rate" if own else UNLIMITED,
                         "seeds": own.get("seeds") if own else None,
                         "targets": [{"step": t["step"], "steps_to_target": n,
                                      "time_to_target_s": None if n is None else n * step_s} for t, n in zip(targets, reached)],
                         # the share of the link's capacity the step used: wire bytes / (rate x step time)
                         "link_utilisation": None if rate_bits is None else net / (rate_bits / 8 * step_s),
                         "step_s_rounds": [r[name][0] for r in rounds]}
            if own and own.get("dgc_stats"):
                per[name]["stock_buckets_total"] = own["dgc_stats"].get("stock_buckets_total")
                per[name]["grad_bytes_per_step"] = (own.get("grad_wire_bytes_total") or 0) / own["steps"]
                param = own.get("param_wire_bytes_total")
                per[name]["param_bytes_per_step"] = param / own["steps"] if param else None
        for name in args.configs:
            # None where nothing was counted (--nodes without a limit: no shaping class to count in)
            own = per[name]["net_bytes_per_step"]
            per[name]["wire_vs_stock_fp32"] = per["stock_fp32"]["net_bytes_per_step"] / own if own else None
            for mine, stock in zip(per[name]["targets"], per["stock_fp32"]["targets"]):
                a, b = mine["time_to_target_s"], stock["time_to_target_s"]
                mine["time_to_target_vs_fp32"] = None if a is None or b is None else a / b
            first = per[name]["targets"][0]  # the tables' target
            per[name].update({k: first[k] for k in ("steps_to_target", "time_to_target_s", "time_to_target_vs_fp32")})
        results["rates"][rate] = per
    return results


def seconds(t: float) -> str:
    """Seconds as the tables show them: whole from 100 s, one decimal below."""
    return f"{t:.0f}" if t >= 100 else f"{t:.1f}"


def seed_table(args: argparse.Namespace, results: dict) -> list[str]:
    """Markdown lines of each loss run's loss at every seed, their mean and its gap to stock fp32's mean (none with
    one seed)."""
    if args.seeds < 2:
        return []
    key = results.get("loss_key", "final_val_loss")
    stock = results["configs"]["stock_fp32"]["val_loss"]
    rows = [(name, c["seeds"]) for name, c in results["configs"].items()]
    rows += [(f"{name} ({rate}, its own run)", r["seeds"]) for rate, per in results["rates"].items()
             for name, r in per.items() if r.get("seeds")]
    lines = [f"Loss of each run ({'the whole validation split' if key == 'holdout_val_loss' else 'last evaluation'}) "
             "at every seed, the mean the tables use, and the runs' spread:", "",
             "| configuration | " + " | ".join(f"seed {args.seed + i}" for i in range(args.seeds))
             + " | mean | gap of the mean | max - min |", "|---|" + "---:|" * (args.seeds + 3)]
    for name, seeds in rows:
        by_seed = {s["seed"]: s[key] for s in seeds or []}  # None: one run (the others' seeds not in a reanalysed DIR)
        if not by_seed:
            own = results["configs"].get(name)
            by_seed = {args.seed: own["val_loss"]} if own else {}
        losses = list(by_seed.values())
        mean = statistics.fmean(losses)
        lines.append(f"| {name} | " + " | ".join(f"{by_seed[args.seed + i]:.4f}" if args.seed + i in by_seed else "—"
                                                 for i in range(args.seeds))
                     + f" | {mean:.4f} | {100 * (mean - stock) / stock:+.2f}% | "
                     + (f"{max(losses) - min(losses):.4f} |" if len(losses) > 1 else "— (one run) |"))
    return lines + [""]


def markdown(args: argparse.Namespace, results: dict, meta: dict) -> str:
    """The result tables (one per rate) and the gradient-only bound, as Markdown: command, machine and date once at
    the top."""
    where = (f"{2 * args.ranks_per_node} ranks as 2 nodes of {args.ranks_per_node} (benchmarks/two_nodes.py: only the "
             "path between the nodes is rate-limited, each direction at the rate; wire bytes are those that crossed "
             "it)" if args.nodes else "2 ranks")
    lines = ([f"Command: `{meta['command']}`", ""] if meta.get("command") else []) + (
        [f"Tables made again from its launches: `{meta['reanalysed']}`", ""] if meta.get("reanalysed") else []) + [f"{meta['date']}, {meta['machine']}; {meta['n_params']:,} parameters, {where}, "
             f"{args.micro_batch} x {args.block_size} tokens per rank per step, validation loss at step "
             f"{args.converge_steps} " + (f"over the whole validation split ({results['holdout_tokens']:,} tokens)"
                                           if results.get("loss_key") == "holdout_val_loss" else
                                           f"over {args.eval_batches} validation batches")
             + (f", the mean of each configuration's runs at seeds {args.seed}-{args.seed + args.seeds - 1} "
                "(validation curves too; every run's loss in the table after the time to target)" if args.seeds > 1
                else "")
             + f" (stock fp32: {results['configs']['stock_fp32']['val_loss']:.4f}); "
             f"step times: median of {args.timed_steps} steps after {args.warmup_steps}, median of "
             f"{args.repeats} interleaved rounds. Target: stock fp32's validation loss at step "
             f"{results['target']['step']}, {results['target']['loss']:.4f}; time to target = the first evaluation "
             f"(every {args.eval_interval} steps) at or below it x the median step time at that rate (evaluation "
             "not counted). Link use = wire bytes per step / (rate x step time). Losses are from "
             + ("one run" if args.seeds == 1 else f"{args.seeds} runs (seeds)") + " on the "
             "unlimited link, except where marked (*: that configuration's own run at that rate: what it sends "
             "depends on the link).", ""]
    for rate, per in results["rates"].items():
        shared = " between the nodes, each direction" if args.nodes else " (shared by both ranks)"
        wire = "MB/step between the nodes" if args.nodes else "wire MB/step (all ranks)"
        lines += [f"**{rate}**" + (" (no rate limit)" if rate == UNLIMITED else shared), "",
                  f"| configuration | step s | speed-up vs fp32 | vs bf16 | {wire} | wire vs fp32 | link use "
                  "| grad / param KB per step (rank 0) | val loss | gap | steps to target | time to target s "
                  "| vs stock fp32's |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for name, r in per.items():
            c = dict(results["configs"][name])
            c.update({k: r[k] for k in ("grad_bytes_per_step", "param_bytes_per_step") if k in r})  # its own run's
            split = "—" if c["grad_bytes_per_step"] is None else (
                f"{c['grad_bytes_per_step'] / 1e3:,.0f} / "
                + ("stock" if c["param_bytes_per_step"] is None else f"{c['param_bytes_per_step'] / 1e3:,.0f}"))
            mark = "*" if r["loss_run"] != UNLIMITED else ""
            if r["time_to_target_s"] is None:
                reach = f"not reached in {args.converge_steps} | — | —"
            else:
                vs = r["time_to_target_vs_fp32"]
                reach = f"{r['steps_to_target']} | {seconds(r['time_to_target_s'])} | "
                reach += "—" if vs is None else f"{vs:.2f}x"
            use = "—" if r["link_utilisation"] is None else f"{100 * r['link_utilisation']:.0f}%"
            lines.append(f"| {c['label']} | {r['step_s']:.2f} | {r['speedup_vs_fp32']:.2f}x | {r['speedup_vs_bf16']:.2f}x "
                         f"| {r['net_bytes_per_step'] / 1e6:.2f} | "
                         + ("—" if r["wire_vs_stock_fp32"] is None else f"{r['wire_vs_stock_fp32']:.1f}x")
                         + f" | {use} | {split} "
                         f"| {r['val_loss']:.4f}{mark} | {r['val_gap_pct']:+.2f}% | {reach} |")
        lines.append("")
    lines += ["Time to target, s (and against stock fp32's at the same rate): the first evaluation at or below stock "
              "fp32's loss at each target step x the median step time" + (" (* its own loss run at that rate)"
                                                                          if any(r["loss_run"] != UNLIMITED for per in
                                                                                 results["rates"].values()
                                                                                 for r in per.values()) else "")
              + ":", "",
              "| configuration | " + " | ".join(f"step {t['step']} ({t['loss']:.4f}), {rate}" for t in results["targets"]
                                                for rate in results["rates"]) + " |",
              "|---|" + "---:|" * (len(results["targets"]) * len(results["rates"]))]
    for name, c in results["configs"].items():
        cells = []
        for i in range(len(results["targets"])):
            for rate, per in results["rates"].items():
                t = per[name]["targets"][i]
                mark = "*" if per[name]["loss_run"] != UNLIMITED else ""
                if t["time_to_target_s"] is None:
                    cells.append(f"not reached in {args.converge_steps} steps{mark}")
                else:
                    vs = t["time_to_target_vs_fp32"]
                    cells.append(f"{seconds(t['time_to_target_s'])}{mark} (step {t['steps_to_target']}"
                                 + ("" if vs is None else f", {vs:.2f}x") + ")")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("")
    lines += seed_table(args, results)
    rates = [r for r in results["rates"] if r != UNLIMITED]
    if UNLIMITED in results["rates"]:
        ceiling = results["rates"][UNLIMITED]
        lines += ["Each rate's step time over the unlimited link's (the ceiling of what compression can win back):", "",
                  "| configuration | unlimited step s | " + " | ".join(f"{r} / unlimited" for r in rates) + " |",
                  "|---|---:|" + "---:|" * len(rates)]
        for name, c in results["configs"].items():
            ratios = " | ".join(f"{results['rates'][r][name]['step_s'] / ceiling[name]['step_s']:.2f}x" for r in rates)
            lines.append(f"| {c['label']} | {ceiling[name]['step_s']:.2f} | {ratios} |")
        lines.append("")
    for rate, per in results["rates"].items():
        grads_only = [n for n in per if BY_NAME[n].grads_only and "dgc" in n and rate != UNLIMITED]
        for name in grads_only:
            # gradient-only compression can remove at most the traffic that is not the weights' all-gather:
            # its bound is stock's bytes over the bytes left when the gradients cost (almost) nothing
            bound = per["stock_fp32"]["net_bytes_per_step"] / per[name]["net_bytes_per_step"]
            lines.append(f"- {rate}: gradient-only {BY_NAME[name].label}: {per[name]['speedup_vs_fp32']:.2f}x faster "
                         f"than stock fp32; it leaves the weights' all-gather as stock, so its bound is stock's bytes "
                         f"over its own, {bound:.2f}x.")
    return "\n".join(lines) + "\n"


def plot(args: argparse.Namespace, results: dict, path: Path) -> None:
    """One panel per rate: validation loss against modelled wall-clock time (evaluation step x median step time at
    that rate), the target as a dashed line. Last panel: median step time per configuration and rate (log scale)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rates = list(results["rates"])
    panels = len(rates) + 1
    cols = min(panels, 2)
    rows = -(-panels // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(7.5 * cols, 5.2 * rows), squeeze=False)
    axes = axes.ravel()
    for ax, rate in zip(axes, rates):
        for name, r in results["rates"][rate].items():
            steps, losses = zip(*r["val_losses"])
            ax.plot([st * r["step_s"] for st in steps], losses, marker=".", markersize=3,
                    label=name + (" (own run at this rate)" if r["loss_run"] != UNLIMITED else ""))
        for t in results["targets"]:
            ax.axhline(t["loss"], color="grey", linestyle="--", linewidth=0.8,
                       label=f"target: stock fp32 at step {t['step']}")
        ax.set_xlabel("modelled wall-clock (s) = step x median step time at this rate")
        ax.set_ylabel("validation loss")
        ax.set_title(f"validation loss against time, {rate}" + (" (no rate limit)" if rate == UNLIMITED else ""))
        ax.set_ylim(top=max(t["loss"] for t in results["targets"]) * 1.2)  # the early losses (4 and more) hide the rest
        ax.legend(fontsize=7)
    ax = axes[len(rates)]
    names = list(results["configs"])
    width = 0.8 / len(rates)
    for i, rate in enumerate(rates):
        values = [results["rates"][rate][n]["step_s"] for n in names]
        ax.bar([j + i * width for j in range(len(names))], values, width, label=rate)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names, rotation=35, ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("median step time (s)")
    ax.set_title("step time per configuration and link rate")
    ax.legend()
    for extra in axes[panels:]:
        extra.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


SIMD_NAMES = {"avx512f": "AVX-512", "avx2": "AVX2", "avx": "AVX", "sse4_2": "SSE4.2"}  # /proc/cpuinfo flag, widest first


def cpu_description(cpuinfo: str | None = None) -> str:
    """The CPU as /proc/cpuinfo names it, with its family and model numbers, clock and widest vector extension
    (hosts that all call themselves "AMD EPYC" differ 2x in this benchmark's step time)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return "unknown CPU"
    fields = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in fields:
            fields[key.strip()] = value.strip()
    if "model name" not in fields:
        return "unknown CPU"
    flags = set(fields.get("flags", "").split())
    simd = next((name for flag, name in SIMD_NAMES.items() if flag in flags), "no AVX")
    details = [f"family {fields['cpu family']} model {fields['model']}" if "cpu family" in fields and "model" in fields
               else None, f"{float(fields['cpu MHz']):.0f} MHz" if "cpu MHz" in fields else None, simd]
    return f"{fields['model name']} ({', '.join(d for d in details if d)})"


def matmul_gflops(n: int = 1024, repeats: int = 5) -> float:
    """One thread's fp32 matrix-product rate, GFLOP/s (the median of ``repeats`` n x n products): what the step
    times' compute part scales with."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return 2 * n**3 / statistics.median(times) / 1e9


def machine() -> str:
    return (f"{os.cpu_count()} cores ({cpu_description()}; one core's fp32 matmul {matmul_gflops():.0f} GFLOP/s), "
            "no GPU use (gloo over the namespace loopback)")


def write_outputs(args: argparse.Namespace, convergence: dict, timing: dict, per_rate: dict, meta: dict) -> None:
    """Analyse the launches; write ``results.md``, ``bench_network.png`` and ``results.json`` under ``--out-dir`` (and
    ``--json``), and print the tables."""
    results = analyse(args, convergence, timing, per_rate)
    table = markdown(args, results, meta)
    (args.out_dir / "results.md").write_text(table)
    plot(args, results, args.out_dir / "bench_network.png")
    payload = {"meta": meta, "results": results, "timing_rounds": timing}
    for path in filter(None, [args.out_dir / "results.json", args.json]):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(payload, indent=2) + "\n")
    print("\n" + table, end="")
    print(f"wrote {args.out_dir / 'results.md'}, {args.out_dir / 'bench_network.png'}"
          + (f", {args.json}" if args.json else ""), flush=True)


def reanalyse(args: argparse.Namespace, argv) -> int:
    """``--reanalyse DIR``: the tables and plot of the launches in DIR again, with this command's targets."""
    payload = json.loads((args.reanalyse / "results.json").read_text())
    reused_dir = payload["meta"]["args"].get("reuse_convergence")  # where a --reuse-convergence run's loss runs are
    dirs = [args.reanalyse] + ([Path(reused_dir)] if reused_dir else [])

    def find(tag: str) -> Path:
        """DIR/tag.json, else the reused run's (a --reuse-convergence run leaves its loss runs there)."""
        return next((d / f"{tag}.json" for d in dirs if (d / f"{tag}.json").is_file()), args.reanalyse / f"{tag}.json")

    def load(name: str, rate: str | None = None) -> dict:
        """The configuration's runs at --seed (required) and at those of the other seeds that are in DIR."""
        paths = [find(converge_tag(BY_NAME[name], rate, extra)) for _, extra in loss_seeds(args)]
        if not paths[0].is_file():
            raise SystemExit(f"bench_network.py: --reanalyse {args.reanalyse}: no loss run {paths[0].name} in "
                             f"{' or '.join(str(d) for d in dirs)}")
        missing = [p.name for p in paths[1:] if not p.is_file()]
        if missing:
            print(f"  {name}{'' if rate is None else ' at ' + rate}: no {', '.join(missing)}; the mean of "
                  f"{len(paths) - len(missing)} run(s)", flush=True)
        return mean_over_seeds([json.loads(p.read_text()) for p in paths if p == paths[0] or p.is_file()])

    convergence = {name: load(name) for name in args.configs}
    per_rate = {rate: {name: load(name, rate) for name in args.configs if BY_NAME[name].loss_per_rate}
                for rate in args.rates}
    timing = {rate: [{name: tuple(v) for name, v in rnd.items()} for rnd in rounds]
              for rate, rounds in payload["timing_rounds"].items()}
    meta = dict(payload["meta"], reanalysed=" ".join(["python", "benchmarks/bench_network.py"]
                                                     + list(argv if argv is not None else sys.argv[1:])))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_outputs(args, convergence, timing, per_rate, meta)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.reanalyse is not None:
        return reanalyse(args, argv)
    problem = check_privileges()
    if problem:
        print(f"bench_network.py: {problem}; cannot make a rate-limited link, nothing measured", file=sys.stderr)
        return 2
    args.out_dir.mkdir(parents=True, exist_ok=True)
    configs = [BY_NAME[n] for n in args.configs]
    print(f"configurations: {', '.join(args.configs)}", flush=True)
    started = time.time()
    if args.nodes:
        import two_nodes
        link = two_nodes.TwoNodeLink(None)
    else:
        link = Namespace(f"dgcbench{os.getpid()}")
    with link as ns:
        ns.set_rate(None)
        print(f"convergence: {args.converge_steps} steps each, unlimited link", flush=True)
        def loss_run(c: BenchConfig, rate: str | None = None) -> dict:
            return mean_over_seeds([(args.reuse_convergence and reused(args, c, rate, extra))
                                    or launch(ns, c, args, args.converge_steps, args.eval_interval, args.eval_batches,
                                              converge_tag(c, rate, extra), holdout=True, seed=seed)
                                    for seed, extra in loss_seeds(args)])

        convergence = {c.name: loss_run(c) for c in configs}
        per_rate = {}  # the loss_per_rate configurations trained again at every rate
        again = [c for c in configs if c.loss_per_rate]
        for rate in [] if args.converge_only else args.rates:
            if again:
                print(f"convergence at {rate}: {', '.join(c.name for c in again)}", flush=True)
                ns.set_rate(rate)
                per_rate[rate] = {c.name: loss_run(c, rate) for c in again}
        timing = {}
        if args.converge_only:
            key, losses = final_losses(list(convergence.values()))
            stock = convergence["stock_fp32"][key]
            for (name, c), loss in zip(convergence.items(), losses):
                print(f"  {name}: validation loss {loss:.4f} after {c['steps']} steps "
                      f"({100 * (loss - stock) / stock:+.2f}% against stock fp32)", flush=True)
            return 0
        for rate in args.rates + [UNLIMITED]:
            ns.set_rate(None if rate == UNLIMITED else rate)
            timing[rate] = []
            for round_index in range(args.repeats):
                shift = round_index % len(configs)
                order = configs[shift:] + configs[:shift]  # rotated so that no configuration always runs first
                print(f"timing at {rate}, round {round_index + 1}/{args.repeats}", flush=True)
                timing[rate].append({c.name: timed(launch(ns, c, args, args.warmup_steps + args.timed_steps,
                                                         args.warmup_steps + args.timed_steps, 1,
                                                         f"time_{rate}_r{round_index}_{c.name}"), args.warmup_steps)
                                     for c in order})
    meta = {"date": time.strftime("%Y-%m-%d", time.gmtime(started)), "machine": machine(),
            "n_params": convergence["stock_fp32"]["n_params"], "elapsed_s": time.time() - started,
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "command": " ".join(["python", "benchmarks/bench_network.py"] + list(argv if argv is not None else sys.argv[1:]))}
    write_outputs(args, convergence, timing, per_rate, meta)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except RuntimeError as exc:
        sys.exit(f"bench_network.py: {exc}")
