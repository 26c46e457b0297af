"""The convergence study's driver: settings, argument errors and parallel launches (no training here)."""

import json
import threading
import time

import pytest

from benchmarks import study_convergence as sc
from deepspeed_dgc.config import parse_dgc_config


def test_settings_hold_what_their_names_say():
    known = sc.settings(60)
    assert known["stock"][2] is None
    w2 = known["adam_int1_w2"][2]
    assert w2["quantization"] == "int2" and w2["density"] == 1.0
    assert w2["compressed_momentum"] == {"freeze_step": 60, "quantization": "int1"}
    assert known["ef_d0.1"][2]["density"] == 0.1 and "compressed_momentum" not in known["ef_d0.1"][2]
    assert known["adam_int2_zlib"][2] == dict(known["adam_int2"][2], entropy_coding="zlib")
    assert known["ef_d0.1_r8"][2] == dict(known["ef_d0.1"][2], threshold_reuse_steps=8)
    own_codec = ("decoupled_momentum", "shared_mask")  # their own codecs: no top-level codec keys
    # as measured: fp32 residuals, but where the name says the storage (the hierarchical study's rows)
    assert all(dgc is None or any(k in dgc for k in own_codec) or dgc["residual_dtype"] == name.rsplit("_", 1)[-1]
               if name.startswith("h_") else dgc is None or any(k in dgc for k in own_codec)
               or dgc["residual_dtype"] == "fp32" for name, (_, _, dgc) in known.items())
    for dtype in ("fp32", "bf16", "fp8"):
        h = known[f"h_int4_dense_{dtype}"][2]
        assert h == dict(known["int4_dense"][2], residual_dtype=dtype, topology="hierarchical", ranks_per_node=2)
    assert known["h_demo_k2_int2_bf16"][2]["decoupled_momentum"] == {"quantization": "int2", "storage": "bf16"}
    assert known["h_demo_k2_int2_fp32"][2]["topology"] == "hierarchical"
    assert known["demo_k2_int2_bf16"][2]["decoupled_momentum"] == {"quantization": "int2", "storage": "bf16"}
    assert known["demo_k1"][2]["decoupled_momentum"] == {"topk": 1}
    assert known["demo_k2_adam"][2]["decoupled_momentum"]["update"] == "adam"
    assert known["mask_d0.05_e0"][2]["shared_mask"] == {"density": 0.05, "explore": 0.0}
    for name, (_, _, dgc) in known.items():  # every setting is a valid "dgc" section
        if dgc is not None:
            parse_dgc_config({"dgc": dgc})
    g512 = known["adam_int2_zlib_g512"][2]
    assert g512["compressed_momentum"]["group_size"] == 512 and g512["group_size"] == 128  # the warm-up keeps 128


@pytest.mark.parametrize("argv, message", [
    (["--long", "nope"], "--long: unknown ['nope']"),
    (["--only", "adam_int3"], "--only: unknown"),
    (["--fp8-residual", "nope"], "--fp8-residual: unknown ['nope']"),
    (["--jobs", "0"], "--jobs must be >= 1"),
    (["--steps", "0"], "--steps and --freeze-step must be >= 1"),
])
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit):
        sc.parse_args(argv)
    assert message in capsys.readouterr().err


def test_run_all_runs_jobs_at_a_time_on_distinct_ports(monkeypatch):
    lock, active, seen = threading.Lock(), set(), []

    def fake_run(name, dgc, steps, args, port):
        with lock:
            assert port not in active, "two launches on one master port"
            active.add(port)
            seen.append((name, steps, port, len(active)))
        time.sleep(0.05)
        with lock:
            active.discard(port)
        return {"name": name, "steps": steps}

    monkeypatch.setattr(sc, "run", fake_run)
    args = sc.parse_args(["--jobs", "2"])
    jobs = [(f"s{i}", None, 300 + i) for i in range(5)]
    out = sc.run_all(jobs, args)
    assert out == {(f"s{i}", 300 + i): {"name": f"s{i}", "steps": 300 + i} for i in range(5)}
    assert {p for _, _, p, _ in seen} <= {29720, 29721} and max(n for *_, n in seen) == 2


def test_merge_adds_only_what_this_run_lacks_and_refuses_another_seed(tmp_path):
    this = [{"name": "stock", "steps": 300, "val_loss": 2.0, "family": "stock"},
            {"name": "adam_int2_zlib", "steps": 300, "val_loss": 2.1, "family": "Adam-aware"}]
    earlier = {"meta": {"seed": 1234, "date": "2026-11-29", "freeze_step": 60},
               "rows": [{"name": "stock", "steps": 300, "val_loss": 9.9, "family": "stock"},
                        {"name": "ef_d0.1", "steps": 300, "val_loss": 2.2, "family": "plain EF"}]}
    path = tmp_path / "earlier.json"
    path.write_text(json.dumps(earlier))
    rows = sc.merged_rows(this, [path], 1234)
    assert [(r["name"], r["val_loss"], r.get("run")) for r in rows] == [
        ("stock", 2.0, None), ("adam_int2_zlib", 2.1, None), ("ef_d0.1", 2.2, "2026-11-29, earlier.json")]
    other = {"meta": {"seed": 1234, "date": "2026-11-30", "freeze_step": 200},
             "rows": [{"name": "adam_int2_zlib", "steps": 300, "val_loss": 2.3, "family": "Adam-aware", "label": "x"}]}
    path.write_text(json.dumps(other))
    renamed = sc.merged_rows(this, [path], 1234)[-1]
    assert renamed["name"] == "adam_int2_zlib_f200" and renamed["label"] == "x, frozen after step 200"
    with pytest.raises(SystemExit, match="seed 1234, this run with 7"):
        sc.merged_rows(this, [path], 7)
    with pytest.raises(SystemExit, match="no "):
        sc.merged_rows(this, [tmp_path / "missing.json"], 1234)
