"""DeepSpeed's gradient and optimizer-state APIs on an engine with DGC: what they answer under each gradient method.

DeepSpeed's ``deepspeed.utils`` functions reach ZeRO-3's optimizer through ``param._z3_optimizer``:
``safe_get_full_grad`` / ``safe_set_full_grad`` / ``safe_get_local_grad`` / ``safe_set_local_grad`` /
``safe_update_full_grad_vectorized`` (and the optimizer's ``get_fp32_grad_partitions``) read and write the gradient
partitions, and ``safe_get_full_optimizer_state`` /
``safe_set_full_optimizer_state`` / ``safe_get_local_optimizer_state`` / ``safe_set_local_optimizer_state`` the basic
optimizer's state (``optimizer.state[<flat fp32 partition>][key]``). :func:`install` patches those methods of one
ZeRO-3 optimizer instance so that they answer meaningfully under every method:

==========================  ===================================================  ==========================================
method                      the gradient APIs                                    the optimizer-state APIs
==========================  ===================================================  ==========================================
top-k / dense (default),    the averaged gradient the owners reconstructed       the optimizer's own keys, as stock;
``shared_mask``,            (what was sent, decoded and summed): as stock        ``"dgc_residual"``: this rank's
``compressed_momentum``                                                          error-feedback residual
before its freeze
``decoupled_momentum``,     :class:`DGCStateError`: the partitions hold the      the optimizer's own keys where it keeps
``momentum_correction``,    method's update (the sum of the ranks' momenta),     them; ``"dgc_momentum"``: this rank's
``compressed_momentum``     not a gradient, and no averaged gradient is formed   local momentum; a key the optimizer
after its freeze                                                                 does not keep: :class:`DGCStateError`
==========================  ===================================================  ==========================================

Inside a gradient accumulation window whose micro-steps are held (``accumulate_locally``), ZeRO-3's partitions hold
none of the window's gradient yet: the gradient APIs raise :class:`DGCStateError` saying so until its last backward.
The method's own states are per rank, not partitioned: the "full" getters return this rank's whole state of the
parameter (shape ``param.ds_shape``, fp32, no collective), the "local" ones the slice of it at this rank's partition
(``param.ds_tensor``'s elements); the setters replace this rank's state (the next step adds to it). Under the
hierarchical topology a rank keeps state only for its node's share of each parameter: those keys raise
:class:`DGCStateError`. ``decoupled_momentum``'s sign step counts its steps in the optimizer's state (``"step"``, as
Adam does), so ``optimizer.state[...]["step"]`` follows ``engine.global_steps``; ``engine.get_global_grad_norm()`` is
the norm of what the partitions hold (under the momentum methods, the update's norm before clipping). ZeRO-3's
internal ``optimizer.averaged_gradients``, read from outside DeepSpeed (DeepSpeed's own tests do), raises the gradient
APIs' :class:`DGCStateError` under the methods that form no averaged gradient (the optimizer's class becomes a subclass
with a guarded property; :func:`uninstall` puts the class back).
"""

import functools
import sys
from typing import Callable, Dict, Optional

import torch

from .swap import replace

RESIDUAL = "dgc_residual"  # this rank's error-feedback residual of the parameter
MOMENTUM = "dgc_momentum"  # this rank's local momentum of the parameter (DeMo's delta, DGC's velocity, 1-bit Adam's m)

GRAD_APIS = ("get_fp32_grad_for_param", "get_local_fp32_grad_for_param", "set_fp32_grad_for_param",
             "set_local_grad_for_param", "update_fp32_grad_for_param_vectorized", "get_fp32_grad_partitions")
STATE_APIS = ("get_full_hp_param", "set_full_hp_param", "get_local_fp32_param", "set_local_hp_param",
              "get_hp_param_device")


class DGCStateError(RuntimeError):
    """A DeepSpeed gradient or optimizer-state API asked for something the engine's gradient method does not have
    (an averaged gradient where the partitions hold the method's update, an optimizer-state key the method's step
    does not keep); the message names the method, what there is instead, and where to read it."""


class DGCAttributeError(DGCStateError, AttributeError):
    """:class:`DGCStateError` for ZeRO-3's ``optimizer.averaged_gradients`` where no averaged gradient is formed: also
    an ``AttributeError``, so ``hasattr`` says False and ``getattr(opt, "averaged_gradients", default)`` gives the
    default, as for an attribute that is not there."""


def install(opt, state, method: Callable[[], object]) -> None:
    """Patch ``opt``'s (a ``DeepSpeedZeroOptimizer_Stage3``) gradient and optimizer-state APIs (see the module
    docstring); ``method()`` gives the engine's gradient method (:class:`~deepspeed_dgc.methods.base.GradientMethod`)
    at call time. :func:`~deepspeed_dgc.zero3.patches.uninstall` puts the originals back."""
    for name in GRAD_APIS:
        if hasattr(opt, name):
            replace(opt, name, _guard_grad(getattr(opt, name), name, state, method))
    for name in STATE_APIS:
        if hasattr(opt, name):
            replace(opt, name, _serve_state(getattr(opt, name), name, opt, state, method))
    _guard_averaged_gradients(opt, state, method)


def uninstall(opt) -> None:
    """Undo what :func:`install` did to ``opt``'s class (``averaged_gradients`` a plain attribute again); the patched
    methods are put back by :func:`~deepspeed_dgc.zero3.swap.restore`."""
    base = getattr(type(opt), "_dgc_guarded_base", None)
    if base is not None:
        opt.__class__ = base
        opt.__dict__["averaged_gradients"] = opt.__dict__.pop(_AVERAGED, None)
        opt.__dict__.pop(_AVERAGED_GUARD, None)


_AVERAGED, _AVERAGED_GUARD = "_dgc_averaged_gradients", "_dgc_averaged_gradients_guard"
_GUARDED: Dict[type, type] = {}


def _from_deepspeed(frame) -> bool:
    """Whether the code at ``frame`` is DeepSpeed's own or this package's (ZeRO-3's internal use of the attribute)."""
    name = frame.f_globals.get("__name__", "") if frame is not None else ""
    return name == "deepspeed" or name.startswith(("deepspeed.", "deepspeed_dgc"))


def _guarded_class(cls: type) -> type:
    """A subclass of ``cls`` whose ``averaged_gradients`` (ZeRO-3's gradient partitions by sub-group, an internal
    attribute that code outside DeepSpeed reads as the averaged gradient) calls the instance's guard first when read
    from outside DeepSpeed (made once per class)."""
    if cls not in _GUARDED:
        def get(self):
            guard = self.__dict__.get(_AVERAGED_GUARD)
            if guard is not None and not _from_deepspeed(sys._getframe(1)):
                guard()
            return self.__dict__.get(_AVERAGED)

        def set_(self, value):
            self.__dict__[_AVERAGED] = value

        _GUARDED[cls] = type(cls.__name__, (cls, ), {"averaged_gradients": property(get, set_),
                                                      "_dgc_guarded_base": cls, "__module__": cls.__module__,
                                                      "__qualname__": cls.__qualname__})
    return _GUARDED[cls]


def _guard_averaged_gradients(opt, state, method) -> None:
    """``opt.averaged_gradients`` read from outside DeepSpeed raises :class:`DGCAttributeError` (a
    :class:`DGCStateError`) where the partitions do not hold the averaged gradient (as the gradient APIs do);
    DeepSpeed's own reads and writes are untouched."""

    def guard():
        held = method().partitions_hold(state)
        if held is not None:
            raise DGCAttributeError(_no_gradient("ZeRO-3's optimizer.averaged_gradients holds no averaged gradient",
                                                 "its", held, state, method))

    if getattr(type(opt), "_dgc_guarded_base", None) is None:  # not guarded yet (an install again keeps the class)
        value = opt.__dict__.pop("averaged_gradients", {})
        opt.__class__ = _guarded_class(type(opt))
        opt.__dict__[_AVERAGED] = value
    opt.__dict__[_AVERAGED_GUARD] = guard


def _method_name(state, method) -> str:
    """The method as the config names it: its own section, or the default codec."""
    name = getattr(method(), "name", "") or ""
    if name.startswith("topk") or not name:
        return "the default codec ('dgc.density', 'dgc.quantization': top-k or dense with error feedback)"
    return f"'dgc.{name}'"


def _no_gradient(what: str, whose: str, held: str, state, method) -> str:
    """The message of a gradient read where the partitions hold no averaged gradient: ``what`` under the method,
    ``whose`` partitions hold ``held``, and where the method's own state is read."""
    return (f"deepspeed_dgc: {what} under {_method_name(state, method)}: {whose} partitions hold {held}. The method's "
            f"own state is read with safe_get_full_optimizer_state(param, {MOMENTUM!r}) (this rank's local momentum)")


def _guard_grad(original: Callable, api: str, state, method) -> Callable:
    """``original`` where ZeRO-3's gradient partitions hold the averaged gradient; else a :class:`DGCStateError`."""

    @functools.wraps(original)
    def guarded(*args, **kwargs):
        if state.window.held:  # between the micro-steps of a window whose gradients are held, not sent
            raise DGCStateError(f"deepspeed_dgc: {api} (DeepSpeed's gradient API) was called inside a gradient "
                                f"accumulation window: under 'dgc.accumulate_locally' each rank holds the window's "
                                "gradients until its last micro-step, and ZeRO-3's gradient partitions get none of "
                                "them before; call it after the window's last backward, or set "
                                "'dgc.accumulate_locally' to false (every micro-step sent)")
        frozen = any(isinstance(a, torch.nn.Parameter) and not a.requires_grad for a in args + tuple(kwargs.values()))
        held = None if frozen else method().partitions_hold(state)  # a frozen parameter: stock's None
        if held is not None:
            raise DGCStateError(_no_gradient(f"{api} (DeepSpeed's gradient API) has no gradient to read or write",
                                             "ZeRO-3's gradient", held, state, method))
        return original(*args, **kwargs)

    return guarded


def _serve_state(original: Callable, api: str, opt, state, method) -> Callable:
    """``original`` for the optimizer's own keys; the method's state for :data:`RESIDUAL` / :data:`MOMENTUM`; a
    :class:`DGCStateError` naming the method for a key the optimizer does not keep."""
    setter = api.startswith("set_")
    local = api in ("get_local_fp32_param", "set_local_hp_param")

    @functools.wraps(original)
    def serve(*args, **kwargs):
        names = ("value", "param", "optim_state_key") if setter else ("param", "optim_state_key")
        bound = dict(zip(names, args), **kwargs)
        key, param = bound.get("optim_state_key"), bound.get("param")
        if key is None or param is None or not getattr(param, "requires_grad", True):
            return original(*args, **kwargs)
        if key == "step":  # a scalar, which DeepSpeed's per-parameter narrow() cannot take (stock fails too)
            raise DGCStateError("deepspeed_dgc: 'step' is one count per sub-group, not per element: read "
                                "engine.optimizer.optimizer.state[<flat fp32 partition>]['step'] (or engine.global_steps)")
        if key in (RESIDUAL, MOMENTUM):
            store = _store_of(state, key, method)
            if api == "get_hp_param_device":
                return store.device if store.device is not None else param.ds_tensor.device
            if setter:
                return _set_own(state, store, key, param, bound["value"], local, opt)
            return _get_own(state, store, key, param, local, opt)
        missing = _missing_key(opt, param, key)
        if missing is not None:
            raise DGCStateError(
                f"deepspeed_dgc: the optimizer ({type(opt.optimizer).__name__}) keeps no {key!r} for this parameter "
                f"under {_method_name(state, method)}{missing}; its keys: {_own_keys(state)}")
        return original(*args, **kwargs)

    return serve


def _missing_key(opt, param, key: str) -> Optional[str]:
    """None where ``key`` is in the optimizer's state of ``param``'s sub-group (or the sub-group is swapped out to
    NVMe, which stock reads); else a clause saying what the state holds."""
    group_idx = opt.grad_position[opt.get_param_id(param)][0]
    if opt._swappable_optimizer_subgroup(group_idx):
        return None
    held = opt.optimizer.state.get(opt.fp32_partitioned_groups_flat[group_idx], {})
    if key in held:
        return None
    return f" (its state holds {sorted(held) or 'nothing'})"


def _keeps_residuals(state) -> bool:
    """Whether the engine carries error-feedback residuals (not under decoupled momentum, whose momentum keeps what
    was not sent, nor with ``error_feedback`` off)."""
    return state.memory is not None and state.cfg.error_feedback and state.cfg.decoupled_momentum is None


def _own_keys(state) -> str:
    """The method-state keys this engine answers, for messages."""
    keys = [RESIDUAL] if _keeps_residuals(state) else []
    if getattr(state.momentum, "store", None) is not None:
        keys.append(MOMENTUM)
    return ", ".join(repr(k) for k in keys) + " (this rank's, deepspeed_dgc's)" if keys else "none of deepspeed_dgc's"


def _store_of(state, key: str, method):
    """The :class:`~deepspeed_dgc.memory.error_feedback.ErrorFeedback` store behind ``key``."""
    if key == RESIDUAL:
        store = state.memory if _keeps_residuals(state) else None
    else:
        store = getattr(state.momentum, "store", None)
    if store is None:
        raise DGCStateError(f"deepspeed_dgc: {_method_name(state, method)} keeps no {key!r} (this engine's keys: "
                            f"{_own_keys(state)})")
    return store


def _check_numel(state, key: str, value: torch.Tensor, param) -> None:
    if value.numel() != param.ds_numel:
        raise DGCStateError(f"deepspeed_dgc: this rank's {key!r} of a parameter of {param.ds_numel} elements has "
                            f"{value.numel()}: under 'dgc.topology' \"{state.cfg.topology}\" a rank keeps state for its "
                            "node's share of each parameter only, which this API cannot give as the parameter")


def _partition(param, opt) -> slice:
    """This rank's elements of ``param`` (its ``ds_tensor``) in the flat parameter."""
    n = param.partition_numel()
    start = opt._get_param_partition_rank(param) * n
    return slice(start, min(start + n, param.ds_numel))


def _get_own(state, store, key: str, param, local: bool, opt) -> torch.Tensor:
    """This rank's state ``key`` of ``param``: fp32 ``param.ds_shape`` (zeros before the first step), or with
    ``local`` this rank's partition of it, ``(param.partition_numel(),)`` (zero padded past the parameter's end)."""
    value = store.committed_value(state.key_of(param))
    if value is None:
        value = torch.zeros(param.ds_numel, dtype=torch.float32, device=param.ds_tensor.device)
    _check_numel(state, key, value, param)
    value = value.float()
    if not local:
        return value.view(param.ds_shape)
    part = value[_partition(param, opt)]
    pad = param.partition_numel() - part.numel()
    return torch.nn.functional.pad(part, (0, pad)) if pad else part.clone()


def _set_own(state, store, key: str, param, value: torch.Tensor, local: bool, opt) -> None:
    """Replace this rank's state ``key`` of ``param`` (its whole, or with ``local`` its partition's slice) by
    ``value``, as if committed by the last step."""
    k = state.key_of(param)
    expect = param.partition_numel() if local else param.ds_numel
    if value.numel() != expect:
        raise DGCStateError(f"deepspeed_dgc: setting this rank's {key!r} of a parameter needs {expect} values "
                            f"({'its partition' if local else 'the whole parameter'}), got {value.numel()}")
    values = store.residuals()
    current = values.get(k)
    if current is None:
        current = torch.zeros(param.ds_numel, dtype=torch.float32, device=value.device)
    _check_numel(state, key, current, param)
    current = current.clone()
    if local:
        sl = _partition(param, opt)
        current[sl] = value.flatten()[:sl.stop - sl.start].to(current)
    else:
        current.copy_(value.flatten().to(current))
    values[k] = current
    store.load(values)
