"""benchmarks/bench_memory.py: its rows' configs, and real launches whose measured per-rank state equals the formulas
the 70B projection uses (the full table is `make bench-memory`)."""

import argparse

import pytest

from benchmarks import bench_memory as bm

HIER = {"ef": "fp8", "adam": "bf16"}


def test_rows_are_the_shipped_configs_with_the_topology():
    flat = bm.ds_config("adam", "flat", HIER)
    assert flat["bf16"] == {"enabled": True} and flat["dgc"]["decoupled_momentum"]["quantization"] == "int2"
    hier = bm.ds_config("adam", "2x4", HIER)
    assert hier["dgc"]["topology"] == "hierarchical" and hier["dgc"]["ranks_per_node"] == 4
    assert hier["dgc"]["decoupled_momentum"]["storage"] == "bf16"
    assert bm.ds_config("ef", "2x2", HIER)["dgc"] == {"enabled": True, "topology": "hierarchical", "ranks_per_node": 2,
                                                      "residual_dtype": "fp8"}
    assert "dgc" not in bm.ds_config("stock", "2x2", HIER)
    # the goal's arithmetic: at W = 64, L = 8 the bf16 momentum is ZeRO-3's own 16/W
    f = bm.formula("adam", 64, 8, HIER)
    assert f["steady"] == pytest.approx(16 / 64) and f["peak"] == 2 * f["steady"] and f["zero3"] == 8 / 64


@pytest.mark.parametrize("config, topology", [("adam", "flat"), ("ef", "2x2")])
def test_measured_state_equals_the_formula(config, topology, tmp_path):
    """One real launch (2 or 4 CPU ranks, 2 steps): ZeRO-3's own state, the extension's between steps and its peak,
    per parameter, on the largest rank, each within padding of the formula."""
    args = argparse.Namespace(hier_storage=HIER, steps=2, seed=7, out_dir=tmp_path, launch_timeout_s=300.0)
    row = bm.run_row(config, topology, args, 29771)
    f = bm.formula(config, row["W"], row["L"], HIER)
    for key in ("zero3", "steady", "peak"):
        assert row[key] == pytest.approx(f[key], rel=0.01, abs=1e-3), (key, row[key], f[key])
    assert all(r["steady"] > 0 and r["zero3"]["optimizer"] >= 0 for r in row["ranks"])
