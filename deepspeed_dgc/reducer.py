"""The compressed reduce-scatter that replaces ZeRO-3's ``__avg_scatter_grads``.

Per bucket of full local gradients ``g_1..g_m`` (params sorted by ``ds_id``), on a group of
W ranks, this rank r:

1. pre-divides by W (as stock does) and adds its error-feedback residual: ``acc = g/W + e``;
2. selects top-k of each tensor (:func:`select_topk`) and splits the selection by owner rank:
   owner o gets the kept elements of ``flat[o*c : min((o+1)*c, n)]``, ``c = ceil(n/W)``;
3. quantizes the kept values per owner to INT4 with group-wise absmax scales and varint-codes
   their positions (:mod:`deepspeed_dgc.compressor`); tensors under ``min_numel`` (and all
   tensors at density 1) are sent whole, still quantized, with no indices;
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
    values    kept values in column order: packed INT4 (two per byte) or raw communication dtype
    uint8[]   varint gaps of the kept positions of sparsified tensors (the others are implied)
"""

import json
import zlib
from dataclasses import dataclass
from typing import List, Sequence, Tuple

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
        kept: elements sent (this rank, all owners); tensors that are not sparsified count whole.
        numel: elements of all tensors of the call.
        finite: False when this rank's input held Inf/NaN (its output was poisoned with NaN).
    """
    wire_bytes: int
    dense_fp32_bytes: float
    kept: int
    numel: int
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

    def _fingerprint(self, numels: Sequence[int], sparse: Sequence[bool], comm_dtype: torch.dtype) -> int:
        desc = json.dumps([
            self.cfg.density, self.cfg.quantization, self.cfg.group_size, self.cfg.min_numel,
            str(comm_dtype),
            list(numels),
            list(sparse)
        ])
        return zlib.crc32(desc.encode()) & 0x7FFFFFFF

    def is_sparse(self, numel: int) -> bool:
        """Whether a tensor of ``numel`` elements is top-k sparsified (else sent whole, still quantized)."""
        return self.cfg.density < 1.0 and numel >= self.cfg.min_numel

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
            comm_dtype: dtype of values on the wire when ``quantization`` is ``"none"``.
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
        sparse = [self.is_sparse(n) for n in numels]

        # acc = g/W + residual * loss_scale in fp32. Stock casts to the communication dtype and
        # pre-divides by W; an fp32 division rounded to that dtype gives the same values.
        accs = []
        for g, key in zip(grads, keys):
            acc = g.reshape(-1).to(comm_dtype).float().div(world)
            residual = self.memory.get(key) if cfg.error_feedback else None
            if residual is not None:
                acc.add_(residual, alpha=loss_scale)
            accs.append(acc)

        finite = all(bool(torch.isfinite(a).all()) for a in accs)
        if finite:
            masks = [
                select_topk(a, cfg.density, self._generator(device)) if s else torch.ones(a.numel(), dtype=torch.bool, device=device)
                for a, s in zip(accs, sparse)
            ]
        else:  # send well-formed payloads with nothing selected; this rank's output becomes NaN below
            accs = [torch.zeros_like(a) for a in accs]
            masks = [torch.zeros(a.numel(), dtype=torch.bool, device=device) for a in accs]
        acc_m, chunks = _owner_matrix(accs, world, torch.float32, device)
        mask_m, _ = _owner_matrix(masks, world, torch.bool, device)
        implied_m = _real_mask(numels, chunks, world, device)  # positions sent without an index
        implied_m[:, _columns(chunks, sparse, device)] = False
        sent_m = torch.zeros_like(acc_m)
        seg_ends = torch.cumsum(torch.tensor(chunks, dtype=torch.long, device=device), 0)
        fingerprint = self._fingerprint(numels, sparse, comm_dtype)

        payloads = []
        for o in range(world):
            pos = mask_m[o].nonzero().squeeze(1)
            kept = pos.numel()
            indexed = pos[~implied_m[o][pos]]
            index_bytes = encode_indices(indexed, torch.tensor([indexed.numel()], device=device))
            values, scales, sent_m[o][pos] = self._encode_values(acc_m[o][pos], pos, seg_ends, comm_dtype)
            header = torch.tensor([MAGIC, fingerprint, kept, index_bytes.numel(), scales.numel()],
                                  dtype=torch.int32,
                                  device=device)
            payload = torch.cat([_bytes(header), _bytes(scales), _bytes(values), index_bytes])
            pad = -payload.numel() % 4
            if pad:
                payload = torch.cat([payload, payload.new_zeros(pad)])
            payloads.append(payload)

        wire_before = comm.wire_bytes
        received = comm.all_to_all(payloads)
        out = self._sum_received(received, implied_m[rank], seg_ends, comm_dtype, fingerprint)
        if cfg.quantization == "none" and comm_dtype != torch.float32:
            out = out.to(comm_dtype).float()  # stock's result is in the communication dtype

        if cfg.error_feedback and not cfg.lossless and finite:
            res_m = (acc_m - sent_m).div_(loss_scale)
            col = 0
            for key, n, c in zip(keys, numels, chunks):
                self.memory.stage(key, res_m[:, col:col + c].reshape(-1)[:n].clone())
                col += c

        outputs, col = [], 0
        for n, c in zip(numels, chunks):
            outputs.append(out.narrow(0, col, max(0, min(c, n - rank * c))))
            col += c
        if not finite:
            out.fill_(float("nan"))

        result = ReduceResult(wire_bytes=comm.wire_bytes - wire_before,
                              dense_fp32_bytes=sum((world - 1) / world * n * 4 for n in numels),
                              kept=int(mask_m.sum()),
                              numel=sum(numels),
                              finite=finite)
        return outputs, result

    def _encode_values(self, vals: torch.Tensor, pos: torch.Tensor, seg_ends: torch.Tensor,
                       comm_dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Kept values (fp32, sorted by column) to ``(values on the wire, fp32 scales, fp32 decoded)``."""
        if self.cfg.quantization == "int4":
            return quantize_int4(vals, self.cfg.group_size, _segment_counts(pos, seg_ends), return_dequantized=True)
        raw = vals.to(comm_dtype)
        return raw, torch.empty(0, dtype=torch.float32, device=vals.device), raw.float()

    def _decode_values(self, values: torch.Tensor, scales: torch.Tensor, pos: torch.Tensor, seg_ends: torch.Tensor,
                       comm_dtype: torch.dtype) -> torch.Tensor:
        """Inverse of :meth:`_encode_values`: fp32 values, shape ``(pos.numel(),)``."""
        if self.cfg.quantization == "int4":
            return dequantize_int4(values, scales, pos.numel(), self.cfg.group_size, _segment_counts(pos, seg_ends))
        return values.float()

    def _sum_received(self, received: Sequence[torch.Tensor], implied_row: torch.Tensor, seg_ends: torch.Tensor,
                      comm_dtype: torch.dtype, fingerprint: int) -> torch.Tensor:
        """Decode every sender's payload for this rank's partition and sum them in sender order.

        Args:
            received: uint8 payload from each rank of the group.
            implied_row: bool ``(sum c_i,)``, True where a kept element needs no index (real
                elements of tensors that are not sparsified).
            seg_ends: int64 ``(T,)``, cumulative column ends of the tensors in the row.
            comm_dtype: dtype of raw values.
            fingerprint: this rank's fingerprint of config and bucket, which every payload must carry.

        Returns:
            fp32 sums over this rank's row, padded layout, shape ``(sum c_i,)``.

        Raises:
            DGCProtocolError: a payload is malformed or was made under another config or bucket.
        """
        device = implied_row.device
        itemsize = torch.empty(0, dtype=comm_dtype).element_size()
        out = torch.zeros(implied_row.numel(), dtype=torch.float32, device=device)
        implied = implied_row.nonzero().squeeze(1)
        for src, buf in enumerate(received):
            header, off = _take(buf, 0, 4 * HEADER_INT32, torch.int32)
            magic, fp, kept, n_index, n_groups = header.tolist()
            if magic != MAGIC or fp != fingerprint:
                raise DGCProtocolError(
                    f"rank {src} sent a payload this rank cannot read (magic {magic:#x}, fingerprint {fp} vs {fingerprint}): "
                    "the 'dgc' config, the communication dtype or the bucket's tensor sizes differ between ranks")
            n_indexed = kept - implied.numel()
            if n_indexed < 0 and kept != 0:
                raise DGCProtocolError(f"rank {src} kept {kept} elements, fewer than the {implied.numel()} sent whole")
            scales, off = _take(buf, off, 4 * n_groups, torch.float32)
            if self.cfg.quantization == "int4":
                values, off = _take(buf, off, int4_packed_bytes(kept), torch.uint8)
            else:
                values, off = _take(buf, off, itemsize * kept, comm_dtype)
            index_bytes, off = _take(buf, off, n_index, torch.uint8)
            if buf.numel() - off >= 4:
                raise DGCProtocolError(f"rank {src} sent {buf.numel()} bytes, expected {off} plus padding")
            if kept == 0:
                continue  # a rank whose input was not finite sends nothing
            try:
                indexed = decode_indices(index_bytes, torch.tensor([n_indexed], device=device))
                if n_indexed and int(indexed[-1]) >= out.numel():
                    raise ValueError(f"index {int(indexed[-1])} past the partition of {out.numel()} elements")
                pos = torch.sort(torch.cat([implied, indexed])).values if n_indexed else implied
                vals = self._decode_values(values, scales, pos, seg_ends, comm_dtype)
            except ValueError as err:
                raise DGCProtocolError(f"rank {src}: {err}") from None
            out.index_add_(0, pos, vals)
        return out


def _columns(chunks: Sequence[int], select: Sequence[bool], device) -> torch.Tensor:
    """Column indices of the owner matrix that belong to tensors with ``select`` true."""
    cols, col = [], 0
    for c, s in zip(chunks, select):
        if s:
            cols.append(torch.arange(col, col + c, device=device))
        col += c
    return torch.cat(cols) if cols else torch.empty(0, dtype=torch.long, device=device)


def _segment_counts(pos: torch.Tensor, seg_ends: torch.Tensor) -> torch.Tensor:
    """Kept positions per tensor: ``pos`` (sorted columns of a row) counted by ``seg_ends`` ranges."""
    below_end = torch.searchsorted(pos, seg_ends)
    return torch.diff(below_end, prepend=below_end.new_zeros(1))
