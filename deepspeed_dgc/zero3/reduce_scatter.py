"""The compressed reduce-scatter that replaces ZeRO-3's ``__avg_scatter_grads``: one bucket, top-down.

Per bucket of full local gradients ``g_1..g_T`` on a group of W ranks, :meth:`CompressedReduceScatter.reduce_scatter`
runs these steps in order (GRACE's ``step``, Xu et al., ICDCS 2021):

1. entry (:meth:`~CompressedReduceScatter.enter`): the loss scale and the averaging over W are to be removed once, by
   dividing the sources by ``W * loss_scale`` in the first fp32 pass; the bucket's density, codec and fingerprint are
   fixed; where the caller allows it, the gradients' memory becomes the bucket's workspace once read;
2. to 6. the method (:mod:`deepspeed_dgc.methods`, one class per method behind one interface, picked from the config
   once): the residuals or momenta in, what each owner row is sent, one all-to-all (:mod:`deepspeed_dgc.comm`), this
   rank's row of the sum over senders, what is kept staged for the step's end; the hierarchical topology wraps any
   method (a dense reduce-scatter inside the node first, ZeRO++ qgZ's two hops, arXiv 2306.10209, section 4.2);
7. exit: the loss scale is restored once, and this rank's slice of each tensor is handed back.

Output contract (tested against stock DeepSpeed): one tensor per input, this rank's slice
``flat[r*c : min((r+1)*c, n)]`` (possibly empty) of the mean over the group. In lossless mode (density 1, no
quantization) it is bit-identical to stock at 2 ranks.
"""

from typing import Dict, Hashable, List, Optional, Sequence, Tuple

import torch

from ..codec import wire
from ..codec.job import CompressJob
from ..codec.kernels import get_ops
from ..codec.layout import Workspace, storage_region
from ..codec.selection import sample_indices
from ..comm.communicators import group_global_ranks
from ..comm.topology import ReduceComms, build_reduce_comms, resolve_ranks_per_node
from ..config import DGCConfig
from ..memory.error_feedback import ErrorFeedback
from ..memory.momentum import MomentumState
from .. import methods
from ..methods.base import Bucket
from ..telemetry import ReduceResult

__all__ = ["Bucket", "CompressedReduceScatter", "reduce_result"]


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
    """Compressed reduce-scatter of one ZeRO-3 optimizer: the entry and exit of every bucket, the schedule and the
    state the methods share, and the method (:func:`deepspeed_dgc.methods.base.build`).

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
        thresholds: threshold reuse (exact layout), key -> ``[threshold (unscaled), density it was estimated for,
            applied optimizer steps it has served, whether it selected momentum]``; this accumulation window's changes
            are staged and kept only if its step is applied (:meth:`end_step`).
        masks: ``shared_mask``: key -> int64 ``(W, k)``, owner o's columns in row o (:meth:`set_masks`).
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
        self._bad_senders: List[Tuple[object, torch.Tensor]] = []  # fixed sizes: (communicator, bad flags) this step
        self._first_step = True  # fixed sizes: every bucket's shape is checked across ranks until the first step ends
        self.masks: Dict[Hashable, torch.Tensor] = {}
        self.masks_version = 0
        self.density = cfg.density if isinstance(cfg.density, float) else cfg.density_max
        self._methods: Dict[str, methods.GradientMethod] = {}

    def method_for(self, device_type: str) -> methods.GradientMethod:
        """The method that reduces buckets on ``device_type`` (built once)."""
        if device_type not in self._methods:
            self._methods[device_type] = methods.build(self, device_type)
        return self._methods[device_type]

    # ---- the bucket path ------------------------------------------------------------------------

    def reduce_scatter(self, grads: Sequence[torch.Tensor], keys: Sequence[Hashable], group, comm_dtype: torch.dtype,
                       loss_scale: float = 1.0, consume: bool = False) -> Tuple[List[torch.Tensor], ReduceResult]:
        """Mean over the group of each gradient, scattered by owner rank, compressed on the wire.

        Args:
            grads: full local gradients, one per parameter, any shape (n_i elements), any float dtype, multiplied
                by ``loss_scale``. Every rank passes tensors of the same sizes in the same order.
            keys: error-feedback key of each gradient (a stable identity of its parameter).
            group: process group of the partition (None: the world).
            comm_dtype: dtype of values on the wire when ``quantization`` is ``"none"`` (and of the
                dense intra-node hop).
            loss_scale: the fp16 loss scale the gradients carry (1 for bf16 and fp32).
            consume: the gradients' memory may be overwritten once they are read (ZeRO-3's bucket, whose contents are
                dead after this call): the bucket's temporaries go there instead of new memory.

        Returns:
            ``(partitions, result)``: per gradient, an fp32 tensor of this rank's slice of the
            mean, shape ``(max(0, min(c, n - r*c)),)``, in the gradients' (scaled) units (views of one row, valid
            until the next bucket when ``consume``); and a :class:`~deepspeed_dgc.telemetry.ReduceResult`.

        Raises:
            DGCProtocolError: a payload from another rank does not match this rank's
                expectation (config or bucket differ between ranks); every rank that receives
                such a payload raises.
            DGCTimeoutError: an exchange did not finish within ``dgc.timeout_s``.
        """
        comms = self.comms_for(group)
        bucket = self.enter(grads, keys, comms, comm_dtype, loss_scale, consume)
        before = [(c, c.wire_bytes) for c in (comms.flat, comms.intra, comms.inter) if c is not None]
        reduced = self.method_for(bucket.device.type).reduce_all(bucket, comms)
        if comms.hierarchical:
            intra_bytes = comms.intra.wire_bytes - before[0][1]
            inter_bytes = comms.inter.wire_bytes - before[1][1]
        else:
            intra_bytes, inter_bytes = comms.split_by_node(comms.flat.last_sent_bytes)
        outputs = self._exit(reduced, bucket)
        return outputs, reduce_result(comms, bucket.numels, intra_bytes, inter_bytes, reduced.kept, reduced.finite)

    def enter(self, grads, keys, comms: ReduceComms, comm_dtype, loss_scale: float, consume: bool) -> Bucket:
        """Step 1: what is compressed, divided by what, with which codec (the :class:`Bucket` a method takes; also
        built for a bucket that ``policy: "auto"`` sends by stock, where the method says what it carries)."""
        world = comms.world_size
        numels = [g.numel() for g in grads]
        # stock casts to the communication dtype and pre-divides by W; the loss scale goes with the division
        srcs = [g.reshape(-1).to(comm_dtype) for g in grads]
        region = storage_region(srcs) if consume else None
        bucket = Bucket(keys=list(keys), numels=numels, chunks=[-(-n // world) for n in numels], world=world,
                        grads=list(grads), srcs=srcs, divisor=float(world) * loss_scale, loss_scale=loss_scale,
                        comm_dtype=comm_dtype, workspace=Workspace([region] if region is not None else []))
        override = self.momentum.codec() if self.momentum is not None else None
        density = self.step_density() if override is None else override[0]
        if density == "auto" or density is None:
            # estimated on what is compressed: the hierarchical topology's node-level sums (after the dense hop) or a
            # momentum state's values (once the method has them)
            if comms.hierarchical or (self.momentum is not None and self.momentum.sending):
                return self._set_codec(bucket, "auto")
            return self._set_codec(bucket, self._auto_density([s.view(-1) for s in srcs], bucket.keys, numels,
                                                              bucket.divisor, comms.flat))
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
                       list(bucket.numels), list(bucket.sparse), self.layout(bucket.device.type),
                       self.cfg.capacity_factor]
        bucket.fingerprint = wire.fingerprint(description)
        return bucket

    def resolve_density(self, bucket: Bucket, values: Sequence[torch.Tensor], divisor: float, comm) -> None:
        """``density: "auto"`` decided late: estimated on what is compressed (per tensor, divided by ``divisor``: the
        hierarchical topology's node-level sums, or a momentum state's values) over ``comm`` (collective), and the
        codec fixed with it."""
        self._set_codec(bucket, self._auto_density(values, bucket.keys, bucket.numels, divisor, comm))

    def _exit(self, reduced, bucket: Bucket) -> List[torch.Tensor]:
        """Step 7: the loss scale restored, stock's rounding to the communication dtype for raw values, this
        rank's slice of each tensor (NaN everywhere when this rank's input was not finite, so that DeepSpeed's
        overflow check skips the step on every rank)."""
        out = reduced.out
        if bucket.loss_scale != 1:
            out.mul_(bucket.loss_scale)
        if bucket.quantization == "none" and bucket.comm_dtype != torch.float32:
            out.copy_(out.to(bucket.comm_dtype))  # stock's result is in the communication dtype
        if not reduced.finite:
            out.fill_(float("nan"))
        return reduced.views

    # ---- what the methods share: checks of the exchange, thresholds, masks ------------------------------------

    def check_first_bucket(self, comm, fingerprint: int) -> None:
        """Fixed-size payloads: until the first step ends, that every rank of ``comm`` compresses a bucket of the same
        config and shape (:meth:`_check_same_bucket`)."""
        if self._first_step and comm is not None:
            self._check_same_bucket(comm, fingerprint)

    def note_bad_senders(self, comm, bad: torch.Tensor) -> None:
        """Fixed-size payloads: the senders whose payload this rank could not read (a device tensor), checked on the
        host only after a skipped step (:meth:`end_step`)."""
        self._bad_senders.append((comm, bad))

    def generator(self, device) -> torch.Generator:
        """This rank's generator of threshold samples and stochastic rounding on ``device``."""
        return self._generator(torch.device(device))

    def reusable(self, key: Hashable, density: float) -> Optional[float]:
        return self._reusable(key, density)

    def remember_thresholds(self, job: CompressJob, keys, used) -> None:
        self._remember_thresholds(job, keys, used)

    def set_masks(self, comm, keys: Sequence[Hashable], chunks: Sequence[int], own: Sequence[torch.Tensor]) -> int:
        """Every owner's shared masks to every rank (``shared_mask``): this owner's positions ``own[i]`` (``(k_i,)``
        below ``chunks[i]``) packed (:func:`~deepspeed_dgc.codec.masked.pack_masks`), one all-to-all of the same row to
        everyone (an all-gather of fixed size, bounded by ``timeout_s``); :attr:`masks` becomes key -> int64
        ``(W, k_i)``. Collective over ``comm``; returns the bytes this rank sent."""
        from ..codec import masked
        local = masked.pack_masks(own, chunks)
        received = comm.all_to_all_fixed(local.expand(comm.world_size, -1).contiguous())
        self.masks = dict(zip(keys, masked.unpack_masks(received, chunks, [m.numel() for m in own])))
        self.masks_version += 1
        return sum(comm.last_sent_bytes)

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
        """The communicators of ``group``, created once per set of ranks (collective over the world the first time:
        :func:`~deepspeed_dgc.zero3.patches.install` builds the data-parallel group's at initialize, so a bucket over
        the same ranks, whichever group object ZeRO-3 passes, finds them made)."""
        key = tuple(group_global_ranks(group))
        if key not in self._comms:
            if self.ranks_per_node is None:
                self.ranks_per_node = resolve_ranks_per_node(self.cfg)[0]
            self._comms[key] = build_reduce_comms(self.cfg, group, self.ranks_per_node)
        return self._comms[key]

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
                budget = torch.tensor(1.0 - cfg.energy_budget, dtype=torch.float64, device=kept_share.device)
                needed = int(torch.searchsorted(kept_share, budget)) + 1  # searchsorted: both on one device
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
