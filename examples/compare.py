"""Run examples/train_char_gpt.py once per DeepSpeed config and tabulate the results.

Run from the repository root::

    python examples/compare.py --max-steps 300

Each run writes ``<out-dir>/<config name>.json``; the Markdown table is printed and written to
``<out-dir>/compare.md``. The first config is the baseline for the validation-loss gap. Exits
non-zero if any run fails.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

DEFAULT_CONFIGS = [
    "configs/zero3_baseline.json", "configs/zero3_int4.json", "configs/zero3_dgc_int4_d01.json", "configs/zero3_dgc_adam.json"
]
TRAIN_SCRIPT = "examples/train_char_gpt.py"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, help="DeepSpeed configs; the first is the baseline")
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--num-gpus", type=int, default=2, help="ranks per run (CPU processes without a GPU)")
    parser.add_argument("--out-dir", type=Path, default=Path("runs"))
    parser.add_argument("--dgc-set", action="append", default=[], metavar="KEY=JSON",
                        help="passed to every run (see train_char_gpt.py), e.g. --dgc-set ranks_per_node=2 to make "
                        "4 ranks on one machine act as 2 nodes of 2")
    return parser.parse_args()


def run_config(config: str, args: argparse.Namespace) -> dict:
    """Launch one training run with the deepspeed launcher; returns its summary dict.

    Raises RuntimeError if the run exits non-zero or leaves no summary file.
    """
    summary_path = args.out_dir / f"{Path(config).stem}.json"
    summary_path.unlink(missing_ok=True)
    cmd = [
        sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(args.num_gpus), TRAIN_SCRIPT,
        "--deepspeed_config", config, "--max-steps", str(args.max_steps), "--seed", str(args.seed),
        "--summary-json", str(summary_path)
    ] + [arg for item in args.dgc_set for arg in ("--dgc-set", item)]
    print(f"==> {' '.join(cmd)}", flush=True)
    result = subprocess.run(cmd)
    if result.returncode != 0 or not summary_path.exists():
        raise RuntimeError(f"run for {config} failed (exit code {result.returncode})")
    return json.loads(summary_path.read_text())


def param_mb(summary: dict) -> str:
    """Parameter all-gather MB sent by rank 0: the gathers through deepspeed_dgc's seam (and the fp32 MB of the same
    gathers), plus the post-step gather of ZeRO-3's persistent parameters (small tensors kept whole on every rank),
    which no seam covers and which goes as stock sends it ("n/a" for stock runs)."""
    if summary.get("param_wire_bytes_total") is None:
        return "n/a"
    return (f"{summary['param_wire_bytes_total'] / 1e6:.1f} ({summary['param_dense_fp32_bytes_total'] / 1e6:.1f}) "
            f"+ {(summary.get('param_uncovered_bytes_total') or 0) / 1e6:.1f}")


def inter_node_mb(summary: dict) -> str:
    """Gradient MB rank 0 sent to other nodes and what stock fp32 would have sent there ("n/a" for stock runs)."""
    stats = summary.get("dgc_stats") or {}
    if "grad_inter_node_wire_bytes_total" not in stats:
        return "n/a"
    return (f"{stats['grad_inter_node_wire_bytes_total'] / 1e6:.2f} "
            f"({stats['grad_inter_node_dense_fp32_bytes_total'] / 1e6:.1f})")


def markdown_table(summaries: list[dict]) -> str:
    """One row per run summary; the first summary is the baseline for the val-loss gap."""
    base_val = summaries[0]["final_val_loss"]
    rows = [
        "| config | final val loss | val gap vs baseline | final train loss | grad compression vs fp32 | grad wire MB "
        "| grad MB to other nodes (fp32 MB) | param wire MB: gathers (fp32 MB) + persistent params | wall s "
        "| skipped steps |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in summaries:
        gap_pct = 100.0 * (s["final_val_loss"] - base_val) / base_val
        rows.append(f"| {Path(s['config']).stem} | {s['final_val_loss']:.4f} | {gap_pct:+.2f}% "
                    f"| {s['final_train_loss']:.4f} | {s['compression_ratio']:.1f}x "
                    f"| {s['wire_bytes_total'] / 1e6:.1f} | {inter_node_mb(s)} | {param_mb(s)} | {s['wall_s']:.1f} "
                    f"| {s['skipped_steps']} |")
    return "\n".join(rows) + "\n"


def main() -> None:
    args = parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    try:
        summaries = [run_config(config, args) for config in args.configs]
    except RuntimeError as exc:
        sys.exit(f"compare.py: {exc}")
    s0 = summaries[0]
    header = (f"{s0['steps']} steps, seed {s0['seed']}, world size {s0['world_size']}, "
              f"{s0['n_params']:,} parameters; wire MB = bytes sent by rank 0 over the run / 1e6; persistent params: "
              "ZeRO-3's post-step gather of the parameters it keeps whole on every rank (below "
              "stage3_param_persistence_threshold), sent as stock sends it\n\n")
    table = header + markdown_table(summaries)
    print("\n" + table, end="")
    (args.out_dir / "compare.md").write_text(table)


if __name__ == "__main__":
    main()
