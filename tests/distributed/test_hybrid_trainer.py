"""HybridTrainer trains the main job's model in 2 real processes (its argument checks: tests/unit/test_trainer.py)."""

import tempfile

import torch

from dist_launch import check_ok, launch


def test_hybrid_trainer_trains_the_main_job_model():
    out = tempfile.mkdtemp()
    check_ok(launch(2, "hybrid_worker.py", ["--out", out], timeout_s=300))
    ranks = [torch.load(f"{out}/rank{r}.pt") for r in range(2)]
    for rec in ranks:
        assert rec["dgc"]["density"] == 0.1 and rec["dgc"]["topology"] == "flat"
        assert rec["stats"]["steps"] == 30 and rec["stats"]["compression_ratio"] > 5
        first, last = sum(rec["losses"][:5]) / 5, sum(rec["losses"][-5:]) / 5
        assert last < first - 0.5, rec["losses"]  # from about ln(65) = 4.17
