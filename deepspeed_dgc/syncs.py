"""Count the tensor calls of deepspeed_dgc's own code that make the host wait for the device.

On a GPU each of these calls reads device memory on the host, or copies host data into device memory
synchronously, so the host waits for every kernel queued before it and stops launching work: ``item``,
``tolist``, ``cpu``, ``numpy``, ``nonzero``, ``unique``, ``masked_select``, ``bool(t)``, ``int(t)``, ``float(t)``,
using a tensor as an index (``__index__``), indexing or assigning with a boolean mask, ``repeat_interleave``
with tensor repeats and no ``output_size``, and ``torch.tensor``/``torch.as_tensor`` of host data with a
``device``. On CPU tensors nothing waits, but the same calls are made, so a CPU run with
``"kernels": "reference"`` (the Python path every device runs) counts what a GPU run would wait for; on a GPU,
``torch.cuda.set_sync_debug_mode("error")`` is the truth.

Example::

    with HostSyncCounter() as syncs:
        for step in range(12):
            train_step()
            print(step, sum(syncs.take().values()))
"""

import os
import sys
import threading
from collections import Counter
from typing import Callable, Dict, Tuple

import torch

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep

TENSOR_METHODS = ("item", "tolist", "cpu", "numpy", "nonzero", "unique", "masked_select", "__bool__", "__int__",
                  "__float__", "__index__")
TORCH_FUNCTIONS = ("nonzero", "unique", "masked_select")


def _has_bool_mask(index) -> bool:
    items = index if isinstance(index, tuple) else (index, )
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


class HostSyncCounter:
    """A context manager that counts host-synchronising tensor calls made directly from deepspeed_dgc's code.

    Only calls whose calling frame is a file of the package count (DeepSpeed's and torch's own calls do not).
    Not thread-safe across counters: one at a time per process.

    Attributes:
        counts: call name -> calls since the last :meth:`take`.
        sites: ``(file:line, call name)`` -> calls since the last :meth:`take`.
    """

    def __init__(self, package_dir: str = PACKAGE_DIR):
        self.package_dir = package_dir
        self.counts: Counter = Counter()
        self.sites: Counter = Counter()
        self._saved: Dict[Tuple[object, str], Callable] = {}
        self._lock = threading.Lock()

    def _hit(self, name: str) -> None:
        frame = sys._getframe(2)
        if frame.f_code.co_filename.startswith(self.package_dir):
            with self._lock:
                self.counts[name] += 1
                self.sites[(f"{os.path.relpath(frame.f_code.co_filename, self.package_dir)}:{frame.f_lineno}",
                            name)] += 1

    def _wrap(self, owner, attr: str, name: str, when: Callable = None) -> None:
        original = getattr(owner, attr)
        self._saved[(owner, attr)] = original
        counter = self

        def wrapper(*args, **kwargs):
            if when is None or when(*args, **kwargs):
                counter._hit(name)
            return original(*args, **kwargs)

        setattr(owner, attr, wrapper)

    def __enter__(self) -> "HostSyncCounter":
        for m in TENSOR_METHODS:
            self._wrap(torch.Tensor, m, m)
        self._wrap(torch.Tensor, "__getitem__", "bool-mask index", lambda t, index: _has_bool_mask(index))
        self._wrap(torch.Tensor, "__setitem__", "bool-mask assign", lambda t, index, value: _has_bool_mask(index))
        for f in TORCH_FUNCTIONS:
            self._wrap(torch, f, f)
        for owner in (torch, torch.Tensor):
            self._wrap(owner, "repeat_interleave", "repeat_interleave",
                       lambda x, repeats=None, *a, **kw: isinstance(repeats, torch.Tensor) and kw.get("output_size") is
                       None)
        for f in ("tensor", "as_tensor"):
            self._wrap(torch, f, f"torch.{f}(host data, device)",
                       lambda data, *a, **kw: kw.get("device") is not None and not isinstance(data, torch.Tensor))
        return self

    def __exit__(self, *exc) -> None:
        for (owner, attr), original in self._saved.items():
            setattr(owner, attr, original)
        self._saved = {}

    def take(self) -> Counter:
        """The calls counted since the last take (by call name), and start counting afresh."""
        with self._lock:
            counts, self.counts, self.sites = self.counts, Counter(), Counter()
        return counts

    def take_sites(self) -> Counter:
        """The calls counted since the last take, by ``(file:line, call name)``, and start counting afresh."""
        with self._lock:
            sites, self.counts, self.sites = self.sites, Counter(), Counter()
        return sites
