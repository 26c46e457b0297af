"""The quantized all-gather's weight codes (cpu_weights.cpp) against the reference.
"""


import pytest
import torch

from deepspeed_dgc.codec import formats
from deepspeed_dgc.codec.reference import REFERENCE

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
