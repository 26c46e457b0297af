"""End-to-end speed of compressed ZeRO-3 on a real, rate-limited link, against stock and PowerSGD.

Run from the repository root as root (``make bench``)::

    python -m benchmarks.bench_network --rates 100mbit 1gbit --json runs/bench_network/results.json

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
import json
import os
import sys
import time
from pathlib import Path

from benchmarks import two_nodes
from benchmarks.configs import BY_NAME, CONFIGS, NODE_CONFIGS, PREFETCH_BUCKET_SIZE, BenchConfig
from benchmarks.launcher import launch
from benchmarks.netlink import UNLIMITED, Namespace, check_privileges, parse_rate_bits
from benchmarks.report import machine, write_outputs
from benchmarks.stats import final_losses, mean_over_seeds, timed


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
    meta = dict(payload["meta"], reanalysed=" ".join(["python", "-m", "benchmarks.bench_network"]
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
            "command": " ".join(["python", "-m", "benchmarks.bench_network"] + list(argv if argv is not None else sys.argv[1:]))}
    write_outputs(args, convergence, timing, per_rate, meta)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except RuntimeError as exc:
        sys.exit(f"bench_network.py: {exc}")
