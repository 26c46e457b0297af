"""Error feedback: residuals keyed by parameter, with staged commit and rollback.

GRACE's Memory role (Xu et al., ICDCS 2021). Error feedback (Seide et al., Interspeech 2014;
Lin et al., ICLR 2018, section 2) adds what a rank did not send last time to what it sends
now, so nothing is lost, only delayed. ZeRO-3 reduces on every micro-step and skips steps
whose gradients overflowed, so updates are staged for the whole accumulation window and
committed only after a step that was applied; a skipped step leaves the residuals as they were.
Residuals are kept unscaled (divided by the fp16 loss scale) so a loss-scale change between
steps does not rescale them by mistake.
"""

from typing import Dict, Hashable, Optional

import torch

from ..codec.formats import dequantize_weights

# bytes per element of each storage dtype of committed residuals (fp8: one code plus an fp32 scale per 128)
RESIDUAL_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp8": 1.0 + 4.0 / 128}
FP8_RESIDUAL_GROUP = 128


class ErrorFeedback:
    """Per-parameter residuals (the full unpartitioned gradient shape, flattened), staged as fp32.

    Keys are opaque and hashable: the caller's stable identity of a parameter (the same on every rank and in
    every process that builds the same model). Committed residuals are stored in
    ``storage``: ``"fp32"`` (4 bytes per element), ``"bf16"`` (2 bytes, relative rounding error
    <= 2^-8) or ``"fp8"`` (e4m3 codes with an fp32 absmax scale per 128 elements, about 1.03 bytes;
    relative error <= 2^-4, values below ``absmax * 2^-9 / 448`` of their group flush to zero), as
    LoCo's 8-bit error-compensation buffer (Xie et al., arXiv 2407.04480, section 3). The rounding
    error of the storage itself is not fed back. During a backward pass the staged fp32 copies
    add up to 4 bytes per element.

    With ``offload``, committed residuals live in pinned host memory (DeepSpeed's accelerator
    ``pin_memory``; one buffer per key, allocated once and overwritten at each commit): each commit
    copies the encoded residual there asynchronously on the current stream, and :meth:`get` copies it
    back to the device the residuals were staged on, also asynchronously. DeepSpeed's ZeRO-3 orders
    the two (its reduce stream waits for the current stream before a bucket, and is synchronized
    before the step that commits). Between steps the device holds no residual; during a backward the
    staged fp32 ones live there until the commit. On the CPU accelerator host and device are the
    same memory and pinning is a no-op.

    Args:
        storage: ``"fp32"``, ``"bf16"`` or ``"fp8"``.
        offload: keep committed residuals in pinned host memory.

    Raises:
        ValueError: unknown storage.
    """

    def __init__(self, storage: str = "fp32", offload: bool = False, kernels: str = "auto"):
        if storage not in RESIDUAL_BYTES:
            raise ValueError(f"unknown residual storage {storage!r}; allowed: {', '.join(RESIDUAL_BYTES)}")
        self.storage = storage
        self.offload = offload
        self.kernels = kernels  # who codes fp8 residuals (``dgc.kernels``): the fused op or the reference, same bits
        self._ops = {}
        self.device = None  # where staged residuals live (the gradients' device); offload copies back there
        self.committed: Dict[Hashable, object] = {}  # fp32/bf16 tensor, or (codes, scales) for fp8
        # fp32 while the window goes on; in the storage form when staged at the window's last micro-step (final)
        self.staged: Dict[Hashable, object] = {}
        # set by the caller: the next stages end the accumulation window (ZeRO-3's gradient accumulation boundary),
        # so they are stored in the storage form at once and no fp32 copy is held until the commit
        self.final = False
        # the most this memory held (committed + staged), updated at every stage; and the counts behind it
        self.peak_bytes = 0
        self._committed_nbytes = self._staged_nbytes = 0

    def _encode(self, r: torch.Tensor):
        if self.storage == "fp32":
            return r
        if self.storage == "bf16":
            return r.to(torch.bfloat16)
        return self._codec(r.device.type).quantize_weights(r, "fp8_e4m3", FP8_RESIDUAL_GROUP)

    def _codec(self, device_type: str):
        """The ops that code fp8 residuals on ``device_type`` (:func:`~deepspeed_dgc.codec.kernels.get_ops`)."""
        if device_type not in self._ops:
            from ..codec.kernels import get_ops
            self._ops[device_type] = get_ops(self.kernels, device_type, True)
        return self._ops[device_type]

    @staticmethod
    def decode(stored) -> torch.Tensor:
        """A stored or exported residual (:meth:`export`) of any storage decoded to fp32, shape ``(numel,)``."""
        if isinstance(stored, tuple):
            codes, scales = stored
            return dequantize_weights(codes, scales, codes.numel(), "fp8_e4m3", FP8_RESIDUAL_GROUP)
        return stored.float()

    @staticmethod
    def _parts(stored) -> tuple:
        """The tensors of a stored residual: ``(codes, scales)`` for fp8, else the one tensor."""
        return stored if isinstance(stored, tuple) else (stored, )

    @staticmethod
    def _map(stored, fn):
        """``fn`` applied to each tensor of a stored residual, in the same form (pair or tensor)."""
        return tuple(fn(t) for t in stored) if isinstance(stored, tuple) else fn(stored)

    def _to_host(self, key: Hashable, encoded):
        """``encoded`` copied into ``key``'s pinned host buffers (reused when shapes and dtypes match)."""
        from deepspeed.accelerator import get_accelerator
        old = self.committed.get(key)
        old_parts = () if old is None else self._parts(old)
        out = []
        for i, part in enumerate(self._parts(encoded)):
            buf = old_parts[i] if i < len(old_parts) else None
            if buf is None or buf.shape != part.shape or buf.dtype != part.dtype:
                buf = get_accelerator().pin_memory(torch.empty(part.shape, dtype=part.dtype, device="cpu"))
            if part.is_cuda:  # made on the reduce stream, read here: not reused before the copy is done
                part.record_stream(torch.cuda.current_stream(part.device))
            out.append(buf.copy_(part, non_blocking=True))
        return tuple(out) if isinstance(encoded, tuple) else out[0]

    def _is_stored_form(self, value) -> bool:
        """Whether a staged value is already in the storage form (staged at the window's end), not fp32."""
        return isinstance(value, tuple) or (self.storage != "fp32" and value.dtype != torch.float32)

    def _store(self, key: Hashable, residual):
        """The committed form of a staged residual (fp32, or already encoded): encoded, and on the host with
        ``offload``."""
        encoded = residual if self._is_stored_form(residual) else self._encode(residual)
        self.device = self._parts(encoded)[0].device
        return self._to_host(key, encoded) if self.offload else encoded

    def _fetch(self, stored) -> torch.Tensor:
        """A committed residual decoded to fp32 on the device (copied from the host with ``offload``)."""
        if self.offload and self.device is not None:
            stored = self._map(stored, lambda t: t.to(self.device, non_blocking=True))
        return self._decoded(stored)

    def _decoded(self, stored) -> torch.Tensor:
        """A residual in the storage form, where it lies, decoded to fp32."""
        if not isinstance(stored, tuple):
            return stored.float()
        codes, scales = stored
        out = torch.empty(codes.numel(), dtype=torch.float32, device=codes.device)
        self._codec(codes.device.type).dequantize_weights_into(out, codes, scales, "fp8_e4m3", FP8_RESIDUAL_GROUP)
        return out

    @staticmethod
    def _nbytes(stored) -> int:
        return sum(t.numel() * t.element_size() for t in ErrorFeedback._parts(stored))

    def export(self) -> Dict[Hashable, object]:
        """The committed residuals in their storage form, on the CPU (for a checkpoint): fp32 or bf16 tensors,
        or ``(codes, scales)`` pairs for fp8; :meth:`restore` puts them back bit for bit."""
        if self.offload and self.device is not None and self.device.type != "cpu":
            from deepspeed.accelerator import get_accelerator
            get_accelerator().synchronize()  # the last commit's copies into the host buffers are done
        return {k: self._map(v, lambda t: t.cpu()) for k, v in self.committed.items()}

    def restore(self, stored: Dict[Hashable, object], storage: str, device) -> None:
        """Replace all state by residuals exported by a memory of ``storage``: as they were when the storage is
        this one's (so a resumed run continues bit-identically), else decoded and stored again."""
        if storage != self.storage:
            self.load({k: self.decode(v).to(device) for k, v in stored.items()})
            return
        self.committed, self.staged, self.device = {}, {}, torch.device(device)
        for k, v in stored.items():
            moved = self._map(v, lambda t: t.to(device))
            self.committed[k] = self._to_host(k, moved) if self.offload else moved
        self._recount()

    def residuals(self) -> Dict[Hashable, torch.Tensor]:
        """Every committed residual decoded to fp32 (new tensors), by key."""
        return {k: self._fetch(v) for k, v in self.committed.items()}

    def load(self, residuals: Dict[Hashable, torch.Tensor]) -> None:
        """Replace all state by these fp32 residuals (stored in ``storage``); nothing staged."""
        self.committed, self.staged = {}, {}
        for k, v in residuals.items():
            self.committed[k] = self._store(k, v.float())
        self._recount()

    def get(self, key: Hashable) -> Optional[torch.Tensor]:
        """The latest residual of ``key`` (staged in this window if any, else committed), unscaled.

        Returns:
            fp32 tensor of shape ``(numel,)`` or None when the parameter has no residual yet.
        """
        r = self.staged.get(key)
        if r is not None:
            return self._decoded(r) if self._is_stored_form(r) else r
        stored = self.committed.get(key)
        return None if stored is None else self._fetch(stored)

    def committed_value(self, key: Hashable) -> Optional[torch.Tensor]:
        """The residual of ``key`` as of the last commit (ignoring this window's staged one), fp32, or None."""
        stored = self.committed.get(key)
        return None if stored is None else self._fetch(stored)

    def stage(self, key: Hashable, residual: torch.Tensor) -> None:
        """Record ``residual`` (fp32, unscaled, shape ``(numel,)``) for commit after the step; with :attr:`final`
        (the window's last micro-step) in the storage form at once: the same bits the commit would store, without
        an fp32 copy of every residual held until then."""
        value = self._encode(residual) if self.final and self.storage != "fp32" else residual
        old = self.staged.get(key)
        self._staged_nbytes += self._nbytes(value) - (0 if old is None else self._nbytes(old))
        self.staged[key] = value
        self.peak_bytes = max(self.peak_bytes, self._committed_nbytes + self._staged_nbytes)

    def _recount(self) -> None:
        """The byte counts behind :attr:`peak_bytes`, after the committed or staged sets changed."""
        self._committed_nbytes, self._staged_nbytes = self.state_bytes(), self.staged_bytes()

    def commit(self) -> None:
        """The step was applied: staged residuals become the committed ones."""
        for k, v in self.staged.items():
            self.committed[k] = self._store(k, v)
        self.staged = {}
        self._recount()

    def rollback(self) -> None:
        """The step was skipped (overflow): forget this window's residual updates."""
        self.staged = {}
        self._recount()

    def clear(self) -> None:
        """Forget every residual, committed and staged (a new phase of training, or state that cannot be loaded)."""
        self.committed, self.staged = {}, {}
        self._recount()

    def drop(self, keys) -> None:
        """Forget the residuals of these keys (parameters that no longer train)."""
        for k in keys:
            self.committed.pop(k, None)
            self.staged.pop(k, None)
        self._recount()

    def __len__(self) -> int:
        """Number of committed residuals."""
        return len(self.committed)


    def residual_norm(self) -> float:
        """L2 norm over all committed residuals (unscaled gradient units); one pass over them."""
        if not self.committed:
            return 0.0
        sq = None
        for stored in self.committed.values():  # one decoded residual at a time, summed on the device
            r = self._fetch(stored)
            d = torch.dot(r, r).double()
            sq = d if sq is None else sq + d.to(sq.device)
        return float(sq)**0.5  # one read-back

    def state_bytes(self) -> int:
        """Bytes held between steps by committed residuals (in host memory with ``offload``)."""
        return sum(self._nbytes(v) for v in self.committed.values())

    def staged_bytes(self) -> int:
        """Bytes of this window's staged residuals (held beside the committed ones until the commit)."""
        return sum(self._nbytes(v) for v in self.staged.values())

    def host_state_bytes(self) -> int:
        """Bytes of committed residuals in host memory: all of them with ``offload``, else 0."""
        return self.state_bytes() if self.offload else 0
