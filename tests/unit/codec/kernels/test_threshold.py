"""DGC's sampled threshold in the op (cpu_threshold.cpp) against the reference: samples crafted to force the
lowering rounds and the exact top-k step, samples in runs, reused and fixed thresholds.
"""


import pytest
import torch

from deepspeed_dgc.codec.kernels import FusedCPUOps, load_fused_op
from deepspeed_dgc.codec.reference import REFERENCE
from deepspeed_dgc.codec.selection import topk_threshold

from ..jobs import SIZES, assert_same, decode_row, make_job


def _sample_of(which):
    """Samples made of the smallest (forces the exact top-k step) or largest (forces lowering) magnitudes."""

    def make(job):
        out = []
        for i, src in enumerate(job.srcs):
            if not job.sparse[i]:
                out.append(None)
                continue
            mag = (src.float() / job.divisor + job.residuals[i]).abs()
            order = torch.argsort(mag, descending=(which == "largest"))
            out.append(order[:2000].repeat(3))
        return out

    return make


@pytest.mark.parametrize("which", ["smallest", "largest"])
def test_threshold_corrections_match(fused, which):
    job = make_job([100_000, 7], 2, density=0.01, samples=_sample_of(which), min_numel=64)
    ref = REFERENCE.compress(job)
    assert_same(ref, fused.compress(job))
    k = 1000
    kept_big = ref.kept - 7  # the 7-element tensor is sent whole
    if which == "smallest":
        assert kept_big == k  # exact top-k step (no ties among random floats)
    else:
        assert 0.8 * k <= kept_big <= 1.3 * k  # lowered until at least 0.8 k


def _runs_of(length, runs, seed):
    """Samples drawn as runs of ``length`` consecutive positions from uniform starts (any position, so runs cross row
    boundaries), in random order with repeats: as ``selection.sample_indices`` draws them on large tensors."""

    def make(job):
        g = torch.Generator().manual_seed(seed)
        out = []
        for i, m in enumerate(job.real_totals()):
            if not job.sparse[i] or m <= length:
                out.append(None)
                continue
            starts = torch.randint(0, m - length + 1, (runs, 1), generator=g)
            out.append((starts + torch.arange(length)).reshape(-1).repeat(2)[torch.randperm(2 * runs * length,
                                                                                           generator=g)[:runs * length]])
        return out

    return make


@pytest.mark.parametrize("hierarchical", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [2, 3])
def test_threshold_samples_in_runs_match(fused, hierarchical, dtype, rows):
    """The op reads a sample's runs of consecutive positions as one vectorized accumulation each (cut at row ends):
    the same thresholds as the reference's element by element, so the same bytes."""
    seed = int(torch.randint(0, 1 << 30, ()))
    for length in (16, 5):
        job = make_job([90_001, 3000, 64], rows, hierarchical=hierarchical, dtype=dtype, density=0.01, seed=seed,
                       samples=_runs_of(length, 400 // length * 4, seed), loss_scale=1024.0)
        assert_same(REFERENCE.compress(job), fused.compress(job))


def test_a_sample_run_across_a_row_boundary_reads_the_next_row():
    """A run of the sample that passes the end of owner row 0 continues at row 1's first element, not at the padding
    or the next tensor's column after row 0's (hierarchical rows are columns of one matrix). Row 1's first element is
    made the one large magnitude: the threshold is then its magnitude and one element is kept, as the reference."""
    job = make_job([200_001, 901], 2, hierarchical=True, density=0.01, seed=int(torch.randint(0, 1 << 30, ())),
                   min_numel=1000)  # tensor 1 sent whole: row 1's positions are all tensor 0's
    real0 = job.real_counts(0)[0]
    src = job.srcs[0]  # the (rows, C) node sum, viewed flat; tensor 0 starts at column 0
    src[job.row_strides[0]] = 1000.0  # row 1, column 0
    job.samples[0] = torch.arange(real0 - 3, real0 + 1)  # row 0's last three elements, then row 1's first
    fused = FusedCPUOps(load_fused_op("cpu"))
    ref, out = REFERENCE.compress(job), fused.compress(job)
    assert_same(ref, out)
    _, body = decode_row(REFERENCE, job, 1, ref.payloads[1])
    assert body.n_indexed == 1  # row 1 keeps its first element only


@pytest.mark.parametrize("hierarchical", [False, True])
@pytest.mark.parametrize("numels", SIZES[1:])
def test_reused_and_fixed_thresholds_match(fused, hierarchical, numels):
    """Thresholds the fused op returns equal the reference's; reusing them on the next step's values (some
    tensors reused, some estimated, loss scale 1024) gives the same bytes and bits, as does the fixed-threshold
    mode; a reused threshold keeping everything is cut to exactly k, one keeping too few is not lowered."""
    first = make_job(numels, 2, hierarchical=hierarchical, loss_scale=1024.0, density=0.1)
    assert all(t is None for t in REFERENCE.compress(first).thresholds + fused.compress(first).thresholds)
    first.reuse_thresholds = [None] * len(numels)  # estimate all, report them
    ref = REFERENCE.compress(first)
    assert_same(ref, fu := fused.compress(first))
    assert fu.thresholds == ref.thresholds
    assert [t is not None for t in ref.thresholds] == [s and sum(first.real_counts(i)) > k for i, (s, k) in
                                                        enumerate(zip(first.sparse, first.targets()))]
    nxt = make_job(numels, 2, hierarchical=hierarchical, loss_scale=1024.0, density=0.1)  # the next step: same scales
    for src in {id(x): x for x in nxt.srcs}.values():
        src.mul_(torch.rand(src.shape, generator=torch.Generator().manual_seed(7)).add_(0.7).to(src.dtype))
    nxt.reuse_thresholds = [t if i % 2 == 0 else None for i, t in enumerate(ref.thresholds)]
    nxt.samples = [s if nxt.reuse_thresholds[i] is None else None for i, s in enumerate(nxt.samples)]
    ref2 = REFERENCE.compress(nxt)
    assert_same(ref2, fu2 := fused.compress(nxt))
    assert fu2.thresholds == ref2.thresholds
    reused = [i for i, t in enumerate(nxt.reuse_thresholds) if t is not None]
    assert any(ref2.thresholds[i] == nxt.reuse_thresholds[i] for i in reused)  # kept what reached it
    for i in reused:  # or cut to the k largest, when more than 1.3 k reached it
        assert ref2.thresholds[i] >= nxt.reuse_thresholds[i]
    n = max(numels)  # one tensor: the kept count is that tensor's
    for reuse in (0.0, 1e9):
        job = make_job([n], 2, hierarchical=hierarchical, density=0.1, seed=9)
        job.reuse_thresholds = [reuse]
        ref3 = REFERENCE.compress(job)
        assert_same(ref3, fused.compress(job))
        assert ref3.kept == (job.targets()[0] if reuse == 0.0 else 0)
    fixed = make_job(numels, 2, hierarchical=hierarchical, loss_scale=1024.0, density=0.1, seed=11)
    fixed.threshold = 0.3
    ref4 = REFERENCE.compress(fixed)
    assert_same(ref4, fused.compress(fixed))
    assert all(t == pytest.approx(0.3, rel=1e-7) for t, s in zip(ref4.thresholds, fixed.sparse) if s)


@pytest.mark.parametrize("threshold", [0.0, -0.0, float("nan"), float("inf"), 1e-40, 0.5])
def test_fixed_thresholds_at_the_edges_match(fused, threshold):
    """Fixed thresholds the config would refuse or that keep everything or nothing (a job built by hand can hold any):
    the kept elements are those with |acc| >= threshold, as the reference's comparison, fp32 and bf16 sources."""
    for dtype in (torch.float32, torch.bfloat16):
        job = make_job([5000, 3, 70_001], 2, dtype=dtype, density=0.01, seed=int(torch.randint(0, 1 << 30, ())))
        job.srcs[0][7] = 1e-40  # a subnormal acc (no residual there)
        job.residuals[0][7] = 0.0
        job.threshold = threshold
        assert_same(REFERENCE.compress(job), fused.compress(job))


def test_topk_threshold_binding(fused):
    g = torch.Generator().manual_seed(3)
    for n, k in ((5000, 50), (100_000, 1000), (3000, 2999)):
        mag = torch.randn(n, generator=g).abs()
        sample = torch.randint(0, n, (1500, ), generator=g)
        assert fused.op.topk_threshold(mag, k, sample) == float(topk_threshold(mag, k, sample))
        assert fused.op.topk_threshold(mag, k, torch.empty(0, dtype=torch.long)) == float(topk_threshold(mag, k, None))
