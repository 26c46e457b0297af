"""The fused ops (C++/OpenMP on CPU, CUDA on GPU) and the choice between them and the reference.

- :class:`FusedCPUOps` (``csrc/dgc/dgc_cpu.cpp``): one OpenMP pass over the dense data;
- :class:`FusedCUDAOps` (``csrc/dgc/dgc_cuda.cu``): accumulation, the codes of every format, decode and the
  weight codes as CUDA kernels; group scales, selection and packing of the kept ~density fraction as torch
  ops on the device.

Both give the bytes and residual bits of :class:`~deepspeed_dgc.codec.reference.ReferenceOps`. They code
every value format (INT4, INT2, INT1, FP8 e4m3/e5m2) rounded to nearest with varint positions, and the
weight formats of the quantized all-gather and of fp8 residual storage (INT8, FP8 e4m3, INT4); a job
asking for anything else (stochastic rounding, bitmap positions, raw values) runs the reference code,
which gives the same bytes either way, so ranks may mix the two paths. :func:`get_ops` picks one from
``dgc.kernels``.
"""

import logging
from typing import Sequence, Tuple

import torch

from . import wire
from .formats import (VALUE_BITS, WEIGHT_QMAX, ZERO_MASKED, _with_zero_masks, group_scales, int4_group_ids, int4_group_scales,
                      pack_bits, pack_nibbles, split_scales, weight_code_bytes)
from .indices import decode_positions
from .job import CompressJob, CompressOutput
from .reference import REFERENCE, ReferenceOps

logger = logging.getLogger("deepspeed_dgc")

KERNEL_CHOICES = ("auto", "fused", "reference")
_warned = set()


class DGCKernelError(RuntimeError):
    """``dgc.kernels`` is ``"fused"`` and the fused op cannot load here (the message says why)."""


# the numbering of value and weight formats in csrc/dgc/dgc_math.h (ValueFormat, WeightFormat)
VALUE_FORMAT_CODES = {"int4": 0, "int2": 1, "int1": 2, "fp8_e4m3": 3, "fp8_e5m2": 4}
WEIGHT_FORMAT_CODES = {"int8": 0, "fp8_e4m3": 1, "int4": 2}
assert set(VALUE_FORMAT_CODES) == set(VALUE_BITS)


def fused_can_decode(quantize: bool, value_format: str, index_coding: str, sparse: Sequence[bool]) -> bool:
    """Whether the fused ops decode such a payload: quantized values with varint positions (or none sent)."""
    return quantize and value_format in VALUE_FORMAT_CODES and (index_coding == "varint" or not any(sparse))


def fused_can_code(job: CompressJob) -> bool:
    """Whether the fused ops code this job themselves: what they decode, rounded to nearest."""
    return (fused_can_decode(job.quantize, job.value_format, job.index_coding, job.sparse)
            and job.rounding_generator is None)


def _row_decodable(row: wire.RowLayout) -> bool:
    return fused_can_decode(row.quantize, row.value_format, row.index_coding, row.sparse)


class FusedCPUOps(ReferenceOps):
    """The fused OpenMP op (``dgc_cpu_op``): one pass over the dense data, then every value format on the kept
    values; weight quantize and dequantize in one pass each."""

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
            [empty_l if s is None else s for s in job.samples], float(job.divisor), job.group_size,
            VALUE_FORMAT_CODES[job.value_format], job.fingerprint,
            job.want_residual, fixed, job.threshold is None)
        report = job.reuse_thresholds is not None or job.threshold is not None
        return CompressOutput(list(payloads), list(residuals) if finite and job.want_residual else None, finite, kept,
                              [t if t >= 0 and report else None for t in used])

    def decode_add(self, out: torch.Tensor, body: wire.Body, row: wire.RowLayout) -> None:
        if not _row_decodable(row):
            return ReferenceOps.decode_add(self, out, body, row)
        self.op.decode_add(out, body.values.contiguous(), body.scales.contiguous(), body.index_bytes.contiguous(),
                           body.kept, body.n_indexed, list(row.seg_real), list(row.chunks), list(row.sparse),
                           row.group_size, VALUE_FORMAT_CODES[row.value_format])

    def quantize_weights(self, x, fmt, group_size, segments=None):
        if x.device.type != "cpu":
            return ReferenceOps.quantize_weights(self, x, fmt, group_size, segments)
        return self.op.quantize_weights(x.reshape(-1).contiguous(), WEIGHT_FORMAT_CODES[fmt], group_size,
                                        _segment_list(x.numel(), segments))

    def dequantize_weights_into(self, out, codes, scales, fmt, group_size, segments=None):
        if out.device.type != "cpu" or not out.is_contiguous() or out.dtype not in _FUSED_DTYPES:
            return ReferenceOps.dequantize_weights_into(self, out, codes, scales, fmt, group_size, segments)
        try:
            self.op.dequantize_weights(codes.contiguous(), scales.contiguous(), out.view(-1), WEIGHT_FORMAT_CODES[fmt],
                                       group_size, _segment_list(out.numel(), segments))
        except ValueError as err:  # a scale count that does not match, as the reference says it
            raise ValueError(str(err)) from None


_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _segment_list(n: int, segments) -> list:
    """Segment lengths for the op (empty: one segment), checked as the reference checks them."""
    if segments is None:
        return []
    if sum(segments) != n:
        raise ValueError(f"segments of {sum(segments)} elements for {n} weights")
    return [int(s) for s in segments]


class FusedCUDAOps(ReferenceOps):
    """The CUDA op (``dgc_cuda_op``): accumulation, value and weight codes and decode as CUDA kernels."""

    name = "fused-cuda"

    def __init__(self, op):
        self.op = op
        self._owners = {}  # (row owners, device) -> int64 device tensor, copied once

    def accumulate(self, job: CompressJob) -> torch.Tensor:
        C = sum(job.chunks)
        acc_m = torch.empty(job.rows, C, dtype=torch.float32, device=job.srcs[0].device)
        key = (tuple(job.row_owner), str(acc_m.device))
        if key not in self._owners:
            self._owners[key] = torch.tensor(job.row_owner, dtype=torch.long).pin_memory().to(acc_m.device,
                                                                                              non_blocking=True)
        owners = self._owners[key]
        col = 0
        for i, src in enumerate(job.srcs):
            residual = job.residuals[i]
            self.op.accumulate(acc_m, col, src, job.offsets[i], job.row_strides[i], job.numels[i], job.chunks[i],
                               owners, residual if residual is not None else torch.empty(0, device=acc_m.device),
                               float(job.divisor), _stream())
            col += job.chunks[i]
        return acc_m

    def decode_add(self, out: torch.Tensor, body: wire.Body, row: wire.RowLayout) -> None:
        if not _row_decodable(row):
            return ReferenceOps.decode_add(self, out, body, row)
        pos, counts = decode_positions(out.numel(), body.index_bytes, body.kept, body.n_indexed, row.seg_real,
                                       row.chunks, row.sparse)
        gid, n_groups = int4_group_ids(counts, row.group_size)
        fmt = row.value_format
        if fmt in ZERO_MASKED:
            scales, nonzero = split_scales(body.scales, gid, n_groups)
        elif n_groups != body.scales.numel():
            raise ValueError(f"{body.scales.numel()} scales for {n_groups} groups")
        else:
            scales, nonzero = body.scales, None
        if fmt == "int4":
            self.op.dequant_add(out, pos, body.values.contiguous(), scales.contiguous(), gid, _stream())
            return
        self.op.values_decode_add(out, pos, body.values.contiguous(), scales.contiguous(), gid,
                                  torch.empty(0, dtype=torch.bool, device=out.device) if nonzero is None else nonzero,
                                  VALUE_FORMAT_CODES[fmt], _stream())

    def quantize_weights(self, x, fmt, group_size, segments=None):
        if x.device.type != "cuda":
            return ReferenceOps.quantize_weights(self, x, fmt, group_size, segments)
        v = x.reshape(-1).float().contiguous()
        gid, n_groups = _weight_groups(v.numel(), group_size, segments, v.device)
        scales = torch.zeros(n_groups, dtype=torch.float32, device=v.device)
        scales.scatter_reduce_(0, gid, v.abs(), reduce="amax", include_self=True)
        scales.div_(WEIGHT_QMAX[fmt])
        codes = self.op.weights_encode(v, scales, gid, WEIGHT_FORMAT_CODES[fmt], _stream())
        return (pack_nibbles(codes) if fmt == "int4" else codes), scales

    def dequantize_weights_into(self, out, codes, scales, fmt, group_size, segments=None):
        if out.device.type != "cuda" or not out.is_contiguous() or out.dtype not in _FUSED_DTYPES:
            return ReferenceOps.dequantize_weights_into(self, out, codes, scales, fmt, group_size, segments)
        gid, n_groups = _weight_groups(out.numel(), group_size, segments, out.device)
        if n_groups != scales.numel():
            raise ValueError(f"dequantize_weights: {scales.numel()} scales for {n_groups} groups of {out.numel()} "
                             "weights")
        if codes.numel() < weight_code_bytes(out.numel(), fmt):
            raise ValueError(f"dequantize_weights: {codes.numel()} code bytes for {out.numel()} {fmt} weights")
        self.op.weights_decode(codes.contiguous(), scales.contiguous(), gid, out.view(-1), WEIGHT_FORMAT_CODES[fmt],
                               _stream())


def _weight_groups(n: int, group_size: int, segments, device):
    """Scale group of each of n weights (groups restart at each segment; sizes from the host, nothing read back)."""
    from .formats import _segment_tensor
    return int4_group_ids(_segment_tensor(n, segments, device), group_size)

    def _quantize(self, vals: torch.Tensor, job: CompressJob, segment_counts_: torch.Tensor):
        if job.rounding_generator is not None:
            return ReferenceOps._quantize(self, vals, job, segment_counts_)
        fmt = job.value_format
        gid, n_groups = int4_group_ids(segment_counts_, job.group_size)
        v = vals.float().contiguous()
        if fmt == "int4":
            scales = int4_group_scales(v, gid, n_groups)
            nibbles, decoded = self.op.int4_encode(v, scales, gid, _stream())
            return pack_nibbles(nibbles), scales, decoded
        scales = group_scales(v, gid, n_groups, fmt)
        codes, decoded = self.op.values_encode(v, scales, gid, VALUE_FORMAT_CODES[fmt], _stream())
        side = _with_zero_masks(v, gid, scales) if fmt in ZERO_MASKED else scales
        return pack_bits(codes, VALUE_BITS[fmt]), side, decoded


def _stream() -> int:
    """The current CUDA stream as an integer handle, for the CUDA op's launchers."""
    return torch.cuda.current_stream().cuda_stream


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
        quantize: whether payloads are quantized (the fused ops code quantized values and hand raw ones to the
            reference; pass True for the weight codes).

    Returns:
        :class:`~deepspeed_dgc.codec.reference.ReferenceOps`, :class:`FusedCPUOps` or :class:`FusedCUDAOps`.

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
                                 "code quantized payloads; use \"auto\" or \"reference\"")
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
