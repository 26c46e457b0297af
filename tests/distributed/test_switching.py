"""Switching the gradient method across a checkpoint, in real processes (docs/faults.md, "Switching methods across a
checkpoint"): a stock ZeRO-3 checkpoint resumed under every method, every method's checkpoint resumed by stock
ZeRO-3, and methods into one another, both ways; at the same world size and at another one through a universal
checkpoint (``python -m deepspeed_dgc universal``, which also converts checkpoints without Adam's moments).

One launch of 2 ranks saves every run (8 steps, a checkpoint after step 4), one launch resumes every same-size case,
one of 3 ranks every universal case. Each case checks that every rank logged one warning naming what carried, what
was dropped and what starts from zero (:data:`SAME_WORLD`, :data:`UNIVERSAL`), that training went on with finite
losses, and where state carries that it did: residuals equal to the saved ones (up to the new storage's rounding),
the resumed run equal to the uninterrupted one bit for bit where the state converts exactly (sparse top-k into
compressed momentum before its freeze), the optimizer state rebuilt from zero where it was empty.
"""

import math
import os
import tempfile

import pytest
import torch

from dist_launch import run_scenarios
from deepspeed_dgc.memory.error_feedback import ErrorFeedback
from deepspeed_dgc.zero3 import universal
from deepspeed_dgc.zero3.checkpoint import read_sidecar

from scenarios import SaveMidway
from scenarios.switching import SwitchResume

from distributed.test_checkpoint import DEMO, MASK, MC, MOMENTUM
from distributed.test_engine import LOSSLESS, SPARSE
from faults.test_world_size import tolerance

STEPS, SAVE_AT = 8, 4
TAG = f"global_step{SAVE_AT}"
# without gradient clipping (DeepSpeed 0.19.8 clips at 1.0 by default), which momentum correction switches off
SGD = {"optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}},
       "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0}
RUNS = {  # name -> ds_config (merged into scenarios.model.BASE, whose optimizer is Adam)
    "stock": {},
    "sgd": SGD,  # stock ZeRO-3 with momentum SGD
    "int4": {"dgc": {"enabled": True}},  # the default: dense INT4 with error feedback, fp8 residuals
    "topk": {"dgc": SPARSE},  # sparse top-k (density 0.1) with error feedback
    "mask": MASK,  # shared masks, bf16 residuals
    "cm": MOMENTUM,  # compressed momentum, frozen after step 3: saved past its freeze
    "mc": MC,  # momentum correction (SGD)
    "demo": DEMO,  # decoupled momentum, sign update (AdamW's moments never written)
    "demo_sgd": dict(SGD, dgc=DEMO["dgc"]),  # the same with SGD
    # loaded only: compressed momentum over sparse top-k, not frozen within the resumed steps (sends gradients as
    # top-k does); momentum correction sending everything exactly (momentum SGD itself)
    "cm_late": {"dgc": dict(SPARSE, compressed_momentum={"freeze_step": 100, "quantization": "int2"})},
    "mc_exact": dict(SGD, dgc=dict(LOSSLESS, momentum_correction=True)),
}
SAVED = ["stock", "sgd", "int4", "topk", "mask", "cm", "mc", "demo", "demo_sgd"]

DROP_DEMO = "decoupled momentum's per-rank momentum (DeMo's delta: what each rank has not sent yet) is DROPPED"
DROP_CM = ("its error-feedback residuals (compressed momentum's momentum not yet sent) are DROPPED",
           "compressed momentum's per-rank momenta (each rank's Adam first moment) are DROPPED")
DROP_MC = ("its error-feedback residuals (momentum correction's velocity not yet sent) are DROPPED",
           "momentum correction's per-rank velocities are DROPPED")
ADAM_FROM_ZERO = ("the checkpoint's optimizer state holds no exp_avg and exp_avg_sq (decoupled momentum's sign update "
                  "keeps none): AdamW's exp_avg and exp_avg_sq (and its step count) start from zero")
ADAM_NOT_USED = ("AdamW's exp_avg and exp_avg_sq loaded from the checkpoint are NOT USED by decoupled momentum's sign "
                 "update")
ADAM_STALE = ("AdamW's exp_avg and exp_avg_sq are STALE: compressed momentum froze them after its step 3, 1 step(s) "
              "before this checkpoint")
TOPK = "top-k / quantization with error feedback"
CARRY = "its error-feedback residuals (the gradient not yet sent) carry over"
DGC_OFF = "this run has DGC off, so "

SAME_WORLD = {  # (saved, loaded) -> what every rank's warning on loading says
    # stock ZeRO-3 -> each method
    ("stock", "int4"): ["no deepspeed_dgc state", "error-feedback residuals start at zero"],
    ("stock", "mask"): ["no deepspeed_dgc state", "error-feedback residuals start at zero"],
    ("stock", "cm"): ["error-feedback residuals start at zero, and so do compressed momentum's per-rank momenta (Adam "
                      "steps on its own for 'freeze_step' = 3 steps"],
    ("sgd", "mc"): ["error-feedback residuals start at zero, and so do momentum correction's per-rank velocities",
                    "SGD's momentum_buffer (the velocity so far) carries over as momentum correction's weight-decay "
                    "momentum"],
    ("sgd", "mc_exact"): ["SGD's momentum_buffer (the velocity so far) carries over"],
    ("stock", "demo"): ["decoupled momentum's per-rank momentum starts at zero", ADAM_NOT_USED],
    # each method -> stock ZeRO-3
    ("int4", "stock"): [f"saved with {TOPK}", DGC_OFF + CARRY[:-len("carry over")] + "are DROPPED",
                        "DeepSpeed's weights and optimizer state loaded as usual"],
    ("mask", "stock"): ["saved with shared masks", DGC_OFF + "its error-feedback residuals (the gradient not yet sent) "
                        "are DROPPED"],
    ("cm", "stock"): [DGC_OFF + DROP_CM[0], DROP_CM[1], ADAM_STALE],
    ("mc", "sgd"): [DGC_OFF + DROP_MC[0], DROP_MC[1], "SGD's momentum_buffer holds at most the weight-decay term's "
                    "momentum", "so the velocity of the gradient restarts at zero"],
    ("demo", "stock"): ["saved with decoupled momentum", DGC_OFF + DROP_DEMO, ADAM_FROM_ZERO],
    ("demo_sgd", "sgd"): [DGC_OFF + DROP_DEMO, "the checkpoint's optimizer state holds no momentum_buffer (decoupled "
                          "momentum's sign update keeps none): SGD's momentum_buffer starts from zero"],
    # methods into one another, both ways
    ("int4", "mask"): [f"saved with another method ({TOPK}), this run has shared masks: {CARRY}",
                       "stored in fp8 and are now stored in bf16"],
    ("mask", "int4"): [f"saved with another method (shared masks), this run has {TOPK}: {CARRY}"],
    ("topk", "cm_late"): [f"this run has compressed momentum: {CARRY}",
                          "compressed momentum's per-rank momenta start at zero"],
    ("cm", "int4"): [DROP_CM[0] + ": this run's hold the gradient not yet sent", DROP_CM[1], ADAM_STALE],
    ("int4", "demo"): [CARRY + " into decoupled momentum's per-rank momentum, which sends them (rounded once into its "
                       "bf16 storage)", ADAM_NOT_USED,
                       ": 6 momenta, step 4"],
    ("demo", "int4"): [f"this run has {TOPK}: " + DROP_DEMO, ADAM_FROM_ZERO],
    ("demo", "mask"): ["this run has shared masks: " + DROP_DEMO, ADAM_FROM_ZERO],
    ("demo", "cm"): [DROP_DEMO, "compressed momentum's per-rank momenta start at zero", ADAM_FROM_ZERO],
    ("cm", "demo"): [DROP_CM[0] + ": decoupled momentum keeps none", DROP_CM[1],
                     "decoupled momentum's per-rank momentum starts at zero", ADAM_NOT_USED],
    ("mc", "demo_sgd"): [DROP_MC[0] + ": decoupled momentum keeps none", DROP_MC[1],
                         "SGD's momentum_buffer loaded from the checkpoint is NOT USED by decoupled momentum's sign "
                         "update"],
    ("demo_sgd", "mc"): [DROP_DEMO, "momentum correction's per-rank velocities start at zero",
                         "SGD's momentum_buffer starts from zero"],
}
UNIVERSAL = {  # (saved at 2 ranks, loaded at 3 from its universal checkpoint) -> the warning's words
    ("demo", "stock"): [DGC_OFF + DROP_DEMO, "AdamW's exp_avg and exp_avg_sq (and its step count) start from zero: the "
                        "saved optimizer kept no exp_avg and exp_avg_sq (decoupled momentum's sign update keeps none), "
                        "and the universal conversion wrote zeros"],
    ("mc", "sgd"): [DGC_OFF + DROP_MC[0], DROP_MC[1], "SGD's momentum_buffer starts from zero: DeepSpeed's universal "
                    "checkpoint holds only Adam's exp_avg and exp_avg_sq"],
    ("stock", "demo"): ["decoupled momentum's per-rank momentum starts at zero", ADAM_NOT_USED],
    ("int4", "demo"): ["saved at data-parallel world size 2, this run has 3: re-sharded 6 residuals",
                       CARRY + " into decoupled momentum's per-rank momentum, which sends them (rounded once into "
                       "its bf16 storage)"],
    ("cm", "int4"): ["this run has 3: re-sharded 0 residuals", DROP_CM[0], DROP_CM[1], ADAM_STALE],
}


def _name(case):
    return "-to-".join(case)


@pytest.fixture(scope="module")
def saved():
    """Every saving run of :data:`SAVED`, 8 steps with a checkpoint after step 4, in one launch of 2 ranks:
    ``(directory, name -> the records of its ranks)``; the checkpoint of run ``name`` is ``directory/name``."""
    out = tempfile.mkdtemp()
    records = run_scenarios({name: SaveMidway(steps=STEPS, ckpt=f"{out}/{name}", save_at=SAVE_AT, config=RUNS[name])
                             for name in SAVED}, timeout_s=600)
    return out, records


def _config(saved_name, loaded_name, universal_=False):
    config = dict(RUNS[loaded_name])
    return dict(config, checkpoint={"load_universal": True}) if universal_ else config


@pytest.fixture(scope="module")
def same_world(saved):
    """Every :data:`SAME_WORLD` case resumed at 2 ranks in one launch: case -> the records of its ranks."""
    out, _ = saved
    jobs = {_name(c): SwitchResume(steps=STEPS, ckpt=f"{out}/{c[0]}", resume_at=SAVE_AT, config=_config(*c))
            for c in SAME_WORLD}
    records = run_scenarios(jobs, timeout_s=600)
    return {c: records[_name(c)] for c in SAME_WORLD}


@pytest.fixture(scope="module")
def at_three(saved):
    """Every :data:`UNIVERSAL` case: its saved checkpoint converted once (in this process) by
    :func:`deepspeed_dgc.zero3.universal.convert`, then resumed at 3 ranks, all in one launch: case -> records."""
    out, _ = saved
    notes = {}
    for name in sorted({c[0] for c in UNIVERSAL}):
        notes[name] = universal.convert(f"{out}/{name}/{TAG}", f"{out}/{name}/{TAG}_universal")
    jobs = {_name(c): SwitchResume(steps=STEPS, ckpt=f"{out}/{c[0]}", resume_at=SAVE_AT, config=_config(*c, True))
            for c in UNIVERSAL}
    records = run_scenarios(jobs, world=3, timeout_s=600)
    return notes, {c: records[_name(c)] for c in UNIVERSAL}


def _check_log_and_training(case, ranks, words):
    """Every rank logged one warning of the load holding every phrase of ``words``, and trained on."""
    for r, rec in enumerate(ranks):
        lines = [(level, msg) for level, msg in rec.log if f"[deepspeed_dgc] rank {r}:" in msg]
        assert len(lines) == 1, (case, r, rec.log)
        level, msg = lines[0]
        assert level == "WARNING", (case, r, msg)
        for w in words:
            assert w in msg, (case, r, w, msg)
        assert len(rec.train.losses) == STEPS - SAVE_AT and all(math.isfinite(x) for x in rec.train.losses), case


def _saved_residuals(out, name, world=2):
    """Each saved rank's residuals, decoded to fp32, and the storage they were saved in."""
    sides = [read_sidecar(f"{out}/{name}/{TAG}/dgc_state_dp_rank_{r:05d}.pt", TAG) for r in range(world)]
    return [{k: ErrorFeedback.decode(v) for k, v in s["residuals"].items()} for s in sides], sides[0]["residual_storage"]


def _close(got, want, storage):
    return got.keys() == want.keys() and all(
        bool(((got[k].double() - want[k].double()).abs() <= tolerance(storage, want[k].double())).all()) for k in want)


@pytest.mark.parametrize("case", list(SAME_WORLD), ids=[_name(c) for c in SAME_WORLD])
def test_resume_under_another_method(saved, same_world, case):
    """See the module docstring; beyond the warning, per case: what carried equals what was saved, what was dropped
    is gone, and the optimizer state is what the warning says."""
    out, full = saved
    ranks = same_world[case]
    _check_log_and_training(case, ranks, SAME_WORLD[case])
    saved_name, loaded_name = case
    if saved_name != "stock" and saved_name != "sgd":
        residuals, storage = _saved_residuals(out, saved_name)
    for r, rec in enumerate(ranks):
        loaded, momenta = rec.train.loaded_residuals, rec.train.loaded_momenta
        if loaded_name in ("stock", "sgd"):
            assert loaded is None and rec.train.stats is None  # DGC off
        if case in (("int4", "mask"), ("mask", "int4")):  # carried, stored again in this run's storage
            assert residuals[r] and _close(loaded, residuals[r], rec.train.residual_storage), (case, r)
        if case == ("topk", "cm_late"):  # the same storage: bit for bit, and the same run as if never switched
            assert loaded.keys() == residuals[r].keys() and all(torch.equal(loaded[k], residuals[r][k]) for k in loaded)
            assert momenta == {}  # its momenta start at zero
            assert rec.train.losses == full["topk"][r].losses[SAVE_AT:]
            assert all(torch.equal(a, b) for a, b in zip(rec.train.params[-1], full["topk"][r].params[-1]))
        if case == ("int4", "demo"):  # into decoupled momentum's momentum (stored in bf16)
            assert any(bool(v.abs().sum() > 0) for v in residuals[r].values())
            assert _close(momenta, residuals[r], "bf16"), case
        if case == ("sgd", "mc_exact"):  # SGD's velocity carried: momentum SGD goes on (to float rounding)
            assert rec.train.losses == pytest.approx(full["sgd"][r].losses[SAVE_AT:], rel=1e-5, abs=1e-7), case
        if case in (("cm", "int4"), ("cm", "demo")):
            assert loaded == {}  # the frozen momentum's residuals dropped
        if saved_name in ("demo", "demo_sgd", "cm", "mc") and momenta is not None:
            assert momenta == {} or not any(bool(v.abs().sum() > 0) for v in momenta.values()), case
        if saved_name in ("demo", "demo_sgd") and loaded_name in ("stock", "int4", "mask", "cm", "sgd", "mc"):
            # no moments in the checkpoint: the optimizer builds them at its first step after the load, from zero
            assert all(keys == [] for keys in rec.after_load["keys"]), (case, rec.after_load)
            if loaded_name not in ("sgd", "mc"):  # Adam's step count then is 1
                assert rec.after_step["steps"] == [1.0] * len(rec.after_step["steps"]), (case, rec.after_step)
        if case == ("stock", "demo"):  # kept, not used: as loaded after a sign step
            assert all("exp_avg" in keys for keys in rec.after_step["keys"])
        if case == ("demo", "cm"):
            assert rec.train.frozen  # compressed momentum froze Adam's rebuilt second moment after 3 steps


@pytest.mark.parametrize("case", list(UNIVERSAL), ids=[_name(c) for c in UNIVERSAL])
def test_resume_under_another_method_at_another_world_size(saved, at_three, case):
    """Saved at 2 ranks, converted to a universal checkpoint by ``deepspeed_dgc.zero3.universal`` (DeepSpeed's own
    ``ds_to_universal`` raises ``KeyError`` on decoupled momentum's and SGD's optimizer state), resumed at 3 under
    another method or stock: the warning names what was dropped, what starts from zero and why; a gradient residual
    re-sharded into decoupled momentum's momentum is conserved (its sum over the ranks)."""
    out, _ = saved
    notes, runs = at_three
    ranks = runs[case]
    _check_log_and_training(case, ranks, UNIVERSAL[case])
    saved_name, loaded_name = case
    if saved_name in ("demo", "mc"):  # no Adam moments: zeros and step 0 written, and noted
        assert notes[saved_name]["filled"] == ["exp_avg", "exp_avg_sq"]
        assert notes[saved_name]["not_carried"] == (["momentum_buffer"] if saved_name == "mc" else [])
        assert os.path.isfile(f"{out}/{saved_name}/{TAG}_universal/dgc_universal.json")
    else:
        assert notes[saved_name] is None
    if case == ("demo", "stock"):  # zeros at step 0: Adam's first step after the load is its first
        for rec in ranks:
            assert rec.after_load["steps"] == [0.0] * len(rec.after_load["steps"]), rec.after_load
            assert rec.after_step["steps"] == [1.0] * len(rec.after_step["steps"]), rec.after_step
    if case == ("mc", "sgd"):  # the zeros SGD does not read are not kept
        assert all("exp_avg" not in keys for rec in ranks for keys in rec.after_load["keys"])
    if case == ("int4", "demo"):
        residuals, _ = _saved_residuals(out, "int4")
        before = {k: residuals[0][k].double() + residuals[1][k].double() for k in residuals[0]}
        after = {k: sum(rec.train.loaded_momenta[k].double() for rec in ranks) for k in before}
        assert _close(after, before, "bf16")
    if case == ("cm", "int4"):
        assert all(rec.train.loaded_residuals == {} for rec in ranks)
