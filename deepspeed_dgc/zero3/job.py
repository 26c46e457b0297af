"""What a ds_config file says about the job, for ``python -m deepspeed_dgc check``: the checks that
``deepspeed.initialize`` makes against the engine and its optimizer
(:func:`~deepspeed_dgc.config.check_engine_compatible`, :func:`~deepspeed_dgc.zero3.optimizer.check_method_fits`),
made on a file without a model or a launch.

DeepSpeed reads the file itself (its ``DeepSpeedConfig``, through ``DeepSpeedEngine``'s own accessors), and the
basic optimizer is the one DeepSpeed would build from the ``"optimizer"`` section: torch's optimizers are built on a
one-element parameter, DeepSpeed's (FusedAdam, DeepSpeedCPUAdam, FusedLion, DeepSpeedCPULion) are stood in for by an
object with their class name and their default param group (nothing is compiled). What needs the launch is left to
``deepspeed.initialize``: the world size, the other ranks' settings, ranks per node, an optimizer passed in code,
``"auto"`` values (filled in by the Trainer or Accelerate), DeepSpeed's other optimizers (LAMB, 1-bit Adam, ...),
and a schedule that changes the optimizer's settings after a step.
"""

import inspect
from typing import Any, Mapping, Optional, Tuple

import torch
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.zenflow.engine import configure_zenflow

from ..config import DGC_SECTION, DGCConfig, check_engine_compatible
from . import optimizer as owners

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


class ConfigEngine:
    """``DeepSpeedEngine``'s config accessors over a ds_config dict, without a model, a process group or a device.

    The batch keys are replaced by one micro-batch of ``gradient_accumulation_steps`` (where it is a number), since
    DeepSpeed's batch arithmetic needs the world size, which a file does not say.

    Raises:
        Whatever ``DeepSpeedConfig`` raises for the file (a ValueError or pydantic's ValidationError, naming the key).
    """

    client_optimizer = None
    _ACCESSORS = ("zero_optimization_stage", "zero_quantized_weights", "zero_quantized_nontrainable_weights",
                  "zero_quantized_gradients", "zero_use_cpu_optimizer", "fp16_enabled", "torch_autocast_enabled",
                  "gradient_accumulation_steps", "managed_gradient_accumulation", "optimizer_name",
                  "optimizer_params", "bf16_optimizer_states", "zenflow_config", "get_optimizer_configuration")

    def __init__(self, ds_config: Mapping[str, Any]):
        gas = ds_config.get("gradient_accumulation_steps")
        view = {k: v for k, v in ds_config.items() if k not in BATCH_KEYS and k != DGC_SECTION}
        view.update(train_micro_batch_size_per_gpu=1,
                    gradient_accumulation_steps=gas if isinstance(gas, int) and not isinstance(gas, bool) else 1)
        self._config = DeepSpeedConfig(view)
        configure_zenflow(self)


for _name in ConfigEngine._ACCESSORS:  # DeepSpeed's own readings of its config, not copies of them
    setattr(ConfigEngine, _name, getattr(DeepSpeedEngine, _name))


def _has_auto(value) -> bool:
    if isinstance(value, Mapping):
        return any(_has_auto(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_auto(v) for v in value)
    return value == "auto"


def _stand_in(cls, params: Mapping[str, Any], attributes: Mapping[str, Any]):
    """An object named as DeepSpeed's optimizer class ``cls``, with one param group: ``cls``'s defaults under
    ``params``, and ``attributes`` (e.g. FusedAdam's ``adam_w_mode``) set on it."""
    defaults = {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items()
                if k not in ("self", "params") and p.default is not inspect.Parameter.empty}
    stand_in = type(cls.__name__, (), {})()
    stand_in.defaults = {**defaults, **params}
    stand_in.param_groups = [dict(stand_in.defaults)]
    for key, value in attributes.items():
        setattr(stand_in, key, value)
    return stand_in


def basic_optimizer(engine: ConfigEngine) -> Tuple[Optional[Any], str]:
    """The basic optimizer DeepSpeed would build from the file's ``"optimizer"`` section, or None and why not.

    Returns:
        ``(optimizer, "")``, or ``(None, reason)`` where the file names no optimizer or one this cannot stand in for.

    Raises:
        What the optimizer's constructor raises for its params (e.g. torch's ValueError for a beta out of [0, 1)).
    """
    name = engine.optimizer_name()
    if name is None:
        return None, "the file has no 'optimizer' section (an optimizer passed in code is checked at initialize)"
    params = dict(engine.optimizer_params() or {})
    if name in ("adam", "adamw"):  # DeepSpeed's own choice among torch's, CPU and fused Adam
        adam_w_mode = params.pop("adam_w_mode", True)
        cls, kwargs = engine.get_optimizer_configuration(params, name == "adamw" or adam_w_mode)
    elif name == "lion":
        from deepspeed.ops.lion import DeepSpeedCPULion, FusedLion
        cls, kwargs = (DeepSpeedCPULion if engine.zero_use_cpu_optimizer() else FusedLion), {}
    else:
        cls, kwargs = getattr(torch.optim, name, None), {}
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            return None, f"its optimizer {name!r} is one of DeepSpeed's this check does not build"
    if cls.__module__.startswith("torch."):
        return cls([torch.nn.Parameter(torch.zeros(1))], **params, **kwargs), ""
    return _stand_in(cls, params, kwargs), ""


def check_job(cfg: DGCConfig, ds_config: Mapping[str, Any]) -> str:
    """Make the checks of ``deepspeed.initialize`` that a ds_config file decides: ZeRO stage 3 and the ZeRO settings
    that compete with compression (:func:`~deepspeed_dgc.config.check_engine_compatible`), and the momentum method
    against the optimizer, fp16, ``torch_autocast``, optimizer offload and the sends per step
    (:func:`~deepspeed_dgc.zero3.optimizer.check_method_fits`), with the same messages.

    Args:
        cfg: the file's enabled ``"dgc"`` config; ds_config: the whole file.

    Returns:
        What was checked, or why the job's side was not (``"auto"`` values, no optimizer section, ...).

    Raises:
        DGCConfigError: the combination is refused, as ``deepspeed.initialize`` would refuse it.
        ValueError: DeepSpeed or the optimizer's constructor refuses the file's settings.
    """
    auto = sorted(k for k, v in ds_config.items() if k != DGC_SECTION and _has_auto(v))
    if auto:
        return (f"job settings not checked: {', '.join(repr(k) for k in auto)} hold \"auto\" values, which the "
                "Trainer or Accelerate fill in; deepspeed.initialize checks them")
    engine = ConfigEngine(ds_config)
    check_engine_compatible(cfg, engine)
    optimizer, why = basic_optimizer(engine)
    if optimizer is None:
        return f"ZeRO settings fit; the optimizer is not checked: {why}"
    gas = ds_config.get("gradient_accumulation_steps")
    held = cfg.accumulate_locally and engine.managed_gradient_accumulation()
    if not held and not isinstance(gas, int) and "train_batch_size" in ds_config:
        gas_note = "; the sends per step depend on the world size (checked at initialize)"
    else:
        gas_note = ""
    owners.check_method_fits(cfg, optimizer, 1 if held else engine.gradient_accumulation_steps(),
                             engine.fp16_enabled(), engine.zero_use_cpu_optimizer(), engine.torch_autocast_enabled())
    return (f"job fits: {type(optimizer).__name__} (what DeepSpeed builds from the 'optimizer' section), "
            f"fp16 {'on' if engine.fp16_enabled() else 'off'}, optimizer offload "
            f"{'on' if engine.zero_use_cpu_optimizer() else 'off'}{gas_note}")
