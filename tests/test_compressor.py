"""Compressor unit tests: threshold estimate, INT4 quantizer, index codec (random inputs, float64 references)."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from deepspeed_dgc.compressor import (LOWER_SLACK, UPPER_SLACK, decode_indices, dequantize_int4, dequantize_weights,
                                      encode_indices, int4_group_ids, int4_packed_bytes, quantize_int4, quantize_weights,
                                      select_topk, target_count)

SIZES = [1, 7, 1001, 4099]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("n", SIZES)
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


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(0, 1 << 33), max_size=40, unique=True), min_size=1, max_size=5))
def test_index_codec_property_round_trip(segments):
    segs = [sorted(s) for s in segments]
    counts = torch.tensor([len(s) for s in segs])
    pos = torch.tensor([p for s in segs for p in s], dtype=torch.long)
    data = encode_indices(pos, counts)
    assert data.dtype == torch.uint8
    assert torch.equal(decode_indices(data, counts), pos)


@pytest.mark.parametrize("n", SIZES)
def test_index_codec_exact_on_random_selection(n):
    x = torch.randn(n, generator=_gen(n))
    pos = select_topk(x, 0.1).nonzero().squeeze(1)
    data = encode_indices(pos, torch.tensor([pos.numel()]))
    assert torch.equal(decode_indices(data, torch.tensor([pos.numel()])), pos)


@pytest.mark.parametrize("density,max_bits", [(0.1, 8.0), (0.01, 12.0), (0.001, 16.0)])
def test_index_cost_well_under_32_bits(density, max_bits):
    n = 1 << 20
    x = torch.randn(n, generator=_gen(7))
    pos = select_topk(x, density, _gen(8)).nonzero().squeeze(1)
    bits = 8 * encode_indices(pos, torch.tensor([pos.numel()])).numel() / pos.numel()
    assert bits <= max_bits


def test_decode_rejects_truncated_bytes():
    pos = torch.tensor([5, 300, 70000])
    data = encode_indices(pos, torch.tensor([3]))
    with pytest.raises(ValueError):
        decode_indices(data[:-1], torch.tensor([3]))
    with pytest.raises(ValueError):
        decode_indices(data, torch.tensor([4]))
    with pytest.raises(ValueError, match="increasing"):
        encode_indices(torch.tensor([4, 2]), torch.tensor([2]))


def _heavy_tailed(n, seed):
    """Gaussian over a power of a uniform: a power-law tail, like real gradient magnitudes."""
    g = _gen(seed)
    return torch.randn(n, generator=g) / torch.rand(n, generator=g).clamp_min(1e-6)**0.8


@pytest.mark.parametrize("dist", ["normal", "heavy", "sparse_spikes"])
@pytest.mark.parametrize("n", [4099, 100_003, 1 << 20])
@pytest.mark.parametrize("density", [0.1, 0.01, 0.001])
def test_threshold_count_within_dgc_bounds(dist, n, density):
    seed = n + int(density * 1e4)
    if dist == "normal":
        x = torch.randn(n, generator=_gen(seed))
    elif dist == "heavy":
        x = _heavy_tailed(n, seed)
    else:  # mostly tiny noise plus rare spikes: the sample often misses the spikes
        x = torch.randn(n, generator=_gen(seed)) * 1e-3
        x[torch.randint(0, n, (max(1, n // 5000), ), generator=_gen(seed + 1))] = 100.0
    k = target_count(n, density)
    count = int(select_topk(x, density, _gen(seed + 2)).sum())
    assert LOWER_SLACK * k <= count <= UPPER_SLACK * k, (count, k)


def test_selection_keeps_largest_magnitudes():
    x = torch.randn(50_000, generator=_gen(3))
    mask = select_topk(x, 0.01, _gen(4))
    assert float(x[mask].abs().min()) >= float(x[~mask].abs().max())


def test_density_one_keeps_everything():
    x = torch.randn(999, generator=_gen(5))
    assert bool(select_topk(x, 1.0).all())
