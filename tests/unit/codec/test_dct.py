"""The chunked DCT top-k codec (codec/dct.py) in one process, against float64: the transform, the top-k per chunk,
what the owners decode equals what the senders say they sent, exact conservation of what leaves the momentum, sizes
from the plan alone, bad payloads flagged."""

import pytest
import torch

from deepspeed_dgc.codec import dct
from deepspeed_dgc.codec.formats import VALUE_BITS

from .jobs import dct64

FORMATS = list(VALUE_BITS) + ["none"]
SIZES = [[3000, 96, 17], [70000], [5, 1, 300]]


def _seed():
    return int(torch.randint(0, 1 << 30, ()))


def _senders(sizes, world, seed, scale_spread=True):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(world):
        srcs = []
        for n in sizes:
            t = torch.randn(n, generator=g)
            if scale_spread:
                t *= torch.exp(3 * torch.randn(n, generator=g))  # heavy tails, as momenta
            srcs.append(t)
        out.append(srcs)
    return out


def _plan(sizes, world, chunk, topk, transform="dct", fmt="int4", gs=32):
    return dct.ChunkPlan(tuple(-(-n // world) for n in sizes), chunk, topk, transform, fmt, gs)


@pytest.mark.parametrize("s", [2, 8, 64, 512])
def test_dct_matrix_is_the_orthonormal_dct_ii(s):
    d = dct.dct_matrix(s, "cpu").double()
    assert torch.allclose(d, dct64(s), atol=1e-7)
    assert torch.allclose(d @ d.T, torch.eye(s, dtype=torch.float64), atol=1e-6)


@pytest.mark.parametrize("transform", ["dct", "none"])
@pytest.mark.parametrize("chunk,topk", [(64, 1), (64, 2), (32, 3), (8, 4), (16, 5), (8, 8)])
def test_top_k_of_each_chunk_against_float64(transform, chunk, topk):
    """Raw values: every sent coefficient is one of the chunk's k largest |X| (float64 transform), with its value."""
    world, sizes = 3, [2000, 130]
    srcs = _senders(sizes, world, _seed())[0]
    plan = _plan(sizes, world, chunk, topk, transform, fmt="none")
    _, sent, kept = dct.encode(srcs, sizes, plan, world, 7)
    assert kept == world * plan.values
    for src, n, c, x in zip(srcs, sizes, plan.chunks, sent):
        chunks = dct.owner_chunks(src.double(), n, c, world, chunk).double()
        coef = chunks @ dct64(chunk).T if transform == "dct" else chunks
        chunks_sent = dct.owner_chunks(x.double(), n, c, world, chunk).double()
        coef_sent = chunks_sent @ dct64(chunk).T if transform == "dct" else chunks_sent
        # padding columns past n are not part of `sent`: compare chunks whose columns are all real
        m_full = c // chunk
        for o in range(world):
            real = min(c, max(0, n - o * c))
            for j in range(min(m_full, real // chunk)):
                want = coef[o, j]
                got = coef_sent[o, j]
                kth = want.abs().sort(descending=True).values[topk - 1]
                nonzero = got.abs() > 1e-4 * want.abs().max()
                # k distinct coefficients (fewer only where the chunk has fewer above the noise floor)
                assert int(nonzero.sum()) == min(topk, int((want.abs() > 1e-4 * want.abs().max()).sum()))
                assert bool((want.abs()[nonzero] >= kth * (1 - 1e-5)).all())
                assert torch.allclose(got[nonzero], want[nonzero], rtol=1e-4, atol=1e-6 * want.abs().max())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("world", [2, 4])
def test_owner_decodes_the_sum_of_what_senders_sent(fmt, sizes, world):
    """Owner o's row equals sum_r sent_r[o's slice] (float64 oracle), and src = sent + rest exactly (what the
    momentum keeps is what was not decoded by anyone)."""
    senders = _senders(sizes, world, _seed())
    plan = _plan(sizes, world, 64, 3, "dct", fmt)
    outs = [dct.encode(srcs, sizes, plan, world, 11) for srcs in senders]
    for o in range(world):
        received = torch.stack([payload[o] for payload, _, _ in outs])
        got, bad = dct.decode_sum(received, plan, 11)
        assert not bool(bad.any())
        col = 0
        for i, (n, c) in enumerate(zip(sizes, plan.chunks)):
            real = max(0, min(c, n - o * c))
            want = sum(sent[i].double()[o * c:o * c + real] for _, sent, _ in outs)
            scale = max(float(sum(s[i].abs().max() for s in senders)), 1e-30)
            assert torch.allclose(got[col:col + real].double(), want, atol=2e-6 * scale, rtol=1e-5)
            col += c
    for srcs, (_, sent, _) in zip(senders, outs):
        for src, x in zip(srcs, sent):
            rest = src - x
            assert torch.equal(rest + x, src) or torch.allclose((rest.double() + x.double()), src.double(), rtol=0,
                                                                atol=float(src.abs().max()) * 2**-23)


@pytest.mark.parametrize("world", [2, 3])
def test_all_coefficients_raw_is_the_exact_sum(world):
    """topk = chunk, raw fp32, no transform: the owner gets exactly sum_r src_r (fp32, senders in rank order)."""
    sizes = [1000, 33, 4097]
    senders = _senders(sizes, world, _seed())
    plan = _plan(sizes, world, 16, 16, "none", "none")
    outs = [dct.encode(srcs, sizes, plan, world, 3) for srcs in senders]
    for o in range(world):
        got, _ = dct.decode_sum(torch.stack([p[o] for p, _, _ in outs]), plan, 3)
        col = 0
        for i, (n, c) in enumerate(zip(sizes, plan.chunks)):
            real = max(0, min(c, n - o * c))
            want = torch.zeros(real)
            for srcs in senders:
                want = want + srcs[i][o * c:o * c + real]
            assert torch.equal(got[col:col + real], want)
            col += c
        for srcs, (_, sent, _) in zip(senders, outs):
            for src, x in zip(srcs, sent):
                assert torch.equal(src, x)


@pytest.mark.parametrize("fmt", FORMATS)
def test_payload_size_is_the_plans_whatever_the_data(fmt):
    world, sizes = 3, [5000, 7, 300]
    plan = _plan(sizes, world, 32, 4, "dct", fmt)
    for fill in (None, 0.0, float("nan"), float("inf")):
        srcs = _senders(sizes, world, _seed())[0]
        if fill is not None:
            for s in srcs:
                s.fill_(fill)
        payload, _, _ = dct.encode(srcs, sizes, plan, world, 5)
        assert payload.shape == (world, plan.payload_bytes) and payload.dtype == torch.uint8
    bits = 0 if fmt == "none" else VALUE_BITS[fmt]
    assert plan.position_bits == 5
    assert plan.values == sum(-(-c // 32) * 4 for c in plan.chunks)
    if fmt not in ("none", "int1"):
        expect = 12 + 4 * plan.value_plan.n_groups + -(-plan.values * bits // 8) + -(-plan.values * 5 // 8)
        assert plan.payload_bytes == expect + (-expect % 4)


def test_non_finite_input_reaches_the_owner_as_nan():
    world, sizes = 2, [4000]
    senders = _senders(sizes, world, _seed())
    senders[1][0][3] = float("nan")  # owner 0's slice of sender 1
    plan = _plan(sizes, world, 64, 2)
    outs = [dct.encode(srcs, sizes, plan, world, 5) for srcs in senders]
    got, bad = dct.decode_sum(torch.stack([p[0] for p, _, _ in outs]), plan, 5)
    assert not bool(bad.any()) and bool(torch.isnan(got).any())


def test_a_payload_of_another_plan_is_flagged_and_the_row_is_nan():
    world, sizes = 3, [3000]
    senders = _senders(sizes, world, _seed())
    plan = _plan(sizes, world, 64, 2)
    outs = [dct.encode(srcs, sizes, plan, world, 5 if r != 2 else 6) for r, srcs in enumerate(senders)]
    got, bad = dct.decode_sum(torch.stack([p[1] for p, _, _ in outs]), plan, 5)
    assert bad.tolist() == [False, False, True]
    assert bool(torch.isnan(got).all())
    with pytest.raises(ValueError, match="payloads"):
        dct.decode_sum(torch.stack([p[1] for p, _, _ in outs])[:, :-4], plan, 5)


@pytest.mark.parametrize("chunk,topk,transform", [(3, 1, "dct"), (64, 65, "dct"), (64, 0, "dct"), (64, 2, "fft")])
def test_bad_plans_are_refused(chunk, topk, transform):
    with pytest.raises(ValueError):
        dct.ChunkPlan((100, ), chunk, topk, transform, "int4", 32)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 64])
def test_topk_indices_are_the_k_largest(k):
    """Against torch.topk: the same set of k distinct indices in every row (fresh random values, distinct)."""
    a = torch.rand(3, 50, 64, generator=torch.Generator().manual_seed(_seed()))
    got = dct.topk_indices(a, k)
    assert got.shape == (3, 50, k)
    assert torch.equal(got.sort(-1).values, torch.topk(a, k, dim=-1).indices.sort(-1).values)


@pytest.mark.parametrize("bits", range(1, 17))
@pytest.mark.parametrize("n", [1, 5, 8, 37])
def test_bit_packing_is_little_endian_bit_strings(bits, n):
    """Byte j bit b of row r is bit (8 j + b) of the row's values laid end to end, value i's bit t at i * bits + t (the
    oracle: Python integers), whichever packing the width takes."""
    x = torch.randint(0, 1 << bits, (3, n), generator=torch.Generator().manual_seed(_seed()))
    packed = dct.pack_uint(x, bits)
    for r in range(3):
        whole = sum(int(v) << (i * bits) for i, v in enumerate(x[r].tolist()))
        want = list(whole.to_bytes(-(-n * bits // 8), "little"))
        assert packed[r].tolist() == want
    assert torch.equal(dct.unpack_uint(packed, bits, n), x)
    # the same bytes from a transposed (non-contiguous) view, and back from one
    xt = x.T.contiguous().T
    assert torch.equal(dct.pack_uint(xt, bits), packed)
    assert torch.equal(dct.unpack_uint(packed.T.contiguous().T, bits, n), x)
    assert dct.pack_uint(x[:0], bits).shape == (0, packed.shape[1])


def test_topk_indices_are_distinct_whatever_the_values():
    """Ties, negative values and NaN: k distinct indices per row; NaN counts as the largest, as in torch.topk."""
    a = torch.tensor([[1.0, 1.0, 1.0, 1.0], [-2.0, -2.0, -3.0, -2.0], [0.0, float("nan"), 5.0, 1.0]])
    for k in (2, 3):
        got = dct.topk_indices(a, k)
        assert all(len(set(row)) == k for row in got.tolist())
    assert set(dct.topk_indices(a, 2)[2].tolist()) == {1, 2}


@pytest.mark.parametrize("bits", [1, 3, 6, 8, 12])
def test_bit_packing_round_trip(bits):
    x = torch.randint(0, 1 << bits, (3, 37))
    packed = dct.pack_uint(x, bits)
    assert packed.shape == (3, -(-37 * bits // 8))
    assert torch.equal(dct.unpack_uint(packed, bits, 37), x)
