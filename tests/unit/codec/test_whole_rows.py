"""Rows sent whole in the exact layout (wire.RowLayout.sends_whole): a row whose sparse payload would not be smaller
than the row sent whole keeps every real element and sends no positions (the header's index bytes 0), and a payload
keeping every real element never sends positions. Checked on the reference encoder against a float64 oracle and an
independent count of what each form costs; rows the rule leaves alone keep the bytes they had before it (the fused
CPU op's bytes: kernels/test_whole_rows_fused.py)."""

import math
import zlib

import pytest
import torch

from deepspeed_dgc.codec import wire
from deepspeed_dgc.codec.formats import VALUE_BITS, quantize_values
from deepspeed_dgc.codec.reference import REFERENCE

from .jobs import acc64, decode_row, make_job
from .kernels import _leb

# error of a decoded value in units of the absmax of its tensor's row (INT4/INT2: half a step; INT1: the group's
# mean magnitude with the value's sign), and FP8 e4m3's relative error
BOUND = {"int4": 1 / 14, "int2": 1 / 3, "int1": 1.0}
E4M3_REL = 2.0**-4


def _seed():
    return int(torch.randint(0, 1 << 30, ()))


def _header(payload):
    """``(magic, fingerprint, kept, index bytes, scale words)``."""
    return payload[:wire.HEADER_BYTES].view(torch.int32).tolist()


def _leb_all(gaps):
    """LEB128 varint bytes of non-negative ints, one after the other."""
    return [b for g in gaps for b in _leb(g)]


def _cost(job, counts, index_bytes):
    """Bytes of scales, values and positions counted from the wire format's definition (module docstring of wire):
    4 per scale group (groups restart at each tensor), the packed codes (or raw values), the index bytes."""
    if job.quantize:
        groups = sum(-(-n // job.group_size) for n in counts)
        return 4 * groups + -(-sum(counts) * VALUE_BITS[job.value_format] // 8) + index_bytes
    return torch.empty(0, dtype=job.value_dtype).element_size() * sum(counts) + index_bytes


def _whole_size(job, row):
    """Bytes of row ``row``'s payload sent whole (INT4/FP8 or raw: no zero bitmap), header and padding included."""
    size = wire.HEADER_BYTES + _cost(job, job.row_layout(row).seg_real, 0)
    return size + -size % 4


def _selection(job, row, threshold):
    """What a fixed ``threshold`` keeps of row ``row`` in float64 (every real element of tensors sent whole):
    per-tensor counts and the sparse tensors' index bytes (varint gaps or bitmap)."""
    acc = acc64(job)[row]
    layout = job.row_layout(row)
    counts, cols, col, n_bitmap = [], [], 0, 0
    for c, real, sparse in zip(job.chunks, layout.seg_real, job.sparse):
        if sparse:
            kept = (acc[col:col + real].abs() >= threshold).nonzero().view(-1) + col
            cols += kept.tolist()
            counts.append(kept.numel())
            n_bitmap += real
        else:
            counts.append(real)
        col += c
    if job.index_coding == "bitmap":
        return counts, -(-n_bitmap // 8)
    gaps = [p - q - 1 for p, q in zip(cols, [-1] + cols[:-1])]
    return counts, len(_leb_all(gaps))


def _check_decodes(job, out):
    """Every row decodes to the float64 accumulator within the format's bound (:data:`BOUND`, in units of the absmax
    of the tensor's row, which bounds its groups' absmax; FP8 relative) and the residual is accumulator - decoded.
    Returns the decoded rows (float64)."""
    acc = acc64(job)
    rows = []
    for row, payload in enumerate(out.payloads):
        decoded, body = decode_row(REFERENCE, job, row, payload)
        decoded = decoded.double()
        col = 0
        for i, c in enumerate(job.chunks):
            a, d = acc[row, col:col + c], decoded[col:col + c]
            kept = d != 0
            absmax = float(a.abs().max()) if c else 0.0
            if job.value_format == "fp8_e4m3":
                assert bool(((d - a).abs() <= E4M3_REL * a.abs() + absmax / 448 * 2.0**-9).all())
            elif bool(kept.any()):
                assert float((d - a)[kept].abs().max()) <= BOUND[job.value_format] * absmax * (1 + 1e-5)
            res = torch.nn.functional.pad(out.residuals[i].double(), (0, job.rows * c - out.residuals[i].numel()))
            torch.testing.assert_close(res.view(job.rows, c)[row], a - d, rtol=0,
                                       atol=1e-6 * max(1.0, float(a.abs().max())))
            col += c
        rows.append(decoded)
    return rows


def test_all_equal_gradient_at_density_001_costs_what_dense_int4_does():
    """An all-equal gradient at density 0.01 in INT4, groups of 128: the ties keep every element, so the payload
    carries no positions (index bytes 0) and is the size of the row sent whole, byte for byte the payload of the same
    tensor not sparsified: about 0.133 of the fp32 bytes (it was 0.383 with a position byte per element). It decodes
    to the gradient within INT4's half step, and the residual is only the quantization error."""
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(50_000, 200_000, (), generator=g))
    value = float(torch.randn((), generator=g)) * 10.0**int(torch.randint(-3, 3, (), generator=g))
    job = make_job([n], 2, density=0.01, group_size=128, seed=seed)
    dense = make_job([n], 2, density=0.01, group_size=128, seed=seed, min_numel=n + 1)
    for j in (job, dense):
        j.srcs[0].fill_(value)
        j.residuals[0].zero_()
    out = REFERENCE.compress(job)
    assert job.sparse == [True] and dense.sparse == [False]
    for row, (payload, want) in enumerate(zip(out.payloads, REFERENCE.compress(dense).payloads)):
        real = job.row_layout(row).seg_real[0]
        _, _, kept, index_bytes, scale_words = _header(payload)
        assert (kept, index_bytes, scale_words) == (real, 0, -(-real // 128))
        assert payload.numel() == _whole_size(job, row)
        assert torch.equal(payload, want)
        assert payload.numel() / (4 * real) < 0.134
    assert out.kept == n
    rows = _check_decodes(job, out)
    total, want = float(sum(r.sum() for r in rows)), n * value / 2  # (divided by the 2 ranks)
    assert abs(total - want) <= n * abs(value / 2) / 14


@pytest.mark.parametrize("fmt", ["int4", "int2", "int1", "fp8_e4m3"])
def test_high_density_row_goes_whole(fmt):
    """Density 0.9 with varint positions: the sparse payload (a position byte for most values) would be larger than
    the row sent whole, so every row goes whole beside a tensor sent whole and small ones (groups restart at each
    tensor): no positions, every real element kept, the bytes of the same bucket with no tensor sparsified."""
    seed = _seed()
    numels = [5, 20_000, 300, 3]
    job = make_job(numels, 3, density=0.9, value_format=fmt, seed=seed, min_numel=10)
    dense = make_job(numels, 3, density=0.9, value_format=fmt, seed=seed, min_numel=10**9)
    assert job.sparse == [False, True, True, False]
    out, want = REFERENCE.compress(job), REFERENCE.compress(dense)
    for row, payload in enumerate(out.payloads):
        _, _, kept, index_bytes, _ = _header(payload)
        assert (kept, index_bytes) == (sum(job.row_layout(row).seg_real), 0)
    assert out.kept == sum(numels)
    for a, b in zip(out.payloads, want.payloads):
        assert torch.equal(a, b)
    for a, b in zip(out.residuals, want.residuals):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    _check_decodes(job, out)


@pytest.mark.parametrize("fmt,coding,densities", [
    ("int4", "varint", (0.3, 0.6)), ("fp8_e4m3", "varint", (0.4, 0.7)), ("int4", "bitmap", (0.7, 0.95)),
    ("raw", "varint", (0.65, 0.95))])
def test_rows_go_whole_exactly_when_sparse_is_not_smaller(fmt, coding, densities):
    """Fixed thresholds swept across the density where a row's sparse payload and the row sent whole cost the same:
    each row goes whole exactly when its sparse scales, values and positions (counted here from the float64
    accumulator) are not fewer bytes than the whole row's scales and values. A row that stays sparse has the kept
    count and index bytes of its selection."""
    seed = _seed()
    job = make_job([9_000, 40, 3_001], 2, residual=False, density=0.5, value_format="int4" if fmt == "raw" else fmt,
                   index_coding=coding, seed=seed, min_numel=50)
    if fmt == "raw":
        job.quantize, job.value_dtype = False, torch.float16
    assert job.sparse == [True, False, True] and job.divisor == 2  # acc = src / 2: exact in fp32
    g = torch.Generator().manual_seed(seed)
    for src in job.srcs:  # one scale for all: the density of a row is about that of its largest tensor
        src.copy_(torch.randn(src.numel(), generator=g))
    mags = acc64(job)[:, :job.chunks[0]].abs().flatten()
    outcomes = set()
    for density in torch.linspace(densities[0], densities[1], 11).tolist():
        job.threshold = float(torch.quantile(mags, 1 - density).float())
        out = REFERENCE.compress(job)
        for row, payload in enumerate(out.payloads):
            counts, index_bytes = _selection(job, row, job.threshold)
            real = job.row_layout(row).seg_real
            whole = _cost(job, counts, index_bytes) >= _cost(job, real, 0)
            outcomes.add(whole)
            _, _, kept, got_index, _ = _header(payload)
            if whole:
                assert (kept, got_index, payload.numel()) == (sum(real), 0, _whole_size(job, row))
            else:
                assert (kept, got_index) == (sum(counts), index_bytes)
    assert outcomes == {False, True}


def test_normal_sparse_row_is_unchanged():
    """Density 0.01, random normal: rows stay sparse, with positions, and their payload is built from its parts
    here (header, scales and codes of the kept values, varint gaps, padding) byte for byte; the kept count is within
    DGC's [0.8 k, 1.3 k] with top-k. The payloads of fixed seeds are the bytes the encoder wrote before rows could go
    whole (CRC-32s saved from that code)."""
    seed = _seed()
    job = make_job([30_000, 70], 2, density=0.01, seed=seed, min_numel=100, group_size=16)
    out = REFERENCE.compress(job)
    k = job.targets()[0]
    assert 0.8 * k <= out.kept - 70 <= 1.3 * k
    for payload in out.payloads:
        assert _header(payload)[3] > 0
    # a fixed threshold: the kept set is known here, and so is every byte
    job.threshold = float(torch.quantile(acc64(job)[:, :job.chunks[0]].abs().flatten(), 0.99).float())
    acc32 = REFERENCE.accumulate(job)
    for row, payload in enumerate(REFERENCE.compress(job).payloads):
        real = job.row_layout(row).seg_real
        a = acc32[row]
        sparse_cols = (a[:real[0]].abs() >= job.threshold).nonzero().view(-1)
        dense_cols = torch.arange(job.chunks[0], job.chunks[0] + real[1])
        pos = torch.cat([sparse_cols, dense_cols])
        gaps = torch.diff(sparse_cols, prepend=torch.tensor([-1])) - 1
        index = _leb_all(gaps.tolist())
        codes, scales, _ = quantize_values(a[pos], "int4", 16, torch.tensor([sparse_cols.numel(), real[1]]))
        header = torch.tensor([wire.MAGIC, job.fingerprint, pos.numel(), len(index), scales.numel()],
                              dtype=torch.int32)
        want = torch.cat([header.view(torch.uint8), scales.view(torch.uint8), codes,
                          torch.tensor(index, dtype=torch.uint8)])
        want = torch.cat([want, want.new_zeros(-want.numel() % 4)])
        assert torch.equal(payload, want)
    saved = {(0, "varint"): [227651950, 3438060604], (1, "bitmap"): [889352624, 609116028],
             (2, "varint"): [3855899311, 3103998276, 3766050008]}
    for (seed, coding), crcs in saved.items():
        fixed = make_job([5, 3000, 2, 65537, 64][:3 + seed], 2 + seed // 2, density=0.01, seed=seed,
                         index_coding=coding, value_format=("int4", "int2", "fp8_e4m3")[seed])
        got = [zlib.crc32(p.numpy().tobytes()) for p in REFERENCE.compress(fixed).payloads]
        assert got == crcs, (seed, coding, got)


@pytest.mark.parametrize("coding", ["varint", "bitmap"])
def test_receiver_reads_every_position_implied_and_the_old_form(coding):
    """A whole row's payload (no index bytes) and the same values with a position for every element of the sparse
    tensors (what encoders wrote before: all-zero varint gaps, or a bitmap of ones) decode to the same row; a whole
    row's payload one value short of every real element is refused."""
    job = make_job([4000, 30, 3001], 2, density=0.9, seed=_seed(), min_numel=50, index_coding=coding)
    out = REFERENCE.compress(job)
    for row, payload in enumerate(out.payloads):
        layout = job.row_layout(row)
        body = wire.parse(payload, 0, layout)
        assert body.index_bytes.numel() == 0 and body.kept == sum(layout.seg_real)
        n_sparse = sum(r for r, s in zip(layout.seg_real, layout.sparse) if s)
        index = torch.zeros(n_sparse, dtype=torch.uint8) if coding == "varint" else \
            torch.full((-(-n_sparse // 8), ), 0xFF, dtype=torch.uint8)
        if coding == "bitmap" and n_sparse % 8:
            index[-1] = (1 << n_sparse % 8) - 1
        if coding == "varint":  # gaps of 0 but from one sparse tensor's last real element to the next one's first
            col, prev, gaps = 0, -1, []
            for c, r, s in zip(layout.chunks, layout.seg_real, layout.sparse):
                if s:
                    gaps += [col - prev - 1] + [0] * (r - 1) if r else []
                    prev = col + r - 1 if r else prev
                col += c
            index = torch.tensor(_leb_all(gaps), dtype=torch.uint8)
        old = wire.pack(job.fingerprint, body.kept, body.scales, body.values, index)
        sums = [wire.decode_sum([p], layout, REFERENCE.decode_add) for p in (payload, old)]
        assert torch.equal(sums[0], sums[1]) and bool((sums[0] != 0).any())
        short = wire.Body(body.kept - 1, body.n_indexed - 1, body.scales, body.values, body.index_bytes)
        with pytest.raises(ValueError):
            REFERENCE.decode_add(torch.zeros(layout.row_numel), short, layout)


def test_non_finite_still_sends_nothing():
    """An all-equal gradient with a NaN: no row goes whole, every payload is a header."""
    job = make_job([20_000], 2, residual=False, density=0.01)
    job.srcs[0].fill_(0.5)
    job.srcs[0][int(torch.randint(0, 20_000, ()))] = math.nan
    out = REFERENCE.compress(job)
    assert not out.finite and out.kept == 0
    assert all(p.numel() == wire.HEADER_BYTES for p in out.payloads)


def equal_cost_job():
    """A bucket of one sparse tensor, two rows of 1120 elements, INT4 in groups of 16, a fixed threshold that keeps
    480 elements of row 0 and 479 of row 1, every gap below 128 (a varint byte each). Row 0's sparse payload costs
    exactly what the row sent whole does (480 / 2 + 480 + 4 * 30 = 1120 / 2 + 4 * 70 = 840 bytes): it goes whole;
    row 1's costs 839: it stays sparse. Returns the job."""
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    job = make_job([2240], 2, density=0.4, seed=seed, group_size=16)
    src = (torch.rand(2240, generator=g) - 0.5)  # |acc| <= 0.25 (divided by 2 ranks)
    for row, kept in ((0, 480), (1, 479)):
        cols = torch.randperm(1120, generator=g)[:kept].sort().values
        assert int(torch.diff(cols, prepend=torch.tensor([-1])).max()) <= 128
        sign = torch.randint(0, 2, (kept, ), generator=g) * 2 - 1
        src[row * 1120 + cols] = sign * (2 + torch.rand(kept, generator=g))  # |acc| >= 1
    job.srcs[0].copy_(src)
    job.residuals[0].zero_()
    job.threshold = 0.5
    return job


def test_equal_cost_goes_whole():
    """A row whose sparse payload costs exactly what it costs whole goes whole; one byte less stays sparse."""
    job = equal_cost_job()
    out = REFERENCE.compress(job)
    assert [_header(p)[2:4] for p in out.payloads][0] == [1120, 0]
    assert _header(out.payloads[1])[2:4] == [479, 479]
    assert _cost(job, [480], 480) == _cost(job, [1120], 0) == _cost(job, [479], 479) + 1
    _check_decodes(job, out)
