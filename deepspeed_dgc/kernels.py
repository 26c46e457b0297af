"""Compression of one bucket into per-owner payloads, and decoding: reference and fused paths.

The reducer describes a bucket as a :class:`CompressJob`: T tensors laid out as an owner matrix of
R rows (row r goes to rank r of the communicator) and ``C = sum(c_i)`` columns. Two
implementations turn it into the same payload bytes and the same new residuals:

- :class:`ReferenceOps`, PyTorch ops, the oracle of the tests and the fallback;
- :class:`FusedCPUOps` (``csrc/dgc/dgc_cpu.cpp``, one OpenMP pass over the dense data) and
  :class:`FusedCUDAOps` (``csrc/dgc/dgc_cuda.cu``: accumulation, INT4 codes and decode as CUDA
  kernels; selection and packing of the kept ~density fraction as torch ops on the device).

:func:`get_ops` picks one from ``dgc.kernels``: ``"auto"`` (fused where it loads, else the
reference with a one-time warning saying why), ``"fused"`` (fails loudly if the op cannot load)
or ``"reference"``.

Wire format of one payload (sender -> owner), aligned to 4 bytes::

    int32[5]  header: MAGIC, fingerprint (config and bucket shape), kept count, index bytes, scale groups
    fp32[G]   group scales (groups restart at each tensor; absent without quantization)
    values    kept values in column order: codes of the value format (INT4 two per byte, INT2 four,
              INT1 eight, FP8 one; see compressor.quantize_values) or raw communication dtype
    uint8[]   positions of the kept values of sparsified tensors (the others are implied): varint
              gaps, or with ``index_coding`` "bitmap" one bit per real element of those tensors

The fused ops code INT4 with round-to-nearest and varint positions; a job asking for anything
else (another format, stochastic rounding, bitmap positions) runs the reference code, which
gives the same bytes either way, so ranks may mix the two paths.
"""

import logging
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from .compressor import (decode_indices, dequantize_values, encode_indices, int4_group_ids, int4_group_scales,
                         pack_bits, pack_nibbles, quantize_values, reused_threshold, sample_indices, target_count,
                         topk_threshold, unpack_bits)

logger = logging.getLogger("deepspeed_dgc")

MAGIC = 0x44474331  # "DGC1"
HEADER_INT32 = 5
KERNEL_CHOICES = ("auto", "fused", "reference")


@dataclass
class CompressJob:
    """One bucket to compress: where its values are, how rows and columns are laid out.

    Tensor i has ``numels[i]`` elements split into rows of ``chunks[i] = c_i`` columns; row r holds
    the ``real_count(i, r) = clamp(n_i - row_owner[r] * c_i, 0, c_i)`` elements of owner
    ``row_owner[r]``, the rest is padding. Element (r, j) is read from
    ``srcs[i][offsets[i] + r * row_strides[i] + j]``.

    Attributes:
        srcs: contiguous 1-D tensors (fp32, bf16 or fp16) holding the values.
        offsets, row_strides: element offsets of row 0 and between rows, per tensor.
        numels, chunks: n_i and c_i per tensor.
        sparse: whether tensor i is top-k sparsified (else every real element is sent, without indices).
        row_owner: global owner index of each row (flat: ``0..W-1``; hierarchical: ``k*L + l``).
        residuals: error-feedback residual per tensor (fp32, ``residual_numels[i]`` elements, element
            (r, j) at ``r * c_i + j``, unscaled) or None.
        residual_numels: length of the residual: n_i (flat) or ``R * c_i`` (hierarchical).
        divisor: the values are divided by it first (flat: the world size; hierarchical: 1).
        loss_scale: residuals are multiplied by it when added and divided by it when stored.
        density: top-k density; samples: positions of the threshold sample per tensor
            (:func:`sample_indices` over the real elements, row-major), None: all of them.
        group_size: values per scale; quantize: False sends raw values in ``value_dtype``.
        fingerprint: int31 written in every header.
        want_residual: return the new residuals (error feedback on and not lossless).
        value_format: format of quantized values (``compressor.VALUE_BITS``), default ``"int4"``.
        rounding_generator: stochastic rounding from this generator (INT4/INT2), None: to nearest.
        index_coding: ``"varint"`` gaps or a ``"bitmap"`` over the real elements of sparse tensors.
        threshold: keep the elements of sparse tensors with ``|acc| >= threshold * loss_scale`` (the threshold is in
            unscaled gradient units) instead of top-k (None: top-k).
        reuse_thresholds: per tensor, a threshold estimated at an earlier step (unscaled, as ``threshold``) that
            top-k reuses instead of estimating one from ``samples[i]``
            (:func:`~deepspeed_dgc.compressor.reused_threshold`), or None; None for the whole list: estimate all.
    """
    srcs: List[torch.Tensor]
    offsets: List[int]
    row_strides: List[int]
    numels: List[int]
    chunks: List[int]
    sparse: List[bool]
    row_owner: List[int]
    residuals: List[Optional[torch.Tensor]]
    residual_numels: List[int]
    divisor: float
    loss_scale: float
    density: float
    samples: List[Optional[torch.Tensor]]
    group_size: int
    quantize: bool
    value_dtype: torch.dtype
    fingerprint: int
    want_residual: bool
    value_format: str = "int4"
    rounding_generator: Optional[torch.Generator] = None
    index_coding: str = "varint"
    threshold: Optional[float] = None
    reuse_thresholds: Optional[List[Optional[float]]] = None

    @property
    def rows(self) -> int:
        return len(self.row_owner)

    def real_counts(self, i: int) -> List[int]:
        """Real elements of tensor i in each row."""
        n, c = self.numels[i], self.chunks[i]
        return [max(0, min(c, n - o * c)) for o in self.row_owner]

    def real_mask(self, i: int, device) -> torch.Tensor:
        """Bool ``(R, c_i)``: True where row r of tensor i holds a real element, not padding."""
        return torch.tensor(self.real_counts(i), device=device)[:, None] > torch.arange(self.chunks[i], device=device)

    def targets(self) -> List[int]:
        """Top-k target count per tensor (over its real elements in all rows)."""
        return [target_count(sum(self.real_counts(i)), self.density) for i in range(len(self.numels))]


def draw_samples(real_totals: Sequence[int], sparse: Sequence[bool], density: float,
                 generator: Optional[torch.Generator], device) -> List[Optional[torch.Tensor]]:
    """Threshold samples of every sparse tensor, drawn in tensor order from ``generator``.

    Args:
        real_totals: real elements per tensor (all rows); sparse: per tensor.

    Returns:
        Per tensor, :func:`sample_indices` (None for tensors sent whole or small enough to use whole).
        Both paths use the same draws, so they select the same elements.
    """
    return [
        sample_indices(m, target_count(m, density), generator, device) if s else None
        for m, s in zip(real_totals, sparse)
    ]


@dataclass
class CompressOutput:
    """Result of compressing one bucket.

    Attributes:
        payloads: uint8 payload per row (rank of the communicator).
        residuals: new residual per tensor (fp32, unscaled), or None (not finite, or not wanted).
        finite: False when any accumulated value was Inf/NaN (payloads then carry nothing).
        kept: values sent, all rows.
        thresholds: per tensor, the threshold that selected its kept elements, unscaled (divided by the loss
            scale; what :attr:`CompressJob.reuse_thresholds` takes), or None where every real element was kept
            (tensors sent whole, k >= m) or nothing was sent (not finite). Only reported for jobs with
            ``reuse_thresholds`` (a list, possibly all None) or a fixed ``threshold``; else all None (reading them
            back would cost a device synchronisation per tensor on a GPU).
    """
    payloads: List[torch.Tensor]
    residuals: Optional[List[torch.Tensor]]
    finite: bool
    kept: int
    thresholds: List[Optional[float]]


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


class ReferenceOps:
    """The PyTorch implementation: several passes, any device, INT4 or raw values."""

    name = "reference"

    def accumulate(self, job: CompressJob) -> Tuple[torch.Tensor, torch.Tensor]:
        """``acc = src / divisor + residual * loss_scale`` as an fp32 owner matrix.

        Returns:
            ``(acc_m, real_m)``: fp32 ``(R, C)`` (padding 0) and bool ``(R, C)`` (real elements).
        """
        R = job.rows
        blocks, reals = [], []
        for i, src in enumerate(job.srcs):
            n, c, off, stride = job.numels[i], job.chunks[i], job.offsets[i], job.row_strides[i]
            flat_layout = off == 0 and stride == c and src.numel() == n
            x = src if flat_layout else torch.as_strided(src, (R, c), (stride, 1), off)
            a = x.to(torch.float32, copy=True) if job.divisor == 1 else x.float().div(job.divisor)
            residual = job.residuals[i]
            if residual is not None:
                r = residual if flat_layout else residual.view(R, c)
                a.add_(r if job.loss_scale == 1 else r.mul(job.loss_scale))
            if flat_layout:
                a = torch.nn.functional.pad(a, (0, R * c - n)).view(R, c)
            blocks.append(a)
            reals.append(job.real_mask(i, src.device))
        device = job.srcs[0].device
        if not blocks:
            return torch.empty(R, 0, device=device), torch.empty(R, 0, dtype=torch.bool, device=device)
        return torch.cat(blocks, dim=1), torch.cat(reals, dim=1)

    def compress(self, job: CompressJob) -> CompressOutput:
        """Select, quantize and encode every row of ``job``; see :class:`CompressJob`."""
        acc_m, real_m = self.accumulate(job)
        return self._select_encode(job, acc_m, real_m, bool(torch.isfinite(acc_m).all()))

    def _select_encode(self, job: CompressJob, acc_m: torch.Tensor, real_m: torch.Tensor, finite: bool) -> CompressOutput:
        mask_m = real_m.clone() if finite else torch.zeros_like(real_m)
        thresholds = [None] * len(job.chunks)
        col = 0
        for i, (c, k) in enumerate(zip(job.chunks, job.targets())):
            real = real_m[:, col:col + c]
            if finite and job.sparse[i] and (job.threshold is not None or k < int(real.sum())):
                mag = acc_m[:, col:col + c].abs()
                reuse = job.reuse_thresholds[i] if job.reuse_thresholds else None
                if job.threshold is not None:  # rounded to fp32 as the fused op does (a host float: no copy)
                    threshold = float(torch.tensor(job.threshold * job.loss_scale, dtype=torch.float32))
                elif reuse is not None:
                    threshold = reused_threshold(mag[real], k, reuse * job.loss_scale)
                else:
                    threshold = topk_threshold(mag[real], k, job.samples[i])
                mask_m[:, col:col + c] = (mag >= threshold) & real
                if job.reuse_thresholds is not None or job.threshold is not None:  # (a device sync on a GPU)
                    thresholds[i] = float(threshold) / job.loss_scale
            col += c
        payloads, sent_m = self._encode_rows(job, acc_m, mask_m, real_m)
        residuals = None
        if finite and job.want_residual:
            res_m = (acc_m - sent_m).div_(job.loss_scale)
            residuals, col = [], 0
            for c, rn in zip(job.chunks, job.residual_numels):
                residuals.append(res_m[:, col:col + c].reshape(-1)[:rn].clone())
                col += c
        return CompressOutput(payloads, residuals, finite, int(mask_m.sum()) if finite else 0, thresholds)

    def _encode_rows(self, job: CompressJob, acc_m, mask_m, real_m) -> Tuple[List[torch.Tensor], torch.Tensor]:
        """Payload of every row, and what was sent (decoded) as an fp32 ``(R, C)`` matrix."""
        device = acc_m.device
        implied_m = real_m.clone()  # positions sent without an index
        col = 0
        for c, s in zip(job.chunks, job.sparse):
            if s:
                implied_m[:, col:col + c] = False
            col += c
        sent_m = torch.zeros_like(acc_m)
        seg_ends = torch.cumsum(torch.tensor(job.chunks, dtype=torch.long, device=device), 0)
        payloads = []
        sparse_cols = ~implied_m & real_m  # bitmap coding: one bit per real element of a sparse tensor
        for o in range(acc_m.shape[0]):
            pos = mask_m[o].nonzero().squeeze(1)
            if job.index_coding == "bitmap":
                index_bytes = pack_bits(mask_m[o][sparse_cols[o]].to(torch.uint8), 1)
            else:
                indexed = pos[~implied_m[o][pos]]
                index_bytes = encode_indices(indexed, torch.tensor([indexed.numel()], device=device))
            vals = acc_m[o][pos]
            if job.quantize:
                values, scales, sent_m[o][pos] = self._quantize(vals, job, _segment_counts(pos, seg_ends))
            else:
                values, scales = vals.to(job.value_dtype), torch.empty(0, dtype=torch.float32, device=device)
                sent_m[o][pos] = values.float()
            header = torch.tensor([MAGIC, job.fingerprint, pos.numel(), index_bytes.numel(), scales.numel()],
                                  dtype=torch.int32, device=device)
            payload = torch.cat([_as_bytes(header), _as_bytes(scales), _as_bytes(values), index_bytes])
            pad = -payload.numel() % 4
            payloads.append(torch.cat([payload, payload.new_zeros(pad)]) if pad else payload)
        return payloads, sent_m

    def _quantize(self, vals: torch.Tensor, job: CompressJob, segment_counts: torch.Tensor):
        """``(packed, scales, decoded)`` of :func:`~deepspeed_dgc.compressor.quantize_values`."""
        return quantize_values(vals, job.value_format, job.group_size, segment_counts, job.rounding_generator)

    def decode_add(self, out: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, index_bytes: torch.Tensor,
                   kept: int, n_indexed: int, seg_real: Sequence[int], chunks: Sequence[int], sparse: Sequence[bool],
                   group_size: int, quantize: bool, value_dtype: torch.dtype, value_format: str = "int4",
                   index_coding: str = "varint") -> None:
        """Add one sender's decoded payload body into this rank's row ``out``.

        Args:
            out: fp32 ``(C,)``, this rank's row of the owner matrix (padded layout), updated in place.
            values: packed codes of ``value_format`` or ``kept`` raw values in ``value_dtype``.
            scales: fp32 scales, one per group (groups restart at each tensor).
            index_bytes: varint gaps of the kept positions of sparse tensors.
            kept, n_indexed: values in the payload, and how many of them carry an index.
            seg_real: real elements of each tensor in this row; chunks: c_i; sparse: per tensor.

        Raises:
            ValueError: the body does not decode to ``kept`` positions inside the row.
        """
        pos, counts = _decode_positions(out.numel(), index_bytes, kept, n_indexed, seg_real, chunks, sparse, index_coding)
        if quantize:
            vals = dequantize_values(values, scales, kept, value_format, group_size, counts)
        else:
            vals = values.float()
        out.index_add_(0, pos, vals)


class FusedCPUOps(ReferenceOps):
    """The fused OpenMP op (``dgc_cpu_op``): one pass over the dense data; INT4 only."""

    name = "fused-cpu"

    def __init__(self, op):
        self.op = op

    def compress(self, job: CompressJob) -> CompressOutput:
        if not fused_can_code(job):
            return ReferenceOps.compress(self, job)
        empty_f = torch.empty(0, dtype=torch.float32)
        empty_l = torch.empty(0, dtype=torch.long)
        if job.threshold is not None:
            fixed = [float(job.threshold)] * len(job.srcs)
        else:
            fixed = [-1.0 if t is None else float(t) for t in (job.reuse_thresholds or [None] * len(job.srcs))]
        payloads, residuals, finite, kept, used = self.op.compress_bucket(
            [s.contiguous() for s in job.srcs], list(job.offsets), list(job.row_strides),
            [empty_f if r is None else r.contiguous() for r in job.residuals], list(job.residual_numels),
            list(job.numels), list(job.chunks), list(job.sparse), list(job.row_owner), job.targets(),
            [empty_l if s is None else s for s in job.samples], float(job.divisor), float(job.loss_scale),
            job.group_size, job.fingerprint, job.want_residual, fixed, job.threshold is None)
        report = job.reuse_thresholds is not None or job.threshold is not None
        return CompressOutput(list(payloads), list(residuals) if finite and job.want_residual else None, finite, kept,
                              [t if t >= 0 and report else None for t in used])

    def decode_add(self, out, values, scales, index_bytes, kept, n_indexed, seg_real, chunks, sparse, group_size,
                   quantize, value_dtype, value_format="int4", index_coding="varint") -> None:
        if not fused_can_decode(quantize, value_format, index_coding, sparse):
            return ReferenceOps.decode_add(self, out, values, scales, index_bytes, kept, n_indexed, seg_real, chunks,
                                           sparse, group_size, quantize, value_dtype, value_format, index_coding)
        self.op.decode_add(out, values.contiguous(), scales.contiguous(), index_bytes.contiguous(), kept, n_indexed,
                           list(seg_real), list(chunks), list(sparse), group_size)


class FusedCUDAOps(ReferenceOps):
    """The CUDA op (``dgc_cuda_op``): accumulation, INT4 coding and decode as CUDA kernels."""

    name = "fused-cuda"

    def __init__(self, op):
        self.op = op

    def accumulate(self, job: CompressJob) -> Tuple[torch.Tensor, torch.Tensor]:
        C = sum(job.chunks)
        acc_m = torch.empty(job.rows, C, dtype=torch.float32, device=job.srcs[0].device)
        owners = torch.tensor(job.row_owner, dtype=torch.long, device=acc_m.device)
        col = 0
        reals = []
        for i, src in enumerate(job.srcs):
            residual = job.residuals[i]
            self.op.accumulate(acc_m, col, src, job.offsets[i], job.row_strides[i], job.numels[i], job.chunks[i],
                               owners, residual if residual is not None else torch.empty(0, device=acc_m.device),
                               float(job.divisor), float(job.loss_scale), _stream())
            reals.append(job.real_mask(i, acc_m.device))
            col += job.chunks[i]
        return acc_m, torch.cat(reals, dim=1)

    def decode_add(self, out, values, scales, index_bytes, kept, n_indexed, seg_real, chunks, sparse, group_size,
                   quantize, value_dtype, value_format="int4", index_coding="varint") -> None:
        if not fused_can_decode(quantize, value_format, index_coding, sparse):
            return ReferenceOps.decode_add(self, out, values, scales, index_bytes, kept, n_indexed, seg_real, chunks,
                                           sparse, group_size, quantize, value_dtype, value_format, index_coding)
        pos, counts = _decode_positions(out.numel(), index_bytes, kept, n_indexed, seg_real, chunks, sparse)
        gid, n_groups = int4_group_ids(counts, group_size)
        if n_groups != scales.numel():
            raise ValueError(f"{scales.numel()} scales for {n_groups} groups")
        self.op.dequant_add(out, pos, values.contiguous(), scales.contiguous(), gid, _stream())

    def _quantize(self, vals: torch.Tensor, job: CompressJob, segment_counts: torch.Tensor):
        if job.value_format != "int4" or job.rounding_generator is not None:
            return ReferenceOps._quantize(self, vals, job, segment_counts)
        group_size = job.group_size
        gid, n_groups = int4_group_ids(segment_counts, group_size)
        scales = int4_group_scales(vals, gid, n_groups)
        nibbles, decoded = self.op.int4_encode(vals.contiguous(), scales, gid, _stream())
        return pack_nibbles(nibbles), scales, decoded


def fused_can_decode(quantize: bool, value_format: str, index_coding: str, sparse: Sequence[bool]) -> bool:
    """Whether the fused ops decode such a payload: INT4 values with varint positions (or none sent)."""
    return quantize and value_format == "int4" and (index_coding == "varint" or not any(sparse))


def fused_can_code(job: CompressJob) -> bool:
    """Whether the fused ops code this job themselves: what they decode, rounded to nearest."""
    return (fused_can_decode(job.quantize, job.value_format, job.index_coding, job.sparse)
            and job.rounding_generator is None)


def _stream() -> int:
    """The current CUDA stream as an integer handle, for the CUDA op's launchers."""
    return torch.cuda.current_stream().cuda_stream


def _decode_positions(row_numel: int, index_bytes: torch.Tensor, kept: int, n_indexed: int, seg_real: Sequence[int],
                      chunks: Sequence[int], sparse: Sequence[bool],
                      index_coding: str = "varint") -> Tuple[torch.Tensor, torch.Tensor]:
    """Sorted positions (columns of the row) of a payload's ``kept`` values, and their count per tensor.

    Raises:
        ValueError: the index bytes are malformed, point past the row, or do not add up to ``kept``.
    """
    device = index_bytes.device
    implied = torch.cat([
        torch.arange(col, col + r, device=device) for col, r, s in zip(_starts(chunks), seg_real, sparse) if not s
    ] or [torch.empty(0, dtype=torch.long, device=device)])
    if index_coding == "bitmap":
        cols = torch.cat([
            torch.arange(col, col + r, device=device) for col, r, s in zip(_starts(chunks), seg_real, sparse) if s
        ] or [torch.empty(0, dtype=torch.long, device=device)])
        if index_bytes.numel() != -(-cols.numel() // 8):
            raise ValueError(f"bitmap of {index_bytes.numel()} bytes for {cols.numel()} elements")
        indexed = cols[unpack_bits(index_bytes, 1, cols.numel()).bool()]
        if indexed.numel() != n_indexed:
            raise ValueError(f"bitmap marks {indexed.numel()} positions, the header says {n_indexed}")
    else:
        indexed = decode_indices(index_bytes, torch.tensor([n_indexed], device=device))
    if n_indexed and (int(indexed.max()) >= row_numel or int(indexed.min()) < 0):
        raise ValueError(f"index past the partition of {row_numel} elements")  # also an int64 wrap-around
    pos = torch.sort(torch.cat([implied, indexed])).values if n_indexed else implied
    if pos.numel() != kept:
        raise ValueError(f"payload holds {pos.numel()} positions for {kept} kept values")
    seg_ends = torch.cumsum(torch.tensor(list(chunks), dtype=torch.long, device=device), 0)
    return pos, _segment_counts(pos, seg_ends)


def _starts(chunks: Sequence[int]) -> List[int]:
    out, col = [], 0
    for c in chunks:
        out.append(col)
        col += c
    return out


def _segment_counts(pos: torch.Tensor, seg_ends: torch.Tensor) -> torch.Tensor:
    """Kept positions per tensor: ``pos`` (sorted columns of a row) counted by ``seg_ends`` ranges."""
    below_end = torch.searchsorted(pos, seg_ends)
    return torch.diff(below_end, prepend=below_end.new_zeros(1))


REFERENCE = ReferenceOps()
_warned = set()


class DGCKernelError(RuntimeError):
    """``dgc.kernels`` is ``"fused"`` and the fused op cannot load here (the message says why)."""


def load_fused_op(device_type: str):
    """Load the fused op for a torch device type (``"cpu"`` or ``"cuda"``).

    Returns:
        The extension module.

    Raises:
        RuntimeError: no compiler, no CUDA, missing sources or a failed build (message says why).
    """
    from op_builder import builder_for_device  # deferred: imports deepspeed's builders
    return builder_for_device(device_type)().load()


def get_ops(kernels: str, device_type: str, quantize: bool):
    """The implementation ``dgc.kernels`` asks for on this device.

    Args:
        kernels: ``"auto"``, ``"fused"`` or ``"reference"``.
        device_type: torch device type of the gradients (``"cpu"``, ``"cuda"``, ...).
        quantize: whether payloads are INT4 (the fused ops only code INT4).

    Returns:
        :class:`ReferenceOps`, :class:`FusedCPUOps` or :class:`FusedCUDAOps`.

    Raises:
        DGCKernelError: ``"fused"`` was asked for and the op cannot load or cannot serve this config.
        ValueError: unknown ``kernels``.
    """
    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"unknown kernels {kernels!r}; allowed: {', '.join(KERNEL_CHOICES)}")
    if kernels == "reference":
        return REFERENCE
    if not quantize:
        if kernels == "fused":
            raise DGCKernelError("'dgc.kernels' is \"fused\" but 'dgc.quantization' is \"none\": the fused ops only "
                                 "code INT4 payloads; use \"auto\" or \"reference\"")
        return REFERENCE
    if device_type not in ("cpu", "cuda"):
        reason = f"no fused op for device type {device_type!r}"
    else:
        try:
            op = load_fused_op(device_type)
            return FusedCUDAOps(op) if device_type == "cuda" else FusedCPUOps(op)
        except Exception as err:  # noqa: BLE001 -- any build/load failure means "fall back" (or fail for "fused")
            reason = f"{type(err).__name__}: {err}".strip()
    if kernels == "fused":
        raise DGCKernelError(f"'dgc.kernels' is \"fused\" but the fused {device_type} op cannot load: {reason}")
    if (device_type, reason) not in _warned:
        _warned.add((device_type, reason))
        logger.warning("deepspeed_dgc: fused %s op unavailable (%s); using the PyTorch reference path", device_type,
                       reason)
    return REFERENCE
