"""The PyTorch implementation of compressing a bucket and decoding a payload: the oracle of the tests.

:class:`ReferenceOps` turns a :class:`~deepspeed_dgc.codec.job.CompressJob` into payloads (accumulate with
the residual, select per tensor, quantize, code positions, :func:`~deepspeed_dgc.codec.wire.pack`) and new
residuals, and adds a parsed payload body into a dense row. The fused ops
(:mod:`~deepspeed_dgc.codec.kernels`) give the same bytes and residual bits; they hand what they do not
code to this class.
"""

from dataclasses import replace
from typing import List, Tuple

import torch

from . import wire
from .formats import dequantize_values, dequantize_weights, quantize_values, quantize_weights
from .indices import decode_positions, encode_bitmap, encode_indices, segment_counts
from .job import CompressJob, CompressOutput
from .selection import reused_threshold, topk_threshold


class ReferenceOps:
    """The PyTorch implementation: several passes, any device, every value format."""

    name = "reference"

    def accumulate(self, job: CompressJob) -> torch.Tensor:
        """``acc = src / divisor + residual`` as an fp32 owner matrix (error feedback, Seide et al. 2014).

        Returns:
            fp32 ``(R, C)``, padding 0.
        """
        R = job.rows
        blocks = []
        for i, src in enumerate(job.srcs):
            n, c, off, stride = job.numels[i], job.chunks[i], job.offsets[i], job.row_strides[i]
            flat_layout = off == 0 and stride == c and src.numel() == n
            x = src if flat_layout else torch.as_strided(src, (R, c), (stride, 1), off)
            a = x.to(torch.float32, copy=True) if job.divisor == 1 else x.float().div(job.divisor)
            residual = job.residuals[i]
            if residual is not None:
                a.add_(residual if flat_layout else residual.view(R, c))
            if flat_layout:
                a = torch.nn.functional.pad(a, (0, R * c - n)).view(R, c)
            blocks.append(a)
        return torch.cat(blocks, dim=1) if blocks else torch.empty(R, 0, device=job.srcs[0].device)

    def compress(self, job: CompressJob) -> CompressOutput:
        """Select, quantize and encode every row of ``job`` in the exact layout (:mod:`~deepspeed_dgc.codec.wire`);
        see :class:`~deepspeed_dgc.codec.job.CompressJob`."""
        acc_m = self.accumulate(job)
        real_m = torch.cat([job.real_mask(i, acc_m.device) for i in range(len(job.srcs))], dim=1)
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
                    threshold = float(torch.tensor(job.threshold, dtype=torch.float32))
                elif reuse is not None:
                    threshold = reused_threshold(mag[real], k, reuse)
                else:
                    threshold = topk_threshold(mag[real], k, job.samples[i])
                mask_m[:, col:col + c] = (mag >= threshold) & real
                if job.reuse_thresholds is not None or job.threshold is not None:  # (a device sync on a GPU)
                    thresholds[i] = float(threshold)
            col += c
        payloads, sent_m = self._encode_rows(job, acc_m, mask_m, real_m)
        residuals = None
        if finite and job.want_residual:
            res_m = acc_m - sent_m
            residuals, col = [], 0
            for c, rn in zip(job.chunks, job.residual_numels):
                residuals.append(res_m[:, col:col + c].reshape(-1)[:rn].clone())
                col += c
        return CompressOutput(payloads, residuals, finite, int(mask_m.sum()) if finite else 0, thresholds)

    def _encode_rows(self, job: CompressJob, acc_m, mask_m, real_m) -> Tuple[List[torch.Tensor], torch.Tensor]:
        """Payload of every row, and what was sent (decoded) as an fp32 ``(R, C)`` matrix.

        A row whose sparse payload would not be smaller than the row sent whole
        (:meth:`~deepspeed_dgc.codec.wire.RowLayout.sends_whole`) keeps every real element: its row of the bool
        ``(R, C)`` ``mask_m`` becomes ``real_m``'s (in place), and its payload carries no positions.
        """
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
        layout, real = job.row_layout(0), [job.real_counts(i) for i in range(len(job.chunks))]
        for o in range(acc_m.shape[0]):
            pos = mask_m[o].nonzero().squeeze(1)
            if job.index_coding == "bitmap":
                index_bytes = encode_bitmap(mask_m[o][sparse_cols[o]])
            else:
                indexed = pos[~implied_m[o][pos]]
                index_bytes = encode_indices(indexed, torch.tensor([indexed.numel()], device=device))
            counts = segment_counts(pos, seg_ends)
            row = replace(layout, seg_real=[r[o] for r in real])
            if row.sends_whole(counts.tolist(), index_bytes.numel()):
                mask_m[o] = real_m[o]
                pos = mask_m[o].nonzero().squeeze(1)
                counts = segment_counts(pos, seg_ends)
                index_bytes = index_bytes.new_empty(0)
            vals = acc_m[o][pos]
            if job.quantize:
                values, scales, sent_m[o][pos] = self._quantize(vals, job, counts)
            else:
                values = wire.raw_encode(vals, job.value_dtype, job.raw_scale)
                scales = torch.empty(0, dtype=torch.float32, device=device)
                sent_m[o][pos] = wire.raw_decode(values, job.raw_scale)
            payloads.append(wire.pack(job.fingerprint, pos.numel(), scales, values, index_bytes))
        return payloads, sent_m

    def _quantize(self, vals: torch.Tensor, job: CompressJob, segment_counts_: torch.Tensor):
        """``(packed, scales, decoded)`` of :func:`~deepspeed_dgc.codec.formats.quantize_values`."""
        return quantize_values(vals, job.value_format, job.group_size, segment_counts_, job.rounding_generator)

    def decode_add(self, out: torch.Tensor, body: wire.Body, row: wire.RowLayout) -> None:
        """Add one sender's decoded payload body into this rank's row ``out``.

        Args:
            out: fp32 ``(C,)``, this rank's row of the owner matrix (padded layout), updated in place.
            body: the payload's sections (:func:`~deepspeed_dgc.codec.wire.parse`).
            row: the receiver's :class:`~deepspeed_dgc.codec.wire.RowLayout`.

        Raises:
            ValueError: the body does not decode to ``kept`` positions inside the row.
        """
        body, row = wire.implied_view(body, row)
        pos, counts = decode_positions(out.numel(), body.index_bytes, body.kept, body.n_indexed, row.seg_real,
                                       row.chunks, row.sparse, row.index_coding)
        if row.quantize:
            vals = dequantize_values(body.values, body.scales, body.kept, row.value_format, row.group_size, counts)
        else:
            vals = wire.raw_decode(body.values, row.raw_scale)
        out.index_add_(0, pos, vals)

    def quantize_weights(self, x: torch.Tensor, fmt: str, group_size: int, segments=None):
        """``(codes, scales)`` of :func:`~deepspeed_dgc.codec.formats.quantize_weights` (weights or fp8 residuals)."""
        return quantize_weights(x, fmt, group_size, segments)

    def dequantize_weights_into(self, out: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, fmt: str,
                                group_size: int, segments=None) -> None:
        """:func:`~deepspeed_dgc.codec.formats.dequantize_weights` of ``out.numel()`` weights copied into ``out``
        (any float dtype, rounded once).

        Raises:
            ValueError: the scales or segments do not match ``out``'s size.
        """
        out.copy_(dequantize_weights(codes, scales, out.numel(), fmt, group_size, segments).view(out.shape))


REFERENCE = ReferenceOps()
