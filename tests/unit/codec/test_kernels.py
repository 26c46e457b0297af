"""The fused CPU op against the PyTorch reference (same payload bytes, residual bits and kept counts), its checks
of bad input, and the choice between fused and reference (``dgc.kernels``).

Random buckets of odd sizes: flat and hierarchical layouts, fp32/bf16/fp16 sources, loss scale 1 and 1024 (in the
divisor), with and without residual, 1-3 owner rows, and samples crafted to force DGC's lowering rounds and its exact
top-k step; a NaN makes both send nothing.
"""

import ctypes
import itertools
import math
import platform
import types
import zlib

import pytest
import torch

from deepspeed_dgc.codec import fixed, formats, indices, wire
from deepspeed_dgc.codec.layout import Workspace
from deepspeed_dgc.codec.kernels import DGCKernelError, FusedCPUOps, fused_can_code, get_ops, load_fused_op
from deepspeed_dgc.codec.reference import REFERENCE
from deepspeed_dgc.codec.selection import topk_threshold

from .jobs import SIZES, assert_same, decode_row, make_job
from .test_wire import check_decodes_to_what_was_accumulated


@pytest.fixture(scope="module")
def fused():
    return FusedCPUOps(load_fused_op("cpu"))


@pytest.fixture(autouse=True, scope="module")
def dirty_allocations():
    """glibc fills every allocation with a non-zero byte while these tests run (mallopt M_PERTURB), so a payload
    byte the op leaves unwritten differs from the reference's instead of reading as a fresh page's zero."""
    libc = ctypes.CDLL(None) if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc" else None
    m_perturb = -6
    if libc is not None:
        libc.mallopt(m_perturb, 0xA5)
    yield
    if libc is not None:
        libc.mallopt(m_perturb, 0)


@pytest.mark.parametrize("hierarchical", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3])
@pytest.mark.parametrize("numels", SIZES)
def test_fused_cpu_equals_reference(fused, hierarchical, rows, numels):
    # every tensor sparsified, some with no real element in this rank's rows (hierarchical, small tensors)
    assert_same(REFERENCE.compress(make_job(numels, rows, hierarchical=hierarchical, min_numel=0)),
                 fused.compress(make_job(numels, rows, hierarchical=hierarchical, min_numel=0)))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for loss_scale in (1.0, 1024.0):
            for residual in (True, False):
                seed = zlib.crc32(repr((rows, numels, str(dtype), loss_scale, residual)).encode()) % 1000
                job = make_job(numels, rows, hierarchical=hierarchical, dtype=dtype, residual=residual,
                           loss_scale=loss_scale, seed=seed)
                ref = REFERENCE.compress(job)
                assert ref.kept > 0 or not any(any(job.real_counts(i)) for i in range(len(numels)))
                assert_same(ref, fused.compress(job))


OTHER_FORMATS = ["int2", "int1", "fp8_e4m3", "fp8_e5m2"]


@pytest.mark.parametrize("fmt", OTHER_FORMATS)
@pytest.mark.parametrize("hierarchical", [False, True])
@pytest.mark.parametrize("numels", SIZES[1:])
def test_every_value_format_equals_reference(fused, fmt, hierarchical, numels):
    """INT2, INT1 and FP8 (INT4 above): the same payload bytes, residual bits and kept counts as the reference, sparse
    and sent whole, fp32 and bf16 sources, loss scale 1 and 1024; and every row decodes to the same bits."""
    for rows, dtype, loss_scale, density in ((1, torch.float32, 1.0, 0.05), (3, torch.bfloat16, 1024.0, 0.05),
                                             (2, torch.float32, 1024.0, 1.0)):
        seed = zlib.crc32(repr((fmt, hierarchical, numels, rows)).encode()) % 1000
        job = make_job(numels, rows, hierarchical=hierarchical, dtype=dtype, loss_scale=loss_scale, density=density,
                       value_format=fmt, seed=seed, min_numel=0 if density < 1 else 10**9)
        assert fused_can_code(job)
        ref = REFERENCE.compress(job)
        assert ref.kept > 0
        assert_same(ref, fused.compress(job))
        for row, payload in enumerate(ref.payloads):
            start = torch.randn(sum(job.chunks), generator=torch.Generator().manual_seed(row))  # a sum under way
            sums = [decode_row(ops, job, row, payload, start.clone())[0] for ops in (REFERENCE, fused)]
            assert torch.equal(sums[0].view(torch.int32), sums[1].view(torch.int32))


@pytest.mark.parametrize("fmt", ["int4"] + OTHER_FORMATS)
def test_exact_zeros_every_format(fused, fmt):
    """Sources with exact zeros (+0 and -0), subnormals and all-zero groups, sent whole and sparse at threshold 0: the
    same bytes, residual bits and decoded sums as the reference; INT1/INT2 payloads carry their zero bitmaps (negative
    scales), and every zero decodes to exactly 0."""
    for zero_frac in (0.3, 0.97):
        job = make_job([5, 3000, 2, 20000], 2, value_format=fmt, density=1.0, residual=False, min_numel=10**9,
                       seed=int(zero_frac * 100))
        g = torch.Generator().manual_seed(int(zero_frac * 100))
        for src in job.srcs:
            src.masked_fill_(torch.rand(src.shape, generator=g) < zero_frac, 0.0)
            src[:src.numel() // 2].neg_()  # -0.0 among them
            if src.numel() > 100:
                src[10:13] = torch.tensor([1e-42, -1e-40, 0.0])
                src[32:64] = 0.0  # whole groups of zeros
        for sparse_at_zero in (False, True):
            if sparse_at_zero:
                job.sparse = [True] * len(job.sparse)
                job.threshold = 0.0
            ref = REFERENCE.compress(job)
            assert_same(ref, fused.compress(job))
            for row, payload in enumerate(ref.payloads):
                layout = job.row_layout(row)
                body = wire.parse(payload, 0, layout)
                if fmt in ("int1", "int2"):
                    assert body.scales.numel() > -(-body.kept // job.group_size)  # bitmap words after the scales
                    assert (body.scales < 0).any()
                sums = [decode_row(ops, job, row, payload)[0] for ops in (REFERENCE, fused)]
                assert torch.equal(sums[0].view(torch.int32), sums[1].view(torch.int32))
                acc = torch.cat([job.srcs[i].view(-1)[row * c:row * c + c] for i, c in enumerate(job.chunks)
                                 if job.numels[i] > row * c])
                assert acc.numel() and (acc == 0).any()


WEIGHT_FORMATS = ["int8", "fp8_e4m3", "int4"]


@pytest.mark.parametrize("fmt", WEIGHT_FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group_size", [32, 256])
def test_weight_codes_equal_reference(fused, fmt, dtype, group_size):
    """quantize_weights and dequantize_weights of the fused op: the reference's codes and scale bits, for one segment
    and for parameters of different magnitudes (groups restart at each), odd lengths, zero runs and subnormals; and
    the same decoded bits in the output dtype. Groups of 256 take the op's vector loops several steps a group."""
    g = torch.Generator().manual_seed(WEIGHT_FORMATS.index(fmt) * 7 + int(dtype.itemsize))
    for segments in (None, [5, 3000, 1, 64, 7], [77, 3000]):
        n = 3077
        x = torch.randn(n, generator=g) * torch.logspace(-6, 3, n)
        x[100:300] = 0.0
        x[5] = 1e-41
        x = x.to(dtype)
        ref = REFERENCE.quantize_weights(x, fmt, group_size, segments)
        got = fused.quantize_weights(x, fmt, group_size, segments)
        assert torch.equal(ref[0], got[0]) and torch.equal(ref[1].view(torch.int32), got[1].view(torch.int32))
        outs = [torch.full((n, ), float("nan"), dtype=dtype) for _ in range(2)]
        REFERENCE.dequantize_weights_into(outs[0], *ref, fmt, group_size, segments)
        fused.dequantize_weights_into(outs[1], *ref, fmt, group_size, segments)
        assert torch.equal(outs[0].view(torch.uint8), outs[1].view(torch.uint8))
        assert torch.isfinite(outs[1]).all()
        for ops in (REFERENCE, fused):  # a scale missing or a segment list that does not add up
            with pytest.raises(ValueError, match="scales for|segments of"):
                ops.dequantize_weights_into(outs[1], ref[0], ref[1][:-1], fmt, group_size, segments)
            with pytest.raises(ValueError, match="segments of"):
                ops.quantize_weights(x, fmt, group_size, [n - 1, 2])


@pytest.mark.parametrize("fmt", WEIGHT_FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_non_finite_weights_decode_to_nan_as_the_reference(fused, fmt, dtype):
    """Weights are finite by contract, but a NaN or Inf one (a diverged run) must not come back finite from the
    quantized all-gather: every group holding one decodes to NaN, as in the reference, and the other groups are
    unchanged. The fused op used to skip a NaN in its absmax and decode a NaN weight as a finite value."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    n, gs = 4096 + 77, 64
    for segments in (None, [1000, n - 1000]):
        x = torch.randn(n, generator=g)
        bad = torch.randperm(n, generator=g)[:12]
        x[bad[:6]] = float("nan")
        x[bad[6:9]] = float("inf")
        x[bad[9:]] = -float("inf")
        x = x.to(dtype)
        ref = REFERENCE.quantize_weights(x, fmt, gs, segments)
        got = fused.quantize_weights(x, fmt, gs, segments)
        assert torch.equal(ref[1].isnan(), got[1].isnan()) and torch.equal(ref[1].nan_to_num(), got[1].nan_to_num())
        outs = [torch.zeros(n, dtype=dtype) for _ in range(2)]
        REFERENCE.dequantize_weights_into(outs[0], *ref, fmt, gs, segments)
        fused.dequantize_weights_into(outs[1], *got, fmt, gs, segments)
        assert torch.equal(outs[0].isnan(), outs[1].isnan()) and outs[1][bad].isnan().all()
        assert torch.equal(outs[0].nan_to_num(), outs[1].nan_to_num())


SUBNORMAL = 2.0**-149  # the smallest fp32 subnormal


def _subnormal_units(n: int, seed: int, high: int) -> torch.Tensor:
    """``n`` fp32 values that are whole multiples (1 to ``high``, random signs) of the smallest subnormal: in a group
    of them the scale absmax / qmax is a subnormal that rounds to a whole unit, so value / scale reaches past the
    format's largest code (up to about 1.5 qmax)."""
    g = torch.Generator().manual_seed(seed)
    units = torch.randint(1, high + 1, (n, ), generator=g).float()
    signs = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    return units * signs * SUBNORMAL


def test_fp8_codes_past_the_largest_value_equal_reference(fused):
    """FP8 codes of values past the format's largest after the division by the group's scale (groups of subnormals,
    whose scale loses its precision): e4m3 magnitudes above 464 become what this torch's c10 makes of them (0x7e,
    saturated, in torch 2.13; 0x7f in older ones), e5m2's from 61440 become infinity; weights and gradients sent
    whole, the fused op's codes, scales, residual bits and decoded sums as the reference's. Gradient groups of 16 and
    of 32 (the op's vector coder, whose vectors holding such a value take the scalar conversion)."""
    # weights: groups of 32 whose absmax is 465-671 units (scale rounds to 1 unit, values up to 671 > 464)
    x = _subnormal_units(4096, 1, 671)
    x[::32] = torch.randint(465, 672, (128, ), generator=torch.Generator().manual_seed(2)).float() * SUBNORMAL
    ref = REFERENCE.quantize_weights(x, "fp8_e4m3", 32, None)
    got = fused.quantize_weights(x, "fp8_e4m3", 32, None)
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1].view(torch.int32), got[1].view(torch.int32))
    assert (x.view(-1, 32).abs() / ref[1][:, None]).max().item() > 464  # values past e4m3's largest were coded
    for (fmt, high), group_size in itertools.product((("fp8_e4m3", 671), ("fp8_e5m2", 90000)), (16, 32)):
        job = make_job([3000, 20000], 1, value_format=fmt, density=1.0, min_numel=10**9, seed=3, group_size=group_size)
        for i, src in enumerate(job.srcs):
            src.copy_(_subnormal_units(src.numel(), 10 + i, high))
            job.residuals[i].fill_(-0.0)  # acc = src exactly, and the new residuals are compared too
        groups = job.srcs[1].view(-1, job.group_size).abs()  # one row: the scale groups are the source's
        largest, past = {"fp8_e4m3": (448.0, 464), "fp8_e5m2": (57344.0, 61440)}[fmt]
        assert (groups / (groups.amax(1, keepdim=True) / largest)).max().item() > past  # past the largest code
        ref = REFERENCE.compress(job)
        assert_same(ref, fused.compress(job))
        sums = [decode_row(ops, job, 0, ref.payloads[0])[0] for ops in (REFERENCE, fused)]
        assert torch.equal(sums[0].view(torch.int32), sums[1].view(torch.int32))


def test_fp8_conversion_of_every_magnitude_class_equals_torch(fused):
    """The fused op's FP8 e4m3 weight codes of values at scale 1 (a group whose absmax is 448 exactly) over every
    class of fp32 magnitude: zeros, fp32 subnormals, fp8 subnormals, normals, halfway cases and random bits; the codes
    torch's own conversion gives."""
    g = torch.Generator().manual_seed(4)
    bits = torch.randint(0, 2**31 - 1, (1 << 16, ), generator=g, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32).abs()
    x = x[torch.isfinite(x) & (x <= 448.0)]
    values = torch.arange(128, dtype=torch.uint8).view(torch.float8_e4m3fn).float()[:127]  # every finite e4m3 >= 0
    grid = torch.cat([values, (values[1:] + values[:-1]) / 2])  # and every midpoint between two neighbours
    small = torch.tensor([2.0**-9, 2.0**-10, 3 * 2.0**-11, 2.0**-6, 2.0**-7 * 1.5, 1e-40, 1e-45, 0.0])
    x = torch.cat([x, grid, small, 2.0**-9 * torch.arange(0, 16, 0.25)])
    x = torch.cat([x, -x])
    n = x.numel() - x.numel() % 32
    x = x[:n].view(-1, 32).clone()
    x[:, 0] = 448.0  # every group's scale is 1 exactly: the codes are the conversion of the values themselves
    x = x.view(-1)
    codes, scales = fused.quantize_weights(x, "fp8_e4m3", 32, None)
    assert torch.equal(scales, torch.ones_like(scales))
    assert torch.equal(codes, x.to(torch.float8_e4m3fn).view(torch.uint8))


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


@pytest.mark.parametrize("fmt", ["int4", "int2", "int1", "fp8_e4m3", "fp8_e5m2"])
def test_sparse_tensors_keeping_every_element_match(fused, fmt):
    """A bucket whose every tensor keeps all its elements though some are sparse (k >= m at a density near 1): the
    sparse ones still send their positions, so the payload is not the size of a bucket sent whole (the op allocated
    an FP8 or INT4 bucket's payloads before its dense pass by that size and raised)."""
    for numels, min_numel in (([24], 0), ([24, 5], 10), ([3000, 70], 0)):
        job = make_job(numels, 2, density=0.9999, min_numel=min_numel, value_format=fmt,
                       seed=int(torch.randint(0, 1 << 30, ())))
        assert all(k >= m for k, m in zip(job.targets(), job.real_totals()))
        ref = REFERENCE.compress(job)
        assert ref.kept == sum(numels)
        assert_same(ref, fused.compress(job))


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


def test_index_gaps_of_every_varint_length(fused):
    """Kept positions whose gaps need one, two, three and four varint bytes, at each side of every length's limit
    (127/128, 16383/16384, 2^21 - 1/2^21): the op's varints (two bytes written at once below 2^14) are the reference's,
    and the receiver finds the positions."""
    n = 2 * 4_400_000
    job = make_job([n, 70], 2, density=0.01, seed=int(torch.randint(0, 1 << 30, ())))
    job.threshold = 1e6
    gaps = [0, 127, 128, 5, 16383, 16384, 1, (1 << 21) - 1, 1 << 21, 130, 2]
    pos = torch.tensor(gaps).cumsum(0) + torch.arange(len(gaps))  # gap g: g positions skipped
    row1 = pos + (n // 2) + int(torch.randint(0, 1000, ()))
    src = job.srcs[0]
    src.zero_()
    src[torch.cat([pos, row1])] = 1e9 * (1 + torch.rand(2 * len(gaps)))
    ref, out = REFERENCE.compress(job), fused.compress(job)
    assert_same(ref, out)
    for r, expect in ((0, pos), (1, row1 - n // 2)):
        acc, body = decode_row(fused, job, r, out.payloads[r])
        assert body.n_indexed == len(gaps)
        assert torch.equal(acc[:n // 2].nonzero().view(-1), expect)


def test_mostly_zero_tensor(fused):
    """Most elements exactly 0: the lowering rounds run out; both keep the same elements."""
    job = make_job([50_000], 2, density=0.1, residual=False)
    job.srcs[0][torch.arange(50_000) % 97 != 0] = 0
    assert_same(REFERENCE.compress(job), fused.compress(job))


def test_non_finite_sends_nothing(fused):
    job = make_job([3, 5000], 2)
    job.srcs[1][1234] = float("nan")
    ref, fu = REFERENCE.compress(job), fused.compress(job)
    assert_same(ref, fu)
    assert not fu.finite and fu.kept == 0 and fu.residuals is None
    assert all(p.numel() == 20 for p in fu.payloads)  # header only


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["int4", "int1"])
def test_non_finite_in_a_row_sent_whole_sends_nothing(fused, bad, dtype, fmt):
    """A row sent whole is accumulated and coded in one pass from groups of 32 values or more; a NaN or an infinity
    anywhere in it (here in a random group of a tensor sent whole beside a sparse one) makes both send nothing."""
    seed = int(torch.randint(0, 1 << 30, ()))
    job = make_job([40_000, 9_000], 2, dtype=dtype, density=0.05, group_size=128, value_format=fmt, seed=seed,
                   min_numel=10_000)
    assert job.sparse == [True, False]
    job.srcs[1][int(torch.randint(0, 9_000, (), generator=torch.Generator().manual_seed(seed)))] = bad
    ref, fu = REFERENCE.compress(job), fused.compress(job)
    assert_same(ref, fu)
    assert not fu.finite and fu.kept == 0 and fu.residuals is None


def test_topk_threshold_binding(fused):
    g = torch.Generator().manual_seed(3)
    for n, k in ((5000, 50), (100_000, 1000), (3000, 2999)):
        mag = torch.randn(n, generator=g).abs()
        sample = torch.randint(0, n, (1500, ), generator=g)
        assert fused.op.topk_threshold(mag, k, sample) == float(topk_threshold(mag, k, sample))
        assert fused.op.topk_threshold(mag, k, torch.empty(0, dtype=torch.long)) == float(topk_threshold(mag, k, None))


@pytest.mark.parametrize("hierarchical", [False, True])
def test_decode_add_equals_reference(fused, hierarchical):
    """The fused decode adds the same bits as the reference for every row; malformed bodies raise ValueError in
    both: a truncated varint, one position too many, an index past the row."""
    job = make_job([5, 3000, 2, 65537, 64], 3, hierarchical=hierarchical, seed=11)
    out = REFERENCE.compress(job)
    for row, payload in enumerate(out.payloads):
        layout = job.row_layout(row)
        body = wire.parse(payload, 0, layout)
        sums = []
        for ops in (REFERENCE, fused):
            acc = torch.randn(layout.row_numel, generator=torch.Generator().manual_seed(row))
            ops.decode_add(acc, body, layout)
            sums.append(acc)
        assert torch.equal(sums[0], sums[1])
        for bad_index, bad_n in ((body.index_bytes[:-1], body.n_indexed), (body.index_bytes, body.n_indexed + 1),
                                 (torch.tensor([0xFF, 0xFF, 0x7F], dtype=torch.uint8), 1)):
            bad = wire.Body(body.kept - body.n_indexed + bad_n, bad_n, body.scales, body.values, bad_index)
            for ops in (REFERENCE, fused):
                with pytest.raises(ValueError):
                    ops.decode_add(torch.zeros(layout.row_numel), bad, layout)


def _leb(v):
    out = []
    while v >= 128:
        out.append(v & 0x7F | 0x80)
        v >>= 7
    return out + [v]


def test_bad_inputs_raise_instead_of_touching_memory(fused):
    """Inputs a corrupted payload or a wrong caller could produce: errors, never a crash or a write
    outside the buffers (each of these crashed or wrote out of bounds before being checked)."""
    op = fused.op
    two = torch.tensor([0x99, 0x09], dtype=torch.uint8)
    # varint gaps that wrap the int64 position around to a negative index
    wrap = torch.tensor(_leb(0) + _leb(2**63 - 1) + _leb(2**63 - 1 - 4), dtype=torch.uint8)
    for ops in (REFERENCE, fused):
        layout = wire.RowLayout(1, [100], [90], [True], True, "int4", 16, torch.float32, "varint")
        with pytest.raises(ValueError, match="past the partition"):
            ops.decode_add(torch.zeros(100), wire.Body(3, 3, torch.tensor([1.0]), two, wrap), layout)
    ok_index = torch.tensor(_leb(3) + _leb(5), dtype=torch.uint8)
    bad_calls = [
        dict(out=torch.zeros(1)),  # smaller than the row
        dict(sparse=[]),  # lists of different lengths
        dict(seg_real=[120]),  # more real elements than columns
        dict(group_size=0),
        dict(fmt=5),  # no such value format
    ]
    for bad in bad_calls:
        args = dict(out=torch.zeros(100), values=two, scales=torch.tensor([1.0]), index_bytes=ok_index, kept=2,
                    n_indexed=2, seg_real=[90], seg_chunks=[100], sparse=[True], group_size=16, fmt=0)
        args.update(bad)
        with pytest.raises((RuntimeError, ValueError), match="decode_add"):  # the C++ op's checks name the function
            op.decode_add(*args.values())
    empty_l = torch.empty(0, dtype=torch.long)
    base = dict(srcs=[torch.randn(100)], offsets=[0], strides=[50], residuals=[torch.randn(100)], residual_numels=[100],
                numels=[100], chunks=[50], sparse=[True], row_owner=[0, 1], ks=[5], samples=[empty_l], divisor=2.0,
                group_size=16, fmt=0, fingerprint=1, want_residual=True, fixed=[-1.0], reuse=False)
    op.compress_bucket(*base.values())  # the valid call works
    for bad, match in ((dict(residuals=[torch.randn(10)], residual_numels=[10]), "residual_numels"),
                       (dict(residuals=[torch.empty(0)], residual_numels=[0]), "residual_numels"),
                       (dict(offsets=[-1000]), "offsets"), (dict(ks=[0]), "ks"), (dict(ks=[-1]), "ks"),
                       (dict(fingerprint=2**40), "fingerprint"), (dict(strides=[10]), "strides"),
                       (dict(fixed=[]), "differ in length"), (dict(fmt=-1), "value format")):
        with pytest.raises(RuntimeError, match=match):
            op.compress_bucket(*dict(base, **bad).values())
    for sample in ([0, 5, 100], [-1, 3], [2**40]):  # sample indices outside the tensor's 100 real elements
        with pytest.raises(IndexError, match="sample index out of range"):
            op.compress_bucket(*dict(base, samples=[torch.tensor(sample)]).values())
    for k in (0, -1, 11):
        with pytest.raises(RuntimeError, match="k must be in"):
            op.topk_threshold(torch.rand(10), k, empty_l)


@pytest.fixture
def no_compiler(monkeypatch, tmp_path):
    """No prebuilt op, no loaded op, no compiler."""
    from deepspeed.ops.op_builder.builder import OpBuilder
    from op_builder.dgc import DGCCPUBuilder
    monkeypatch.setattr(DGCCPUBuilder, "prebuilt_module", lambda self: None)
    monkeypatch.setattr(OpBuilder, "_loaded_ops", {})
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    import deepspeed_dgc.codec.kernels as kernels
    monkeypatch.setattr(kernels, "_warned", set())
    monkeypatch.setattr(kernels, "_LOAD_FAILURES", {})


def test_stale_prebuilt_op_is_rebuilt_with_a_warning(monkeypatch, caplog):
    """A prebuilt module of an older calling convention (an editable install not reinstalled after a pull) is
    not loaded: the builder says so and JIT-builds from the sources instead."""
    from deepspeed.ops.op_builder.builder import OpBuilder
    from op_builder.dgc import DGCCPUBuilder
    assert load_fused_op("cpu").ABI == DGCCPUBuilder.ABI  # the op built from these sources declares it
    stale, fresh = types.SimpleNamespace(), types.SimpleNamespace(ABI=DGCCPUBuilder.ABI)  # ABI absent: 1
    monkeypatch.setattr(OpBuilder, "_loaded_ops", {})
    monkeypatch.setattr(DGCCPUBuilder, "prebuilt_module", lambda self: stale)
    monkeypatch.setattr(DGCCPUBuilder, "jit_load", lambda self, verbose=False: fresh)
    with caplog.at_level("WARNING", logger="deepspeed_dgc"):
        assert DGCCPUBuilder().load() is fresh
    assert f"calling convention 1, these sources need {DGCCPUBuilder.ABI}" in caplog.text


def test_fused_without_compiler_fails_clearly(no_compiler):
    with pytest.raises(DGCKernelError, match=r"'dgc.kernels' is \"fused\" but the fused cpu op cannot load: .*"
                       r"no C\+\+ compiler \(/nonexistent/c\+\+\)"):
        get_ops("fused", "cpu", True)


def test_auto_without_compiler_falls_back_with_one_warning(no_compiler, caplog, monkeypatch):
    """The fused op that cannot load falls back to the reference with one warning, and is not tried again in the
    process (every caller would otherwise retry the build)."""
    import deepspeed_dgc.codec.kernels as kernels
    attempts = []
    real = kernels.load_fused_op
    monkeypatch.setattr(kernels, "load_fused_op", lambda device_type: attempts.append(device_type) or real(device_type))
    with caplog.at_level("WARNING", logger="deepspeed_dgc"):
        assert get_ops("auto", "cpu", True) is REFERENCE
        assert get_ops("auto", "cpu", True) is REFERENCE
    warnings = [r.getMessage() for r in caplog.records if "using the PyTorch reference path" in r.getMessage()]
    assert len(warnings) == 1 and "no C++ compiler" in warnings[0]
    assert attempts == ["cpu"]


def test_dispatch_choices():
    assert get_ops("reference", "cpu", True) is REFERENCE
    assert get_ops("auto", "cpu", False) is REFERENCE  # raw values: reference only
    assert get_ops("auto", "cpu", True).name == "fused-cpu"
    with pytest.raises(DGCKernelError, match="only code quantized payloads"):
        get_ops("fused", "cpu", False)
    with pytest.raises(ValueError, match="unknown kernels 'fast'"):
        get_ops("fast", "cpu", True)


@pytest.mark.parametrize("fmt, coding, sr", [("int4", "bitmap", False), ("int4", "varint", True),
                                              ("int2", "varint", True)])
def test_what_the_fused_op_does_not_code_is_still_coded_right(fused, fmt, coding, sr):
    """Jobs the fused op hands on (bitmap positions, stochastic rounding): its payloads decode to
    within the format's bound of a float64 oracle of the accumulator, the residuals are the accumulator minus what
    was sent, and each tensor keeps within DGC's bounds."""
    job = make_job([5, 3000, 2, 20000, 64], 2, value_format=fmt, index_coding=coding, density=0.1, seed=8)
    if sr:
        job.rounding_generator = torch.Generator().manual_seed(3)
    assert not fused_can_code(job)
    check_decodes_to_what_was_accumulated(job, fused.compress(job), fused)


def test_dense_jobs_stay_on_the_fused_op_whatever_the_index_coding():
    """Positions are never sent when no tensor is sparse, so a dense job with "bitmap" is still fused work."""
    job = make_job([100], 2, density=1.0, index_coding="bitmap")
    job.sparse = [False]
    assert fused_can_code(job)
    job.sparse = [True]
    assert not fused_can_code(job)


# the absmax that makes a group's scale exactly 1 (INT1's scale is a mean: its groups keep random values)
UNIT_SCALE_ABSMAX = {"int4": 7.0, "int2": 1.5, "fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}


def _value_classes(fmt, g):
    """Magnitudes every rounding path of ``fmt``'s coder meets at scale 1, both signs: its grid, the midpoints and the
    points one fp32 ulp either side of them, fp32 and fp8 subnormals, zeros, and random bits up to the absmax."""
    top = UNIT_SCALE_ABSMAX.get(fmt, 4.0)
    if fmt.startswith("fp8"):
        dt = torch.float8_e4m3fn if fmt == "fp8_e4m3" else torch.float8_e5m2
        grid = torch.arange(128, dtype=torch.uint8).view(dt).float()
        grid = grid[torch.isfinite(grid) & (grid <= top)]
    else:
        grid = torch.arange(0.0, top + 1.0, 0.5)  # INT4's ties at k + 0.5, INT2's at the integers
    mid = (grid[1:] + grid[:-1]) / 2
    near = torch.cat([grid, mid])
    near = torch.cat([near, torch.nextafter(near, torch.tensor(math.inf)), torch.nextafter(near, torch.tensor(0.0))])
    tiny = torch.tensor([0.0, 1e-45, 1e-40, 2.0**-126, 2.0**-9, 2.0**-10, 3 * 2.0**-11, 2.0**-16, 2.0**-17, 3 * 2.0**-18])
    bits = torch.randint(0, 0x7F800000, (4096, ), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)
    x = torch.cat([near, tiny, bits[bits <= top]])
    x = x[x <= top]
    x = torch.cat([x, -x])
    return x[torch.randperm(x.numel(), generator=g)]


@pytest.mark.parametrize("fmt", ["int4"] + OTHER_FORMATS)
@pytest.mark.parametrize("group_size", [32, 64, 2048])
def test_rows_sent_whole_code_every_value_class_as_the_reference(fused, fmt, group_size):
    """Rows sent whole are coded by the dense pass, whose vector coders take 32 values at a time from groups of 32 or
    more (the other tests' groups of 16 never reach them). Groups at scale 1 exactly (their first value is the
    format's absmax) hold every value class of the format's rounding: ties and the fp32 neighbours of ties, the FP8
    grid, subnormals of fp32 and of the FP8 formats, +0 and -0, random bits; one group is all zeros and the last is
    short. The same payload bytes and residual bits as the reference."""
    seed = int(torch.randint(0, 1 << 30, ()))
    g = torch.Generator().manual_seed(seed)
    x = _value_classes(fmt, g)
    n = (x.numel() // group_size + 2) * group_size + 37
    top = UNIT_SCALE_ABSMAX.get(fmt)
    x = torch.cat([x, torch.randn(n - x.numel(), generator=g).clamp(-(top or 4.0), top or 4.0)])[:n]
    if top is not None:
        x[::group_size] = torch.where(torch.arange(x[::group_size].numel()) % 2 == 0, top, -top)
    x[group_size:2 * group_size] = torch.where(torch.rand(group_size, generator=g) < 0.5, 0.0, -0.0)  # scale 0
    job = make_job([n], 1, density=1.0, value_format=fmt, group_size=group_size, min_numel=10**9, seed=seed)
    job.srcs[0].copy_(x)
    job.residuals[0].fill_(-0.0)  # acc = src + (-0) is src exactly, -0 included (a +0 residual would make it +0)
    assert job.divisor == 1.0
    out = fused.compress(job)
    assert_same(REFERENCE.compress(job), out)
    if top is not None:  # the groups really were at scale 1
        scales = wire.parse(out.payloads[0], 0, job.row_layout(0)).scales[:-(-n // group_size)].abs()
        assert scales[1] == 0.0 and (scales[0] == 1.0) and (scales[2:] == 1.0).all()


@pytest.mark.parametrize("fmt", ["int4"] + OTHER_FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rows_sent_whole_with_zeros_from_every_source_dtype(fused, fmt, dtype):
    """fp32 and bf16 rows sent whole take the one-pass coder, fp16 ones the three steps (accumulate, encode_block,
    pack); both from groups of 32 and 128 values where about a third of the values are exact zeros (INT2's and
    INT1's mixed groups and zero bitmaps), some groups all zeros. The same payload bytes and residual bits as the
    reference."""
    seed = int(torch.randint(0, 1 << 30, ()))
    g = torch.Generator().manual_seed(seed)
    for group_size in (32, 128):
        job = make_job([5000, 70_001], 2, dtype=dtype, density=1.0, value_format=fmt, group_size=group_size,
                       seed=seed, residual=False, min_numel=10**9)
        for src in job.srcs:
            src[torch.rand(src.numel(), generator=g) < 0.3] = 0.0
            src[group_size:3 * group_size] = 0.0
        assert_same(REFERENCE.compress(job), fused.compress(job))


def _code_of_quotient(fmt, t):
    """INT4's or INT2's code (as a signed level) of quotients ``t`` (fp32), as formats.quantize_values takes it."""
    if fmt == "int4":
        return torch.round(t).clamp(-7, 7)
    return torch.floor((t - 0.5) + 0.5).clamp(-2, 1)


@pytest.mark.parametrize("fmt", ["int4", "int2"])
def test_rows_sent_whole_code_quotients_near_a_step_as_the_reference(fused, fmt):
    """Codes are functions of the quotient v / scale, rounded once; v * (1 / scale), which a vector coder may be
    tempted to use, differs from it by up to 3 units in the last place, which moves values across a step of the code
    (INT4's half-integers, INT2's integers and its step just below 0). Groups at random scales that are not powers
    of two hold, after their absmax, values whose quotients are a step moved by a random walk of up to 9 fp32 ulps.
    The test first checks that the product would code some of them otherwise, then that the dense pass's payload bytes
    and residual bits are the reference's. (A coder taking the product away from the steps and dividing near them
    was tried: no faster, results/kernels.md.)"""
    seed = int(torch.randint(0, 1 << 30, ()))
    g = torch.Generator().manual_seed(seed)
    gs, n_groups = 64, 48
    qmax = 7.0 if fmt == "int4" else 1.5
    steps = (torch.arange(-6.5, 7.0, 1.0) if fmt == "int4" else
             torch.tensor([-1.0, 1.0, -2.0**-24, -2.0**-25, -2.0**-26]))  # INT2's near-0 step is about -2^-24.5
    absmax = (1.0 + torch.rand(n_groups, generator=g)) * 2.0**torch.randint(-20, 20, (n_groups, ), generator=g)
    scale = absmax / qmax  # fp32, as the group's scale
    groups, naive_misses = [], 0
    for a, s in zip(absmax, scale):
        v = steps[torch.randint(0, steps.numel(), (gs - 1, ), generator=g)] * s
        for _ in range(9):  # each value one ulp towards or away from zero, or not moved, 9 times
            away = torch.rand(gs - 1, generator=g) < 0.5
            v = torch.where(torch.rand(gs - 1, generator=g) < 0.5, v,
                            torch.nextafter(v, torch.where(away, v.sign() * math.inf, torch.zeros(()))))
        naive_misses += int((_code_of_quotient(fmt, v / s) != _code_of_quotient(fmt, v * (1.0 / s))).sum())
        groups.append(torch.cat([torch.where(torch.rand((), generator=g) < 0.5, a, -a).view(1), v]))
    assert naive_misses > 0, "no value here would be coded otherwise from the product: the test cannot fail"
    x = torch.cat(groups + [torch.randn(21, generator=g) * scale[0]])
    job = make_job([x.numel()], 1, density=1.0, value_format=fmt, group_size=gs, min_numel=10**9, seed=seed)
    job.srcs[0].copy_(x)
    job.residuals[0].fill_(-0.0)
    assert job.divisor == 1.0
    assert_same(REFERENCE.compress(job), fused.compress(job))


@pytest.mark.parametrize("fmt", ["int4", "int2", "int1", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("group_size", [16, 2048])
def test_large_buckets_equal_reference(fused, fmt, group_size):
    """Sizes the small random buckets do not reach: samples of more than 4096 magnitudes (the op's radix select of
    the threshold), a tensor spanning several of the dense pass's blocks and L1 pieces at odd offsets into its rows,
    scale groups wider than a piece, and rows sent whole coded piece by piece."""
    seed = int(torch.randint(0, 1 << 30, ()))
    for density in (0.01, 1.0):
        job = make_job([450_001, 70_003, 5], 2, density=density, value_format=fmt, group_size=group_size, seed=seed,
                       min_numel=64 if density < 1 else 10**9)
        assert_same(REFERENCE.compress(job), fused.compress(job))
        hier = make_job([200_003, 901], 2, hierarchical=True, density=density, value_format=fmt,
                        group_size=group_size, seed=seed + 1, min_numel=64 if density < 1 else 10**9)
        assert_same(REFERENCE.compress(hier), fused.compress(hier))



def test_residuals_of_32_mb_and_more_are_reused_and_equal_reference(fused, tmp_path):
    """A new residual of 32 MB or more is 2 MB-aligned memory of the op's own: the same bits as the reference's, fed
    back as the next step's residual, saved and loaded; freed, its memory is handed out again for the next residual
    of its size, and at most two freed ones are kept."""
    fused.op.release_residual_cache()
    seed = int(torch.randint(0, 1 << 30, ()))
    big = (32 << 20) // 4 + 1001  # a residual of 32 MB and 4004 bytes
    for density, fmt in ((0.01, "int4"), (1.0, "int2")):
        job = make_job([big, 3000], 1, density=density, value_format=fmt, group_size=128, seed=seed,
                       min_numel=64 if density < 1 else 10**9)
        ref, out = REFERENCE.compress(job), fused.compress(job)
        assert_same(ref, out)
        ptr = out.residuals[0].data_ptr()
        assert ptr % (2 << 20) == 0
        job.residuals = out.residuals  # the next step reads the op's residual
        job.srcs = [torch.randn_like(s) for s in job.srcs]
        assert_same(REFERENCE.compress(job), fused.compress(job))
        torch.save(out.residuals[0], tmp_path / "r.pt")
        assert torch.equal(torch.load(tmp_path / "r.pt").view(torch.int32), ref.residuals[0].view(torch.int32))
        del out, job.residuals
        assert fused.compress(make_job([big, 3000], 1, density=density, value_format=fmt, group_size=128,
                                       seed=seed)).residuals[0].data_ptr() == ptr  # (freed again at once)
    job = make_job([big, 3000], 1, density=0.01, group_size=128, seed=seed)
    outs = [fused.compress(job) for _ in range(3)]  # three buffers (one from the cache), all freed: two kept
    assert len({o.residuals[0].data_ptr() for o in outs}) == 3
    del outs
    assert fused.op.release_residual_cache() == 2 * 4 * big
    assert fused.op.release_residual_cache() == 0


def _cpu_has_avx2() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return platform.machine() == "x86_64" and "avx2" in flags


def test_the_avx2_passes_run_where_the_cpu_has_avx2(fused):
    """The comparisons with the reference give the same bytes whether the op's hand-written AVX2 passes (compaction,
    streamed residual) ran or not; this says that they run on an x86-64 CPU with AVX2 (the op is built by GCC)."""
    assert fused.op.avx2_paths() == _cpu_has_avx2()


def test_long_position_lists_decode_in_parallel_as_the_reference(fused):
    """A row whose index bytes are long enough for the op to decode them in parallel chunks (from 2 x 16384 bytes;
    about 75K here), with gaps of one, two and three varint bytes and two segments: the same sums as the reference.
    Corrupted bodies raise the serial decoder's error naming the fault: a varint longer than 9 bytes or a position
    past the row in the middle of the bytes, the bytes ending inside a varint (followed in memory by a byte that
    would end it), a count that does not match, a position in a tensor's padding."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    chunks, real = [2_000_000, 1_000_000], [1_999_990, 1_000_000]
    row = sum(chunks)

    def positions(lo, hi):  # strictly increasing columns in [lo, hi): mostly gaps < 128, some of 2 and 3 bytes
        kind = torch.rand(200_000, generator=g)
        gaps = torch.where(kind < 0.98, torch.randint(0, 40, (200_000, ), generator=g),
                           torch.where(kind < 0.9995, torch.randint(128, 1000, (200_000, ), generator=g),
                                       torch.randint(16384, 20_000, (200_000, ), generator=g)))
        p = lo + torch.cumsum(gaps + 1, 0) - 1
        return p[p < hi]

    pos = torch.cat([positions(0, real[0]), positions(chunks[0], chunks[0] + real[1])])
    counts = [int((pos < chunks[0]).sum()), int((pos >= chunks[0]).sum())]
    index = indices.encode_indices(pos, torch.tensor([pos.numel()]))
    assert index.numel() >= 4 * 16384 and int((index >= 0x80).sum()) > 1000 and int((index == 0x81).sum()) > 3
    n = pos.numel()
    groups = sum(-(-c // 128) for c in counts)
    values = torch.randint(0, 256, (-(-n // 2), ), dtype=torch.uint8, generator=g)
    scales = torch.rand(groups, generator=g) + 0.1
    layout = wire.RowLayout(1, chunks, real, [True, True], True, "int4", 128, torch.float32, "varint")
    start = torch.randn(row, generator=g)
    sums = []
    for ops in (REFERENCE, fused):
        out = start.clone()
        ops.decode_add(out, wire.Body(n, n, scales, values, index), layout)
        sums.append(out)
    assert torch.equal(sums[0], sums[1])
    assert bool((sums[0] != start)[pos].float().mean() > 0.9)  # the values landed at the positions sent
    # two-byte varints only, 32K-48K bytes (two chunks, split at the middle byte), after no or one one-byte varint:
    # in one of the two, the middle byte is a varint's second
    gaps = torch.randint(128, 180, (18_000, ), generator=g)
    for lead in ([], [5]):
        p2 = torch.cumsum(torch.cat([torch.tensor(lead, dtype=torch.long), gaps]) + 1, 0) - 1
        idx2 = indices.encode_indices(p2, torch.tensor([p2.numel()]))
        assert 2 * 16384 <= idx2.numel() < 3 * 16384 and idx2.numel() == len(lead) + 2 * gaps.numel()
        layout2 = wire.RowLayout(1, [row], [row], [True], True, "int4", 128, torch.float32, "varint")
        k2 = p2.numel()
        body2 = wire.Body(k2, k2, scales[:-(-k2 // 128)], values[:-(-k2 // 2)], idx2)
        got = [start.clone(), start.clone()]
        REFERENCE.decode_add(got[0], body2, layout2)
        fused.decode_add(got[1], body2, layout2)
        assert torch.equal(got[0], got[1])

    mid = int((index[:index.numel() // 2] < 0x80).sum())  # the varints before the middle of the bytes
    cut = int(torch.nonzero(index < 0x80)[mid - 1]) + 1  # the first byte after the middle's varint
    too_long = torch.cat([index[:cut], torch.full((9, ), 0x81, dtype=torch.uint8), index[cut:]])
    past = torch.cat([index[:cut], torch.tensor(_leb(row), dtype=torch.uint8), index[cut:]])
    in_padding = indices.encode_indices(torch.cat([pos[:counts[0]], torch.tensor([real[0] + 3]), pos[counts[0]:]]),
                                        torch.tensor([n + 1]))
    bad = [(too_long, n, "varint longer than 9 bytes"), (past, n + 1, "past the partition"),
           (torch.cat([index, torch.tensor([0x80, 0x00], dtype=torch.uint8)])[:-1], n, "inside a varint"),
           (index, n + 1, f"hold {n} positions, expected {n + 1}"), (in_padding, n + 1, "points into padding")]
    for bad_index, bad_n, message in bad:
        assert bad_index.numel() >= 4 * 16384
        for ops in (REFERENCE, fused) if message != "points into padding" else (fused, ):  # (the reference does not
            with pytest.raises(ValueError) as err:                                        # look at padding)
                ops.decode_add(start.clone(), wire.Body(bad_n, bad_n, scales, values, bad_index), layout)
            if ops is fused:
                assert message in str(err.value)


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "int4"])
def test_weights_decode_to_bf16_bits_as_the_reference(fused, fmt):
    """Dequantizing into bf16 rounds each weight once as torch does, bit for bit: every code at scales whose products
    fall exactly halfway between two bf16 values (1 + 2^-8 and 1 + 2^-7 + 2^-8: ties to even), infinity, a subnormal
    and random scales, in groups that end inside a vector and after a segment boundary; a NaN scale's group decodes
    to NaN."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    gs = 128
    special = torch.tensor([1.00390625, -1.01171875, 1.01171875, 2.0**-120, float("inf")])  # (1 + 2^-7 + 2^-8: up)
    special = torch.cat([special, torch.tensor([0xFFC00000], dtype=torch.int64).to(torch.int32).view(torch.float32)])
    for segments in (None, [3 * gs + 5, 9 * gs - 2]):
        n = 12 * gs + 3
        groups = formats.weight_num_groups(n, gs, segments)
        scales = torch.rand(groups, generator=g) * 3
        scales[:special.numel()] = special
        codes = torch.randint(0, 256, (n if fmt != "int4" else (n + 1) // 2, ), dtype=torch.uint8, generator=g)
        codes[:256] = torch.arange(256, dtype=torch.uint8)
        outs = [torch.empty(n, dtype=torch.bfloat16) for _ in range(2)]
        REFERENCE.dequantize_weights_into(outs[0], codes, scales, fmt, gs, segments)
        fused.dequantize_weights_into(outs[1], codes, scales, fmt, gs, segments)
        nan = outs[0].isnan()  # (NaN's bits differ between torch's own vectorized and scalar conversions)
        assert torch.equal(nan, outs[1].isnan()) and int(nan.sum()) >= gs
        assert torch.equal(outs[0].view(torch.int16)[~nan], outs[1].view(torch.int16)[~nan])


@pytest.mark.parametrize("density", [0.05, 1.0])
def test_int1_scales_of_huge_magnitudes_stay_finite_as_the_reference(fused, density):
    """INT1's scale is a group's mean magnitude. Where the fp32 sum of a group's magnitudes passes the largest float
    (finite values from about 2.7e36 in groups of 128) the mean is taken at 2^-64 the size, so the scale, the decoded
    values and the new residual stay finite. Sparse tensors (step 4's scales) and tensors sent whole (the dense pass's
    coder), fused against the reference: the same bytes and residual bits, everything finite; each scale within
    float rounding of its group's float64 mean (formats.group_scales against float64); the fixed layout finite too."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1, ))))
    job = make_job([70001, 300, 4099], 2, density=density, group_size=128, value_format="int1",
                   seed=int(torch.randint(0, 2**31 - 1, (1, ), generator=g)))
    for src in job.srcs[:2]:  # huge values (acc up to 1.5e38) in the first half, ordinary ones after
        half = src.numel() // 2
        sign = torch.randint(0, 2, (half, ), generator=g) * 2.0 - 1
        src[:half] = sign * (1e37 + 2e38 * torch.rand(half, generator=g))
    ref, out = REFERENCE.compress(job), fused.compress(job)
    assert ref.finite and out.finite
    assert_same(ref, out)
    assert all(bool(torch.isfinite(r).all()) for r in ref.residuals)
    rows = [decode_row(fused, job, row, payload)[0] for row, payload in enumerate(out.payloads)]
    assert all(bool(torch.isfinite(d).all()) for d in rows) and rows[0].abs().max() > 1e36  # (row 0: the huge half)
    plan = fixed.FixedPlan.build(job.numels, 2, [0, 1], job.sparse, density, True, "int1", 128, torch.float32)
    A = plan.layout.gather([s / job.divisor for s in job.srcs], fixed.owner_matrix(2, plan.layout.columns, "cpu"))
    fixed.encode(A, plan, 1, Workspace())
    assert bool(torch.isfinite(A).all())  # the fixed layout's residuals

    values = torch.cat([torch.rand(256, generator=g) * 3e38, torch.randn(128, generator=g)])  # 2 huge groups, 1 not
    values[5] = 0.0
    gid = torch.arange(384) // 128
    scales = formats.group_scales(values, gid, 3, "int1")
    mag = values.double().abs()
    mean64 = torch.stack([mag[gid == k].sum() / (mag[gid == k] > 0).sum() for k in range(3)])
    assert bool(torch.isfinite(scales).all())
    assert torch.allclose(scales.double(), mean64, rtol=1e-5, atol=0)
    ordinary = torch.zeros((), dtype=torch.float32)
    for v in values[256:].abs():  # below the overflow: the fp32 mean as before, summed in value order
        ordinary = ordinary + v
    assert torch.equal(scales[2], ordinary / 128)
