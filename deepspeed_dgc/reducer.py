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

Steps 1-3 and 6 are one :class:`~deepspeed_dgc.kernels.CompressJob`, done by the fused op or
the PyTorch reference (``dgc.kernels``); the wire format is documented in :mod:`deepspeed_dgc.kernels`.
"""

import json
import zlib
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from deepspeed import comm as dist

from .compressor import packed_bytes, sample_indices
from .config import DGCConfig
from .kernels import HEADER_INT32, MAGIC, CompressJob, draw_samples, get_ops
from .memory import ErrorFeedback
from .topology import ReduceComms, build_reduce_comms, resolve_ranks_per_node


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


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


ZLIB_LEVEL = 1  # DEFLATE's fastest level: the Huffman stage, which is what codes skewed INT2/INT4 codes, is the same


def deflate(payload: torch.Tensor) -> torch.Tensor:
    """Entropy-code one uint8 payload with DEFLATE (zlib, RFC 1950/1951: LZ77 then Huffman codes), lossless.

    Quantized codes of gradients are far from uniform (most values fall in the inner levels of an
    absmax-scaled grid), so Huffman coding of their bytes saves 25-35% of INT2 and 10-25% of INT4
    codes of heavy-tailed values (Gaussian to Student-t); random-looking parts (fp32 scales, INT1
    signs) pass through at about their size. In the convergence study: 20% of a dense-INT2-momentum
    run's bytes and 14% of a dense-INT4 run's. Runs on the host: a GPU payload is copied there and back.

    Args:
        payload: 1-D uint8 tensor (any device).

    Returns:
        1-D uint8 tensor on the same device holding the zlib stream.
    """
    data = zlib.compress(payload.cpu().numpy().tobytes(), ZLIB_LEVEL)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(payload.device)


def inflate(stream: torch.Tensor, src: int) -> torch.Tensor:
    """Undo :func:`deflate` for what rank ``src`` sent.

    Args:
        stream: 1-D uint8 tensor (any device), a zlib stream.
        src: the sender's rank in the communicator (named in the error).

    Returns:
        1-D uint8 tensor on the same device: the payload as it was before :func:`deflate`.

    Raises:
        DGCProtocolError: the bytes are not a zlib stream (the sender does not entropy-code: configs differ).
    """
    try:
        data = zlib.decompress(stream.cpu().numpy().tobytes())
    except zlib.error as err:
        raise DGCProtocolError(f"rank {src} sent a payload that is not a zlib stream ({err}): 'dgc.entropy_coding' "
                               "differs between ranks") from None
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(stream.device)


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
        ops: the compression implementation (None: :func:`~deepspeed_dgc.kernels.get_ops` for
            ``cfg.kernels`` and the gradients' device, at first use).
    """

    def __init__(self,
                 cfg: DGCConfig,
                 memory: ErrorFeedback,
                 seed: int = 0,
                 ranks_per_node: Optional[int] = None,
                 ops=None):
        self.cfg = cfg
        self.memory = memory
        self.seed = seed
        self.ranks_per_node = ranks_per_node
        self.ops = ops
        self._generators = {}
        self._comms = {}
        self.momentum = None  # momentum.CompressedMomentum or momentum.MomentumCorrection (see their shared interface)
        self.steps_done = lambda: 0  # optimizer steps completed so far (the engine's integration sets it)
        self._density = cfg.density if isinstance(cfg.density, float) else cfg.density_max
        # threshold reuse: key -> [threshold (unscaled), density it was estimated for, exchanges it has served,
        # whether it selected momentum (compressed momentum after the freeze, momentum correction) or gradients]
        self.thresholds = {}

    def ops_for(self, device_type: str):
        """The compression implementation (fused or reference), chosen once."""
        if self.ops is None:
            self.ops = get_ops(self.cfg.kernels, device_type, self.cfg.quantization != "none")
        return self.ops

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

    def codec(self) -> Tuple[float, str, int]:
        """``(density, quantization, group_size)`` of the current exchange: the top-level keys, or the
        ``compressed_momentum`` ones after the freeze; the density as :meth:`step_density` or ``"auto"`` chose it."""
        if self.momentum is not None and self.momentum.frozen:
            m = self.momentum.cfg
            return self._density, m.quantization, m.group_size
        return self._density, self.cfg.quantization, self.cfg.group_size

    def step_density(self) -> Optional[float]:
        """Density of this step from the schedule: dense warm-up steps, then DGC's geometric warm-up
        from max(0.25, density) to ``density``, then ``density``; None when ``"auto"`` chooses per bucket."""
        cfg, t = self.cfg, self.steps_done()
        if t < cfg.warmup_dense_steps:
            return 1.0
        if cfg.density == "auto":
            return None
        t -= cfg.warmup_dense_steps
        if t < cfg.warmup_steps:
            start, frac = max(0.25, cfg.density), t / cfg.warmup_steps
            return start**(1.0 - frac) * cfg.density**frac
        return cfg.density

    def _auto_density(self, grads: Sequence[torch.Tensor], keys: Sequence[int], divisor: float, loss_scale: float, group,
                      device) -> float:
        """The smallest density leaving at most ``energy_budget`` of the accumulator's energy unsent, estimated on
        DGC's 1% samples of every tensor that is sparsified, clamped to the bounds; then the largest over the
        ranks of ``group`` (one all-reduce of one value), so every rank uses the same."""
        cfg = self.cfg
        mags = []
        for g, key in zip(grads, keys):
            n = g.numel()
            if n < cfg.min_numel:
                continue
            flat = g.reshape(-1)
            sample = sample_indices(n, 1, self._generator(device), device)
            acc = (flat if sample is None else flat[sample]).float() / divisor
            residual = self.memory.get(key) if cfg.topology == "flat" and cfg.error_feedback else None
            if residual is not None:
                acc += (residual if sample is None else residual[sample]) * loss_scale
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
        dist.all_reduce(want, op=dist.ReduceOp.MAX, group=group)
        return float(want.item())

    def _fingerprint(self, numels: Sequence[int], sparse: Sequence[bool], comm_dtype: torch.dtype) -> int:
        desc = json.dumps([
            self.codec(), self.cfg.stochastic_rounding, self.cfg.index_coding, self.cfg.min_numel, self.cfg.topology,
            self.ranks_per_node if self.cfg.topology == "hierarchical" else None,
            str(comm_dtype),
            list(numels),
            list(sparse)
        ])
        return zlib.crc32(desc.encode()) & 0x7FFFFFFF

    def threshold_active(self) -> bool:
        """Whether this step keeps by the fixed ``threshold``: set, and neither a dense warm-up step nor the
        momentum phase."""
        return (self.cfg.threshold is not None and not (self.momentum is not None and self.momentum.frozen)
                and self.steps_done() >= self.cfg.warmup_dense_steps)

    def is_sparse(self, numel: int) -> bool:
        """Whether a tensor of ``numel`` elements is top-k sparsified (else sent whole, still quantized)."""
        return (self.codec()[0] < 1.0 or self.threshold_active()) and numel >= self.cfg.min_numel

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
        frozen = self.momentum is not None and self.momentum.frozen
        density = self.step_density() if not frozen else self.momentum.cfg.density
        numels = [g.numel() for g in grads]
        # Stock casts to the communication dtype and pre-divides by W (the division is in the job).
        srcs = [g.reshape(-1).to(comm_dtype) for g in grads]
        divisor, job_loss_scale = float(world), loss_scale
        if self.momentum is not None:  # every step updates the local momentum; once it is sent, it replaces g
            momenta = [self.momentum.update(k, g, world, loss_scale) for k, g in zip(keys, grads)]
            if self.momentum.sending:  # unscaled fp32 values, already divided by W
                srcs = [self.momentum.to_send(k, m) for k, m in zip(keys, momenta)]
                divisor, job_loss_scale = 1.0, 1.0
        if density == "auto" or density is None:
            density = self._auto_density(srcs, keys, divisor, job_loss_scale, group, device)
        self._density = density
        sparse = [self.is_sparse(n) for n in numels]
        chunks = [-(-n // world) for n in numels]
        fingerprint = self._fingerprint(numels, sparse, comm_dtype)

        if comms.hierarchical:
            intra_before, inter_before = comms.intra.wire_bytes, comms.inter.wire_bytes
            out, finite, kept = self._reduce_two_hops(srcs, chunks, keys, numels, sparse, comms, comm_dtype, loss_scale,
                                                      fingerprint)
            intra_bytes = comms.intra.wire_bytes - intra_before
            inter_bytes = comms.inter.wire_bytes - inter_before
        else:
            job = self._job(srcs, [0] * len(srcs), chunks, numels, chunks, sparse, list(range(world)), keys, numels,
                            divisor, job_loss_scale, comm_dtype, fingerprint, device)
            before = list(job.residuals)
            out, finite, kept = self._compress_exchange(job, keys, comms.flat, rank)
            if self.momentum is not None and self.momentum.sending and finite:
                self.momentum.after_exchange(keys, srcs, sparse, before, self.memory)
            sent = comms.flat.last_sent_bytes
            intra_bytes = sum(b for d, b in enumerate(sent) if comms.dest_nodes[d] == comms.dest_nodes[rank])
            inter_bytes = sum(sent) - intra_bytes
        if self.codec()[1] == "none" and comm_dtype != torch.float32:
            out = out.to(comm_dtype).float()  # stock's result is in the communication dtype
        if job_loss_scale != loss_scale:  # momentum is sent unscaled; DeepSpeed divides by the loss scale
            out.mul_(loss_scale)

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

    def _job(self, srcs, offsets, strides, numels, chunks, sparse, row_owner, keys, residual_numels, divisor,
             loss_scale, comm_dtype, fingerprint, device) -> CompressJob:
        """The :class:`~deepspeed_dgc.kernels.CompressJob` of one exchange, with this rank's residuals
        and threshold samples (drawn from this rank's generator in tensor order)."""
        density, quantization, group_size = self.codec()
        threshold = self.cfg.threshold if self.threshold_active() else None
        ef = self.cfg.error_feedback and not (density >= 1.0 and quantization == "none" and threshold is None)
        job = CompressJob(srcs=srcs,
                          offsets=offsets,
                          row_strides=strides,
                          numels=numels,
                          chunks=chunks,
                          sparse=sparse,
                          row_owner=row_owner,
                          residuals=[self.memory.get(k) if ef else None for k in keys],
                          residual_numels=residual_numels,
                          divisor=divisor,
                          loss_scale=loss_scale,
                          density=density,
                          samples=[],
                          group_size=group_size,
                          quantize=quantization != "none",
                          value_dtype=comm_dtype,
                          fingerprint=fingerprint,
                          want_residual=ef,
                          value_format=quantization if quantization != "none" else "int4",
                          index_coding=self.cfg.index_coding_for(density),
                          threshold=threshold)
        if self.cfg.threshold_reuse_steps > 1 and threshold is None:
            job.reuse_thresholds = [self._reusable(k, density) for k in keys]
        estimate = [s and (job.reuse_thresholds is None or job.reuse_thresholds[i] is None) for i, s in enumerate(sparse)]
        job.samples = draw_samples([sum(job.real_counts(i)) for i in range(len(numels))], estimate, density,
                                   self._generator(device), device)
        if self.cfg.stochastic_rounding and quantization in ("int4", "int2"):
            job.rounding_generator = self._generator(device)
        return job

    def _reusable(self, key: int, density: float) -> Optional[float]:
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
        """After a finite exchange: store the thresholds just estimated, count one more use of the reused ones."""
        for i, (key, t) in enumerate(zip(keys, used)):
            if job.reuse_thresholds[i] is not None:
                self.thresholds[key][2] += 1
            elif t is not None:
                self.thresholds[key] = [t, job.density, 1, self._sends_momentum()]
            else:  # nothing selected by a threshold (sent whole): estimate afresh next time
                self.thresholds.pop(key, None)

    def _reduce_two_hops(self, srcs, chunks, keys, numels, sparse, comms, comm_dtype, loss_scale, fingerprint):
        """Dense reduce-scatter inside the node, then the compressed exchange between nodes."""
        L, N = comms.ranks_per_node, comms.n_nodes
        world = comms.world_size
        device = srcs[0].device
        C = sum(chunks)
        # owner matrix of g/W: row o = owner o's slices of every tensor, zero-padded
        cols = [
            torch.nn.functional.pad(s.float().div(world), (0, world * c - s.numel())).view(world, c)
            for s, c in zip(srcs, chunks)
        ]
        acc_m = torch.cat(cols, dim=1)
        payloads = [_bytes(acc_m[j::L].to(comm_dtype)) for j in range(L)]  # rows of owners k*L + j
        received = comms.intra.all_to_all(payloads)
        node_sum = torch.zeros(N, C, dtype=torch.float32, device=device)
        for buf in received:  # in local-rank order, the same on every rank
            node_sum.add_(buf.view(comm_dtype).view(N, C).float())
        owners = [k * L + comms.local_rank for k in range(N)]
        if N == 1:
            return node_sum[0], True, sum(max(0, min(c, n - owners[0] * c)) for n, c in zip(numels, chunks))
        starts = [sum(chunks[:i]) for i in range(len(chunks))]
        job = self._job([node_sum.view(-1)] * len(srcs), starts, [C] * len(srcs), numels, chunks, sparse, owners, keys,
                        [N * c for c in chunks], 1.0, loss_scale, comm_dtype, fingerprint, device)
        return self._compress_exchange(job, keys, comms.inter, comms.node)

    def _compress_exchange(self, job: CompressJob, keys, comm, my_row: int) -> Tuple[torch.Tensor, bool, int]:
        """Compress row o of the job for rank o of ``comm``, exchange, sum what arrived, stage residuals.

        Returns:
            ``(out, finite, kept)``: the fp32 sum over senders of row ``my_row``, shape ``(C,)``; whether
            this rank's input was finite (it sends nothing otherwise); values it sent.
        """
        result = self.ops_for(job.srcs[0].device.type).compress(job)
        if self.cfg.entropy_coding == "zlib":
            received = [inflate(b, src) for src, b in enumerate(comm.all_to_all([deflate(p) for p in result.payloads]))]
        else:
            received = comm.all_to_all(result.payloads)
        seg_real = [job.real_counts(i)[my_row] for i in range(len(job.numels))]
        out = self._sum_received(received, job, seg_real)
        if job.reuse_thresholds is not None and result.finite:
            self._remember_thresholds(job, keys, result.thresholds)
        if result.residuals is not None:
            for key, residual in zip(keys, result.residuals):
                self.memory.stage(key, residual)
        return out, result.finite, result.kept

    def _sum_received(self, received: Sequence[torch.Tensor], job: CompressJob, seg_real: Sequence[int]) -> torch.Tensor:
        """Decode every sender's payload for this rank's row and sum them in sender order.

        Args:
            received: uint8 payload from each rank of the communicator.
            job: this rank's job (layout, fingerprint, value format).
            seg_real: real elements of each tensor in this rank's row.

        Returns:
            fp32 sums over this rank's row, padded layout, shape ``(sum c_i,)``.

        Raises:
            DGCProtocolError: a payload is malformed or was made under another config or bucket.
        """
        device = job.srcs[0].device
        comm_dtype = job.value_dtype
        itemsize = torch.empty(0, dtype=comm_dtype).element_size()
        out = torch.zeros(sum(job.chunks), dtype=torch.float32, device=device)
        n_implied = sum(r for r, s in zip(seg_real, job.sparse) if not s)
        ops = self.ops_for(device.type)
        for src, buf in enumerate(received):
            header, off = _take(buf, 0, 4 * HEADER_INT32, torch.int32)
            magic, fp, kept, n_index, n_groups = header.tolist()
            if magic != MAGIC or fp != job.fingerprint:
                raise DGCProtocolError(
                    f"rank {src} sent a payload this rank cannot read (magic {magic:#x}, fingerprint {fp} vs "
                    f"{job.fingerprint}): the 'dgc' config, the communication dtype or the bucket's tensor sizes "
                    "differ between ranks")
            if min(kept, n_index, n_groups) < 0:
                raise DGCProtocolError(f"rank {src} sent negative sizes in its header {header.tolist()}")
            n_indexed = kept - n_implied
            if n_indexed < 0 and kept != 0:
                raise DGCProtocolError(f"rank {src} kept {kept} elements, fewer than the {n_implied} sent whole")
            scales, off = _take(buf, off, 4 * n_groups, torch.float32)
            if job.quantize:
                values, off = _take(buf, off, packed_bytes(kept, job.value_format), torch.uint8)
            else:
                values, off = _take(buf, off, itemsize * kept, comm_dtype)
            index_bytes, off = _take(buf, off, n_index, torch.uint8)
            if buf.numel() - off >= 4:
                raise DGCProtocolError(f"rank {src} sent {buf.numel()} bytes, expected {off} plus padding")
            if kept == 0:
                continue  # a rank whose input was not finite sends nothing
            try:
                ops.decode_add(out, values, scales, index_bytes, kept, n_indexed, seg_real, job.chunks, job.sparse,
                               job.group_size, job.quantize, comm_dtype, job.value_format, job.index_coding)
            except ValueError as err:
                raise DGCProtocolError(f"rank {src}: {err}") from None
        return out
