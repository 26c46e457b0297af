"""Checkpoint side-car: the extension's per-rank state next to DeepSpeed's per-rank files.

``engine.save_checkpoint(dir, tag)`` also writes ``dir/tag/dgc_state_dp_rank_{r:05d}.pt`` on every rank, keyed by
the parameters' names: committed residuals (in their storage form), the threshold-sampling generators, the reused top-k thresholds,
the warm-up clock, local momenta and the telemetry totals. ``engine.load_checkpoint`` reads it back, so a
resumed run continues exactly as an uninterrupted one. DeepSpeed's own files are untouched
(``zero_to_fp32`` keeps working); the side-car loads with ``torch.load(weights_only=True)``.

Crash safety: every rank writes its side-car before DeepSpeed writes anything of the checkpoint, and ``latest`` is
written after every rank's DeepSpeed files (``zero3/patches.py``), each under a temporary name that is flushed to
disk and then renamed (:func:`write_sidecar`, :func:`write_latest`); a rank that cannot write its side-car (a full
disk) makes every rank raise before DeepSpeed starts. The file holds the SHA-256 of its payload, checked on load (:func:`read_sidecar`): a truncated,
damaged or misplaced side-car raises :class:`DGCCheckpointError` naming it instead of loading.
"""

import errno
import glob
import hashlib
import io
import os
import re
from typing import Callable, Dict, Optional

import torch
from deepspeed.utils import logger

from ..comm.topology import resolve_ranks_per_node
from ..memory.error_feedback import ErrorFeedback
from ..memory.momentum import CompressedMomentum
from . import switching
from .state import DGCState

# 3: {"format", "sha256", "body"}, body the torch.save bytes of the payload (keyed by parameter name, with its tag)
# as a uint8 tensor;
# 2: the payload itself; 1: keyed by ZeRO-3's ds_id (read by mapping the ds_ids in order)
FORMAT = 3
READABLE_FORMATS = (1, 2, 3)
SIDECAR_GLOB = "dgc_state_dp_rank_*.pt"


class DGCCheckpointError(RuntimeError):
    """A side-car cannot be written, cannot be read (truncated, damaged, another checkpoint's), or holds state that
    does not fit this model (another model, or parameters of other sizes)."""


def sidecar_name(dp_rank: int) -> str:
    """File name of a rank's side-car."""
    return f"dgc_state_dp_rank_{dp_rank:05d}.pt"


def sidecar_path(ckpt_dir: str, tag: str, dp_rank: int) -> str:
    """Path of this rank's side-car file in checkpoint ``ckpt_dir/tag``."""
    return os.path.join(ckpt_dir, str(tag), sidecar_name(dp_rank))


def residual_layout(state: DGCState) -> str:
    """What the residuals' shapes depend on besides the world size: the topology and node size."""
    if state.cfg.topology == "flat":
        return "flat"
    return f"hierarchical, {state.reducer.ranks_per_node} ranks per node"


def save_state(state: DGCState, ckpt_dir: str, tag: str, world_size: int, save_id: Optional[int] = None) -> str:
    """Write this rank's side-car (:func:`write_sidecar`); returns its path. Residuals are unscaled, in their storage
    form (:meth:`~deepspeed_dgc.memory.error_feedback.ErrorFeedback.export`: fp32 or bf16 tensors, ``(codes, scales)``
    for fp8), with ``residual_storage`` naming it.

    Raises:
        DGCCheckpointError: the file could not be written (no space left, no permission); nothing is left behind.
    """
    path = sidecar_path(ckpt_dir, tag, state.dp_rank)
    reducer = state.reducer.export_state()
    payload = {
        "format": FORMAT,
        "tag": str(tag),
        "save_id": save_id,  # the same in every rank's side-car and in DeepSpeed's client_state of this save
        "world_size": world_size,
        "dp_rank": state.dp_rank,
        "config": state.cfg.model_dump(mode="json"),
        "residual_layout": residual_layout(state),
        "ranks_per_node": state.reducer.ranks_per_node if state.cfg.topology == "hierarchical" else None,
        "residual_storage": state.memory.storage,
        "residuals": state.memory.export(),
        "generators": reducer["generators"],
        "thresholds": reducer["thresholds"],
        "steps_applied": reducer["steps_applied"],
        "stats": state.stats.totals(),
        "momentum": state.momentum.export() if state.momentum is not None else None,
    }
    write_sidecar(path, payload)
    return path


def write_sidecar(path: str, payload: dict) -> None:
    """Write ``payload`` to ``path`` as a format-3 side-car, atomically: into a temporary file of the same directory,
    flushed and fsync'ed, then renamed over ``path`` (and the directory fsync'ed), so ``path`` is either the old file
    or the whole new one, whatever moment a crash comes.

    Raises:
        DGCCheckpointError: writing failed (``ENOSPC``: no space left); the temporary file is removed.
    """
    buf = io.BytesIO()
    torch.save(payload, buf)
    body = buf.getvalue()
    outer = io.BytesIO()  # the body as a uint8 tensor: a damaged byte of it loads, and the checksum names it
    torch.save({"format": FORMAT, "sha256": hashlib.sha256(body).hexdigest(),
                "body": torch.frombuffer(bytearray(body), dtype=torch.uint8)}, outer)
    _write_atomically(path, outer.getvalue())


def write_latest(ckpt_dir: str, tag: str) -> None:
    """Write ``ckpt_dir/latest`` naming ``tag`` (what DeepSpeed's ``load_checkpoint`` reads without a tag),
    atomically as :func:`write_sidecar` writes.

    Raises:
        DGCCheckpointError: writing failed; ``latest`` still names the checkpoint it named before.
    """
    _write_atomically(os.path.join(ckpt_dir, "latest"), str(tag).encode())


def _write_atomically(path: str, data: bytes) -> None:
    """``data`` to ``path`` through a temporary file of its directory, flushed, fsync'ed and renamed over it.

    Raises:
        DGCCheckpointError: writing failed (``ENOSPC``: no space left); the temporary file is removed.
    """
    directory = os.path.dirname(path)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp{os.getpid()}")
    try:
        os.makedirs(directory, exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(directory)
    except OSError as err:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise DGCCheckpointError(f"deepspeed_dgc could not write {path}: {write_failure(err, path)}") from err


NEARLY_FULL = 1 << 20  # bytes free below which a failed write is put down to a full file system


def write_failure(err: Exception, path: str) -> str:
    """What a failed write ``err`` of ``path`` means, for error messages: ``"no space left on the device; N bytes
    free there (OSError: ...)"`` where the file system is full (``ENOSPC``, or under 1 MiB free: torch's zip writer
    reports a full disk as ``unexpected pos ...``), else ``"see the cause; ..."``."""
    first = str(err).splitlines()[0][:200] if str(err) else ""
    try:
        st = os.statvfs(os.path.dirname(path) or ".")
        free = st.f_bavail * st.f_frsize
    except OSError:
        free = None
    full = getattr(err, "errno", None) == errno.ENOSPC or "No space left" in first or (
        free is not None and free < NEARLY_FULL)
    room = f"; {free} bytes free there" if free is not None else ""
    return f"{'no space left on the device' if full else 'see the cause'}{room} ({type(err).__name__}: {first})"


def _fsync_dir(directory: str) -> None:
    """Make a rename in ``directory`` durable (where the platform allows opening a directory)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


ADVICE = "restore it from a copy, or resume from another checkpoint"


def _error_text(err: Exception, limit: int = 240) -> str:
    """``Type: message`` of ``err``, its message cut at ``limit`` characters (marked with an ellipsis)."""
    text = str(err).replace("\n", " ")
    return f"{type(err).__name__}: " + (text if len(text) <= limit else text[:limit] + "...")


def read_sidecar(path: str, tag: Optional[str] = None, save_id: Optional[int] = None) -> dict:
    """The payload of the side-car at ``path``, checked: readable, its SHA-256 matching (format 3), saved for
    checkpoint ``tag`` where it records one, and by the save ``save_id`` (the id DeepSpeed's files of the checkpoint
    record) where both record one. Side-cars of formats 1 and 2 (no checksum) load as they are.

    Raises:
        DGCCheckpointError: naming ``path`` and what is wrong: unreadable or truncated, damaged (checksum), not a
            side-car, another checkpoint's, or another save's (copied from another run of the same tag, perhaps of
            another method or model).
    """
    try:
        outer = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises RuntimeError, pickle errors, EOFError, ... for a damaged file
        raise DGCCheckpointError(f"deepspeed_dgc checkpoint side-car {path} cannot be read (truncated or damaged: "
                                 f"{_error_text(err)}); {ADVICE}") from None
    if not isinstance(outer, dict) or outer.get("format") not in READABLE_FORMATS:
        found = outer.get("format") if isinstance(outer, dict) else type(outer).__name__
        raise DGCCheckpointError(f"{path} is not a deepspeed_dgc side-car this version reads (format {found!r}, "
                                 f"readable: {READABLE_FORMATS})")
    if outer["format"] < 3:
        return outer
    body = outer.get("body")
    if isinstance(body, torch.Tensor) and body.dtype == torch.uint8 and body.dim() == 1:
        body = body.numpy().tobytes()
    if not isinstance(body, bytes) or hashlib.sha256(body).hexdigest() != outer.get("sha256"):
        raise DGCCheckpointError(f"deepspeed_dgc checkpoint side-car {path} is damaged: its content does not match "
                                 f"the checksum written with it; {ADVICE}")
    try:
        payload = torch.load(io.BytesIO(body), map_location="cpu", weights_only=True)
    except Exception as err:
        raise DGCCheckpointError(f"deepspeed_dgc checkpoint side-car {path} holds an unreadable payload "
                                 f"({_error_text(err)}); {ADVICE}") from None
    if tag is not None and str(payload.get("tag")) != str(tag) and not _universal_source(str(tag), payload.get("tag")):
        raise DGCCheckpointError(f"{path} was saved for checkpoint {payload.get('tag')!r}, not {str(tag)!r}: it was "
                                 f"copied or moved from another checkpoint; {ADVICE}")
    saved_id = payload.get("save_id")
    if save_id is not None and saved_id is not None and int(saved_id) != int(save_id):
        raise DGCCheckpointError(f"{path} was written by another save than the DeepSpeed files of its checkpoint (save "
                                 f"id {int(saved_id):#x}, theirs {int(save_id):#x}): it was copied from another run's "
                                 f"checkpoint of the same tag ({_methods(payload.get('config'))}); {ADVICE}")
    return payload


def _methods(config) -> str:
    """The gradient method a side-car's recorded ``dgc`` settings ran, for errors: e.g. ``"saved with
    decoupled_momentum"``."""
    if not isinstance(config, dict):
        return "its settings are not recorded"
    used = [k for k in ("decoupled_momentum", "compressed_momentum", "shared_mask") if config.get(k)]
    used += ["momentum_correction"] if config.get("momentum_correction") else []
    density = config.get("density")
    return "saved with " + (", ".join(used) if used else f"density {density!r}, quantization {config.get('quantization')!r}")


def _universal_source(tag: str, saved_tag) -> bool:
    """Whether ``tag`` is DeepSpeed's universal conversion of checkpoint ``saved_tag`` (``<tag>_universal``)."""
    return tag.endswith("_universal") and tag[:-len("_universal")] == str(saved_tag)


def sidecar_dir(ckpt_dir: str, tag: str) -> str:
    """The tag directory holding the side-cars: ``tag`` itself, or for a universal checkpoint made by
    DeepSpeed's ``ds_to_universal`` (``<tag>_universal``, which does not copy them) the source tag."""
    here = os.path.join(ckpt_dir, str(tag))
    if str(tag).endswith("_universal") and not glob.glob(os.path.join(here, SIDECAR_GLOB)):
        source = os.path.join(ckpt_dir, str(tag)[:-len("_universal")])
        if glob.glob(os.path.join(source, SIDECAR_GLOB)):
            return source
    return here


def _clear(state: DGCState) -> None:
    """Nothing loaded: residuals, thresholds and momenta restart from zero."""
    state.memory.clear()
    state.reducer.clear_thresholds()
    if state.momentum is not None:
        state.momentum.clear()


def _momentum_note(state: DGCState, saved: Optional[dict]) -> str:
    """Restore nothing more, but say what happens to momenta saved or missing (for the log)."""
    if state.momentum is None:
        if saved and saved.get("momenta"):
            return (f"; its {len(saved['momenta'])} saved local momenta are IGNORED: this run has none of "
                    "'dgc.momentum_correction', 'dgc.compressed_momentum' and 'dgc.decoupled_momentum', so that "
                    "momentum is lost")
        return ""
    if not saved:
        state.momentum.clear()
        warm_up = " (and its warm-up)" if isinstance(state.momentum, CompressedMomentum) else ""
        return f"; no saved momentum: the local momentum restarts at zero{warm_up}"
    return f"; local momentum of {len(saved['momenta'])} tensors, {int(saved['steps_done'])} steps done"


def _settings_note(state: DGCState, saved: Optional[dict]) -> str:
    """Say which ``dgc`` settings the saved run had that this run changes (for the log), e.g.
    ``"; the saved run's 'dgc' settings differ from this run's: density 0.01 -> 0.1"``; "" where they agree or the
    side-car does not record them. A resumed run may change them on purpose, but what the saved state meant then
    (residuals of another density or format, momenta of another method) is not what this run would have built."""
    if not isinstance(saved, dict):
        return ""
    now = state.cfg.model_dump(mode="json")  # keys of one version only: a setting added since was not recorded
    changed = []
    for key in sorted(set(saved) & set(now) - NEUTRAL_SETTINGS):
        was, is_ = saved[key], now[key]
        if isinstance(was, dict) and isinstance(is_, dict):  # a method's section: its settings one by one, those
            changed += [f"{key}.{sub} {was[sub]!r} -> {is_[sub]!r}"  # both versions record
                        for sub in sorted(set(was) & set(is_)) if was[sub] != is_[sub]]
        elif was != is_:
            changed.append(f"{key} {was!r} -> {is_!r}")
    if not changed:
        return ""
    return ("; the saved run's 'dgc' settings differ from this run's (" + ", ".join(changed) + "): the state it "
            "left (as counted above) goes on under this run's settings, which would not have built it so")


# settings that change nothing the saved state means (how long to wait, how often to log, which collective or kernels
# carry the same values, whether a bucket goes by stock's collective, the parameter all-gather): not reported
NEUTRAL_SETTINGS = {"timeout_s", "stats_interval", "policy", "policy_interval", "comm_backend", "kernels", "weights"}

# what makes a "restored ..." message a warning: state dropped, rounded or loaded for other settings
NOT_ROUTINE = ("IGNORED", "rounded once", "restarts at zero", "differ from this run's") + switching.DROP_MARKS


def load_state(state: DGCState, ckpt_dir: str, tag: str, world_size: int, device: torch.device,
               expect_sidecars: bool = False, save_id: Optional[int] = None, optimizer=None) -> str:
    """Restore this rank's side-car into ``state``; returns what was done, for the log.

    Same data-parallel world size and layout: residuals, sampling generators, thresholds, momenta and telemetry come
    back as saved. Another world size (a universal checkpoint), or another topology or node size: every saved
    rank's residuals and local momenta are put together into the whole run's (float64, per parameter; the
    hierarchical topology's node-level slices assembled per node, then summed over nodes) and split evenly over
    this run's nodes and ranks (:func:`gather_shards`, :func:`split_shard`), so the gradient not yet sent and the
    momenta's sums are conserved (up to the rounding of their storage when it is not fp32: both are in units of the
    mean gradient, a share of ``g / W``, at any world size); thresholds are estimated afresh, the generators
    restart from this rank's seed, the step counters and telemetry are rank 0's (docs/faults.md's table). A
    checkpoint without side-cars (saved without DGC): the residuals restart at zero and the message says so.
    A side-car saved with another gradient method: what means the same under this run's method carries over, the
    rest is dropped, and the message names both (:func:`switching.plan`); the optimizer state DeepSpeed loaded is
    checked against what this run's step reads (:func:`switching.optimizer_note`). Nothing is half-loaded: every
    side-car is read and checked before any state changes.

    Args:
        expect_sidecars: DeepSpeed's files say the checkpoint was saved with side-cars (DGC on): missing ones are an
            error, not a checkpoint saved without DGC.
        save_id: the save DeepSpeed's files record (their ``client_state``), or None: every side-car read must
            have been written by it (:func:`read_sidecar`).
        optimizer: the ZeRO-3 optimizer DeepSpeed loaded the checkpoint into, or None (its state not checked).

    Raises:
        DGCCheckpointError: a side-car is missing where ``expect_sidecars`` (or, re-sharding, any saved rank's),
            unreadable, damaged, another checkpoint's, another save's or another rank's (:func:`read_sidecar`), or its
            state does not fit this model or its saved layout; the error names the file.
    """
    sdir = sidecar_dir(ckpt_dir, tag)
    first = os.path.join(sdir, sidecar_name(0))
    own = os.path.join(sdir, sidecar_name(state.dp_rank))
    marker = switching.read_marker(os.path.join(ckpt_dir, str(tag)))

    def said(msg: str, saved: Optional[dict]) -> str:  # and what the optimizer's loaded state means for this run
        saved = saved or {}
        return msg + switching.optimizer_note(optimizer, saved.get("config"), saved.get("momentum"), state.cfg, marker)

    if not os.path.isfile(first) and not os.path.isfile(own):
        if expect_sidecars:
            raise DGCCheckpointError(f"checkpoint {os.path.join(ckpt_dir, str(tag))} was saved with deepspeed_dgc "
                                     f"state, but its side-car {own} is missing (deleted, or not copied with the "
                                     f"checkpoint); {ADVICE}")
        _clear(state)
        return said(f"no deepspeed_dgc state in {sdir} (checkpoint saved without DGC?): "
                    f"{switching.fresh_note(state.cfg)}", None)
    read: Dict[str, dict] = {}  # path -> payload: each file is read and checked once

    def read_once(path: str) -> dict:
        if path not in read:
            read[path] = read_sidecar(path, tag, save_id)
        return read[path]

    if os.path.isfile(own):  # each rank reads its own side-car only, unless the world size changed
        payload = read_once(own)
        saved = dict(payload)  # as read: the loaders replace some of its entries
        if payload.get("world_size") == world_size:
            if payload.get("residual_layout", "flat") == residual_layout(state):
                return said(_load_same_world(state, own, payload, device), saved)
            # the same ranks in another topology or node size: re-sharded as at another world size
            return said(_load_resharded(state, sdir, read_once(first), world_size, device, read_once), saved)
    if not os.path.isfile(first):
        raise DGCCheckpointError(f"{first} is missing, though {own} is there: {ADVICE}")
    head = read_once(first)
    if head.get("world_size") == world_size:
        raise DGCCheckpointError(f"{own} is missing, though rank 0's side-car in {sdir} is there (saved at the same "
                                 f"world size, {world_size}): {ADVICE}")
    saved = dict(head)
    return said(_load_resharded(state, sdir, head, world_size, device, read_once), saved)


def _load_same_world(state: DGCState, path: str, payload: dict, device) -> str:
    """Restore this rank's own side-car ``payload`` (read from ``path``), saved at this run's world size in this
    run's residual layout."""
    if payload.get("dp_rank", state.dp_rank) != state.dp_rank:
        raise DGCCheckpointError(f"{path} holds the state of data-parallel rank {payload.get('dp_rank')}, read by rank "
                                 f"{state.dp_rank}: the side-cars were renamed or mixed up; {ADVICE}")
    saved_storage = payload.get("residual_storage", "fp32")  # side-cars without it hold fp32
    rename = _key_map(state, payload, path)
    switch = switching.plan(payload.get("config"), payload.get("momentum"), bool(payload["residuals"]), state.cfg)
    payload["residuals"] = _checked(state, {rename(k): v for k, v in payload["residuals"].items()}, "residual", path)
    payload["thresholds"] = {rename(k): v for k, v in payload.get("thresholds", {}).items()}
    if switch is not None:  # another method's side-car: another method's momentum is not taken
        payload["momentum"] = None
    if payload.get("momentum"):
        momenta = {rename(k): v for k, v in payload["momentum"]["momenta"].items()}
        payload["momentum"] = dict(payload["momentum"], momenta=_checked(state, momenta, "momentum", path))
    taken = {} if switch is not None and switch.residuals != "load" else payload["residuals"]
    state.memory.restore(taken, saved_storage, device)
    stats = payload["stats"]
    state.reducer.restore_state({"generators": payload["generators"],
                                 "thresholds": payload.get("thresholds", {}) if taken else {},
                                 # side-cars without it: the steps taken, as the clock counted then
                                 "steps_applied": payload.get("steps_applied", stats.get("steps", 0))})
    state.stats.restore_totals(stats)
    if switch is not None:
        _switch_momentum(state, switch, payload["residuals"], device)
        note = switch.note
    else:
        momentum = payload.get("momentum")
        note = _momentum_note(state, momentum)
        if state.momentum is not None and momentum:
            state.momentum.restore(momentum, device)
    if saved_storage != state.memory.storage and len(state.memory):
        if state.memory.storage == "fp32":  # every fp8 or bf16 value (times its scale) is an fp32 value
            note += (f"; the residuals were stored in {saved_storage} and are now stored in fp32 "
                     "('dgc.residual_dtype'), converted exactly")
        else:
            note += (f"; the residuals were stored in {saved_storage} and are now stored in {state.memory.storage} "
                     "('dgc.residual_dtype'), so they were rounded once")
    if switch is None:  # another method's settings all differ: the note above says what that means
        note += _settings_note(state, payload.get("config"))
    return f"restored deepspeed_dgc state from {path}: {_held(state)}, step {state.stats.steps}{note}"


def _held(state: DGCState) -> str:
    """What the state holds after a load, in words: its residuals, and its momentum method's per-rank momenta."""
    store = getattr(state.momentum, "store", None)
    if store is None:
        return f"{len(state.memory)} residuals"
    if not len(state.memory):
        return f"{len(store)} momenta"
    return f"{len(state.memory)} residuals and {len(store)} momenta"


def _switch_momentum(state: DGCState, switch: "switching.Plan", residuals: Dict, device) -> None:
    """A side-car of another method loaded (:func:`switching.plan`): this run's momentum starts at zero, or (decoupled
    momentum) from the saved residuals of the gradient not yet sent, decoded to fp32 (``residuals``: by key, in
    their storage form)."""
    if state.momentum is None:
        return
    state.momentum.clear()
    if switch.residuals == "momentum" and residuals:
        state.momentum.restore({"momenta": {k: ErrorFeedback.decode(v).float() for k, v in residuals.items()},
                                "steps_done": 0}, device)


def _load_resharded(state: DGCState, sdir: str, head: dict, world_size: int, device,
                    read: Callable[[str], dict]) -> str:
    """Restore the side-cars of a run saved at another data-parallel world size (see :func:`load_state`): every
    saved rank's residuals and momenta put together into the whole run's state per parameter (float64,
    :func:`gather_shards`), then this rank's share of it in this run's layout (:func:`split_shard`). Every file is
    read and checked before anything is loaded.

    Raises:
        DGCCheckpointError: naming the file: a saved rank's side-car missing, saved at another world size or in
            another layout than rank 0's, holding another rank, other parameters or sizes than its layout needs,
            or other residual or momentum keys than rank 0's.
    """
    saved_world = int(head.get("world_size"))
    where = f"deepspeed_dgc state in {sdir} was saved at data-parallel world size {saved_world}, this run has {world_size}"
    saved_rpn = saved_ranks_per_node(head, os.path.join(sdir, sidecar_name(0)))
    rpn = _ranks_per_node(state)
    if saved_rpn is not None and saved_world % saved_rpn:
        raise DGCCheckpointError(f"{os.path.join(sdir, sidecar_name(0))} was saved by {saved_world} ranks with "
                                 f"{saved_rpn} ranks per node, which is not a whole number of nodes; {ADVICE}")
    sides = []
    for r in range(saved_world):
        p = os.path.join(sdir, sidecar_name(r))
        if not os.path.isfile(p):
            raise DGCCheckpointError(f"{where}, but {p} is missing: the state of all {saved_world} saved ranks is "
                                     f"needed to re-shard it, and nothing was loaded; {ADVICE}")
        side = read(p)
        if (side.get("world_size") != saved_world or side.get("residual_layout", "flat") != head.get("residual_layout", "flat")
                or saved_ranks_per_node(side, p) != saved_rpn or side.get("dp_rank", r) != r):
            raise DGCCheckpointError(
                f"{p} does not belong with rank 0's side-car of {sdir}: it holds rank {side.get('dp_rank')!r} of a "
                f"world of {side.get('world_size')!r} ({side.get('residual_layout', 'flat')}), rank 0's a world of "
                f"{saved_world} ({head.get('residual_layout', 'flat')}); nothing was loaded; {ADVICE}")
        rename = _key_map(state, side, p)
        side["residuals"] = {rename(k): v for k, v in side["residuals"].items()}
        if side.get("momentum"):
            side["momentum"] = dict(side["momentum"], momenta={rename(k): v for k, v in side["momentum"]["momenta"].items()})
        if bool(side.get("momentum")) != bool(head.get("momentum")) and r:
            raise DGCCheckpointError(f"{p} {'holds' if side.get('momentum') else 'lacks'} local momenta, rank 0's "
                                     f"side-car does not: nothing was loaded; {ADVICE}")
        sides.append(side)
    numels = {state.key_of(p): getattr(p, "ds_numel", p.numel()) for p in state.params}
    switch = switching.plan(head.get("config"), head.get("momentum"), bool(head["residuals"]), state.cfg)
    total = _gather_all(sides, lambda s: s["residuals"], numels, saved_world, saved_rpn, "residual", sdir)
    momenta = None
    if head.get("momentum") and switch is None:  # another method's momentum is not taken (switching.plan)
        momenta = _gather_all(sides, lambda s: s["momentum"]["momenta"], numels, saved_world, saved_rpn,
                              "momentum", sdir)
    rank = state.dp_rank
    mine = {k: split_shard(v, world_size, rpn, rank).float().to(device) for k, v in total.items()}
    saved = None
    if momenta is not None:
        saved = {"momenta": {k: split_shard(v, world_size, rpn, rank).float() for k, v in momenta.items()},
                 "steps_done": int(sides[0]["momentum"]["steps_done"])}
    # everything read and checked: load
    state.memory.load(mine if switch is None or switch.residuals == "load" else {})
    state.reducer.clear_thresholds()  # each rank's own: estimated afresh on the new ranks
    state.stats.restore_totals(head["stats"])  # step counters (the density schedule's clock) are global: rank 0's
    state.reducer.restore_state({"steps_applied": head.get("steps_applied", head["stats"].get("steps", 0))})
    if switch is not None:
        _switch_momentum(state, switch, mine, device)
        note = switch.note
    else:
        note = _momentum_note(state, saved) + _settings_note(state, head.get("config"))
        if state.momentum is not None and saved:
            state.momentum.restore(saved, device)
    layouts = f"{head.get('residual_layout', 'flat')} -> {residual_layout(state)}"
    count = 0 if switch is not None and switch.residuals == "drop" else len(total)
    return (f"{where}: re-sharded {count} residuals ({layouts}: put together from the {saved_world} saved "
            f"ranks and split evenly over this run's nodes and ranks, so the gradient not yet sent is conserved); "
            f"sampling restarts from this rank's seed{note}")


def saved_ranks_per_node(side: dict, where: str = "side-car") -> Optional[int]:
    """The node size L of a saved side-car's hierarchical residuals (None: flat), from its ``ranks_per_node`` or,
    in side-cars written before that was recorded, its ``residual_layout`` text.

    Raises:
        DGCCheckpointError: naming ``where``: the layout says hierarchical but names no node size.
    """
    layout = side.get("residual_layout", "flat")
    if layout == "flat":
        return None
    if side.get("ranks_per_node"):
        return int(side["ranks_per_node"])
    found = re.fullmatch(r"hierarchical, (\d+) ranks per node", str(layout))
    if not found:
        raise DGCCheckpointError(f"{where}: residual layout {layout!r} names no node size; {ADVICE}")
    return int(found.group(1))


def _ranks_per_node(state: DGCState) -> Optional[int]:
    """This run's node size L (None: the flat topology)."""
    if state.cfg.topology != "hierarchical":
        return None
    if state.reducer.ranks_per_node is None:
        state.reducer.ranks_per_node = resolve_ranks_per_node(state.cfg)[0]
    return int(state.reducer.ranks_per_node)


def shard_numel(numel: int, world: int, ranks_per_node: Optional[int]) -> int:
    """Elements of one rank's residual or momentum of a parameter of ``numel`` elements: ``numel`` (flat,
    ``ranks_per_node`` None), or ``N * ceil(numel / world)`` with ``N = world / ranks_per_node`` nodes (hierarchical:
    the node-level sums of the owners ``k L + l``, :func:`~deepspeed_dgc.zero3.optimizer.node_rows`)."""
    if ranks_per_node is None:
        return numel
    return world // ranks_per_node * -(-numel // world)


def gather_shards(shards, numel: int, world: int, ranks_per_node: Optional[int]) -> torch.Tensor:
    """The whole run's state of one parameter from every rank's share: float64 ``(numel,)``.

    Flat topology (``ranks_per_node`` None): each of the ``world`` shards is ``(numel,)``, one rank's part of the
    mean (gradient / W units), and the whole is their sum. Hierarchical (N = world / L nodes of L ranks): rank
    ``g = k L + l`` (node k, local rank l) holds ``(N * c,)`` with ``c = ceil(numel / world)``, row j being node k's
    part of owner ``j L + l``'s slice ``[(jL+l)c, (jL+l+1)c)`` of the parameter; the L ranks of a node together hold
    its whole node-level state, and the whole is the sum over nodes. The padding beyond ``numel`` is dropped (it
    carries no gradient; the flat export drops it as well).

    Args:
        shards: ``world`` tensors in rank order, any float dtype (decoded), shapes as above.

    Raises:
        ValueError: a shard of another size, or ``world`` not a multiple of ``ranks_per_node``.
    """
    if len(shards) != world:
        raise ValueError(f"{len(shards)} shards for a world of {world}")
    want = shard_numel(numel, world, ranks_per_node)
    for g, t in enumerate(shards):
        if t.numel() != want:
            raise ValueError(f"rank {g}'s shard has {t.numel()} elements, its layout needs {want}")
    if ranks_per_node is None:
        total = torch.zeros(numel, dtype=torch.float64)
        for t in shards:
            total += t.reshape(-1).double()
        return total
    if world % ranks_per_node:
        raise ValueError(f"world {world} is not a whole number of nodes of {ranks_per_node} ranks")
    c = -(-numel // world)
    full = torch.zeros(world, c, dtype=torch.float64)
    for g, t in enumerate(shards):
        full[g % ranks_per_node::ranks_per_node] += t.reshape(-1, c).double()
    return full.reshape(-1)[:numel].clone()


def split_shard(total: torch.Tensor, world: int, ranks_per_node: Optional[int], rank: int) -> torch.Tensor:
    """Rank ``rank``'s share of the whole state ``total`` (``(numel,)``, float64) in a run of ``world`` ranks: an
    even split, so that :func:`gather_shards` of every rank's share gives ``total`` back. Flat: ``total / world``,
    ``(numel,)``. Hierarchical (N = world / L nodes): every node holds ``total / N``, its local rank l the rows of
    the owners ``j L + l``, ``(N * ceil(numel / world),)`` zero-padded. Returns float64.

    Raises:
        ValueError: ``world`` not a multiple of ``ranks_per_node``, or ``rank`` outside the world.
    """
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside a world of {world}")
    total = total.reshape(-1).double()
    if ranks_per_node is None:
        return total / world
    if world % ranks_per_node:
        raise ValueError(f"world {world} is not a whole number of nodes of {ranks_per_node} ranks")
    nodes, numel = world // ranks_per_node, total.numel()
    c = -(-numel // world)
    padded = torch.nn.functional.pad(total, (0, world * c - numel))
    return padded.view(world, c)[rank % ranks_per_node::ranks_per_node].reshape(-1) / nodes


def _gather_all(sides, entries_of, numels: Dict[str, int], world: int, ranks_per_node: Optional[int], kind: str,
                sdir: str) -> Dict[str, torch.Tensor]:
    """Per key, :func:`gather_shards` of every saved rank's entry (decoded from its storage form).

    Raises:
        DGCCheckpointError: naming the side-car whose keys differ from rank 0's, which holds a parameter this
            model lacks, or an entry of another size than the saved layout gives.
    """
    keys = set(entries_of(sides[0]))
    out = {}
    for r, side in enumerate(sides):
        path = os.path.join(sdir, sidecar_name(r))
        entries = entries_of(side)
        if set(entries) != keys:
            raise DGCCheckpointError(f"{path} holds {kind}s of other parameters than rank 0's side-car "
                                     f"({sorted(map(str, set(entries) ^ keys))[:4]} differ); nothing was loaded; {ADVICE}")
        for key in entries:
            if key not in numels:
                raise DGCCheckpointError(f"deepspeed_dgc checkpoint {path} holds a {kind} for parameter {key!r}, which "
                                         "this model does not have (was it saved from another model?)")
            want = shard_numel(numels[key], world, ranks_per_node)
            value = ErrorFeedback.decode(entries[key])
            if value.numel() != want:
                raise DGCCheckpointError(f"deepspeed_dgc checkpoint {path}: the {kind} of parameter {key!r} has "
                                         f"{value.numel()} elements, its saved layout needs {want} (the model differs "
                                         "from the one saved)")
            entries[key] = value
    for key in keys:
        out[key] = gather_shards([entries_of(s)[key] for s in sides], numels[key], world, ranks_per_node)
    return out


def _expected_numel(state: DGCState, kind: str) -> Dict[str, int]:
    """Elements of each parameter's saved residual or momentum in this run, by key: the full parameter (flat
    topology), or the node-level sums this rank compresses, ``N * ceil(n / W)`` (hierarchical: residuals and every
    local momentum). ``kind``: ``"residual"`` or ``"momentum"`` (the same sizes; named in errors)."""
    world, hierarchical = state.stats.world_size, state.cfg.topology == "hierarchical"
    nodes = world // (state.reducer.ranks_per_node or world)
    out = {}
    for p in state.params:
        n = getattr(p, "ds_numel", p.numel())
        out[state.key_of(p)] = nodes * -(-n // world) if hierarchical else n
    return out


def _checked(state: DGCState, entries: Dict, kind: str, where: str) -> Dict:
    """``entries`` if every key is a parameter of this model and every entry has its length.

    Raises:
        DGCCheckpointError: naming the first entry that does not fit (another model, or a parameter of another size).
    """
    expected = _expected_numel(state, kind)
    for key, value in entries.items():
        if key not in expected:
            raise DGCCheckpointError(f"deepspeed_dgc checkpoint {where} holds a {kind} for parameter {key!r}, which "
                                     "this model does not have (was it saved from another model?)")
        numel = value["numel"] if isinstance(value, dict) else (value[0] if isinstance(value, tuple) else value).numel()
        if numel != expected[key]:
            raise DGCCheckpointError(f"deepspeed_dgc checkpoint {where}: the {kind} of parameter {key!r} has {numel} "
                                     f"elements, this run needs {expected[key]} (the model or the topology differs "
                                     "from the one saved)")
    return entries


def _key_map(state: DGCState, side: dict, where: str):
    """How a side-car's keys become this run's: names as they are; the ``ds_id`` keys of format 1 mapped in order
    onto this engine's parameters (ZeRO-3 numbers an engine's parameters consecutively in module order, after those
    of every model built before it in that process), with a warning."""
    if side.get("format", 1) >= 2:
        return lambda k: k
    saved = {k for k in side["residuals"]} | {k for k in (side.get("momentum") or {}).get("momenta", {})}
    ids = sorted(getattr(p, "ds_id", i) for i, p in enumerate(state.params))
    if not saved:
        return lambda k: k
    shift = min(saved) - (ids[0] if ids else 0)
    by_id = {getattr(p, "ds_id", i): state.key_of(p) for i, p in enumerate(state.params)}
    logger.warning(f"[deepspeed_dgc] {where} was saved by an earlier version, keyed by ZeRO-3's ds_id; its entries are "
                   "mapped onto this model's parameters in order (checked by size)")

    def rename(k):
        if k - shift not in by_id:
            raise DGCCheckpointError(f"deepspeed_dgc checkpoint {where} holds state for ds_id {k}, which does not map onto "
                                     f"this model's {len(by_id)} parameters")
        return by_id[k - shift]

    return rename


def load_without_dgc(optimizer, load_dir: str, tag: str, load_path: str, dp_rank: int,
                     save_id: Optional[int] = None) -> Optional[str]:
    """What a ZeRO-3 run with DGC off makes of the checkpoint DeepSpeed just loaded into ``optimizer``, for the log;
    None where there is nothing to say (a stock checkpoint, its optimizer state as the run uses it).

    Its side-cars, when there are any, are not loaded: this rank's (rank 0's at another world size) is read only to
    name what is dropped (:func:`switching.dropped_without_dgc`: the residuals, the method's per-rank momentum), and
    the optimizer's state is checked against what stock's step reads (:func:`switching.optimizer_note`: Adam's
    moments left empty by decoupled momentum's sign update are rebuilt from zero, and so on). A side-car that cannot
    be read is named, not raised: this run does not need it."""
    sdir, found = sidecars_in(load_dir, tag)
    payload, problem = None, ""
    if found:
        own = os.path.join(sdir, sidecar_name(dp_rank))
        try:
            payload = read_sidecar(own if os.path.isfile(own) else os.path.join(sdir, sidecar_name(0)), tag, save_id)
        except (DGCCheckpointError, OSError) as err:
            problem = f" (it could not be read to say more: {_error_text(err, 160)})"
    payload = payload or {}
    note = switching.optimizer_note(optimizer, payload.get("config"), payload.get("momentum"), None,
                                    switching.read_marker(os.path.join(load_dir, str(tag))))
    if not found:
        return f"checkpoint {load_path}: {note[2:]}" if note else None
    method = switching.method_of(payload.get("config"))
    saved = f"saved with {switching.TITLES[method]}" if method else "saved with DGC on"
    drops = switching.dropped_without_dgc(payload) if payload else []
    what = "; ".join(drops) if drops else ("its state is IGNORED" + problem if problem or not payload else
                                           "it holds nothing this run would use")
    loaded = "DeepSpeed's weights loaded as usual" + note if note else (
        "DeepSpeed's weights and optimizer state loaded as usual")
    return (f"checkpoint {load_path} holds deepspeed_dgc state {saved} ({len(found)} dgc_state_dp_rank_*.pt files in "
            f"{sdir}); this run has DGC off, so {what}. {loaded}")


def tag_of(load_dir: str, tag, universal: bool = False) -> str:
    """The tag DeepSpeed loaded: the given one, else the content of ``latest`` (``latest_universal``
    when the engine loads universal checkpoints)."""
    if tag is None:
        with open(os.path.join(load_dir, "latest_universal" if universal else "latest")) as f:
            return f.read().strip()
    return str(tag)


def sidecars_in(load_dir: str, tag: str):
    """The side-car files of a checkpoint (any rank's: the world size may have changed)."""
    sdir = sidecar_dir(load_dir, tag)
    return sdir, glob.glob(os.path.join(sdir, SIDECAR_GLOB))
