"""Side-cars that do not belong to the checkpoint beside them, in real processes (issue 52, item 4; the unit tests in
tests/unit/zero3/test_checkpoint.py cover the same per file, and tests/distributed/test_checkpoint.py truncated and
missing side-cars)."""

import os
import shutil
import tempfile

import pytest

from dist_launch import run_scenario
from scenarios import SaveMidway

from ..distributed.test_checkpoint import DEMO, _resume_fails, saved_at_step_5
from ..distributed.test_engine import SPARSE


@pytest.mark.slow
def test_a_sidecar_from_another_runs_checkpoint_of_the_same_tag_fails_on_every_rank():
    """Two runs save ``global_step5``: top-k (the checkpoint resumed) and decoupled momentum. Rank 1's side-car of the
    second copied over the first's: its tag, rank and world size match, so only the save id that DeepSpeed's files
    record tells it apart. Rank 1 raises DGCCheckpointError naming the file, "another save" and the other run's
    method; rank 0 one naming rank 1; neither loads or hangs."""
    out = saved_at_step_5()
    other = tempfile.mkdtemp()
    run_scenario(SaveMidway(steps=5, ckpt=f"{other}/ckpt", save_at=5, config=DEMO))
    name = "dgc_state_dp_rank_00001.pt"
    shutil.copy(os.path.join(other, "ckpt", "global_step5", name), os.path.join(out, "ckpt", "global_step5", name))
    errs = _resume_fails(out, {"dgc": SPARSE})
    assert "DGCCheckpointError" in errs[1] and f"{name} was written by another save" in errs[1] and \
        "saved with decoupled_momentum" in errs[1], errs[1][-1500:]
    assert "DGCCheckpointError" in errs[0] and "failed on rank(s) [1]" in errs[0], errs[0][-1500:]
