"""Copies of state between the device and pinned host memory, off the compute path.

A state kept on the host between steps (``residual_offload``, ``decoupled_momentum.offload``) is read once per step,
when its bucket is reduced, and written once, when the bucket's new state is staged at the window's last micro-step.
:class:`HostCopies` runs both copies beside the backward pass instead of on its path:

- on a GPU on a side stream of its own: a write-back waits (an event) for the stream that made the state, a fetch is
  issued while the bucket before it is being reduced (the buckets come in the same order every step), and the reduce
  stream waits for it only where it uses it;
- on the CPU accelerator on one worker thread (torch's copies release the GIL); there device and host are the same
  memory, so the copy is the whole cost of offload and nothing is saved.

Both keep their copies in order (one stream, one thread), so a fetch never reads a host buffer before the write-back
into it is done. :meth:`wait` waits for every copy (before a checkpoint reads the host buffers).
"""

import concurrent.futures
from typing import Dict, Hashable, List, Sequence, Tuple

import torch


def pinned_like(t: torch.Tensor) -> torch.Tensor:
    """An uninitialised host tensor of ``t``'s shape and dtype, pinned where the accelerator pins
    (DeepSpeed's ``pin_memory``; a no-op on the CPU accelerator)."""
    from deepspeed.accelerator import get_accelerator
    return get_accelerator().pin_memory(torch.empty(t.shape, dtype=t.dtype, device="cpu"))


class HostCopies:
    """Asynchronous copies of tensors to and from pinned host memory, in issue order (see the module docstring).

    Args:
        device: the device the state is used on.
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._pool = None if self.cuda else concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dgc-offload")
        self._futures: List[concurrent.futures.Future] = []
        self._fetches: Dict[Hashable, Tuple[Tuple[torch.Tensor, ...], object]] = {}

    def write_back(self, parts: Sequence[torch.Tensor], host: Sequence[torch.Tensor]) -> None:
        """Copy device ``parts`` into the host buffers ``host`` (same shapes and dtypes) after the current stream's
        work that made them; ``parts`` must not be changed afterwards (their memory is kept until the copy is done)."""
        if self.cuda:
            made = torch.cuda.current_stream(self.device).record_event()
            self._stream.wait_event(made)
            with torch.cuda.stream(self._stream):
                for p, h in zip(parts, host):
                    h.copy_(p, non_blocking=True)
                    p.record_stream(self._stream)
        else:
            self._futures.append(self._pool.submit(_copy_all, tuple(parts), tuple(host)))

    def prefetch(self, key: Hashable, host: Sequence[torch.Tensor]) -> None:
        """Start copying the host buffers ``host`` to the device, to be taken by :meth:`fetch` of ``key``."""
        if key in self._fetches:
            return
        if self.cuda:
            with torch.cuda.stream(self._stream):
                dev = tuple(h.to(self.device, non_blocking=True) for h in host)
                done = self._stream.record_event()
            self._fetches[key] = (dev, done)
        else:
            dev = tuple(torch.empty_like(h) for h in host)
            self._fetches[key] = (dev, self._pool.submit(_copy_all, tuple(host), dev))

    def fetch(self, key: Hashable, host: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, ...]:
        """``host`` on the device, ready to use on the current stream: the prefetched copy of ``key`` where one was
        started, else copied now."""
        self.prefetch(key, host)
        dev, done = self._fetches.pop(key)
        if self.cuda:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(done)
            for t in dev:
                t.record_stream(current)
        else:
            done.result()
        return dev

    def drop_prefetch(self, key: Hashable) -> None:
        """Forget a started fetch of ``key`` (its host buffers are about to change)."""
        entry = self._fetches.pop(key, None)
        if entry is not None and not self.cuda:
            entry[1].result()

    def pending(self) -> List[Hashable]:
        """Keys whose fetch was started and not yet taken."""
        return list(self._fetches)

    def wait(self) -> None:
        """Every copy issued so far is done (the host buffers hold what was written back)."""
        if self.cuda:
            self._stream.synchronize()
        else:
            for f in self._futures:
                f.result()
            self._futures = []


def _copy_all(src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor]) -> None:
    for s, d in zip(src, dst):
        d.copy_(s)
