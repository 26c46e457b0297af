"""The compressed reduce-scatter's per-rank decisions, without other processes: threshold reuse and the density
warm-up clock (the whole path in real processes: tests/distributed/test_reduce_scatter.py)."""

import types

import torch

from deepspeed_dgc.codec.kernels import FusedCPUOps, load_fused_op
from deepspeed_dgc.config import DGCConfig
from deepspeed_dgc.memory.error_feedback import ErrorFeedback
from deepspeed_dgc.methods.topk import TopKExact
from deepspeed_dgc.zero3.reduce_scatter import Bucket, CompressedReduceScatter


def _bucket(reducer, numels, keys, density):
    _, quantization, group_size = reducer.codec(density)
    return Bucket(keys=keys, numels=numels, chunks=[-(-n // 2) for n in numels], world=2, grads=[], srcs=[],
                  divisor=2.0, loss_scale=1.0, comm_dtype=torch.float32, density=density, quantization=quantization,
                  group_size=group_size, sparse=[True] * len(numels), fingerprint=1)


def test_thresholds_are_reused_every_n_steps_and_skipped_steps_do_not_count():
    """threshold_reuse_steps 3: the reducer estimates (draws a sample) at steps 0 and 3, reuses the stored threshold at
    1 and 2, estimates afresh when the density changes (step 4) and when momentum replaces the gradient at the same
    density (step 6), and reuses in between. A skipped step (overflow) in the middle changes nothing: the reuse
    count and the stored thresholds are those of the steps applied."""
    ops = FusedCPUOps(load_fused_op("cpu"))
    reducer = CompressedReduceScatter(DGCConfig(enabled=True, density=0.1, threshold_reuse_steps=3, min_numel=0),
                                      ErrorFeedback("fp32"), ops=ops)
    method = TopKExact(reducer)
    g = torch.Generator().manual_seed(3)
    numels, keys = [5000, 3], ["a", "b"]
    pattern = []
    steps = [(0.1, True)] * 2 + [(0.1, False)] + [(0.1, True)] * 2 + [(0.2, True)] * 2 + [(0.2, True)] * 2
    for step, (density, applied) in enumerate(steps):
        if step == 7:  # the compressed momentum's freeze: the same density, another quantity
            reducer.momentum = types.SimpleNamespace(sending=True, codec=lambda: None)
        bucket = _bucket(reducer, numels, keys, density)
        srcs = [torch.randn(n, generator=g) for n in numels]
        job = method._job(bucket, srcs, [0, 0], bucket.chunks, [0, 1], numels, 2.0)
        reused = job.reuse_thresholds[0] is not None
        assert (job.samples[0] is None) == reused  # a sample is drawn only to estimate
        out = ops.compress(job)
        method._stage(bucket, job, out.residuals, out.thresholds)
        reducer.end_step(applied)
        pattern.append((reused, reducer.thresholds["a"][1:]))
    assert pattern == [(False, [0.1, 1, False]), (True, [0.1, 2, False]), (True, [0.1, 2, False]),  # skipped
                       (True, [0.1, 3, False]), (False, [0.1, 1, False]), (False, [0.2, 1, False]),
                       (True, [0.2, 2, False]), (False, [0.2, 1, True]), (True, [0.2, 2, True])]


def test_warmup_counts_applied_steps_only():
    """The density schedule (2 dense steps, then DGC's geometric warm-up over 4 steps from 0.25 to 0.01) advances
    with applied steps; a skipped step (overflow) leaves it where it was."""
    reducer = CompressedReduceScatter(DGCConfig(enabled=True, density=0.01, warmup_dense_steps=2, warmup_steps=4),
                                      ErrorFeedback("fp32"))
    seen = []
    for applied in (True, False, True, True, False, True, True, True, True):
        seen.append(reducer.step_density())
        reducer.end_step(applied)
    want = [1.0, 1.0, 1.0] + [0.25**(1 - t / 4) * 0.01**(t / 4) for t in (0, 1, 1, 2, 3)] + [0.01]
    assert seen == want, seen
