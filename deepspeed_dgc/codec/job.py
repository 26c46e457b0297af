"""One bucket to compress, laid out as an owner matrix, and what compressing it gives back.

A bucket of T tensors is an owner matrix of R rows (row r goes to rank r of the communicator) and
``C = sum(c_i)`` columns: tensor i has ``c_i = ceil(n_i / W)`` columns, and row r holds the elements of
owner ``row_owner[r]``, ``flat_i[o * c_i : (o + 1) * c_i]`` clipped to ``n_i`` (the rest is padding).
Flat topology: R = W rows read straight from the gradients. Hierarchical topology: the rows are the
node-level sums of this rank's owners, read with a row stride from one matrix.
"""

from dataclasses import dataclass
from typing import List, Optional

import torch

from .selection import target_count
from .wire import RowLayout


def real_count(numel: int, owner: int, chunk: int) -> int:
    """Elements of a tensor of ``numel`` elements that ``owner`` holds when every owner gets ``chunk`` (the rest of its
    row is padding): ``clamp(numel - owner * chunk, 0, chunk)``."""
    return max(0, min(chunk, numel - owner * chunk))


@dataclass
class CompressJob:
    """One bucket to compress: where its values are, how rows and columns are laid out, how to code them.

    Element (r, j) of tensor i is read from ``srcs[i][offsets[i] + r * row_strides[i] + j]`` and
    accumulated in fp32 as ``acc = src / divisor + residual`` (unscaled gradient units: the divisor holds
    the world size and the fp16 loss scale).

    Attributes:
        srcs: contiguous 1-D tensors (fp32, bf16 or fp16) holding the values.
        offsets, row_strides: element offsets of row 0 and between rows, per tensor.
        numels, chunks: n_i and c_i per tensor.
        sparse: whether tensor i is top-k sparsified (else every real element is sent, without indices).
        row_owner: global owner index of each row (flat: ``0..W-1``; hierarchical: ``k*L + l``).
        residuals: error-feedback residual per tensor (fp32, ``residual_numels[i]`` elements, element
            (r, j) at ``r * c_i + j``, unscaled) or None.
        residual_numels: length of the residual: n_i (flat) or ``R * c_i`` (hierarchical).
        divisor: the sources are divided by it (flat: W times the loss scale; hierarchical: the loss scale).
        density: top-k density; samples: positions of the threshold sample per tensor
            (:func:`~deepspeed_dgc.codec.selection.sample_indices` over the real elements, row-major), None:
            all of them.
        group_size: values per scale; quantize: False sends raw values in ``value_dtype``.
        value_dtype: dtype of raw values (the communication dtype).
        fingerprint: int31 written in every header.
        want_residual: return the new residuals (error feedback on and not lossless).
        value_format: format of quantized values (``formats.VALUE_BITS``), default ``"int4"``.
        rounding_generator: stochastic rounding from this generator (INT4/INT2), None: to nearest.
        index_coding: ``"varint"`` gaps or a ``"bitmap"`` over the real elements of sparse tensors.
        threshold: keep the elements of sparse tensors with ``|acc| >= threshold`` instead of top-k (None: top-k).
        reuse_thresholds: per tensor, a threshold estimated at an earlier step that top-k reuses instead of
            estimating one from ``samples[i]`` (:func:`~deepspeed_dgc.codec.selection.reused_threshold`), or
            None; None for the whole list: estimate all (and report none).
        raw_scale: raw values travel multiplied by it (the loss scale: a narrow communication dtype keeps the
            range stock's loss scaling gives it); quantized values ignore it (their scales are fp32).
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
    raw_scale: float = 1.0

    @property
    def rows(self) -> int:
        return len(self.row_owner)

    def real_counts(self, i: int) -> List[int]:
        """Real elements of tensor i in each row."""
        return [real_count(self.numels[i], o, self.chunks[i]) for o in self.row_owner]

    def real_mask(self, i: int, device) -> torch.Tensor:
        """Bool ``(R, c_i)``: True where row r of tensor i holds a real element, not padding."""
        return torch.tensor(self.real_counts(i), device=device)[:, None] > torch.arange(self.chunks[i], device=device)

    def real_totals(self) -> List[int]:
        """Real elements of each tensor in all rows (the m of its top-k; its rows hold them first, row-major)."""
        return [sum(self.real_counts(i)) for i in range(len(self.numels))]

    def targets(self) -> List[int]:
        """Top-k target count per tensor (over its real elements in all rows)."""
        return [target_count(m, self.density) for m in self.real_totals()]

    def row_layout(self, row: int) -> RowLayout:
        """What the owner of row ``row`` needs to check and decode the payloads of this bucket."""
        return RowLayout(fingerprint=self.fingerprint,
                         chunks=list(self.chunks),
                         seg_real=[self.real_counts(i)[row] for i in range(len(self.numels))],
                         sparse=list(self.sparse),
                         quantize=self.quantize,
                         value_format=self.value_format,
                         group_size=self.group_size,
                         value_dtype=self.value_dtype,
                         index_coding=self.index_coding,
                         raw_scale=self.raw_scale)


@dataclass
class CompressOutput:
    """Result of compressing one bucket.

    Attributes:
        payloads: uint8 payload per row (rank of the communicator), :mod:`~deepspeed_dgc.codec.wire` format.
        residuals: new residual per tensor (fp32, unscaled), or None (not finite, or not wanted).
        finite: False when any accumulated value was Inf/NaN (payloads then carry nothing).
        kept: values sent, all rows.
        thresholds: per tensor, the threshold that selected its kept elements (unscaled, what
            :attr:`CompressJob.reuse_thresholds` takes), or None where every real element was kept (tensors
            sent whole, k >= m) or nothing was sent (not finite). Only reported for jobs with ``reuse_thresholds``
            (a list, possibly all None) or a fixed ``threshold``; else all None (reading them back would cost a
            device synchronisation per tensor on a GPU).
    """
    payloads: List[torch.Tensor]
    residuals: Optional[List[torch.Tensor]]
    finite: bool
    kept: int
    thresholds: List[Optional[float]]
