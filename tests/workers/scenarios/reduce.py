"""Reduce-scatter scenarios: the compressed reduce-scatter run directly on random gradients (no engine).

:class:`ReduceCases` runs every case of :data:`CASES` and records each rank's inputs, outputs and residuals of every
call (:class:`ReduceRecord`). The inputs do not depend on the backend or the kernels, so the records of two runs that
differ only there must be equal bit for bit. The jobs of one launch run in turn, e.g. the torch and the mpi backends
under one ``mpirun``.
"""

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from deepspeed_dgc.config import DGCConfig
from deepspeed_dgc.memory.error_feedback import ErrorFeedback
from deepspeed_dgc.zero3.reduce_scatter import CompressedReduceScatter

from . import scenario

SIZES = [1, 7, 42, 1001]
CASES = {
    "sparse_int4": dict(density=0.1, quantization="int4", group_size=16, min_numel=0),
    "dense_int4": dict(density=1.0, quantization="int4", group_size=16, min_numel=0),
    "lossless": dict(density=1.0, quantization="none", min_numel=0),
    "sparse_raw_mixed": dict(density=0.05, quantization="none", min_numel=40),
    "zero_rank": dict(density=0.1, quantization="int4", group_size=16, min_numel=0),
    # rank r's gradients are scaled by 1000**r: each rank would choose another density on its own
    "auto_scales": dict(density="auto", density_min=0.02, density_max=0.4, quantization="int4", group_size=16,
                        min_numel=0),
    "int2_sr_bitmap": dict(density=0.3, quantization="int2", stochastic_rounding=True, group_size=16, min_numel=0),
    "int1_dense": dict(density=1.0, quantization="int1", group_size=16, min_numel=0),
    "fp8_e5m2": dict(density=0.1, quantization="fp8_e5m2", group_size=16, min_numel=0),
    "fixed_threshold": dict(threshold=0.6, quantization="int4", group_size=16, min_numel=0),
    "bf16_residual": dict(density=0.1, quantization="int4", group_size=16, min_numel=0, residual_dtype="bf16"),
    "fp8_residual": dict(density=0.1, quantization="int4", group_size=16, min_numel=0, residual_dtype="fp8"),
    # thresholds estimated at steps 0 and 3, reused at 1 and 2 (the scenario divides this case's gradients by the
    # growth of the others, 1 + 10 * step, so every step has gradients of one scale)
    "reuse_threshold": dict(density=0.1, quantization="int4", group_size=16, min_numel=0, threshold_reuse_steps=3),
    # the same inputs as the case without the suffix (entropy coding is lossless)
    "sparse_int4_zlib": dict(density=0.1, quantization="int4", group_size=16, min_numel=0, entropy_coding="zlib"),
    "int1_dense_zlib": dict(density=1.0, quantization="int1", group_size=16, min_numel=0, entropy_coding="zlib"),
    # gradient accumulation: 4 micro-steps (reduce-scatters) per optimizer step, committed at its end
    "sparse_int4_gas4": dict(density=0.1, quantization="int4", group_size=16, min_numel=0),
    # the same, with an Inf in rank 1's gradients at micro-step 1 of step 1: that step is skipped on every rank
    "sparse_int4_gas4_overflow": dict(density=0.1, quantization="int4", group_size=16, min_numel=0),
}
STEPS = 4
MICRO_STEPS = {"sparse_int4_gas4": 4, "sparse_int4_gas4_overflow": 4}  # per optimizer step; 1 for the others
INF_AT = {"sparse_int4_gas4_overflow": (1, 1, 1)}  # (step, micro-step, rank) whose gradients hold an Inf

BACKENDS = ("torch", "mpi")
KERNELS = ("auto", "fused", "reference")
TOPOLOGIES = ("flat", "hierarchical")
LAYOUTS = ("auto", "fixed", "exact")


@dataclass
class ReduceCases:
    """Every case of :data:`CASES`, :data:`STEPS` optimizer steps each, through ``dgc.comm_backend`` ``backend``,
    ``dgc.kernels`` ``kernels``, ``topology`` (``ranks_per_node``: None takes the launcher's LOCAL_SIZE) and
    ``layout``. A case whose settings need the exact layout runs with ``"auto"`` (exact on CPU) when asked for the
    fixed one; a case the hierarchical topology refuses is left out of the record."""
    backend: str = "torch"
    kernels: str = "auto"
    topology: str = "flat"
    ranks_per_node: Optional[int] = None
    layout: str = "auto"

    def __post_init__(self):
        for name, allowed in (("backend", BACKENDS), ("kernels", KERNELS), ("topology", TOPOLOGIES),
                              ("layout", LAYOUTS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"ReduceCases: {name} {getattr(self, name)!r} must be one of {allowed}")
        if self.ranks_per_node is not None and self.ranks_per_node < 1:
            raise ValueError(f"ReduceCases: ranks_per_node {self.ranks_per_node} must be at least 1 (or None)")

    @classmethod
    def of_run(cls, run: str, **settings) -> "ReduceCases":
        """The job of a run named ``BACKEND[:KERNELS]`` (e.g. ``"torch:reference"``), with ``settings``."""
        backend, _, kernels = run.partition(":")
        return cls(backend=backend, kernels=kernels or "auto", **settings)


@dataclass
class ReduceStep:
    """One reduce-scatter call (a micro-step) of one rank.

    Attributes:
        step, micro: the optimizer step and the micro-step in it.
        inputs, outputs: this rank's gradients and its output slices (fp32).
        residuals: this rank's residuals after the call, key -> tensor (staged in the window, else committed; at a
            step's last micro-step, the committed ones).
        density, wire_bytes, intra_node_wire_bytes, inter_node_wire_bytes, kept: the reducer's density and the
            call's result.
        applied, committed, thresholds: at the last micro-step of each optimizer step only (None before): whether
            the step was applied (no rank overflowed), the committed residuals, and the stored thresholds
            (key -> list).
    """
    step: int
    micro: int
    inputs: List[torch.Tensor]
    outputs: List[torch.Tensor]
    residuals: Dict[int, torch.Tensor]
    density: float
    wire_bytes: int
    intra_node_wire_bytes: int
    inter_node_wire_bytes: int
    kept: int
    applied: Optional[bool] = None
    committed: Optional[Dict[int, torch.Tensor]] = None
    thresholds: Optional[Dict[int, list]] = None


@dataclass
class ReduceCase:
    """One case's run on one rank: its settings (``CASES[name]``), every call, the compressor ops' name and the
    payload layout it took on CPU."""
    cfg: dict
    steps: List[ReduceStep]
    ops: str
    layout: str


@dataclass
class ReduceRecord:
    """Case name -> :class:`ReduceCase`, in :data:`CASES` order (less the cases the topology refused)."""
    cases: Dict[str, ReduceCase] = field(default_factory=dict)


def case_config(job: ReduceCases, name: str) -> Optional[DGCConfig]:
    """The config of case ``name`` under ``job`` (fp32 residuals unless the case says: the exact oracle; the default
    "auto" is fp8 on the flat topology), or None where the hierarchical topology refuses it."""
    settings = dict(comm_backend=job.backend, kernels=job.kernels, topology=job.topology,
                    ranks_per_node=job.ranks_per_node, timeout_s=60.0, layout=job.layout)
    kw = dict(dict(residual_dtype="fp32"), **CASES[name])
    try:
        try:
            return DGCConfig(enabled=True, **settings, **kw)
        except ValueError:  # e.g. density "auto" with the fixed layout: this case runs in the exact one
            if job.layout != "fixed":
                raise
            return DGCConfig(enabled=True, **dict(settings, layout="auto"), **kw)
    except ValueError as err:  # a case this topology refuses (e.g. density "auto" with the hierarchical one)
        if job.topology != "hierarchical":
            raise
        print(f"case {name} refused by the hierarchical topology: {err}".splitlines()[0])
        return None


def run_case(name: str, cfg: DGCConfig, rank: int) -> ReduceCase:
    """Case ``name``'s :data:`STEPS` steps on this rank under ``cfg``."""
    memory = ErrorFeedback(cfg.residual_storage)
    reducer = CompressedReduceScatter(cfg, memory, seed=rank)
    twin = list(CASES).index(name.removesuffix("_zlib"))  # a _zlib case draws its twin's inputs
    gen = torch.Generator().manual_seed(1000 * twin + 17 * rank + 1)
    steps = []
    keys = list(range(len(SIZES)))
    for step in range(STEPS):
        overflow = torch.zeros(1)
        for micro in range(MICRO_STEPS.get(name, 1)):
            grads = [torch.randn(n, generator=gen) * (1 + 10 * step) for n in SIZES]
            grads[-1] = grads[-1].view(7, 143)  # any shape is accepted
            if name == "zero_rank" and rank == 1:
                grads = [torch.zeros_like(g) for g in grads]
            if name == "auto_scales":
                grads = [g * 1000.0**rank for g in grads]
            if name == "reuse_threshold":
                grads = [g / (1 + 10 * step) for g in grads]
            if INF_AT.get(name) == (step, micro, rank):
                grads[-1].view(-1)[5] = float("inf")
            outs, res = reducer.reduce_scatter(grads, keys, None, torch.float32)
            overflow += float(not all(bool(torch.isfinite(o).all()) for o in outs))
            steps.append(ReduceStep(step=step, micro=micro, inputs=[g.clone() for g in grads],
                                    outputs=[o.clone() for o in outs],
                                    # this rank's residuals after the call (staged in the window, else committed)
                                    residuals={k: memory.get(k).clone() for k in keys if memory.get(k) is not None},
                                    density=reducer.density,
                                    wire_bytes=res.wire_bytes,
                                    intra_node_wire_bytes=res.intra_node_wire_bytes,
                                    inter_node_wire_bytes=res.inter_node_wire_bytes,
                                    kept=res.kept))
        # DeepSpeed's overflow check: any rank's non-finite partition skips the step on every rank
        torch.distributed.all_reduce(overflow, op=torch.distributed.ReduceOp.MAX)
        applied = not bool(overflow.item())
        memory.commit() if applied else memory.rollback()
        reducer.end_step(applied)
        committed = {k: v.clone() for k, v in memory.residuals().items()}
        # what the next call starts from: the committed residuals (rounded by their storage dtype)
        last = steps[-1]
        last.applied, last.committed, last.residuals = applied, committed, dict(committed)
        last.thresholds = {k: list(v) for k, v in reducer.thresholds.items()}
    return ReduceCase(cfg=CASES[name], steps=steps, ops=reducer.ops.name, layout=reducer.layout("cpu"))


@scenario(ReduceCases)
def reduce_cases(job: ReduceCases, rank: int) -> ReduceRecord:
    """Every case in turn, each with a reducer and residuals of its own."""
    record = ReduceRecord()
    for name in CASES:
        cfg = case_config(job, name)
        if cfg is not None:
            record.cases[name] = run_case(name, cfg, rank)
    return record
