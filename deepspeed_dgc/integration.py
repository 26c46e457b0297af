"""The ZeRO-3 seam: activation from ds_config and the patch of the optimizer instance.

``import deepspeed_dgc`` wraps ``DeepSpeedEngine._configure_zero_optimizer`` (every caller of
``deepspeed.initialize`` goes through it: scripts, HF Trainer, Accelerate) and
``DeepSpeedEngine.__init__`` (to reject an enabled ``"dgc"`` section that nothing consumed,
e.g. with ZeRO disabled). When ``"dgc": {"enabled": true}``, the ZeRO-3 optimizer instance
gets our reducer in place of its private ``__avg_scatter_grads`` and a ``step`` wrapper that
commits or rolls back error feedback (see ../shared/deepspeed-0.19.8-seams.md, sections 1-3, 8).
"""

import functools
import logging
import types
from typing import List, Optional

import torch
import deepspeed
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.zero import partition_parameters
from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

from .agreement import check_agreement, ranks_failing
from .checkpoint import wrap_engine_checkpointing, wrap_plain_engine_loading
from .comm import DGCBackendError, check_mpi_world
from .config import DGCConfig, DGCConfigError, check_engine_compatible, parse_dgc_config
from .kernels import DGCKernelError
from .memory import ErrorFeedback
from .momentum import CompressedMomentum, MomentumCorrection, check_optimizer, check_sgd_optimizer, dgc_sgd_step
from .reducer import CompressedReduceScatter
from .telemetry import DGCStats, log_step
from .topology import resolve_ranks_per_node
from .weights import install_allgather, zero_shard_padding

SEAM = "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads"
SEED_BASE = 0x5EED
_STATE_ATTR = "_dgc_state"
logger = logging.getLogger("deepspeed_dgc")


class DGCSeamError(ImportError):
    """The installed DeepSpeed lacks the methods this extension replaces."""


class DGCState:
    """Everything the extension keeps for one engine: config, residuals, reducer, telemetry.

    Reachable as ``engine._dgc_state`` and ``optimizer._dgc_state``; scripts use
    :func:`get_stats` instead.
    """

    def __init__(self, cfg: DGCConfig, global_rank: int, ranks_per_node: Optional[int] = None):
        self.cfg = cfg
        self.global_rank = global_rank
        self.memory = ErrorFeedback(cfg.residual_storage, offload=cfg.residual_offload)
        self.reducer = CompressedReduceScatter(cfg, self.memory, seed=SEED_BASE + global_rank, ranks_per_node=ranks_per_node)
        self.stats = DGCStats()
        self.params: List[torch.nn.Parameter] = []  # the engine's parameters (ZeRO-3 shards)
        self.dp_rank = 0
        self.monitor = None
        self.engine_samples = lambda: 0
        self.momentum = None  # CompressedMomentum (dgc.compressed_momentum) or MomentumCorrection (dgc.momentum_correction)


def check_seam() -> None:
    """Fail loudly when DeepSpeed lacks a method we replace (another DeepSpeed version).

    Raises:
        DGCSeamError: naming the missing method and the installed DeepSpeed version.
    """
    needed = ((DeepSpeedZeroOptimizer_Stage3, SEAM), (DeepSpeedEngine, "_configure_zero_optimizer"),
              (partition_parameters, "_dist_allgather_fn"))
    missing = [name for owner, name in needed if not hasattr(owner, name)]
    if missing:
        raise DGCSeamError(f"deepspeed_dgc needs {', '.join(missing)}, which deepspeed {deepspeed.__version__} lacks; "
                           "install the DeepSpeed version range in setup.py (tested: 0.19.8)")


def _make_avg_scatter_grads(opt, state: DGCState):
    """Build the replacement of ``opt.__avg_scatter_grads(params, communication_data_type)``."""

    def avg_scatter_grads(params_to_reduce: List[torch.nn.Parameter], communication_data_type: torch.dtype):
        opt._assert_same_partition_group(params_to_reduce)
        group = opt._get_param_partition_group(params_to_reduce[0])
        partitions, result = state.reducer.reduce_scatter([p.grad for p in params_to_reduce],
                                                          [p.ds_id for p in params_to_reduce],
                                                          group,
                                                          communication_data_type,
                                                          loss_scale=float(opt.loss_scale))
        state.stats.record(result)
        world = state.reducer.comms_for(group).world_size
        averaging_world_size = opt._gradient_averaging_world_size(params_to_reduce, world)
        if averaging_world_size != world:  # sequence/expert parallel averaging, as stock
            partitions = [g.mul(world / float(averaging_world_size)) for g in partitions]
        return [g.to(opt.gradient_accumulation_dtype) for g in partitions]

    return avg_scatter_grads


def _wrap_step(opt, state: DGCState):
    """Commit error feedback after an applied step, roll it back after a skipped one."""
    step = opt.step

    @functools.wraps(step)
    def dgc_step(*args, **kwargs):
        out = step(*args, **kwargs)
        if state.cfg.weights.quantization != "none":  # the step copied stale padding back into the shards
            zero_shard_padding(state.params, state.dp_rank)
        skipped = bool(opt.overflow)
        momentum = state.momentum
        if skipped:
            state.memory.rollback()
            if momentum is not None:
                momentum.store.rollback()
        else:
            state.memory.commit()
            if momentum is not None:
                momentum.store.commit()
                momentum.steps_done += 1
                if momentum.freeze_due():
                    # the gradient phase's residuals are in gradient units: the momentum phase starts clean (its
                    # reused thresholds are told apart by the reducer)
                    state.memory.committed, state.memory.staged = {}, {}
                    momentum.freeze(opt, opt.dp_process_group)
                    if state.global_rank == 0:
                        logger.info("deepspeed_dgc: Adam's second moment frozen after step %d; compressing the "
                                    "momentum (%s) from now on", momentum.steps_done, momentum.cfg.quantization)
        state.stats.state_bytes = state.memory.state_bytes() + (momentum.state_bytes() if momentum is not None else 0)
        state.stats.host_state_bytes = state.memory.host_state_bytes()
        log_now = (state.stats.steps + 1) % state.cfg.stats_interval == 0
        s = state.stats.end_step(skipped, state.memory.residual_norm() if log_now else None, _persistent_gather_bytes(opt))
        if log_now:
            log_step(s, state.global_rank, state.monitor, state.engine_samples())
        return out

    return dgc_step


def _persistent_gather_bytes(opt) -> int:
    """Bytes this rank sends in the post-step all-gather of persistent parameters (not compressed)."""
    params = getattr(opt, "persistent_parameters", None) or []
    if not params:
        return 0
    return sum((opt.partition_count - 1) * p.ds_tensor.ds_numel * p.ds_tensor.element_size() for p in params)


def _check_hpz_nodes(engine, cfg: DGCConfig, ranks_per_node: int, source: str) -> None:
    """hpZ's secondary partition and the hierarchical topology must mean the same node."""
    hpz = engine.zero_hpz_partition_size()
    if cfg.topology == "hierarchical" and hpz > 1 and hpz != ranks_per_node:
        raise DGCConfigError(f"'zero_optimization.zero_hpz_partition_size' = {hpz} but 'dgc.topology' = \"hierarchical\" "
                             f"uses {ranks_per_node} ranks per node (from {source}): both must describe the same node; "
                             f"set 'dgc.ranks_per_node' = {hpz} or the hpZ size to {ranks_per_node}")


def install(engine, opt, cfg: DGCConfig) -> DGCState:
    """Patch a ZeRO-3 optimizer instance of ``engine`` with the compressed reduce-scatter.

    Args:
        engine: the ``DeepSpeedEngine`` that owns ``opt``.
        opt: a ``DeepSpeedZeroOptimizer_Stage3`` (or subclass) instance.
        cfg: the enabled ``"dgc"`` config.

    Returns:
        The :class:`DGCState` now attached to both engine and optimizer.

    Collective over the world: resolves ranks per node (with the hierarchical topology, checks that
    every rank found the same, :func:`~deepspeed_dgc.agreement.check_agreement`; the other settings
    were compared before the optimizer was built) and builds the communicators.

    Raises:
        DGCConfigError: no optimizer was given (ZeRO-3 then only offloads parameters); settings
            differ between ranks; hpZ and the hierarchical topology disagree on the node size.
        DGCBackendError: ``comm_backend`` ``"mpi"`` without mpi4py or outside an MPI job.
        DGCKernelError: ``kernels`` ``"fused"`` and the fused op cannot load on some rank (on every rank).
        DGCSeamError: ``opt`` is not a ZeRO-3 optimizer with the expected method.
    """
    if isinstance(opt, DeepSpeedZeRoOffload):
        raise DGCConfigError("'dgc.enabled' requires an optimizer: without one, ZeRO-3 only partitions parameters "
                             "and reduces no gradients (pass an optimizer or an 'optimizer' section)")
    if not isinstance(opt, DeepSpeedZeroOptimizer_Stage3) or not hasattr(opt, SEAM):
        raise DGCSeamError(f"deepspeed_dgc can only patch a ZeRO-3 optimizer, got {type(opt).__name__}")
    ranks_per_node, source = resolve_ranks_per_node(cfg)
    if cfg.topology == "hierarchical":  # the launcher's node size must agree too (the rest already did)
        check_agreement(cfg, ranks_per_node, cfg.timeout_s)
    if cfg.comm_backend == "mpi":
        problem = check_mpi_world()
        if problem:
            raise DGCBackendError(f"'dgc.comm_backend' = \"mpi\": {problem}")
    _check_hpz_nodes(engine, cfg, ranks_per_node, source)
    state = DGCState(cfg, engine.global_rank, ranks_per_node)
    state.reducer.steps_done = lambda: state.stats.steps  # the density schedule's clock
    state.stats.residual_storage = cfg.residual_storage
    if (cfg.compressed_momentum is not None or cfg.momentum_correction) and engine.torch_autocast_enabled():
        raise DGCConfigError("'dgc.compressed_momentum' and 'dgc.momentum_correction' do not support 'torch_autocast' "
                             "(its loss scaling skips steps the extension does not see); use 'bf16' or fp32")
    if cfg.compressed_momentum is not None:
        beta1 = check_optimizer(opt.optimizer, engine.gradient_accumulation_steps(), engine.fp16_enabled(),
                                bool(getattr(opt, "offload_optimizer", False)))
        state.momentum = CompressedMomentum(cfg.compressed_momentum, beta1)
        state.reducer.momentum = state.momentum
    elif cfg.momentum_correction:
        m = check_sgd_optimizer(opt.optimizer, engine.gradient_accumulation_steps(), engine.fp16_enabled(),
                                bool(getattr(opt, "offload_optimizer", False)))
        state.momentum = MomentumCorrection(cfg, m)
        state.reducer.momentum = state.momentum
        # a bound method, as torch's own (LR schedulers wrap optimizer.step.__func__): the senders applied the momentum
        opt.optimizer.step = types.MethodType(dgc_sgd_step, opt.optimizer)
        if opt.clip_grad and engine.global_rank == 0:
            logger.warning("deepspeed_dgc: 'gradient_clipping' = %s is switched off under 'dgc.momentum_correction' "
                           "(it would clip the summed velocity); DGC clips each rank's gradient instead: "
                           "'dgc.local_clip_norm' (now %s)", opt.clip_grad, cfg.local_clip_norm)
        opt.clip_grad = 0.0
    failure = ""
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
    if engine.global_rank == 0:
        logger.info("deepspeed_dgc: compression by the %s path (dgc.kernels = %s)", ops.name, cfg.kernels)
    comms = state.reducer.comms_for(opt.dp_process_group)  # collective: every rank builds its groups now
    if comms.hierarchical and comms.n_nodes == 1 and engine.global_rank == 0:
        logger.warning("deepspeed_dgc: 'dgc.topology' is \"hierarchical\" but all %d ranks are on one node "
                       "(%d ranks per node, from %s): gradients are reduced densely inside the node and nothing is "
                       "compressed", comms.world_size, comms.ranks_per_node, source)
    state.params = list(engine.module.parameters())
    state.stats.world_size = comms.world_size
    state.stats.n_params = sum(getattr(p, "ds_numel", p.numel()) for p in state.params)
    state.dp_rank = dist.get_rank(group=opt.dp_process_group)
    if cfg.weights.quantization != "none":
        zero_shard_padding(state.params, state.dp_rank)
    state.monitor = getattr(engine, "monitor", None)
    state.engine_samples = lambda: getattr(engine, "global_samples", 0)
    setattr(opt, SEAM, _make_avg_scatter_grads(opt, state))
    install_allgather(cfg.weights.quantization, cfg.weights.group_size, state.stats.record_param_gather, cfg.timeout_s,
                      ranks_per_node)
    opt.step = _wrap_step(opt, state)
    setattr(opt, _STATE_ATTR, state)
    setattr(engine, _STATE_ATTR, state)
    wrap_engine_checkpointing(engine, state)
    return state


def _engine_dgc_config(engine) -> Optional[DGCConfig]:
    config = engine.config if isinstance(engine.config, dict) else {}
    return parse_dgc_config(config)


def _wrap_configure_zero_optimizer(orig):

    @functools.wraps(orig)
    def _configure_zero_optimizer(self, optimizer):
        cfg = _engine_dgc_config(self)
        if self.zero_optimization_stage() == 3:
            # every ZeRO-3 rank takes part, DGC on or off: a rank whose "dgc" section differs (even
            # one that has it disabled or absent) fails here, on every rank, naming the key
            effective = cfg or DGCConfig()
            check_agreement(effective, None, effective.timeout_s)
        if cfg is None or not cfg.enabled:
            opt = orig(self, optimizer)
            if self.zero_optimization_stage() == 3:
                wrap_plain_engine_loading(self)  # a DGC checkpoint loaded here says what is ignored
            return opt
        check_engine_compatible(cfg, self)
        opt = orig(self, optimizer)
        install(self, opt, cfg)
        return opt

    _configure_zero_optimizer._dgc_wrapped = True
    return _configure_zero_optimizer


def _wrap_engine_init(orig):

    @functools.wraps(orig)
    def __init__(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        cfg = _engine_dgc_config(self)
        if cfg is not None and cfg.enabled and getattr(self, _STATE_ATTR, None) is None:
            check_engine_compatible(cfg, self)  # names the clashing key, e.g. a stage other than 3
            raise RuntimeError("'dgc.enabled' is true but no ZeRO-3 optimizer was created to compress "
                               "(an optimizer and 'zero_optimization.stage' = 3 are required)")

    __init__._dgc_wrapped = True
    return __init__


def activate() -> None:
    """Install the wrappers on ``DeepSpeedEngine`` once (idempotent). Called by ``import deepspeed_dgc``."""
    check_seam()
    if not getattr(DeepSpeedEngine._configure_zero_optimizer, "_dgc_wrapped", False):
        DeepSpeedEngine._configure_zero_optimizer = _wrap_configure_zero_optimizer(DeepSpeedEngine._configure_zero_optimizer)
    if not getattr(DeepSpeedEngine.__init__, "_dgc_wrapped", False):
        DeepSpeedEngine.__init__ = _wrap_engine_init(DeepSpeedEngine.__init__)


def get_stats(engine) -> Optional[DGCStats]:
    """This rank's compression telemetry for ``engine``, or None when DGC is not enabled on it.

    Args:
        engine: a ``DeepSpeedEngine`` from ``deepspeed.initialize``.

    Returns:
        :class:`~deepspeed_dgc.telemetry.DGCStats` (bytes are this rank's, in bytes).
    """
    state = getattr(engine, _STATE_ATTR, None)
    return None if state is None else state.stats
