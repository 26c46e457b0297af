"""Switching the gradient method across a checkpoint, on its own (no processes): the table of what carries between
every saved and loaded method (:func:`deepspeed_dgc.zero3.switching.plan`), what the log says, the optimizer state made
usable (a step count without Adam's moments, on which torch's Adam raises ``KeyError: 'exp_avg'``), and the staging of
a universal conversion for a checkpoint without Adam's moments. The same in real processes, both ways for every
method: tests/distributed/test_switching.py."""

import json
import os
from types import SimpleNamespace

import pytest
import torch

from deepspeed_dgc.config import DGCConfig
from deepspeed_dgc.zero3 import switching, universal
from deepspeed_dgc.zero3.checkpoint import NOT_ROUTINE

CONFIGS = {  # method -> its "dgc" section
    "topk": DGCConfig(enabled=True, density=0.1),
    "shared_mask": DGCConfig(enabled=True, shared_mask={"density": 0.1}),
    "compressed_momentum": DGCConfig(enabled=True, compressed_momentum={"freeze_step": 3}),
    "momentum_correction": DGCConfig(enabled=True, momentum_correction=True),
    "decoupled_momentum": DGCConfig(enabled=True, decoupled_momentum={}),
}
MOMENTUM = {"momenta": {"a": torch.ones(3)}, "steps_done": 5}  # past compressed momentum's freeze (3)
EARLY = {"momenta": {"a": torch.ones(3)}, "steps_done": 2}  # before it

# (saved, loaded) -> what happens to the saved residuals: "load", "momentum" (into decoupled momentum's), "drop";
# "cm-early": compressed momentum saved before its freeze (its residuals hold the gradient)
TABLE = {
    ("topk", "shared_mask"): "load", ("topk", "compressed_momentum"): "load", ("topk", "momentum_correction"): "drop",
    ("topk", "decoupled_momentum"): "momentum",
    ("shared_mask", "topk"): "load", ("shared_mask", "compressed_momentum"): "load",
    ("shared_mask", "momentum_correction"): "drop", ("shared_mask", "decoupled_momentum"): "momentum",
    ("compressed_momentum", "topk"): "drop", ("compressed_momentum", "shared_mask"): "drop",
    ("compressed_momentum", "momentum_correction"): "drop", ("compressed_momentum", "decoupled_momentum"): "drop",
    ("cm-early", "topk"): "load", ("cm-early", "shared_mask"): "load", ("cm-early", "decoupled_momentum"): "momentum",
    ("momentum_correction", "topk"): "drop", ("momentum_correction", "shared_mask"): "drop",
    ("momentum_correction", "compressed_momentum"): "drop", ("momentum_correction", "decoupled_momentum"): "drop",
    ("decoupled_momentum", "topk"): "drop", ("decoupled_momentum", "shared_mask"): "drop",
    ("decoupled_momentum", "compressed_momentum"): "drop", ("decoupled_momentum", "momentum_correction"): "drop",
}


def _saved(name):
    method = "compressed_momentum" if name == "cm-early" else name
    momentum = {"cm-early": EARLY, "topk": None, "shared_mask": None}.get(name, MOMENTUM)
    return CONFIGS[method].model_dump(mode="json"), momentum


@pytest.mark.parametrize("saved, loaded", list(TABLE))
def test_what_carries_from_one_method_to_another(saved, loaded):
    """Residuals carry where both methods' hold the gradient not yet sent (into decoupled momentum's per-rank momentum
    where that is the loading method), never another method's momentum; the note names the saved and the loading
    method, everything dropped (DROPPED) and what starts at zero, and is never a routine line."""
    config, momentum = _saved(saved)
    has_residuals = saved != "decoupled_momentum"
    plan = switching.plan(config, momentum, has_residuals, CONFIGS[loaded])
    assert plan.residuals == (TABLE[saved, loaded] if has_residuals else "drop")
    method = "compressed_momentum" if saved == "cm-early" else saved
    assert f"saved with another method ({switching.TITLES[method]}), this run has {switching.TITLES[loaded]}" in plan.note
    if has_residuals and plan.residuals == "drop":
        assert "its error-feedback residuals (" in plan.note and ") are DROPPED: " in plan.note
    if momentum:
        assert switching.DROPPED_MOMENTUM[method] in plan.note
    if loaded in switching.ZERO_MOMENTUM and plan.residuals != "momentum":
        assert switching.ZERO_MOMENTUM[loaded] in plan.note
    assert any(mark in plan.note for mark in NOT_ROUTINE)


def test_the_same_method_loads_everything_and_stock_drops_everything():
    """A side-car of this run's own method (any settings) is no switch; with DGC off, the residuals and the method's
    momentum are named as dropped; a stock checkpoint says what starts at zero under each method."""
    for name, cfg in CONFIGS.items():
        config = cfg.model_dump(mode="json")
        assert switching.plan(config, MOMENTUM, True, cfg) is None
        assert switching.method_of(config) == name
        drops = switching.dropped_without_dgc({"config": config, "residuals": {"a": 1}, "momentum": MOMENTUM})
        assert drops[0].startswith("its error-feedback residuals (") and drops[0].endswith(") are DROPPED")
        if name in switching.DROPPED_MOMENTUM:
            assert drops[1] == switching.DROPPED_MOMENTUM[name]
        assert "at zero" in switching.fresh_note(cfg)
    assert switching.plan(None, None, True, CONFIGS["topk"]) is None  # settings not recorded: loaded as before
    assert "'freeze_step' = 3 steps" in switching.fresh_note(CONFIGS["compressed_momentum"])


def _zero3(optimizer_cls=torch.optim.AdamW, **kwargs):
    """A stand-in for a ZeRO-3 optimizer: one fp32 flat partition with a gradient, and its basic optimizer."""
    flat = torch.nn.Parameter(torch.ones(8))
    flat.grad = torch.full((8,), 0.5)
    return SimpleNamespace(optimizer=optimizer_cls([flat], lr=0.1, **kwargs), fp32_partitioned_groups_flat=[flat]), flat


def test_a_step_count_without_moments_is_rebuilt_from_zero_not_a_key_error():
    """Decoupled momentum's sign update keeps at most a step count in Adam's state. Loaded as it is, torch's AdamW
    raises KeyError: 'exp_avg' at its first step; after optimizer_note (DGC off, or a method that steps with Adam)
    the state is gone, AdamW builds it afresh (step 1), and the note says that its moments start from zero."""
    demo = CONFIGS["decoupled_momentum"].model_dump(mode="json")
    for loaded in (None, CONFIGS["topk"], CONFIGS["shared_mask"]):
        opt, flat = _zero3()
        opt.optimizer.state[flat]["step"] = torch.tensor(4.0)
        if loaded is None:
            with pytest.raises(KeyError, match="exp_avg"):
                opt.optimizer.step()
        note = switching.optimizer_note(opt, demo, None, loaded)
        assert ("the checkpoint's optimizer state holds no exp_avg and exp_avg_sq (decoupled momentum's sign update "
                "keeps none): AdamW's exp_avg and exp_avg_sq (and its step count) start from zero") in note
        opt.optimizer.step()
        assert float(opt.optimizer.state[flat]["step"]) == 1.0
    opt, flat = _zero3()  # loaded by decoupled momentum's sign update again: kept as it is, nothing said
    opt.optimizer.state[flat]["step"] = torch.tensor(4.0)
    assert switching.optimizer_note(opt, demo, None, CONFIGS["decoupled_momentum"]) == ""
    assert float(opt.optimizer.state[flat]["step"]) == 4.0


def test_the_optimizer_state_other_methods_leave_is_named():
    """Adam's moments as compressed momentum froze them are STALE for another method; Adam's moments under decoupled
    momentum's sign update are NOT USED; SGD's buffer after momentum correction holds only the weight-decay momentum,
    and carries into momentum correction; a stock run's full Adam state says nothing."""
    opt, flat = _zero3()
    opt.optimizer.step()
    cm = CONFIGS["compressed_momentum"].model_dump(mode="json")
    assert "AdamW's exp_avg and exp_avg_sq are STALE: compressed momentum froze them after its step 3, 2 step(s)" in (
        switching.optimizer_note(opt, cm, MOMENTUM, None))
    assert switching.optimizer_note(opt, cm, EARLY, None) == ""  # saved before the freeze: Adam's own
    assert "NOT USED by decoupled momentum's sign update" in switching.optimizer_note(opt, None, None,
                                                                                       CONFIGS["decoupled_momentum"])
    assert switching.optimizer_note(opt, None, None, CONFIGS["topk"]) == ""
    sgd, flat = _zero3(torch.optim.SGD, momentum=0.9, weight_decay=0.01)
    sgd.optimizer.step()
    mc = CONFIGS["momentum_correction"].model_dump(mode="json")
    assert "SGD's momentum_buffer holds at most the weight-decay term's momentum" in switching.optimizer_note(
        sgd, mc, MOMENTUM, None)
    assert "SGD's momentum_buffer (the velocity so far) carries over as momentum correction's weight-decay momentum" in (
        switching.optimizer_note(sgd, None, None, CONFIGS["momentum_correction"]))


def test_a_universal_conversion_note_is_read_and_its_zeros_dropped_where_unused():
    """A universal checkpoint made from one without Adam's moments: Adam's start from zero (said); zeros an optimizer
    does not read (SGD, the sign update) are removed; SGD's momentum_buffer, which no universal checkpoint holds, is
    named."""
    marker = {"filled": ["exp_avg", "exp_avg_sq"], "not_carried": [], "reason": "decoupled momentum's sign update "
              "keeps none"}
    opt, flat = _zero3()
    opt.optimizer.state[flat].update(exp_avg=torch.zeros(8), exp_avg_sq=torch.zeros(8), step=torch.tensor(0.0))
    demo = CONFIGS["decoupled_momentum"].model_dump(mode="json")
    assert "start from zero: the saved optimizer kept no exp_avg and exp_avg_sq (decoupled momentum's sign update " \
           "keeps none), and the universal conversion wrote zeros" in switching.optimizer_note(opt, demo, None, None, marker)
    assert switching.optimizer_note(opt, demo, None, CONFIGS["decoupled_momentum"], marker) == ""
    assert set(opt.optimizer.state[flat]) == {"step"}
    sgd, flat = _zero3(torch.optim.SGD, momentum=0.9)
    sgd.optimizer.state[flat].update(exp_avg=torch.zeros(8), exp_avg_sq=torch.zeros(8), step=torch.tensor(0.0))
    note = switching.optimizer_note(sgd, None, None, None, dict(marker, not_carried=["momentum_buffer"]))
    assert "SGD's momentum_buffer starts from zero: DeepSpeed's universal checkpoint holds only" in note
    assert "exp_avg" not in sgd.optimizer.state[flat]


def test_staging_fills_the_moments_a_universal_conversion_needs(tmp_path):
    """A ZeRO-3 optimizer file whose sub-group state holds only a step count (the sign update's) or nothing: the
    staged copy has zeros for exp_avg and exp_avg_sq and step 0, every other file is linked, the checkpoint itself is
    unchanged, and the note names what was filled and why; a checkpoint with the moments needs no staging."""
    src = tmp_path / "global_step4"
    src.mkdir()
    flat = torch.arange(6.0)
    for rank, state in enumerate(({0: {"step": torch.tensor(4.0)}}, {})):
        torch.save({"optimizer_state_dict": {"zero_stage": 3, "fp32_flat_groups": [flat],
                                             "optimizer_state_dict": {"state": state, "param_groups": [
                                                 {"lr": 0.1, "momentum": 0.9, "params": [0]}]}}},
                   src / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    (src / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"model")
    note = universal.stage(str(src), str(tmp_path / "staged"))
    assert note["filled"] == ["exp_avg", "exp_avg_sq"] and note["not_carried"] == []
    assert note["reason"] == "the saved optimizer is not Adam (SGD with momentum)"
    for rank in range(2):
        staged = torch.load(tmp_path / "staged" / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt", weights_only=False)
        st = staged["optimizer_state_dict"]["optimizer_state_dict"]["state"][0]
        assert torch.equal(st["exp_avg"], torch.zeros(6)) and torch.equal(st["exp_avg_sq"], torch.zeros(6))
        assert float(st["step"]) == 0.0
    assert os.path.islink(tmp_path / "staged" / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    original = torch.load(src / "zero_pp_rank_0_mp_rank_00_optim_states.pt", weights_only=False)
    assert set(original["optimizer_state_dict"]["optimizer_state_dict"]["state"][0]) == {"step"}
    full = tmp_path / "adam"
    full.mkdir()
    torch.save({"optimizer_state_dict": {"zero_stage": 3, "fp32_flat_groups": [flat], "optimizer_state_dict": {
        "state": {0: {"exp_avg": flat, "exp_avg_sq": flat, "step": 3}}, "param_groups": [{"betas": (0.9, 0.99)}]}}},
               full / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    assert universal.stage(str(full), str(tmp_path / "staged2")) is None
    json.dumps(note)  # the note is written as JSON
