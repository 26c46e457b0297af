"""Checkpoint side-car: the extension's per-rank state next to DeepSpeed's per-rank files.

``engine.save_checkpoint(dir, tag)`` also writes ``dir/tag/dgc_state_dp_rank_{r:05d}.pt`` on every
rank: committed residuals (keyed by ``ds_id``), the threshold-sampling generators, the reused top-k
thresholds (``threshold_reuse_steps``), local momenta and the telemetry totals.
``engine.load_checkpoint`` reads it back, so a resumed run continues exactly as an uninterrupted one.
DeepSpeed's own files are untouched (``zero_to_fp32`` keeps working); the side-car loads with
``torch.load(weights_only=True)``.
"""

import glob
import os
from typing import Optional

import torch
from deepspeed.utils import logger

from .memory import ErrorFeedback

FORMAT = 1


def sidecar_path(ckpt_dir: str, tag: str, dp_rank: int) -> str:
    """Path of this rank's side-car file in checkpoint ``ckpt_dir/tag``."""
    return os.path.join(ckpt_dir, str(tag), f"dgc_state_dp_rank_{dp_rank:05d}.pt")


def residual_layout(state) -> str:
    """What the residuals' shapes depend on besides the world size: the topology and node size."""
    if state.cfg.topology == "flat":
        return "flat"
    return f"hierarchical, {state.reducer.ranks_per_node} ranks per node"


def save_state(state, ckpt_dir: str, tag: str, world_size: int) -> str:
    """Write this rank's side-car; returns its path. Residuals are unscaled, in their storage form
    (:meth:`~deepspeed_dgc.memory.ErrorFeedback.export`: fp32 or bf16 tensors, ``(codes, scales)`` for fp8),
    with ``residual_storage`` naming it."""
    path = sidecar_path(ckpt_dir, tag, state.dp_rank)
    payload = {
        "format": FORMAT,
        "world_size": world_size,
        "dp_rank": state.dp_rank,
        "config": state.cfg.model_dump(mode="json"),
        "residual_layout": residual_layout(state),
        "residual_storage": state.memory.storage,
        "residuals": {int(k): v for k, v in state.memory.export().items()},
        "generators": {dev: g.get_state() for dev, g in state.reducer._generators.items()},
        "thresholds": {int(k): list(v) for k, v in state.reducer.thresholds.items()},
        "stats": state.stats.totals(),
        "momentum": _momentum_payload(state),
    }
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(payload, path)
    return path


def _momentum_payload(state):
    m = getattr(state, "momentum", None)
    if m is None:
        return None
    return {"momenta": {int(k): v.detach().cpu() for k, v in m.store.committed.items()}, "steps_done": m.steps_done}


def _restore_momentum(state, saved, device, world_scale: float = 1.0) -> str:
    """Put saved local momenta back (``world_scale`` rescales re-sharded ones); returns a note for the log."""
    m = getattr(state, "momentum", None)
    if m is None:
        if saved and saved.get("momenta"):
            return (f"; its {len(saved['momenta'])} saved local momenta are IGNORED: this run has neither "
                    "'dgc.momentum_correction' nor 'dgc.compressed_momentum', so that momentum is lost")
        return ""
    m.store.staged = {}
    if not saved:
        m.store.committed, m.steps_done = {}, 0
        return "; no saved momentum: the local momentum restarts at zero (compressed momentum: its warm-up too)"
    m.store.committed = {int(k): (v.double() * world_scale).float().to(device) for k, v in saved["momenta"].items()}
    m.steps_done = int(saved["steps_done"])
    return f"; local momentum of {len(m.store.committed)} tensors, {m.steps_done} steps done"


def _sidecar_dir(ckpt_dir: str, tag: str) -> str:
    """The tag directory holding the side-cars: ``tag`` itself, or for a universal checkpoint made by
    DeepSpeed's ``ds_to_universal`` (``<tag>_universal``, which does not copy them) the source tag."""
    here = os.path.join(ckpt_dir, str(tag))
    if str(tag).endswith("_universal") and not glob.glob(os.path.join(here, "dgc_state_dp_rank_*.pt")):
        source = os.path.join(ckpt_dir, str(tag)[:-len("_universal")])
        if glob.glob(os.path.join(source, "dgc_state_dp_rank_*.pt")):
            return source
    return here


def _clear(state) -> None:
    state.memory.committed, state.memory.staged = {}, {}
    state.reducer.thresholds = {}
    _restore_momentum(state, None, "cpu")


def load_state(state, ckpt_dir: str, tag: str, world_size: int, device: torch.device) -> str:
    """Restore this rank's side-car into ``state``; returns what was done, for the log.

    Same data-parallel world size: residuals, sampling generators and telemetry come back as saved.
    Another world size (a universal checkpoint), flat topology: the residuals of all saved ranks are
    summed and split evenly over this run's ranks, so the gradient not yet sent is conserved (up to the
    rounding of the residual storage when it is not fp32; each residual is one rank's unsent share of the
    mean gradient, full tensor shape); the generators
    restart from this rank's seed. Another world size with the hierarchical topology (residuals live
    on node-level slices), a checkpoint without side-cars (saved without DGC) or one whose side-cars
    disagree: the residuals restart at zero and the message says why. Nothing is half-loaded.
    """
    sdir = _sidecar_dir(ckpt_dir, tag)
    path = os.path.join(sdir, os.path.basename(sidecar_path(ckpt_dir, tag, state.dp_rank)))
    first = os.path.join(sdir, os.path.basename(sidecar_path(ckpt_dir, tag, 0)))
    if not os.path.isfile(first):
        _clear(state)
        return f"no deepspeed_dgc state in {sdir} (checkpoint saved without DGC?): error-feedback residuals start at zero"
    head = torch.load(first, map_location="cpu", weights_only=True)
    saved_world: Optional[int] = head.get("world_size")
    if head.get("format") != FORMAT:
        _clear(state)
        return f"deepspeed_dgc state in {first} has format {head.get('format')}, not {FORMAT}: residuals restart at zero"
    saved_layout = head.get("residual_layout", "flat")
    if saved_world == world_size:
        if saved_layout != residual_layout(state):
            _clear(state)
            return (f"deepspeed_dgc state in {path} holds residuals of the {saved_layout} topology, this run uses "
                    f"{residual_layout(state)}: they do not fit, so they are dropped and restart at zero")
        payload = torch.load(path, map_location="cpu", weights_only=True)
        saved_storage = payload.get("residual_storage", "fp32")  # side-cars without it hold fp32
        state.memory.restore(payload["residuals"], saved_storage, device)
        for dev, gen_state in payload["generators"].items():
            state.reducer._generator(torch.device(dev)).set_state(gen_state)
        state.reducer.thresholds = {int(k): list(v) for k, v in payload.get("thresholds", {}).items()}
        for f, v in payload["stats"].items():
            setattr(state.stats, f, v)
        note = _restore_momentum(state, payload.get("momentum"), device)
        if saved_storage != state.memory.storage and state.memory.committed:
            note += (f"; the residuals were stored in {saved_storage} and are now stored in {state.memory.storage} "
                     "('dgc.residual_dtype'), so they were rounded once")
        return (f"restored deepspeed_dgc state from {path}: {len(state.memory.committed)} residuals, step "
                f"{state.stats.steps}{note}")
    if saved_layout != "flat" or residual_layout(state) != "flat":
        _clear(state)
        return (f"deepspeed_dgc state in {sdir} was saved at data-parallel world size {saved_world}, this run has "
                f"{world_size}; residuals of the hierarchical topology live on node-level slices and cannot be "
                "re-sharded, so they are dropped and restart at zero")
    total = None
    momenta, steps_done = None, None
    for r in range(saved_world):
        p = os.path.join(sdir, os.path.basename(sidecar_path(ckpt_dir, tag, r)))
        if not os.path.isfile(p):
            _clear(state)
            return (f"deepspeed_dgc state in {sdir} was saved at data-parallel world size {saved_world} but {p} is "
                    f"missing: residuals cannot be re-sharded to {world_size} ranks and restart at zero")
        side = torch.load(p, map_location="cpu", weights_only=True)
        res = {int(k): ErrorFeedback.decode(v) for k, v in side["residuals"].items()}
        if side.get("momentum"):  # local momenta add up to the global one, like residuals
            steps_done = side["momentum"]["steps_done"]
            if momenta is None:
                momenta = {int(k): v.double() for k, v in side["momentum"]["momenta"].items()}
            elif set(momenta) != {int(k) for k in side["momentum"]["momenta"]}:
                _clear(state)
                return (f"deepspeed_dgc side-cars in {sdir} hold different local-momentum sets: they cannot be "
                        f"re-sharded to {world_size} ranks; residuals and momentum restart at zero")
            else:
                for k, v in side["momentum"]["momenta"].items():
                    momenta[int(k)] += v.double()
        if total is None:
            total = {int(k): v.double() for k, v in res.items()}
        elif set(total) != {int(k) for k in res} or any(total[int(k)].shape != v.shape for k, v in res.items()):
            _clear(state)
            return (f"deepspeed_dgc side-cars in {sdir} hold different residual sets: they cannot be re-sharded to "
                    f"{world_size} ranks and restart at zero")
        else:
            for k, v in res.items():
                total[int(k)] += v.double()
    state.memory.load({k: (v / world_size).float().to(device) for k, v in total.items()})
    state.reducer.thresholds = {}  # each rank's own: estimated afresh on the new ranks
    for f, v in head["stats"].items():  # step counters (the density schedule's clock) are global: rank 0's
        setattr(state.stats, f, v)
    note = _restore_momentum(state, None if momenta is None else {"momenta": momenta, "steps_done": steps_done}, device,
                             1.0 / world_size)
    return (f"deepspeed_dgc state in {sdir} was saved at data-parallel world size {saved_world}, this run has "
            f"{world_size}: re-sharded {len(total)} residuals (summed over the {saved_world} saved ranks, split "
            "evenly over this run's, so the gradient not yet sent is conserved); sampling restarts from this rank's "
            f"seed{note}")


def _tag_of(load_dir: str, tag, engine=None) -> str:
    """The tag DeepSpeed loaded: the given one, else the content of ``latest`` (``latest_universal``
    when the engine loads universal checkpoints)."""
    if tag is None:
        universal = engine is not None and getattr(engine, "load_universal_checkpoint", lambda: False)()
        with open(os.path.join(load_dir, "latest_universal" if universal else "latest")) as f:
            return f.read().strip()
    return str(tag)


def wrap_plain_engine_loading(engine) -> None:
    """For a ZeRO-3 engine without DGC: say so when ``load_checkpoint`` meets a DGC side-car.

    DeepSpeed's weights and optimizer state load as usual; the residuals of the side-car (what a DGC
    run had not sent yet) are ignored, and this logs a warning naming the file, on every rank.
    """
    load = engine.load_checkpoint

    def load_checkpoint(load_dir, tag=None, *args, **kwargs):
        load_path, client_state = load(load_dir, tag, *args, **kwargs)
        if load_path is not None:
            sdir = _sidecar_dir(load_dir, _tag_of(load_dir, tag, engine))
            found = glob.glob(os.path.join(sdir, "dgc_state_dp_rank_*.pt"))
            if found:  # any rank's side-car: the world size may have changed
                logger.warning(f"[deepspeed_dgc] rank {engine.global_rank}: checkpoint {load_path} holds deepspeed_dgc "
                               f"state ({len(found)} dgc_state_dp_rank_*.pt files in {sdir}, saved with DGC on); this run "
                               "has DGC off, so its error-feedback residuals are ignored (and so are any local momenta "
                               "of 'momentum_correction' or 'compressed_momentum'). DeepSpeed's weights and "
                               "optimizer state loaded as usual")
        return load_path, client_state

    load_checkpoint.__doc__ = load.__doc__
    engine.load_checkpoint = load_checkpoint


def wrap_engine_checkpointing(engine, state) -> None:
    """Make ``engine.save_checkpoint`` / ``load_checkpoint`` (instance methods) carry the side-car."""
    save, load = engine.save_checkpoint, engine.load_checkpoint

    def save_checkpoint(save_dir, tag=None, *args, **kwargs):
        tag_used = str(tag) if tag is not None else f"global_step{engine.global_steps}"
        out = save(save_dir, tag, *args, **kwargs)
        save_state(state, save_dir, tag_used, engine.dp_world_size)
        return out

    def load_checkpoint(load_dir, tag=None, *args, **kwargs):
        load_path, client_state = load(load_dir, tag, *args, **kwargs)
        if load_path is None:
            return load_path, client_state
        device = engine.device
        m = state.momentum
        if m is not None and m.frozen:  # the loaded optimizer state decides afresh whether Adam is frozen
            m.unfreeze(engine.optimizer)
        msg = load_state(state, load_dir, _tag_of(load_dir, tag, engine), engine.dp_world_size, device)
        if m is not None and m.freeze_due():  # every rank loads: collective
            m.freeze(engine.optimizer, engine.optimizer.dp_process_group)
        routine = msg.startswith("restored") and "IGNORED" not in msg and "rounded once" not in msg
        (logger.info if routine else logger.warning)(f"[deepspeed_dgc] rank {state.global_rank}: {msg}")
        return load_path, client_state

    save_checkpoint.__doc__ = save.__doc__
    load_checkpoint.__doc__ = load.__doc__
    engine.save_checkpoint = save_checkpoint
    engine.load_checkpoint = load_checkpoint
