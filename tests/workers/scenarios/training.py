"""Training scenarios: ZeRO-3 through ``deepspeed.initialize`` for a few steps, every step recorded."""

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import safe_get_full_grad

import deepspeed_dgc
from deepspeed_dgc.syncs import HostSyncCounter
from deepspeed_dgc.zero3.patches import _stock_method

from . import scenario
from .model import BASE, CLIENT_OPTIMIZERS, check_model, dtype_of, full_params, make_engine, merge, batches


@dataclass
class Train:
    """Train a small model with ZeRO-3 for ``steps`` optimizer steps on every rank.

    Attributes:
        config: merged into :data:`~.model.BASE` (nested objects key by key, ``"optimizer"`` replaced whole; a
            ``None`` removes the key). The inputs are in the engine's dtype (fp16 or bf16 when enabled).
        model: a key of :data:`~.model.MODELS`: ``"net"`` (Net, odd sizes), ``"embed"`` (EmbedNet: an embedding of
            which a quarter of the rows is used), ``"wide"``, ``"skiplast"`` (a side layer every second forward
            leaves out) or ``"reentrant"`` (Net in two segments of reentrant activation checkpointing).
        steps, gas: optimizer steps, and micro-steps per step.
        inf_at: rank 1's input holds Inf at that step (0-based), in every micro-step or in micro-step ``inf_micro``.
        allow_fp16: let DeepSpeed's CPU accelerator run fp16 (torch computes fp16 on any CPU).
        local_grads: record each rank's own full local gradients (hooks on the parameters).
        lr_scheduler: wrap the owners' optimizer in a torch LambdaLR after initialize and at the end.
        models_before: build that many stock ZeRO-3 engines first in this process (ZeRO-3 numbers the parameters of
            every model a process builds, ``ds_id``).
        freeze_at: after that many steps, ``l1.weight`` stops training (``requires_grad`` False).
        poison_padding: fill the padding of the fp32 master partitions with 1e30 after initialize (DeepSpeed copies
            it into the parameter shards at every step and checkpoint load, and saves it).
        count_syncs: count the host syncs of deepspeed_dgc's tensor calls per step (:mod:`deepspeed_dgc.syncs`).
        count_memory: measure the bytes of the tensors deepspeed_dgc's ops make, from before initialize on
            (:class:`~deepspeed_dgc.syncs.HostSyncCounter` with ``track_bytes``): per step, those alive at its start
            and the most alive at once during it above that.
        client_optimizer: a key of :data:`~.model.CLIENT_OPTIMIZERS` (``"lion"``): that optimizer is built by the
            user and passed to ``deepspeed.initialize``, the config's ``"optimizer"`` dropped.
        coalesce: None: the engine's own accumulation loop (``engine.step()`` after every micro-step); False or
            True: ``gas`` backward calls and one ``engine.step()`` per step, the caller setting the boundary
            (``set_gradient_accumulation_boundary``, as DeepSpeed's coalescing tests do), and with True all of them
            inside ``engine.coalesce_grad_reduction()`` (DeepSpeed's one reduction per step). Either way
            ``gradient_accumulation_steps`` is ``gas`` (the engine divides each micro-step's loss by it).
    """
    config: dict = field(default_factory=dict)
    model: str = "net"
    steps: int = 4
    gas: int = 1
    inf_at: Optional[int] = None
    inf_micro: Optional[int] = None
    allow_fp16: bool = False
    local_grads: bool = False
    lr_scheduler: bool = False
    models_before: int = 0
    freeze_at: Optional[int] = None
    poison_padding: bool = False
    count_syncs: bool = False
    count_memory: bool = False
    coalesce: Optional[bool] = None
    client_optimizer: Optional[str] = None

    def __post_init__(self):
        check_model(self.model)
        if self.client_optimizer is not None and self.client_optimizer not in CLIENT_OPTIMIZERS:
            raise ValueError(f"client_optimizer {self.client_optimizer!r}: expected one of {sorted(CLIENT_OPTIMIZERS)}")
        if self.steps < 1 or self.gas < 1:
            raise ValueError(f"steps {self.steps} and gas {self.gas} must be at least 1")


@dataclass
class OptimizerSettings:
    """The basic optimizer DeepSpeed built (its class name) and its first parameter group's settings (None where the
    optimizer has no such setting)."""
    type: str
    gradient_clipping: float
    lr: Optional[float] = None
    betas: Optional[tuple] = None
    eps: Optional[float] = None
    weight_decay: Optional[float] = None
    momentum: Optional[float] = None


@dataclass
class MemoryStep:
    """Bytes of deepspeed_dgc's tensors in one step: alive when it started (the state carried between steps), and
    the most alive at once during it above that (temporaries and new state)."""
    live_at_start: int
    peak_new: int


@dataclass
class TrainRecord:
    """What one rank saw in a training scenario.

    Attributes:
        losses: the loss of every micro-step, in order (``steps * gas``; a resumed run only its own).
        params: every parameter's full fp32 master copy before the first step, then after each step
            (``params[t][i]``: fp32, parameter i's shape; None for a frozen parameter).
        grads: DeepSpeed's full fp32 gradient of every parameter after the last micro-step of each step.
        skipped: ``engine.skipped_steps`` after each step; loss_scale: the loss scale after each step.
        optimizer: the basic optimizer's settings.
        keys: the extension's stable key of every parameter (empty without it).
        residuals, momenta: the extension's committed residuals and momenta after each step, key -> fp32 or the
            residual dtype (its own shape: full size flat, the node's sums hierarchical).
        state_bytes: the extension's state in bytes after each step; density: the last bucket's density.
        local_grads: this rank's own full local gradient of every parameter (fp32) at the last micro-step of each
            step; local_grads_micro: the same for every micro-step (``[step][micro][param]``).
        host_syncs: per step, the host syncs of deepspeed_dgc's tensor calls, ``"site name" -> count``.
        memory: per step, deepspeed_dgc's bytes (``count_memory``); n_params: the model's parameters.
        stats: the telemetry's dictionary at the end (``deepspeed_dgc.get_stats(engine).to_dict()``) or None.
        frozen: compressed momentum froze; residual_storage: where residuals live; timeout_s: the extension's
            collective timeout in seconds (each None without the extension).
        loaded_residuals: the residuals a checkpoint load restored (resumed runs only); loaded_momenta: the committed
            local momenta right after the load (key -> fp32; None without a momentum state).
    """
    losses: List[float]
    params: List[list]
    optimizer: OptimizerSettings
    grads: List[list] = field(default_factory=list)
    skipped: List[int] = field(default_factory=list)
    loss_scale: List[float] = field(default_factory=list)
    keys: List[str] = field(default_factory=list)
    residuals: List[Dict[str, torch.Tensor]] = field(default_factory=list)
    momenta: List[Dict[str, torch.Tensor]] = field(default_factory=list)
    state_bytes: List[int] = field(default_factory=list)
    density: List[float] = field(default_factory=list)
    local_grads: List[list] = field(default_factory=list)
    local_grads_micro: List[List[list]] = field(default_factory=list)
    host_syncs: List[Dict[str, int]] = field(default_factory=list)
    memory: List[MemoryStep] = field(default_factory=list)
    n_params: int = 0
    stats: Optional[dict] = None
    frozen: Optional[bool] = None
    residual_storage: Optional[str] = None
    timeout_s: Optional[float] = None
    loaded_residuals: Optional[Dict[str, torch.Tensor]] = None
    loaded_momenta: Optional[Dict[str, torch.Tensor]] = None


def held_gradient(engine, p):
    """What ZeRO-3's gradient partitions of ``p`` hold, gathered (DeepSpeed's ``safe_get_full_grad``): the averaged
    gradient, or under a momentum method its update, which ``safe_get_full_grad`` refuses to call a gradient
    (:mod:`deepspeed_dgc.zero3.ds_api`); the tests check that update, so they read it by ZeRO-3's own method."""
    if getattr(p, "grad", None) is not None or not hasattr(p, "ds_id") or getattr(engine, "_dgc_state", None) is None:
        return safe_get_full_grad(p)
    return _stock_method(engine.optimizer, "get_fp32_grad_for_param")(p)


@dataclass
class Built:
    """An engine :func:`build` made, its ds_config, and the counter of deepspeed_dgc's ops (None unless
    ``count_syncs`` or ``count_memory``; entered before ``deepspeed.initialize``, so the state it allocates counts)."""
    engine: object
    cfg: dict
    counter: Optional[HostSyncCounter]


def build(job: Train, rank: int) -> Built:
    """The engine of ``job`` (after its ``models_before`` stock engines), with its lr scheduler and poisoned
    padding."""
    counter = None
    if job.count_syncs or job.count_memory:
        counter = HostSyncCounter(track_bytes=job.count_memory).__enter__()
    cfg = merge(BASE, job.config)
    cfg["gradient_accumulation_steps"] = job.gas
    if job.allow_fp16:
        get_accelerator().is_fp16_supported = lambda: True
    for _ in range(job.models_before):  # e.g. a reference or EMA model, an evaluation copy
        make_engine(merge(BASE, {"dgc": None}))
    engine = make_engine(cfg, job.model, job.client_optimizer)
    if job.lr_scheduler:  # a torch LR scheduler wraps the owners' optimizer.step (needs a bound method)
        torch.optim.lr_scheduler.LambdaLR(engine.optimizer.optimizer, lambda s: 1.0)
    if job.poison_padding:
        poison_padding(engine, rank)
    return Built(engine, cfg, counter)


def poison_padding(engine, rank: int) -> None:
    """1e30 in the padding of every parameter's fp32 master partition (which DeepSpeed allocates uninitialised):
    what a quantized all-gather must never take for a weight."""
    opt = engine.optimizer
    with torch.no_grad():
        for flat, params in zip(opt.fp32_partitioned_groups_flat, opt.fp16_groups):
            col = 0
            for p in params:
                shard = p.ds_tensor.ds_numel
                real = max(0, min(p.ds_numel - rank * shard, shard))
                flat[col + real:col + shard] = 1e30
                col += shard


def new_record(engine) -> TrainRecord:
    """A record holding the parameters before training, the optimizer's settings and the extension's keys."""
    basic = getattr(engine.optimizer, "optimizer", None) or torch.optim.SGD([torch.zeros(1)], lr=0.0)
    group = basic.param_groups[0]
    optimizer = OptimizerSettings(type(basic).__name__, engine.gradient_clipping(),
                                  **{k: group.get(k) for k in ("lr", "betas", "eps", "weight_decay", "momentum")})
    record = TrainRecord(losses=[], params=[full_params(engine)], optimizer=optimizer)
    state = getattr(engine, "_dgc_state", None)
    if state is not None:
        record.keys = [state.key_of(p) for p in engine.module.parameters()]
    return record


AfterStep = Callable[[object, int], None]


def run_steps(job: Train, rank: int, built: Built, record: TrainRecord, first: int = 0,
              after_step: Optional[AfterStep] = None) -> TrainRecord:
    """Steps ``first .. job.steps - 1`` of ``job`` on the engine :func:`build` made, each recorded into ``record``;
    ``after_step(engine, step)`` runs after each step's records (a checkpoint save). Returns ``record``, finished."""
    engine, cfg, syncs = built.engine, built.cfg, built.counter
    state = getattr(engine, "_dgc_state", None)
    local = {}
    if job.local_grads:  # this rank's full local gradient of every parameter
        for i, p in enumerate(engine.module.parameters()):
            p.register_hook(lambda g, i=i: local.__setitem__(i, g.detach().float().clone()))
    all_batches = batches(rank, job.steps, job.gas, dtype_of(cfg), job.model)
    record.n_params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in engine.module.parameters())
    if syncs is not None:
        syncs.take()  # initialize's ops are not a step's
    for step in range(first, job.steps):
        live_at_start = syncs.mark() if syncs is not None else 0
        with engine.coalesce_grad_reduction() if job.coalesce else contextlib.nullcontext():
            for m, (x, y) in enumerate(all_batches[step]):
                if step == job.inf_at and rank == 1 and job.inf_micro in (None, m):
                    x = x.clone()
                    x[0, 0] = float("inf")
                loss = engine(x, y)
                if job.coalesce is not None:
                    engine.set_gradient_accumulation_boundary(m == job.gas - 1)
                engine.backward(loss)
                record.losses.append(float(loss))
                if job.local_grads:  # every micro-step's (the hooks fire in each backward)
                    if m == 0:
                        record.local_grads_micro.append([])
                    record.local_grads_micro[-1].append([local[i].clone() for i in range(len(local))])
                if m == job.gas - 1 and not job.coalesce:
                    _record_grads(record, engine, job, local)
                if job.coalesce is None:
                    engine.step()
        if job.coalesce:  # the with-block's exit reduced the step's gradients
            _record_grads(record, engine, job, local)
        if job.coalesce is not None:
            # the with-block's exit puts back the boundary it found (before the first step: none, which the engine
            # then reads from its micro-step counter, one per step here): the caller's boundary again
            engine.set_gradient_accumulation_boundary(True)
            engine.step()
        if syncs is not None:  # before this scenario's own read-backs below, which are not counted
            record.host_syncs.append({f"{site} {name}": n for (site, name), n in syncs.take_sites().items()})
            record.memory.append(MemoryStep(live_at_start, syncs.peak_bytes))
        with syncs.paused() if syncs is not None else contextlib.nullcontext():
            record_step(record, engine, state)
        if job.freeze_at is not None and step + 1 == job.freeze_at:
            engine.module.l1.weight.requires_grad_(False)
        if after_step is not None:
            after_step(engine, step)
        if syncs is not None:
            syncs.take()
    if syncs is not None:
        syncs.__exit__(None, None, None)
    finish_record(record, job, engine, state)
    return record


def _record_grads(record: TrainRecord, engine, job: Train, local: dict) -> None:
    """DeepSpeed's full fp32 gradient of every parameter (and this rank's own local ones) at the step's end."""
    grads = [held_gradient(engine, p) for p in engine.module.parameters()]
    record.grads.append([None if g is None else g.float().clone() for g in grads])
    if job.local_grads:
        record.local_grads.append([local[i] for i in range(len(local))])


def record_step(record: TrainRecord, engine, state) -> None:
    """Append what one step left: parameters, skipped steps, loss scale, the extension's state."""
    record.params.append(full_params(engine))
    record.skipped.append(engine.skipped_steps)
    record.loss_scale.append(float(engine.optimizer.loss_scale))
    if state is not None:
        record.state_bytes.append(state.stats.state_bytes)
        record.density.append(state.stats.last.density)
        record.residuals.append(state.memory.residuals())
        if state.momentum is not None:
            record.momenta.append({k: v.clone() for k, v in state.momentum.momenta().items()})


def finish_record(record: TrainRecord, job: Train, engine, state) -> None:
    """The end of a run: the telemetry and the extension's settings."""
    if job.lr_scheduler:  # after a freeze of compressed momentum the owners' step is replaced: still bound
        torch.optim.lr_scheduler.LambdaLR(engine.optimizer.optimizer, lambda s: 1.0)
    stats = deepspeed_dgc.get_stats(engine)
    record.stats = None if stats is None else stats.to_dict()
    if state is not None:
        if state.momentum is not None:
            record.frozen = bool(getattr(state.momentum, "frozen", False))
        record.residual_storage = state.memory.storage
        record.timeout_s = state.cfg.timeout_s


@scenario(Train)
def train(job: Train, rank: int) -> TrainRecord:
    """Train ``job.steps`` steps from a fresh engine and record every one."""
    built = build(job, rank)
    return run_steps(job, rank, built, new_record(built.engine))
