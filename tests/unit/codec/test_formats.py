"""Value formats: round trips and per-format error bounds against float64 references, stochastic rounding,
FP8 range, bit packing, group ids, weight formats, subnormal groups."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepspeed_dgc.codec.formats import (FP8_MAX, VALUE_BITS, dequantize_int4, dequantize_values, dequantize_weights,
                                         int4_group_ids, int4_packed_bytes, pack_bits, pack_nibbles, packed_bytes,
                                         quantize_int4, quantize_values, quantize_weights, unpack_bits)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _values(n, seed):
    g = _gen(seed)
    return torch.randn(n, generator=g) * torch.rand(n, generator=g).pow(3) * 10


@pytest.mark.parametrize("n", [1, 7, 1001, 4099])
@pytest.mark.parametrize("group_size", [2, 16, 128])
def test_int4_round_trip_within_bound(n, group_size):
    x = torch.randn(n, generator=_gen(n + group_size), dtype=torch.float64).float() * 3
    packed, scales = quantize_int4(x, group_size)
    assert packed.dtype == torch.uint8 and packed.numel() == int4_packed_bytes(n) == math.ceil(n / 2)
    assert scales.numel() == math.ceil(n / group_size)
    y = dequantize_int4(packed, scales, n, group_size)
    # float64 reference of the bound: half a scale step of the value's own group
    groups = torch.arange(n) // group_size
    ref_scale = torch.zeros(scales.numel(), dtype=torch.float64).scatter_reduce(0, groups, x.double().abs(), "amax") / 7
    err = (y.double() - x.double()).abs()
    assert bool((err <= ref_scale[groups] / 2 * (1 + 1e-6) + 1e-12).all())
    # the group absmax itself is exact (code +-7)
    for g in range(scales.numel()):
        sel = groups == g
        i = int(x[sel].abs().argmax())
        assert abs(float(y[sel][i]) - float(x[sel][i])) <= 1e-6 * abs(float(x[sel][i]))


@pytest.mark.parametrize("fmt", ["int4", "int8", "fp8_e4m3"])
def test_tiny_and_subnormal_groups_stay_finite(fmt):
    """Groups whose absmax is subnormal (residuals of rarely-updated embedding rows end up there):
    1/scale would overflow to inf and 0 * inf is NaN; the codes must stay finite and in bound."""
    x = torch.zeros(512)
    x[:128] = torch.randn(128, generator=_gen(11)) * 1e-39  # subnormal group with zeros
    x[128] = 3e-45
    x[256:384] = torch.randn(128, generator=_gen(12))
    if fmt == "int4":
        packed, scales, deq = quantize_int4(x, 128, return_dequantized=True)
        y = dequantize_int4(packed, scales, 512, 128)
        assert torch.equal(deq, y)  # what the sender keeps as sent is what the receiver decodes
    else:
        codes, scales = quantize_weights(x, fmt, 128)
        y = dequantize_weights(codes, scales, 512, fmt, 128)
    assert bool(torch.isfinite(y).all())
    qmax = {"int4": 7, "int8": 127, "fp8_e4m3": 448}[fmt]
    bound = {"int4": 0.5, "int8": 0.5, "fp8_e4m3": 16.0}[fmt] / qmax
    for g in range(4):
        sl = slice(128 * g, 128 * (g + 1))
        # + 1e-42: a scale below the smallest subnormal (1.4e-45) flushes to 0 and its group with it
        assert float((y[sl] - x[sl]).abs().max()) <= bound * float(x[sl].abs().max()) * (1 + 1e-5) + 1e-42


def test_int4_segments_do_not_share_scales():
    """A tiny tensor next to a huge one keeps its own scale (groups restart per segment)."""
    small = torch.randn(5, generator=_gen(1)) * 1e-3
    big = torch.randn(300, generator=_gen(2)) * 1e3
    x = torch.cat([small, big])
    counts = torch.tensor([5, 300])
    packed, scales = quantize_int4(x, 128, counts)
    assert scales.numel() == 1 + 3
    y = dequantize_int4(packed, scales, 305, 128, counts)
    assert float((y[:5] - small).abs().max()) <= float(small.abs().max()) / 14 * (1 + 1e-6)
    with pytest.raises(ValueError, match="scales"):
        dequantize_int4(packed, scales, 305, 128)  # wrong segmentation is caught


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6, allow_nan=False, width=32), min_size=0, max_size=300),
       st.sampled_from([2, 4, 16, 128]))
def test_int4_property_bound(values, group_size):
    x = torch.tensor(values, dtype=torch.float32)
    n = x.numel()
    packed, scales = quantize_int4(x, group_size)
    y = dequantize_int4(packed, scales, n, group_size)
    gid, _ = int4_group_ids(torch.tensor([n]), group_size)
    assert bool(((y - x).abs() <= scales[gid] / 2 * (1 + 1e-5) + 1e-30).all())


@pytest.mark.parametrize("fmt", list(VALUE_BITS))
@pytest.mark.parametrize("n", [0, 1, 7, 128, 1001])
def test_round_trip_and_error_bound(fmt, n):
    v = _values(n, n + 7)
    seg = torch.tensor([n // 3, n - n // 3])
    packed, scales, decoded = quantize_values(v, fmt, 16, seg)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_bytes(n, fmt)
    assert torch.equal(dequantize_values(packed, scales, n, fmt, 16, seg), decoded)
    if n == 0:
        return
    # the per-group bound of each format, in units of the group's absmax (groups of 16 restart per segment)
    gid = torch.cat([torch.arange(n // 3) // 16, (n // 3 + 15) // 16 + torch.arange(n - n // 3) // 16])
    absmax = torch.zeros(int(gid.max()) + 1).scatter_reduce(0, gid, v.abs(), "amax")[gid]
    err = (decoded - v).abs()
    if fmt == "int4":
        assert bool((err <= absmax / 14 * (1 + 1e-6) + 1e-12).all())
    elif fmt == "int2":
        assert bool((err <= absmax / 3 * (1 + 1e-6) + 1e-12).all())
    elif fmt == "int1":  # s * sign(v) with s the group's mean magnitude
        assert bool((decoded.abs() <= absmax * (1 + 1e-6)).all()) and bool(((decoded >= 0) == (v >= 0)).all())
    else:  # FP8: relative 2^-4 (e4m3) or 2^-3 (e5m2) for normal values; absolute below the smallest normal
        rel = 2.0**-4 if fmt == "fp8_e4m3" else 2.0**-3
        tiny = absmax / FP8_MAX[fmt] * (2.0**-6 if fmt == "fp8_e4m3" else 2.0**-14)
        assert bool((err <= rel * v.abs() + tiny).all())
        assert bool((decoded.abs() <= absmax * (1 + 1e-6)).all())  # never overflows the group's range


def test_int1_scale_is_the_mean_magnitude():
    v = torch.tensor([1.0, -3.0, 2.0, -6.0])
    _, scales, decoded = quantize_values(v, "int1", 4)
    assert scales.tolist() == [3.0] and decoded.tolist() == [3.0, -3.0, 3.0, -3.0]


@pytest.mark.parametrize("fmt,stochastic", [(f, False) for f in VALUE_BITS] + [("int4", True), ("int2", True)])
def test_exact_zeros_decode_to_exact_zeros(fmt, stochastic):
    """Fresh random values in two segments, groups of 16, each group all zero, all non-zero or mixed (a random
    quarter to three quarters zero): every exact zero (+0 or -0) decodes to exactly 0, the round trip gives what the
    sender decoded, and the non-zero values get their format's value against a float64 oracle (INT1: sign times the
    mean magnitude of the group's non-zero values; INT2: within absmax/3, never 0)."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    n = 16 * 24 + 5
    v = torch.randn(n, generator=gen)
    kind = torch.randint(0, 3, ((n + 15) // 16, ), generator=gen).repeat_interleave(16)[:n]  # 0 zero, 1 full, 2 mixed
    zero = (kind == 0) | ((kind == 2) & (torch.rand(n, generator=gen) < 0.25 + 0.5 * torch.rand(1, generator=gen)))
    v[zero] = 0.0
    v[zero & (torch.rand(n, generator=gen) < 0.5)] = -0.0
    seg = torch.tensor([160, n - 160])  # a group boundary at 160: groups restart there
    rng = torch.Generator().manual_seed(3) if stochastic else None
    packed, side, decoded = quantize_values(v, fmt, 16, seg, generator=rng)
    assert torch.equal(dequantize_values(packed, side, n, fmt, 16, seg), decoded)
    assert bool((decoded[zero] == 0).all()), f"{int((decoded[zero] != 0).sum())} zeros decoded non-zero"
    nz = ~zero
    assert bool((decoded[nz] != 0).all()) or fmt not in ("int1", "int2")
    gid, n_groups = int4_group_ids(seg, 16)
    v64 = v.double()
    if fmt == "int1":
        sums = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, gid[nz], v64[nz].abs())
        counts = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, gid[nz], torch.ones_like(v64[nz]))
        oracle = torch.sign(v64) * (sums / counts.clamp(min=1))[gid]
        assert torch.allclose(decoded[nz].double(), oracle[nz], rtol=1e-6, atol=0)
    elif fmt == "int2":
        absmax = torch.zeros(n_groups, dtype=torch.float64).scatter_reduce(0, gid, v64.abs(), "amax")[gid]
        bound = absmax * (2 / 3 if stochastic else 1 / 3)  # nearest: half a step; stochastic: under one step
        assert bool(((decoded.double() - v64).abs() <= bound * (1 + 1e-6)).all())


def test_zero_masks_are_checked():
    """A scale section whose zero-mask words do not match the flagged groups is refused, not decoded."""
    v = torch.tensor([0.0, 1.0, -2.0, 3.0] * 8)
    packed, side, _ = quantize_values(v, "int1", 16)
    assert side.numel() == 2 + 1 and bool((side[:2] < 0).all())  # both groups mixed: 32 bits in one word
    with pytest.raises(ValueError, match="zero mask"):
        dequantize_values(packed, side[:2], 32, "int1", 16)
    with pytest.raises(ValueError, match="zero mask"):
        dequantize_values(packed, torch.cat([side, side[2:]]), 32, "int1", 16)


@pytest.mark.parametrize("fmt", ["int4", "int2"])
def test_stochastic_rounding_is_unbiased(fmt):
    """E[decoded] = v. 200,000 draws of values between two codes: the mean of the decoded values is within
    5 standard errors of v (the standard error of one draw is at most half a step)."""
    gen = torch.Generator().manual_seed(1)
    n = 200_000
    step = 1.0  # absmax 7 (INT4, scale 1) or 1.5 (INT2, scale 1): one code step is the scale
    v = torch.full((n, ), 0.3 if fmt == "int4" else -0.2)
    v[::1000] = 7.0 if fmt == "int4" else 1.5  # one absmax per group of 1000: scale 1
    _, _, decoded = quantize_values(v, fmt, 1000, generator=gen)
    mask = torch.ones(n, dtype=torch.bool)
    mask[::1000] = False
    mean = float(decoded[mask].double().mean())
    stderr = (step / 2) / math.sqrt(int(mask.sum()))
    assert abs(mean - float(v[1])) < 5 * stderr, (mean, float(v[1]), stderr)
    # and it really is random: both neighbouring codes occur, and round-to-nearest would be biased
    assert len(set(decoded[mask].tolist())) == 2
    _, _, nearest = quantize_values(v, fmt, 1000)
    assert abs(float(nearest[mask].double().mean()) - float(v[1])) > 10 * stderr


def test_fp8_group_from_1e_minus_4_to_400():
    """A group spanning 1e-4..400: e5m2 neither overflows nor flushes the small values to zero; e4m3
    (2^-9..448 after scaling, a range of 2.3e5 < 4e6) cannot keep 1e-4 with one absmax scale and flushes it,
    which error feedback then carries to the next step instead of losing it."""
    v = torch.tensor([400.0, 1e-4, -2.5e-4, 3e-3, -1.0, 0.05])
    _, _, d = quantize_values(v, "fp8_e5m2", 6)
    assert bool(torch.isfinite(d).all()) and abs(float(d[0]) - 400) <= 400 * 2**-3
    assert bool((d[1:].abs() > 0).all())
    assert bool(((d - v).abs() <= v.abs() * 2**-2).all())
    _, _, d4 = quantize_values(v, "fp8_e4m3", 6)
    assert bool(torch.isfinite(d4).all()) and float(d4[1]) == 0.0
    residual = v - d4  # what error feedback keeps
    assert torch.allclose(d4 + residual, v)


@settings(max_examples=60, deadline=None)
@given(bits=st.sampled_from([1, 2, 4, 8]), n=st.integers(0, 300), seed=st.integers(0, 2**31 - 1))
def test_pack_bits_round_trip(bits, n, seed):
    codes = torch.randint(0, 1 << bits, (n, ), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.numel() == math.ceil(n * bits / 8)
    assert torch.equal(unpack_bits(packed, bits, n), codes)
    if bits == 4:
        assert torch.equal(packed, pack_nibbles(codes))


@pytest.mark.parametrize("m, g", [(0, 4), (1, 4), (127, 128), (1000, 128), (4097, 256)])
def test_one_segment_group_ids_match_the_general_path(m, g):
    fast, n_fast = int4_group_ids(torch.tensor([m]), g)
    general, n_general = int4_group_ids(torch.tensor([m, 0]), g)  # two segments: the general formula
    assert torch.equal(fast, general) and n_fast == n_general
