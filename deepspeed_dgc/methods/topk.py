"""Top-k sparsification (or every element) of the gradient, quantized, with error feedback: in the exact layout
(:class:`TopKExact`, payloads of the kept count) or the fixed layout (:class:`TopKFixed`, sizes from the shape).

DGC (Lin et al., ICLR 2018, arXiv 1712.01887, sections 2-3): each rank adds its residual (what it did not send before)
to its gradient, keeps the elements above a sampled top-k threshold (or all of them at density 1), sends them quantized
with group-wise scales, and keeps the rest, quantization error included, as its new residual (error feedback, Seide et
al., Interspeech 2014). A momentum method may hand these classes its momenta instead of the gradients (``sources``).
"""

from typing import List, Optional, Sequence

import torch

from ..codec import fixed, wire
from ..codec.entropy import deflate, inflate
from ..codec.job import CompressJob
from ..codec.layout import layout_for, real_count
from ..codec.selection import draw_samples
from .base import Bucket, Exchange, GradientMethod, Reduced, register


def _want_residual(cfg, bucket: Bucket, threshold) -> bool:
    """Whether error feedback keeps anything: on, and the codec is not lossless."""
    return cfg.error_feedback and not (bucket.density >= 1.0 and bucket.quantization == "none" and threshold is None)


def _value_format(bucket: Bucket) -> str:
    """The format of the sent values (raw values keep INT4's tag: ``quantize`` says they are not coded)."""
    return bucket.quantization if bucket.quantization != "none" else "int4"


def _rounding_generator(reducer, bucket: Bucket, device) -> Optional[torch.Generator]:
    """This rank's generator where stochastic rounding applies (INT4 and INT2), else None (to nearest)."""
    if reducer.cfg.stochastic_rounding and bucket.quantization in ("int4", "int2"):
        return reducer.generator(device)
    return None


@register("topk_exact", lambda cfg, device: cfg.layout_for(device) == "exact")
class TopKExact(GradientMethod):
    """Payloads of exactly the kept values (varint or bitmap positions, entropy coding where asked), one uneven
    all-to-all after a size exchange; the fused CPU op codes them where it loads (the CPU's default). Thresholds may
    be reused between steps (Ok-Topk, Li and Hoefler, PPoPP 2022, section 3.1.3) or fixed."""

    def fixed_payloads(self, bucket):
        return False

    def layout(self, bucket, owners):
        return layout_for(bucket.numels, bucket.world, owners, 1)

    def reduce(self, bucket: Bucket, exchange: Exchange, A: Optional[torch.Tensor] = None,
               sources: Optional[List[torch.Tensor]] = None, residual_numels: Optional[List[int]] = None,
               on_exchanged=None) -> Reduced:
        """Steps 2-6 (see :meth:`GradientMethod.reduce`). ``sources``: a momentum method's per-tensor values to send
        instead (already divided; ``residual_numels`` their lengths); ``on_exchanged(before, after)`` then sees each
        tensor's residual before and after the exchange."""
        T = len(bucket.numels)
        if sources is not None:
            srcs, offsets, strides, divisor = sources, [0] * T, list(bucket.chunks), 1.0
            res_numels = residual_numels or list(bucket.numels)
        elif A is None:
            srcs, offsets, strides, divisor, res_numels = bucket.srcs, [0] * T, list(bucket.chunks), bucket.divisor, \
                list(bucket.numels)
        else:
            L = self.layout(bucket, exchange.owners)
            srcs, offsets, strides = [A.view(-1)] * T, list(L.cols), [L.columns] * T
            divisor, res_numels = bucket.divisor, [exchange.rows * c for c in bucket.chunks]
        job = self._job(bucket, srcs, offsets, strides, list(exchange.owners), res_numels, divisor)
        result = self.reducer.ops_for(bucket.device.type).compress(job)
        received = self._exchange(exchange.comm, result.payloads) if exchange.comm is not None else result.payloads
        out = wire.decode_sum(received, job.row_layout(exchange.row), self.reducer.ops_for(bucket.device.type).decode_add)
        before = list(job.residuals)
        self._stage(bucket, job, result.residuals, result.thresholds if result.finite else None)
        if on_exchanged is not None and result.residuals is not None:
            on_exchanged(before, result.residuals)
        views, col = [], 0
        for n, c in zip(bucket.numels, bucket.chunks):
            views.append(out.narrow(0, col, real_count(n, exchange.owners[exchange.row], c)))
            col += c
        return Reduced(out, views, result.finite, result.kept)

    def _job(self, bucket: Bucket, srcs, offsets, strides, row_owner, residual_numels, divisor) -> CompressJob:
        """Step 2: the job of one exchange, with this rank's residuals and threshold samples (drawn from this
        rank's generator in tensor order)."""
        r, cfg = self.reducer, self.cfg
        density, quantization, group_size = bucket.density, bucket.quantization, bucket.group_size
        threshold = cfg.threshold if r.threshold_active() else None
        ef = _want_residual(cfg, bucket, threshold)
        device = srcs[0].device
        job = CompressJob(srcs=srcs, offsets=offsets, row_strides=strides, numels=bucket.numels, chunks=bucket.chunks,
                          sparse=bucket.sparse, row_owner=row_owner,
                          residuals=r.memory.get_many(bucket.keys) if ef else [None] * len(bucket.keys),
                          residual_numels=residual_numels, divisor=divisor, density=density, samples=[],
                          group_size=group_size, quantize=quantization != "none", value_dtype=bucket.comm_dtype,
                          fingerprint=bucket.fingerprint, want_residual=ef,
                          value_format=_value_format(bucket),
                          index_coding=cfg.index_coding_for(density), threshold=threshold, raw_scale=bucket.loss_scale)
        if cfg.threshold_reuse_steps > 1 and threshold is None:
            job.reuse_thresholds = [r.reusable(k, density) for k in bucket.keys]
        estimate = [s and (job.reuse_thresholds is None or job.reuse_thresholds[i] is None)
                    for i, s in enumerate(bucket.sparse)]
        # positions of the threshold's sample, over the real elements (known from the shape)
        job.samples = draw_samples(job.real_totals(), estimate, density, r.generator(device), device)
        job.rounding_generator = _rounding_generator(r, bucket, device)
        return job

    def _exchange(self, comm, payloads: List[torch.Tensor]) -> List[torch.Tensor]:
        """Step 4: one uneven all-to-all of the payloads (entropy-coded around it with ``entropy_coding``)."""
        if self.cfg.entropy_coding == "zlib":
            return [inflate(b, src) for src, b in enumerate(comm.all_to_all([deflate(p) for p in payloads]))]
        return comm.all_to_all(payloads)

    def _stage(self, bucket: Bucket, job: CompressJob, residuals, thresholds) -> None:
        """Step 6: the new residuals, and the thresholds a finite exchange used (threshold reuse)."""
        if job.reuse_thresholds is not None and thresholds is not None:
            self.reducer.remember_thresholds(job, bucket.keys, thresholds)
        if residuals is None:
            return
        for key, residual in zip(bucket.keys, residuals):
            self.reducer.memory.stage(key, residual)


@register("topk_fixed", lambda cfg, device: cfg.layout_for(device) == "fixed")
class TopKFixed(GradientMethod):
    """Payloads whose sizes follow from the bucket's shape (:mod:`~deepspeed_dgc.codec.fixed`): one owner matrix per
    bucket, a fixed number of batched ops whatever its tensors, one ``all_to_all_single``, nothing read back on the
    host. The residuals are one block per bucket (:meth:`~deepspeed_dgc.memory.error_feedback.ErrorFeedback.add_block`).
    """

    def plan(self, bucket: Bucket, owners: Sequence[int]) -> fixed.FixedPlan:
        return fixed.FixedPlan.build(bucket.numels, bucket.world, owners, bucket.sparse, bucket.density,
                                     bucket.quantization != "none", _value_format(bucket), bucket.group_size,
                                     bucket.comm_dtype, self.cfg.capacity_factor)

    def layout(self, bucket, owners):
        return self.plan(bucket, owners).layout

    def reduce(self, bucket: Bucket, exchange: Exchange, A: Optional[torch.Tensor] = None,
               sources: Optional[List[torch.Tensor]] = None, residual_numels: Optional[List[int]] = None,
               on_exchanged=None) -> Reduced:
        """Steps 2-6 (see :meth:`GradientMethod.reduce`; ``sources``, ``residual_numels`` and ``on_exchanged`` as
        :meth:`TopKExact.reduce`, the residuals given to ``on_exchanged`` per tensor, flat)."""
        r, cfg = self.reducer, self.cfg
        plan = self.plan(bucket, exchange.owners)
        L, R, device, ws = plan.layout, exchange.rows, bucket.device, bucket.workspace
        ops = r.ops_for(device.type)
        res_numels = residual_numels or (list(bucket.numels) if A is None else [R * c for c in bucket.chunks])
        ef = _want_residual(cfg, bucket, None)
        if A is None:
            by_row = sources is not None and residual_numels is not None  # hierarchical: node-level rows
            values, divisor = (sources, 1.0) if sources is not None else (bucket.srcs, bucket.divisor)
            dtype = fixed.matrix_dtype(values, r.memory.storage if ef else None) if sources is None else torch.float32
            A = fixed.owner_matrix(R, L.columns, device, dtype)
            if hasattr(ops, "gather"):  # the CUDA op: one launch, divided on the way
                ops.gather(L, values, A, divisor, by_row)
            else:
                L.gather(values, A, by_row=by_row)
                if divisor != 1:
                    A.div_(divisor)
        elif bucket.divisor != 1:
            A.div_(bucket.divisor)
        before = None
        if ef:
            if on_exchanged is not None:
                before = r.memory.get_many(bucket.keys)  # a block decoded once, not once a tensor
            r.memory.add_block(bucket.keys, res_numels, L, A, ws)
        payloads = fixed.encode(A, plan, bucket.fingerprint, ws, bucket.loss_scale, r.generator(device),
                                _rounding_generator(r, bucket, device), ops)
        if on_exchanged is not None and ef:
            on_exchanged(before, [L.flat_of(A, i, n) for i, n in enumerate(res_numels)])
        held = ef and r.memory.stage_block(bucket.keys, res_numels, L, A, ws)
        if not held:  # the owner matrix is dead: what follows may use its memory
            ws.add(A.view(-1).view(torch.uint8))
        if exchange.comm is None:
            received = payloads
        else:
            r.check_first_bucket(exchange.comm, bucket.fingerprint)
            received = exchange.comm.all_to_all_fixed(payloads, out=ws.take(payloads.shape, torch.uint8, device))
            ws.add(payloads.view(-1))  # sent: its memory is dead too (the collective is waited for, or stream-ordered)
        out, bad = fixed.decode_sum(received, plan, bucket.fingerprint, exchange.row, ws, bucket.loss_scale, ops)
        if exchange.comm is not None:
            r.note_bad_senders(exchange.comm, bad)
        return Reduced(out, L.row_slices(out, exchange.row), True, plan.kept)
