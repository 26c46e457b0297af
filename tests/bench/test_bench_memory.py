"""benchmarks/bench_memory.py: its rows' configs, its formulas, every row of the committed results
(results/bench_memory.json) against those formulas, and two real launches (flat with every storage once, hierarchical
with two rows, both placements) whose measured per-rank state equals the formulas the 7B and 70B projection uses (the
full table is `make bench-memory`)."""

import argparse
import json
from pathlib import Path

import pytest

from benchmarks import bench_memory as bm

RESULTS = Path(bm.ROOT, "results", "bench_memory.json")


def test_rows_are_the_shipped_configs_with_storage_placement_and_topology():
    flat = bm.ds_config(bm.Row("adam", "bf16", "device"), "flat")
    assert flat["bf16"] == {"enabled": True} and flat["dgc"]["decoupled_momentum"]["quantization"] == "int2"
    assert flat["dgc"]["decoupled_momentum"]["storage"] == "bf16" and not flat["dgc"]["decoupled_momentum"]["offload"]
    hier = bm.ds_config(bm.Row("adam", "int8", "host"), "2x2")
    assert hier["dgc"]["topology"] == "hierarchical" and hier["dgc"]["ranks_per_node"] == 2
    assert hier["dgc"]["decoupled_momentum"] == dict(flat["dgc"]["decoupled_momentum"], storage="int8", offload=True)
    assert bm.ds_config(bm.Row("ef", "fp8", "host"), "2x2")["dgc"] == {
        "enabled": True, "layout": "fixed", "residual_dtype": "fp8", "residual_offload": True,
        "topology": "hierarchical", "ranks_per_node": 2}
    assert "dgc" not in bm.ds_config(bm.Row("stock"), "2x2")
    half = bm.ds_config(bm.Row("ef", "fp8", "device", 250000), "flat")
    assert half["zero_optimization"]["reduce_bucket_size"] == 250000
    rows = bm.all_rows()
    assert len(rows) == 1 + 2 * (len(bm.STORAGES["ef"]) + len(bm.STORAGES["adam"])) and len(set(rows)) == len(rows)


def test_formulas_and_the_floor():
    assert bm.STORAGE_BYTES["int8"] == 1 + 2 / 64 and bm.STORAGE_BYTES["fp8"] == 1 + 4 / 128
    f = bm.formula(bm.Row("adam", "bf16", "device"), 64, 8)
    assert f["device"] == pytest.approx(16 / 64) and f["host"] == 0 and f["zero3"] == 8 / 64
    assert f["peak"] == f["peak_device"] == 2 * f["steady"] and f["peak_host"] == 0
    h = bm.formula(bm.Row("adam", "int8", "host"), 64, None)  # flat, on the host: two host buffers, none on the device
    assert h["steady"] == pytest.approx(1.03125) and h["device"] == h["peak_device"] == 0
    assert h["host"] == h["peak_host"] == h["peak"] == 2 * h["steady"]
    assert bm.formula(bm.Row("ef", "fp32", "device"), 8, None)["zero3"] == 2.0
    assert bm.floor_met() == ["bf16", "int8"]  # at most 16/W at W = 64, L = 8
    table = bm.projection_markdown()
    # 70B, adam in int8 on L = 8: 0.129 B per parameter, 9.02 GB, 0.52x of 16/64; flat on the host: 144 GB host
    assert ("| adam | L = 8 | int8 | device | 0.129, 0.000, 0.258 | 0.90, 0.00, 1.80 | 9.02, 0.00, 18.05 | "
            "0.06x, 0.52x, 4.12x | 0.13x, 1.03x, 8.25x | 0.13x, 1.03x, 8.25x |") in table
    assert "| adam | flat | int8 | host | 0.000, 2.062, 0.000 | 0.00, 14.44, 0.00 | 0.00, 144.38, 0.00 |" in table


def check_row(r: dict) -> None:
    """One measured row (bytes per parameter, the largest rank) against its formula, each within 2% (padding): ZeRO-3's
    own state; the extension's accounting (committed state, host memory, the state's peak); its tensors in host
    memory at the last step's start and at their peak. Its tensors on the device: at the step's start the formula's
    plus at most 0.5 B per parameter (plans, the DCT basis) and, with the state on the host, the first bucket's block
    fetched ahead; at their peak at least the formula's, and beyond the state's peak at most 16 B per element of
    ``reduce_bucket_size``. ZeRO-3's own tensors hold at least its state."""
    f = bm.formula(bm.row_of(r), r["W"], r["L"])
    s = r["step"]
    # the formulas leave out padding: the fixed layout pads each owner's slice of a tensor to whole scale groups
    close = lambda a, b: a == pytest.approx(b, rel=0.02, abs=1e-3)  # noqa: E731
    for label, measured, key in (("ZeRO-3's own", r["zero3"], "zero3"), ("state_bytes", r["steady"], "steady"),
                                 ("host_state_bytes", r["host"], "host"), ("peak_state_bytes", r["peak"], "peak"),
                                 ("host tensors at the start", s["dgc_host_start"], "host"),
                                 ("host tensors' peak", s["dgc_host_peak"], "peak_host")):
        assert close(measured, f[key]), (r["name"], r["topology"], label, measured, f[key])
    fetched = f["steady"] * min(1.0, bm.bucket_elements(r) / r["n_params"]) if r["placement"] == "host" else 0.0
    assert f["device"] - 1e-3 <= s["dgc_start"] <= f["device"] + 0.5 + 1.01 * fetched, (r["name"], r["topology"], s)
    assert s["dgc_peak"] >= f["peak_device"] - 1e-3, (r["name"], r["topology"], s)
    assert bm.in_step(r)["extra_per_bucket_element"] <= 16, (r["name"], r["topology"], s)
    assert s["zero3_start"] >= f["zero3"] - 1e-3 and s["zero3_peak"] >= s["zero3_start"], (r["name"], s)


def test_committed_results_equal_their_formulas():
    """results/bench_memory.json (`make bench-memory`): every measured row against today's formulas."""
    data = json.loads(RESULTS.read_text())
    assert {r["topology"] for r in data["rows"]} >= {"flat", "2x2"}
    for r in data["rows"]:
        check_row(r)


# each storage measured in the two launches (int8 on 2x2), each config on the device and on the host in each;
# the benchmark's other rows (`make bench-memory`) are checked against the formulas above
FLAT = [bm.Row("stock"), bm.Row("ef", "fp32", "device"), bm.Row("ef", "bf16", "host"), bm.Row("ef", "fp8", "device"),
        bm.Row("adam", "bf16", "device"), bm.Row("adam", "fp32", "host")]
HIER = [bm.Row("ef", "int8", "host"), bm.Row("adam", "int8", "host")]


def test_the_launches_measure_every_storage_and_placement():
    rows = FLAT + HIER
    for config in ("ef", "adam"):
        assert {r.storage for r in rows if r.config == config} == set(bm.STORAGES[config]), config
        assert {r.placement for r in FLAT if r.config == config} == set(bm.PLACEMENTS), config


@pytest.mark.parametrize("topology, rows", [("flat", FLAT), ("2x2", HIER)])
def test_measured_state_equals_the_formula(topology, rows, tmp_path):
    """One real launch per topology (2 or 4 CPU ranks, the rows one after the other, 3 steps each as in the
    benchmark): flat, stock and every storage but int8, ef and adam each on the device and on the host; on 2x2, int8
    residuals and int8 momentum on the host."""
    assert all(bm.refusal(r, topology) is None for r in rows)
    args = argparse.Namespace(steps=3, seed=7, out_dir=tmp_path, launch_timeout_s=600.0)
    measured = bm.run_topology(rows, topology, args, 29831)
    assert [r["name"] for r in measured] == [r.name for r in rows]
    for r in measured:
        check_row(r)
        assert all(rec["steady"] > 0 for rec in r["ranks"]) == (r["config"] != "stock")
