"""The compressed reduce-scatter that replaces ZeRO-3's ``__avg_scatter_grads``.

Per bucket of full local gradients ``g_1..g_m`` (params sorted by ``ds_id``), on a group of
W ranks, this rank r:

1. pre-divides by W (as stock does) and adds its error-feedback residual: ``acc = g/W + e``;
2. selects top-k of each tensor (:func:`select_topk`) and splits the selection by owner rank:
   owner o gets the kept elements of ``flat[o*c : min((o+1)*c, n)]``, ``c = ceil(n/W)``;
3. quantizes the kept values per owner to INT4 with group-wise absmax scales and varint-codes
   their positions (:mod:`deepspeed_dgc.compressor`); tensors under ``min_numel`` (and all
   tensors at density 1) are sent whole, still quantized, with no indices;
4. exchanges one byte payload per owner with an uneven all-to-all (:mod:`deepspeed_dgc.comm`);
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
from typing import List, Optional, Sequence, Tuple

import torch

from .compressor import (decode_indices, dequantize_int4, encode_indices, int4_packed_bytes,
                         quantize_int4, select_topk)
from .config import DGCConfig
from .memory import ErrorFeedback
from .topology import ReduceComms, build_reduce_comms, resolve_ranks_per_node

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
        intra_node_wire_bytes, inter_node_wire_bytes: ``wire_bytes`` split by whether the
            destination rank is on this rank's node.
        inter_node_dense_fp32_bytes: the part of ``dense_fp32_bytes`` stock (flat) would send to
            ranks on other nodes, ``(ranks off this node)/W * numel * 4``.
    """
    wire_bytes: int
    dense_fp32_bytes: float
    kept: int
    numel: int
    finite: bool
    intra_node_wire_bytes: int = 0
    inter_node_wire_bytes: int = 0
    inter_node_dense_fp32_bytes: float = 0.0


def _owner_matrix(flats: Sequence[torch.Tensor], chunks: Sequence[int], world: int, dtype: torch.dtype,
                  device) -> torch.Tensor:
    """Lay tensors out by owner rank, as stock ``reduce_scatter_coalesced`` does.

    Returns:
        M of shape ``(world, sum(c_i))`` where row o is the concatenation of
        ``flat_i[o*c_i : (o+1)*c_i]`` zero-padded to ``c_i = chunks[i] = ceil(n_i/world)``.
    """
    if not flats:
        return torch.empty(world, 0, dtype=dtype, device=device)
    cols = [torch.nn.functional.pad(f.to(dtype), (0, world * c - f.numel())).view(world, c) for f, c in zip(flats, chunks)]
    return torch.cat(cols, dim=1)


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
        cfg: the enabled ``"dgc"`` config (its ``topology``, ``comm_backend`` and ``timeout_s``
            choose the communicators).
        memory: residual store (error feedback).
        seed: seed of the random generator used to sample for threshold estimation; give each
            rank its own (e.g. a constant plus the global rank) for reproducible runs.
        ranks_per_node: ranks per node (None: :func:`~deepspeed_dgc.topology.resolve_ranks_per_node`
            at first use, collective).
    """

    def __init__(self, cfg: DGCConfig, memory: ErrorFeedback, seed: int = 0, ranks_per_node: Optional[int] = None):
        self.cfg = cfg
        self.memory = memory
        self.seed = seed
        self.ranks_per_node = ranks_per_node
        self._generators = {}
        self._comms = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        if key not in self._generators:
            self._generators[key] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[key]

    def comms_for(self, group) -> ReduceComms:
        """The communicators of ``group``, created once per group (collective over the world the first time)."""
        if group not in self._comms:
            if self.ranks_per_node is None:
                self.ranks_per_node = resolve_ranks_per_node(self.cfg)[0]
            self._comms[group] = build_reduce_comms(self.cfg, group, self.ranks_per_node)
        return self._comms[group]

    def _fingerprint(self, numels: Sequence[int], sparse: Sequence[bool], comm_dtype: torch.dtype) -> int:
        desc = json.dumps([
            self.cfg.density, self.cfg.quantization, self.cfg.group_size, self.cfg.min_numel, self.cfg.topology,
            self.ranks_per_node if self.cfg.topology == "hierarchical" else None,
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

        Flat topology: every rank compresses its whole local gradient (plus residual) and sends each
        owner its slice. Hierarchical topology (N nodes of L ranks): first a dense reduce-scatter
        inside the node in the communication dtype, after which local rank l holds the node's sum of
        the slices of owners ``k*L + l`` (k = 0..N-1); then it compresses those N slices (plus its
        residual, which therefore has about n/L elements) and exchanges them with the rank l of every
        other node. With one node nothing is compressed.

        Args:
            grads: full local gradients, one per parameter, any shape (n_i elements), any float dtype.
                Every rank passes tensors of the same sizes in the same order.
            keys: error-feedback key of each gradient (``param.ds_id``).
            group: process group of the partition (None: the world).
            comm_dtype: dtype of values on the wire when ``quantization`` is ``"none"`` (and of the
                dense intra-node hop).
            loss_scale: current loss scale the gradients are multiplied by (residuals are stored
                divided by it).

        Returns:
            ``(partitions, result)``: per gradient, an fp32 tensor of this rank's slice of the
            mean, shape ``(max(0, min(c, n - r*c)),)``; and a :class:`ReduceResult`.

        Raises:
            DGCProtocolError: a payload from another rank does not match this rank's
                expectation (config or bucket differ between ranks); every rank that receives
                such a payload raises.
            DGCTimeoutError: an exchange did not finish within ``dgc.timeout_s``.
        """
        comms = self.comms_for(group)
        world, rank = comms.world_size, comms.rank
        device = grads[0].device
        numels = [g.numel() for g in grads]
        sparse = [self.is_sparse(n) for n in numels]
        # Stock casts to the communication dtype and pre-divides by W; an fp32 division rounded to
        # that dtype gives the same values.
        accs = [g.reshape(-1).to(comm_dtype).float().div(world) for g in grads]
        chunks = [-(-n // world) for n in numels]
        real_m = _real_mask(numels, chunks, world, device)
        fingerprint = self._fingerprint(numels, sparse, comm_dtype)

        if comms.hierarchical:
            acc_m = _owner_matrix(accs, chunks, world, torch.float32, device)  # (W, C)
            intra_before, inter_before = comms.intra.wire_bytes, comms.inter.wire_bytes
            out, finite, kept = self._reduce_two_hops(acc_m, real_m, chunks, keys, numels, sparse, comms, comm_dtype,
                                                      loss_scale, fingerprint)
            intra_bytes = comms.intra.wire_bytes - intra_before
            inter_bytes = comms.inter.wire_bytes - inter_before
        else:
            out, finite, kept = self._reduce_flat(accs, real_m, chunks, keys, numels, sparse, comms, comm_dtype,
                                                  loss_scale, fingerprint)
            sent = comms.flat.last_sent_bytes
            intra_bytes = sum(b for d, b in enumerate(sent) if comms.dest_nodes[d] == comms.dest_nodes[rank])
            inter_bytes = sum(sent) - intra_bytes
        if self.cfg.quantization == "none" and comm_dtype != torch.float32:
            out = out.to(comm_dtype).float()  # stock's result is in the communication dtype

        outputs, col = [], 0
        for n, c in zip(numels, chunks):
            outputs.append(out.narrow(0, col, max(0, min(c, n - rank * c))))
            col += c
        if not finite:
            out.fill_(float("nan"))

        off_node = sum(1 for node in comms.dest_nodes if node != comms.dest_nodes[rank])
        result = ReduceResult(wire_bytes=intra_bytes + inter_bytes,
                              dense_fp32_bytes=sum((world - 1) / world * n * 4 for n in numels),
                              kept=kept,
                              numel=sum(numels),
                              finite=finite,
                              intra_node_wire_bytes=intra_bytes,
                              inter_node_wire_bytes=inter_bytes,
                              inter_node_dense_fp32_bytes=sum(off_node / world * n * 4 for n in numels))
        return outputs, result

    def _add_residual(self, acc: torch.Tensor, key: int, loss_scale: float) -> None:
        """``acc += residual * loss_scale`` in place (residuals are stored unscaled), if there is one."""
        residual = self.memory.get(key) if self.cfg.error_feedback else None
        if residual is not None:
            acc.add_(residual.view_as(acc), alpha=loss_scale)

    def _stage_residuals(self, acc_m: torch.Tensor, sent_m: torch.Tensor, keys, numels, chunks, loss_scale: float,
                         trim: bool) -> None:
        """Stage ``acc - sent`` (unscaled) per key: the tensor's columns of the matrix, flattened
        (row-major), cut to its ``numel`` when ``trim`` (flat layout)."""
        if not self.cfg.error_feedback or self.cfg.lossless:
            return
        res_m = (acc_m - sent_m).div_(loss_scale)
        col = 0
        for key, n, c in zip(keys, numels, chunks):
            block = res_m[:, col:col + c].reshape(-1)
            self.memory.stage(key, (block[:n] if trim else block).clone())
            col += c

    def _reduce_flat(self, accs, real_m, chunks, keys, numels, sparse, comms, comm_dtype, loss_scale, fingerprint):
        """One compressed all-to-all over the group; residuals hold the whole local tensor."""
        world, device = comms.world_size, real_m.device
        for acc, key in zip(accs, keys):
            self._add_residual(acc, key, loss_scale)
        finite = all(bool(torch.isfinite(a).all()) for a in accs)
        masks = [
            select_topk(a, self.cfg.density, self._generator(device)) if s and finite else torch.ones(
                a.numel(), dtype=torch.bool, device=device) for a, s in zip(accs, sparse)
        ]
        acc_m = _owner_matrix(accs, chunks, world, torch.float32, device)
        mask_m = _owner_matrix(masks, chunks, world, torch.bool, device)
        out, sent_m = self._compress_exchange(acc_m, mask_m, real_m, chunks, sparse, comms.flat, comms.rank, comm_dtype,
                                              fingerprint, finite)
        if finite:
            self._stage_residuals(acc_m, sent_m, keys, numels, chunks, loss_scale, trim=True)
        return out, finite, int(mask_m.sum()) if finite else 0

    def _reduce_two_hops(self, acc_m, real_m, chunks, keys, numels, sparse, comms, comm_dtype, loss_scale, fingerprint):
        """Dense reduce-scatter inside the node, then the compressed exchange between nodes."""
        L, N = comms.ranks_per_node, comms.n_nodes
        C = acc_m.shape[1]
        payloads = [_bytes(acc_m[j::L].to(comm_dtype)) for j in range(L)]  # rows of owners k*L + j
        received = comms.intra.all_to_all(payloads)
        node_sum = torch.zeros(N, C, dtype=torch.float32, device=acc_m.device)
        for buf in received:  # in local-rank order, the same on every rank
            node_sum.add_(buf.view(comm_dtype).view(N, C).float())
        real_rows = real_m[comms.local_rank::L]  # (N, C): real elements of the owners k*L + l
        if N == 1:
            return node_sum[0], True, int(real_rows.sum())
        col = 0
        for key, c in zip(keys, chunks):
            self._add_residual(node_sum[:, col:col + c], key, loss_scale)
            col += c
        finite = bool(torch.isfinite(node_sum).all())
        mask_m = real_rows.clone()
        if finite:
            col = 0
            for c, s in zip(chunks, sparse):
                if s:
                    real = real_rows[:, col:col + c]
                    block_mask = torch.zeros_like(real)
                    block_mask[real] = select_topk(node_sum[:, col:col + c][real], self.cfg.density,
                                                   self._generator(acc_m.device))
                    mask_m[:, col:col + c] = block_mask
                col += c
        out, sent_m = self._compress_exchange(node_sum, mask_m, real_rows, chunks, sparse, comms.inter, comms.node,
                                              comm_dtype, fingerprint, finite)
        if finite:
            self._stage_residuals(node_sum, sent_m, keys, numels, chunks, loss_scale, trim=False)
        return out, finite, int(mask_m.sum()) if finite else 0

    def _compress_exchange(self, acc_m: torch.Tensor, mask_m: torch.Tensor, real_m: torch.Tensor, chunks, sparse,
                           comm, my_row: int, comm_dtype: torch.dtype, fingerprint: int,
                           finite: bool) -> Tuple[torch.Tensor, torch.Tensor]:
        """Encode row o of the kept entries for rank o of ``comm``, exchange, and sum what arrived.

        Args:
            acc_m: fp32 ``(R, C)``, values to send, row o for rank o of ``comm`` (R ranks).
            mask_m: bool ``(R, C)``, the kept entries.
            real_m: bool ``(R, C)``, real elements (not padding).
            chunks: columns of each tensor; sparse: whether each tensor is sparsified (positions of
                the others are implied, not sent).
            my_row: this rank's index in ``comm``.
            finite: False sends empty payloads (this rank's output is then poisoned by the caller).

        Returns:
            ``(out, sent_m)``: the fp32 sum over senders of row ``my_row``, shape ``(C,)``; and what
            was sent, dequantized, ``(R, C)`` (the residual is ``acc_m - sent_m``).
        """
        device = acc_m.device
        if not finite:
            mask_m = torch.zeros_like(mask_m)
        implied_m = real_m.clone()  # positions sent without an index
        implied_m[:, _columns(chunks, sparse, device)] = False
        sent_m = torch.zeros_like(acc_m)
        seg_ends = torch.cumsum(torch.tensor(chunks, dtype=torch.long, device=device), 0)
        payloads = []
        for o in range(acc_m.shape[0]):
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
        received = comm.all_to_all(payloads)
        out = self._sum_received(received, implied_m[my_row], seg_ends, comm_dtype, fingerprint)
        return out, sent_m

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
