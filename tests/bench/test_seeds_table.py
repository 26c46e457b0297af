"""benchmarks.seeds_table: the table over seeds from study_convergence's JSON files."""

import json
import random

import pytest

from benchmarks.seeds_table import table


def _doc(seed, stock, ours):
    rows = [{"name": "stock", "steps": 1000, "val_loss": stock, "gap_pct": 0.0, "state_bytes_per_param": 0.0},
            {"name": "x", "steps": 1000, "val_loss": ours, "gap_pct": 100 * (ours / stock - 1),
             "state_bytes_per_param": 1.03125}]
    return {"meta": {"seed": seed}, "rows": rows}


def test_gaps_per_seed_and_their_mean(tmp_path):
    paths, gaps = [], []
    for seed in (1, 2, 3):
        stock, ours = random.uniform(1.5, 2), random.uniform(1.5, 2)
        gaps.append(100 * (ours / stock - 1))
        paths.append(tmp_path / f"s{seed}.json")
        paths[-1].write_text(json.dumps(_doc(seed, stock, ours)))
    text = table(paths, ["x"], 1000).splitlines()
    assert len(text) == 2 + 3 + 2
    assert text[2].startswith("| 1 | ") and f"{gaps[0]:+.2f}%" in text[2]
    assert text[5] == f"| mean | | | {sum(gaps) / 3:+.2f}% |"
    assert text[6] == "| state B/param | | 1.03 | |"
    with pytest.raises(KeyError):
        table(paths, ["x"], 300)
