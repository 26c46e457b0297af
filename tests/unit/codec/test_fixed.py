"""The fixed layout (codec/fixed.py) in one process: sizes from the plan alone, chunked top-k against a float64
oracle, every format's values and exact zeros, conservation of error feedback, bad payloads flagged, not read back."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepspeed_dgc.codec import fixed
from deepspeed_dgc.codec.formats import FP8_MAX, VALUE_BITS
from deepspeed_dgc.codec.reference import REFERENCE
from deepspeed_dgc.codec.selection import topk_threshold

from .jobs import SIZES, acc64, make_job

FORMATS = list(VALUE_BITS)


def _seed():
    return int(torch.randint(0, 1 << 30, ()))


def _exchange(jobs):
    """What row r's owner receives from every sender (jobs[s] is sender s's job): ``(W, P)`` per row."""
    outs = [REFERENCE.compress_fixed(job) for job in jobs]
    rows = jobs[0].rows
    return outs, [torch.stack([o.payloads[r] for o in outs]) for r in range(rows)]


@pytest.mark.parametrize("density", [0.3, 0.05, 0.004, 0.0004])
@pytest.mark.parametrize("sizes", SIZES + [[5000, 300, 70000]])
def test_payload_size_is_the_plans_whatever_the_data(sizes, density):
    """Every row's payload has plan.payload_bytes, for random data, all zeros, ties everywhere and Inf/NaN."""
    job = make_job(sizes, 3, density=density, seed=_seed(), min_numel=64)
    plan = job.fixed_plan()
    for fill in (None, 0.0, 1.0, float("nan"), float("inf")):
        if fill is not None:
            for s in job.srcs:
                s.fill_(fill)
        out = REFERENCE.compress_fixed(job)
        assert out.payloads.shape == (3, plan.payload_bytes) and plan.payload_bytes % 4 == 0
        assert out.kept == 3 * plan.values


@pytest.mark.parametrize("case", ["heavy", "tiny", "zeros", "overestimate", "padded"])
def test_threshold_is_the_exact_layouts_bit_for_bit(case):
    """threshold_on_device equals the exact layout's topk_threshold (DGC's rounds run one by one in fp32, then the
    k-th largest above 1.3 k) bit for bit: heavy-tailed data; a sample that overestimates (most values tiny: the
    lowering rounds run); all zeros; a sample that underestimates (its largest values removed: the upper
    correction runs); and a tensor followed by padding zeros (m is the real count). Each case checks that its
    correction really ran."""
    g = torch.Generator().manual_seed(_seed())
    m, k = 50000, 700
    rounds = upper = 0
    for _ in range(20):
        mag = (torch.randn(m, generator=g) ** 3).abs()
        sample = torch.randint(0, m, (500, ), generator=g)
        if case == "tiny":
            mag[torch.rand(m, generator=g) < 0.97] *= 1e-3
        if case == "zeros":
            mag.zero_()
        if case == "overestimate":  # the sample holds the small values only
            sample = torch.argsort(mag)[torch.randint(0, m // 2, (500, ), generator=g)]
        padded = torch.cat([mag, torch.zeros(m // 2)]) if case == "padded" else mag
        got = fixed.threshold_on_device(padded, k, sample, m)
        want = topk_threshold(mag, k, sample)
        assert got.dtype == want.dtype == torch.float32
        assert torch.equal(got, want), (case, float(got), float(want))
        t0 = torch.topk(mag[sample], math.ceil(500 * k / m)).values.min()
        rounds += bool(t0 > want) and float(want) != float(torch.topk(mag, k).values.min())
        upper += float(want) == float(torch.topk(mag, k).values.min()) and bool(t0 != want)
    if case == "tiny":
        assert rounds > 0
    if case == "overestimate":
        assert upper > 0


@pytest.mark.parametrize("density", [0.3, 0.02, 0.001])
def test_rows_send_their_largest_up_to_capacity(density):
    """Each owner row sends, of each sparsified tensor, a top set of its own magnitudes (every value sent is at
    least every value kept back, ties by the lower column), at most ceil(1.3 density c) of them, exactly (raw
    values); over the rows at least min(capacity, 0.8 k) (DGC's lowering rounds). A quarter of the values are 0
    and a quarter share one value (ties)."""
    numels = [70000, 9000, 300]
    job = make_job(numels, 2, density=density, seed=_seed(), min_numel=64, residual=False)
    job.quantize = False
    g = torch.Generator().manual_seed(_seed())
    for src in job.srcs:
        r = torch.rand(src.numel(), generator=g)
        src[r < 0.25] = 0.0
        src[(r >= 0.25) & (r < 0.5)] = 0.75
    job.samples = [None] * len(numels)  # the whole tensor is the sample: k is met exactly
    acc = acc64(job)
    out = REFERENCE.compress_fixed(job)
    for i, (c, s) in enumerate(zip(job.chunks, job.sparse)):
        assert s
    total = [0] * len(numels)
    for r in range(2):
        row, bad = REFERENCE.decode_sum_fixed(out.payloads[r:r + 1], job)  # one sender: this job
        assert not bool(bad.any())
        col = 0
        for i, c in enumerate(job.chunks):
            a, got = acc[r, col:col + c], row[col:col + c].double()
            col += c
            sent = got != 0
            assert torch.equal(got[sent], a[sent])  # raw values arrive exactly
            assert int(sent.sum()) <= fixed.capacity(c, density, 2.0)
            held = (~sent) & (a != 0)
            if bool(sent.any()) and bool(held.any()):
                assert float(a[held].abs().max()) <= float(a[sent].abs().min())
            total[i] += int(sent.sum())
    for i, c in enumerate(job.chunks):
        k = job.targets()[i]
        assert total[i] >= min(fixed.capacity(c, density, 2.0), math.floor(0.8 * k)), (i, total[i], k)


@pytest.mark.parametrize("fmt", FORMATS + ["none"])
@pytest.mark.parametrize("density", [1.0, 0.1, 0.003])
def test_conservation_and_format_bounds_over_senders(fmt, density):
    """3 senders, each row summed by its owner: decoded sum + the senders' new residuals = the float64 sum of their
    accumulators (error feedback loses nothing); each decoded value is within its format's bound of what was
    selected; every exact zero arrives as exactly 0."""
    seed = _seed()
    jobs = [make_job([5, 3000, 2, 65537, 64], 3, density=density, seed=seed + s, group_size=16,
                     value_format=fmt if fmt != "none" else "int4") for s in range(3)]
    g = torch.Generator().manual_seed(seed)
    for job in jobs:
        job.quantize = fmt != "none"
        for s, res in zip(job.srcs, job.residuals):  # exact zeros (gradient and residual) in mixed groups
            zero = torch.rand(s.numel(), generator=g) < 0.2
            s[zero], res[zero] = 0.0, 0.0
    outs, received = _exchange(jobs)
    accs = [acc64(job) for job in jobs]
    for r in range(3):
        row, bad = REFERENCE.decode_sum_fixed(received[r], jobs[0])
        assert not bool(bad.any())
        total = sum(a[r] for a in accs)
        residual = torch.zeros_like(total)
        col = 0
        for i, c in enumerate(jobs[0].chunks):
            n = jobs[0].numels[i]
            for o in outs:
                flat = o.residuals[i].double()
                real = max(0, min(c, n - r * c))
                residual[col:col + real] += flat[r * c:r * c + real]
            col += c
        assert torch.allclose(row.double() + residual, total, rtol=1e-6, atol=1e-6 * float(total.abs().max()))
        zero_everywhere = torch.stack([a[r] == 0 for a in accs]).all(dim=0)
        assert int(zero_everywhere.sum()) > 10
        assert bool((row[zero_everywhere] == 0).all()), "exact zeros must arrive as zeros"


@pytest.mark.parametrize("fmt", FORMATS)
def test_values_within_each_formats_bound(fmt):
    """Dense rows of one sender, groups of 16 of which some mix zeros: |decoded - acc| per group within INT4 a/14,
    INT2 a/3 (a/2 in a group with zeros), INT1 sign times the mean non-zero magnitude, FP8 relative 2^-4 / 2^-3;
    zeros exactly 0."""
    job = make_job([4096], 2, density=1.0, seed=_seed(), group_size=16, value_format=fmt, min_numel=1 << 30,
                   residual=False)
    g = torch.Generator().manual_seed(_seed())
    job.srcs[0][torch.rand(4096, generator=g) < 0.1] = 0.0
    acc = acc64(job)
    out = REFERENCE.compress_fixed(job)
    for r in range(2):
        row, _ = REFERENCE.decode_sum_fixed(out.payloads[r:r + 1], job)
        a = acc[r].view(-1, 16)
        d = row.double().view(-1, 16)
        amax = a.abs().amax(dim=1, keepdim=True)
        zero = a == 0
        assert bool((d[zero] == 0).all())
        err = (d - a).abs()
        if fmt == "int4":
            assert bool((err <= amax / 14 * (1 + 1e-6) + 1e-12).all())
        elif fmt == "int2":
            mixed = zero.any(dim=1, keepdim=True)
            assert bool((err <= torch.where(mixed, amax / 2, amax / 3) * (1 + 1e-6) + 1e-12).all())
        elif fmt == "int1":
            nz = (~zero).sum(dim=1, keepdim=True).clamp(min=1)
            mean = a.abs().sum(dim=1, keepdim=True) / nz
            assert torch.allclose(d, torch.sign(a) * mean, rtol=1e-6, atol=0)
        else:
            rel = 2.0**-4 if fmt == "fp8_e4m3" else 2.0**-3
            tiny = amax / FP8_MAX[fmt] * (2.0**-6 if fmt == "fp8_e4m3" else 2.0**-14)
            assert bool((err <= rel * a.abs() + tiny).all())


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 40), st.sampled_from([8, 12, 16]), st.integers(1, 3))
def test_positions_round_trip(n, bits, rows):
    g = torch.Generator().manual_seed(n * 7 + bits)
    pos = torch.randint(0, 1 << bits, (rows, n), generator=g)
    packed = fixed.pack_positions(pos, bits)
    assert packed.shape == (rows, math.ceil(n * bits / 8))
    assert torch.equal(fixed.unpack_positions(packed, n, bits), pos)


def test_ternary_codes_take_five_per_byte():
    plan = fixed.FixedPlan.build([23], [False], 1.0, True, "int1", 16, torch.float32)
    codes = torch.randint(0, 3, (2, 23), dtype=torch.uint8)
    packed = fixed.pack_rows(codes, plan)
    assert packed.shape == (2, 5) and plan.value_bytes == 5
    assert torch.equal(fixed.unpack_rows(packed, plan), codes)


def test_a_bad_payload_is_flagged_and_poisons_the_row():
    """Another fingerprint, a wrong magic or chunk counts past the capacity: the sender is flagged (a device tensor) and
    the row is NaN, so the step is skipped on every rank; an input with Inf poisons every owner's row the same way."""
    jobs = [make_job([3000, 70], 2, density=0.05, seed=_seed() + s) for s in range(2)]
    plan = jobs[0].fixed_plan()
    _, received = _exchange(jobs)
    row, bad = REFERENCE.decode_sum_fixed(received[0], jobs[0])
    assert bad.tolist() == [False, False] and bool(torch.isfinite(row).all())
    for corrupt in ("fingerprint", "magic", "position"):
        recv = received[0].clone()
        if corrupt == "fingerprint":
            recv[1, 4:8] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
        elif corrupt == "magic":
            recv[1, 0] ^= 0xFF
        else:  # the first chunk count of tensor 0 claims more values than the row's capacity
            at = fixed.HEADER_BYTES + 4 * plan.n_groups + plan.value_bytes
            recv[1, at:at + 2] = torch.tensor([0xFF, 0x7F], dtype=torch.uint8)
        row, bad = REFERENCE.decode_sum_fixed(recv, jobs[0])
        assert bad.tolist() == [False, True], corrupt
        assert bool(torch.isnan(row).all()), corrupt
    jobs[1].srcs[0][7] = float("inf")
    _, received = _exchange(jobs)
    for r in range(2):
        row, bad = REFERENCE.decode_sum_fixed(received[r], jobs[0])
        assert not bool(bad.any()) and bool(torch.isnan(row).all())


@pytest.mark.parametrize("value_format", ["int4", "fp8_e4m3", "fp8_e5m2", "raw"])
@pytest.mark.parametrize("density", [0.1, 0.01])
def test_without_a_cut_the_fixed_layout_sends_what_the_exact_layout_sends(value_format, density):
    """Where no owner row reaches its capacity (factor 1 / density: a capacity of the whole slice), the fixed
    layout selects and quantizes exactly what the exact layout does: the new residuals (accumulator minus what
    was sent) are equal bit for bit, for INT4, FP8 and raw values, over buckets with padding, tensors sent whole
    and thresholds that need either of DGC's corrections. (INT2 and INT1 differ by design: the fixed layout codes a
    scale group holding zeros in three levels.)"""
    first = _seed()
    for seed in range(first, first + 6):
        job = make_job([5000, 300, 70001, 20000, 40], 3, density=density, seed=seed, group_size=128,
                       value_format="int4" if value_format == "raw" else value_format)
        job.quantize = value_format != "raw"
        job.capacity_factor = 1.0 / density
        exact, fixed_out = REFERENCE.compress(job), REFERENCE.compress_fixed(job)
        for a, b in zip(exact.residuals, fixed_out.residuals):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), (seed, value_format)
