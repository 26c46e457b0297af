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
from typing import Callable, Dict, Optional

import torch
from deepspeed.utils import logger

from ..memory.error_feedback import ErrorFeedback
from ..memory.momentum import CompressedMomentum
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


def save_state(state: DGCState, ckpt_dir: str, tag: str, world_size: int) -> str:
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
        "world_size": world_size,
        "dp_rank": state.dp_rank,
        "config": state.cfg.model_dump(mode="json"),
        "residual_layout": residual_layout(state),
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
        why = "no space left on the device" if err.errno == errno.ENOSPC else err.strerror or str(err)
        raise DGCCheckpointError(f"deepspeed_dgc could not write {path}: {why} ({err})") from err


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


def read_sidecar(path: str, tag: Optional[str] = None) -> dict:
    """The payload of the side-car at ``path``, checked: readable, its SHA-256 matching (format 3), and saved for
    checkpoint ``tag`` where it records one. Side-cars of formats 1 and 2 (no checksum) load as they are.

    Raises:
        DGCCheckpointError: naming ``path`` and what is wrong: unreadable or truncated, damaged (checksum), not a
            side-car, or another checkpoint's.
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
    return payload


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
    changed = [f"{key} {saved[key]!r} -> {now[key]!r}" for key in sorted(set(saved) & set(now)) if saved[key] != now[key]]
    if not changed:
        return ""
    return ("; the saved run's 'dgc' settings differ from this run's (" + ", ".join(changed) + "): the state it "
            "left was loaded for this run's settings, and what they do not use is dropped")


# what makes a "restored ..." message a warning: state dropped, rounded or loaded for other settings
NOT_ROUTINE = ("IGNORED", "rounded once", "restarts at zero", "differ from this run's")


def load_state(state: DGCState, ckpt_dir: str, tag: str, world_size: int, device: torch.device,
               expect_sidecars: bool = False) -> str:
    """Restore this rank's side-car into ``state``; returns what was done, for the log.

    Same data-parallel world size: residuals, sampling generators, thresholds and telemetry come back as saved.
    Another world size (a universal checkpoint), flat topology: the residuals of all saved ranks are summed and
    split evenly over this run's ranks, so the gradient not yet sent is conserved (up to the rounding of the
    residual storage when it is not fp32; each residual is one rank's unsent share of the mean gradient); the
    generators restart from this rank's seed. Another world size with the hierarchical topology (residuals live
    on node-level slices), a checkpoint without side-cars (saved without DGC) or one whose side-cars disagree:
    the residuals restart at zero and the message says why. Nothing is half-loaded.

    Args:
        expect_sidecars: DeepSpeed's files say the checkpoint was saved with side-cars (DGC on): missing ones are an
            error, not a checkpoint saved without DGC.

    Raises:
        DGCCheckpointError: a side-car is missing where ``expect_sidecars``, unreadable, damaged, another
            checkpoint's or another rank's (:func:`read_sidecar`), or its state does not fit this model.
    """
    sdir = sidecar_dir(ckpt_dir, tag)
    first = os.path.join(sdir, sidecar_name(0))
    own = os.path.join(sdir, sidecar_name(state.dp_rank))
    if not os.path.isfile(first) and not os.path.isfile(own):
        if expect_sidecars:
            raise DGCCheckpointError(f"checkpoint {os.path.join(ckpt_dir, str(tag))} was saved with deepspeed_dgc "
                                     f"state, but its side-car {own} is missing (deleted, or not copied with the "
                                     f"checkpoint); {ADVICE}")
        _clear(state)
        return f"no deepspeed_dgc state in {sdir} (checkpoint saved without DGC?): error-feedback residuals start at zero"
    read: Dict[str, dict] = {}  # path -> payload: each file is read and checked once

    def read_once(path: str) -> dict:
        if path not in read:
            read[path] = read_sidecar(path, tag)
        return read[path]

    if os.path.isfile(own):  # each rank reads its own side-car only, unless the world size changed
        payload = read_once(own)
        if payload.get("world_size") == world_size:
            return _load_same_world(state, own, payload, device)
    if not os.path.isfile(first):
        raise DGCCheckpointError(f"{first} is missing, though {own} is there: {ADVICE}")
    head = read_once(first)
    if head.get("world_size") == world_size:
        raise DGCCheckpointError(f"{own} is missing, though rank 0's side-car in {sdir} is there (saved at the same "
                                 f"world size, {world_size}): {ADVICE}")
    return _load_resharded(state, sdir, head, world_size, device, read_once)


def _load_same_world(state: DGCState, path: str, payload: dict, device) -> str:
    """Restore this rank's own side-car ``payload`` (read from ``path``), saved at this run's world size."""
    saved_layout = payload.get("residual_layout", "flat")
    if saved_layout != residual_layout(state):
        _clear(state)
        return (f"deepspeed_dgc state in {path} holds residuals of the {saved_layout} topology, this run uses "
                f"{residual_layout(state)}: they do not fit, so they are dropped and restart at zero")
    if payload.get("dp_rank", state.dp_rank) != state.dp_rank:
        raise DGCCheckpointError(f"{path} holds the state of data-parallel rank {payload.get('dp_rank')}, read by rank "
                                 f"{state.dp_rank}: the side-cars were renamed or mixed up; {ADVICE}")
    saved_storage = payload.get("residual_storage", "fp32")  # side-cars without it hold fp32
    rename = _key_map(state, payload, path)
    payload["residuals"] = _checked(state, {rename(k): v for k, v in payload["residuals"].items()}, "residual", path)
    payload["thresholds"] = {rename(k): v for k, v in payload.get("thresholds", {}).items()}
    if payload.get("momentum"):
        momenta = {rename(k): v for k, v in payload["momentum"]["momenta"].items()}
        payload["momentum"] = dict(payload["momentum"], momenta=_checked(state, momenta, "momentum", path))
    state.memory.restore(payload["residuals"], saved_storage, device)
    stats = payload["stats"]
    state.reducer.restore_state({"generators": payload["generators"], "thresholds": payload.get("thresholds", {}),
                                 # side-cars without it: the steps taken, as the clock counted then
                                 "steps_applied": payload.get("steps_applied", stats.get("steps", 0))})
    state.stats.restore_totals(stats)
    momentum = payload.get("momentum")
    note = _momentum_note(state, momentum)
    if state.momentum is not None and momentum:
        state.momentum.restore(momentum, device)
    if saved_storage != state.memory.storage and len(state.memory):
        note += (f"; the residuals were stored in {saved_storage} and are now stored in {state.memory.storage} "
                 "('dgc.residual_dtype'), so they were rounded once")
    note += _settings_note(state, payload.get("config"))
    return f"restored deepspeed_dgc state from {path}: {len(state.memory)} residuals, step {state.stats.steps}{note}"


def _load_resharded(state: DGCState, sdir: str, head: dict, world_size: int, device,
                    read: Callable[[str], dict]) -> str:
    saved_world = head.get("world_size")
    where = f"deepspeed_dgc state in {sdir} was saved at data-parallel world size {saved_world}, this run has {world_size}"
    if head.get("residual_layout", "flat") != "flat" or residual_layout(state) != "flat":
        _clear(state)
        return (f"{where}; residuals of the hierarchical topology live on node-level slices and cannot be "
                "re-sharded, so they are dropped and restart at zero")
    sides = []
    for r in range(saved_world):
        p = os.path.join(sdir, sidecar_name(r))
        if not os.path.isfile(p):
            _clear(state)
            return f"{where} but {p} is missing: residuals cannot be re-sharded and restart at zero"
        side = read(p)
        rename = _key_map(state, side, p)
        side["residuals"] = {rename(k): v for k, v in side["residuals"].items()}
        if side.get("momentum"):
            side["momentum"] = dict(side["momentum"], momenta={rename(k): v for k, v in side["momentum"]["momenta"].items()})
        sides.append(side)
    total = _sum_over_ranks([{k: ErrorFeedback.decode(v) for k, v in s["residuals"].items()} for s in sides])
    saved_momenta = [s["momentum"]["momenta"] for s in sides if s.get("momentum")]
    momenta = _sum_over_ranks(saved_momenta) if saved_momenta else None
    if total is None or (saved_momenta and momenta is None):
        _clear(state)
        return f"{where}; the saved side-cars hold different residual or momentum sets: they restart at zero"
    total = _checked(state, total, "residual", sdir)
    if momenta is not None:
        momenta = _checked(state, momenta, "momentum", sdir)
    state.memory.load({k: (v / world_size).float().to(device) for k, v in total.items()})
    state.reducer.clear_thresholds()  # each rank's own: estimated afresh on the new ranks
    state.stats.restore_totals(head["stats"])  # step counters (the density schedule's clock) are global: rank 0's
    state.reducer.restore_state({"steps_applied": head.get("steps_applied", head["stats"].get("steps", 0))})
    saved = None if momenta is None else {"momenta": momenta, "steps_done": sides[0]["momentum"]["steps_done"]}
    note = _momentum_note(state, saved) + _settings_note(state, head.get("config"))
    if state.momentum is not None and saved:
        state.momentum.restore(saved, device, 1.0 / world_size)
    return (f"{where}: re-sharded {len(total)} residuals (summed over the {saved_world} saved ranks, split evenly "
            f"over this run's, so the gradient not yet sent is conserved); sampling restarts from this rank's seed{note}")


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
        numel = (value[0] if isinstance(value, tuple) else value).numel()
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


def _sum_over_ranks(per_rank) -> Optional[Dict]:
    """float64 sums per key of the ranks' tensors, or None when the ranks hold different keys or shapes."""
    total = None
    for entries in per_rank:
        if total is None:
            total = {k: v.double() for k, v in entries.items()}
        elif set(total) != set(entries) or any(total[k].shape != v.shape for k, v in entries.items()):
            return None
        else:
            for k, v in entries.items():
                total[k] += v.double()
    return total if total is not None else {}


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
