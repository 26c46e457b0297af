"""The value coders (cpu_coders.h, cpu_simd.h, dgc_math.h) against the reference: exact zeros, FP8 conversions of
every magnitude class, rows sent whole coded in the dense pass, quotients near a code's step, huge INT1 magnitudes.
"""

import itertools
import math

import pytest
import torch

from deepspeed_dgc.codec import fixed, formats, wire
from deepspeed_dgc.codec.layout import Workspace
from deepspeed_dgc.codec.reference import REFERENCE

from ..jobs import assert_same, decode_row, make_job
from . import OTHER_FORMATS


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
