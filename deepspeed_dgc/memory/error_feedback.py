"""Error feedback: residuals keyed by parameter, with staged commit and rollback.

GRACE's Memory role (Xu et al., ICDCS 2021). Error feedback (Seide et al., Interspeech 2014;
Lin et al., ICLR 2018, section 2) adds what a rank did not send last time to what it sends
now, so nothing is lost, only delayed. ZeRO-3 reduces on every micro-step and skips steps
whose gradients overflowed, so updates are staged for the whole accumulation window and
committed only after a step that was applied; a skipped step leaves the residuals as they were.
Residuals are kept unscaled (divided by the fp16 loss scale) so a loss-scale change between
steps does not rescale them by mistake.
"""

from dataclasses import dataclass
from typing import Dict, Hashable, List, Optional, Sequence, Tuple

import torch

from ..codec.formats import FP8_MAX, dequantize_weights
from ..codec.layout import BucketLayout, Workspace, slabs
from . import int8_storage as i8
from .offload import HostCopies, pinned_like

# bytes per element of each storage dtype of committed residuals (fp8: one code plus an fp32 scale per 128; int8: one
# code plus a bf16 scale per 64, stochastically rounded, :mod:`.int8_storage`)
RESIDUAL_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp8": 1.0 + 4.0 / 128, "int8": i8.INT8_BYTES}
FP8_RESIDUAL_GROUP = 128


@dataclass
class Block:
    """One bucket's residuals (or momenta) as a padded owner matrix (:class:`~deepspeed_dgc.codec.layout.BucketLayout`)
    in the storage form: ``parts`` is the fp32 or bf16 ``(R, C)`` matrix, or for fp8 its e4m3 codes (uint8 ``(R, C)``)
    and an fp32 absmax scale per 128 columns of a row (``(R, C / 128)``; blocks are aligned to 128, so a group never
    spans two tensors), or for int8 its codes (int8 ``(R, C)``) and a bf16 scale per ``g`` columns (``(R, C / g)``,
    ``g = int8_storage.group_for(layout.align)``). ``numels``: elements of each key's residual (``n_i``, or ``R c_i`` on the hierarchical
    topology), in the layout's tensor order. ``host``: the parts are pinned host buffers (``offload``), copied there
    by :class:`~deepspeed_dgc.memory.offload.HostCopies` (perhaps still in flight)."""
    layout: BucketLayout
    keys: Tuple[Hashable, ...]
    numels: Tuple[int, ...]
    parts: Tuple[torch.Tensor, ...]
    host: bool = False

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts)


class ErrorFeedback:
    """Per-parameter residuals (the full unpartitioned gradient shape, flattened), staged as fp32.

    Keys are opaque and hashable: the caller's stable identity of a parameter (the same on every rank and in
    every process that builds the same model). Committed residuals are stored in
    ``storage``: ``"fp32"`` (4 bytes per element), ``"bf16"`` (2 bytes, relative rounding error
    <= 2^-8), ``"fp8"`` (e4m3 codes with an fp32 absmax scale per 128 elements, about 1.03 bytes;
    relative error <= 2^-4, values below ``absmax * 2^-9 / 448`` of their group flush to zero), as
    LoCo's 8-bit error-compensation buffer (Xie et al., arXiv 2407.04480, section 3), or ``"int8"``
    (int8 codes with a bf16 absmax scale per 64, 1.03 bytes, stochastically rounded so that the stored
    value is unbiased: :mod:`.int8_storage`; its noise is seeded by :attr:`round_seed`, which the owner
    sets per step, so a resumed run draws the same). The rounding error of the storage itself is not
    fed back. During a backward pass the staged fp32 copies
    add up to 4 bytes per element.

    With ``offload``, committed residuals live in pinned host memory. A bucket's block (the fixed
    layout) is written back when it is staged at the window's last micro-step, into a second host
    buffer (the committed one stays for a rollback), and fetched ahead of its bucket: the first
    bucket right after the commit (during the next forward), each next one while the one before is
    reduced; both copies run beside the backward (:class:`~deepspeed_dgc.memory.offload.HostCopies`:
    a side stream on a GPU, a thread on the CPU), and the host holds two buffers per block. A
    residual kept per key (the exact layout) lives in pinned host memory (DeepSpeed's accelerator
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
        self.round_seed: Tuple = (0, )  # int8's rounding noise: seeded by this and the key (the owner sets it per step)
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
        # bucket-level state (the fixed layout and the fixed-size codecs): bucket keys -> Block
        self.blocks: Dict[Tuple[Hashable, ...], Block] = {}
        self.staged_blocks: Dict[Tuple[Hashable, ...], Block] = {}
        # offload of blocks: the copies, the second host buffers per bucket, and the buckets' order (this step's, last)
        self._copies: Optional[HostCopies] = None
        self._memo: Optional[Dict[int, Tuple[Block, torch.Tensor]]] = None  # get_many's decoded blocks
        self._spare: Dict[Tuple[Hashable, ...], Tuple[torch.Tensor, ...]] = {}
        self._order: List[Tuple[Hashable, ...]] = []
        self._last_order: List[Tuple[Hashable, ...]] = []

    def _encode(self, r: torch.Tensor, key: Hashable):
        if self.storage == "fp32":
            return r
        if self.storage == "bf16":
            return r.to(torch.bfloat16)
        if self.storage == "int8":
            return i8.encode_flat(r, self._seed(key))
        return self._codec(r.device.type).quantize_weights(r, "fp8_e4m3", FP8_RESIDUAL_GROUP)

    def _seed(self, ident) -> int:
        """The int8 rounding noise's seed for a key or a bucket's keys at this step (:attr:`round_seed`)."""
        return i8.round_seed(*self.round_seed, ident)

    def _encode_block_(self, A: torch.Tensor, layout: BucketLayout, bkey,
                       ws: Optional[Workspace] = None) -> Tuple[torch.Tensor, ...]:
        """A block's fp32 ``(R, C)`` matrix in the (non-fp32) storage form; ``A`` may be overwritten; ``ws``: dead
        memory for int8's noise."""
        if self.storage == "bf16":
            return (A.to(torch.bfloat16), )
        if self.storage == "int8":
            return i8.encode_(A, i8.group_for(layout.align), self._seed(bkey), ws)
        return _fp8_encode_(A)

    def _codec(self, device_type: str):
        """The ops that code fp8 residuals on ``device_type`` (:func:`~deepspeed_dgc.codec.kernels.get_ops`)."""
        if device_type not in self._ops:
            from ..codec.kernels import get_ops
            self._ops[device_type] = get_ops(self.kernels, device_type, True)
        return self._ops[device_type]

    @staticmethod
    def decode(stored) -> torch.Tensor:
        """A stored or exported residual (:meth:`export`) of any storage decoded to fp32, shape ``(numel,)``."""
        if isinstance(stored, dict):
            return _decode_piece(stored)
        if isinstance(stored, tuple):
            codes, scales = stored
            if codes.dtype == torch.int8:
                return i8.decode_flat(codes, scales)
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
        encoded = residual if self._is_stored_form(residual) else self._encode(residual, key)
        self.device = self._parts(encoded)[0].device
        return self._to_host(key, encoded) if self.offload else encoded

    def _fetch(self, stored) -> torch.Tensor:
        """A committed residual decoded to fp32 on the device (copied from the host with ``offload``)."""
        if isinstance(stored, dict):
            return _decode_piece(stored)
        if self.offload and self.device is not None:
            stored = self._map(stored, lambda t: t.to(self.device, non_blocking=True))
        return self._decoded(stored)

    def _decoded(self, stored) -> torch.Tensor:
        """A residual in the storage form, where it lies, decoded to fp32."""
        if isinstance(stored, dict):
            return _decode_piece(stored)
        if not isinstance(stored, tuple):
            return stored.float()
        codes, scales = stored
        if codes.dtype == torch.int8:
            return i8.decode_flat(codes, scales)
        out = torch.empty(codes.numel(), dtype=torch.float32, device=codes.device)
        self._codec(codes.device.type).dequantize_weights_into(out, codes, scales, "fp8_e4m3", FP8_RESIDUAL_GROUP)
        return out

    @staticmethod
    def _nbytes(stored) -> int:
        if isinstance(stored, dict):
            return sum(t.numel() * t.element_size() for t in stored.values() if torch.is_tensor(t))
        return sum(t.numel() * t.element_size() for t in ErrorFeedback._parts(stored))

    def export(self) -> Dict[Hashable, object]:
        """The committed residuals in their storage form, on the CPU (for a checkpoint), by key: fp32 or bf16 tensors,
        ``(codes, scales)`` pairs for fp8; a key kept in a bucket's block (:meth:`add_block`) as its flat residual
        (fp32, bf16), or for fp8 as a dict of its block's columns (``{"codes", "scales", "chunk", "numel"}``).
        :meth:`restore` puts them back bit for bit."""
        self._settle()
        if self.offload and self.device is not None and self.device.type != "cpu":
            from deepspeed.accelerator import get_accelerator
            get_accelerator().synchronize()  # the last commit's copies into the host buffers are done
        out = {k: self._map(v, lambda t: t.cpu()) if not isinstance(v, dict) else
               {n: (t.cpu() if torch.is_tensor(t) else t) for n, t in v.items()} for k, v in self.committed.items()}
        for block in self.blocks.values():
            out.update(_block_pieces(block))
        return out

    def restore(self, stored: Dict[Hashable, object], storage: str, device) -> None:
        """Replace all state by residuals exported by a memory of ``storage``: as they were when the storage is
        this one's (so a resumed run continues bit-identically), else decoded and stored again."""
        if storage != self.storage:
            self.load({k: self.decode(v).to(device) for k, v in stored.items()})
            return
        self.clear()
        self.device = torch.device(device)
        for k, v in stored.items():
            if isinstance(v, dict):  # a block's columns: assembled into its block when the bucket comes (add_block)
                self.committed[k] = {n: (t.to(device) if torch.is_tensor(t) else t) for n, t in v.items()}
                continue
            moved = self._map(v, lambda t: t.to(device))
            self.committed[k] = self._to_host(k, moved) if self.offload else moved
        self._recount()

    def residuals(self) -> Dict[Hashable, torch.Tensor]:
        """Every committed residual decoded to fp32 (new tensors), by key."""
        out = {k: self._fetch(v) for k, v in self.committed.items()}
        for block in self.blocks.values():
            matrix = self._block_matrix(block)
            for i, (key, n) in enumerate(zip(block.keys, block.numels)):
                out[key] = block.layout.flat_of(matrix, i, n)
        return out

    def load(self, residuals: Dict[Hashable, torch.Tensor]) -> None:
        """Replace all state by these fp32 residuals (stored in ``storage``); nothing staged."""
        self.clear()
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
        found = self._in_block(key, staged=True)
        if found is not None:
            return found
        return self.committed_value(key)

    def flush(self, keys: Sequence[Hashable]) -> Dict[Hashable, torch.Tensor]:
        """What a bucket sent whole takes along: the latest residual of each of ``keys`` (as :meth:`get`: fp32 flat,
        unscaled; keys without one left out), and zero staged in its place (committed if the step is applied, so a
        skipped step keeps the old ones). A bucket's block is decoded once and staged as one zero block."""
        wanted, out = set(keys), {}
        for bkey in list(dict.fromkeys(list(self.staged_blocks) + list(self.blocks))):
            if not set(bkey) <= wanted:
                continue
            block = self.staged_blocks.get(bkey) or self.blocks[bkey]
            matrix = self._block_matrix(block)
            for i, k in enumerate(block.keys):
                out[k] = block.layout.flat_of(matrix, i, block.numels[i])
            self.stage_block(block.keys, block.numels, block.layout, matrix.zero_())
        for k in keys:
            if k not in out:
                value = self.get(k)
                if value is not None:
                    out[k] = value
                    self.stage(k, torch.zeros_like(value, dtype=torch.float32))
        return out

    def committed_value(self, key: Hashable) -> Optional[torch.Tensor]:
        """The residual of ``key`` as of the last commit (ignoring this window's staged one), fp32, or None."""
        stored = self.committed.get(key)
        if stored is not None:
            return self._fetch(stored)
        return self._in_block(key, staged=False)

    def stage(self, key: Hashable, residual: torch.Tensor) -> None:
        """Record ``residual`` (fp32, unscaled, shape ``(numel,)``) for commit after the step; with :attr:`final`
        (the window's last micro-step) in the storage form at once: the same bits the commit would store, without
        an fp32 copy of every residual held until then. A key kept in a bucket's block is written into it."""
        block = self._block_with(key)
        if block is not None:
            matrix = self._block_matrix(self.staged_blocks.get(_bucket(block), block)).clone()
            block.layout.place(matrix, block.keys.index(key), residual.float())
            self.stage_block(block.keys, block.numels, block.layout, matrix)
            return
        value = self._encode(residual, key) if self.final and self.storage != "fp32" else residual
        old = self.staged.get(key)
        self._staged_nbytes += self._nbytes(value) - (0 if old is None else self._nbytes(old))
        self.staged[key] = value
        self.peak_bytes = max(self.peak_bytes, self._committed_nbytes + self._staged_nbytes)

    # ---- bucket blocks ----------------------------------------------------------------------------------------

    def add_block(self, keys: Sequence[Hashable], numels: Sequence[int], layout: BucketLayout, A: torch.Tensor,
                  ws: Optional[Workspace] = None, scale: Optional[float] = None) -> bool:
        """``A += `` the bucket's latest residuals (staged in this window, else committed; times ``scale`` where
        given, rounded once in fp32), in one pass over the bucket's block whatever its tensors.

        Args:
            keys: the bucket's keys (in ``layout``'s tensor order); numels: each key's residual length.
            layout: the padded owner matrix of ``A`` ``(R, C)`` (fp32 or bf16, padding 0); ws: memory for a decoded
                copy.

        Returns:
            Whether there was anything to add. Residuals kept per key (from the exact layout or an older checkpoint)
            or in another layout are moved into this bucket's block first (decoded and stored again once, unless
            they are this layout's columns in this storage).
        """
        bkey = tuple(keys)
        block = self.staged_blocks.get(bkey) or self.blocks.get(bkey)
        if block is None or block.layout.key != layout.key:
            block = self._adopt(bkey, numels, layout, A.device)
            if block is None:
                return False
        parts = self._fetch_block(bkey, block, A.device) if block.host else block.parts
        if parts[0].dtype == torch.float32 and scale is None:
            A.add_(parts[0])
            return True
        ws = ws or Workspace()
        R, C = A.shape
        unit = C // parts[1].shape[1] if len(parts) == 2 else 1  # fp8 and int8 blocks decode in whole scale groups
        for u0, u1 in slabs(C // unit, R * unit * 4, ws):  # decoded a slab at a time into the dead memory
            c0, c1 = u0 * unit, u1 * unit
            mark = ws.mark()
            tmp = ws.take((R, c1 - c0), torch.float32, A.device)
            if parts[0].dtype == torch.float32:
                torch.mul(parts[0][:, c0:c1], scale, out=tmp)
            else:
                if parts[0].dtype == torch.int8:
                    i8.decode_into(tmp, parts[0][:, c0:c1], parts[1][:, u0:u1])
                elif len(parts) == 1:
                    tmp.copy_(parts[0][:, c0:c1])
                else:
                    tmp.copy_(parts[0][:, c0:c1].view(torch.float8_e4m3fn))
                    tmp.view(R, -1, FP8_RESIDUAL_GROUP).mul_(parts[1][:, u0:u1, None])
                if scale is not None:
                    tmp.mul_(scale)
            A[:, c0:c1].add_(tmp)
            ws.release(mark)
        return True

    def stage_block(self, keys: Sequence[Hashable], numels: Sequence[int], layout: BucketLayout,
                    A: torch.Tensor, ws: Optional[Workspace] = None) -> bool:
        """Stage ``A`` (fp32, or bf16 where the storage is not fp32, ``(R, C)``, padding 0, unscaled) as the bucket's
        residuals for commit after the step (``ws``: dead memory for the encoding's temporaries).

        Returns:
            True when the store now holds ``A`` itself (fp32 storage, bf16 storage of a bf16 ``A``, or any storage
            before the window's last micro-step); False when ``A`` was encoded into the storage form, in place (its
            memory is then free).
        """
        bkey = tuple(keys)
        if not self.final or self._as_stored(A):
            parts, held = (A, ), True
        else:
            parts, held = self._encode_block_(A, layout, bkey, ws), False
        block = Block(layout, bkey, tuple(int(n) for n in numels), parts)
        if self.offload and self.final:  # the window's state: written back now, beside the rest of the backward
            block = self._write_back(bkey, block)
        old = self.staged_blocks.get(bkey)
        self._staged_nbytes += block.nbytes - (0 if old is None else old.nbytes)
        self.staged_blocks[bkey] = block
        self.peak_bytes = max(self.peak_bytes, self._committed_nbytes + self._staged_nbytes)
        return held

    def _as_stored(self, matrix: torch.Tensor) -> bool:
        """Whether a block's one matrix is already its storage form (fp32 storage, or bf16 storage of a bf16 matrix)."""
        return self.storage == "fp32" or (self.storage == "bf16" and matrix.dtype == torch.bfloat16)

    def _block_matrix(self, block: Block) -> torch.Tensor:
        """A block decoded to fp32 ``(R, C)`` (a new tensor, where it lies; an offloaded block on the device it is used
        on, copied there after the write-backs issued before, without a host wait). Memoized inside :meth:`get_many`."""
        memo = self._memo
        if memo is not None and id(block) in memo:
            return memo[id(block)][1]
        parts = block.parts
        if block.host:
            if self.device is not None and self.device.type == "cuda":
                parts = self._host_copies(self.device).fetch(("read", id(parts[0])), parts)
            else:
                self._settle()
        matrix = self._decoded_block(parts)
        if memo is not None:
            memo[id(block)] = (block, matrix)  # the block too: its id stays its own while it is held here
        return matrix

    def get_many(self, keys: Sequence[Hashable]) -> List[Optional[torch.Tensor]]:
        """:meth:`get` of every key of ``keys``, each bucket block decoded once for all its keys (not once a key)."""
        self._memo = {}
        try:
            return [self.get(k) for k in keys]
        finally:
            self._memo = None

    @staticmethod
    def _decoded_block(parts: Tuple[torch.Tensor, ...]) -> torch.Tensor:
        if len(parts) == 1:
            return parts[0].float().clone() if parts[0].dtype == torch.float32 else parts[0].float()
        if parts[0].dtype == torch.int8:
            return i8.decode(parts[0], parts[1].to(parts[0].device))
        R, C = parts[0].shape
        out = parts[0].view(torch.float8_e4m3fn).float()
        out.view(R, C // FP8_RESIDUAL_GROUP, FP8_RESIDUAL_GROUP).mul_(parts[1][..., None].to(out.device))
        return out

    def _block_with(self, key: Hashable) -> Optional[Block]:
        for blocks in (self.staged_blocks, self.blocks):
            for block in blocks.values():
                if key in block.keys:
                    return block
        return None

    def _in_block(self, key: Hashable, staged: bool) -> Optional[torch.Tensor]:
        for blocks in ((self.staged_blocks, self.blocks) if staged else (self.blocks, )):
            for block in blocks.values():
                if key in block.keys:
                    i = block.keys.index(key)
                    return block.layout.flat_of(self._block_matrix(block), i, block.numels[i])
        return None

    def _adopt(self, bkey: Tuple[Hashable, ...], numels: Sequence[int], layout: BucketLayout,
               device) -> Optional[Block]:
        """The bucket's residuals gathered into a block of ``layout``: from its block in another layout, from keys
        kept per key, or from restored block columns (exactly, when they are this layout's in this storage).
        Staged where any was staged, else committed; None when the bucket has none."""
        sources = {}
        for blocks in (self.blocks, self.staged_blocks):
            for other_key, block in list(blocks.items()):
                if set(other_key) & set(bkey):
                    matrix = self._block_matrix(block)
                    for i, k in enumerate(block.keys):
                        sources[k] = block.layout.flat_of(matrix, i, block.numels[i])
                    del blocks[other_key]
        pieces = {k: self.committed.pop(k) for k in bkey if isinstance(self.committed.get(k), dict)}
        staged_keys = [k for k in bkey if k in self.staged]
        for k in bkey:
            if k in self.staged:
                sources[k] = self.get(k)
                self.staged.pop(k)
            elif k in self.committed:
                sources[k] = self._fetch(self.committed.pop(k))
        if not sources and not pieces:
            self._recount()
            return None
        code_dtype = {"fp8": torch.uint8, "int8": torch.int8}.get(self.storage)
        exact = (code_dtype is not None and len(pieces) == len(bkey) and not sources
                 and all(tuple(pieces[k]["codes"].shape) == (layout.rows, layout.widths[i])
                         and pieces[k]["codes"].dtype == code_dtype for i, k in enumerate(bkey)))
        if exact:  # this layout's columns in this storage: put together bit for bit
            codes = torch.cat([pieces[k]["codes"] for k in _in_columns(bkey, layout)], dim=1)
            scales = torch.cat([pieces[k]["scales"] for k in _in_columns(bkey, layout)], dim=1)
            block = Block(layout, bkey, tuple(int(n) for n in numels), (codes.to(device), scales.to(device)))
        else:
            for k, piece in pieces.items():
                sources[k] = _decode_piece(piece)
            matrix = torch.zeros(layout.rows, layout.columns, device=device)
            for i, k in enumerate(bkey):
                if k in sources:
                    layout.place(matrix, i, sources[k].to(device))
            final, self.final = self.final, True
            self.stage_block(bkey, numels, layout, matrix)
            self.final = final
            block = self.staged_blocks.pop(bkey)
        (self.staged_blocks if staged_keys else self.blocks)[bkey] = block
        self._recount()
        return block

    def _recount(self) -> None:
        """The byte counts behind :attr:`peak_bytes`, after the committed or staged sets changed."""
        self._committed_nbytes, self._staged_nbytes = self.state_bytes(), self.staged_bytes()

    def commit(self) -> None:
        """The step was applied: staged residuals become the committed ones."""
        for k, v in self.staged.items():
            self.committed[k] = self._store(k, v)
        self.staged = {}
        for bkey, block in self.staged_blocks.items():
            if len(block.parts) == 1 and not self._as_stored(block.parts[0]):
                block = Block(block.layout, block.keys, block.numels,  # staged before the window's end: encode now
                              self._encode_block_(block.parts[0], block.layout, bkey))
            if self.offload and not block.host:
                block = self._write_back(bkey, block)
            old = self.blocks.get(bkey)
            if old is not None and old.host:  # the committed buffers take the next window's write-back
                self._spare[bkey] = old.parts
            self.blocks[bkey] = block
        self.staged_blocks = {}
        if self._copies is not None:
            if not self._copies.cuda:
                self._copies.wait()  # the CPU's write-backs (issued during the backward) are done
            self._last_order, self._order = self._order or self._last_order, []
            self._prefetch_after(None)  # the first bucket of the next step, during its forward
        self._recount()

    # ---- offloaded blocks ---------------------------------------------------------------------------------------

    def _host_copies(self, device) -> HostCopies:
        if self._copies is None:
            self._copies = HostCopies(device)
        return self._copies

    def _write_back(self, bkey, block: Block) -> Block:
        """``block`` (on the device) copied into ``bkey``'s second host buffers, asynchronously: the staged block."""
        self.device = block.parts[0].device
        spare = self._spare.pop(bkey, ())
        if len(spare) != len(block.parts) or any(h.shape != p.shape or h.dtype != p.dtype
                                                 for h, p in zip(spare, block.parts)):
            spare = tuple(pinned_like(p) for p in block.parts)
        self._host_copies(self.device).write_back(block.parts, spare)
        return Block(block.layout, block.keys, block.numels, tuple(spare), host=True)

    def _fetch_block(self, bkey, block: Block, device) -> Tuple[torch.Tensor, ...]:
        """A host block's parts on ``device`` (prefetched where they were), and the next bucket's fetch started."""
        copies = self._host_copies(device)
        parts = copies.fetch(bkey, block.parts)
        self._order.append(bkey)
        self._prefetch_after(bkey)
        return parts

    def _prefetch_after(self, bkey) -> None:
        """Start fetching the committed host block of the bucket that came after ``bkey`` last step (None: the
        first)."""
        order = self._last_order
        i = 0 if bkey is None else (order.index(bkey) + 1 if bkey in order else len(order))
        if i < len(order):
            nxt = self.blocks.get(order[i])
            if nxt is not None and nxt.host and order[i] not in self.staged_blocks:
                self._copies.prefetch(order[i], nxt.parts)

    def _settle(self) -> None:
        """Every write-back done and no fetch in flight: the host buffers may be read or changed here."""
        if self._copies is not None:
            self._copies.wait()
            for bkey in list(self._copies.pending()):
                self._copies.drop_prefetch(bkey)

    def rollback(self) -> None:
        """The step was skipped (overflow): forget this window's residual updates."""
        self._settle()
        for bkey, block in self.staged_blocks.items():
            if block.host:
                self._spare[bkey] = block.parts
        self.staged, self.staged_blocks = {}, {}
        self._recount()

    def clear(self) -> None:
        """Forget every residual, committed and staged (a new phase of training, or state that cannot be loaded)."""
        self._settle()
        self.committed, self.staged, self.blocks, self.staged_blocks = {}, {}, {}, {}
        self._spare, self._order, self._last_order = {}, [], []
        self._recount()

    def drop(self, keys) -> None:
        """Forget the residuals of these keys (parameters that no longer train)."""
        self._settle()
        keys = set(keys)
        for k in keys:
            self.committed.pop(k, None)
            self.staged.pop(k, None)
        for blocks in (self.blocks, self.staged_blocks):
            for bkey, block in blocks.items():
                for i, k in enumerate(block.keys):
                    if k in keys:
                        cols = slice(block.layout.cols[i], block.layout.cols[i] + block.layout.widths[i])
                        block.parts[0][:, cols] = 0  # fp8: a zero code decodes to 0 whatever the scale
        self._recount()

    def __len__(self) -> int:
        """Number of committed residuals."""
        return len(self.committed) + sum(len(b.keys) for b in self.blocks.values())

    def residual_norm(self) -> float:
        """L2 norm over all committed residuals (unscaled gradient units); one pass over them."""
        sq = None
        tensors = [self._fetch(v) for v in self.committed.values()]
        tensors += [self._block_matrix(b).view(-1) for b in self.blocks.values()]
        for r in tensors:  # one decoded residual at a time, summed on the device
            d = torch.dot(r, r).double()
            sq = d if sq is None else sq + d.to(sq.device)
        return 0.0 if sq is None else float(sq)**0.5  # one read-back

    def state_bytes(self) -> int:
        """Bytes held between steps by committed residuals (in host memory with ``offload``)."""
        return sum(self._nbytes(v) for v in self.committed.values()) + sum(b.nbytes for b in self.blocks.values())

    def staged_bytes(self) -> int:
        """Bytes of this window's staged residuals (held beside the committed ones until the commit)."""
        return sum(self._nbytes(v) for v in self.staged.values()) + sum(b.nbytes for b in self.staged_blocks.values())

    def host_state_bytes(self) -> int:
        """Bytes in host memory with ``offload`` (else 0): every committed residual, and the second host buffer of
        each bucket's block (the next window's write-back goes there)."""
        if not self.offload:
            return 0
        per_key = sum(self._nbytes(v) for v in self.committed.values())
        return (per_key + sum(b.nbytes for b in self.blocks.values() if b.host)
                + sum(t.numel() * t.element_size() for parts in self._spare.values() for t in parts))

    def device_state_bytes(self) -> int:
        """Bytes held between steps on the device: the committed state not on the host (a block restored from a
        checkpoint is there until its first commit)."""
        per_key = 0 if self.offload else sum(self._nbytes(v) for v in self.committed.values())
        return per_key + sum(b.nbytes for b in self.blocks.values() if not b.host)


def _bucket(block: Block) -> Tuple[Hashable, ...]:
    return block.keys


def _in_columns(keys: Sequence[Hashable], layout: BucketLayout) -> List[Hashable]:
    """The keys of a layout's tensors in column order."""
    return [keys[i] for i in layout.placement]


def _fp8_encode_(A: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """fp8 e4m3 codes and fp32 absmax scales per 128 columns of each row of ``A`` ``(R, C)`` (fp32 or bf16, ``C`` a
    multiple of 128), as :func:`~deepspeed_dgc.codec.formats.quantize_weights` codes them; ``A`` is overwritten (a
    bf16 ``A`` holds the scaled values in bf16 before they round to e4m3)."""
    R, C = A.shape
    groups = A.view(R, C // FP8_RESIDUAL_GROUP, FP8_RESIDUAL_GROUP)
    scales = torch.maximum(groups.amax(dim=-1), groups.amin(dim=-1).neg_()).float().div_(FP8_MAX["fp8_e4m3"])
    groups.div_(torch.where(scales > 0, scales, torch.ones_like(scales))[..., None])
    codes = torch.empty(R, C, dtype=torch.uint8, device=A.device)
    codes.view(torch.float8_e4m3fn).copy_(A)
    return codes, scales


def _block_pieces(block: Block) -> Dict[Hashable, object]:
    """A committed block by key, on the CPU: flat fp32/bf16 residuals, or for fp8 each key's columns."""
    L = block.layout
    out = {}
    for i, (key, n) in enumerate(zip(block.keys, block.numels)):
        if len(block.parts) == 1:
            out[key] = L.flat_of(block.parts[0], i, n).cpu()
        else:
            g = block.parts[0].shape[1] // block.parts[1].shape[1]  # columns per scale
            cols = slice(L.cols[i], L.cols[i] + L.widths[i])
            groups = slice(L.cols[i] // g, (L.cols[i] + L.widths[i]) // g)
            out[key] = {"codes": block.parts[0][:, cols].cpu().contiguous(),
                        "scales": block.parts[1][:, groups].cpu().contiguous(), "chunk": L.chunks[i], "numel": n}
    return out


def _decode_piece(piece: dict) -> torch.Tensor:
    """A key's fp8 or int8 block columns (:func:`_block_pieces`) as its flat fp32 residual."""
    codes, scales = piece["codes"], piece["scales"]
    R, w = codes.shape
    if codes.dtype == torch.int8:
        rows = i8.decode(codes, scales)
    else:
        rows = codes.view(torch.float8_e4m3fn).float().view(R, w // FP8_RESIDUAL_GROUP, FP8_RESIDUAL_GROUP)
        rows = rows.mul_(scales[..., None]).view(R, w)
    return rows[:, :piece["chunk"]].reshape(-1)[:piece["numel"]].clone()
