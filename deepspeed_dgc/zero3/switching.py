"""Switching the gradient method across a checkpoint: what of the saved state a run of another method (or of stock
ZeRO-3) carries over, what it drops, and what the log says about each (docs/faults.md, "Switching methods across a
checkpoint").

The state a method leaves in a checkpoint is of three kinds, and each converts only where it means the same thing:

- error-feedback residuals (side-car): "the gradient not yet sent" under top-k / dense quantization, shared masks,
  and compressed momentum before its freeze; "the preconditioned momentum not yet sent" after the freeze; "the
  velocity not yet sent" under momentum correction; none under decoupled momentum (its momentum is its error
  feedback). Residuals of the gradient carry between the methods that keep such residuals, and into decoupled
  momentum's per-rank momentum (which then sends them); the others are dropped.
- a method's per-rank momentum (side-car): compressed momentum's momenta, momentum correction's velocities,
  decoupled momentum's ``delta``. Each means something only to its own method: carried by the same method (any
  settings), dropped by every other and by stock.
- the optimizer's own state (DeepSpeed's files, loaded by DeepSpeed): what a method leaves there is checked after
  the load, against what this run's step reads (:func:`optimizer_note`): decoupled momentum's sign update keeps no
  moments (a run that steps with the optimizer rebuilds them from zero, and a state holding only the sign step's
  count is removed first, since Adam would fail on it with ``KeyError: 'exp_avg'``); compressed momentum leaves
  Adam's moments as it froze them; momentum correction's SGD keeps only the weight-decay term's momentum; a
  universal checkpoint made by :mod:`deepspeed_dgc.zero3.universal` from a checkpoint without Adam's moments holds
  zeros for them.

Every drop and every state rebuilt from zero is named in the load's log line, which is then a warning (its words
are in :data:`DROP_MARKS`).
"""

import json
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

# the methods, as named in the side-car's recorded settings; None: stock ZeRO-3 (DGC off, or no side-car)
TITLES = {None: "stock ZeRO-3", "topk": "top-k / quantization with error feedback", "shared_mask": "shared masks",
          "compressed_momentum": "compressed momentum", "momentum_correction": "momentum correction",
          "decoupled_momentum": "decoupled momentum"}

# what a method's error-feedback residuals hold
RESIDUALS = {"gradient": "the gradient not yet sent", "momentum": "compressed momentum's momentum not yet sent",
             "velocity": "momentum correction's velocity not yet sent"}

DROPPED_MOMENTUM = {
    "compressed_momentum": "compressed momentum's per-rank momenta (each rank's Adam first moment) are DROPPED",
    "momentum_correction": "momentum correction's per-rank velocities are DROPPED",
    "decoupled_momentum": "decoupled momentum's per-rank momentum (DeMo's delta: what each rank has not sent yet) is "
                          "DROPPED"}

ZERO_MOMENTUM = {"compressed_momentum": "compressed momentum's per-rank momenta start at zero",
                 "momentum_correction": "momentum correction's per-rank velocities start at zero",
                 "decoupled_momentum": "decoupled momentum's per-rank momentum starts at zero"}

# words that make a load's log line a warning (checkpoint.NOT_ROUTINE holds them too)
DROP_MARKS = ("DROPPED", "at zero", "from zero", "NOT USED", "STALE", "saved with another method")

# written by deepspeed_dgc.zero3.universal into the universal checkpoint's folder
MARKER = "dgc_universal.json"


def method_of(config) -> Optional[str]:
    """The gradient method of recorded ``"dgc"`` settings (a side-car's ``config``, or ``DGCConfig.model_dump``):
    ``"decoupled_momentum"``, ``"compressed_momentum"``, ``"shared_mask"``, ``"momentum_correction"`` or ``"topk"``
    (top-k or dense quantization with error feedback, the default); None where nothing is recorded or DGC is off."""
    if not isinstance(config, dict) or not config.get("enabled", True):
        return None
    for name in ("decoupled_momentum", "compressed_momentum", "shared_mask", "momentum_correction"):
        if config.get(name):
            return name
    return "topk"


def _dump(cfg) -> Optional[dict]:
    return None if cfg is None else cfg.model_dump(mode="json")


def sign_update(config) -> bool:
    """Whether recorded settings run decoupled momentum's sign update (the optimizer's own step and state unused)."""
    if method_of(config) != "decoupled_momentum":
        return False
    return (config["decoupled_momentum"] or {}).get("update", "sign") == "sign"


def cm_frozen(config, momentum) -> bool:
    """Whether a side-car of compressed momentum was saved past its freeze (its momentum's ``steps_done``)."""
    if method_of(config) != "compressed_momentum" or not isinstance(momentum, dict):
        return False
    return int(momentum.get("steps_done", 0)) >= int(config["compressed_momentum"].get("freeze_step", 1))


def residual_kind(config, momentum) -> Optional[str]:
    """What the error-feedback residuals of a run with these recorded settings (and saved momentum) hold: a key of
    :data:`RESIDUALS`, or None where it keeps none."""
    method = method_of(config)
    if method is None or method == "decoupled_momentum" or not config.get("error_feedback", True):
        return None
    if method == "momentum_correction":
        return "velocity"
    return "momentum" if cm_frozen(config, momentum) else "gradient"


@dataclass
class Plan:
    """What a run of another method takes of a side-car: ``residuals`` ``"load"`` (as residuals), ``"momentum"``
    (into decoupled momentum's per-rank momentum) or ``"drop"``; the saved momentum is never taken (another method's
    means nothing here). ``note`` says so, for the log."""
    residuals: str
    note: str


def plan(saved_config, saved_momentum, has_residuals: bool, cfg) -> Optional[Plan]:
    """What this run (``cfg``, an enabled ``DGCConfig``) takes of a side-car saved with ``saved_config`` (its recorded
    settings) and ``saved_momentum``; None where the side-car was saved with this run's method (everything loads,
    as at any resume) or records no settings.

    Residuals carry where both hold the gradient not yet sent (top-k / quantization, shared masks, compressed
    momentum before its freeze; into compressed momentum, whose momenta restart at zero, so it is before its freeze),
    and go into decoupled momentum's per-rank momentum where this run is decoupled momentum and they hold the
    gradient; everything else is dropped, and this run's own momentum starts at zero."""
    saved, now = method_of(saved_config), method_of(_dump(cfg))
    if saved is None or saved == now:
        return None
    kind = residual_kind(saved_config, saved_momentum)
    mine = residual_kind(_dump(cfg), None)
    parts, residuals = [], "drop"
    if has_residuals:
        if kind == "gradient" and mine == "gradient":
            residuals = "load"
            parts.append("its error-feedback residuals (the gradient not yet sent) carry over")
        elif kind == "gradient" and now == "decoupled_momentum":
            residuals = "momentum"
            storage = cfg.decoupled_momentum.storage
            rounded = "" if storage == "fp32" else f" (rounded once into its {storage} storage)"
            parts.append("its error-feedback residuals (the gradient not yet sent) carry over into decoupled "
                         "momentum's per-rank momentum, which sends them" + rounded)
        else:
            why = {None: ("decoupled momentum keeps none (its momentum is its error feedback)"
                          if now == "decoupled_momentum" else "this run keeps none ('dgc.error_feedback' is false)")}
            why.update({k: f"this run's hold {v}" for k, v in RESIDUALS.items()})
            parts.append(f"its error-feedback residuals ({RESIDUALS.get(kind, 'of unknown meaning')}) are DROPPED: "
                         f"{why[mine]}")
    if isinstance(saved_momentum, dict) and saved_momentum.get("momenta"):
        parts.append(DROPPED_MOMENTUM.get(saved, "its per-rank momenta are DROPPED"))
    if now in ZERO_MOMENTUM and residuals != "momentum":
        parts.append(ZERO_MOMENTUM[now] + _freeze_again(cfg))
    note = (f"; saved with another method ({TITLES[saved]}), this run has {TITLES[now]}: "
            + ("; ".join(parts) or "it holds no state this run uses"))
    return Plan(residuals, note)


def _freeze_again(cfg) -> str:
    cm = getattr(cfg, "compressed_momentum", None)
    if cm is None:
        return ""
    return (f" (Adam steps on its own for 'freeze_step' = {cm.freeze_step} steps from the loaded state before its "
            "second moment is frozen)")


FRESH = {"topk": "error-feedback residuals start at zero", "shared_mask": "error-feedback residuals start at zero",
         "compressed_momentum": "error-feedback residuals start at zero, and so do compressed momentum's per-rank "
                                "momenta",
         "momentum_correction": "error-feedback residuals start at zero, and so do momentum correction's per-rank "
                                "velocities",
         "decoupled_momentum": ZERO_MOMENTUM["decoupled_momentum"]}


def fresh_note(cfg) -> str:
    """What starts at zero where a run of ``cfg``'s method loads a checkpoint without side-cars (stock ZeRO-3's)."""
    return FRESH[method_of(_dump(cfg))] + _freeze_again(cfg)


def dropped_without_dgc(payload: dict) -> List[str]:
    """What a run with DGC off drops of a side-car ``payload``: its residuals and its method's momentum, named."""
    config, momentum = payload.get("config"), payload.get("momentum")
    out = []
    if payload.get("residuals"):
        kind = residual_kind(config, momentum) if isinstance(config, dict) else None
        out.append(f"its error-feedback residuals ({RESIDUALS.get(kind, 'what the run had not sent yet')}) are "
                   "DROPPED")
    if isinstance(momentum, dict) and momentum.get("momenta"):
        out.append(DROPPED_MOMENTUM.get(method_of(config), "its per-rank momenta are DROPPED"))
    return out


# ---- the optimizer's own state ----------------------------------------------------------------------------------


def moment_names(basic) -> Tuple[str, ...]:
    """The moments the optimizer ``basic`` keeps in its state, by its param groups: Adam-like (betas and eps)
    ``exp_avg`` and ``exp_avg_sq``, Lion-like (betas only) ``exp_avg``, momentum SGD ``momentum_buffer``; () for one
    that keeps none (SGD without momentum) or that this does not know."""
    groups = getattr(basic, "param_groups", None) or [{}]
    if any("betas" in g for g in groups):
        return ("exp_avg", "exp_avg_sq") if any("eps" in g for g in groups) else ("exp_avg",)
    if any(float(g.get("momentum", 0.0) or 0.0) > 0 for g in groups):
        return ("momentum_buffer",)
    return ()


def _states(opt):
    """The ZeRO-3 optimizer's basic optimizer and its sub-groups' fp32 partitions (None where they cannot be seen: no
    optimizer, or its state swapped out to NVMe)."""
    basic = getattr(opt, "optimizer", None)
    flats = getattr(opt, "fp32_partitioned_groups_flat", None)
    if basic is None or not flats or getattr(opt, "swap_optimizer", False) or not hasattr(basic, "state"):
        return None
    return basic, list(flats)


def read_marker(tag_dir: str) -> Optional[dict]:
    """The note :mod:`deepspeed_dgc.zero3.universal` left in a universal checkpoint's folder, or None."""
    try:
        with open(os.path.join(tag_dir, MARKER)) as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def optimizer_note(opt, saved_config, saved_momentum, cfg, marker: Optional[dict] = None) -> str:
    """What the optimizer state DeepSpeed just loaded means for this run, for the load's log line (``"; ..."`` or
    ""), after making it usable: a state holding no moments (decoupled momentum's sign update keeps at most its step
    count) is removed where this run's optimizer steps (it then builds its moments from zero, as at a first step;
    torch's Adam would raise ``KeyError: 'exp_avg'`` on a state with a step and no moments), and zeros a universal
    conversion wrote for moments this run's step does not read are removed.

    Args:
        opt: the ZeRO-3 optimizer (its basic optimizer's state as loaded); None: nothing to say.
        saved_config, saved_momentum: the side-car's recorded settings and momentum (None: saved without DGC).
        cfg: this run's ``DGCConfig`` (None: DGC off).
        marker: the universal conversion's note (:func:`read_marker`), or None.
    """
    found = _states(opt)
    if found is None:
        return ""
    basic, flats = found
    moments = moment_names(basic)
    if not moments:
        return ""
    name, listed = type(basic).__name__, " and ".join(moments)
    counted = listed + (" (and its step count)" if "exp_avg_sq" in moments else "")
    are, s = ("are", "") if len(moments) > 1 else ("is", "s")  # "exp_avg and exp_avg_sq are", "momentum_buffer is"
    saved, now = method_of(saved_config), method_of(_dump(cfg))
    uses = not sign_update(_dump(cfg))  # this run's step reads the optimizer's state
    saved_sign = sign_update(saved_config)
    states = [basic.state.get(f) or {} for f in flats]
    notes = []
    filled = [k for k in (marker or {}).get("filled", []) if isinstance(k, str)]
    lost = [k for k in (marker or {}).get("not_carried", []) if isinstance(k, str)]
    if filled:
        if uses and set(filled) & set(moments):
            notes.append(f"{name}'s {counted} start{s} from zero: the saved optimizer kept no {' and '.join(filled)} "
                         f"({marker.get('reason', 'see the conversion')}), and the universal conversion wrote zeros")
        else:  # zeros nobody reads: not kept in memory (nor saved again)
            for st in states:
                for k in filled:
                    st.pop(k, None)
    if lost and uses:
        verb = "start" if len(lost) > 1 else "starts"
        notes.append(f"{name}'s {' and '.join(lost)} {verb} from zero: DeepSpeed's universal checkpoint holds only "
                     "Adam's exp_avg and exp_avg_sq of the saved optimizer state")
    absent = all(not (set(st) - {"step"}) for st in states)
    if uses and absent and not filled and (saved_sign or any(states)):
        for f in flats:  # a step count without moments: the optimizer builds its state afresh at its next step
            basic.state.pop(f, None)
        why = ("decoupled momentum's sign update keeps none" if saved_sign else "the saved optimizer kept none")
        notes.append(f"the checkpoint's optimizer state holds no {listed} ({why}): {name}'s {counted} start{s} from "
                     "zero")
    if (uses and not absent and saved == "compressed_momentum" and now != saved
            and cm_frozen(saved_config, saved_momentum)):
        freeze = int(saved_config["compressed_momentum"].get("freeze_step", 1))
        since = int(saved_momentum.get("steps_done", freeze)) - freeze
        notes.append(f"{name}'s {listed} {are} STALE: compressed momentum froze them after its step {freeze}, {since} "
                     "step(s) before this checkpoint, and stepped with its own momenta since; they go on from there")
    if uses and not absent and not filled and saved_sign:
        notes.append(f"{name}'s {listed} {are} STALE: decoupled momentum's sign update does not update them, so they "
                     "are as a run before it left them")
    if not uses and not absent and not saved_sign:
        notes.append(f"{name}'s {listed} loaded from the checkpoint {are} NOT USED by decoupled momentum's sign update "
                     "(kept as they are, and saved again)")
    if moments == ("momentum_buffer",) and not lost:
        decay = any(float(g.get("weight_decay", 0.0) or 0.0) for g in basic.param_groups)
        if uses and saved == "momentum_correction" and now != saved:
            notes.append(f"{name}'s momentum_buffer holds at most the weight-decay term's momentum (momentum "
                         "correction keeps the gradient's velocity per rank, in its side-car), so the velocity of "
                         "the gradient restarts at zero")
        elif now == "momentum_correction" and saved != now and not absent:
            notes.append(f"{name}'s momentum_buffer (the velocity so far) carries over as momentum correction's "
                         "weight-decay momentum, in which it decays as SGD's momentum would" if decay else
                         f"{name}'s momentum_buffer (the velocity so far) is NOT USED: momentum correction without "
                         "weight decay keeps no buffer, so that velocity is lost")
    return "".join("; " + n for n in notes)


def states_summary(opt) -> Dict[str, object]:
    """For tests and reports: the keys of every sub-group's optimizer state and its step count (None: no step)."""
    found = _states(opt)
    if found is None:
        return {}
    basic, flats = found
    steps = []
    for f in flats:
        step = (basic.state.get(f) or {}).get("step")
        steps.append(None if step is None else float(step) if not torch.is_tensor(step) else float(step.item()))
    return {"keys": [sorted(basic.state.get(f) or {}) for f in flats], "steps": steps}
