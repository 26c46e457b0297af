"""The fixed layout (codec/fixed.py) in one process: sizes from the plan alone, DGC's threshold and the capacity cut
against a sort-based oracle, every format's values and exact zeros, conservation of error feedback against float64,
bad payloads flagged, the same bits with or without a workspace, and a fixed number of ops whatever the tensors."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepspeed_dgc.codec import fixed
from deepspeed_dgc.codec.formats import FORMATS, FP8_MAX, pack_codes, unpack_codes
from deepspeed_dgc.codec.layout import Workspace
from deepspeed_dgc.codec.reference import REFERENCE
from deepspeed_dgc.codec.selection import target_count

from .jobs import count_ops, make_job

FORMAT_NAMES = list(FORMATS)


def _seed():
    return int(torch.randint(0, 1 << 30, ()))


def _plan(sizes, rows, density, fmt="int4", quantize=True, gs=16, factor=2.0, min_numel=64, world=None):
    world = world or rows
    return fixed.FixedPlan.build(sizes, world, list(range(rows)), [n >= min_numel for n in sizes], density, quantize,
                                 fmt, gs, torch.float32, factor)


def _sources(sizes, g, zeros=0.0, ties=False):
    srcs = []
    for n in sizes:
        t = torch.randn(n, generator=g) * torch.exp(2 * torch.randn(n, generator=g))
        if ties:
            t[torch.rand(n, generator=g) < 0.4] = 0.5
        t[torch.rand(n, generator=g) < zeros] = 0.0
        srcs.append(t)
    return srcs


def _matrix(plan, srcs, dtype=torch.float32):
    L = plan.layout
    A = fixed.owner_matrix(L.rows, L.columns, "cpu", dtype)
    return L.gather(srcs, A)


@pytest.mark.parametrize("density", [1.0, 0.3, 0.05, 0.004])
@pytest.mark.parametrize("rows", [1, 3, 4])
def test_kept_counts_real_elements_and_slots_never_padding(rows, density):
    """The values a plan says one sender sends (the telemetry's density): each whole-sent tensor's elements, not its
    padding columns, and each sparsified slice's slots up to its real elements; so all of a bucket sent whole is its
    element count exactly (a density of 1, not above), and a sparse plan counts its slots."""
    g = torch.Generator().manual_seed(_seed())
    sizes = [int(n) for n in torch.randint(1, 20000, (6, ), generator=g)] + [1, 130]
    plan = _plan(sizes, rows, density)
    ceil = [-(-n // rows) for n in sizes]
    real = [[max(0, min(c, n - r * c)) for r in range(rows)] for n, c in zip(sizes, ceil)]
    slots = dict(zip(plan.sparse_tensors, plan.slots))
    expected = sum(sum(min(slots[i], x) for x in real[i]) if plan.sparse[i] else n for i, n in enumerate(sizes))
    assert plan.kept == expected <= sum(sizes)
    if density == 1.0:
        assert not any(plan.sparse) and plan.kept == sum(sizes) < plan.rows * plan.values  # the padding is not counted
    else:
        assert any(plan.sparse) and plan.kept < sum(sizes)


@pytest.mark.parametrize("density", [0.3, 0.05, 0.004, 0.0004])
@pytest.mark.parametrize("sizes", [[1], [3, 70, 1001], [5, 3000, 2, 65537, 64], [5000, 300, 70000]])
def test_payload_size_is_the_plans_whatever_the_data(sizes, density):
    """Every row's payload has plan.payload_bytes, for random data, all zeros, ties everywhere and Inf/NaN; a bucket
    with Inf or NaN says so in every header."""
    plan = _plan(sizes, 3, density)
    g = torch.Generator().manual_seed(_seed())
    for fill in (None, 0.0, 1.0, float("nan"), float("inf")):
        srcs = _sources(sizes, g)
        if fill is not None:
            for s in srcs:
                s.fill_(fill)
        payloads = fixed.encode(_matrix(plan, srcs), plan, 5, Workspace(), sample_generator=g)
        assert payloads.shape == (3, plan.payload_bytes) and plan.payload_bytes % 4 == 0
        flags = payloads[:, :fixed.HEADER_BYTES].contiguous().view(torch.int32)[:, 2]
        assert flags.tolist() == [int(fill is not None and not math.isfinite(fill))] * 3


def _oracle_threshold(mag, k, sample):
    """DGC's sampled threshold with its lowering rounds (fp32, one multiplication after the other), never 0."""
    s = sample.numel()
    t = torch.sort(sample, descending=True).values[min(max(1, math.ceil(s * k / mag.numel())), s) - 1]
    tiny = torch.tensor(1, dtype=torch.int32).view(torch.float32)
    for _ in range(11):
        if int((mag >= max(t, tiny)).sum()) >= 0.8 * k:
            break
        t = t * 0.8
    return max(t, tiny)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("density", [0.3, 0.01, 0.002])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("factor", [2.0, 1.0])
def test_each_slice_sends_its_largest_above_dgcs_threshold_up_to_capacity(rows, density, dtype, factor):
    """From the same sample, each owner's slice sends exactly the oracle's set: the elements at or above DGC's
    threshold (first estimate on the sample, lowered by 0.8 while it keeps fewer than 0.8 k), non-zero, the largest up
    to the slice's slots by magnitude in bf16 precision (the high 16 bits), ties by the lower column. Heavy tails, ties
    on 40% of one bucket, zeros on 90% of another. An fp32 owner matrix and a bf16 one (bf16 gradients; the oracle
    then sees the same bf16 values)."""
    g = torch.Generator().manual_seed(_seed())
    for sizes, kw in (([5000, 300, 70001, 20000, 40], {}), ([3000, 2500], {"ties": True}), ([4000], {"zeros": 0.9})):
        plan = _plan(sizes, rows, density, quantize=False, factor=factor)
        L = plan.layout
        srcs = [s.to(dtype).float() for s in _sources(sizes, g, **kw)]
        A = _matrix(plan, srcs, dtype)
        acc = A.to(torch.float32, copy=True)
        seed = _seed()
        positions, tensor = fixed.draw_sample(plan, torch.Generator().manual_seed(seed), "cpu")
        fixed.encode(A, plan, 1, Workspace(), sample_generator=torch.Generator().manual_seed(seed))
        for t, i in enumerate(plan.sparse_tensors):
            mag = srcs[i].abs()
            k = target_count(sizes[i], density)
            threshold = _oracle_threshold(mag, k, mag[positions[tensor == t]])
            for r in range(rows):
                real = L.real[r][i]
                a = acc[r, L.cols[i]:L.cols[i] + real]
                sent = A[r, L.cols[i]:L.cols[i] + real].float() != a  # raw fp32: a sent value leaves nothing behind
                eligible = (a != 0) & (a.abs() >= threshold)
                key = (a.abs().view(torch.int32) >> 16).long()  # bf16 precision, then the lower column
                order = torch.sort(torch.where(eligible, -key, 1 << 20), stable=True).indices
                want = torch.zeros(real, dtype=torch.bool)
                want[order[:min(plan.slots[t], int(eligible.sum()))]] = True
                assert torch.equal(sent, want), (sizes, r, i, int(sent.sum()), int(want.sum()), plan.slots[t])


def _exchange(plans_and_payloads, plan, rows):
    """Row r's owner decodes what every sender sent it."""
    return [fixed.decode_sum(torch.stack([p[r] for p in plans_and_payloads]), plan, 7, r, Workspace())
            for r in range(rows)]


@pytest.mark.parametrize("fmt", FORMAT_NAMES + ["none"])
@pytest.mark.parametrize("density", [1.0, 0.1, 0.003])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conservation_and_exact_zeros_over_senders(fmt, density, dtype):
    """3 senders, each row summed by its owner: decoded sum + the senders' new residuals = the float64 sum of their
    accumulators (error feedback loses nothing but the rounding of the residual to the owner matrix's dtype: fp32, or
    bf16 for bf16 gradients); every exact zero of every sender arrives as exactly 0."""
    sizes = [5, 3000, 2, 65537, 64]
    plan = _plan(sizes, 3, density, fmt if fmt != "none" else "int4", quantize=fmt != "none")
    g = torch.Generator().manual_seed(_seed())
    accs, residuals, payloads = [], [], []
    unit = 2**-24 if dtype == torch.float32 else 2**-8  # the dtype's unit roundoff
    for _ in range(3):
        A = _matrix(plan, _sources(sizes, g, zeros=0.2), dtype)
        accs.append(A.double().clone())
        payloads.append(fixed.encode(A, plan, 7, Workspace(), sample_generator=g))
        residuals.append(A.double())
    for r, (row, bad) in enumerate(_exchange(payloads, plan, 3)):
        assert not bool(bad.any())
        total = sum(a[r] for a in accs)
        kept = sum(x[r] for x in residuals)
        # fp32 rounding: of each residual and of the sum over senders (decoded values may exceed what was accumulated)
        magnitude = sum(a[r].abs() for a in accs) + sum(x[r].abs() for x in residuals) + row.double().abs()
        assert bool(((row.double() + kept - total).abs() <= 4 * unit * magnitude).all())
        zero = torch.stack([a[r] == 0 for a in accs]).all(dim=0)
        assert int(zero.sum()) > 10 and bool((row[zero] == 0).all()), "exact zeros must arrive as zeros"


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_values_within_each_formats_bound(fmt):
    """Dense rows of one sender, groups of 16 of which some mix zeros: |decoded - acc| per group within INT4 a/14,
    INT2 a/3 (a/2 in a group with zeros), INT1 sign times the mean non-zero magnitude, FP8 relative 2^-4 / 2^-3;
    zeros exactly 0."""
    plan = _plan([4096], 2, 1.0, fmt, gs=16)
    g = torch.Generator().manual_seed(_seed())
    src = torch.randn(4096, generator=g) * torch.exp(torch.randn(4096, generator=g))
    src[torch.rand(4096, generator=g) < 0.1] = 0.0
    A = _matrix(plan, [src])
    acc = A.double().clone()
    payloads = fixed.encode(A, plan, 7, Workspace())
    for r in range(2):
        row, _ = fixed.decode_sum(payloads[r:r + 1], plan, 7, r, Workspace())
        a, d = acc[r].view(-1, 16), row.double().view(-1, 16)
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
            mean = a.abs().sum(dim=1, keepdim=True) / (~zero).sum(dim=1, keepdim=True).clamp(min=1)
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


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_codes_pack_per_byte_and_back(fmt):
    """INT4 two codes a byte, INT2 four, INT1 five (ternary), FP8 one; unpacking gives them back."""
    f = FORMATS[fmt]
    top = {"int4": 16, "int2": 4, "int1": 3}.get(fmt, 256)
    codes = torch.randint(0, top, (2, 40 * f.per_byte), dtype=torch.uint8)
    packed = pack_codes(codes, fmt, torch.empty(2, 40, dtype=torch.uint8))
    assert torch.equal(unpack_codes(packed, fmt, torch.empty_like(codes)), codes)
    assert fixed.FixedPlan.build([23], 1, [0], [False], 1.0, True, fmt, 16, torch.float32).value_bytes == \
        -(-128 // f.per_byte)


def test_a_bad_payload_is_flagged_and_poisons_the_row():
    """Another fingerprint, a wrong magic or chunk counts past the capacity: the sender is flagged (a device tensor) and
    the row is NaN, so the step is skipped on every rank; an input with Inf poisons every owner's row the same way."""
    sizes = [3000, 70]
    plan = _plan(sizes, 2, 0.05)
    g = torch.Generator().manual_seed(_seed())
    payloads = [fixed.encode(_matrix(plan, _sources(sizes, g)), plan, 7, Workspace()) for _ in range(2)]
    received = torch.stack([p[0] for p in payloads])
    row, bad = fixed.decode_sum(received, plan, 7, 0, Workspace())
    assert bad.tolist() == [False, False] and bool(torch.isfinite(row).all())
    _, _, counts_at, _ = plan.sections
    for corrupt in ("fingerprint", "magic", "counts"):
        recv = received.clone()
        if corrupt == "fingerprint":
            recv[1, 4:8] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
        elif corrupt == "magic":
            recv[1, 0] ^= 0xFF
        else:  # the first chunk count claims more values than the slice's slots
            recv[1, counts_at:counts_at + 2] = torch.tensor([0xFF, 0x7F], dtype=torch.uint8)
        row, bad = fixed.decode_sum(recv, plan, 7, 0, Workspace())
        assert bad.tolist() == [False, True], corrupt
        assert bool(torch.isnan(row).all()), corrupt
    srcs = _sources(sizes, g)
    srcs[0][7] = float("inf")
    payloads[1] = fixed.encode(_matrix(plan, srcs), plan, 7, Workspace())
    for r in range(2):
        row, bad = fixed.decode_sum(torch.stack([p[r] for p in payloads]), plan, 7, r, Workspace())
        assert not bool(bad.any()) and bool(torch.isnan(row).all())


@pytest.mark.parametrize("value_format", ["int4", "fp8_e4m3", "fp8_e5m2", "raw"])
@pytest.mark.parametrize("density", [0.1, 0.01])
def test_without_a_cut_the_fixed_layout_keeps_what_the_exact_layout_keeps(value_format, density):
    """Where no slice reaches its capacity (factor 1 / density: slots for the whole slice) and from the same sample:
    where DGC's upper correction does not run in the exact layout, both layouts select and quantize the same values
    and their new residuals are equal bit for bit (INT4, FP8, raw values; with padding, tensors sent whole and
    thresholds that need the lowering rounds); where it runs, the fixed layout sends a superset of what the exact one
    sends (it does not cut to the k-th largest: the capacity bounds a slice instead). (INT2 and INT1 differ by design:
    the fixed layout codes a scale group holding zeros in three levels.)"""
    sizes, equal, first = [5000, 300, 70001, 20000, 40], 0, _seed()
    for seed in range(first, first + 8):
        job = make_job(sizes, 3, density=density, seed=seed, group_size=128,
                       value_format="int4" if value_format == "raw" else value_format)
        job.quantize = value_format != "raw"
        plan = fixed.FixedPlan.build(sizes, 3, [0, 1, 2], job.sparse, density, job.quantize, job.value_format, 128,
                                     torch.float32, 1.0 / density)
        positions, tensor = fixed.draw_sample(plan, torch.Generator().manual_seed(seed), "cpu")
        samples = iter([positions[tensor == t] for t in range(len(plan.sparse_tensors))])
        job.samples = [next(samples) if s else None for s in plan.sparse]
        job.sparse = list(plan.sparse)
        exact = REFERENCE.compress(job)
        L = plan.layout
        A = fixed.owner_matrix(L.rows, L.columns, "cpu")
        L.gather([s.float() / job.divisor for s in job.srcs], A)
        for i, res in enumerate(job.residuals):
            L.block(A, i)[:, :L.chunks[i]].add_(torch.nn.functional.pad(res, (0, 3 * L.chunks[i] - res.numel()))
                                                .view(3, -1))
        acc = A.clone()
        fixed.encode(A, plan, 1, Workspace(), sample_generator=torch.Generator().manual_seed(seed))
        for i, want in enumerate(exact.residuals):
            got = L.flat_of(A, i)
            if torch.equal(got.view(torch.int32), want.view(torch.int32)):
                equal += 1
                continue
            a = L.flat_of(acc, i)
            sent_exact, sent_fixed = want != a, got != a
            assert bool((sent_fixed | ~sent_exact).all()), (seed, i)  # every value the exact layout sent
    assert equal > 4 * len(sizes)


def test_the_same_bits_with_and_without_a_workspace():
    """A workspace holding the temporaries (the gradients' memory, in the engine) changes no bit of the payloads, the
    residuals or the decoded rows: none, one large enough for every stage in one pass, and a small one whose passes
    (the selection made slab by slab inside the compaction among them) take several slabs."""
    sizes = [5, 3000, 2, 65537, 64, 9000]
    plan = _plan(sizes, 3, 0.05, "int2")
    g = torch.Generator().manual_seed(_seed())
    srcs = _sources(sizes, g, zeros=0.1)
    outs = []
    for ws in (Workspace(), Workspace([torch.empty(10_000_000, dtype=torch.uint8)]),
               Workspace([torch.empty(60_000, dtype=torch.uint8)])):
        A = _matrix(plan, srcs)
        payloads = fixed.encode(A, plan, 7, ws, sample_generator=torch.Generator().manual_seed(3))
        row, _ = fixed.decode_sum(payloads, plan, 7, 1, ws)
        outs.append((payloads.clone(), A.clone(), row.clone()))
    for a, b, c in zip(*outs):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        assert torch.equal(a.view(torch.uint8), c.view(torch.uint8))


def test_a_region_added_inside_a_stage_is_dropped_at_its_release():
    """Memory added to a workspace inside a stage (a temporary of it, dead once read) is handed out until the stage's
    mark is released, and not after (it is live again there)."""
    ws = Workspace([torch.empty(256, dtype=torch.uint8)])
    outer = ws.mark()
    first = ws.take((64, ), torch.int32)  # the whole first region
    inner = ws.mark()
    spent = torch.empty(128, dtype=torch.uint8)
    ws.add(spent)
    got = ws.take((32, ), torch.int32)
    assert got.data_ptr() == spent.data_ptr()
    ws.release(inner)
    again = ws.take((32, ), torch.int32)  # no room in the first region, and spent's memory is not the workspace's
    assert again.data_ptr() != spent.data_ptr() and again.untyped_storage().data_ptr() != first.data_ptr()
    ws.release(outer)
    assert ws.take((64, ), torch.int32).data_ptr() == first.data_ptr()


@pytest.mark.parametrize("density,fmt", [(1.0, "int4"), (0.05, "int4"), (0.05, "int1"), (0.01, "fp8_e4m3")])
def test_a_bucket_is_a_fixed_number_of_ops_whatever_its_tensors(density, fmt):
    """Encoding and decoding a bucket of 8 tensors and one of 32 (the same shapes repeated) dispatch the same number
    of aten ops, none of which reads the device on the host."""
    counts = []
    for repeat in (2, 8):
        sizes = [5000, 300, 7001, 64] * repeat
        plan = _plan(sizes, 2, density, fmt)
        A = _matrix(plan, _sources(sizes, torch.Generator().manual_seed(1)))
        fixed.encode(A.clone(), plan, 7, Workspace(), sample_generator=torch.Generator().manual_seed(1))  # warm
        with count_ops() as ops:
            payloads = fixed.encode(A, plan, 7, Workspace(), sample_generator=torch.Generator().manual_seed(1))
            fixed.decode_sum(payloads, plan, 7, 0, Workspace())
        assert ops.syncs == 0, ops.sync_names
        counts.append(ops.launches)
    assert counts[0] == counts[1], counts


def test_the_owner_matrix_is_bf16_only_for_bf16_gradients_whose_residuals_keep_no_more():
    """A bucket of bf16 gradients gets a bf16 owner matrix (2 B per element, not 4) where its residuals are stored in
    bf16, fp8 or int8, or not kept; fp32 residual storage, fp32 or mixed gradients keep fp32."""
    b, f = torch.zeros(3, dtype=torch.bfloat16), torch.zeros(3)
    for storage in ("fp8", "int8", "bf16", None):
        assert fixed.matrix_dtype([b, b], storage) == torch.bfloat16
    assert fixed.matrix_dtype([b, b], "fp32") == torch.float32
    assert fixed.matrix_dtype([b, f], "fp8") == torch.float32
    assert fixed.matrix_dtype([f], "fp8") == torch.float32
