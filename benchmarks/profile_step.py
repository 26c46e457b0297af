"""Where one training step's time goes: cProfile of one step of the network benchmark's model, per configuration.

Run from the repository root (``make profile``)::

    python -m benchmarks.profile_step --configs stock_fp32 int4_ef_wint4 dgc_adam_flat

Each configuration (a name of the network benchmark's ``benchmarks/configs.py``: the same ds_config, model and
micro-batch) runs ``--steps`` steps with ``deepspeed --num_gpus 2`` on the plain loopback (no rate limit); step
``--profile-step`` runs under cProfile on every rank (``examples/train_char_gpt.py --profile-step``). What is
reported, rank 0:

- the median step time of the unprofiled steps after the first three (cProfile slows the profiled one);
- the profiled step split by where DeepSpeed calls into it: the gradient reduce-scatter (stock's
  ``__avg_scatter_grads`` or the extension's), inside it the extension's codec (encode / decode) and the time spent
  waiting on exchanges; the weight all-gather (its launch, and the waits on it); the optimizer step; and the rest
  (forward and backward compute);
- the interpreter's own time in ``deepspeed_dgc`` functions and their call count (the per-bucket Python overhead:
  a tensor operator written as ``@`` or ``>>`` counts in the caller's own time, so this is an upper bound);
- the functions with the most own time.

Outputs: ``--out-dir``/``<config>.rank<R>.prof`` and ``.txt`` (pstats), ``--out-dir``/``profile.json`` and
``profile.md`` (the table), and with ``--results DIR`` the table as ``DIR/profile.md`` too.
"""

import argparse
import json
import os
import pstats
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.configs import BY_NAME, CONFIGS, ds_config_for  # the network benchmark's configurations
from benchmarks.launcher import TRAIN_SCRIPT
from benchmarks.report import machine

ROOT = Path(__file__).resolve().parent.parent

# (label, where: (file name suffix, function name)): the largest cumulative time of the matches (alternatives, or one
# calling the other), rank 0
SECTIONS = [
    ("gradient reduce-scatter", [("stage3.py", "__avg_scatter_grads"), ("patches.py", "avg_scatter_grads")]),
    ("  of which codec: encode", [("kernels.py", "compress"), ("reference.py", "compress"), ("dct.py", "encode"),
                                  ("masked.py", "encode")]),
    ("  of which codec: decode and sum", [("wire.py", "decode_sum"), ("dct.py", "decode_sum"),
                                          ("masked.py", "decode_sum")]),
    ("  of which waiting on the exchange", [("communicators.py", "_wait")]),
    ("weight all-gather: launch", [("partitioned_param_coordinator.py", "__all_gather_params")]),
    ("weight all-gather: wait", [("partition_parameters.py", "wait")]),
    ("optimizer step", [("stage3.py", "step")]),
]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["stock_fp32", "int4_ef_wint4", "dgc_adam_flat"],
                        help="configurations of benchmarks/configs.py")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--profile-step", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--out-dir", type=Path, default=Path("runs/profile"))
    parser.add_argument("--results", type=Path, help="write DIR/profile.md")
    parser.add_argument("--launch-timeout-s", type=float, default=900.0)
    args = parser.parse_args(argv)
    args.configs = list(dict.fromkeys(args.configs))  # each once
    for name in ("steps", "micro_batch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if not args.launch_timeout_s > 0:
        parser.error(f"--launch-timeout-s must be > 0, got {args.launch_timeout_s}")
    if args.steps < 6:
        parser.error(f"--steps {args.steps}: at least 6 (steps 1-3 build caches, then the profiled step and "
                     "unprofiled steps around it)")
    unknown = [c for c in args.configs if c not in BY_NAME or BY_NAME[c].ddp]
    if unknown:
        parser.error(f"--configs: unknown (or not ZeRO-3) {unknown}; choose from "
                     f"{[c.name for c in CONFIGS if not c.ddp]}")
    if not 5 <= args.profile_step <= args.steps - 1:
        parser.error(f"--profile-step {args.profile_step}: must be 5 to --steps - 1 ({args.steps - 1}): steps 1-3 "
                     "build caches, and the median needs unprofiled steps on both sides")
    return args


def run(name: str, args: argparse.Namespace) -> dict:
    """One launch of ``name``; returns its summary. RuntimeError when it fails."""
    config = BY_NAME[name]
    out = args.out_dir
    (out / "configs").mkdir(parents=True, exist_ok=True)
    config_path = out / "configs" / f"{name}.json"
    config_path.write_text(json.dumps(ds_config_for(config, args.micro_batch), indent=2) + "\n")
    summary_path = out / f"{name}.summary.json"
    summary_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_addr", "127.0.0.1",
           "--master_port", "29711", str(TRAIN_SCRIPT), "--deepspeed_config", str(config_path),
           "--n-layer", "6", "--n-embd", "384", "--n-head", "6", "--block-size", "128", "--max-steps", str(args.steps),
           "--eval-interval", str(args.steps + 1), "--eval-batches", "1", "--profile-step", str(args.profile_step),
           "--profile-out", str(out / name), "--summary-json", str(summary_path)]
    print(f"  {name}: {' '.join(cmd[3:])}", flush=True)
    with open(out / f"{name}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        try:
            code = proc.wait(timeout=args.launch_timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its ranks
            proc.wait()
            raise RuntimeError(f"{name} ran longer than {args.launch_timeout_s} s (log: {out / f'{name}.log'})") from None
    if code != 0 or not summary_path.is_file():
        raise RuntimeError(f"{name} failed with exit code {code} (log: {out / f'{name}.log'})")
    return json.loads(summary_path.read_text())


def breakdown(prof: Path) -> dict:
    """The sections, the package's own time and calls, and the top functions of one rank's profile."""
    stats = pstats.Stats(str(prof))
    total = stats.total_tt
    found = {}
    for label, keys in SECTIONS:
        found[label] = max((v[3] for (path, _, func), v in stats.stats.items()
                            if any(path.endswith(f) and func == fn for f, fn in keys)), default=0.0)
    rest = total - sum(t for label, t in found.items() if not label.startswith(" "))
    own = [(v[2], v[1], path, func) for (path, _, func), v in stats.stats.items() if "/deepspeed_dgc/" in path]
    top = sorted(((v[2], v[1], f"{Path(path).name}:{func}" if path != "~" else func)
                  for (path, _, func), v in stats.stats.items()), reverse=True)[:10]
    return {"profiled_step_s": total, "sections_s": found, "rest_s": rest,
            "package_own_s": sum(t for t, *_ in own), "package_calls": sum(n for _, n, *_ in own),
            "top_own": [{"function": f, "own_s": t, "calls": n} for t, n, f in top]}


def markdown(results: dict, meta: dict) -> str:
    names = list(results)
    lines = [f"Command: `{meta['command']}`", "",
             f"{meta['date']}, {meta['machine']}, commit {meta['commit']}; {meta['n_params']:,} parameters, 2 ranks, "
             f"the network benchmark's model and ds_configs, plain loopback (no rate limit); rank 0. Step time: median "
             f"of the unprofiled steps 4 to {meta['steps']}; the rest is step {meta['profile_step']} under cProfile "
             "(which slows it: compare shares, not totals).", "",
             "| | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names),
             "| step time s (unprofiled) | " + " | ".join(f"{results[n]['step_s']:.3f}" for n in names) + " |",
             "| profiled step s | " + " | ".join(f"{results[n]['profiled_step_s']:.3f}" for n in names) + " |"]
    for label, _ in SECTIONS:
        lines.append(f"| {label} | " + " | ".join(f"{results[n]['sections_s'][label]:.3f}" for n in names) + " |")
    lines += ["| forward, backward and the rest | " + " | ".join(f"{results[n]['rest_s']:.3f}" for n in names) + " |",
              "| deepspeed_dgc interpreter time (calls) | "
              + " | ".join(f"{results[n]['package_own_s']:.3f} ({results[n]['package_calls']:,})" for n in names)
              + " |", ""]
    for n in names:
        lines += [f"**{n}**: the 10 functions with the most own time (s, calls)", "",
                  ", ".join(f"`{t['function']}` {t['own_s']:.3f} ({t['calls']})" for t in results[n]["top_own"]), ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    results, n_params = {}, None
    for name in args.configs:
        summary = run(name, args)
        n_params = summary["n_params"]
        times = summary["step_times_s"]
        unprofiled = [t for i, t in enumerate(times, 1) if i > 3 and i != args.profile_step]
        results[name] = dict(breakdown(args.out_dir / f"{name}.rank0.prof"), step_s=statistics.median(unprofiled),
                             step_times_s=times)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    meta = {"date": time.strftime("%Y-%m-%d", time.gmtime()),
            "machine": machine().replace("the namespace loopback", "the loopback"), "commit": commit,
            "n_params": n_params, "steps": args.steps, "profile_step": args.profile_step,
            "command": " ".join(["python", "-m", "benchmarks.profile_step"] + list(argv if argv is not None else sys.argv[1:]))}
    (args.out_dir / "profile.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    table = markdown(results, meta)
    (args.out_dir / "profile.md").write_text(table)
    if args.results:
        args.results.mkdir(parents=True, exist_ok=True)
        (args.results / "profile.md").write_text(table)
    print("\n" + table)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except RuntimeError as exc:
        sys.exit(f"profile_step.py: {exc}")
