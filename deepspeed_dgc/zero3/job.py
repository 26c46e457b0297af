"""What a ds_config file says about the job, for ``python -m deepspeed_dgc check``: the checks that
``deepspeed.initialize`` makes against the engine and its optimizer
(:func:`~deepspeed_dgc.config.check_engine_compatible`, :func:`~deepspeed_dgc.zero3.optimizer.check_method_fits`),
made on a file without a model or a launch.

DeepSpeed reads the file itself (its ``DeepSpeedConfig``, through ``DeepSpeedEngine``'s own accessors), and the
basic optimizer is the one DeepSpeed would build from the ``"optimizer"`` section: torch's optimizers are built on a
one-element parameter, DeepSpeed's (FusedAdam, DeepSpeedCPUAdam, FusedLion, DeepSpeedCPULion) are stood in for by an
object with their class name and their default param group (nothing is compiled). What needs the launch is left to
``deepspeed.initialize``: the world size and the batch sizes (unless the check is told the world size: then
DeepSpeed's batch arithmetic, and the hierarchical topology's whole nodes where the ranks per node are known), the
other ranks' settings, an optimizer passed in code, what settings holding ``"auto"`` decide (the Trainer or
Accelerate fill them in), DeepSpeed's other optimizers (LAMB, Adagrad, MuAdam, Muon, ...), and a schedule that
changes the optimizer's settings after a step.
"""

import inspect
from typing import Any, List, Mapping, Optional, Sequence, Tuple

import torch
from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS, DeepSpeedConfig
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.zenflow.engine import configure_zenflow
from deepspeed.runtime.zero.utils import ZERO_SUPPORTED_OPTIMIZERS

from ..comm.topology import check_hpz_node, check_whole_nodes
from ..config import DGC_SECTION, DGCConfig, DGCConfigError, check_engine_compatible, json_type
from . import optimizer as owners
from .accumulation import holds_windows, sends_per_step

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
# what check_engine_compatible reads, and what the method's checks read (dotted ds_config paths)
ZERO_KEYS = ("zero_optimization.stage", "zero_optimization.zero_quantized_weights",
             "zero_optimization.zero_quantized_nontrainable_weights", "zero_optimization.zero_quantized_gradients")
METHOD_KEYS = ("optimizer", "fp16", "torch_autocast", "gradient_accumulation_steps", "managed_gradient_accumulation",
               "zero_optimization.offload_optimizer", "zero_allow_untested_optimizer")


class ConfigEngine:
    """``DeepSpeedEngine``'s config accessors over a ds_config dict, without a model, a process group or a device.

    DeepSpeed's batch arithmetic needs the world size, which a file does not say: given ``world_size`` (data-parallel
    ranks), DeepSpeed's own arithmetic runs on the file's batch keys for that world; without it, the batch keys are
    replaced by one micro-batch of ``gradient_accumulation_steps`` (1 where the file does not give it;
    :func:`check_job` has checked that it is an integer). ``ds_config`` is the file without its ``"dgc"`` section.

    Raises:
        Whatever ``DeepSpeedConfig`` raises for the file (a ValueError or pydantic's ValidationError, naming the key;
        an AssertionError for batch sizes that do not fit ``world_size``).
    """

    client_optimizer = None
    _ACCESSORS = ("zero_optimization_stage", "zero_quantized_weights", "zero_quantized_nontrainable_weights",
                  "zero_quantized_gradients", "zero_use_cpu_optimizer", "fp16_enabled", "torch_autocast_enabled",
                  "gradient_accumulation_steps", "managed_gradient_accumulation", "optimizer_name",
                  "optimizer_params", "bf16_optimizer_states", "zenflow_config", "get_optimizer_configuration",
                  "zero_allow_untested_optimizer", "zero_hpz_partition_size")

    def __init__(self, ds_config: Mapping[str, Any], world_size: Optional[int] = None):
        if world_size is None:
            view = {k: v for k, v in ds_config.items() if k not in BATCH_KEYS}
            view.update(train_micro_batch_size_per_gpu=1,
                        gradient_accumulation_steps=ds_config.get("gradient_accumulation_steps", 1))
            self._config = DeepSpeedConfig(view)
        else:
            self._config = _WorldConfig(dict(ds_config), world_size)
        configure_zenflow(self)


class _WorldConfig(DeepSpeedConfig):
    """``DeepSpeedConfig`` for ``world_size`` data-parallel ranks: DeepSpeed takes the world size from
    torch.distributed, which a file check has not started (it then counts 1); the batch arithmetic and its messages
    stay DeepSpeed's."""

    def __init__(self, config: dict, world_size: int):
        self._world = world_size
        super().__init__(config)

    def _configure_train_batch_size(self):
        self.world_size = self._world
        super()._configure_train_batch_size()


for _name in ConfigEngine._ACCESSORS:  # DeepSpeed's own readings of its config, not copies of them
    setattr(ConfigEngine, _name, getattr(DeepSpeedEngine, _name))


def _without_auto(value, path: str = "") -> Tuple[Any, List[str]]:
    """``value`` without its ``"auto"`` leaves (the Trainer and Accelerate fill them in at launch), and their
    dotted paths."""
    if isinstance(value, Mapping):
        kept, auto = {}, []
        for key, v in value.items():
            sub = f"{path}.{key}" if path else str(key)
            if v == "auto" or (isinstance(v, (list, tuple)) and "auto" in v):
                auto.append(sub)
            else:
                kept[key], more = _without_auto(v, sub)
                auto += more
        return kept, auto
    return value, []


def _touches(paths: Sequence[str], keys: Sequence[str]) -> List[str]:
    """The paths in ``paths`` that are, hold or lie under one of ``keys``."""
    return [p for p in paths if any(p == k or p.startswith(k + ".") or k.startswith(p + ".") for k in keys)]


def _one_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {' '.join(str(err).split())}"


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


def basic_optimizer(engine: ConfigEngine, spelled: Any) -> Tuple[Optional[Any], Optional[type], str]:
    """The basic optimizer DeepSpeed would build from the file's ``"optimizer"`` section, or None and why not.

    Args:
        spelled: the section's ``"type"`` as the file spells it (DeepSpeed lower-cases its own names).

    Returns:
        ``(optimizer, class, "")``: a torch optimizer on a one-element parameter, or a stand-in named as DeepSpeed's
        class; or ``(None, None, reason)`` where the file names no optimizer or one of DeepSpeed's that this does
        not stand in for.

    Raises:
        ValueError: DeepSpeed would refuse the name, or the optimizer's constructor refuses its params (the
            constructor's message).
    """
    name = engine.optimizer_name()
    if name is None:
        return None, None, "the file has no 'optimizer' section (an optimizer passed in code is checked at initialize)"
    if not isinstance(name, str) or not DeepSpeedEngine._is_supported_optimizer(engine, name):
        raise ValueError(f"'optimizer.type' = {spelled!r} is not a supported DeepSpeed optimizer (initialize would "
                         f"refuse it): one of DeepSpeed's ({', '.join(DEEPSPEED_OPTIMIZERS)}, in any case) or a class "
                         "of torch.optim, spelled as torch spells it (\"SGD\")")
    params = engine.optimizer_params()
    if not isinstance(params, Mapping):
        raise ValueError(f"'optimizer.params' must be a JSON object, got {json_type(params)}")
    params = dict(params)
    if name in ("adam", "adamw"):  # DeepSpeed's own choice among torch's, CPU and fused Adam
        adam_w_mode = params.pop("adam_w_mode", True)
        cls, kwargs = engine.get_optimizer_configuration(params, name == "adamw" or adam_w_mode)
    elif name == "lion":
        from deepspeed.ops.lion import DeepSpeedCPULion, FusedLion
        cls, kwargs = (DeepSpeedCPULion if engine.zero_use_cpu_optimizer() else FusedLion), {}
    elif isinstance(getattr(torch.optim, name, None), type):
        cls, kwargs = getattr(torch.optim, name), {}
    else:
        return None, None, (f"{spelled!r} is one of DeepSpeed's own optimizers, which this check does not build "
                            "(deepspeed.initialize checks it)")
    try:
        if cls.__module__.startswith("torch."):
            return cls([torch.nn.Parameter(torch.zeros(1))], **params, **kwargs), cls, ""
        return _stand_in(cls, params, kwargs), cls, ""
    except Exception as err:  # the constructor's own refusal (torch's ValueError for a beta out of range, ...)
        raise ValueError(f"'optimizer.params' are refused by {cls.__name__}: {_one_line(err)}") from None


def check_job(cfg: DGCConfig, ds_config: Mapping[str, Any], world_size: Optional[int] = None,
              ranks_per_node: Optional[int] = None) -> str:
    """Make the checks of ``deepspeed.initialize`` that a ds_config file decides: ZeRO stage 3 and the ZeRO settings
    that compete with compression (:func:`~deepspeed_dgc.config.check_engine_compatible`), DeepSpeed's own refusal of
    an optimizer it does not know or ZeRO has not tested, and the momentum method against the optimizer, fp16,
    ``torch_autocast``, optimizer offload and the sends per step
    (:func:`~deepspeed_dgc.zero3.optimizer.check_method_fits`), with initialize's messages. Settings that hold
    ``"auto"`` are left out, and what they decide is not checked.

    With ``world_size`` (the job's data-parallel ranks), also DeepSpeed's batch arithmetic for that world (unless a
    batch key holds ``"auto"``) and, under ``"hierarchical"``, whole nodes of ``dgc.ranks_per_node`` ranks, else of
    ``ranks_per_node`` (the launcher's ``LOCAL_SIZE``).

    Args:
        cfg: the file's enabled ``"dgc"`` config; ds_config: the whole file; world_size: ranks of the job, or None;
        ranks_per_node: ranks per node the launcher will start, or None.

    Returns:
        What was checked, and what was left to ``deepspeed.initialize`` (``"auto"`` values, no optimizer section,
        the batch sizes and the world size where ``world_size`` is None).

    Raises:
        DGCConfigError: the combination is refused, as ``deepspeed.initialize`` would refuse it.
        ValueError: DeepSpeed, or the optimizer's constructor, refuses the file's settings (their message, one line).
    """
    view, auto = _without_auto({k: v for k, v in ds_config.items() if k != DGC_SECTION})
    gas = view.get("gradient_accumulation_steps")
    if gas is not None and (isinstance(gas, bool) or not isinstance(gas, int) or gas < 1):
        raise ValueError(f"'gradient_accumulation_steps' must be an integer >= 1 (or \"auto\"), got {gas!r}")
    if _touches(auto, ZERO_KEYS):
        return (f"job settings not checked: {_said(_touches(auto, ZERO_KEYS))} \"auto\" (filled in by the Trainer or "
                "Accelerate); deepspeed.initialize checks them")
    batch_auto = _touches(auto, BATCH_KEYS)
    sized = world_size is not None and not batch_auto
    try:
        engine = ConfigEngine(view, world_size if sized else None)
    except Exception as err:  # DeepSpeed's parse: pydantic's ValidationError, AssertionError, TypeError, ...
        whose = f"refuses the file's settings for {world_size} ranks" if sized else "cannot read the file's settings"
        raise ValueError(f"DeepSpeed {whose}: {_one_line(err)}") from None
    check_engine_compatible(cfg, engine)
    later = _world_said(cfg, engine, world_size, ranks_per_node, batch_auto)
    held = holds_windows(cfg, engine)  # one send per step, whatever the window
    undecided = [p for p in _touches(auto, METHOD_KEYS) if not (held and p == "gradient_accumulation_steps")]
    if undecided:
        return (f"ZeRO settings fit; the method against the optimizer is not checked: {_said(undecided)} \"auto\" "
                f"(filled in by the Trainer or Accelerate; deepspeed.initialize checks it); {later}")
    spelled = ds_config["optimizer"].get("type") if isinstance(ds_config.get("optimizer"), Mapping) else None
    optimizer, cls, why = basic_optimizer(engine, spelled)
    if optimizer is None:
        return f"ZeRO settings fit; the optimizer is not checked: {why}; {later}"
    if cls not in ZERO_SUPPORTED_OPTIMIZERS and not engine.zero_allow_untested_optimizer():
        raise ValueError(f"DeepSpeed refuses {cls.__name__} under ZeRO at initialize unless the file says "
                         "\"zero_allow_untested_optimizer\": true (\"You are using an untested ZeRO Optimizer\")")
    try:
        owners.check_method_fits(cfg, optimizer, sends_per_step(cfg, engine), engine.fp16_enabled(),
                                 engine.zero_use_cpu_optimizer(), engine.torch_autocast_enabled())
    except DGCConfigError:
        raise
    except Exception as err:  # a param group of odd values (betas of one element, ...)
        raise ValueError(f"'optimizer.params' cannot be read: {_one_line(err)}") from None
    sends = "" if sized or held or "gradient_accumulation_steps" in ds_config or "train_batch_size" not in ds_config \
        else " (the sends per step follow the world size: 1 assumed)"
    return (f"job fits: {type(optimizer).__name__} (what DeepSpeed builds from the 'optimizer' section), "
            f"fp16 {'on' if engine.fp16_enabled() else 'off'}, optimizer offload "
            f"{'on' if engine.zero_use_cpu_optimizer() else 'off'}{sends}; {later}")


def _world_said(cfg: DGCConfig, engine: ConfigEngine, world_size: Optional[int], ranks_per_node: Optional[int],
                batch_auto: Sequence[str]) -> str:
    """What :func:`check_job` checked of the world and the nodes, or left to initialize. Under ``"hierarchical"``
    with a known node (``dgc.ranks_per_node``, else ``ranks_per_node``): hpZ's node against it, and with
    ``world_size`` whole nodes.

    Raises:
        DGCConfigError: the node disagrees with hpZ's, or ``world_size`` is not whole nodes.
    """
    if world_size is None:
        said = ["the batch sizes and the world size are checked at initialize"]
    elif batch_auto:
        said = [f"batch sizes not checked: {_said(batch_auto)} \"auto\""]
    else:
        said = [f"the batch sizes fit {world_size} ranks"]
    if cfg.topology == "hierarchical":
        per_node, source = ((cfg.ranks_per_node, "dgc.ranks_per_node") if cfg.ranks_per_node is not None else
                            (ranks_per_node, "--ranks-per-node"))
        if per_node is not None:
            check_hpz_node(engine.zero_hpz_partition_size(), per_node, source)
        if world_size is not None and per_node is None:
            said.append("the nodes are not checked: 'dgc.ranks_per_node' is null (the launcher's LOCAL_SIZE; give "
                        "--ranks-per-node)")
        elif world_size is not None:
            check_whole_nodes(world_size, per_node)
            nodes = world_size // per_node
            said.append(f"{nodes} node{'s' if nodes > 1 else ''} of {per_node} rank{'s' if per_node > 1 else ''}")
    return ", ".join(said)


def _said(paths: Sequence[str]) -> str:
    return ", ".join(repr(p) for p in paths) + (" holds" if len(paths) == 1 else " hold")
