"""The compressed reduce-scatter that replaces ZeRO-3's ``__avg_scatter_grads``.

Per bucket of full local gradients ``g_1..g_m`` (params sorted by ``ds_id``), on a group of
W ranks, this rank r:

1. pre-divides by W (as stock does) and adds its error-feedback residual: ``acc = g/W + e``;
2. selects top-k of each tensor (:func:`select_topk`) and splits the selection by owner rank:
   owner o gets the kept elements of ``flat[o*c : min((o+1)*c, n)]``, ``c = ceil(n/W)``;
3. quantizes the kept values per owner to INT4 with group-wise absmax scales and varint-codes
   their positions (:mod:`deepspeed_dgc.compressor`); tensors under ``min_numel`` go dense;
4. exchanges one byte payload per owner with an uneven all-to-all (:class:`TorchCommunicator`);
5. sums what every sender sent for its own partition into a dense fp32 buffer;
6. stages the new residual ``acc - sent`` (includes the quantization error), unscaled.

Output contract (tested against stock DeepSpeed): one tensor per input, this rank's slice
``flat[r*c : min((r+1)*c, n)]`` (possibly empty) of the mean over the group, in
``gradient_accumulation_dtype``. In lossless mode (density 1, no quantization) it is
bit-identical to stock at 2 ranks.

Wire format of one payload (sender -> owner), aligned to 4 bytes::

    int32[5]  header: MAGIC, fingerprint (config and bucket shape), kept count, index bytes, scale groups
    fp32[G]   INT4 scales (groups restart at each tensor; absent without quantization)
    dense     the owner's rows of the tensors under min_numel, raw, in the communication dtype
    values    kept values: packed INT4 (two per byte) or raw communication dtype
    uint8[]   varint gaps of the kept positions (absent when every real element is kept)
"""

import json
import zlib
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from .comm import TorchCommunicator
from .compressor import (decode_indices, dequantize_int4, encode_indices, int4_packed_bytes,
                         quantize_int4, select_topk)
from .config import DGCConfig
from .memory import ErrorFeedback

MAGIC = 0x44474331  # "DGC1"
HEADER_INT32 = 5


class DGCProtocolError(RuntimeError):
    """A payload from another rank does not match what this rank expects (config or bucket differ)."""


@dataclass
class ReduceResult:
    """What one call did, for telemetry.

    Attributes:
        wire_bytes: bytes this rank sent to other ranks (payloads and size exchange).
        dense_fp32_bytes: what stock fp32 reduce-scatter would send for the same tensors,
            ``(W-1)/W * numel * 4`` summed over tensors.
        kept: elements selected among compressed tensors (this rank, all owners).
        compressed_numel: elements of the compressed tensors.
        finite: False when this rank's input held Inf/NaN (its output was poisoned with NaN).
    """
    wire_bytes: int
    dense_fp32_bytes: float
    kept: int
    compressed_numel: int
    finite: bool


def _owner_matrix(flats: Sequence[torch.Tensor], world: int, dtype: torch.dtype,
                  device) -> Tuple[torch.Tensor, List[int]]:
    """Lay tensors out by owner rank, as stock ``reduce_scatter_coalesced`` does.

    Returns:
        ``(M, chunks)``: M of shape ``(world, sum(c_i))`` where row o is the concatenation of
        ``flat_i[o*c_i : (o+1)*c_i]`` zero-padded to ``c_i = ceil(n_i/world)``; and the ``c_i``.
    """
    chunks = [-(-f.numel() // world) for f in flats]
    if not flats:
        return torch.empty(world, 0, dtype=dtype, device=device), chunks
    cols = [torch.nn.functional.pad(f.to(dtype), (0, world * c - f.numel())).view(world, c) for f, c in zip(flats, chunks)]
    return torch.cat(cols, dim=1), chunks


def _real_mask(numels: Sequence[int], chunks: Sequence[int], world: int, device) -> torch.Tensor:
    """Bool ``(world, sum(c_i))``: True where the owner matrix holds a real element, not padding."""
    if not numels:
        return torch.empty(world, 0, dtype=torch.bool, device=device)
    cols = [(torch.arange(world * c, device=device) < n).view(world, c) for n, c in zip(numels, chunks)]
    return torch.cat(cols, dim=1)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _take(buf: torch.Tensor, offset: int, nbytes: int, dtype: torch.dtype) -> Tuple[torch.Tensor, int]:
    """View ``nbytes`` of uint8 ``buf`` at ``offset`` as ``dtype``; return it and the next offset."""
    if offset + nbytes > buf.numel():
        raise DGCProtocolError(f"payload too short: need {offset + nbytes} bytes, got {buf.numel()}")
    return buf[offset:offset + nbytes].view(dtype), offset + nbytes


class CompressedReduceScatter:
    """Sparsified, INT4-quantized reduce-scatter with error feedback for one ZeRO-3 optimizer.

    Args:
        cfg: the enabled ``"dgc"`` config.
        memory: residual store (error feedback).
        seed: seed of the random generator used to sample for threshold estimation; give each
            rank its own (e.g. a constant plus the global rank) for reproducible runs.
    """

    def __init__(self, cfg: DGCConfig, memory: ErrorFeedback, seed: int = 0):
        self.cfg = cfg
        self.memory = memory
        self.seed = seed
        self._generators = {}
        self._communicators = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        if key not in self._generators:
            self._generators[key] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[key]

    def communicator(self, group) -> TorchCommunicator:
        """The communicator of ``group``, created once per group."""
        if group not in self._communicators:
            self._communicators[group] = TorchCommunicator(group)
        return self._communicators[group]

    def wire_bytes(self) -> int:
        """Bytes sent to other ranks so far, over all groups."""
        return sum(c.wire_bytes for c in self._communicators.values())

    def _fingerprint(self, numels: Sequence[int], compressed: Sequence[bool], comm_dtype: torch.dtype) -> int:
        desc = json.dumps([
            self.cfg.density, self.cfg.quantization, self.cfg.group_size, self.cfg.min_numel,
            str(comm_dtype),
            list(numels),
            list(compressed)
        ])
        return zlib.crc32(desc.encode()) & 0x7FFFFFFF

    def is_compressed(self, numel: int) -> bool:
        """Whether a tensor of ``numel`` elements takes the compressed path (else dense)."""
        return not self.cfg.lossless and numel >= self.cfg.min_numel

    def reduce_scatter(self,
                       grads: Sequence[torch.Tensor],
                       keys: Sequence[int],
                       group,
                       comm_dtype: torch.dtype,
                       loss_scale: float = 1.0) -> Tuple[List[torch.Tensor], ReduceResult]:
        """Mean over the group of each gradient, scattered by owner rank, compressed on the wire.

        Args:
            grads: full local gradients, one per parameter, any shape (n_i elements), any float dtype.
                Every rank passes tensors of the same sizes in the same order.
            keys: error-feedback key of each gradient (``param.ds_id``).
            group: process group of the partition (None: the world).
            comm_dtype: dtype of dense values and of raw kept values on the wire.
            loss_scale: current loss scale the gradients are multiplied by (residuals are stored
                divided by it).

        Returns:
            ``(partitions, result)``: per gradient, an fp32 tensor of this rank's slice of the
            mean, shape ``(max(0, min(c, n - r*c)),)``; and a :class:`ReduceResult`.

        Raises:
            DGCProtocolError: a payload from another rank does not match this rank's
                expectation (config or bucket differ between ranks); every rank that receives
                such a payload raises.
        """
        comm = self.communicator(group)
        world, rank = comm.world_size, comm.rank
        device = grads[0].device
        cfg = self.cfg
        numels = [g.numel() for g in grads]
        compressed = [self.is_compressed(n) for n in numels]
        flats = [g.reshape(-1) for g in grads]
        c_idx = [i for i, c in enumerate(compressed) if c]
        d_idx = [i for i, c in enumerate(compressed) if not c]

        # Dense part: stock casts to the communication dtype and pre-divides by the world size.
        dense_m, dense_chunks = _owner_matrix([flats[i] for i in d_idx], world, comm_dtype, device)
        dense_m.div_(world)

        # Compressed part: acc = g/W + residual * loss_scale, in fp32.
        accs = []
        for i in c_idx:
            acc = flats[i].float().div(world)
            residual = self.memory.get(keys[i]) if cfg.error_feedback else None
            if residual is not None:
                acc.add_(residual, alpha=loss_scale)
            accs.append(acc)

        finite = bool(torch.isfinite(dense_m).all()) and all(bool(torch.isfinite(a).all()) for a in accs)
        if finite:
            masks = [select_topk(a, cfg.density, self._generator(device)) for a in accs]
        else:  # send well-formed zeros and nothing selected; this rank's output becomes NaN below
            dense_m.zero_()
            accs = [torch.zeros_like(a) for a in accs]
            masks = [torch.zeros(a.numel(), dtype=torch.bool, device=device) for a in accs]
        acc_m, chunks = _owner_matrix(accs, world, torch.float32, device)
        mask_m, _ = _owner_matrix(masks, world, torch.bool, device)
        c_numels = [numels[i] for i in c_idx]
        real_m = _real_mask(c_numels, chunks, world, device)
        sent_m = torch.zeros_like(acc_m)
        fingerprint = self._fingerprint(numels, compressed, comm_dtype)

        seg_ends = torch.cumsum(torch.tensor(chunks, dtype=torch.long, device=device), 0)
        payloads = []
        for o in range(world):
            pos = mask_m[o].nonzero().squeeze(1)
            vals = acc_m[o][pos]
            kept = pos.numel()
            full = kept == int(real_m[o].sum())
            index_bytes = (torch.empty(0, dtype=torch.uint8, device=device)
                           if full else encode_indices(pos, torch.tensor([kept], device=device)))
            parts = [None, None, _bytes(dense_m[o])]
            if cfg.quantization == "int4":
                segs = _segment_counts(pos, seg_ends)
                packed, scales = quantize_int4(vals, cfg.group_size, segs)
                sent_m[o][pos] = dequantize_int4(packed, scales, kept, cfg.group_size, segs)
                parts[1] = _bytes(scales)
                parts.append(packed)
            else:
                raw = vals.to(comm_dtype)
                sent_m[o][pos] = raw.float()
                parts[1] = torch.empty(0, dtype=torch.uint8, device=device)
                parts.append(_bytes(raw))
            parts.append(index_bytes)
            header = torch.tensor([MAGIC, fingerprint, kept, index_bytes.numel(), parts[1].numel() // 4],
                                  dtype=torch.int32,
                                  device=device)
            parts[0] = _bytes(header)
            payload = torch.cat(parts)
            pad = -payload.numel() % 4
            if pad:
                payload = torch.cat([payload, payload.new_zeros(pad)])
            payloads.append(payload)

        wire_before = comm.wire_bytes
        received = comm.all_to_all(payloads)
        out_c, out_d = self._sum_received(received, real_m[rank], seg_ends, dense_m.shape[1], comm_dtype, fingerprint)

        if cfg.error_feedback and finite:
            res_m = (acc_m - sent_m).div_(loss_scale)
            col = 0
            for i, c in zip(c_idx, chunks):
                self.memory.stage(keys[i], res_m[:, col:col + c].reshape(-1)[:numels[i]].clone())
                col += c

        outputs: List[Optional[torch.Tensor]] = [None] * len(grads)
        for idx_list, chunk_list, out in ((c_idx, chunks, out_c), (d_idx, dense_chunks, out_d)):
            col = 0
            for i, c in zip(idx_list, chunk_list):
                real = max(0, min(c, numels[i] - rank * c))
                outputs[i] = out.narrow(0, col, real)
                col += c
        if not finite:
            for o in outputs:
                o.fill_(float("nan"))

        dense_fp32 = sum((world - 1) / world * n * 4 for n in numels)
        result = ReduceResult(wire_bytes=comm.wire_bytes - wire_before,
                              dense_fp32_bytes=dense_fp32,
                              kept=int(mask_m.sum()),
                              compressed_numel=sum(c_numels),
                              finite=finite)
        return outputs, result

    def _sum_received(self, received: Sequence[torch.Tensor], real_row: torch.Tensor, seg_ends: torch.Tensor,
                      dense_cols: int, comm_dtype: torch.dtype, fingerprint: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Decode every sender's payload for this rank's partition and sum them in sender order.

        Args:
            received: uint8 payload from each rank of the group.
            real_row: bool ``(sum c_i,)``, True where this rank's compressed row holds a real element.
            seg_ends: int64 ``(T,)``, cumulative column ends of the compressed tensors in the row.
            dense_cols: length of the dense row (sum of the dense tensors' chunks).
            comm_dtype: dtype of raw values.
            fingerprint: this rank's fingerprint of config and bucket, which every payload must carry.

        Returns:
            ``(out_c, out_d)``: fp32 sums over the compressed row (padded layout, shape
            ``(sum c_i,)``) and the dense row (shape ``(dense_cols,)``).

        Raises:
            DGCProtocolError: a payload is malformed or was made under another config or bucket.
        """
        cfg = self.cfg
        device = real_row.device
        itemsize = torch.empty(0, dtype=comm_dtype).element_size()
        out_c = torch.zeros(real_row.numel(), dtype=torch.float32, device=device)
        out_d = torch.zeros(dense_cols, dtype=torch.float32, device=device)
        real_pos = None
        for src, buf in enumerate(received):
            header, off = _take(buf, 0, 4 * HEADER_INT32, torch.int32)
            magic, fp, kept, n_index, n_groups = header.tolist()
            if magic != MAGIC or fp != fingerprint:
                raise DGCProtocolError(
                    f"rank {src} sent a payload this rank cannot read (magic {magic:#x}, fingerprint {fp} vs {fingerprint}): "
                    "the 'dgc' config, the communication dtype or the bucket's tensor sizes differ between ranks")
            scales, off = _take(buf, off, 4 * n_groups, torch.float32)
            dense, off = _take(buf, off, itemsize * dense_cols, comm_dtype)
            if cfg.quantization == "int4":
                values, off = _take(buf, off, int4_packed_bytes(kept), torch.uint8)
            else:
                values, off = _take(buf, off, itemsize * kept, comm_dtype)
            index_bytes, off = _take(buf, off, n_index, torch.uint8)
            if buf.numel() - off >= 4:
                raise DGCProtocolError(f"rank {src} sent {buf.numel()} bytes, expected {off} plus padding")
            if n_index == 0:  # nothing kept, or every real element kept (positions implied)
                if real_pos is None:
                    real_pos = real_row.nonzero().squeeze(1)
                if kept not in (0, real_pos.numel()):
                    raise DGCProtocolError(f"rank {src} sent {kept} values without indices for {real_pos.numel()} elements")
                pos = real_pos[:kept]
            else:
                try:
                    pos = decode_indices(index_bytes, torch.tensor([kept], device=device))
                except ValueError as err:
                    raise DGCProtocolError(f"rank {src}: {err}") from None
                if kept and int(pos[-1]) >= out_c.numel():
                    raise DGCProtocolError(f"rank {src} sent an index past the partition ({int(pos[-1])})")
            if cfg.quantization == "int4":
                try:
                    vals = dequantize_int4(values, scales, kept, cfg.group_size, _segment_counts(pos, seg_ends))
                except ValueError as err:
                    raise DGCProtocolError(f"rank {src}: {err}") from None
            else:
                vals = values.float()
            out_c.index_add_(0, pos, vals)
            out_d.add_(dense.float())
        return out_c, out_d


def _segment_counts(pos: torch.Tensor, seg_ends: torch.Tensor) -> torch.Tensor:
    """Kept positions per tensor: ``pos`` (sorted columns of a row) counted by ``seg_ends`` ranges."""
    return torch.bincount(torch.bucketize(pos, seg_ends, right=True), minlength=seg_ends.numel())
