"""Checkpoint and resume with DGC state (residuals, sampling generators, telemetry) in real processes."""

import glob
import math
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch

from dist_launch import check_ok, launch
from deepspeed_dgc.memory import ErrorFeedback


def run(mode, out, world=2):
    results = launch(world, "engine_worker.py", [mode, out], timeout_s=240)
    check_ok(results)
    return [torch.load(f"{out}/rank{r}.pt") for r in range(world)], results


_SHARED = {}


def uninterrupted():
    """The 10-step run every resume test compares against, which saves a checkpoint after step 5 without
    changing its course (run once per session).

    Returns:
        ``(src_dir, records)``: a directory holding ``ckpt/``, and the run's records per rank.
    """
    if "full" not in _SHARED:
        src = tempfile.mkdtemp()
        _SHARED["full"] = (src, run("resume_full", src)[0])
    return _SHARED["full"]


def saved_at_step_5():
    """A fresh copy of the uninterrupted run's checkpoint saved at step 5 by 2 ranks."""
    src, _ = uninterrupted()
    out = tempfile.mkdtemp()
    shutil.copytree(os.path.join(src, "ckpt"), os.path.join(out, "ckpt"))
    return out


def test_resume_is_bit_identical():
    _, full = uninterrupted()
    out = saved_at_step_5()
    sidecars = sorted(glob.glob(f"{out}/ckpt/*/dgc_state_dp_rank_*.pt"))
    assert len(sidecars) == 2
    saved = torch.load(sidecars[0], weights_only=True)  # plain tensors and containers only
    assert saved["world_size"] == 2 and saved["residuals"]
    second, _ = run("resume_second", out)
    for r in range(2):
        # new processes continue exactly where the first ones stopped
        assert second[r]["losses"] == full[r]["losses"][5:]
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
    _, full = uninterrupted()
    out = saved_at_step_5()
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
    _, full = uninterrupted()
    out = saved_at_step_5()
    second, results = run("resume_second_nodgc", out)
    for r in range(2):
        log = results[r].stderr + results[r].stdout
        assert "this run has DGC off, so its error-feedback residuals are ignored" in log, log[-2000:]
        assert "dgc_state_dp_rank_" in log
        assert second[r]["losses"][0] == full[r]["losses"][5]  # same weights at the start of step 6
        assert second[r]["losses"][1:] != full[r]["losses"][6:]  # then stock ZeRO-3 reduces differently


def test_world_size_2_saved_loaded_at_3():
    """DeepSpeed refuses a ZeRO checkpoint at another data-parallel size (every rank raises); its
    universal checkpoint (ds_to_universal) loads at 3 ranks, and the DGC residuals of the 2 saved
    ranks are re-sharded: summed and split evenly, so the gradient not yet sent is conserved (up to the rounding of
    the default fp8 storage of each rank's share; the arithmetic is checked exactly in fp32 by the next test)."""
    out = saved_at_step_5()
    refused = launch(3, "engine_worker.py", ["resume_second", out], timeout_s=240)
    for r in refused:
        assert r.returncode != 0  # no hang, no silent partial load
    assert any("used a DP world size of 2 but the current world size is 3" in r.stderr for r in refused)
    tag = open(f"{out}/ckpt/latest").read().strip()
    conv = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                           f"{out}/ckpt/{tag}", "--output_folder", f"{out}/ckpt/{tag}_universal",
                           "--num_extract_workers", "1", "--num_merge_workers", "1"],
                          capture_output=True, text=True, timeout=300)
    assert conv.returncode == 0, conv.stderr[-3000:]
    third, results = run("resume_second_universal", out, world=3)
    sides = [torch.load(f"{out}/ckpt/{tag}/dgc_state_dp_rank_{r:05d}.pt", weights_only=True) for r in range(2)]
    assert all(s["residual_storage"] == "fp8" for s in sides)  # "auto" on the flat topology
    saved = [{k: ErrorFeedback.decode(v) for k, v in s["residuals"].items()} for s in sides]
    for r in range(3):
        log = results[r].stderr + results[r].stdout
        assert "saved at data-parallel world size 2, this run has 3: re-sharded" in log, log[-2000:]
        assert len(third[r]["losses"]) == 5 and all(math.isfinite(x) for x in third[r]["losses"])
    assert set(third[0]["loaded_residuals"]) == set(saved[0])
    for k in saved[0]:
        before = saved[0][k].double() + saved[1][k].double()
        after = sum(third[r]["loaded_residuals"][k].double() for r in range(3))
        # fp8 e4m3: relative error <= 2^-4; values far below their group's absmax may flush to zero
        assert bool(((after - before).abs() <= 2**-4 * before.abs() + 1e-5 * float(before.abs().max())).all())
        assert not torch.equal(after, before) or bool((before == 0).all())  # really stored in fp8
        assert torch.equal(third[0]["loaded_residuals"][k], third[2]["loaded_residuals"][k])  # an even split


def test_sidecar_at_another_world_size_flat_reshards_hierarchical_drops(tmp_path):
    from deepspeed_dgc.checkpoint import load_state, save_state
    from deepspeed_dgc.config import DGCConfig
    from deepspeed_dgc.integration import DGCState

    saved = []
    for rank in range(2):
        state = DGCState(DGCConfig(enabled=True, residual_dtype="fp32"), global_rank=rank)
        state.dp_rank = rank
        state.memory.committed = {3: torch.randn(10), 7: torch.randn(5)}
        save_state(state, str(tmp_path), "tag", world_size=2)
        saved.append(state.memory.committed)
    fresh = DGCState(DGCConfig(enabled=True, residual_dtype="fp32"), global_rank=0)
    msg = load_state(fresh, str(tmp_path), "tag", world_size=3, device=torch.device("cpu"))
    assert "world size 2" in msg and "has 3" in msg and "re-sharded 2 residuals" in msg
    assert torch.allclose(fresh.memory.committed[3] * 3, saved[0][3] + saved[1][3], atol=1e-6)
    msg = load_state(fresh, str(tmp_path), "tag", world_size=2, device=torch.device("cpu"))
    assert msg.startswith("restored") and torch.equal(fresh.memory.committed[3], saved[0][3])
    hier = DGCState(DGCConfig(enabled=True, topology="hierarchical", ranks_per_node=1), global_rank=0)
    hier.reducer.ranks_per_node = 1
    msg = load_state(hier, str(tmp_path), "tag", world_size=3, device=torch.device("cpu"))
    assert "cannot be re-sharded" in msg and "world size 2" in msg and "has 3" in msg
    assert hier.memory.committed == {}
    os.unlink(tmp_path / "tag" / "dgc_state_dp_rank_00001.pt")  # a side-car missing: nothing half-loaded
    msg = load_state(fresh, str(tmp_path), "tag", world_size=3, device=torch.device("cpu"))
    assert "is missing" in msg and fresh.memory.committed == {}


def test_fp8_residuals_restore_bit_for_bit_and_an_older_fp32_sidecar_still_loads(tmp_path):
    """The default storage (fp8) is saved as its codes and scales and restored exactly; a side-car of an earlier
    version (plain fp32 residuals, no storage name, no thresholds) loads into it, rounded once, and the log says so."""
    from deepspeed_dgc.checkpoint import FORMAT, load_state, save_state
    from deepspeed_dgc.config import DGCConfig
    from deepspeed_dgc.integration import DGCState

    gen = torch.Generator().manual_seed(3)
    state = DGCState(DGCConfig(enabled=True), global_rank=0)
    state.dp_rank = 0
    for k, n in ((3, 1000), (7, 130)):
        state.memory.stage(k, torch.randn(n, generator=gen) * 10.0**k)
    state.memory.commit()
    save_state(state, str(tmp_path / "new"), "tag", world_size=2)
    fresh = DGCState(DGCConfig(enabled=True), global_rank=0)
    msg = load_state(fresh, str(tmp_path / "new"), "tag", world_size=2, device=torch.device("cpu"))
    assert msg.startswith("restored") and "rounded once" not in msg
    for k in (3, 7):
        assert all(torch.equal(a, b) for a, b in zip(fresh.memory.committed[k], state.memory.committed[k]))
    old = {k: torch.randn(n, generator=gen) for k, n in ((3, 1000), (7, 130))}
    path = tmp_path / "old" / "tag" / "dgc_state_dp_rank_00000.pt"
    path.parent.mkdir(parents=True)
    torch.save({"format": FORMAT, "world_size": 1, "dp_rank": 0, "config": {}, "residual_layout": "flat",
                "residuals": old, "generators": {}, "stats": {"steps": 4}, "momentum": None}, path)
    msg = load_state(fresh, str(tmp_path / "old"), "tag", world_size=1, device=torch.device("cpu"))
    assert "stored in fp32 and are now stored in fp8" in msg and fresh.reducer.thresholds == {}
    for k, v in old.items():
        got = fresh.memory.get(k)
        assert bool(((got - v).abs() <= 2**-4 * v.abs() + 1e-5 * float(v.abs().max())).all()) and not torch.equal(got, v)


@pytest.mark.parametrize("suffix", ["_momentum", "_mc"])
def test_resume_with_local_momentum_is_bit_identical(suffix):
    """Saved at step 5, resumed in new processes: losses, parameters, residuals and the local momenta equal the
    uninterrupted run's bit for bit. ``_momentum``: compressed_momentum frozen after step 3, and the resumed run is
    frozen again. ``_mc``: SGD with DGC's momentum correction (density 0.1, INT4, masking, local clipping, weight
    decay, thresholds reused for 3 steps): the velocities and the thresholds being reused are in the side-car, the
    weight-decay momentum in the optimizer state."""
    out = tempfile.mkdtemp()
    full, _ = run("resume_full" + suffix, out)  # saves after step 5
    second, _ = run("resume_second" + suffix, out)
    for r in range(2):
        assert second[r]["losses"] == full[r]["losses"][5:]
        assert all(torch.equal(a, b) for a, b in zip(second[r]["params"], full[r]["params"]))
        assert second[r]["momenta"].keys() == full[r]["momenta"].keys() and second[r]["momenta"]
        assert all(torch.equal(second[r]["momenta"][k], full[r]["momenta"][k]) for k in full[r]["momenta"])
        assert all(torch.equal(second[r]["residuals"][k], full[r]["residuals"][k]) for k in full[r]["residuals"])
        if suffix == "_momentum":
            assert second[r]["frozen"] and full[r]["frozen"]
        else:  # momentum factor masking happened
            assert any(bool((v == 0).any()) for v in full[r]["momenta"].values())
