"""Rows sent whole (cpu_compress.cpp's send_whole_rows, cpu_decode.cpp's implied positions) against the reference:
the same decision per row, payload bytes, residual bits and kept counts, and the same sums decoded, where ties keep
everything, where the density is high, where one row of a bucket goes whole and the others do not, and where the rule
does not apply (the bytes the op wrote before it)."""

import zlib

import pytest
import torch

from deepspeed_dgc.codec import wire
from deepspeed_dgc.codec.reference import REFERENCE

from ..jobs import acc64, assert_same, make_job
from ..test_whole_rows import equal_cost_job

FORMATS = ["int4", "int2", "int1", "fp8_e4m3", "fp8_e5m2"]


def _seed():
    return int(torch.randint(0, 1 << 30, ()))


def _whole_rows(out, job):
    """Per row: whether its payload was sent whole (no index bytes, every real element kept)."""
    bodies = [(wire.parse(p, 0, job.row_layout(r)), job.row_layout(r)) for r, p in enumerate(out.payloads)]
    return [body.index_bytes.numel() == 0 and body.kept == sum(layout.seg_real) for body, layout in bodies]


def _same_sums(fused, job, out):
    """Every row's payload decoded by the op and by the reference into the same random start: the same bits."""
    for row, payload in enumerate(out.payloads):
        layout = job.row_layout(row)
        start = torch.randn(layout.row_numel, generator=torch.Generator().manual_seed(row))
        sums = [wire.decode_sum([payload], layout, ops.decode_add, start.clone()) for ops in (REFERENCE, fused)]
        assert torch.equal(sums[0].view(torch.int32), sums[1].view(torch.int32))


@pytest.mark.parametrize("fmt", FORMATS)
def test_all_equal_gradient_goes_whole_as_the_reference(fused, fmt):
    """An all-equal gradient at density 0.01 (ties keep everything), alone and in a bucket with a tensor sent whole
    and a random sparse one: the op sends the rows the reference sends (no positions), byte for byte, with the same
    residual bits; INT4 in groups of 128 costs about 0.133 of the fp32 bytes."""
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    value = float(torch.randn((), generator=g))
    job = make_job([100_003], 2, density=0.01, value_format=fmt, group_size=128, seed=seed)
    job.srcs[0].fill_(value)
    job.residuals[0].zero_()
    ref = REFERENCE.compress(job)
    assert _whole_rows(ref, job) == [True, True]
    assert_same(ref, fused.compress(job))
    _same_sums(fused, job, ref)
    if fmt == "int4":
        assert sum(p.numel() for p in ref.payloads) / (4 * 100_003) < 0.134
    mixed = make_job([3, 60_000, 40, 7_001], 3, density=0.01, value_format=fmt, seed=seed, min_numel=50)
    mixed.srcs[1].fill_(value)  # ties keep all of tensor 1 (a position byte each), tensor 3 about 1%: rows go whole
    mixed.residuals[1].zero_()
    ref = REFERENCE.compress(mixed)
    assert all(_whole_rows(ref, mixed))
    assert_same(ref, fused.compress(mixed))
    _same_sums(fused, mixed, ref)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("hierarchical", [False, True])
def test_high_density_goes_whole_as_the_reference(fused, fmt, hierarchical):
    """Density 0.5 to 0.9 (top-k) on fp32 and bf16 sources, with and without residual, some rows sent whole
    (the op collects their sparse tensors' elements again): the reference's bytes, residual bits and sums."""
    seed = _seed()
    for density, dtype, residual in ((0.9, torch.float32, True), (0.6, torch.bfloat16, False),
                                     (0.5, torch.float32, True)):
        job = make_job([5, 3000, 2, 65537, 64], 3, hierarchical=hierarchical, dtype=dtype, residual=residual,
                       density=density, value_format=fmt, seed=seed, min_numel=0)
        ref = REFERENCE.compress(job)
        assert_same(ref, fused.compress(job))
        _same_sums(fused, job, ref)
        if density == 0.9:
            assert all(_whole_rows(ref, job))


@pytest.mark.parametrize("fmt", ["int4", "int2", "fp8_e4m3"])
def test_one_row_goes_whole_the_other_not(fused, fmt):
    """A fixed threshold that keeps about 90% of row 0 and 1% of row 1 (of a tensor of 650K elements per row: the
    op collects row 0 again in several tasks): row 0 goes whole, row 1 stays sparse with its positions, as in the
    reference; row 0's residual is its quantization error only."""
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    n = 1_300_000
    job = make_job([n, 70], 2, density=0.01, value_format=fmt, seed=seed, min_numel=100, dtype=torch.bfloat16)
    src = torch.randn(n, generator=g)
    src[:n // 2] *= 100.0
    job.srcs[0].copy_(src)
    job.threshold = 8.0
    ref = REFERENCE.compress(job)
    assert _whole_rows(ref, job) == [True, False]
    out = fused.compress(job)
    assert_same(ref, out)
    _same_sums(fused, job, ref)
    sent = torch.zeros(sum(job.chunks))
    wire.decode_sum([out.payloads[0]], job.row_layout(0), fused.decode_add, sent)
    a = acc64(job)[0, :n // 2]
    torch.testing.assert_close(out.residuals[0][:n // 2].double(), a - sent[:n // 2].double(), rtol=0, atol=1e-3)


@pytest.mark.parametrize("fmt", ["int4", "fp8_e4m3", "int1"])
def test_decision_at_the_boundary_as_the_reference(fused, fmt):
    """Fixed thresholds swept through the density where sparse and whole cost about the same: every row, sent whole
    or not, is the reference's (one cost formula in both)."""
    seed = _seed()
    job = make_job([9_000, 40, 3_001], 2, density=0.5, value_format=fmt, seed=seed, min_numel=50)
    g = torch.Generator().manual_seed(seed)
    for src in job.srcs:
        src.copy_(torch.randn(src.numel(), generator=g))
    mags = acc64(job)[:, :job.chunks[0]].abs().flatten()
    outcomes = set()
    lo, hi = {"int4": (0.3, 0.6), "fp8_e4m3": (0.4, 0.7), "int1": (0.2, 0.45)}[fmt]
    for density in torch.linspace(lo, hi, 13).tolist():
        job.threshold = float(torch.quantile(mags, 1 - density).float())
        ref = REFERENCE.compress(job)
        outcomes.update(_whole_rows(ref, job))
        assert_same(ref, fused.compress(job))
    assert outcomes == {False, True}


def test_old_form_decodes_as_the_new(fused):
    """A whole row's payload, and the same values with a zero varint gap for every element of the sparse tensors (the
    form encoders wrote before): the op adds the same bits as the reference for both."""
    job = make_job([4000, 30, 3001], 2, density=0.9, seed=_seed(), min_numel=50)
    for row, payload in enumerate(fused.compress(job).payloads):
        layout = job.row_layout(row)
        body = wire.parse(payload, 0, layout)
        assert body.index_bytes.numel() == 0 and body.kept == sum(layout.seg_real)
        n_sparse = sum(r for r, s in zip(layout.seg_real, layout.sparse) if s)
        gaps = [0] * n_sparse
        gaps[layout.seg_real[0]] = layout.chunks[0] - layout.seg_real[0] + layout.chunks[1]  # to tensor 2's first
        assert max(gaps) < 128
        old = wire.pack(job.fingerprint, body.kept, body.scales, body.values, torch.tensor(gaps, dtype=torch.uint8))
        sums = [wire.decode_sum([p], layout, ops.decode_add) for p in (payload, old) for ops in (REFERENCE, fused)]
        assert all(torch.equal(sums[0], s) for s in sums[1:])


def test_sparse_rows_keep_their_bytes(fused):
    """Density 0.01: the bytes the op wrote before rows could go whole (CRC-32s saved from that code)."""
    saved = {(0, "int4"): [227651950, 3438060604], (2, "fp8_e4m3"): [3855899311, 3103998276, 3766050008]}
    for (seed, fmt), crcs in saved.items():
        job = make_job([5, 3000, 2, 65537, 64][:3 + seed], 2 + seed // 2, density=0.01, seed=seed, value_format=fmt)
        assert [zlib.crc32(p.numpy().tobytes()) for p in fused.compress(job).payloads] == crcs


def test_equal_cost_goes_whole_as_the_reference(fused):
    """The row whose sparse payload costs exactly what it costs whole goes whole in the op too (sparse >= whole),
    the one a byte cheaper stays sparse."""
    job = equal_cost_job()
    ref = REFERENCE.compress(job)
    assert _whole_rows(ref, job) == [True, False]
    assert_same(ref, fused.compress(job))
    _same_sums(fused, job, ref)
