"""One table over seeds from ``study_convergence --json`` files: per seed, stock's validation loss and each setting's
loss and gap to it, then the mean gap per setting.

Usage::

    python -m benchmarks.seeds_table runs/study_storage/s1234.json runs/study_storage/s1235.json \\
        runs/study_storage/s1236.json --settings demo_k2_int2 demo_k2_int2_int8 --steps 1000
"""

import argparse
import json
import statistics
import sys
from pathlib import Path


def table(paths, settings, steps: int) -> str:
    """The markdown table (see the module docstring).

    Raises:
        KeyError: a file lacks stock or a setting at ``steps``.
    """
    head = "| seed | stock | " + " | ".join(f"`{s}` | gap" for s in settings) + " |"
    lines = [head, "|---:|---:|" + "---:|---:|" * len(settings)]
    gaps = {s: [] for s in settings}
    state = {}
    for path in paths:
        doc = json.loads(Path(path).read_text())
        rows = {(r["name"], r["steps"]): r for r in doc["rows"]}
        stock = rows[("stock", steps)]
        cells = [str(doc["meta"]["seed"]), f"{stock['val_loss']:.4f}"]
        for s in settings:
            r = rows[(s, steps)]
            gaps[s].append(r["gap_pct"])
            state[s] = r["state_bytes_per_param"]
            cells += [f"{r['val_loss']:.4f}", f"{r['gap_pct']:+.2f}%"]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("| mean | | " + " | ".join(f"| {statistics.mean(gaps[s]):+.2f}%" for s in settings) + " |")
    lines.append("| state B/param | | " + " | ".join(f"{state[s]:.2f} |" for s in settings) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", type=Path)
    ap.add_argument("--settings", nargs="+", required=True)
    ap.add_argument("--steps", type=int, required=True)
    args = ap.parse_args(argv)
    print(table(args.paths, args.settings, args.steps), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
