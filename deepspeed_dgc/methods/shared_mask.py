"""Owner-chosen shared masks, after SCAPE (arXiv 2607.01678, section 3): every rank sends the same coordinates.

After each applied step every owner chooses, from its Adam state, the columns of its partition that the next step
sends (:func:`~deepspeed_dgc.zero3.optimizer.choose_masks`) and tells every rank (:meth:`~deepspeed_dgc.zero3.
reduce_scatter.CompressedReduceScatter.set_masks`); a bucket then sends the error-feedback accumulator at those columns,
values only (:mod:`~deepspeed_dgc.codec.masked`), and keeps the rest as its residual (one block per bucket). Until the
first masks exist (``warmup_steps``) the bucket goes by the top-level codec (dense INT4 with error feedback).
"""

from typing import Optional

import torch

from ..codec import fixed, masked, wire
from ..codec.layout import host_to_device, layout_for
from ..memory.error_feedback import FP8_RESIDUAL_GROUP
from ..telemetry import ReduceResult
from ..zero3 import optimizer as owners
from .base import Bucket, Exchange, GradientMethod, Reduced, register
from .topk import TopKExact, TopKFixed


@register("shared_mask", lambda cfg, device: cfg.shared_mask is not None, order=10)
class SharedMaskMethod(GradientMethod):
    """See the module docstring."""

    def __init__(self, reducer):
        super().__init__(reducer)
        self._warm = None
        self._cols = {}  # (bucket keys, layout, masks' version) -> int64 (R, K) mask columns in the owner matrix

    def _warmup(self, device_type: str):
        """The top-level codec of the warm-up steps, in the layout of ``device_type``."""
        cls = TopKFixed if self.reducer.layout(device_type) == "fixed" else TopKExact
        if type(self._warm) is not cls:
            self._warm = cls(self.reducer)
        return self._warm

    def ready(self, bucket: Bucket) -> bool:
        """Whether every tensor of the bucket has its owners' masks (after the warm-up)."""
        masks = self.reducer.masks
        return bool(masks) and all(k in masks for k in bucket.keys)

    def fixed_payloads(self, bucket):
        return self.ready(bucket) or self._warmup(bucket.device.type).fixed_payloads(bucket)

    def layout(self, bucket, owners_):
        if not self.ready(bucket):
            return self._warmup(bucket.device.type).layout(bucket, owners_)
        return layout_for(bucket.numels, bucket.world, owners_, FP8_RESIDUAL_GROUP)

    def reduce(self, bucket: Bucket, exchange: Exchange, A: Optional[torch.Tensor] = None) -> Reduced:
        if not self.ready(bucket):
            return self._warmup(bucket.device.type).reduce(bucket, exchange, A)
        r, cfg = self.reducer, self.cfg.shared_mask
        L = self.layout(bucket, exchange.owners)
        R, device, ws = exchange.rows, bucket.device, bucket.workspace
        res_numels = list(bucket.numels) if A is None else [R * c for c in bucket.chunks]
        if A is None:
            A = fixed.owner_matrix(R, L.columns, device)
            L.gather(bucket.srcs, A)
        if bucket.divisor != 1:
            A.div_(bucket.divisor)
        if self.cfg.error_feedback:
            r.memory.add_block(bucket.keys, res_numels, L, A, ws)
        cols = self._columns(bucket, L, device)
        counts = [r.masks[k].shape[1] for k in bucket.keys]
        plan = masked.value_plan(counts, cfg.quantization, cfg.group_size)
        fingerprint = wire.fingerprint([bucket.fingerprint, "masked", list(plan.counts), cfg.quantization,
                                        cfg.group_size])
        payloads = masked.encode(A, cols, plan, fingerprint)
        if self.cfg.error_feedback:
            r.memory.stage_block(bucket.keys, res_numels, L, A, ws)
        r.check_first_bucket(exchange.comm, fingerprint)
        received = exchange.comm.all_to_all_fixed(payloads)
        out, bad = masked.decode_sum(received, cols[exchange.row], L.columns, plan, fingerprint)
        r.note_bad_senders(exchange.comm, bad)
        return Reduced(out, L.row_slices(out, exchange.row), True, exchange.comm.world_size * plan.values)

    def _columns(self, bucket: Bucket, L, device) -> torch.Tensor:
        """int64 ``(R, K)``: every owner's mask positions of every tensor as columns of the owner matrix (one gather
        of the masks and one offset per tensor, made once per bucket and set of masks)."""
        key = (tuple(bucket.keys), L.key, self.reducer.masks_version)
        if key not in self._cols:
            self._cols = {}
            masks = [self.reducer.masks[k] for k in bucket.keys]
            counts = [m.shape[1] for m in masks]
            offsets = host_to_device(torch.repeat_interleave(  # built on the host, copied without a wait (every step)
                torch.tensor([L.cols[i] for i in range(len(masks))], dtype=torch.long),
                torch.tensor(counts, dtype=torch.long), output_size=sum(counts)), device)
            self._cols[key] = torch.cat(masks, dim=1) + offsets[None, :]
        return self._cols[key]

    def after_load(self, opt, state) -> None:
        """The masks chosen again from the loaded Adam state (they are not saved). A checkpoint whose optimizer state
        holds no Adam moments (saved by decoupled momentum's sign update: they start from zero, and the load says so)
        has nothing to choose from: the next step goes by the warm-up codec, and the masks follow it."""
        basic = opt.optimizer
        if any("exp_avg" not in basic.state.get(flat, {}) for flat in opt.fp32_partitioned_groups_flat):
            return
        self.after_step(opt, state, True)

    def after_step(self, opt, state, applied: bool) -> None:
        """After an applied step past the warm-up: every owner chooses its masks from its Adam state and sends them to
        every rank, for the next step (collective over the data-parallel group; the bytes count in this step's
        gradient traffic). On the hierarchical topology they go over the inter-node communicator: the owners of the
        node-level rows a rank sends are exactly its members."""
        cfg, r = state.cfg.shared_mask, state.reducer
        if not applied or r.steps_applied < cfg.warmup_steps:
            return
        comms = r.comms_for(opt.dp_process_group)
        if comms.hierarchical and comms.n_nodes == 1:
            return  # nothing crosses a node: the node's sums are sent whole
        comm = comms.inter if comms.hierarchical else comms.flat
        keys, chunks, own = owners.choose_masks(opt, cfg.density, cfg.score, cfg.explore, r.steps_applied,
                                                comms.world_size, state.key_of)
        sent = r.set_masks(comm, keys, chunks, own)
        intra, inter = (0, sent) if comms.hierarchical else comms.split_by_node(comm.last_sent_bytes)
        state.stats.record(ReduceResult(wire_bytes=sent, dense_fp32_bytes=0.0, kept=0, numel=0, finite=True,
                                        intra_node_wire_bytes=intra, inter_node_wire_bytes=inter))
