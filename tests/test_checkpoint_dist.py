"""Checkpoint and resume with DGC state (residuals, sampling generators, telemetry) in real processes."""

import glob
import os
import tempfile

import torch

from dist_launch import check_ok, launch


def run(mode, out, world=2):
    results = launch(world, "engine_worker.py", [mode, out], timeout_s=240)
    check_ok(results)
    return [torch.load(f"{out}/rank{r}.pt") for r in range(world)], results


def test_resume_is_bit_identical():
    full, _ = run("resume_full", tempfile.mkdtemp())
    out = tempfile.mkdtemp()
    first, _ = run("resume_first", out)
    sidecars = sorted(glob.glob(f"{out}/ckpt/*/dgc_state_dp_rank_*.pt"))
    assert len(sidecars) == 2
    saved = torch.load(sidecars[0], weights_only=True)  # plain tensors and containers only
    assert saved["world_size"] == 2 and saved["residuals"]
    second, _ = run("resume_second", out)
    for r in range(2):
        # new processes continue exactly where the first ones stopped
        assert first[r]["losses"] + second[r]["losses"] == full[r]["losses"]
        for a, b in zip(second[r]["params"], full[r]["params"]):
            assert torch.equal(a, b)
        assert second[r]["residuals"].keys() == full[r]["residuals"].keys()
        for k in full[r]["residuals"]:
            assert torch.equal(second[r]["residuals"][k], full[r]["residuals"][k])
        assert second[r]["stats_steps"] == 10
    # DeepSpeed's own files still load: the fp32 weights from the ZeRO checkpoint
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    state = get_fp32_state_dict_from_zero_checkpoint(f"{out}/ckpt")
    assert set(state) == {"l1.weight", "l1.bias", "ln.weight", "ln.bias", "l2.weight", "l2.bias"}


def test_checkpoint_without_dgc_state_says_residuals_restart():
    full, _ = run("resume_full", tempfile.mkdtemp())
    out = tempfile.mkdtemp()
    run("resume_first", out)
    for path in glob.glob(f"{out}/ckpt/*/dgc_state_dp_rank_*.pt"):
        os.unlink(path)
    second, results = run("resume_second", out)
    for r in range(2):
        assert "error-feedback residuals start at zero" in results[r].stderr + results[r].stdout
        assert second[r]["residuals"]  # training went on and built new residuals
        assert second[r]["losses"] != full[r]["losses"][5:]  # the side-car is what makes resume exact


def test_dgc_checkpoint_into_a_run_without_dgc_says_what_is_ignored():
    """Saved with DGC, loaded with DGC off: DeepSpeed's weights load as usual (the first step after
    loading starts from the saved weights: its loss equals the uninterrupted DGC run's sixth loss),
    and every rank says that the side-car's residuals are ignored."""
    full, _ = run("resume_full", tempfile.mkdtemp())
    out = tempfile.mkdtemp()
    run("resume_first", out)
    second, results = run("resume_second_nodgc", out)
    for r in range(2):
        log = results[r].stderr + results[r].stdout
        assert "this run has DGC off, so its error-feedback residuals are ignored" in log, log[-2000:]
        assert "dgc_state_dp_rank_" in log
        assert second[r]["losses"][0] == full[r]["losses"][5]  # same weights at the start of step 6
        assert second[r]["losses"][1:] != full[r]["losses"][6:]  # then stock ZeRO-3 reduces differently


def test_sidecar_from_another_world_size_is_dropped_with_a_warning(tmp_path):
    """DeepSpeed itself refuses a ZeRO checkpoint at another data-parallel size; the side-car check
    stands on its own for paths that do re-shard (universal checkpoints)."""
    from deepspeed_dgc.checkpoint import load_state, save_state
    from deepspeed_dgc.config import DGCConfig
    from deepspeed_dgc.integration import DGCState

    state = DGCState(DGCConfig(enabled=True), global_rank=0)
    state.memory.committed = {3: torch.randn(10), 7: torch.randn(5)}
    save_state(state, str(tmp_path), "tag", world_size=2)
    fresh = DGCState(DGCConfig(enabled=True), global_rank=0)
    msg = load_state(fresh, str(tmp_path), "tag", world_size=3, device=torch.device("cpu"))
    assert "world size 2" in msg and "has 3" in msg and "dropped" in msg
    assert fresh.memory.committed == {}
    msg = load_state(fresh, str(tmp_path), "tag", world_size=2, device=torch.device("cpu"))
    assert msg.startswith("restored") and torch.equal(fresh.memory.committed[3], state.memory.committed[3])
