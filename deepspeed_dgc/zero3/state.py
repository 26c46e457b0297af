"""Everything the extension keeps for one engine, and what happens to it at the end of an optimizer step."""

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from ..config import DGCConfig
from ..memory.error_feedback import ErrorFeedback
from ..memory.momentum import MomentumState
from ..telemetry import DGCStats, StepStats, log_step
from .accumulation import LocalAccumulation
from .policy import LinkPolicy
from .reduce_scatter import CompressedReduceScatter

SEED_BASE = 0x5EED  # threshold samples of rank r are drawn from a generator seeded SEED_BASE + r
STATE_ATTR = "_dgc_state"  # the engine's and its optimizer's attribute holding the DGCState


@dataclass
class DGCState:
    """The extension's state for one engine (reachable as ``engine._dgc_state``; scripts use
    :func:`deepspeed_dgc.get_stats`).

    Attributes:
        cfg: the enabled ``"dgc"`` config.
        global_rank: this process's rank; dp_rank: its rank in the data-parallel group.
        memory: error-feedback residuals; reducer: the compressed reduce-scatter; stats: telemetry.
        momentum: a momentum state (``compressed_momentum`` or ``momentum_correction``), or None.
        params: the engine's parameters (ZeRO-3 shards), in module order.
        monitor: DeepSpeed's monitor (telemetry events), or None.
        samples_seen: the engine's sample count (the x axis of monitor events).
        keys: ``id(param)`` -> the stable key of its residual and momentum (:meth:`assign_keys`).
        policy: ``policy: "auto"``'s per-bucket choice between stock and compressed, or None.
        window: the gradients of this accumulation window's micro-steps not sent yet (``accumulate_locally``).
        holds_windows: whether micro-steps before ZeRO-3's accumulation boundary are held rather than sent
            (``accumulate_locally`` and DeepSpeed's managed gradient accumulation).
    """
    cfg: DGCConfig
    global_rank: int
    memory: ErrorFeedback
    reducer: CompressedReduceScatter
    stats: DGCStats
    momentum: Optional[MomentumState] = None
    dp_rank: int = 0
    params: List[torch.nn.Parameter] = field(default_factory=list)
    monitor: Any = None
    samples_seen: Callable[[], int] = lambda: 0
    keys: Dict[int, str] = field(default_factory=dict)
    policy: Optional[LinkPolicy] = None
    window: LocalAccumulation = field(default_factory=LocalAccumulation)
    holds_windows: bool = False

    @classmethod
    def build(cls, cfg: DGCConfig, global_rank: int, ranks_per_node: Optional[int] = None,
              momentum: Optional[MomentumState] = None, module: Optional[torch.nn.Module] = None,
              param_groups: Sequence[dict] = (), dp_rank: int = 0, dp_world_size: int = 1, monitor: Any = None,
              samples_seen: Callable[[], int] = lambda: 0) -> "DGCState":
        """A fresh state: residual storage from ``cfg``, a reducer seeded for this rank, the parameters of ``module``
        keyed by name (:meth:`assign_keys`)."""
        memory = ErrorFeedback(cfg.residual_storage, offload=cfg.residual_offload, kernels=cfg.kernels)
        reducer = CompressedReduceScatter(cfg, memory, seed=SEED_BASE + global_rank, ranks_per_node=ranks_per_node,
                                          momentum=momentum)
        params = list(module.parameters()) if module is not None else []
        # decoupled_momentum keeps no residual (its momentum is the error feedback): its storage is the momentum's
        dm = cfg.decoupled_momentum
        storage = cfg.residual_storage if dm is None else f"none (momentum {dm.storage})"
        stats = DGCStats(residual_storage=storage, world_size=dp_world_size,
                         n_params=sum(getattr(p, "ds_numel", p.numel()) for p in params))
        state = cls(cfg=cfg, global_rank=global_rank, memory=memory, reducer=reducer, stats=stats, momentum=momentum,
                    dp_rank=dp_rank, params=params, monitor=monitor, samples_seen=samples_seen,
                    policy=LinkPolicy(cfg.policy_interval) if cfg.policy == "auto" else None)
        if module is not None:
            state.assign_keys(module, param_groups)
        return state

    def assign_keys(self, module: torch.nn.Module, param_groups: Sequence[dict] = ()) -> None:
        """Key every parameter by a stable identity: its name in ``module`` (``"blocks.0.attn.qkv.weight"``), or for
        a parameter the optimizer has but the module does not, its place in the optimizer's groups
        (``"param_groups.1.3"``). Unlike ZeRO-3's ``ds_id``, a per-process counter that also counts the parameters
        of every model built earlier in the process, these are the same in every process that builds the same
        model, so saved state lands on the right parameters."""
        self.keys = {id(p): name for name, p in module.named_parameters()}
        for g, group in enumerate(param_groups):
            for i, p in enumerate(group["params"]):
                self.keys.setdefault(id(p), f"param_groups.{g}.{i}")

    def key_of(self, param: torch.nn.Parameter) -> str:
        """The stable key of a parameter's residual and momentum (:meth:`assign_keys`).

        Raises:
            KeyError: the parameter is neither in the engine's module nor in its optimizer's groups.
        """
        key = self.keys.get(id(param))
        if key is None:
            raise KeyError(f"deepspeed_dgc: a parameter of shape {tuple(getattr(param, 'ds_shape', param.shape))} "
                           "is neither in the engine's module nor in its optimizer's param groups")
        return key

    def set_window_end(self, final: bool) -> None:
        """Whether the micro-step about to be reduced ends the accumulation window: its residuals and momenta are then
        staged in their storage form at once (:attr:`ErrorFeedback.final`)."""
        self.memory.final = final
        # int8 storage's rounding noise: drawn afresh every step and rank, the same again in a resumed run
        self.memory.round_seed = ("residual", self.global_rank, self.reducer.steps_applied)
        store = getattr(self.momentum, "store", None)  # every local momentum keeps its momenta in an ErrorFeedback
        if store is not None:
            store.final = final
            store.round_seed = ("momentum", self.global_rank, self.reducer.steps_applied)

    def commit_step(self, applied: bool) -> None:
        """The optimizer step ended: commit this window's residuals and momenta if it was applied, roll them back
        if it was skipped (overflow); an applied step advances the density warm-up."""
        # the most held at any stage so far (residuals and momenta each at their own peak: an upper bound)
        self.stats.peak_state_bytes = self.memory.peak_bytes + (self.momentum.peak_bytes() if self.momentum else 0)
        self.stats.held_gradient_peak_bytes = self.window.peak_bytes
        if applied:
            self.memory.commit()
            if self.momentum is not None:
                self.momentum.commit()
        else:
            self.memory.rollback()
            if self.momentum is not None:
                self.momentum.rollback()
        self.reducer.end_step(applied)
        self.drop_frozen()

    def drop_frozen(self) -> None:
        """Parameters frozen during the run (``requires_grad`` now False) give up their residual, momentum and
        threshold: their weights no longer change, so what error feedback held back for them can never be applied,
        and it would only hold memory. (A parameter that is merely unused in some steps keeps its residual: it is
        sent when the parameter gets a gradient again.)"""
        frozen = [self.key_of(p) for p in self.params if not p.requires_grad and id(p) in self.keys]
        if frozen:
            self.memory.drop(frozen)
            if self.momentum is not None:
                self.momentum.drop(frozen)
            self.reducer.clear_thresholds(frozen)

    def close_step(self, applied: bool, uncovered_gather_bytes: int = 0) -> StepStats:
        """Close the step's telemetry (after :meth:`commit_step`); log it every ``stats_interval`` steps."""
        self.stats.state_bytes = self.memory.state_bytes() + (self.momentum.state_bytes() if self.momentum else 0)
        store = getattr(self.momentum, "store", None)
        self.stats.host_state_bytes = self.memory.host_state_bytes() + (store.host_state_bytes() if store else 0)
        # on the device: the stores' parts there, and what a momentum state keeps beside its store (a preconditioner)
        beside = (self.momentum.state_bytes() - (store.state_bytes() if store else 0)) if self.momentum else 0
        self.stats.device_state_bytes = (self.memory.device_state_bytes() + beside
                                         + (store.device_state_bytes() if store else 0))
        log_now = (self.stats.steps + 1) % self.cfg.stats_interval == 0
        s = self.stats.end_step(not applied, self.memory.residual_norm() if log_now else None, uncovered_gather_bytes)
        if log_now:
            log_step(s, self.global_rank, self.monitor, self.samples_seen())
        return s

    def start_momentum_phase(self) -> None:
        """The gradient phase's residuals are in gradient units: the momentum phase starts with none (its reused
        thresholds are told apart by the reducer)."""
        self.memory.clear()


def get_stats(engine) -> Optional[DGCStats]:
    """This rank's compression telemetry for ``engine``, or None when DGC is not enabled on it.

    Args:
        engine: a ``DeepSpeedEngine`` from ``deepspeed.initialize``.

    Returns:
        :class:`~deepspeed_dgc.telemetry.DGCStats` (bytes are this rank's, in bytes).
    """
    state = getattr(engine, STATE_ATTR, None)
    return None if state is None else state.stats
