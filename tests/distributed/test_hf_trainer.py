"""Hugging Face Trainer + DeepSpeed ZeRO-3 + deepspeed_dgc: examples/hf_trainer_gpt2.py on 2 ranks.

transformers is in requirements-test.txt, so CI runs this; it skips only where transformers is absent.
"""

import json
import os
import subprocess
import sys

import pytest

from dist_launch import ROOT, free_port, remove_shm_buffers

pytest.importorskip("transformers")


def test_hf_trainer_runs_with_dgc_compressing():
    port = free_port()
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(port),
           "examples/hf_trainer_gpt2.py", "--deepspeed", "configs/hf_zero3_dgc.json", "--max-steps", "10",
           "--output-dir", os.path.join(ROOT, "runs", "test_hf_trainer")]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"),
                              capture_output=True, text=True, timeout=600)
    finally:
        remove_shm_buffers(port)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("DGC_TELEMETRY ")]
    assert len(line) == 1, proc.stdout[-3000:]
    t = json.loads(line[0].split(" ", 1)[1])
    assert t["steps"] == 10 and t["dgc_steps"] == 10 and t["kernels"] == "fused-cpu"
    # every parameter of every step went through our reduce-scatter: stock fp32's bytes for the model's size
    world = t["world_size"]
    assert t["dense_fp32_bytes_total"] == round(10 * (world - 1) / world * 4 * t["n_params"])
    # dense INT4 (the config's density 1.0): 4 bits per value plus an fp32 scale per 128 values, 4.25 bits per
    # parameter, so at most 32 / 4.25 = 7.53x; payload headers take a little of it (a sparse or raw payload is far off)
    assert 7.0 < t["compression_ratio"] <= 7.53, t
    assert 0 < t["train_loss"] < 4.5  # finite, and below ln(65) = 4.17 plus slack at the start
