"""compress_bucket against the PyTorch reference, end to end (cpu_compress.cpp, cpu_dense_pass.cpp): same payload
bytes, residual bits and kept counts. Random buckets of odd sizes: flat and hierarchical layouts, fp32/bf16/fp16
sources, loss scale 1 and 1024 (in the divisor), with and without residual, 1-3 owner rows; a NaN makes both send
nothing.
"""

import math
import zlib

import pytest
import torch

from deepspeed_dgc.codec.kernels import fused_can_code
from deepspeed_dgc.codec.reference import REFERENCE

from ..jobs import SIZES, assert_same, decode_row, make_job
from . import OTHER_FORMATS


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


@pytest.mark.parametrize("fmt", ["int4", "int2", "int1", "fp8_e4m3", "fp8_e5m2"])
def test_sparse_tensors_keeping_every_element_match(fused, fmt):
    """A bucket whose every tensor keeps all its elements though some are sparse (k >= m at a density near 1): the
    rows keep every real element, so they send no positions (the op allocates an FP8 or INT4 bucket's payloads
    before its dense pass only where no tensor is sparse)."""
    for numels, min_numel in (([24], 0), ([24, 5], 10), ([3000, 70], 0)):
        job = make_job(numels, 2, density=0.9999, min_numel=min_numel, value_format=fmt,
                       seed=int(torch.randint(0, 1 << 30, ())))
        assert all(k >= m for k, m in zip(job.targets(), job.real_totals()))
        ref = REFERENCE.compress(job)
        assert ref.kept == sum(numels)
        assert all(int(p[12:16].view(torch.int32)) == 0 for p in ref.payloads)  # the header's index bytes
        assert_same(ref, fused.compress(job))


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
