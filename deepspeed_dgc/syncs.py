"""Count, on aten ops, the kernel launches and the host synchronisations of deepspeed_dgc's own code.

On a GPU the host's job in the bucket path is to launch work; an op that reads device memory on the host makes it wait
for every kernel queued before it. A :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees every aten op, those
that method wrappers miss included (``_local_scalar_dense`` behind ``int(t)``, ``bool(t)`` and indexing with a 0-d
tensor), and each op is charged to the innermost frame of the package that made it. On CPU tensors nothing waits, but
the same ops run, so a CPU run with ``"kernels": "reference"`` (the Python path every device runs) counts what a GPU
run would wait for; on a GPU, ``torch.cuda.set_sync_debug_mode("error")`` is the truth.

- launches: ops that run a kernel on a GPU (views, metadata and empty allocations left out);
- syncs: ``_local_scalar_dense`` (``item``, ``int``, ``float``, ``bool``, indexing with a 0-d tensor), ``nonzero``,
  ``masked_select``, ``unique``, indexing with a boolean mask, ``repeat_interleave`` without ``output_size``,
  ``bincount`` and ``histc`` (on CUDA they read their input's range back to the host);
- bytes (``track_bytes=True``): the storage of every tensor an op of the package makes that is not the storage of one
  of its inputs (so in-place ops, views and writes into ZeRO-3's memory are not new), ``empty`` allocations included,
  from its creation until it is freed: the bytes alive now and the most alive at once since :meth:`mark`.

Example::

    with HostSyncCounter() as ops:
        for step in range(12):
            train_step()
            print(step, sum(ops.take().values()), ops.launches)
"""

import contextlib
import os
import sys
import threading
import weakref
from collections import Counter
from typing import Dict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
DEEPSPEED_DIR = os.sep + "deepspeed" + os.sep

# ops that launch nothing on a device: views, metadata, allocations without a fill
NOT_LAUNCHES = frozenset((
    "view", "_unsafe_view", "slice", "select", "expand", "t", "unsqueeze", "squeeze", "alias", "detach", "as_strided",
    "split", "split_with_sizes", "narrow", "unbind", "permute", "_reshape_alias", "reshape", "lift_fresh", "empty",
    "empty_like", "empty_strided", "transpose", "view_as_real", "view_as_complex", "resolve_conj", "resolve_neg",
    "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size", "_has_compatible_shallow_copy_type",
    "set_", "unfold", "chunk", "movedim", "flatten", "view_as", "dim", "size", "stride", "numel", "is_contiguous",
    "storage_offset", "record_stream"))
SYNC_OPS = frozenset(("_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_dim",
                      "unique_consecutive", "_unique", "bincount", "histc"))  # bincount, histc: their range on CUDA


def _name(func) -> str:
    return func._schema.name.split("::")[-1]


def is_sync(name: str, args, kwargs) -> bool:
    """Whether an aten op (by name, with its arguments) makes the host wait for the device."""
    if name in SYNC_OPS:
        return True
    if name == "repeat_interleave" and kwargs.get("output_size") is None and len(args) < 3:
        return isinstance(args[0], torch.Tensor) and args[0].dtype in (torch.int64, torch.int32)
    if name in ("index", "index_put", "index_put_", "_index_put_impl_") and len(args) > 1:
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in (args[1] or ()))
    return False


class HostSyncCounter(TorchDispatchMode):
    """A dispatch mode that counts the aten ops made from deepspeed_dgc's code (the innermost frame of a call stack
    that is a file of the package), and those of them that synchronise the host.

    Only one per thread at a time (it is a dispatch mode: pushed on entry, popped on exit).

    Args:
        package_dir: the directory whose files count as the package's (default: deepspeed_dgc's).
        track_bytes: also account the bytes of the tensors the package's ops make (see the module's docstring).

    Attributes:
        counts: sync kind -> syncs since the last :meth:`take`; sites: ``(file:line, kind)`` -> syncs.
        launches: launching ops since the last :meth:`take`; syncs: syncs since then (the sum of ``counts``).
        live_bytes: bytes of the package's tensors alive now (made while counting, not yet freed).
        peak_bytes: the most of ``live_bytes`` above its value at the last :meth:`mark`, since that mark.
    """

    def __init__(self, package_dir: str = PACKAGE_DIR, track_bytes: bool = False):
        super().__init__()
        self.package_dir = package_dir
        self.track_bytes = track_bytes
        self.counts: Counter = Counter()
        self.sites: Counter = Counter()
        self.launches = 0
        self.live_bytes = 0
        self.peak_bytes = 0
        self._base = 0
        self._alive: Dict[int, int] = {}
        self._paused = False
        self._lock = threading.RLock()  # a finalizer may free a storage while an op is being counted

    def _site(self):
        """The innermost frame of the package on the stack (file relative to the package, line), or None where a
        frame of DeepSpeed's comes first (its own work, even when the package called it: its step, say)."""
        frame = sys._getframe(2)
        while frame is not None:
            name = frame.f_code.co_filename
            if name.startswith(self.package_dir) and not name.endswith("syncs.py"):
                return os.path.relpath(name, self.package_dir), frame.f_lineno
            if DEEPSPEED_DIR in name and os.sep + "utils" + os.sep not in name.split(DEEPSPEED_DIR)[-1]:
                return None
            frame = frame.f_back
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        site = None if self._paused else self._site()
        if site is None:
            return out
        name = _name(func)
        with self._lock:
            if name not in NOT_LAUNCHES:
                self.launches += 1
            if is_sync(name, args, kwargs):
                self.counts[name] += 1
                self.sites[(f"{site[0]}:{site[1]}", name)] += 1
            if self.track_bytes:
                self._count_new(args, kwargs, out)
        return out

    def _count_new(self, args, kwargs, out) -> None:
        """Account the storages of ``out`` that are new (not an input's), until each is freed."""
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or key in inputs or key in self._alive:
                continue
            self._alive[key] = nbytes
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes - self._base)
            weakref.finalize(storage, self._free, key, nbytes)  # the storage's Python object lives as long as it

    def _free(self, key: int, nbytes: int) -> None:
        with self._lock:
            if self._alive.pop(key, None) is not None:
                self.live_bytes -= nbytes

    def mark(self) -> int:
        """Start a new peak from the bytes alive now; returns them."""
        with self._lock:
            self._base, self.peak_bytes = self.live_bytes, 0
        return self._base

    @contextlib.contextmanager
    def paused(self):
        """Count nothing inside (a test's own read-backs through the package between steps, say)."""
        self._paused = True
        try:
            yield self
        finally:
            self._paused = False

    @property
    def syncs(self) -> int:
        return sum(self.counts.values())

    @property
    def sync_names(self) -> Dict[str, int]:
        return dict(self.sites)

    def take(self) -> Counter:
        """The syncs counted since the last take (by kind), and start counting afresh (launches too)."""
        with self._lock:
            counts, self.counts, self.sites, self.launches = self.counts, Counter(), Counter(), 0
        return counts

    def take_sites(self) -> Counter:
        """The syncs counted since the last take, by ``(file:line, kind)``, and start counting afresh."""
        with self._lock:
            sites, self.counts, self.sites, self.launches = self.sites, Counter(), Counter(), 0
        return sites
