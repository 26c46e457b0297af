"""Hugging Face Trainer + DeepSpeed ZeRO-3 + deepspeed_dgc: examples/hf_trainer_gpt2.py on 2 ranks, started as the
test launches of tests/dist_launch.py start their workers (the Trainer reads the ranks from the environment, as under
the deepspeed launcher).

transformers is in requirements-test.txt, so CI runs this; it skips only where transformers is absent.
"""

import json
import os

import pytest

from dist_launch import ROOT, check_ok, launch

pytest.importorskip("transformers")


def test_hf_trainer_runs_with_dgc_compressing():
    argv = ["--deepspeed", "configs/hf_zero3_dgc.json", "--max-steps", "10", "--output-dir",
            os.path.join(ROOT, "runs", "test_hf_trainer")]
    ranks = launch(2, os.path.join(ROOT, "examples", "hf_trainer_gpt2.py"), argv, timeout_s=600)
    check_ok(ranks)
    line = [ln for ln in ranks[0].stdout.splitlines() if ln.startswith("DGC_TELEMETRY ")]
    assert len(line) == 1, ranks[0].stdout[-3000:]
    t = json.loads(line[0].split(" ", 1)[1])
    assert t["steps"] == 10 and t["dgc_steps"] == 10 and t["kernels"] == "fused-cpu"
    # every parameter of every step went through our reduce-scatter: stock fp32's bytes for the model's size
    world = t["world_size"]
    assert t["dense_fp32_bytes_total"] == round(10 * (world - 1) / world * 4 * t["n_params"])
    # dense INT4 (the config's density 1.0): 4 bits per value plus an fp32 scale per 128 values, 4.25 bits per
    # parameter, so at most 32 / 4.25 = 7.53x; payload headers take a little of it (a sparse or raw payload is far off)
    assert 7.0 < t["compression_ratio"] <= 7.53, t
    assert 0 < t["train_loss"] < 4.5  # finite, and below ln(65) = 4.17 plus slack at the start
