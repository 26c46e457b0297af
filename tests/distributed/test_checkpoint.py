"""Checkpoint and resume with DGC state (residuals, sampling generators, thresholds, momenta, telemetry) in real
processes: bit-identical resume, checkpoints without the side-car, DGC checkpoints into runs without DGC, another
world size through a universal checkpoint."""

import glob
import math
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch

from dist_launch import launch_scenarios, run_scenario, run_scenarios
from deepspeed_dgc.memory.error_feedback import ErrorFeedback
from deepspeed_dgc.zero3.checkpoint import read_sidecar

from scenarios import CrashWhileSaving, Resume, SaveMidway, Train

from .test_engine import SPARSE

STEPS = 10
MOMENTUM = {"dgc": dict(SPARSE, compressed_momentum={"freeze_step": 3, "quantization": "int2"})}
# thresholds estimated at steps 0, 3, 6, 9: the checkpoint after step 5 holds one mid-reuse
MC = {"dgc": dict(SPARSE, momentum_correction=True, local_clip_norm=1.0, threshold_reuse_steps=3),
      "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}},
      "zero_allow_untested_optimizer": True}
DEMO = {"dgc": {"enabled": True, "decoupled_momentum": {"chunk": 16, "topk": 3, "quantization": "int2",
                                                       "storage": "bf16"}}}
MASK = {"dgc": {"enabled": True, "residual_dtype": "bf16", "shared_mask": {"density": 0.1, "quantization": "int2"}}}
HIER = {"topology": "hierarchical", "ranks_per_node": 2}  # at 4 ranks: 2 nodes of 2
MOMENTUM_HIER = {"dgc": dict(MOMENTUM["dgc"], residual_dtype="fp8", **HIER)}
MC_HIER = dict(MC, dgc=dict({k: v for k, v in MC["dgc"].items() if k != "local_clip_norm"}, **HIER))
DEMO_INT8 = {"dgc": dict(DEMO["dgc"], decoupled_momentum=dict(DEMO["dgc"]["decoupled_momentum"], storage="int8"))}
DEMO_HIER = {"dgc": dict(DEMO_INT8["dgc"], **HIER)}
MASK_HIER = {"dgc": dict(MASK["dgc"], residual_dtype="int8", **HIER)}
_SHARED = {}


def uninterrupted():
    """The 10-step run every resume test compares against, which saves a checkpoint after step 5 without changing
    its course (run once per session). Returns ``(src_dir, records)``: a directory holding ``ckpt/``, and the run's
    records per rank."""
    if "full" not in _SHARED:
        src = tempfile.mkdtemp()
        job = SaveMidway(steps=STEPS, ckpt=f"{src}/ckpt", save_at=5, config={"dgc": SPARSE})
        _SHARED["full"] = (src, run_scenario(job, out=src))
    return _SHARED["full"]


def saved_at_step_5():
    """A fresh copy of the uninterrupted run's checkpoint saved at step 5 by 2 ranks."""
    src, _ = uninterrupted()
    out = tempfile.mkdtemp()
    shutil.copytree(os.path.join(src, "ckpt"), os.path.join(out, "ckpt"))
    return out


def resume(out, config, world=2):
    """Load the latest checkpoint of ``out/ckpt`` and run steps 5..9; returns (records, launch results)."""
    return run_scenario(Resume(steps=STEPS, ckpt=f"{out}/ckpt", resume_at=5, config=config), world, out=out, logs=True)


def test_resume_is_bit_identical():
    _, full = uninterrupted()
    out = saved_at_step_5()
    sidecars = sorted(glob.glob(f"{out}/ckpt/*/dgc_state_dp_rank_*.pt"))
    assert len(sidecars) == 2
    torch.load(sidecars[0], weights_only=True)  # plain tensors and containers only
    saved = read_sidecar(sidecars[0])  # its checksum checked
    assert saved["world_size"] == 2 and saved["residuals"]
    second, _ = resume(out, {"dgc": SPARSE})
    for r in range(2):
        # new processes continue exactly where the first ones stopped
        assert second[r].losses == full[r].losses[5:]
        for a, b in zip(second[r].params[-1], full[r].params[-1]):
            assert torch.equal(a, b)
        assert second[r].residuals[-1].keys() == full[r].residuals[-1].keys()
        for k in full[r].residuals[-1]:
            assert torch.equal(second[r].residuals[-1][k], full[r].residuals[-1][k])
        assert second[r].stats["steps"] == STEPS
    # DeepSpeed's own files still load: the fp32 weights from the ZeRO checkpoint
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    state = get_fp32_state_dict_from_zero_checkpoint(f"{out}/ckpt")
    assert set(state) == {"l1.weight", "l1.bias", "ln.weight", "ln.bias", "l2.weight", "l2.bias"}


def test_resume_after_building_another_model_first_is_bit_identical():
    """The resumed process builds another ZeRO-3 model before the one it resumes (a reference or EMA model): ZeRO-3
    numbers parameters per process, so state keyed by that number would land on the wrong parameters or nowhere.
    Keyed by the parameters' names, the run continues bit-identically, as stock ZeRO-3 does."""
    _, full = uninterrupted()
    out = saved_at_step_5()
    job = Resume(steps=STEPS, ckpt=f"{out}/ckpt", resume_at=5, config={"dgc": SPARSE}, models_before=1)
    second, _ = run_scenario(job, out=out, logs=True)
    for r in range(2):
        assert second[r].losses == full[r].losses[5:]
        assert all(torch.equal(a, b) for a, b in zip(second[r].params[-1], full[r].params[-1]))
        res_a, res_b = second[r].residuals[-1], full[r].residuals[-1]
        assert res_a.keys() == res_b.keys() and all(torch.equal(res_a[k], res_b[k]) for k in res_b)
        assert second[r].keys == ["l1.weight", "l1.bias", "ln.weight", "ln.bias", "l2.weight", "l2.bias"]


def test_resume_with_int8_weights_and_padded_shards_is_bit_identical():
    """INT8 weights gathered in forward and backward, odd-sized parameters (padded shards), and the padding of the
    fp32 master partitions holding 1e30, which DeepSpeed copies into the shards at every step and at checkpoint load:
    the padding never reaches a quantizer's scale, so the poisoned run equals one whose padding was left alone, and
    the run resumed from step 5 (whose load copies the saved 1e30 padding into the shards) equals the uninterrupted
    one, bit for bit."""
    config = {"dgc": dict(SPARSE, weights={"quantization": "int8"}),
              "zero_optimization": {"stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0}}
    out = tempfile.mkdtemp()
    full = run_scenario(SaveMidway(steps=8, ckpt=f"{out}/ckpt", save_at=5, config=config, poison_padding=True), out=out)
    clean = run_scenario(Train(steps=8, config=config))
    second, _ = run_scenario(Resume(steps=8, ckpt=f"{out}/ckpt", resume_at=5, config=config), out=out, logs=True)
    for r in range(2):
        assert all(math.isfinite(x) for x in full[r].losses)
        assert full[r].losses == clean[r].losses  # a quantizer that saw the padding would differ from step 1
        assert all(torch.equal(a, b) for a, b in zip(full[r].params[-1], clean[r].params[-1]))
        assert second[r].losses == full[r].losses[5:]
        assert all(torch.equal(a, b) for a, b in zip(second[r].params[-1], full[r].params[-1]))
        assert full[r].stats["param_wire_bytes_total"] < 0.3 * full[r].stats["param_dense_fp32_bytes_total"]


def test_a_stock_checkpoint_into_a_dgc_run_starts_the_residuals_at_zero():
    """Saved by stock ZeRO-3 (no side-cars), resumed with DGC on: every rank says the residuals start at zero and
    training goes on, building new ones."""
    out = tempfile.mkdtemp()
    run_scenario(SaveMidway(steps=STEPS, ckpt=f"{out}/ckpt", save_at=5), out=tempfile.mkdtemp())
    second, results = resume(out, {"dgc": SPARSE})
    for r in range(2):
        assert "error-feedback residuals start at zero" in results[r].stderr + results[r].stdout
        assert second[r].residuals[-1]  # training went on and built new residuals


def _resume_fails(out, config):
    """Resume from ``out/ckpt`` expecting every rank to fail (no hang): the ranks' stderr."""
    ranks = launch_scenarios([Resume(steps=STEPS, ckpt=f"{out}/ckpt", resume_at=5, config=config)], timeout_s=240,
                             out=tempfile.mkdtemp())
    assert all(r.returncode != 0 for r in ranks), [r.stderr[-1500:] for r in ranks]
    return [r.stderr for r in ranks]


def test_a_dgc_checkpoint_whose_sidecars_are_gone_fails_on_every_rank():
    """Saved with DGC, its side-cars deleted: DeepSpeed's files say it had them, so the resume fails on every rank
    with DGCCheckpointError naming the missing file, instead of restarting the residuals (and a method's momentum)
    at zero unnoticed."""
    out = saved_at_step_5()
    for path in glob.glob(f"{out}/ckpt/*/dgc_state_dp_rank_*.pt"):
        os.unlink(path)
    for r, err in enumerate(_resume_fails(out, {"dgc": SPARSE})):
        assert "DGCCheckpointError" in err and f"dgc_state_dp_rank_{r:05d}.pt is missing" in err, err[-1500:]


def test_a_damaged_sidecar_fails_on_every_rank_naming_it():
    """Rank 1's side-car cut to half its length: rank 1 raises DGCCheckpointError naming the file, rank 0 one saying
    that rank 1 failed; neither hangs or loads anything."""
    out = saved_at_step_5()
    (path,) = glob.glob(f"{out}/ckpt/*/dgc_state_dp_rank_00001.pt")
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[:len(data) // 2])
    errs = _resume_fails(out, {"dgc": SPARSE})
    assert "DGCCheckpointError" in errs[1] and "dgc_state_dp_rank_00001.pt cannot be read" in errs[1], errs[1][-1500:]
    assert "DGCCheckpointError" in errs[0] and "failed on rank(s) [1]" in errs[0], errs[0][-1500:]


def test_dgc_checkpoint_into_a_run_without_dgc_says_what_is_ignored():
    """Saved with DGC, loaded with DGC off: DeepSpeed's weights load as usual (the first step after loading starts
    from the saved weights: its loss equals the uninterrupted DGC run's sixth loss), and every rank says that the
    side-car's residuals are dropped (every method, both ways: tests/distributed/test_switching.py)."""
    _, full = uninterrupted()
    out = saved_at_step_5()
    second, results = resume(out, {})
    for r in range(2):
        log = results[r].stderr + results[r].stdout
        assert ("this run has DGC off, so its error-feedback residuals (the gradient not yet sent) are DROPPED"
                in log), log[-2000:]
        assert "dgc_state_dp_rank_" in log
        assert second[r].stats is None
        assert second[r].losses[0] == full[r].losses[5]  # same weights at the start of step 6
        assert second[r].losses[1:] != full[r].losses[6:]  # then stock ZeRO-3 reduces differently


def test_world_size_2_saved_loaded_at_3():
    """DeepSpeed refuses a ZeRO checkpoint at another data-parallel size (every rank raises); its universal
    checkpoint (ds_to_universal) loads at 3 ranks, and the DGC residuals of the 2 saved ranks are re-sharded: summed
    and split evenly, so the gradient not yet sent is conserved (up to the rounding of the default fp8 storage of
    each rank's share; the arithmetic is checked exactly in fp32 by tests/unit/zero3/test_checkpoint.py)."""
    out = saved_at_step_5()
    refused = launch_scenarios([Resume(steps=STEPS, ckpt=f"{out}/ckpt", resume_at=5, config={"dgc": SPARSE})], world=3,
                               timeout_s=240, out=tempfile.mkdtemp())
    for r in refused:
        assert r.returncode != 0  # no hang, no silent partial load
    assert any("used a DP world size of 2 but the current world size is 3" in r.stderr for r in refused)
    tag = open(f"{out}/ckpt/latest").read().strip()
    conv = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                           f"{out}/ckpt/{tag}", "--output_folder", f"{out}/ckpt/{tag}_universal",
                           "--num_extract_workers", "1", "--num_merge_workers", "1"],
                          capture_output=True, text=True, timeout=300)
    assert conv.returncode == 0, conv.stderr[-3000:]
    third, results = resume(out, {"dgc": SPARSE, "checkpoint": {"load_universal": True}}, world=3)
    sides = [read_sidecar(f"{out}/ckpt/{tag}/dgc_state_dp_rank_{r:05d}.pt", tag) for r in range(2)]
    assert all(s["residual_storage"] == "fp8" for s in sides)  # "auto" on the flat topology
    saved = [{k: ErrorFeedback.decode(v) for k, v in s["residuals"].items()} for s in sides]
    for r in range(3):
        log = results[r].stderr + results[r].stdout
        assert "saved at data-parallel world size 2, this run has 3: re-sharded" in log, log[-2000:]
        assert len(third[r].losses) == 5 and all(math.isfinite(x) for x in third[r].losses)
    loaded = [third[r].loaded_residuals for r in range(3)]
    assert set(loaded[0]) == set(saved[0])
    for k in saved[0]:
        before = saved[0][k].double() + saved[1][k].double()
        after = sum(loaded[r][k].double() for r in range(3))
        # fp8 e4m3: relative error <= 2^-4; values far below their group's absmax may flush to zero
        assert bool(((after - before).abs() <= 2**-4 * before.abs() + 1e-5 * float(before.abs().max())).all())
        assert not torch.equal(after, before) or bool((before == 0).all())  # really stored in fp8
        assert torch.equal(loaded[0][k], loaded[2][k])  # an even split


LOCAL_MOMENTUM = {  # case -> (ds_config, world size)
    "compressed_momentum": (MOMENTUM, 2), "momentum_correction": (MC, 2), "decoupled_momentum": (DEMO, 2),
    "decoupled_momentum-int8": (DEMO_INT8, 2), "shared_mask": (MASK, 2), "compressed_momentum-fp8-2x2": (MOMENTUM_HIER, 4), "momentum_correction-2x2": (MC_HIER, 4),
    "decoupled_momentum-2x2": (DEMO_HIER, 4), "shared_mask-2x2": (MASK_HIER, 4)}


@pytest.fixture(scope="module")
def local_momentum_runs():
    """Every LOCAL_MOMENTUM case run for 10 steps saving at step 5, and resumed from that checkpoint in new processes.
    Per world size, one launch runs every case's full run in turn (each into its own checkpoint directory) and one
    launch resumes them all in turn: case -> (full run's records, resumed run's records)."""
    runs, by_world = {}, {}
    for case, (_, world) in LOCAL_MOMENTUM.items():
        by_world.setdefault(world, []).append(case)
    for world, cases in by_world.items():
        out = tempfile.mkdtemp()
        jobs = {case: dict(steps=STEPS, ckpt=f"{out}/{case}", config=LOCAL_MOMENTUM[case][0]) for case in cases}
        full = run_scenarios({case: SaveMidway(**job, save_at=5) for case, job in jobs.items()}, world=world)
        second = run_scenarios({case: Resume(**job, resume_at=5) for case, job in jobs.items()}, world=world)
        runs.update({case: (full[case], second[case]) for case in cases})
    return runs


@pytest.mark.parametrize("case", list(LOCAL_MOMENTUM))
def test_resume_with_local_momentum_is_bit_identical(local_momentum_runs, case):
    """Saved at step 5, resumed in new processes: losses, parameters, residuals and the local momenta equal the
    uninterrupted run's bit for bit. compressed_momentum: frozen after step 3, and the resumed run is frozen again.
    decoupled_momentum: INT2 coefficients, the momentum stored in bf16 (the sign update in the owners' step); ``-int8``
    and ``-2x2``: stored in int8 with stochastic rounding (the noise drawn again the same after the resume).
    shared_mask: the masks are not saved but chosen again from the loaded Adam state, as after step 5.
    momentum_correction: SGD (density 0.1, INT4, masking, local clipping, weight decay, thresholds reused for 3
    steps): the velocities and the thresholds being reused are in the side-car, the weight-decay momentum in the
    optimizer state. ``-2x2``: the same on 4 ranks as 2 nodes of 2 (hierarchical topology: residuals and momenta of
    the node-level sums; compressed momentum with fp8 residuals; the masks shared between nodes, int8 residuals). The cases of a
    world size save in one launch and resume in another, one after the other in the same processes."""
    config, world = LOCAL_MOMENTUM[case]
    full, second = local_momentum_runs[case]
    for r in range(world):
        assert second[r].losses == full[r].losses[5:]
        assert all(torch.equal(a, b) for a, b in zip(second[r].params[-1], full[r].params[-1]))
        res_a, res_b = second[r].residuals[-1], full[r].residuals[-1]
        assert res_a.keys() == res_b.keys() and all(torch.equal(res_a[k], res_b[k]) for k in res_b)
        if world == 4:  # node-level: N x ceil(n / W) elements, 1/L of each parameter (plus padding)
            node_level = res_b if config is MASK_HIER else full[r].momenta[-1]
            for key, p in zip(full[r].keys, full[r].params[-1]):
                assert node_level[key].numel() == 2 * -(-p.numel() // 4), key
        if config in (MASK, MASK_HIER):  # no local momentum; the residuals hold what the masks left
            assert not second[r].momenta and not full[r].momenta and res_b
            continue
        mom_a, mom_b = second[r].momenta[-1], full[r].momenta[-1]
        assert mom_a.keys() == mom_b.keys() and mom_a
        assert all(torch.equal(mom_a[k], mom_b[k]) for k in mom_b)
        if config in (MOMENTUM, MOMENTUM_HIER):
            assert second[r].frozen and full[r].frozen
        elif config in (MC, MC_HIER):  # momentum factor masking happened
            assert any(bool((v == 0).any()) for v in mom_b.values())


@pytest.mark.parametrize("point, victim", [("sidecar", 0), ("sidecar", 1), ("deepspeed", 0), ("deepspeed", 1)])
def test_killed_while_saving_latest_names_the_last_complete_checkpoint(point, victim):
    """Saved at step 5, then killed saving at step 8: rank ``victim`` dies (SIGKILL) inside its side-car write (before
    the rename) or inside DeepSpeed's own files (after every side-car is written; rank 1 there: stock DeepSpeed would
    have rank 0 name step 8 in ``latest`` after its own files). Every rank ends (none hangs), ``latest`` still names
    step 5, no step-8 side-car of the victim exists under its final name, and resuming from ``latest`` is
    bit-identical to the uninterrupted run. Step 8 asked for by name fails on every rank, saying it is incomplete."""
    _, full = uninterrupted()
    out = tempfile.mkdtemp()
    ranks = launch_scenarios([CrashWhileSaving(steps=STEPS, ckpt=f"{out}/ckpt", save_at=5, crash_at=8, point=point,
                                               victim=victim, config={"dgc": SPARSE})], timeout_s=240,
                             out=tempfile.mkdtemp())
    assert ranks[victim].returncode == -9 and ranks[1 - victim].returncode != 0
    assert open(f"{out}/ckpt/latest").read().strip() == "global_step5"
    if point == "sidecar":
        assert not os.path.exists(f"{out}/ckpt/global_step8/dgc_state_dp_rank_{victim:05d}.pt")
    if (point, victim) == ("deepspeed", 1):  # the unfinished tag, asked for by name: refused before DeepSpeed loads it
        refused = launch_scenarios([Resume(steps=STEPS, ckpt=f"{out}/ckpt", resume_at=8, tag="global_step8",
                                           config={"dgc": SPARSE})], timeout_s=240, out=tempfile.mkdtemp())
        assert all(r.returncode != 0 for r in refused)
        assert all("global_step8 is incomplete" in r.stderr and "'latest' names 'global_step5'" in r.stderr
                   for r in refused), refused[0].stderr[-3000:]
    second, _ = resume(out, {"dgc": SPARSE})
    for r in range(2):
        assert second[r].losses == full[r].losses[5:]
        assert all(torch.equal(a, b) for a, b in zip(second[r].params[-1], full[r].params[-1]))
