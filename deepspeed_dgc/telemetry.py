"""Telemetry: bytes on the wire, compression ratio, density and residual norm per step and per run.

The compressed reduce-scatter returns a :class:`ReduceResult` per bucket; the step wrapper closes each
optimizer step (:meth:`DGCStats.end_step`) and writes a log line and DeepSpeed monitor events
(TensorBoard, CSV, W&B, as the ds_config asks) every ``dgc.stats_interval`` steps.
"""

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Dict, Optional

from deepspeed.utils import logger


@dataclass
class ReduceResult:
    """What one compressed reduce-scatter call did.

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
        stock_buckets: 1 when ``policy: "auto"`` sent this bucket by stock's reduce-scatter, else 0.
    """
    wire_bytes: int
    dense_fp32_bytes: float
    kept: int
    numel: int
    finite: bool
    intra_node_wire_bytes: int = 0
    inter_node_wire_bytes: int = 0
    inter_node_dense_fp32_bytes: float = 0.0
    stock_buckets: int = 0


@dataclass
class StepStats:
    """Counters of one optimizer step on this rank (all micro-steps of its accumulation window).

    Attributes:
        step: optimizer step number (1-based, counting skipped steps).
        wire_bytes: bytes sent to other ranks by the compressed reduce-scatter.
        intra_node_wire_bytes, inter_node_wire_bytes: ``wire_bytes`` split by whether the
            destination is on this rank's node (the fast link) or on another node.
        inter_node_dense_fp32_bytes: what stock fp32 reduce-scatter would send to other nodes.
        dense_fp32_bytes: bytes stock fp32 reduce-scatter would have sent for the same tensors.
        kept: elements sent (tensors that are not sparsified count whole).
        numel: elements of all reduced tensors.
        skipped: the step was skipped (overflow); its residual updates were rolled back.
        residual_norm: L2 norm of all residuals after the step (only on logged steps, else None).
        param_wire_bytes: bytes sent to other ranks by parameter all-gathers through our seam.
        param_dense_fp32_bytes: what fp32 gathers of the same shards would send, ``(W-1) * n * 4``.
        param_inter_node_wire_bytes, param_inter_node_dense_fp32_bytes: the part of each sent to
            ranks on other nodes.
        param_uncovered_bytes: bytes of the post-step gather of persistent parameters, which no
            seam covers (stock dtype, estimated as ``(W-1) * shard numel * element size``).
        stock_buckets: buckets ``policy: "auto"`` sent by stock's reduce-scatter (their bytes are in the counts).
    """
    step: int = 0
    wire_bytes: int = 0
    intra_node_wire_bytes: int = 0
    inter_node_wire_bytes: int = 0
    inter_node_dense_fp32_bytes: float = 0.0
    dense_fp32_bytes: float = 0.0
    kept: int = 0
    numel: int = 0
    param_wire_bytes: int = 0
    param_dense_fp32_bytes: float = 0.0
    param_inter_node_wire_bytes: float = 0.0
    param_inter_node_dense_fp32_bytes: float = 0.0
    param_uncovered_bytes: int = 0
    stock_buckets: int = 0
    skipped: bool = False
    residual_norm: Optional[float] = None

    @property
    def compression_ratio(self) -> float:
        """Dense fp32 bytes over wire bytes (0 when nothing was sent)."""
        return self.dense_fp32_bytes / self.wire_bytes if self.wire_bytes else 0.0

    @property
    def density(self) -> float:
        """Fraction of elements sent (1 when nothing was reduced)."""
        return self.kept / self.numel if self.numel else 1.0


# Per-step counters of StepStats; DGCStats keeps a run total of each as ``<name>_total``.
PARAM_GATHER_COUNTERS = ("param_wire_bytes", "param_dense_fp32_bytes", "param_inter_node_wire_bytes",
                         "param_inter_node_dense_fp32_bytes")
STEP_COUNTERS = ("wire_bytes", "intra_node_wire_bytes", "inter_node_wire_bytes", "inter_node_dense_fp32_bytes",
                 "dense_fp32_bytes", "kept", "numel", "stock_buckets") + PARAM_GATHER_COUNTERS + ("param_uncovered_bytes", )

# The counters a ReduceResult carries (every field but the ``finite`` flag); each is a StepStats counter.
REDUCE_COUNTERS = tuple(f.name for f in fields(ReduceResult) if f.name != "finite")


@dataclass
class DGCStats:
    """Run totals of this rank plus the last completed step, readable by a training script.

    Get it with :func:`deepspeed_dgc.get_stats`. Byte counts are this rank's: what it sent to
    other ranks (``wire_bytes_total``) and what stock fp32 ZeRO-3 would have sent for the same
    reduce-scatters (``dense_fp32_bytes_total``, ``(W-1)/W * numel * 4`` per tensor and call).
    These and ``compression_ratio`` are about gradients; the ``param_*`` totals count the
    parameter all-gathers (see :class:`StepStats`).
    """
    steps: int = 0
    skipped_steps: int = 0
    wire_bytes_total: int = 0
    intra_node_wire_bytes_total: int = 0
    inter_node_wire_bytes_total: int = 0
    inter_node_dense_fp32_bytes_total: float = 0.0
    dense_fp32_bytes_total: float = 0.0
    kept_total: int = 0
    numel_total: int = 0
    param_wire_bytes_total: int = 0
    param_dense_fp32_bytes_total: float = 0.0
    param_inter_node_wire_bytes_total: float = 0.0
    param_inter_node_dense_fp32_bytes_total: float = 0.0
    param_uncovered_bytes_total: int = 0
    stock_buckets_total: int = 0
    # policy "auto": bucket shape -> its choice and measured times (latest measurement); bytes its probes sent
    policy: Dict[str, dict] = field(default_factory=dict)
    policy_probe_bytes: int = 0
    kernels: str = ""  # which compression path ran: "fused-cpu", "fused-cuda" or "reference"
    residual_storage: str = ""  # the residuals' storage dtype, "auto" resolved (set at install)
    world_size: int = 1  # of the data-parallel group (set at install)
    n_params: int = 0  # elements of the model's parameters (set at install)
    state_bytes: int = 0  # the extension's persistent state on this rank after the last step (bytes)
    # what it holds in host memory (residual_offload, decoupled_momentum.offload): the committed state there, and the
    # second host buffer of each bucket's block that the next window writes back into (bytes)
    host_state_bytes: int = 0
    # the committed state on the device (bytes): state_bytes less its part on the host (the first bucket's block,
    # fetched ahead for the next backward, is not counted: it is a copy)
    device_state_bytes: int = 0
    # the most the extension's state held on this rank in this process: committed plus a window's staged residuals
    # and momenta, at any stage (each at its own peak; bytes; the bucket path's buffers, one bucket at a time, aside)
    peak_state_bytes: int = 0
    # the most the window's held gradients took at once (``accumulate_locally`` with gradient accumulation; bytes)
    held_gradient_peak_bytes: int = 0
    last: Optional[StepStats] = None
    _current: StepStats = field(default_factory=StepStats, repr=False)

    @property
    def compression_ratio(self) -> float:
        """Run total dense fp32 bytes over wire bytes (0 before anything was sent)."""
        return self.dense_fp32_bytes_total / self.wire_bytes_total if self.wire_bytes_total else 0.0

    @property
    def mean_density(self) -> float:
        """Run total elements sent over elements reduced."""
        return self.kept_total / self.numel_total if self.numel_total else 1.0

    @property
    def bits_per_kept_element(self) -> float:
        """Gradient wire bits per value sent to another rank: everything on the wire (values, positions,
        scales, headers, size exchange) over ``kept_total * (W-1)/W`` (a rank keeps its own slice); 0 before
        anything was sent."""
        sent = self.kept_total * (self.world_size - 1) / self.world_size
        return 8.0 * self.wire_bytes_total / sent if sent else 0.0

    @property
    def state_bytes_per_param(self) -> float:
        """Persistent state of the extension on this rank (residuals, local momentum, preconditioner)
        per model parameter, in bytes."""
        return self.state_bytes / self.n_params if self.n_params else 0.0

    def record(self, r: ReduceResult) -> None:
        """Add one reduce-scatter call to the current step."""
        cur = self._current
        for name in REDUCE_COUNTERS:
            setattr(cur, name, getattr(cur, name) + getattr(r, name))

    def record_param_gather(self, wire_bytes: int, dense_fp32_bytes: float, off_node_fraction: float = 0.0) -> None:
        """Add one parameter all-gather to the current step and to the run totals (engines without an optimizer
        take no steps); ``off_node_fraction`` of both byte counts went to ranks on other nodes."""
        added = (wire_bytes, dense_fp32_bytes, wire_bytes * off_node_fraction, dense_fp32_bytes * off_node_fraction)
        for name, value in zip(PARAM_GATHER_COUNTERS, added):
            setattr(self._current, name, getattr(self._current, name) + value)
            setattr(self, name + "_total", getattr(self, name + "_total") + value)

    def end_step(self, skipped: bool, residual_norm: Optional[float], param_uncovered_bytes: int = 0) -> StepStats:
        """Close the current step, add it to the totals and return it."""
        cur = self._current
        cur.param_uncovered_bytes = param_uncovered_bytes
        self.steps += 1
        cur.step, cur.skipped, cur.residual_norm = self.steps, skipped, residual_norm
        self.skipped_steps += int(skipped)
        for name in STEP_COUNTERS:
            if name not in PARAM_GATHER_COUNTERS:  # those are added as they happen
                setattr(self, name + "_total", getattr(self, name + "_total") + getattr(cur, name))
        self.last = cur
        self._current = StepStats()
        return cur

    def totals(self) -> Dict[str, Any]:
        """The run totals (``steps``, ``skipped_steps`` and every ``<counter>_total``), e.g. for a checkpoint."""
        return {name: getattr(self, name) for name in ("steps", "skipped_steps") + tuple(c + "_total" for c in STEP_COUNTERS)}

    def restore_totals(self, totals: Dict[str, Any]) -> None:
        """Put :meth:`totals` back (from a checkpoint); keys this version does not know are ignored."""
        for name, value in totals.items():
            if name in self.__dataclass_fields__:
                setattr(self, name, value)

    def to_dict(self) -> Dict[str, Any]:
        """Totals and the last step as a JSON-ready dict."""
        return {
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
            "wire_bytes_total": self.wire_bytes_total,
            "dense_fp32_bytes_total": round(self.dense_fp32_bytes_total),
            "compression_ratio": self.compression_ratio,
            "mean_density": self.mean_density,
            "bits_per_kept_element": self.bits_per_kept_element,
            "state_bytes": self.state_bytes,
            "state_bytes_per_param": self.state_bytes_per_param,
            "host_state_bytes": self.host_state_bytes,
            "device_state_bytes": self.device_state_bytes,
            "peak_state_bytes": self.peak_state_bytes,
            "held_gradient_peak_bytes": self.held_gradient_peak_bytes,
            "residual_storage": self.residual_storage,
            "grad_wire_bytes_total": self.wire_bytes_total,
            "grad_intra_node_wire_bytes_total": self.intra_node_wire_bytes_total,
            "grad_inter_node_wire_bytes_total": self.inter_node_wire_bytes_total,
            "grad_inter_node_dense_fp32_bytes_total": round(self.inter_node_dense_fp32_bytes_total),
            "grad_dense_fp32_bytes_total": round(self.dense_fp32_bytes_total),
            "param_wire_bytes_total": self.param_wire_bytes_total,
            "param_dense_fp32_bytes_total": round(self.param_dense_fp32_bytes_total),
            "param_inter_node_wire_bytes_total": round(self.param_inter_node_wire_bytes_total),
            "param_inter_node_dense_fp32_bytes_total": round(self.param_inter_node_dense_fp32_bytes_total),
            "param_uncovered_bytes_total": self.param_uncovered_bytes_total,
            "stock_buckets_total": self.stock_buckets_total,
            "policy": dict(self.policy),
            "policy_probe_bytes": self.policy_probe_bytes,
            "last": None if self.last is None else dict(asdict(self.last),
                                                         compression_ratio=self.last.compression_ratio,
                                                         density=self.last.density),
        }


def log_step(s: StepStats, rank: int, monitor=None, global_samples: int = 0) -> None:
    """Write a step's telemetry as one log line and, if enabled, to DeepSpeed's monitor."""
    norm = "n/a" if s.residual_norm is None else f"{s.residual_norm:.4g}"
    logger.info(f"[deepspeed_dgc] rank {rank} step {s.step}: wire {s.wire_bytes} B "
                f"(intra-node {s.intra_node_wire_bytes} B, inter-node {s.inter_node_wire_bytes} B), dense fp32 {s.dense_fp32_bytes:.0f} B, "
                f"ratio {s.compression_ratio:.1f}x, density {s.density:.4f}, residual norm {norm}; "
                f"params: wire {s.param_wire_bytes} B, dense fp32 {s.param_dense_fp32_bytes:.0f} B, "
                f"uncovered {s.param_uncovered_bytes} B"
                f"{f'; {s.stock_buckets} bucket(s) sent by stock (policy auto)' if s.stock_buckets else ''}"
                f"{', skipped (overflow)' if s.skipped else ''}")
    if monitor is not None and getattr(monitor, "enabled", False) and rank == 0:
        events = [("Train/dgc/wire_bytes", s.wire_bytes, global_samples),
                  ("Train/dgc/inter_node_wire_bytes", s.inter_node_wire_bytes, global_samples),
                  ("Train/dgc/compression_ratio", s.compression_ratio, global_samples),
                  ("Train/dgc/density", s.density, global_samples),
                  ("Train/dgc/param_wire_bytes", s.param_wire_bytes, global_samples),
                  ("Train/dgc/stock_buckets", s.stock_buckets, global_samples)]
        if s.residual_norm is not None:
            events.append(("Train/dgc/residual_norm", s.residual_norm, global_samples))
        monitor.write_events(events)


def zero3_state_bytes(engine) -> Dict[str, int]:
    """ZeRO-3's own persistent state on this rank, by part, from the tensors' storage bytes (each storage once).

    The parts of a ``DeepSpeedZeroOptimizer_Stage3`` (DeepSpeed 0.19.8): ``params`` (this rank's partitions of the
    parameters in the training dtype, ``fp16_partitioned_groups_flat``), ``master`` (their fp32 copies,
    ``fp32_partitioned_groups_flat``), ``optimizer`` (the optimizer's state tensors, e.g. Adam's ``exp_avg`` and
    ``exp_avg_sq``) and ``grads`` (the partitioned gradient buffer, ``grad_partitions_flat_buffer``). For
    mixed-precision Adam this is ``(2 + 4 + 8 + 2) / W`` = 16/W bytes per parameter (ZeRO, Rajbhandari et al.,
    SC 2020, section 3), plus padding. Host memory of an offloaded optimizer counts too.

    Args:
        engine: a ``DeepSpeedEngine`` with ZeRO stage 3.

    Returns:
        ``{"params", "master", "optimizer", "grads", "total"}`` in bytes.

    Raises:
        TypeError: the engine's optimizer is not ZeRO-3's.
    """
    import torch

    opt = engine.optimizer
    if not hasattr(opt, "fp32_partitioned_groups_flat"):
        raise TypeError(f"zero3_state_bytes needs a ZeRO stage 3 engine, got optimizer {type(opt).__name__}")
    seen = set()

    def storage_bytes(tensors) -> int:
        total = 0
        for t in tensors:
            if not torch.is_tensor(t) or t.numel() == 0:
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        return total

    state = [v for s in opt.optimizer.state.values() for v in s.values()]
    parts = {"params": storage_bytes(opt.fp16_partitioned_groups_flat),
             "master": storage_bytes(opt.fp32_partitioned_groups_flat),
             "optimizer": storage_bytes(state),
             "grads": storage_bytes([getattr(opt, "grad_partitions_flat_buffer", None)])}
    parts["total"] = sum(parts.values())
    return parts
