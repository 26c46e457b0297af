"""Step time of the recommended Adam method with its momentum on the host against on the device, interleaved.

Run from the repository root::

    python -m benchmarks.bench_offload --rounds 3 --steps 120 --json results/bench_offload.json \\
        --markdown results/bench_offload.md

Every round launches the main job (``examples/train_char_gpt.py``, ``configs/zero3_dgc_adam.json``, 2 ranks) once per
variant, in an order that alternates from round to round, for ``--steps`` steps without evaluation:

- ``fp32``: the momentum in fp32 on the device (the recommended method before issue 53);
- ``int8``: the momentum in int8 (stochastic rounding) on the device;
- ``int8-host``: the same in pinned host memory between steps (``decoupled_momentum.offload``), written back and
  fetched beside the backward.

A variant's time is the median of its steps after the first ``--warmup`` (optimizer steps only: no evaluation); the
table gives each round's ratio to ``int8`` and their median, next to the state's device and host bytes per parameter
from the telemetry. On the CPU accelerator host and device are the same memory: offload copies the state there and
back and saves nothing, so what this measures is the cost of the copies and their thread on the step, not a saving.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRAIN_SCRIPT = ROOT / "examples" / "train_char_gpt.py"
ADAM_CONFIG = ROOT / "configs" / "zero3_dgc_adam.json"
VARIANTS = {"fp32": {"storage": "fp32"}, "int8": {"storage": "int8"},
            "int8-host": {"storage": "int8", "offload": True}}
REFERENCE = "int8"


def config_of(variant: str) -> dict:
    """``configs/zero3_dgc_adam.json`` with the variant's ``decoupled_momentum`` storage and placement."""
    ds = json.loads(ADAM_CONFIG.read_text())
    dm = dict(ds["dgc"]["decoupled_momentum"], **VARIANTS[variant])
    dm.setdefault("offload", False)
    ds["dgc"] = dict(ds["dgc"], decoupled_momentum=dm)
    return ds


def run_once(variant: str, steps: int, port: int, workdir: Path) -> dict:
    """One launch of the main job; returns its summary (``step_times_s``, ``dgc_stats``).

    Raises:
        RuntimeError: the launch failed (its log is named).
    """
    cfg, summary, log = (workdir / f"{variant}.{suffix}" for suffix in ("json", "summary.json", "log"))
    cfg.write_text(json.dumps(config_of(variant), indent=2))
    summary.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(port),
           str(TRAIN_SCRIPT), "--deepspeed_config", str(cfg), "--max-steps", str(steps), "--eval-interval",
           str(steps), "--summary-json", str(summary)]
    with open(log, "w") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    if done.returncode != 0 or not summary.exists():
        raise RuntimeError(f"{variant} failed with exit code {done.returncode} (log: {log})")
    return json.loads(summary.read_text())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=120, help="optimizer steps per launch")
    ap.add_argument("--warmup", type=int, default=20, help="steps left out of each launch's median")
    ap.add_argument("--port", type=int, default=29760)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--markdown", type=Path)
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.steps <= args.warmup or args.warmup < 0:
        ap.error("--rounds must be >= 1 and --steps above --warmup >= 0")
    names = list(VARIANTS)
    rounds, bytes_ = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            order = names if i % 2 == 0 else names[::-1]
            medians = {}
            for v in order:
                s = run_once(v, args.steps, args.port, Path(tmp))
                medians[v] = statistics.median(s["step_times_s"][args.warmup:])
                st, n = s["dgc_stats"], s["n_params"]
                bytes_[v] = {"state_per_param": st["state_bytes"] / n, "host_per_param": st["host_state_bytes"] / n,
                             "device_per_param": (st["state_bytes"] - min(st["state_bytes"], st["host_state_bytes"]))
                             / n, "final_train_loss": s["final_train_loss"]}
                print(f"round {i} {v}: median step {medians[v] * 1e3:.1f} ms", flush=True)
            rounds.append({"order": order, "median_step_s": medians})
    ratio = {v: statistics.median(r["median_step_s"][v] / r["median_step_s"][REFERENCE] for r in rounds) for v in names}
    out = {"date": time.strftime("%Y-%m-%d"), "command": "python -m benchmarks.bench_offload " + " ".join(
        sys.argv[1:] if argv is None else argv), "machine": "2 CPU cores, gloo (CPU accelerator)", "rounds": rounds,
        "ratio_to_int8": ratio, "bytes": bytes_}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    lines = [f"`{out['command']}`, {out['date']}, {out['machine']}; main job, `configs/zero3_dgc_adam.json`, 2 ranks, "
             f"{args.steps} steps per launch, median of steps {args.warmup}-{args.steps - 1}, {args.rounds} rounds in "
             "alternating order.", "",
             "| momentum | median step, ms (per round) | ratio to int8 on the device (median of rounds) | "
             "state B/param | of it on the host (committed), B/param | host buffers B/param |",
             "|---|---|---:|---:|---:|---:|"]
    for v in names:
        per_round = ", ".join(f"{r['median_step_s'][v] * 1e3:.1f}" for r in rounds)
        b = bytes_[v]
        on_host = b["state_per_param"] - b["device_per_param"]
        lines.append(f"| {v} | {per_round} | {ratio[v]:.3f} | {b['state_per_param']:.3f} | {on_host:.3f} | "
                     f"{b['host_per_param']:.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
