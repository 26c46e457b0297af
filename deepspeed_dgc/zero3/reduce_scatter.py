"""The compressed reduce-scatter that replaces ZeRO-3's ``__avg_scatter_grads``: one bucket, top-down.

Per bucket of full local gradients ``g_1..g_T`` on a group of W ranks, :meth:`CompressedReduceScatter.reduce_scatter`
runs these steps in order (GRACE's ``step``, Xu et al., ICDCS 2021):

1. entry: the loss scale and the averaging over W are removed once, by dividing the sources by ``W * loss_scale``
   inside the first fp32 pass; a momentum state (:mod:`deepspeed_dgc.memory.momentum`) may replace the gradients
   by its momenta; the bucket's density, codec and fingerprint are fixed;
2. residual in: the error-feedback residuals join a :class:`~deepspeed_dgc.codec.job.CompressJob`;
3. encode: the fused op or the reference selects, quantizes and codes one payload per owner
   (:mod:`deepspeed_dgc.codec`), and returns the new residuals;
4. exchange: one uneven all-to-all of the payloads (:mod:`deepspeed_dgc.comm`);
5. decode and sum: every sender's payload for this rank's partition, summed densely in fp32
   (:func:`~deepspeed_dgc.codec.wire.decode_sum`);
6. stage: the new residuals (committed after an applied step), reused thresholds, momentum masking;
7. exit: the loss scale is restored once, and this rank's slice of each tensor is handed back.

Two Adam methods bring their own codec to steps 2-6, with every size fixed by the shapes: ``decoupled_momentum``
(DeMo: each rank's momentum as a chunked DCT top-k, :mod:`deepspeed_dgc.codec.dct`; the subtraction of what was sent
is its error feedback) and ``shared_mask`` (after SCAPE: the residual-corrected gradient at the owners' shared masks,
values only, :mod:`deepspeed_dgc.codec.masked`).

Hierarchical topology (N nodes of L ranks): step 1 is preceded by a dense reduce-scatter inside the node
(ZeRO++ qgZ's two hops, arXiv 2306.10209, section 4.2); steps 2-6 then run on the node-level sums of this
rank's owners, between the ranks of the same local rank on every node.

Output contract (tested against stock DeepSpeed): one tensor per input, this rank's slice
``flat[r*c : min((r+1)*c, n)]`` (possibly empty) of the mean over the group. In lossless mode (density 1, no
quantization) it is bit-identical to stock at 2 ranks.
"""

from dataclasses import dataclass
from typing import Dict, Hashable, List, Optional, Sequence, Tuple

import torch

from ..codec import dct, masked, wire
from ..codec.entropy import deflate, inflate
from ..codec.job import CompressJob, real_count
from ..codec.kernels import get_ops
from ..codec.selection import draw_samples, sample_indices
from ..comm.topology import ReduceComms, build_reduce_comms, resolve_ranks_per_node
from ..config import DGCConfig
from ..memory.error_feedback import ErrorFeedback
from ..memory.momentum import DecoupledMomentum, MomentumState
from ..telemetry import ReduceResult


@dataclass
class Bucket:
    """One call's plan, fixed at entry (step 1).

    Attributes:
        keys: stable key of each tensor; numels: elements per tensor; chunks: ``ceil(n_i / W)``.
        srcs: what is compressed (the gradients in the communication dtype, or a momentum state's values).
        divisor: the sources are divided by it in the first fp32 pass (``W * loss_scale`` for gradients, 1 for
            momenta, which are divided already). The hierarchical topology divides by W in its dense intra-node hop
            (in the communication dtype, as stock) and by the loss scale when its compressed hop begins.
        loss_scale: restored on exit.
        density, quantization, group_size: the codec of this bucket; sparse: per tensor, top-k or sent whole.
        comm_dtype: of raw values and of the dense intra-node hop; fingerprint: written in every header.
        momentum_sources: the sources came from the momentum state (which then sees the exchange, step 6).
        density_pending: ``density: "auto"`` on the hierarchical topology: estimated on the node-level sums after the
            dense hop (until then ``density`` is 1 and the fingerprint says "auto").
    """
    keys: List[Hashable]
    numels: List[int]
    chunks: List[int]
    srcs: List[torch.Tensor]
    divisor: float
    loss_scale: float
    density: float
    quantization: str
    group_size: int
    sparse: List[bool]
    comm_dtype: torch.dtype
    fingerprint: int
    momentum_sources: bool
    density_pending: bool = False


def split_by_node(comms: ReduceComms, sent: Sequence[int]) -> Tuple[int, int]:
    """``(intra-node, inter-node)`` bytes of a flat exchange that sent ``sent[d]`` bytes to group rank ``d``."""
    intra = sum(b for d, b in enumerate(sent) if comms.dest_nodes[d] == comms.dest_nodes[comms.rank])
    return intra, sum(sent) - intra


def reduce_result(comms: ReduceComms, numels: Sequence[int], intra_bytes: int, inter_bytes: int, kept: int,
                  finite: bool = True, stock_buckets: int = 0) -> ReduceResult:
    """The telemetry of one reduce-scatter of tensors of ``numels`` elements over ``comms``' group that sent these
    bytes: beside them, what stock fp32 would send, ``(W-1)/W`` of each tensor, and the share of it to other nodes."""
    world = comms.world_size
    off_node = sum(1 for node in comms.dest_nodes if node != comms.dest_nodes[comms.rank])
    return ReduceResult(wire_bytes=intra_bytes + inter_bytes,
                        dense_fp32_bytes=sum((world - 1) / world * n * 4 for n in numels),
                        kept=kept,
                        numel=sum(numels),
                        finite=finite,
                        intra_node_wire_bytes=intra_bytes,
                        inter_node_wire_bytes=inter_bytes,
                        inter_node_dense_fp32_bytes=sum(off_node / world * n * 4 for n in numels),
                        stock_buckets=stock_buckets)


class CompressedReduceScatter:
    """Sparsified, quantized reduce-scatter with error feedback for one ZeRO-3 optimizer.

    Args:
        cfg: the enabled ``"dgc"`` config (its ``topology``, ``comm_backend`` and ``timeout_s``
            choose the communicators).
        memory: residual store (error feedback).
        seed: seed of the random generator used to sample for threshold estimation; give each
            rank its own (e.g. a constant plus the global rank) for reproducible runs.
        ranks_per_node: ranks per node (None: :func:`~deepspeed_dgc.comm.topology.resolve_ranks_per_node`
            at first use, collective).
        ops: the compression implementation (None: :func:`~deepspeed_dgc.codec.kernels.get_ops` for
            ``cfg.kernels`` and the gradients' device, at first use).
        momentum: a :class:`~deepspeed_dgc.memory.momentum.MomentumState`, or None.

    Attributes:
        steps_applied: optimizer steps applied so far (skipped steps do not count): the clock of the density
            warm-up. :meth:`end_step` advances it.
        thresholds: threshold reuse, key -> ``[threshold (unscaled), density it was estimated for, applied optimizer
            steps it has served, whether it selected momentum]``; this accumulation window's changes are staged and
            kept only if its step is applied (:meth:`end_step`).
        density: the density of the latest bucket (telemetry).
    """

    def __init__(self, cfg: DGCConfig, memory: ErrorFeedback, seed: int = 0, ranks_per_node: Optional[int] = None,
                 ops=None, momentum: Optional[MomentumState] = None):
        self.cfg = cfg
        self.memory = memory
        self.seed = seed
        self.ranks_per_node = ranks_per_node
        self.ops = ops
        self.momentum = momentum
        self.steps_applied = 0
        self.thresholds: Dict[Hashable, list] = {}
        self._window_thresholds: Dict[Hashable, Optional[list]] = {}  # this window's: an estimate, "reused", or None
        self._generators: Dict[str, torch.Generator] = {}
        self._comms = {}
        self._bad_senders: List[Tuple[object, torch.Tensor]] = []  # fixed layout: (communicator, bad flags) this step
        self._first_step = True  # fixed layout: every bucket's shape is checked across ranks until the first step ends
        self.masks: Dict[Hashable, torch.Tensor] = {}  # shared_mask: key -> int64 (W, k), owner o's columns in row o
        self.density = cfg.density if isinstance(cfg.density, float) else cfg.density_max

    # ---- the bucket path ------------------------------------------------------------------------

    def reduce_scatter(self, grads: Sequence[torch.Tensor], keys: Sequence[Hashable], group, comm_dtype: torch.dtype,
                       loss_scale: float = 1.0) -> Tuple[List[torch.Tensor], ReduceResult]:
        """Mean over the group of each gradient, scattered by owner rank, compressed on the wire.

        Args:
            grads: full local gradients, one per parameter, any shape (n_i elements), any float dtype, multiplied
                by ``loss_scale``. Every rank passes tensors of the same sizes in the same order.
            keys: error-feedback key of each gradient (a stable identity of its parameter).
            group: process group of the partition (None: the world).
            comm_dtype: dtype of values on the wire when ``quantization`` is ``"none"`` (and of the
                dense intra-node hop).
            loss_scale: the fp16 loss scale the gradients carry (1 for bf16 and fp32).

        Returns:
            ``(partitions, result)``: per gradient, an fp32 tensor of this rank's slice of the
            mean, shape ``(max(0, min(c, n - r*c)),)``, in the gradients' (scaled) units; and a
            :class:`~deepspeed_dgc.telemetry.ReduceResult`.

        Raises:
            DGCProtocolError: a payload from another rank does not match this rank's
                expectation (config or bucket differ between ranks); every rank that receives
                such a payload raises.
            DGCTimeoutError: an exchange did not finish within ``dgc.timeout_s``.
        """
        comms = self.comms_for(group)
        bucket = self._enter(grads, keys, comms, comm_dtype, loss_scale)
        if comms.hierarchical:
            intra_before, inter_before = comms.intra.wire_bytes, comms.inter.wire_bytes
            out, finite, kept = self._two_hops(bucket, comms)
            intra_bytes = comms.intra.wire_bytes - intra_before
            inter_bytes = comms.inter.wire_bytes - inter_before
        else:
            if isinstance(self.momentum, DecoupledMomentum):
                out, finite, kept = self._decoupled_exchange(bucket, comms.flat, bucket.srcs, bucket.numels)
            elif self._masked(bucket):
                W = comms.world_size
                rows = [torch.nn.functional.pad(src.float() / bucket.divisor, (0, W * c - n)).view(W, c)
                        for src, n, c in zip(bucket.srcs, bucket.numels, bucket.chunks)]
                out, finite, kept = self._masked_exchange(bucket, comms.flat, comms.rank, rows, bucket.numels)
            else:
                job = self._job(bucket, bucket.srcs, [0] * len(bucket.srcs), bucket.chunks,
                                list(range(comms.world_size)), bucket.numels, bucket.divisor)
                out, finite, kept = self._compress_exchange(bucket, job, comms.flat, comms.rank)
            intra_bytes, inter_bytes = split_by_node(comms, comms.flat.last_sent_bytes)
        outputs = self._exit(out, finite, bucket, comms.rank)
        return outputs, reduce_result(comms, bucket.numels, intra_bytes, inter_bytes, kept, finite)

    def _enter(self, grads, keys, comms: ReduceComms, comm_dtype, loss_scale: float) -> Bucket:
        """Step 1: what is compressed, divided by what, with which codec."""
        world = comms.world_size
        numels = [g.numel() for g in grads]
        # stock casts to the communication dtype and pre-divides by W; the loss scale goes with the division
        srcs = [g.reshape(-1).to(comm_dtype) for g in grads]
        divisor = float(world) * loss_scale
        # on the hierarchical topology a momentum state keeps the momenta of the node-level sums (_two_hops)
        later = self.momentum is not None and comms.hierarchical
        momenta = self.momentum.sources(keys, grads, divisor) if self.momentum is not None and not later else None
        if momenta is not None:
            srcs, divisor = momenta, 1.0
        override = self.momentum.codec() if self.momentum is not None else None
        density = self.step_density() if override is None else override[0]
        bucket = Bucket(keys=list(keys), numels=numels, chunks=[-(-n // world) for n in numels], srcs=srcs,
                        divisor=divisor, loss_scale=loss_scale, density=1.0, quantization="none", group_size=0,
                        sparse=[], comm_dtype=comm_dtype, fingerprint=0, momentum_sources=momenta is not None)
        if density == "auto" or density is None:
            # the hierarchical topology estimates it on the node-level sums, after the dense hop (_two_hops)
            return self._set_codec(bucket, "auto") if comms.hierarchical else \
                self._set_codec(bucket, self._auto_density(srcs, keys, numels, divisor, comms.flat))
        return self._set_codec(bucket, density)

    def _set_codec(self, bucket: Bucket, density) -> Bucket:
        """Fix ``bucket``'s density, codec, per-tensor sparsity and fingerprint (``"auto"``: the density is not known
        yet; the fingerprint of the hierarchical topology's dense hop then says so)."""
        bucket.density_pending = density == "auto"
        self.density = bucket.density = density if density != "auto" else 1.0
        codec = self.codec(bucket.density)
        _, bucket.quantization, bucket.group_size = codec
        threshold = self.threshold_active()
        bucket.sparse = [(bucket.density < 1.0 or threshold) and n >= self.cfg.min_numel for n in bucket.numels]
        description = [list(codec) if density != "auto" else "auto", self.cfg.stochastic_rounding,
                       self.cfg.index_coding, self.cfg.min_numel, self.cfg.topology,
                       self.ranks_per_node if self.cfg.topology == "hierarchical" else None, str(bucket.comm_dtype),
                       list(bucket.numels), list(bucket.sparse), self.layout(bucket.srcs[0].device.type),
                       self.cfg.capacity_factor]
        bucket.fingerprint = wire.fingerprint(description)
        return bucket

    def _job(self, bucket: Bucket, srcs, offsets, strides, row_owner, residual_numels, divisor) -> CompressJob:
        """Step 2: the job of one exchange, with this rank's residuals and threshold samples (drawn from this
        rank's generator in tensor order)."""
        density, quantization, group_size = bucket.density, bucket.quantization, bucket.group_size
        threshold = self.cfg.threshold if self.threshold_active() else None
        ef = self.cfg.error_feedback and not (density >= 1.0 and quantization == "none" and threshold is None)
        device = srcs[0].device
        job = CompressJob(srcs=srcs,
                          offsets=offsets,
                          row_strides=strides,
                          numels=bucket.numels,
                          chunks=bucket.chunks,
                          sparse=bucket.sparse,
                          row_owner=row_owner,
                          residuals=[self.memory.get(k) if ef else None for k in bucket.keys],
                          residual_numels=residual_numels,
                          divisor=divisor,
                          density=density,
                          samples=[],
                          group_size=group_size,
                          quantize=quantization != "none",
                          value_dtype=bucket.comm_dtype,
                          fingerprint=bucket.fingerprint,
                          want_residual=ef,
                          value_format=quantization if quantization != "none" else "int4",
                          index_coding=self.cfg.index_coding_for(density),
                          threshold=threshold,
                          raw_scale=bucket.loss_scale,
                          capacity_factor=self.cfg.capacity_factor)
        if self.cfg.threshold_reuse_steps > 1 and threshold is None:
            job.reuse_thresholds = [self._reusable(k, density) for k in bucket.keys]
        estimate = [s and (job.reuse_thresholds is None or job.reuse_thresholds[i] is None)
                    for i, s in enumerate(bucket.sparse)]
        # positions of the threshold's sample, over the real elements (known from the shape). Both layouts draw the
        # same ones: the fixed layout's (R, c_i) block holds the real elements first, row-major, then the padding
        job.samples = draw_samples(job.real_totals(), estimate, density, self._generator(device), device)
        if self.cfg.stochastic_rounding and quantization in ("int4", "int2"):
            job.rounding_generator = self._generator(device)
        return job

    def _compress_exchange(self, bucket: Bucket, job: CompressJob, comm, my_row: int) -> Tuple[torch.Tensor, bool, int]:
        """Steps 3-6: encode every row, exchange, decode and sum this rank's row, stage what lasts.

        Returns:
            ``(out, finite, kept)``: the fp32 sum over senders of row ``my_row``, shape ``(C,)``, unscaled; whether
            this rank's input was finite (exact layout: it sends nothing otherwise; fixed layout: always True, not
            read back, every row is NaN instead); values it sent.
        """
        ops = self.ops_for(job.srcs[0].device.type)
        if self.layout(job.srcs[0].device.type) == "fixed":
            if self._first_step:
                self._check_same_bucket(comm, bucket.fingerprint)
            fixed_out = ops.compress_fixed(job)
            out, bad = ops.decode_sum_fixed(comm.all_to_all_fixed(fixed_out.payloads), job)
            self._bad_senders.append((comm, bad))
            self._stage(bucket, job, fixed_out.residuals)
            return out, True, fixed_out.kept
        result = ops.compress(job)
        received = self._exchange(comm, result.payloads)
        out = wire.decode_sum(received, job.row_layout(my_row), ops.decode_add)
        self._stage(bucket, job, result.residuals, result.thresholds if result.finite else None)
        return out, result.finite, result.kept

    def _decoupled_exchange(self, bucket: Bucket, comm, deltas: List[torch.Tensor],
                            numels: List[int]) -> Tuple[torch.Tensor, bool, int]:
        """Steps 3-6 of ``decoupled_momentum``: each rank's momenta ``deltas`` (``numels[i]`` elements: the full
        tensor, or on the hierarchical topology its node-level rows, ``N * c_i``) as a chunked DCT top-k per owner
        row of ``comm`` (:mod:`deepspeed_dgc.codec.dct`), one all-to-all of equal rows, this rank's row summed over
        senders, and what was not sent staged back into the momenta. Nothing is read on the host (as the fixed
        layout). ``comm`` None: one row, extracted and decoded locally (the hierarchical topology on one node).

        Returns:
            ``(out, True, kept)``: fp32 ``(C,)``, the sum over senders of this rank's row, unscaled (NaN when a payload
            does not match this rank's plan); values sent.
        """
        cfg = self.momentum.cfg
        plan = dct.ChunkPlan(tuple(bucket.chunks), cfg.chunk, cfg.topk, cfg.transform, cfg.quantization,
                             cfg.group_size)
        fingerprint = wire.fingerprint([bucket.fingerprint, "decoupled", plan.chunk, plan.topk, plan.transform,
                                        plan.value_format, plan.group_size])
        if comm is None:  # a single row (the hierarchical topology on one node): decoded here, nothing sent
            payloads, sent, kept = dct.encode(deltas, numels, plan, 1, fingerprint)
            out, _ = dct.decode_sum(payloads, plan, fingerprint)
        else:
            if self._first_step:
                self._check_same_bucket(comm, fingerprint)
            payloads, sent, kept = dct.encode(deltas, numels, plan, comm.world_size, fingerprint)
            out, bad = dct.decode_sum(comm.all_to_all_fixed(payloads), plan, fingerprint)
            self._bad_senders.append((comm, bad))
        self.momentum.keep_rest(bucket.keys, [d.sub_(x) for d, x in zip(deltas, sent)])
        return out, True, kept

    def _masked(self, bucket: Bucket) -> bool:
        """Whether ``bucket`` goes by the owners' shared masks (``shared_mask`` after its warm-up step)."""
        return bool(self.masks) and all(k in self.masks for k in bucket.keys)

    def _masked_exchange(self, bucket: Bucket, comm, my_row: int, rows: List[torch.Tensor],
                         residual_numels: List[int]) -> Tuple[torch.Tensor, bool, int]:
        """Steps 2-6 of ``shared_mask``: every rank's error-feedback accumulator at the owners' shared masks
        (:attr:`masks`), values only (:mod:`deepspeed_dgc.codec.masked`), one all-to-all of equal rows, the compacted
        buffers summed densely, the rest staged as the new residuals. Nothing is read on the host.

        Args:
            comm: the exchange: the flat group (row o = owner o), or on the hierarchical topology the inter-node
                communicator (row k = owner k L + this local rank, whose masks :meth:`set_masks` got over it).
            my_row: this rank's row in ``comm``.
            rows: per tensor, fp32 ``(R, c_i)``: what is sent to each row's owner before the residual (the gradients
                divided, zero-padded; on the hierarchical topology the node-level sums of the owners' slices).
            residual_numels: per tensor, the residual's elements (the first of ``R c_i``: ``n_i`` flat, ``N c_i``
                hierarchical).

        Returns:
            ``(out, True, kept)``: fp32 ``(C,)``, unscaled (NaN when a payload does not match); values sent.
        """
        cfg = self.cfg.shared_mask
        masks = [self.masks[k] for k in bucket.keys]
        plan = masked.value_plan([m.shape[1] for m in masks], cfg.quantization, cfg.group_size)
        fingerprint = wire.fingerprint([bucket.fingerprint, "masked", list(plan.counts), cfg.quantization,
                                        cfg.group_size])
        if self.cfg.error_feedback:
            for key, row, n in zip(bucket.keys, rows, residual_numels):
                residual = self.memory.get(key)
                if residual is not None:
                    row.view(-1)[:n] += residual
        payloads, sent = masked.encode(rows, masks, plan, fingerprint)
        out, bad = masked.decode_sum(comm.all_to_all_fixed(payloads), [m[my_row] for m in masks], bucket.chunks,
                                     plan, fingerprint)
        self._bad_senders.append((comm, bad))
        if self.cfg.error_feedback:
            for key, row, x, n in zip(bucket.keys, rows, sent, residual_numels):
                self.memory.stage(key, row.sub_(x).view(-1)[:n])
        return out, True, comm.world_size * plan.values

    def set_masks(self, comm, keys: Sequence[Hashable], chunks: Sequence[int], own: Sequence[torch.Tensor]) -> int:
        """Every owner's shared masks to every rank (``shared_mask``): this owner's positions ``own[i]`` (``(k_i,)``
        below ``chunks[i]``) packed (:func:`~deepspeed_dgc.codec.masked.pack_masks`), one all-to-all of the same row to
        everyone (an all-gather of fixed size, bounded by ``timeout_s``); :attr:`masks` becomes key -> int64
        ``(W, k_i)``. Collective over ``comm``; returns the bytes this rank sent."""
        local = masked.pack_masks(own, chunks)
        received = comm.all_to_all_fixed(local.expand(comm.world_size, -1).contiguous())
        self.masks = dict(zip(keys, masked.unpack_masks(received, chunks, [m.numel() for m in own])))
        return sum(comm.last_sent_bytes)

    def _exchange(self, comm, payloads: List[torch.Tensor]) -> List[torch.Tensor]:
        """Step 4: one uneven all-to-all of the payloads (entropy-coded around it with ``entropy_coding``)."""
        if self.cfg.entropy_coding == "zlib":
            return [inflate(b, src) for src, b in enumerate(comm.all_to_all([deflate(p) for p in payloads]))]
        return comm.all_to_all(payloads)

    def _stage(self, bucket: Bucket, job: CompressJob, residuals: Optional[List[torch.Tensor]],
               thresholds: Optional[Sequence[Optional[float]]] = None) -> None:
        """Step 6: the new residuals, the thresholds a finite exchange used (threshold reuse), and what the momentum
        state learns from the exchange."""
        if job.reuse_thresholds is not None and thresholds is not None:
            self._remember_thresholds(job, bucket.keys, thresholds)
        if residuals is None:
            return
        before = list(job.residuals)
        for key, residual in zip(bucket.keys, residuals):
            self.memory.stage(key, residual)
        if bucket.momentum_sources:
            self.momentum.after_exchange(bucket.keys, bucket.srcs, before, residuals, bucket.sparse)

    def _exit(self, out: torch.Tensor, finite: bool, bucket: Bucket, rank: int) -> List[torch.Tensor]:
        """Step 7: the loss scale restored, stock's rounding to the communication dtype for raw values, this
        rank's slice of each tensor (NaN everywhere when this rank's input was not finite, so that DeepSpeed's
        overflow check skips the step on every rank)."""
        if bucket.loss_scale != 1:
            out.mul_(bucket.loss_scale)
        if bucket.quantization == "none" and bucket.comm_dtype != torch.float32:
            out = out.to(bucket.comm_dtype).float()  # stock's result is in the communication dtype
        if not finite:
            out.fill_(float("nan"))
        outputs, col = [], 0
        for n, c in zip(bucket.numels, bucket.chunks):
            outputs.append(out.narrow(0, col, real_count(n, rank, c)))
            col += c
        return outputs

    def _two_hops(self, bucket: Bucket, comms: ReduceComms) -> Tuple[torch.Tensor, bool, int]:
        """Hierarchical topology: a dense reduce-scatter of ``g / W`` inside the node, in the communication dtype,
        then steps 2-6 on the node-level sums of this rank's owners (divided by the loss scale on entry)."""
        L, N, world = comms.ranks_per_node, comms.n_nodes, comms.world_size
        srcs, chunks = bucket.srcs, bucket.chunks
        device = srcs[0].device
        C = sum(chunks)
        # owner matrix of g/W: row o = owner o's slices of every tensor, zero-padded
        cols = [
            torch.nn.functional.pad(s.float().div(world), (0, world * c - s.numel())).view(world, c)
            for s, c in zip(srcs, chunks)
        ]
        acc_m = torch.cat(cols, dim=1)
        payloads = [wire.as_bytes(acc_m[j::L].to(bucket.comm_dtype)) for j in range(L)]  # rows of owners k*L + j
        # equal sizes: no size exchange (decoupled_momentum's and shared_mask's codecs have fixed sizes on every device)
        if self.layout(device.type) == "fixed" or isinstance(self.momentum, DecoupledMomentum) or self._masked(bucket):
            if self._first_step:
                self._check_same_bucket(comms.intra, bucket.fingerprint)
            received = list(comms.intra.all_to_all_fixed(torch.stack(payloads)))
        else:
            received = comms.intra.all_to_all(payloads)
        node_sum = torch.zeros(N, C, dtype=torch.float32, device=device)
        for buf in received:  # in local-rank order, the same on every rank
            node_sum.add_(buf.view(bucket.comm_dtype).view(N, C).float())
        owners = [k * L + comms.local_rank for k in range(N)]
        starts = [sum(chunks[:i]) for i in range(len(chunks))]
        row_numels = [N * c for c in chunks]
        rows = None  # the node-level sums of each tensor, fp32 (N * c_i,), built when something needs them apart
        if self.momentum is not None:  # momenta of the N node-level rows: 1/L of full size
            rows = [node_sum[:, start:start + c].reshape(-1) for start, c in zip(starts, chunks)]
            momenta = self.momentum.sources(bucket.keys, rows, bucket.loss_scale)
            if isinstance(self.momentum, DecoupledMomentum):
                # one node: the same extraction (DeMo's step needs it), nothing crosses a node
                return self._decoupled_exchange(bucket, comms.inter if N > 1 else None, momenta, row_numels)
            if momenta is not None:
                bucket.srcs, bucket.divisor, bucket.momentum_sources = momenta, 1.0, True
        if N == 1:  # nothing crosses a node: the node's sum (or its momenta), sent whole
            if bucket.momentum_sources:
                return torch.cat(bucket.srcs), True, sum(row_numels)
            row = node_sum[0]
            if bucket.loss_scale != 1:
                row.div_(bucket.loss_scale)  # _exit restores it
            return row, True, sum(real_count(n, owners[0], c) for n, c in zip(bucket.numels, chunks))
        if self._masked(bucket):  # shared_mask: the owners' masks were shared over comms.inter (share_masks)
            rows = [node_sum[:, start:start + c] / bucket.loss_scale for start, c in zip(starts, chunks)]
            return self._masked_exchange(bucket, comms.inter, comms.node, rows, row_numels)
        if bucket.momentum_sources:
            job_srcs, offsets, strides, divisor = bucket.srcs, [0] * len(chunks), list(chunks), 1.0
        else:
            job_srcs, offsets, strides, divisor = [node_sum.view(-1)] * len(srcs), starts, [C] * len(srcs), \
                bucket.loss_scale
        if bucket.density_pending:
            if rows is None:
                rows = [node_sum[:, start:start + c].reshape(-1) for start, c in zip(starts, chunks)]
            self._set_codec(bucket, self._auto_density(bucket.srcs if bucket.momentum_sources else rows, bucket.keys,
                                                       bucket.numels, divisor, comms.inter))
        job = self._job(bucket, job_srcs, offsets, strides, owners, row_numels, divisor)
        return self._compress_exchange(bucket, job, comms.inter, comms.node)

    # ---- what a bucket is compressed with ---------------------------------------------------------

    def layout(self, device_type: str) -> str:
        """``"fixed"`` or ``"exact"``: the payload layout of gradients on ``device_type`` (``dgc.layout``)."""
        return self.cfg.layout_for(device_type)

    def ops_for(self, device_type: str):
        """The compression implementation (fused or reference), chosen once."""
        if self.ops is None:
            self.ops = get_ops(self.cfg.kernels, device_type, self.cfg.quantization != "none")
        return self.ops

    def comms_for(self, group) -> ReduceComms:
        """The communicators of ``group``, created once per group (collective over the world the first time)."""
        if group not in self._comms:
            if self.ranks_per_node is None:
                self.ranks_per_node = resolve_ranks_per_node(self.cfg)[0]
            self._comms[group] = build_reduce_comms(self.cfg, group, self.ranks_per_node)
        return self._comms[group]

    def codec(self, density: float) -> Tuple[float, str, int]:
        """``(density, quantization, group_size)`` of an exchange at ``density``: the top-level keys' format, or the
        momentum state's own (compressed momentum after the freeze)."""
        override = self.momentum.codec() if self.momentum is not None else None
        if override is not None:
            return density, override[1], override[2]
        return density, self.cfg.quantization, self.cfg.group_size

    def step_density(self) -> Optional[float]:
        """Density of this step from the schedule: dense warm-up steps, then DGC's geometric warm-up
        from max(0.25, density) to ``density`` (Lin et al. 2018, section 3.4), then ``density``; None when
        ``"auto"`` chooses per bucket. Counts applied steps only."""
        cfg, t = self.cfg, self.steps_applied
        if t < cfg.warmup_dense_steps:
            return 1.0
        if cfg.density == "auto":
            return None
        t -= cfg.warmup_dense_steps
        if t < cfg.warmup_steps:
            start, frac = max(0.25, cfg.density), t / cfg.warmup_steps
            return start**(1.0 - frac) * cfg.density**frac
        return cfg.density

    def threshold_active(self) -> bool:
        """Whether this step keeps by the fixed ``threshold``: set, and neither a dense warm-up step nor a
        momentum state's own codec."""
        own = self.momentum is not None and self.momentum.codec() is not None
        return self.cfg.threshold is not None and not own and self.steps_applied >= self.cfg.warmup_dense_steps

    def _auto_density(self, srcs: Sequence[torch.Tensor], keys: Sequence[Hashable], numels: Sequence[int],
                      divisor: float, comm) -> float:
        """The smallest density leaving at most ``energy_budget`` of the accumulator's energy unsent, estimated on
        DGC's 1% samples of every tensor that is sparsified (``numels``: the tensors' full sizes), clamped to the
        bounds; then the largest over the ranks of ``comm`` (one all-reduce of one value, bounded by ``timeout_s``),
        so every rank of the exchange uses the same. ``srcs``: what is compressed with this rank's residuals (the
        full gradients or momenta, or on the hierarchical topology the node-level sums, as the residuals)."""
        cfg = self.cfg
        device = srcs[0].device
        mags = []
        for g, key, full in zip(srcs, keys, numels):
            if full < cfg.min_numel:
                continue
            flat = g.reshape(-1)
            sample = sample_indices(flat.numel(), 1, self._generator(device), device)
            acc = (flat if sample is None else flat[sample]).float() / divisor
            residual = self.memory.get(key) if cfg.error_feedback else None
            if residual is not None:
                acc += residual if sample is None else residual[sample]
            mags.append(acc.abs())
        want = cfg.density_max
        if mags:
            energy = torch.sort(torch.cat(mags).double().square(), descending=True).values
            total = float(energy.sum())
            if total > 0:
                kept_share = torch.cumsum(energy, 0) / total
                needed = int(torch.searchsorted(kept_share, torch.tensor(1.0 - cfg.energy_budget, dtype=torch.float64))) + 1
                want = needed / energy.numel()
        want = torch.tensor([min(cfg.density_max, max(cfg.density_min, want))], dtype=torch.float32, device=device)
        return float(comm.max_all_reduce(want).item())

    # ---- threshold reuse ------------------------------------------------------------------------

    def _reusable(self, key: Hashable, density: float) -> Optional[float]:
        """The stored threshold of ``key`` if it was estimated for ``density`` and for the same quantity (gradients
        or momentum) and has served fewer than ``threshold_reuse_steps`` exchanges, else None (estimate anew)."""
        entry = self.thresholds.get(key)
        if (entry is None or len(entry) != 4 or entry[1] != density or entry[2] >= self.cfg.threshold_reuse_steps
                or entry[3] != self._sends_momentum()):
            return None
        return entry[0]

    def _sends_momentum(self) -> bool:
        return self.momentum is not None and self.momentum.sending

    def _remember_thresholds(self, job: CompressJob, keys, used: Sequence[Optional[float]]) -> None:
        """After a finite exchange: stage the thresholds just estimated and the uses of the reused ones, for
        :meth:`end_step` to keep if the step is applied."""
        for i, (key, t) in enumerate(zip(keys, used)):
            if job.reuse_thresholds[i] is not None:
                self._window_thresholds.setdefault(key, "reused")
            elif t is not None:
                self._window_thresholds[key] = [t, job.density, 1, self._sends_momentum()]
            else:  # nothing selected by a threshold (sent whole): estimate afresh next time
                self._window_thresholds[key] = None

    # ---- between steps --------------------------------------------------------------------------

    def end_step(self, applied: bool) -> None:
        """The optimizer step ended. An applied step advances the warm-up clock and keeps this window's thresholds
        (a reused one has served one more step); a skipped one forgets them.

        Raises:
            DGCProtocolError: (fixed layout, after a skipped step only: the one time the flags are read on the host)
                a rank of the group received a payload that does not match its own plan; raised on every rank.
        """
        bad, self._bad_senders = self._bad_senders, []
        self._first_step = False
        if not applied and bad:
            self._check_payloads(bad)
        if applied:
            self.steps_applied += 1
            for key, change in self._window_thresholds.items():
                if change == "reused":
                    self.thresholds[key][2] += 1
                elif change is None:
                    self.thresholds.pop(key, None)
                else:
                    self.thresholds[key] = change
        self._window_thresholds = {}

    def _check_same_bucket(self, comm, fingerprint: int) -> None:
        """Fixed layout, first step: every rank of the exchange compresses a bucket of the same config and shape (else
        their payload sizes differ, which gloo and NCCL cannot report cleanly). One max all-reduce of the fingerprint
        and its negation, read on the host, per bucket of the first step only.

        Raises:
            DGCProtocolError: on every rank of the exchange, when the fingerprints differ.
        """
        both = comm.max_all_reduce(torch.tensor([fingerprint, -fingerprint], dtype=torch.int64,
                                                device=self._exchange_device(comm))).tolist()
        if both[0] != -both[1]:
            raise wire.DGCProtocolError(
                f"rank {comm.rank} of a {comm.world_size}-rank exchange: the ranks compress buckets of different "
                "configs or tensor sizes (their fingerprints differ): the 'dgc' config, the communication dtype or "
                "the model differ between ranks")

    @staticmethod
    def _exchange_device(comm):
        """Where a small tensor for ``comm``'s collectives lives (NCCL: the current GPU)."""
        return torch.device("cuda", torch.cuda.current_device()) if getattr(comm, "stream_wait", False) else "cpu"

    def _check_payloads(self, bad: Sequence[Tuple[object, torch.Tensor]]) -> None:
        """After a skipped step: whether any rank received a payload that is not of its plan (one max all-reduce per
        communicator, so every rank raises or none)."""
        by_comm = {}
        for comm, flags in bad:
            by_comm[id(comm)] = (comm, flags if id(comm) not in by_comm else by_comm[id(comm)][1] | flags)
        for comm, flags in by_comm.values():
            senders = comm.any_rank(flags)
            if senders:
                raise wire.DGCProtocolError(
                    f"rank {comm.rank} of a {comm.world_size}-rank exchange: a rank received payloads it cannot read "
                    f"from rank(s) {senders} of that exchange (the 'dgc' config, the communication dtype or the "
                    "bucket's tensor sizes differ between ranks); the step was skipped")

    def clear_thresholds(self, keys=None) -> None:
        """Forget the stored thresholds of these keys, or every one (estimated afresh at the next exchange)."""
        if keys is None:
            self.thresholds = {}
        for k in keys or ():
            self.thresholds.pop(k, None)

    def _generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        if key not in self._generators:
            self._generators[key] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[key]

    def export_state(self) -> dict:
        """What a checkpoint keeps: the sampling generators' states, the stored thresholds, the warm-up clock."""
        return {"generators": {dev: g.get_state() for dev, g in self._generators.items()},
                "thresholds": {k: list(v) for k, v in self.thresholds.items()},
                "steps_applied": self.steps_applied}

    def restore_state(self, saved: dict) -> None:
        """Put :meth:`export_state` back (generators of devices not saved restart from the seed)."""
        for dev, gen_state in saved.get("generators", {}).items():
            self._generator(torch.device(dev)).set_state(gen_state)
        self.thresholds = {k: list(v) for k, v in saved.get("thresholds", {}).items()}
        self.steps_applied = int(saved.get("steps_applied", self.steps_applied))
