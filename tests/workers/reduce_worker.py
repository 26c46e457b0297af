"""Worker: run the compressed reduce-scatter directly on random gradients and save everything.

Usage: reduce_worker.py --out DIR [--runs RUN[,RUN...]] [--topology flat|hierarchical] [--ranks-per-node L]
[--layout auto|fixed|exact] (a case whose settings need the exact layout runs with "auto", i.e. exact on CPU),
e.g. ``--runs torch,mpi`` or ``--runs torch,torch:reference --topology hierarchical --ranks-per-node 2``. Each run
is ``BACKEND[:KERNELS]`` (``dgc.comm_backend``, ``dgc.kernels``, default auto). Writes DIR/rank<r>_<run>.pt:
{case: {"cfg", "steps": [...], "ops"}} where each step holds this rank's inputs, outputs and committed residuals
after the step. The inputs do not depend on the run, so the files of two runs must be equal bit for bit.
"""

import argparse
import sys

import torch

from common import finish, init

from deepspeed_dgc.config import DGCConfig
from deepspeed_dgc.memory.error_feedback import ErrorFeedback
from deepspeed_dgc.zero3.reduce_scatter import CompressedReduceScatter

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
    # thresholds estimated at steps 0 and 3, reused at 1 and 2 (the worker divides this case's gradients by the
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


def run_cases(rank: int, **settings) -> dict:
    results = {}
    for ci, (name, kw) in enumerate(CASES.items()):
        try:
            # fp32 residuals unless the case says (the exact oracle; the default "auto" is fp8 on the flat topology)
            kw_all = dict(dict(residual_dtype="fp32"), **kw)
            try:
                cfg = DGCConfig(enabled=True, **settings, **kw_all)
            except ValueError:  # e.g. density "auto" with the fixed layout: this case runs in the exact one
                if settings.get("layout") != "fixed":
                    raise
                cfg = DGCConfig(enabled=True, **dict(settings, layout="auto"), **kw_all)
        except ValueError as err:  # a case this topology refuses (e.g. density "auto" with the hierarchical one)
            if settings.get("topology") != "hierarchical":
                raise
            print(f"case {name} refused by the hierarchical topology: {err}".splitlines()[0])
            continue
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
                steps.append(dict(step=step, micro=micro, inputs=[g.clone() for g in grads],
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
            steps[-1].update(applied=applied, committed=committed, residuals=dict(committed),
                             thresholds={k: list(v) for k, v in reducer.thresholds.items()})
        results[name] = dict(cfg=kw, steps=steps, ops=reducer.ops.name, layout=reducer.layout("cpu"))
    return results


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--runs", default="torch")
    ap.add_argument("--topology", default="flat", choices=["flat", "hierarchical"])
    ap.add_argument("--ranks-per-node", type=int, default=None)
    ap.add_argument("--layout", default="auto", choices=["auto", "fixed", "exact"])
    args = ap.parse_args(argv)
    rank = init()
    for run in args.runs.split(","):
        backend, _, kernels = run.partition(":")
        results = run_cases(rank, comm_backend=backend, kernels=kernels or "auto", topology=args.topology,
                            ranks_per_node=args.ranks_per_node, timeout_s=60.0, layout=args.layout)
        torch.save(results, f"{args.out}/rank{rank}_{run}.pt")
    finish()


if __name__ == "__main__":
    main(sys.argv[1:])
