"""What makes a checkpoint's save all-or-nothing across ranks, beside the side-cars (:mod:`.checkpoint`).

- An in-progress marker: rank 0 writes ``<tag>/dgc_saving`` before any rank writes a file of the checkpoint and
  removes it once every rank has written all of its files (then ``latest`` is written). A tag that still holds it was
  not saved whole (a rank died, or a disk filled, while saving), so loading it by name fails naming what happened,
  instead of DeepSpeed's error about a truncated file or, worse, a load of a mix of two saves into the same tag.
  Checkpoints saved before the marker existed have none and load as before.
- A guard on DeepSpeed's file writes (``engine.checkpoint_engine.save``, and rank 0's copy of the recovery scripts
  ``zero_to_fp32.py`` and ``zero_to_torch.py`` into the save directory, a plain file copy): a write that fails
  (``ENOSPC``, a permission) is recorded instead of raised, and this rank writes nothing more of that checkpoint, so
  it still reaches the collectives the others wait in (DeepSpeed's closing barrier, the extension's agreement) and
  every rank then raises together, not after a timeout or in a mismatched collective.
"""

import contextlib
import glob
import os
from typing import Callable, List, Optional

from .checkpoint import DGCCheckpointError, _fsync_dir, _write_atomically, write_failure

SAVING_MARK = "dgc_saving"
_MISSING = object()


def saving_mark_path(ckpt_dir: str, tag: str) -> str:
    """Path of the in-progress marker of checkpoint ``ckpt_dir/tag``."""
    return os.path.join(ckpt_dir, str(tag), SAVING_MARK)


def begin_save(ckpt_dir: str, tag: str) -> None:
    """Mark checkpoint ``ckpt_dir/tag`` as being saved (rank 0, before any rank writes a file of it).

    Raises:
        DGCCheckpointError: the marker could not be written (no space left, no permission).
    """
    _write_atomically(saving_mark_path(ckpt_dir, tag), f"{tag}\n".encode())


def end_save(ckpt_dir: str, tag: str) -> None:
    """Every rank has written its files of ``ckpt_dir/tag``: remove the in-progress marker (rank 0, before
    ``latest`` is written).

    Raises:
        DGCCheckpointError: the marker could not be removed.
    """
    path = saving_mark_path(ckpt_dir, tag)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as err:
        raise DGCCheckpointError(f"deepspeed_dgc could not remove {path} after saving checkpoint {tag!r}: {err}") from err
    _fsync_dir(os.path.dirname(path))


def incomplete(ckpt_dir: str, tag: str) -> Optional[str]:
    """Why checkpoint ``ckpt_dir/tag`` must not be loaded, or None: a save into it started and did not finish on
    every rank (its in-progress marker is still there). The message names the directory, what it holds and what to
    do."""
    path = saving_mark_path(ckpt_dir, tag)
    if not os.path.exists(path):
        return None
    here = os.path.dirname(path)
    files = sorted(f for f in os.listdir(here) if f != SAVING_MARK and not f.startswith("."))
    shown = ", ".join(files[:8]) + (f" and {len(files) - 8} more" if len(files) > 8 else "")
    latest = os.path.join(ckpt_dir, "latest")
    named = None
    if os.path.isfile(latest):
        with open(latest) as f:
            named = f.read().strip()
    if named and named != str(tag):
        where = f"'latest' names {named!r}, the last checkpoint saved whole"
    else:  # 'latest' names this very tag (a save into it was cut short) or nothing: say which tags are whole
        whole = complete_tags(ckpt_dir)
        where = ("'latest' names this tag: a save into it was cut short; complete here, newest first: "
                 + (", ".join(whole[:3]) if whole else "none") + "; load one by its tag"
                 if named == str(tag) else "no complete checkpoint is named by 'latest'")
    return (f"deepspeed_dgc: checkpoint {here} is incomplete: a save into it started and did not finish on every rank "
            f"(a rank died or a disk filled while saving; {SAVING_MARK} is still there), so some rank's files are "
            f"missing or cut short (present: {shown or 'nothing'}); resume from another checkpoint ({where})")


def complete_tags(ckpt_dir: str) -> List[str]:
    """The tags under ``ckpt_dir`` holding DeepSpeed's model states and no in-progress mark, newest first (by the
    time their model states were written)."""
    found = []
    for name in os.listdir(ckpt_dir):
        here = os.path.join(ckpt_dir, name)
        states = glob.glob(os.path.join(here, "*model_states.pt"))
        if os.path.isdir(here) and states and not os.path.exists(os.path.join(here, SAVING_MARK)):
            found.append((max(os.path.getmtime(p) for p in states), name))
    return [name for _, name in sorted(found, reverse=True)]


class GuardedWrites(contextlib.AbstractContextManager):
    """Within the block, DeepSpeed's checkpoint writes that fail are recorded in :attr:`errors` (as
    :class:`DGCCheckpointError` naming the file and the cause) instead of raised, and once one has failed this rank
    writes nothing more of the checkpoint.

    The writes guarded: ``checkpoint_engine.save(state_dict, path)`` (every file of DeepSpeed's own), and where
    ``engine`` is given its ``_copy_recovery_script(save_dir)`` (DeepSpeed 0.19.8: rank 0 copies ``zero_to_fp32.py``
    and ``zero_to_torch.py`` into the save directory with ``shutil.copyfile``, after its optimizer states; on a full
    disk that copy fails even where the scripts are there from an earlier save, since the copy truncates them first;
    unguarded, rank 0 alone would raise out of the save and leave the others in DeepSpeed's closing barrier).

    Args:
        checkpoint_engine: the engine's ``checkpoint_engine``.
        engine: the DeepSpeed engine, or None (only ``checkpoint_engine.save`` is guarded).
    """

    def __init__(self, checkpoint_engine, engine=None):
        self.checkpoint_engine = checkpoint_engine
        self.engine = engine
        self.errors: List[DGCCheckpointError] = []
        self._patched = []

    def _guard(self, owner, name: str, what: Callable) -> None:
        """Guard ``owner.name``; ``what(*args, **kwargs)`` gives (what the call writes, for the error; a path in
        the file system written to)."""
        real = getattr(owner, name)

        def guarded(*args, **kwargs):
            if self.errors:  # the checkpoint is lost already: write no more of it
                return None
            try:
                return real(*args, **kwargs)
            except (OSError, RuntimeError) as err:  # torch.save wraps a failed write in a RuntimeError
                text, path = what(*args, **kwargs)
                self.errors.append(DGCCheckpointError(f"deepspeed_dgc: {text} failed: {write_failure(err, path)}"))
                return None

        self._patched.append((owner, name, owner.__dict__.get(name, _MISSING)))
        setattr(owner, name, guarded)

    def __enter__(self):
        self._guard(self.checkpoint_engine, "save",
                    lambda state_dict=None, path=None, *a, **k: (f"writing {path}", path))
        if self.engine is not None and hasattr(self.engine, "_copy_recovery_script"):
            self._guard(self.engine, "_copy_recovery_script",
                        lambda save_path=None, *a, **k: (f"copying DeepSpeed's recovery scripts (zero_to_fp32.py, "
                                                         f"zero_to_torch.py) into {save_path}",
                                                         os.path.join(str(save_path), "zero_to_fp32.py")))
        return self

    def __exit__(self, *exc):
        for owner, name, before in reversed(self._patched):  # as it was: the class's method, or an instance's own
            if before is _MISSING:
                owner.__dict__.pop(name, None)
            else:
                setattr(owner, name, before)
        self._patched = []
        return False
