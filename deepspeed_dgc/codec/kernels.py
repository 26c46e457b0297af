"""The fused ops (C++/OpenMP on CPU, CUDA on GPU) and the choice between them and the reference.

- :class:`FusedCPUOps` (``csrc/dgc/cpu_*.cpp``): one OpenMP pass over the dense data;
- :class:`FusedCUDAOps` (``csrc/dgc/dgc_cuda_fixed.cu``, ``dgc_cuda.cu``): the fixed layout's gather of a bucket,
  its scales, codes and packing in one kernel and its decode-and-sum in one, the weight codes; the selection of the
  kept values stays torch ops on the device (batched, :mod:`~deepspeed_dgc.codec.fixed`).

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
from .formats import VALUE_BITS, ZERO_MASKED, int4_group_ids, pack_nibbles, split_scales, weight_code_bytes
from .indices import decode_positions
from .job import CompressJob, CompressOutput
from .reference import REFERENCE, ReferenceOps

logger = logging.getLogger("deepspeed_dgc")

KERNEL_CHOICES = ("auto", "fused", "reference")
_warned = set()
_LOAD_FAILURES = {}  # device type -> why its fused op did not load (remembered: one attempt, one warning)


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
        body, row = wire.implied_view(body, row)
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
    """The CUDA op (``dgc_cuda_op``): the fixed layout's bucket stages (the owner matrix gathered from the bucket's
    tensors, every scale group coded and packed into the payload in one kernel, every sender decoded and summed in
    one), the weight codes by segment tables, and the exact layout's accumulation and decode. No per-element index
    tensors: the kernels take small per-tensor or per-segment tables."""

    name = "fused-cuda"

    def __init__(self, op):
        self.op = op
        self._owners = {}  # (row owners, device) -> int64 device tensor, copied once

    def _rows(self, owners, device) -> torch.Tensor:
        key = (tuple(owners), str(device))
        if key not in self._owners:
            self._owners[key] = torch.tensor(list(owners), dtype=torch.long).pin_memory().to(device, non_blocking=True)
        return self._owners[key]

    # ---- the fixed layout --------------------------------------------------------------------------------------

    def gather(self, layout, srcs, out: torch.Tensor, divisor: float = 1.0, by_row: bool = False) -> torch.Tensor:
        """``out`` (R, C) fp32 or bf16 (:func:`~deepspeed_dgc.codec.fixed.matrix_dtype`) = the bucket's owner matrix
        of ``srcs`` (one dtype, contiguous), divided by ``divisor``, in one launch (:meth:`~deepspeed_dgc.codec.layout.
        BucketLayout.gather`'s result, times ``1 / divisor`` as torch divides by a scalar on a GPU, rounded to
        ``out``'s dtype once). Sources of mixed dtypes, not contiguous or not on the GPU take the torch ops."""
        if not all(s.is_cuda and s.is_contiguous() and s.dtype == srcs[0].dtype for s in srcs) or \
                srcs[0].dtype not in _FUSED_DTYPES:
            layout.gather(srcs, out, by_row=by_row)
            return out.div_(divisor) if divisor != 1 else out
        table = torch.tensor([[s.data_ptr(), layout.chunks[i], layout.numels[i], layout.cols[i]]
                              for i, s in ((i, srcs[i]) for i in layout.placement)], dtype=torch.long)
        table = table.pin_memory().to(out.device, non_blocking=True)
        owners = tuple(layout.key.owners)  # the chunk each row reads, then whose chunk it is (its real elements)
        rows = self._rows((tuple(range(layout.rows)) if by_row else owners) + owners, out.device)
        self.op.owner_gather(out, table, rows, srcs[0], float(divisor), _stream())
        return out

    def fixed_encode(self, A: torch.Tensor, plan, sel, payload: torch.Tensor) -> None:
        """The values of a fixed-layout bucket (its whole-sent columns in ``A``, fp32 or bf16, its slots in ``sel``,
        of ``A``'s dtype) coded and packed into ``payload`` with their scales, and ``A`` left holding the residual
        (:func:`~deepspeed_dgc.codec.fixed.encode`'s quantized path, rounded to nearest; its bits for INT4, INT2 and
        FP8)."""
        from math import gcd
        s_at, v_at, _, _ = plan.sections
        per = {"int4": 2, "int2": 4, "int1": 5}.get(plan.value_format, 1)
        span = plan.group_size * per // gcd(plan.group_size, per)
        empty_f = torch.empty(0, dtype=A.dtype, device=A.device)
        if sel is not None:  # an empty slot's element: -1 (sel.flat is not used after this)
            slots, flat = sel.values, sel.flat.masked_fill_(sel.valid.logical_not(), -1)
        else:
            slots, flat = empty_f, torch.empty(0, dtype=torch.int32, device=A.device)
        self.op.fixed_encode(A, plan.dense_columns, slots, flat, torch.empty(0, dtype=torch.int32, device=A.device),
                             payload, s_at, v_at, VALUE_FORMAT_CODES[plan.value_format], plan.group_size, span,
                             plan.values, plan.packed_values, _stream())

    def fixed_decode(self, received: torch.Tensor, plan, columns, valid, D, out: torch.Tensor) -> None:
        """This owner's row: every sender's whole-sent columns and slots decoded and summed in rank order into ``out``
        (``columns``, ``valid``: the slots' columns in the sparse region and which are filled; ``D`` fp32 ``(W, Cs)``
        scratch)."""
        s_at, v_at, _, _ = plan.sections
        empty = torch.empty(0, device=out.device)
        self.op.fixed_decode(received, s_at, v_at, VALUE_FORMAT_CODES[plan.value_format], plan.group_size,
                             plan.dense_columns, columns if columns is not None else empty.int(),
                             valid if valid is not None else empty.bool(), D if D is not None else empty, out,
                             _stream())

    # ---- the exact layout ----------------------------------------------------------------------------------------

    def accumulate(self, job: CompressJob) -> torch.Tensor:
        C = sum(job.chunks)
        acc_m = torch.empty(job.rows, C, dtype=torch.float32, device=job.srcs[0].device)
        owners = self._rows(job.row_owner, acc_m.device)
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
        body, row = wire.implied_view(body, row)
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

    # ---- weights (the quantized all-gather, fp8 residuals) --------------------------------------------------------

    def quantize_weights(self, x, fmt, group_size, segments=None):
        if x.device.type != "cuda":
            return ReferenceOps.quantize_weights(self, x, fmt, group_size, segments)
        v = x.reshape(-1).float().contiguous()
        table, n_groups = _segment_table(v.numel(), group_size, segments, v.device)
        scales = torch.empty(n_groups, dtype=torch.float32, device=v.device)
        codes = self.op.weights_encode_seg(v, table, group_size, scales, WEIGHT_FORMAT_CODES[fmt], _stream())
        return (pack_nibbles(codes) if fmt == "int4" else codes), scales

    def dequantize_weights_into(self, out, codes, scales, fmt, group_size, segments=None):
        if out.device.type != "cuda" or not out.is_contiguous() or out.dtype not in _FUSED_DTYPES:
            return ReferenceOps.dequantize_weights_into(self, out, codes, scales, fmt, group_size, segments)
        table, n_groups = _segment_table(out.numel(), group_size, segments, out.device)
        if n_groups != scales.numel():
            raise ValueError(f"dequantize_weights: {scales.numel()} scales for {n_groups} groups of {out.numel()} "
                             "weights")
        if codes.numel() < weight_code_bytes(out.numel(), fmt):
            raise ValueError(f"dequantize_weights: {codes.numel()} code bytes for {out.numel()} {fmt} weights")
        self.op.weights_decode_seg(codes.contiguous(), scales.contiguous(), table, group_size, out.view(-1),
                                   WEIGHT_FORMAT_CODES[fmt], _stream())


_TABLES = {}


def _segment_table(n: int, group_size: int, segments, device) -> Tuple[torch.Tensor, int]:
    """int64 ``(S, 2)``: each segment's first weight and first scale group (groups restart at each segment), cached per
    layout and device; and the number of groups."""
    lengths = tuple(int(s) for s in segments) if segments else (n, )
    if sum(lengths) != n:
        raise ValueError(f"segments of {sum(lengths)} elements for {n} weights")
    key = (lengths, group_size, str(device))
    if key not in _TABLES:
        if len(_TABLES) > 1024:
            _TABLES.clear()
        rows, start, group = [], 0, 0
        for length in lengths:
            rows.append((start, group))
            start, group = start + length, group + -(-length // group_size)
        _TABLES[key] = (torch.tensor(rows, dtype=torch.long).pin_memory().to(device, non_blocking=True), group)
    return _TABLES[key]


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
    elif device_type in _LOAD_FAILURES:  # a failed load (or JIT build) is not tried again in this process
        reason = _LOAD_FAILURES[device_type]
    else:
        try:
            op = load_fused_op(device_type)
            return FusedCUDAOps(op) if device_type == "cuda" else FusedCPUOps(op)
        except Exception as err:  # noqa: BLE001 -- any build/load failure means "fall back" (or fail for "fused")
            reason = _LOAD_FAILURES[device_type] = f"{type(err).__name__}: {err}".strip()
    if kernels == "fused":
        raise DGCKernelError(f"'dgc.kernels' is \"fused\" but the fused {device_type} op cannot load: {reason}")
    if (device_type, reason) not in _warned:
        _warned.add((device_type, reason))
        logger.warning("deepspeed_dgc: fused %s op unavailable (%s); using the PyTorch reference path", device_type,
                       reason)
    return REFERENCE
