"""Local gradient accumulation: a window of micro-steps is compressed and sent once, at its end.

ZeRO-3 reduce-scatters every micro-step's gradients, so with gradient accumulation over N micro-steps stock sends N
times per optimizer step. Under compression each send also pays the codec's error once, and the owners' step only
ever sees the window's sum. So, as DGC accumulates gradients locally until they are sent (Lin et al., ICLR 2018,
section 3.1) and as DeepSpeed's own ``engine.coalesce_grad_reduction()`` does for stock, each rank adds its
micro-steps' gradients up (:meth:`LocalAccumulation.hold`) and at the window's last micro-step, ZeRO-3's gradient
accumulation boundary, the sum goes through the method once (:meth:`LocalAccumulation.fold`): N times fewer bytes
and collectives. The sum is kept in ZeRO-3's gradient accumulation dtype (``data_types.grad_accum_dtype``; by
default the model's: fp32, or bf16 or fp16 on a half-precision engine), the precision stock ZeRO-3 accumulates its
gradient partitions in, and added into the last micro-step's gradient, each micro-step added to the ones before:
where that dtype is the gradients' own, the very sum autograd forms on the parameters under DeepSpeed's coalesced
reduction, bit for bit; with ``grad_accum_dtype`` fp32 on a half-precision engine, a more precise one, rounded to the
gradients' dtype once, at the end.

A parameter held in the window but without a gradient at its last micro-step (unused by the last micro-batch) is
sent at the end of that backward, after its buckets (:meth:`LocalAccumulation.leftovers`), as DeepSpeed's coalesced
flush sends every parameter with a gradient. Reentrant activation checkpointing changes nothing: DeepSpeed 0.19.8
queues its epilogue as autograd's callback, which runs once per backward, after every recomputed segment (tested
bit for bit against the coalesced reduction). (Where it cannot queue it, DeepSpeed ends a backward once per phase: a
parameter whose last gradient comes in a later phase is then sent in two parts, its held sum at the earlier phase's
end and its last gradient with its bucket; the owners add both, at the cost of a second send.)

The cost is memory: the window's sum is held until its end, the parameters' full size in the accumulation dtype (2
or 4 bytes per element; sending every micro-step staged the residuals or momenta in fp32 across the window, 4);
``"dgc": {"accumulate_locally": false}`` sends every micro-step instead.
"""

from typing import Dict, Hashable, List, Sequence, Tuple

import torch


def holds_windows(cfg, engine) -> bool:
    """Whether each rank holds a window's micro-steps and sends their sum once, at ZeRO-3's accumulation boundary:
    ``dgc.accumulate_locally`` with DeepSpeed's managed gradient accumulation (``engine``: a ``DeepSpeedEngine``, or
    :class:`~deepspeed_dgc.zero3.job.ConfigEngine` for a file)."""
    return bool(cfg.accumulate_locally and engine.managed_gradient_accumulation())


def sends_per_step(cfg, engine) -> int:
    """Compressed sends per optimizer step: 1 where the window is held (:func:`holds_windows`), else every micro-step,
    the engine's ``gradient_accumulation_steps``."""
    return 1 if holds_windows(cfg, engine) else engine.gradient_accumulation_steps()


class LocalAccumulation:
    """The gradients of the micro-steps of one accumulation window that were not sent yet, keyed like the residuals.

    Attributes:
        held: key -> the sum of this window's gradients so far (the accumulation dtype, the gradient's shape,
            multiplied by the loss scale as ZeRO-3's gradients are; views into one buffer per bucket).
        peak_bytes: the most ``held`` took at once, over the run (bytes).
    """

    def __init__(self):
        self.held: Dict[Hashable, torch.Tensor] = {}
        self.peak_bytes = 0
        self._bytes = 0  # of what is held now
        self._zeros: Dict[Tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.held)

    def hold(self, grads: Sequence[torch.Tensor], keys: Sequence[Hashable], dtype: torch.dtype = torch.float32) -> None:
        """Add a micro-step's gradients to the window's: one batched add for those held already, one batched copy
        into a new buffer for the rest (``grads`` may be views into ZeRO-3's bucket buffer, which the next bucket
        reuses).

        Args:
            grads: this micro-step's full gradients (fp32, bf16 or fp16, any shape), one per key.
            keys: their stable keys.
            dtype: of a new sum (ZeRO-3's ``gradient_accumulation_dtype``); one held already keeps its own.
        """
        old = [(self.held[k], g) for g, k in zip(grads, keys) if k in self.held]
        new = [(k, g) for g, k in zip(grads, keys) if k not in self.held]
        if old:
            torch._foreach_add_([h for h, _ in old], [g for _, g in old])
        if new:
            flat = torch.empty(sum(g.numel() for _, g in new), dtype=dtype, device=new[0][1].device)
            views = [v.view(g.shape) for v, (_, g) in zip(flat.split([g.numel() for _, g in new]), new)]
            torch._foreach_copy_(views, [g.detach() for _, g in new])
            self.held.update((k, v) for (k, _), v in zip(new, views))
            self._bytes += flat.numel() * flat.element_size()
        self.peak_bytes = max(self.peak_bytes, self._bytes)

    def fold(self, grads: Sequence[torch.Tensor], keys: Sequence[Hashable]) -> None:
        """At the window's end: add to each of ``grads`` (in place, in its dtype) what the window holds for its key,
        and let go of it. ``g + held`` equals ``held + g`` bit for bit, so where the sum is held in the gradients' dtype
        it is the one autograd forms when the gradients stay on the parameters (DeepSpeed's coalesced reduction)."""
        pairs = [(g, self._pop(k)) for g, k in zip(grads, keys) if k in self.held]
        if pairs:
            torch._foreach_add_([g for g, _ in pairs], [h for _, h in pairs])

    def leftovers(self) -> List[Hashable]:
        """Keys held whose parameter has not been sent at the window's end (no gradient in its last micro-step)."""
        return list(self.held)

    def take(self, key: Hashable) -> torch.Tensor:
        """The window's sum for ``key``, no longer held."""
        return self._pop(key)

    def _pop(self, key: Hashable) -> torch.Tensor:
        held = self.held.pop(key)
        self._bytes -= held.numel() * held.element_size()
        return held

    def clear(self) -> None:
        """Drop what is held (a checkpoint was loaded: the window it belonged to is gone, as stock's gradients)."""
        self.held.clear()
        self._bytes = 0

    def zeros(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A read-only zero tensor of ``numel`` elements (a view of one cached buffer per dtype and device): what a
        held micro-step hands ZeRO-3 as this rank's partitions, which ZeRO-3 copies or adds and never writes."""
        key = (torch.device(device), dtype)
        buf = self._zeros.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.zeros(max(numel, 1), dtype=dtype, device=device)
            self._zeros[key] = buf
        return buf.narrow(0, 0, numel)
