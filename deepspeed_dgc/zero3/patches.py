"""Every patch this extension makes to DeepSpeed, in one place: the seams, the version check, install and uninstall.

DeepSpeed 0.19.8 has no public hook for the gradient reduce-scatter of ZeRO-3, so the extension replaces, and
can put back, exactly these (:data:`SEAMS`):

==========================================================  ==========  =============================================
seam                                                        scope       what replaces it
==========================================================  ==========  =============================================
``DeepSpeedEngine._configure_zero_optimizer``               class       builds the ZeRO-3 optimizer, then :func:`install`
                                                                        when ``"dgc": {"enabled": true}``
``DeepSpeedEngine.__init__``                                class       an enabled ``"dgc"`` section that no ZeRO-3
                                                                        optimizer consumed is an error
``DeepSpeedZeroOptimizer_Stage3.__avg_scatter_grads``       instance    the compressed reduce-scatter of a bucket
``DeepSpeedZeroOptimizer_Stage3.__avg_scatter_contiguous_``  instance    the same, where stock all-reduces the bucket
``grads`` (``reduce_scatter: false`` + contiguous gradients)
``DeepSpeedZeroOptimizer_Stage3.step``                      instance    commits or rolls back error feedback, telemetry
``DeepSpeedZeroOptimizer_Stage3.independent_gradient_``     instance    then sends what an accumulation window holds
``partition_epilogue``                                                  for parameters unused in its last micro-step
``DeepSpeedEngine.save_checkpoint`` / ``load_checkpoint``   instance    also write / read the side-car
``partition_parameters._dist_allgather_fn``                 module      the quantized parameter all-gather
``<owners' torch optimizer>.step``, ``clip_grad``           instance    the owners' steps of the momentum methods
``DeepSpeedZeroOptimizer_Stage3.get_fp32_grad_for_param``,  instance    DeepSpeed's ``safe_*_grad`` and
``get_full_hp_param`` and their ``set``/``local`` variants              ``safe_*_optimizer_state`` under the method
                                                                        (:mod:`.ds_api`)
==========================================================  ==========  =============================================

Class-level wrappers are installed by :func:`activate` (``import deepspeed_dgc``) and removed by
:func:`deactivate`; instance patches by :func:`install` and removed by :func:`uninstall`. The work itself is
done elsewhere: :mod:`.reduce_scatter`, :mod:`.allgather`, :mod:`.optimizer`, :mod:`.checkpoint`, :mod:`.ds_api`.
"""

import dataclasses
import functools
import logging
import os
import secrets
from dataclasses import dataclass
from typing import Callable, Optional

import deepspeed
import torch
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.zero import partition_parameters
from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

from ..codec.kernels import DGCKernelError
from ..codec.layout import real_count
from ..comm.agreement import check_agreement, gather_int, ranks_failing
from ..comm.communicators import DGCBackendError, check_mpi_world, group_timeout_s
from ..comm.topology import check_hpz_node, resolve_ranks_per_node
from ..config import (DGCConfig, check_engine_compatible, misspelled_section, parse_dgc_config,
                      switched_off_by_default)
from ..memory.momentum import CompressedMomentum, DecoupledMomentum, MomentumCorrection
from . import checkpoint, ds_api, saving
from .accumulation import holds_windows, sends_per_step
from . import optimizer as owners
from .allgather import QuantizedAllGather, check_layout_seam
from .policy import STOCK, stock_result_bytes
from .reduce_scatter import reduce_result
from .state import STATE_ATTR, DGCState
from .swap import ORIGINALS, replace, restore

logger = logging.getLogger("deepspeed_dgc")

TESTED_DEEPSPEED = "0.19.8"
SEAM = "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads"
CONTIGUOUS_SEAM = "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_contiguous_grads"


@dataclass(frozen=True)
class Seam:
    """One place of DeepSpeed the extension replaces: ``owner.name``, at class, instance or module scope."""
    owner: object
    name: str
    scope: str
    purpose: str


SEAMS = (
    Seam(DeepSpeedEngine, "_configure_zero_optimizer", "class", "install DGC on the ZeRO-3 optimizer it builds"),
    Seam(DeepSpeedEngine, "__init__", "class", "refuse an enabled 'dgc' section nothing consumed"),
    Seam(DeepSpeedZeroOptimizer_Stage3, SEAM, "instance", "the compressed reduce-scatter of one bucket"),
    Seam(DeepSpeedZeroOptimizer_Stage3, CONTIGUOUS_SEAM, "instance", "the same where stock all-reduces the bucket"),
    Seam(DeepSpeedZeroOptimizer_Stage3, "step", "instance", "commit or roll back error feedback; telemetry"),
    Seam(DeepSpeedZeroOptimizer_Stage3, "independent_gradient_partition_epilogue", "instance",
         "send what an accumulation window holds for parameters without a gradient in its last micro-step"),
    Seam(DeepSpeedEngine, "save_checkpoint", "instance", "write the side-car too"),
    Seam(DeepSpeedEngine, "load_checkpoint", "instance", "read the side-car too"),
    Seam(partition_parameters, "_dist_allgather_fn", "module", "the quantized parameter all-gather"),
)


class DGCSeamError(ImportError):
    """The installed DeepSpeed lacks the methods this extension replaces."""


def check_seam() -> None:
    """Fail loudly when DeepSpeed lacks a method we replace (another DeepSpeed version).

    Raises:
        DGCSeamError: naming the missing methods and the installed DeepSpeed version.
    """
    missing = [s.name for s in SEAMS if not hasattr(s.owner, s.name)]
    layout = check_layout_seam(partition_parameters.Init._convert_to_deepspeed_param)
    if layout:
        missing.append(layout)
    if missing:
        raise DGCSeamError(f"deepspeed_dgc needs {', '.join(missing)}, which deepspeed {deepspeed.__version__} lacks; "
                           f"install the DeepSpeed version range in setup.py (tested: {TESTED_DEEPSPEED})")


# ---- class level: activate / deactivate -----------------------------------------------------------


def activate() -> None:
    """Install the class-level wrappers on ``DeepSpeedEngine`` once (idempotent). Called by ``import deepspeed_dgc``.

    Raises:
        DGCSeamError: DeepSpeed lacks a seam (:func:`check_seam`).
    """
    check_seam()
    for name, wrap in (("_configure_zero_optimizer", _wrap_configure_zero_optimizer), ("__init__", _wrap_engine_init)):
        current = getattr(DeepSpeedEngine, name)
        if not getattr(current, "_dgc_original", None):
            wrapped = wrap(current)
            wrapped._dgc_original = current
            setattr(DeepSpeedEngine, name, wrapped)


def deactivate() -> None:
    """Remove the class-level wrappers (engines built afterwards are stock; installed ones keep their patches)."""
    for name in ("_configure_zero_optimizer", "__init__"):
        original = getattr(getattr(DeepSpeedEngine, name), "_dgc_original", None)
        if original is not None:
            setattr(DeepSpeedEngine, name, original)


def _engine_ds_config(engine) -> dict:
    return engine.config if isinstance(engine.config, dict) else {}


def _engine_dgc_config(engine) -> Optional[DGCConfig]:
    return parse_dgc_config(_engine_ds_config(engine))


def _wrap_configure_zero_optimizer(orig):

    @functools.wraps(orig)
    def _configure_zero_optimizer(self, optimizer):  # DeepSpeed passes it by keyword too
        cfg = _engine_dgc_config(self)
        if self.zero_optimization_stage() == 3:
            # every ZeRO-3 rank takes part, DGC on or off: a rank whose "dgc" section differs (even
            # one that has it disabled or absent) fails here, on every rank, naming the key
            effective = cfg or DGCConfig()
            check_agreement(effective, None, with_timeout(effective).timeout_s)
        if cfg is None or not cfg.enabled:
            opt = orig(self, optimizer)
            if self.zero_optimization_stage() == 3:
                _patch_plain_loading(self)  # a DGC checkpoint loaded here says what is ignored
            return opt
        check_engine_compatible(cfg, self)
        opt = orig(self, optimizer)
        install(self, opt, cfg)
        return opt

    return _configure_zero_optimizer


def _wrap_engine_init(orig):

    @functools.wraps(orig)
    def __init__(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        cfg = _engine_dgc_config(self)
        if getattr(self, "global_rank", 0) == 0:
            for slip in (switched_off_by_default(cfg), misspelled_section(_engine_ds_config(self))):
                if slip:
                    logger.warning(slip)
        if cfg is not None and cfg.enabled and getattr(self, STATE_ATTR, None) is None:
            check_engine_compatible(cfg, self)  # names the clashing key, e.g. a stage other than 3
            raise RuntimeError("'dgc.enabled' is true but no ZeRO-3 engine was built to compress "
                               "('zero_optimization.stage' = 3 is required)")

    return __init__


# ---- instance level: install / uninstall ----------------------------------------------------------


def install(engine, opt, cfg: DGCConfig) -> DGCState:
    """Patch a ZeRO-3 optimizer instance of ``engine`` with the compressed reduce-scatter.

    Collective over the world: resolves ranks per node (with the hierarchical topology, checks that every rank
    found the same; the other settings were compared before the optimizer was built), checks that the fused op
    loads everywhere when ``kernels`` is ``"fused"``, and builds the communicators.

    Args:
        engine: the ``DeepSpeedEngine`` that owns ``opt``.
        opt: a ``DeepSpeedZeroOptimizer_Stage3`` (or subclass) instance.
        cfg: the enabled ``"dgc"`` config.

    Returns:
        The :class:`~deepspeed_dgc.zero3.state.DGCState` now attached to both engine and optimizer.

    Raises:
        DGCConfigError: no optimizer was given (ZeRO-3 then only offloads parameters); settings
            differ between ranks; hpZ and the hierarchical topology disagree on the node size; the optimizer
            does not fit the momentum method asked for.
        DGCBackendError: ``comm_backend`` ``"mpi"`` without mpi4py or outside an MPI job.
        DGCKernelError: ``kernels`` ``"fused"`` and the fused op cannot load on some rank (on every rank).
        DGCSeamError: ``opt`` is not a ZeRO-3 optimizer with the expected method.
    """
    cfg = with_timeout(cfg, getattr(opt, "dp_process_group", None))
    if isinstance(opt, DeepSpeedZeRoOffload):  # no optimizer: inference, evaluation, a model built in zero.Init
        return _install_without_optimizer(engine, opt, cfg)
    _check_optimizer_instance(opt)
    ranks_per_node = _check_job(engine, cfg)
    state = DGCState.build(cfg, engine.global_rank, ranks_per_node, _momentum_state(engine, opt, cfg),
                           module=engine.module, param_groups=[{"params": g} for g in opt.fp16_groups],
                           dp_rank=dist.get_rank(group=opt.dp_process_group),
                           dp_world_size=dist.get_world_size(group=opt.dp_process_group),
                           monitor=getattr(engine, "monitor", None),
                           samples_seen=lambda: getattr(engine, "global_samples", 0))
    _choose_kernels(state, engine.global_rank)
    comms = state.reducer.comms_for(opt.dp_process_group)  # collective: every rank builds its groups now
    if state.policy is not None:  # and the stock exchange "auto" measures against
        state.policy._stock_comm(state.reducer, opt.dp_process_group)
    if comms.hierarchical and comms.n_nodes == 1 and engine.global_rank == 0:
        logger.warning("deepspeed_dgc: 'dgc.topology' is \"hierarchical\" but all %d ranks are on one node "
                       "(%d ranks per node): gradients are reduced densely inside the node and nothing is "
                       "compressed%s", comms.world_size, comms.ranks_per_node,
                       " (decoupled_momentum still extracts its top-k from each rank's momentum of the node's sums, so "
                       "the owners' step stays DeMo's)" if cfg.decoupled_momentum is not None else "")
    _patch_instance(engine, opt, state)
    return state


def uninstall(engine) -> None:
    """Undo :func:`install` on an engine: its optimizer and checkpoint methods are stock again, the owners' step and
    gradient clipping as before, the parameter all-gather as before the install. Nothing when DGC is not on it."""
    state = getattr(engine, STATE_ATTR, None)
    if state is None:
        return
    opt = engine.optimizer
    ds_api.uninstall(opt)
    for obj in (opt, engine, opt.optimizer):
        for name in list(getattr(obj, ORIGINALS, {})):
            restore(obj, name)
        obj.__dict__.pop(ORIGINALS, None)
    stock = getattr(partition_parameters._dist_allgather_fn, "stock", None)
    if stock is not None:
        partition_parameters._dist_allgather_fn = stock
    for obj in (opt, engine):
        obj.__dict__.pop(STATE_ATTR, None)


def with_timeout(cfg: DGCConfig, group=None) -> DGCConfig:
    """``cfg`` with ``timeout_s`` resolved: as given, or (``null``) the own timeout of ``group`` (None: the world),
    the process group the extension's collectives stand in for."""
    if cfg.timeout_s is not None:
        return cfg
    return cfg.model_copy(update={"timeout_s": group_timeout_s(group)})


def _install_without_optimizer(engine, offload, cfg: DGCConfig) -> DGCState:
    """An engine without an optimizer reduces no gradients: only the parameter all-gather is compressed (where
    ``weights.quantization`` asks for it); one log line says so."""
    ranks_per_node, _ = resolve_ranks_per_node(cfg)
    group = getattr(offload, "dp_process_group", None)
    state = DGCState.build(cfg, engine.global_rank, ranks_per_node, module=engine.module,
                           dp_rank=dist.get_rank(group=group), dp_world_size=dist.get_world_size(group=group),
                           monitor=getattr(engine, "monitor", None))
    state.stats.kernels = "none"
    if engine.global_rank == 0:  # a warning: the "dgc" section asks for more than this engine can do
        logger.warning("deepspeed_dgc: this engine has no optimizer, so gradient compression has nothing to do; "
                    "the parameter all-gather is %s", "quantized to " + cfg.weights.quantization
                    if cfg.weights.quantization != "none" else "stock (counted)")
    _install_allgather(cfg, state)
    setattr(engine, STATE_ATTR, state)
    return state


def _check_optimizer_instance(opt) -> None:
    if not isinstance(opt, DeepSpeedZeroOptimizer_Stage3) or not hasattr(opt, SEAM):
        raise DGCSeamError(f"deepspeed_dgc can only patch a ZeRO-3 optimizer, got {type(opt).__name__}")


def _check_job(engine, cfg: DGCConfig) -> int:
    """What must hold across the job before anything is built; returns the ranks per node."""
    ranks_per_node, source = resolve_ranks_per_node(cfg)
    if cfg.topology == "hierarchical":  # the launcher's node size must agree too (the rest already did)
        check_agreement(cfg, ranks_per_node, cfg.timeout_s)
    if cfg.comm_backend == "mpi":
        problem = check_mpi_world()
        if problem:
            raise DGCBackendError(f"'dgc.comm_backend' = \"mpi\": {problem}")
    if cfg.topology == "hierarchical":
        check_hpz_node(engine.zero_hpz_partition_size(), ranks_per_node, source)
    return ranks_per_node


def _momentum_state(engine, opt, cfg: DGCConfig):
    """The momentum state the config asks for, after checking that the owners' optimizer fits it; or None."""
    offload = bool(getattr(opt, "offload_optimizer", False))
    fit = owners.check_method_fits(cfg, opt.optimizer, sends_per_step(cfg, engine), engine.fp16_enabled(), offload,
                                   engine.torch_autocast_enabled())
    if cfg.compressed_momentum is not None:
        return CompressedMomentum(cfg.compressed_momentum, fit)
    if cfg.decoupled_momentum is not None:
        on_host = cfg.decoupled_momentum.offload
        return DecoupledMomentum(cfg.decoupled_momentum, offload if on_host is None else on_host)
    if cfg.momentum_correction:
        return MomentumCorrection(cfg, fit, dist.get_world_size(group=opt.dp_process_group))
    return None


def _choose_kernels(state: DGCState, global_rank: int) -> None:
    """Load the compression ops now; with ``kernels`` ``"fused"`` every rank fails if any rank cannot load them."""
    cfg, failure = state.cfg, ""
    try:
        ops = state.reducer.ops_for(get_accelerator().device_name())  # "fused" that cannot load fails here
    except DGCKernelError as err:
        failure = str(err)
    if cfg.kernels == "fused":  # same config on every rank (checked): all take part, all fail together
        bad = ranks_failing(not failure, "the fused-op check", cfg.timeout_s)
        if bad:
            raise DGCKernelError(failure or f"'dgc.kernels' is \"fused\" but the fused op could not load on rank(s) "
                                 f"{bad} (see their logs)")
    state.stats.kernels = ops.name
    if global_rank == 0:
        logger.info("deepspeed_dgc: compression by the %s path (dgc.kernels = %s)", ops.name, cfg.kernels)


def _patch_instance(engine, opt, state: DGCState) -> None:
    cfg = state.cfg
    replace(opt, SEAM, _avg_scatter_grads(opt, state))
    replace(opt, CONTIGUOUS_SEAM, _avg_scatter_contiguous_grads(opt, state))
    replace(opt, "step", _step(opt, state))
    replace(opt, "independent_gradient_partition_epilogue", _send_leftovers(opt, state))
    state.holds_windows = holds_windows(state.cfg, engine)
    replace(engine, "save_checkpoint", _save_checkpoint(engine, state))
    replace(engine, "load_checkpoint", _load_checkpoint(engine, state))
    _method(state).install(engine, opt, state)  # the owners' side of the method (its optimizer step)
    ds_api.install(opt, state, lambda: _method(state))  # DeepSpeed's safe_get_* APIs under the method
    _install_allgather(cfg, state)
    setattr(opt, STATE_ATTR, state)
    setattr(engine, STATE_ATTR, state)


def _method(state: DGCState):
    """The gradient method of this engine's device (:mod:`deepspeed_dgc.methods`)."""
    return state.reducer.method_for(get_accelerator().device_name())


def _window_ends(opt) -> bool:
    """Whether the micro-step being reduced is ZeRO-3's gradient accumulation boundary (the engine mirrors it into
    the optimizer before backward; False where this DeepSpeed does not say, so nothing is staged early)."""
    boundary = getattr(opt, "is_gradient_accumulation_boundary", None)
    return bool(boundary()) if callable(boundary) else False


def _avg_scatter_grads(opt, state: DGCState) -> Callable:
    """The replacement of ``opt.__avg_scatter_grads(params, communication_data_type)``: stock's contract (this rank's
    partitions of the mean, in ``gradient_accumulation_dtype``), our collective."""

    def avg_scatter_grads(params_to_reduce, communication_data_type):
        opt._assert_same_partition_group(params_to_reduce)
        group = opt._get_param_partition_group(params_to_reduce[0])
        if _held(opt, state, params_to_reduce, group):
            comms = state.reducer.comms_for(group)
            # rank r's slice flat[r*c : min((r+1)*c, n)], c = ceil(n / W): the compressed reduce-scatter's contract
            return [state.window.zeros(real_count(p.ds_numel, comms.rank, -(-p.ds_numel // comms.world_size)),
                                       opt.gradient_accumulation_dtype, p.grad.device) for p in params_to_reduce]
        state.set_window_end(_window_ends(opt))
        if _by_stock(opt, state, params_to_reduce, group, communication_data_type):
            return _stock_method(opt, SEAM)(params_to_reduce, communication_data_type)
        return _compressed_partitions(opt, state, params_to_reduce, [p.grad for p in params_to_reduce], group,
                                      communication_data_type)

    return avg_scatter_grads


def _compressed_partitions(opt, state: DGCState, params, grads, group, communication_data_type):
    """This rank's partitions of the mean over ``group`` of ``grads`` (``params``' full gradients, consumed), by the
    compressed reduce-scatter (stock's contract of ``__avg_scatter_grads``)."""
    partitions, result = state.reducer.reduce_scatter(grads, [state.key_of(p) for p in params],
                                                      group, communication_data_type,
                                                      loss_scale=float(opt.loss_scale), consume=True)
    state.stats.record(result)
    world = state.reducer.comms_for(group).world_size
    averaging_world_size = opt._gradient_averaging_world_size(params, world)
    if averaging_world_size != world:  # sequence/expert parallel averaging, as stock
        partitions = [g.mul(world / float(averaging_world_size)) for g in partitions]
    if not getattr(opt, "zenflow", False):
        # fp32 views of the bucket's row: partition_grads copies each into its gradient_accumulation_dtype buffer
        # (the same rounding as .to) or converts it before adding, so no narrower copy of the whole row is made
        # beside it (1 B per bucket element at 2 ranks with bf16)
        return partitions
    return [g.to(opt.gradient_accumulation_dtype) for g in partitions]


def _held(opt, state: DGCState, params, group) -> bool:
    """Local accumulation (:mod:`.accumulation`): before ZeRO-3's accumulation boundary, add the bucket's gradients
    to the window's and send nothing (True; the telemetry counts what stock would have sent); at the boundary, add
    the window's sums into the gradients about to be sent (False)."""
    if not state.holds_windows:
        return False
    if _window_ends(opt):
        if state.window.held:  # nothing is held at accumulation 1: no lists to build on every bucket
            state.window.fold([p.grad for p in params], [state.key_of(p) for p in params])
        return False
    grads = [p.grad for p in params]
    state.window.hold(grads, [state.key_of(p) for p in params], opt.gradient_accumulation_dtype)
    comms = state.reducer.comms_for(group)
    numels = [g.numel() for g in grads]
    state.stats.record(dataclasses.replace(reduce_result(comms, numels, 0, 0, kept=0), numel=0))
    return True


def _send_leftovers(opt, state: DGCState) -> Callable:
    """``opt.independent_gradient_partition_epilogue`` (the end of every backward) that then sends, at the window's
    end, what the window still holds: the sums of parameters without a gradient in its last micro-step (in none of
    its buckets, all reduced by the epilogue itself, its stream synchronized): one compressed reduce-scatter per
    partition group and dtype, into ZeRO-3's gradient partitions (``partition_grads``, which adds them to the zeros
    the held micro-steps left there; ``averaged_gradients`` holds views of those). Every rank must hold the same
    parameters then, as every rank must reduce the same buckets in stock ZeRO-3."""
    epilogue = opt.independent_gradient_partition_epilogue

    @functools.wraps(epilogue)
    def independent_gradient_partition_epilogue(*args, **kwargs):
        out = epilogue(*args, **kwargs)
        if state.window.held and _window_ends(opt):
            left = set(state.window.leftovers())
            batches = {}
            for p in (p for group in opt.fp16_groups for p in group if state.keys.get(id(p)) in left):
                grad = state.window.take(state.key_of(p))
                batches.setdefault((opt._get_param_partition_group(p), grad.dtype), []).append((p, grad))
            state.set_window_end(True)
            for (group, dtype), pairs in batches.items():
                ps = [p for p, _ in pairs]
                opt.partition_grads(ps, _compressed_partitions(opt, state, ps, [g for _, g in pairs], group, dtype))
        return out

    return independent_gradient_partition_epilogue


def _avg_scatter_contiguous_grads(opt, state: DGCState) -> Callable:
    """The replacement of ``opt.__avg_scatter_contiguous_grads(buffer, communication_data_type)``, which stock uses
    with ``reduce_scatter: false`` and contiguous gradients (an all-reduce of the bucket): the same compressed
    reduce-scatter of the bucket's gradients (views into ``buffer``), then stock's contract: each parameter's
    partition padded to ``partition_numel()``, stock's scaling (predivide and postscale factors, sequence-parallel
    averaging), in ``gradient_accumulation_dtype``."""

    def avg_scatter_contiguous_grads(buffer_to_reduce, communication_data_type):
        params = opt.ipg_buckets[communication_data_type].params
        opt._assert_same_partition_group(params)
        group = opt._get_param_partition_group(params[0])
        if _held(opt, state, params, group):
            return [state.window.zeros(p.partition_numel(), opt.gradient_accumulation_dtype, buffer_to_reduce.device)
                    for p in params]
        state.set_window_end(_window_ends(opt))
        if _by_stock(opt, state, params, group, communication_data_type):
            return _stock_method(opt, CONTIGUOUS_SEAM)(buffer_to_reduce, communication_data_type)
        partitions, result = state.reducer.reduce_scatter([p.grad for p in params], [state.key_of(p) for p in params],
                                                          group, communication_data_type,
                                                          loss_scale=float(opt.loss_scale), consume=True)
        state.stats.record(result)
        world = state.reducer.comms_for(group).world_size
        # stock divides by the averaging world size over the sequence-parallel size (we divided by W), and with
        # postscale_gradients by gradient_predivide_factor before the all-reduce and multiplies by it after
        averaging = opt._gradient_averaging_world_size(params, world)
        factor = world / (averaging / float(opt.sequence_parallel_size))
        pre = opt.gradient_predivide_factor
        if opt.postscale_gradients and pre != 1.0:
            factor /= pre
        if opt.postscale_gradients and pre != averaging:
            factor *= pre
        out = []
        for p, g in zip(params, partitions):
            g = (g if factor == 1.0 else g.mul(factor)).to(opt.gradient_accumulation_dtype)
            if g.numel() != p.partition_numel():
                g = torch.nn.functional.pad(g, (0, p.partition_numel() - g.numel()))
            out.append(g)
        return out

    return avg_scatter_contiguous_grads


def _stock_method(opt, name: str) -> Callable:
    """Stock's own ``opt.name`` (the instance's attribute before :func:`_replace`, else the class's), bound."""
    own = opt.__dict__.get(ORIGINALS, {}).get(name)
    return own if own is not None else getattr(type(opt), name).__get__(opt)


def _by_stock(opt, state: DGCState, params, group, comm_dtype) -> bool:
    """``policy: "auto"``: whether this bucket goes by stock's reduce-scatter (:mod:`~deepspeed_dgc.zero3.policy`,
    collective when it measures). If so, the method makes the gradients stock is about to send carry what it has not
    sent yet (:meth:`~deepspeed_dgc.methods.base.GradientMethod.send_by_stock`: the residuals, or under decoupled
    momentum this rank's DeMo extraction), and the telemetry counts stock's bytes."""
    if state.policy is None:
        return False
    reducer = state.reducer
    grads, keys = [p.grad for p in params], [state.key_of(p) for p in params]
    choice = state.policy.choose(reducer, grads, group, comm_dtype)
    state.stats.policy, state.stats.policy_probe_bytes = state.policy.summary(), state.policy.probe_bytes
    if choice != STOCK:
        return False
    comms = reducer.comms_for(group)
    reducer.method_for(grads[0].device.type).send_by_stock(grads, keys, comms, comm_dtype, float(opt.loss_scale))
    numels = [g.numel() for g in grads]
    wire, inter = stock_result_bytes(numels, comms, torch.tensor([], dtype=comm_dtype).element_size())
    state.stats.record(reduce_result(comms, numels, wire - inter, inter, kept=sum(numels), stock_buckets=1))
    return True


def _step(opt, state: DGCState) -> Callable:
    """``opt.step`` followed by the end of the step for DGC: commit or roll back, then the method's own step end
    (shared masks, the freeze of compressed momentum)."""
    step = opt.step

    @functools.wraps(step)
    def dgc_step(*args, **kwargs):
        if state.window.held:  # only a window that never reached ZeRO-3's boundary leaves gradients held here
            raise RuntimeError(f"deepspeed_dgc: the optimizer step came before the end of the gradient accumulation "
                               f"window ({len(state.window)} parameters' gradients are held, not sent, under "
                               "'dgc.accumulate_locally'): step at the accumulation boundary, or set "
                               "'dgc.accumulate_locally' to false")
        out = step(*args, **kwargs)
        applied = not opt.overflow
        state.commit_step(applied)
        _method(state).after_step(opt, state, applied)
        state.close_step(applied, _persistent_gather_bytes(opt))
        return out

    return dgc_step


def _persistent_gather_bytes(opt) -> int:
    """Bytes this rank sends in the post-step all-gather of persistent parameters (not compressed)."""
    params = getattr(opt, "persistent_parameters", None) or []
    if not params:
        return 0
    return sum((opt.partition_count - 1) * p.ds_tensor.ds_numel * p.ds_tensor.element_size() for p in params)


def _install_allgather(cfg: DGCConfig, state: DGCState) -> None:
    """Replace ``partition_parameters._dist_allgather_fn`` (process-wide; the latest engine's settings win)."""
    current = partition_parameters._dist_allgather_fn
    stock = current.stock if isinstance(current, QuantizedAllGather) else current
    partition_parameters._dist_allgather_fn = QuantizedAllGather(cfg.weights.quantization, cfg.weights.group_size,
                                                                 state.stats.record_param_gather, stock, cfg.timeout_s,
                                                                 state.reducer.ranks_per_node, cfg.kernels,
                                                                 policy=state.policy,
                                                                 clock=lambda: state.reducer.steps_applied)


# in DeepSpeed's client_state: the checkpoint has side-cars: {"world_size": how many, "save_id": the id every one of
# them records} (an int, the world size, in checkpoints saved before the id)
SIDECAR_MARK = "deepspeed_dgc_sidecars"


def _take_mark(client_state):
    """Remove :data:`SIDECAR_MARK` (the extension's, not the user's) from the ``client_state`` DeepSpeed's
    ``load_checkpoint`` returns; its value, or None for a checkpoint saved without it."""
    return client_state.pop(SIDECAR_MARK, None) if isinstance(client_state, dict) else None


def _save_id_of(mark) -> Optional[int]:
    """The save id a :data:`SIDECAR_MARK` records, or None (none recorded)."""
    return mark.get("save_id") if isinstance(mark, dict) else None


def _agree(ok: bool, what: str, state: Optional[DGCState], err: Optional[Exception]) -> None:
    """Every rank raises if any rank failed ``what`` (its own error on that rank, one naming it elsewhere); bounded by
    ``dgc.timeout_s`` (``state`` None, DGC off: the world group's own timeout)."""
    bad = ranks_failing(ok, what, state.cfg.timeout_s if state is not None else group_timeout_s())
    if err is not None:
        raise err
    if bad:
        raise checkpoint.DGCCheckpointError(f"deepspeed_dgc: {what} failed on rank(s) {bad} (their own error says "
                                            "why); every rank stops here")


def _save_checkpoint(engine, state: DGCState) -> Callable:
    """``save_checkpoint`` that ``latest`` names only complete checkpoints, and that fails on every rank together.

    1. Rank 0 marks the tag as being saved (:func:`saving.begin_save`), and every rank writes its side-car
       (:func:`checkpoint.save_state`, atomic), before DeepSpeed writes any file; a rank that cannot makes every rank
       raise.
    2. DeepSpeed writes its files, with ``client_state`` recording that the checkpoint has side-cars
       (:data:`SIDECAR_MARK`), and without ``latest``: DeepSpeed 0.19.8 has rank 0 write it after rank 0's own files,
       not after every rank's. A write that fails (a full disk) is held (:class:`saving.GuardedWrites`) until every
       rank is through, then every rank raises (the failing one its own error naming the file).
    3. Once every rank has written its files, rank 0 removes the in-progress mark and writes ``latest`` atomically
       (:func:`checkpoint.write_latest`), and every rank returns after it. A decoupled (asynchronous) checkpoint
       engine writes ``latest`` itself when it commits, so there DeepSpeed's ``save_latest`` is passed on unchanged
       (and there is no in-progress mark).

    A failed save leaves the engine as it was: the run may go on training (and save again) or exit.
    """
    save = engine.save_checkpoint

    @functools.wraps(save)
    def save_checkpoint(save_dir, tag=None, client_state=None, save_latest=True, *args, **kwargs):
        tag_used = str(tag) if tag is not None else f"global_step{engine.global_steps}"
        decoupled = getattr(getattr(engine, "checkpoint_engine", None), "is_decoupled", lambda: False)()
        # one id for this save, rank 0's, in every side-car and in DeepSpeed's files: a side-car copied in from
        # another run's checkpoint of the same tag is told apart on load
        save_id = gather_int(secrets.randbits(62) if engine.global_rank == 0 else 0,
                             f"starting checkpoint {tag_used!r}", state.cfg.timeout_s)[0]
        err = None
        try:
            if engine.global_rank == 0 and not decoupled:
                saving.begin_save(save_dir, tag_used)
            checkpoint.save_state(state, save_dir, tag_used, engine.dp_world_size, save_id)
        except checkpoint.DGCCheckpointError as e:
            err = e
        _agree(err is None, f"writing the side-cars of checkpoint {tag_used!r}", state, err)
        client_state = dict(client_state or {}, **{SIDECAR_MARK: {"world_size": engine.dp_world_size,
                                                                  "save_id": save_id}})
        if decoupled:
            return save(save_dir, tag, client_state, save_latest, *args, **kwargs)
        with saving.GuardedWrites(engine.checkpoint_engine, engine) as guard:
            out = save(save_dir, tag, client_state, False, *args, **kwargs)
        _agree(not guard.errors, f"saving checkpoint {tag_used!r} in {save_dir}", state,
               guard.errors[0] if guard.errors else None)  # every rank's files are written
        err = None
        if engine.global_rank == 0:
            try:
                saving.end_save(save_dir, tag_used)
                if save_latest:
                    checkpoint.write_latest(save_dir, tag_used)
            except checkpoint.DGCCheckpointError as e:
                err = e
        _agree(err is None, f"closing checkpoint {tag_used!r} (its in-progress mark and 'latest')", state, err)
        return out

    return save_checkpoint


def _refuse_incomplete(engine, load_dir, tag, state: Optional[DGCState]) -> None:
    """Every rank raises :class:`checkpoint.DGCCheckpointError` before DeepSpeed loads anything when the checkpoint to
    load was not saved whole (:func:`saving.incomplete`), naming it and what to do."""
    why = None
    try:
        why = saving.incomplete(load_dir, _loaded_tag(engine, load_dir, tag))
    except OSError:  # no 'latest' (nothing saved there): DeepSpeed says so
        pass
    err = checkpoint.DGCCheckpointError(why) if why else None
    _agree(err is None, f"checking that checkpoint {load_dir} (tag {tag!r}) was saved whole", state, err)


def _loaded_tag(engine, load_dir, tag) -> str:
    universal = getattr(engine, "load_universal_checkpoint", lambda: False)()
    return checkpoint.tag_of(load_dir, tag, universal)


def _load_checkpoint(engine, state: DGCState) -> Callable:
    load = engine.load_checkpoint

    @functools.wraps(load)
    def load_checkpoint(load_dir, tag=None, *args, **kwargs):
        _refuse_incomplete(engine, load_dir, tag, state)
        load_path, client_state = load(load_dir, tag, *args, **kwargs)
        if load_path is None:
            return load_path, client_state
        marked = _take_mark(client_state)
        state.window.clear()  # a window's held gradients are gone with it, as stock's are
        _method(state).before_load(engine.optimizer, state)  # e.g. Adam unfrozen: the loaded state decides afresh
        msg, err = None, None
        loaded = _loaded_tag(engine, load_dir, tag)
        try:
            msg = checkpoint.load_state(state, load_dir, loaded, engine.dp_world_size, engine.device,
                                        expect_sidecars=marked is not None, save_id=_save_id_of(marked),
                                        optimizer=engine.optimizer)
        except checkpoint.DGCCheckpointError as e:
            err = e
        _agree(err is None, f"loading the side-cars of checkpoint {os.path.join(str(load_dir), loaded)}", state, err)
        state.reducer.masks = {}
        _method(state).after_load(engine.optimizer, state)  # every rank loads: collective where the method says
        routine = msg.startswith("restored") and not any(mark in msg for mark in checkpoint.NOT_ROUTINE)
        (logger.info if routine else logger.warning)(f"[deepspeed_dgc] rank {state.global_rank}: {msg}")
        return load_path, client_state

    return load_checkpoint


def _patch_plain_loading(engine) -> None:
    """For a ZeRO-3 engine without DGC: say what a checkpoint saved with DGC leaves behind.

    DeepSpeed's weights and optimizer state load as usual; the side-car's state (the residuals, a method's per-rank
    momentum) is dropped, and the optimizer's state is made usable where a method left it so (Adam's moments, which
    decoupled momentum's sign update never writes, start from zero): a warning on every rank names each
    (:func:`checkpoint.load_without_dgc`).
    """
    load = engine.load_checkpoint

    @functools.wraps(load)
    def load_checkpoint(load_dir, tag=None, *args, **kwargs):
        _refuse_incomplete(engine, load_dir, tag, None)
        load_path, client_state = load(load_dir, tag, *args, **kwargs)
        marked = _take_mark(client_state)
        if load_path is not None:
            opt = engine.optimizer
            msg = checkpoint.load_without_dgc(opt, load_dir, _loaded_tag(engine, load_dir, tag), load_path,
                                              dist.get_rank(group=getattr(opt, "dp_process_group", None)),
                                              _save_id_of(marked))
            if msg:
                logger.warning(f"[deepspeed_dgc] rank {engine.global_rank}: {msg}")
        return load_path, client_state

    replace(engine, "load_checkpoint", load_checkpoint)
