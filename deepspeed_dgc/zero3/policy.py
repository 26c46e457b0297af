"""``"dgc": {"policy": "auto"}``: per bucket, stock ZeRO-3's reduce-scatter or the compressed one, whichever the
measurements say is faster on this job's link.

Compression pays where the link is slow and costs where it is fast: its own coding time is only won back when the
bytes it saves take longer to send (results/bench_network.md has both cases). The choice depends on the link, the
device, the codec and the bucket's tensors, so it is measured, not guessed: when a bucket of a new shape is first
reduced, and again every ``policy_interval`` applied steps, every rank of the group times, on random tensors of
exactly that bucket's sizes and on the same process group,

- **stock**: what ZeRO-3's reduce-scatter moves, an all-to-all of the partitions in the communication dtype plus
  the sum of the received ones;
- **compressed**: the whole compressed reduce-scatter with the job's own codec (a throwaway instance with empty
  residuals, so the job's state is untouched), both hops on the hierarchical topology,

three times each after one untimed warm-up run of each, interleaved, keeping the fastest of each (an option more
than twice as slow as the other after the first run, and slower than 50 ms, is not run again: on a slow link stock's
exchange is the probe's main cost). The times are
then the largest over the ranks (one max all-reduce of two values: every rank decides the same), and the bucket goes
compressed only if its time is more than 5% below stock's: ties and small speed-ups go to stock, so that noise does
not make a job slower than stock. The probe's own cost is at most four compressed and four stock exchanges of each
bucket shape per measurement (at 100 Mbit/s on the network benchmark, four compressed and two stock: by estimate,
about two stock steps' traffic per measurement); a small ``policy_interval`` makes the probes cost more than they
save (at 1, several times the training's own gradient bytes). The parameter all-gather is chosen the same way per
shard size and group (stock's gather against the quantized one of ``weights.quantization``): at the first gather of
each size, and again at a gather of that size ``policy_interval`` or more steps later. Parameters that ZeRO-3 keeps
whole (below ``stage3_param_persistence_threshold``) are gathered only at the start, so their choice is never
measured again.

A bucket sent by stock sends its error-feedback residuals with it (added to this rank's gradient, so the sum over
ranks is the same mean the compressed path would have had before quantization), and its residuals become zero (staged,
so a skipped step keeps them). What was not yet sent is thus never lost.

The plain gradient codecs (error feedback with any density, threshold and format) and decoupled momentum can switch
per bucket. Under decoupled momentum a bucket sent by stock carries each rank's DeMo extraction, sent densely: the
momentum ``decay delta + g / W`` is transformed and its top-k DCT coefficients per chunk quantized as the compressed
exchange would send them, what was not sent stays as the momentum, and the decoded extraction (times ``W loss_scale``)
replaces the gradient stock sends
(:meth:`~deepspeed_dgc.methods.decoupled.DecoupledMomentumMethod.send_by_stock`). The owners receive the same sum
``u`` and take the same step as on the compressed path: the choice changes the bytes and the time, not the training
(flat topology; with the hierarchical topology the momentum is of node-level sums that stock never forms, refused at
initialize). The other momentum methods
(``compressed_momentum``, ``momentum_correction``) and ``shared_mask`` are refused (:class:`~deepspeed_dgc.config.
DGCConfig`): what their owners step with, or the coordinates they choose, follows from what was compressed. Each choice is logged on rank 0 at INFO by DeepSpeed's logger (which shows INFO only when its level is
set so, e.g. ``deepspeed.utils.logger.setLevel(logging.INFO)``) and is in :func:`deepspeed_dgc.get_stats`'s
``policy``. Measured times are host wall-clock around the exchange; on a GPU the probe synchronises the device
(probe steps only, never a normal step). Choices depend on measured times, so two runs (or a run and its resume,
which measures again) may choose differently.
"""

import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Sequence, Tuple

import torch
from deepspeed.utils import logger

from ..comm.communicators import group_global_ranks, make_communicator
from ..memory.error_feedback import ErrorFeedback
from ..memory.momentum import DecoupledMomentum


STOCK, COMPRESSED = "stock", "compressed"
# an option is run only once per measurement when it is both more than twice as slow as the other and slower than this
# (seconds): only then does the probe's own time matter, and a single run of a sub-millisecond exchange is noise
PRUNE_ABOVE_S = 0.05


@dataclass
class Decision:
    """One bucket shape's measured times (seconds, largest over the ranks) and choice."""
    choice: str
    stock_s: float
    compressed_s: float
    step: int  # applied steps when it was measured

    def as_dict(self) -> dict:
        return {"choice": self.choice, "stock_ms": round(self.stock_s * 1e3, 3),
                "compressed_ms": round(self.compressed_s * 1e3, 3), "measured_at_step": self.step}


@dataclass
class LinkPolicy:
    """The per-bucket choice of ``policy: "auto"`` (see the module docstring).

    Args:
        interval: applied steps between two measurements of the same bucket shape (``dgc.policy_interval``).
        reps: timed exchanges per option and measurement (the fastest counts).
        margin: the compressed option is chosen only when it is faster than stock by more than this share of stock's
            time (measurement noise must not make a job slower than stock).

    Attributes:
        decisions: bucket shape (numels and communication dtype) -> :class:`Decision`.
        probe_bytes: bytes this rank sent while measuring (not in the gradient telemetry's wire bytes).
    """
    interval: int
    reps: int = 3
    margin: float = 0.05
    decisions: Dict[Tuple, Decision] = field(default_factory=dict)
    gathers: Dict[Tuple, Decision] = field(default_factory=dict)
    probe_bytes: int = 0
    runs: List[int] = field(default_factory=lambda: [0, 0], repr=False)  # of each option in the latest measurement
    _stock_comms: dict = field(default_factory=dict, repr=False)

    def choose(self, reducer, grads: Sequence[torch.Tensor], group, comm_dtype: torch.dtype) -> str:
        """``"stock"`` or ``"compressed"`` for this bucket, measured first when due (collective over ``group``:
        every rank calls it for the same buckets in the same order, and decides the same)."""
        shape = (tuple(g.numel() for g in grads), str(comm_dtype))
        known = self.decisions.get(shape)
        if known is None or reducer.steps_applied - known.step >= self.interval:
            known = self._measure(reducer, shape[0], group, comm_dtype, grads[0].device)
            self.decisions[shape] = known
            if reducer.comms_for(group).rank == 0:
                logger.info("deepspeed_dgc: policy auto, bucket of %d tensors (%d elements, %s): stock %.2f ms, "
                            "compressed %.2f ms -> %s (step %d)", len(shape[0]), sum(shape[0]), comm_dtype,
                            known.stock_s * 1e3, known.compressed_s * 1e3, known.choice, known.step)
        return known.choice

    def choose_gather(self, gather, shard: torch.Tensor, group, step: int) -> str:
        """``"stock"`` or ``"compressed"`` for a parameter all-gather of shards like ``shard`` (1-D, n elements) over
        ``group`` (a ``deepspeed.comm`` group, None: the world), measured first when due: stock's gather against the
        quantized one (:class:`~deepspeed_dgc.zero3.allgather.QuantizedAllGather`) on random shards of the same size
        and dtype, on the same group (collective over it: every rank gathers the same shards in the same order)."""
        from deepspeed import comm as dist

        ranks = tuple(group_global_ranks(group))
        shape = ("all-gather", shard.numel(), str(shard.dtype), ranks)
        known = self.gathers.get(shape)
        if known is None or step - known.step >= self.interval:
            gen = torch.Generator(device=shard.device).manual_seed(step + shard.numel())
            probe = torch.randn(shard.numel(), generator=gen, device=shard.device).to(shard.dtype)
            out = torch.empty(len(ranks) * shard.numel(), dtype=shard.dtype, device=shard.device)
            options = (lambda: gather.stock(probe, out, group).wait(), lambda: gather.quantized(probe, out, group).wait())

            def agree(values: List[float]) -> List[float]:  # synchronous; read on the host (probe steps only)
                t = torch.tensor(values, dtype=torch.float64, device=shard.device)
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
                return t.tolist()

            stock_s, compressed_s = self._time_options(options, shard.device, agree)  # every rank decides the same
            from .allgather import payload_bytes  # noqa: allgather's callers hold the policy
            runs = self.runs
            self.probe_bytes += (len(ranks) - 1) * ((runs[0] + 1) * shard.numel() * shard.element_size() + (runs[1] + 1) *
                                                    payload_bytes(shard.numel(), gather.fmt, gather.group_size))
            known = Decision(self._faster(stock_s, compressed_s), stock_s, compressed_s, step)
            self.gathers[shape] = known
            if dist.get_rank() == ranks[0]:
                logger.info("deepspeed_dgc: policy auto, all-gather of %d-element shards (%s, %d ranks): stock %.2f ms, "
                            "quantized %.2f ms -> %s (step %d)", shard.numel(), shard.dtype, len(ranks),
                            stock_s * 1e3, compressed_s * 1e3, known.choice, step)
        return known.choice

    def summary(self) -> Dict[str, dict]:
        """JSON-ready decisions (telemetry): ``"<tensors>x<elements> <dtype>"`` -> a bucket shape's choice and times,
        ``"all-gather <n> <dtype> <ranks>"`` -> a gather's."""
        out = {f"{len(s[0])}x{sum(s[0])} {s[1]}": d.as_dict() for s, d in self.decisions.items()}
        out.update({f"all-gather {s[1]} {s[2]} {len(s[3])} ranks": d.as_dict() for s, d in self.gathers.items()})
        return out

    def _stock_comm(self, reducer, group):
        """A torch communicator over the whole group, as stock's reduce-scatter uses (made once per group,
        collective; bounded by ``timeout_s``)."""
        key = tuple(group_global_ranks(group))
        if key not in self._stock_comms:
            self._stock_comms[key] = make_communicator("torch", group, reducer.cfg.timeout_s)
        return self._stock_comms[key]

    def _measure(self, reducer, numels: Sequence[int], group, comm_dtype: torch.dtype, device) -> Decision:
        from .reduce_scatter import CompressedReduceScatter  # noqa: the reducer's own module imports this one

        comms = reducer.comms_for(group)
        cfg = reducer.cfg.model_copy(update={"policy": "fixed"})
        dm = cfg.decoupled_momentum  # a throwaway momentum too, zero at first, as the residuals
        probe = CompressedReduceScatter(cfg, ErrorFeedback(cfg.residual_storage, kernels=cfg.kernels),
                                        seed=reducer.seed, ranks_per_node=reducer.ranks_per_node, ops=reducer.ops,
                                        momentum=DecoupledMomentum(dm) if dm is not None else None)
        probe._comms, probe.steps_applied = reducer._comms, reducer.steps_applied  # same communicators and schedule
        gen = torch.Generator(device=device).manual_seed(reducer.seed + reducer.steps_applied)
        grads = [torch.randn(n, generator=gen, device=device, dtype=torch.float32).to(comm_dtype) for n in numels]
        keys = [("policy probe", i) for i in range(len(numels))]
        comm = self._stock_comm(reducer, group)
        W = comms.world_size
        chunks = [-(-n // W) for n in numels]
        sent_before = _sent(comms) + comm.wire_bytes

        def stock():
            # what ZeRO-3's reduce-scatter moves: every owner's partition in the communication dtype, then the sum
            rows = torch.cat([torch.nn.functional.pad(g.reshape(-1), (0, W * c - g.numel())).view(W, c)
                              for g, c in zip(grads, chunks)], dim=1)
            received = comm.all_to_all_fixed(rows.contiguous().view(torch.uint8).view(W, -1))
            received.view(comm_dtype).view(W, -1).float().sum(0)

        def compressed():
            probe.reduce_scatter(grads, keys, group, comm_dtype)
            probe.end_step(True)
            probe.memory.commit()
            if probe.momentum is not None:
                probe.momentum.commit()

        def agree(values: List[float]) -> List[float]:  # read on the host (probe steps only)
            return comm.max_all_reduce(torch.tensor(values, dtype=torch.float64,
                                                    device=reducer._exchange_device(comm))).tolist()

        stock_s, compressed_s = self._time_options((stock, compressed), device, agree)  # every rank decides the same
        self.probe_bytes += _sent(comms) + comm.wire_bytes - sent_before
        return Decision(self._faster(stock_s, compressed_s), stock_s, compressed_s, reducer.steps_applied)

    def _faster(self, stock_s: float, compressed_s: float) -> str:
        return COMPRESSED if compressed_s < (1.0 - self.margin) * stock_s else STOCK

    @staticmethod
    def _timed(option: int, fn: Callable[[], None], device) -> float:
        """Seconds of one run of ``fn`` (option ``option``), the device synchronised before and after."""
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        return time.perf_counter() - t0

    def _time_options(self, options, device, agree: Callable[[List[float]], List[float]]) -> List[float]:
        """Seconds of each option (callable): after one untimed run of each, the fastest of :attr:`reps` interleaved
        runs, device synchronised, then the largest over the ranks (``agree``: a max all-reduce, read on the host). An
        option more than twice as slow as the fastest after the first run and slower than :data:`PRUNE_ABOVE_S` (by
        the agreed times, so every rank runs the same collectives) is not run again: on a slow link stock's exchange
        is the probe's main cost, and its choice is clear. :attr:`runs` holds how often each ran."""
        for fn in options:  # warm-up, untimed: first calls (codec set-up, the fixed layout's shape check, caches)
            fn()
        best = [float("inf")] * len(options)
        active = list(range(len(options)))
        self.runs = [0] * len(options)
        for rep in range(self.reps):
            for i in active:
                best[i] = min(best[i], self._timed(i, options[i], device))
                self.runs[i] += 1
            if rep == 0:
                first = agree(best)
                active = [i for i in active if first[i] <= max(2.0 * min(first), PRUNE_ABOVE_S)]
        return agree(best)


def _sent(comms) -> int:
    return sum(c.wire_bytes for c in (comms.flat, comms.intra, comms.inter) if c is not None)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def stock_result_bytes(numels: List[int], comms, elem_size: int) -> Tuple[int, int]:
    """``(wire, inter-node)`` bytes this rank sends in stock's reduce-scatter of tensors of ``numels`` elements:
    ``(W - 1) / W`` of each in the communication dtype, the share to other nodes by ``dest_nodes``. (Where stock
    all-reduces the bucket instead, ``reduce_scatter: false``, a ring all-reduce sends up to twice that; it is counted
    as a reduce-scatter.)"""
    W = comms.world_size
    per_dest = sum(-(-n // W) for n in numels) * elem_size
    off = sum(1 for node in comms.dest_nodes if node != comms.dest_nodes[comms.rank])
    return per_dest * (W - 1), per_dest * off
