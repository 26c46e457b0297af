"""The chunked DCT top-k codec (codec/dct.py) in one process, against float64 and against a per-tensor computation: the
transform, the top-k per chunk, what the owners decode equals what the senders sent, exact conservation of what
leaves the momentum, the same bits as transforming each tensor on its own (one-row products included), sizes from the
plan alone, bad payloads flagged, a fixed number of ops whatever the tensors."""

import pytest
import torch

from deepspeed_dgc.codec import dct
from deepspeed_dgc.codec.fixed import owner_matrix
from deepspeed_dgc.codec.formats import VALUE_BITS, encode_segments
from deepspeed_dgc.codec.layout import Workspace, layout_for

from .jobs import count_ops, dct64

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


def _layout(sizes, world, chunk):
    return layout_for(sizes, world, tuple(range(world)), chunk)


def _encode(srcs, sizes, plan, world, fingerprint):
    """One sender: ``(payloads, sent, kept)`` with ``sent`` per tensor, flat (what left its momentum)."""
    L = _layout(sizes, world, plan.chunk)
    X = L.gather(srcs, owner_matrix(world, L.columns, "cpu"))
    before = X.clone()
    payloads, kept = dct.encode(X, L, plan, fingerprint, Workspace())
    return payloads, [L.flat_of(before - X, i) for i in range(len(sizes))], kept, X


def _decode(received, sizes, world, plan, fingerprint, owner):
    """Owner ``owner``'s real slice of each tensor of the sum."""
    L = _layout(sizes, world, plan.chunk)
    out, bad = dct.decode_sum(received, L, plan, fingerprint, Workspace())
    return [v.clone() for v in L.row_slices(out, owner)], bad


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
    _, sent, kept, _ = _encode(srcs, sizes, plan, world, 7)
    assert kept == world * plan.values
    d64 = dct64(chunk)
    for src, n, c, x in zip(srcs, sizes, plan.chunks, sent):
        for o in range(world):
            real = min(c, max(0, n - o * c))
            for j in range(real // chunk):  # chunks whose columns are all real
                cols = slice(o * c + j * chunk, o * c + (j + 1) * chunk)
                want = src[cols].double() @ d64.T if transform == "dct" else src[cols].double()
                got = x[cols].double() @ d64.T if transform == "dct" else x[cols].double()
                kth = want.abs().sort(descending=True).values[topk - 1]
                nonzero = got.abs() > 1e-4 * want.abs().max()
                assert int(nonzero.sum()) == min(topk, int((want.abs() > 1e-4 * want.abs().max()).sum()))
                assert bool((want.abs()[nonzero] >= kth * (1 - 1e-5)).all())
                assert torch.allclose(got[nonzero], want[nonzero], rtol=1e-4, atol=1e-6 * want.abs().max())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("world", [2, 4])
def test_owner_decodes_the_sum_of_what_senders_sent(fmt, sizes, world):
    """Owner o's row equals sum_r sent_r[o's slice] (float64 oracle), and src = sent + rest (what the momentum keeps is
    what no one decoded), the padding of the momenta staying 0."""
    senders = _senders(sizes, world, _seed())
    plan = _plan(sizes, world, 64, 3, "dct", fmt)
    outs = [_encode(srcs, sizes, plan, world, 11) for srcs in senders]
    for o in range(world):
        got, bad = _decode(torch.stack([p[o] for p, _, _, _ in outs]), sizes, world, plan, 11, o)
        assert not bool(bad.any())
        for i, (n, c) in enumerate(zip(sizes, plan.chunks)):
            real = max(0, min(c, n - o * c))
            want = sum(sent[i].double()[o * c:o * c + real] for _, sent, _, _ in outs)
            scale = max(float(sum(s[i].abs().max() for s in senders)), 1e-30)
            assert torch.allclose(got[i].double(), want, atol=2e-6 * scale, rtol=1e-5)
    L = _layout(sizes, world, 64)
    for srcs, (_, sent, _, rest) in zip(senders, outs):
        for i, (src, x) in enumerate(zip(srcs, sent)):
            kept = L.flat_of(rest, i)
            assert torch.allclose(kept.double() + x.double(), src.double(), rtol=0, atol=float(src.abs().max()) * 2**-22)
        padding = torch.ones_like(rest, dtype=torch.bool)
        for i in range(len(sizes)):
            for r in range(world):
                padding[r, L.cols[i]:L.cols[i] + L.real[r][i]] = False
        assert bool((rest[padding] == 0).all())


@pytest.mark.parametrize("world", [2, 3])
def test_all_coefficients_raw_is_the_exact_sum(world):
    """topk = chunk, raw fp32, no transform: the owner gets exactly sum_r src_r (fp32, senders in rank order)."""
    sizes = [1000, 33, 4097]
    senders = _senders(sizes, world, _seed())
    plan = _plan(sizes, world, 16, 16, "none", "none")
    outs = [_encode(srcs, sizes, plan, world, 3) for srcs in senders]
    for o in range(world):
        got, _ = _decode(torch.stack([p[o] for p, _, _, _ in outs]), sizes, world, plan, 3, o)
        for i, (n, c) in enumerate(zip(sizes, plan.chunks)):
            real = max(0, min(c, n - o * c))
            want = torch.zeros(real)
            for srcs in senders:
                want = want + srcs[i][o * c:o * c + real]
            assert torch.equal(got[i], want)
    for srcs, (_, sent, _, _) in zip(senders, outs):
        for src, x in zip(srcs, sent):
            assert torch.equal(src, x)


def _per_tensor(senders, sizes, world, plan):
    """The codec tensor by tensor, as each tensor's own products make it (the oracle of the batched transforms' bits):
    per sender the payload's values and positions and what stays of each tensor; per owner its decoded slices."""
    s, k, d = plan.chunk, plan.topk, dct.dct_matrix(plan.chunk, "cpu")
    coded = []
    for srcs in senders:
        values, positions, parts = [], [], []
        for src, n, c in zip(srcs, sizes, plan.chunks):
            m = -(-c // s)
            rows = torch.nn.functional.pad(src.float(), (0, world * c - n)).view(world, c)
            x = torch.nn.functional.pad(rows, (0, m * s - c)).view(world, m, s)
            coef = x @ d.T
            v, idx = dct.topk_(coef.abs(), k)
            values.append(coef.gather(2, idx).view(world, -1))
            positions.append(idx)
            parts.append((x, m, c, n))
        vals = torch.cat(values, dim=1)
        if plan.quantize:
            scales, packed, decoded = encode_segments(vals, list(plan.counts), plan.value_format, plan.group_size)
        else:
            scales, packed, decoded = None, None, vals
        rest, at = [], 0
        for (x, m, c, n), idx, cnt in zip(parts, positions, plan.counts):
            sent = torch.zeros(world, m, s).scatter_(2, idx, decoded[:, at:at + cnt].view(world, m, k)) @ d
            rest.append((x.view(world, -1)[:, :c].reshape(-1)[:n] - sent.view(world, -1)[:, :c].reshape(-1)[:n]))
            at += cnt
        coded.append((scales, packed, torch.cat([p.reshape(world, -1) for p in positions], 1), decoded, rest))
    owners = []
    for o in range(world):
        slices, at = [], 0
        for n, c, cnt in zip(sizes, plan.chunks, plan.counts):
            m = -(-c // s)
            coef = torch.zeros(m * s)
            for _, _, pos, decoded, _ in coded:  # senders in rank order
                index = (torch.arange(m)[:, None] * s + pos[o, at:at + cnt].view(m, k)).reshape(-1)
                coef.scatter_add_(0, index, decoded[o, at:at + cnt])
            real = max(0, min(c, n - o * c))
            slices.append((coef.view(m, s) @ d).view(-1)[:real])
            at += cnt
        owners.append(slices)
    return coded, owners


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("fmt", ["int2", "int4", "none"])
def test_the_same_bits_as_transforming_each_tensor_on_its_own(world, fmt):
    """One product for the whole bucket gives every coefficient, value, residual and decoded element bit for bit as
    each tensor's own products do, tensors whose products have one or two rows (a chunk or two) included: BLAS
    rounds those by another kernel, and the codec computes them as such. Each tensor's own product here has 1, 2, 4,
    8 or at least 12 rows: MKL rounds products of 3, 5-7 and 9-11 rows by other kernels on some CPUs (AMD EPYC; not
    on Intel's), and the codec does not promise those tensors their own products' bits (module docstring)."""
    sizes = [5000, 128, 40, 500, 64, 250, 7, 900]
    senders = _senders(sizes, world, _seed())
    plan = _plan(sizes, world, 64, 2, "dct", fmt, 128)
    coded, owners = _per_tensor(senders, sizes, world, plan)
    outs = [_encode(srcs, sizes, plan, world, 9) for srcs in senders]
    L = _layout(sizes, world, 64)
    for (payload, _, _, rest), (scales, packed, _, _, rest_t) in zip(outs, coded):
        for i, want in enumerate(rest_t):
            assert torch.equal(L.flat_of(rest, i).view(torch.int32), want.view(torch.int32)), i
        if fmt != "none":
            assert torch.equal(payload[:, 12:12 + scales.numel() * 4 // world], scales.view(torch.uint8))
    for o in range(world):
        got, _ = _decode(torch.stack([p[o] for p, _, _, _ in outs]), sizes, world, plan, 9, o)
        for i, want in enumerate(owners[o]):
            assert torch.equal(got[i].view(torch.int32), want.view(torch.int32)), (o, i)


@pytest.mark.parametrize("fmt", FORMATS)
def test_payload_size_is_the_plans_whatever_the_data(fmt):
    world, sizes = 3, [5000, 7, 300]
    plan = _plan(sizes, world, 32, 4, "dct", fmt)
    for fill in (None, 0.0, float("nan"), float("inf")):
        srcs = _senders(sizes, world, _seed())[0]
        if fill is not None:
            for s in srcs:
                s.fill_(fill)
        payload, _, _, _ = _encode(srcs, sizes, plan, world, 5)
        assert payload.shape == (world, plan.payload_bytes) and payload.dtype == torch.uint8
    bits = 0 if fmt == "none" else VALUE_BITS[fmt]
    assert plan.position_bits == 5
    assert plan.values == sum(-(-c // 32) * 4 for c in plan.chunks)
    if fmt not in ("none", "int1"):
        expect = 12 + 4 * plan.n_groups + -(-plan.values * bits // 8) + -(-plan.values * 5 // 8)
        assert plan.payload_bytes == expect + (-expect % 4)


def test_non_finite_input_reaches_the_owner_as_nan():
    world, sizes = 2, [4000]
    senders = _senders(sizes, world, _seed())
    senders[1][0][3] = float("nan")  # owner 0's slice of sender 1
    plan = _plan(sizes, world, 64, 2)
    outs = [_encode(srcs, sizes, plan, world, 5) for srcs in senders]
    got, bad = _decode(torch.stack([p[0] for p, _, _, _ in outs]), sizes, world, plan, 5, 0)
    assert not bool(bad.any()) and bool(torch.isnan(got[0]).any())


def test_a_payload_of_another_plan_is_flagged_and_the_row_is_nan():
    world, sizes = 3, [3000]
    senders = _senders(sizes, world, _seed())
    plan = _plan(sizes, world, 64, 2)
    outs = [_encode(srcs, sizes, plan, world, 5 if r != 2 else 6) for r, srcs in enumerate(senders)]
    got, bad = _decode(torch.stack([p[1] for p, _, _, _ in outs]), sizes, world, plan, 5, 1)
    assert bad.tolist() == [False, False, True]
    assert bool(torch.isnan(got[0]).all())
    with pytest.raises(ValueError, match="payloads"):
        _decode(torch.stack([p[1] for p, _, _, _ in outs])[:, :-4], sizes, world, plan, 5, 1)


@pytest.mark.parametrize("chunk,topk,transform", [(3, 1, "dct"), (64, 65, "dct"), (64, 0, "dct"), (64, 2, "fft")])
def test_bad_plans_are_refused(chunk, topk, transform):
    with pytest.raises(ValueError):
        dct.ChunkPlan((100, ), chunk, topk, transform, "int4", 32)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 64])
def test_topk_is_the_k_largest(k):
    """Against torch.topk: the same set of k distinct indices in every row, with their values (fresh random values,
    distinct)."""
    a = torch.rand(3, 50, 64, generator=torch.Generator().manual_seed(_seed()))
    values, got = dct.topk_(a.clone(), k)
    assert got.shape == (3, 50, k)
    assert torch.equal(got.sort(-1).values, torch.topk(a, k, dim=-1).indices.sort(-1).values)
    assert torch.equal(values, a.gather(-1, got))


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
    xt = x.T.contiguous().T
    assert torch.equal(dct.pack_uint(xt, bits), packed)
    assert torch.equal(dct.unpack_uint(packed.T.contiguous().T, bits, n), x)
    assert dct.pack_uint(x[:0], bits).shape == (0, packed.shape[1])


def test_topk_indices_are_distinct_whatever_the_values():
    """Ties, negative values and NaN: k distinct indices per row; NaN counts as the largest, as in torch.topk."""
    a = torch.tensor([[1.0, 1.0, 1.0, 1.0], [-2.0, -2.0, -3.0, -2.0], [0.0, float("nan"), 5.0, 1.0]])
    for k in (2, 3):
        _, got = dct.topk_(a.clone(), k)
        assert all(len(set(row)) == k for row in got.tolist())
    assert set(dct.topk_(a.clone(), 2)[1][2].tolist()) == {1, 2}


def test_a_bucket_is_a_fixed_number_of_ops_whatever_its_tensors():
    """Encoding and decoding a bucket of 6 tensors and one of 24 (the same shapes repeated) dispatch the same number
    of aten ops, none of which reads the device on the host."""
    counts = []
    for repeat in (2, 8):
        sizes = [5000, 128, 300] * repeat
        plan = _plan(sizes, 2, 64, 2, "dct", "int2", 128)
        srcs = _senders(sizes, 2, 1)[0]
        _encode(srcs, sizes, plan, 2, 1)  # warm the caches of the shape
        L = _layout(sizes, 2, 64)
        X = L.gather(srcs, owner_matrix(2, L.columns, "cpu"))
        ws = Workspace([torch.empty(16 * X.numel(), dtype=torch.uint8)])  # the gradients' memory, in the engine
        with count_ops() as ops:
            payloads, _ = dct.encode(X, L, plan, 1, ws)
            dct.decode_sum(payloads, L, plan, 1, ws)
        assert ops.syncs == 0, ops.sync_names
        counts.append(ops.launches)
    assert counts[0] == counts[1], counts


@pytest.mark.parametrize("transform", ["dct", "none"])
def test_slabs_change_no_bit(transform):
    """The transforms and the top-k run over slabs of chunks sized to the workspace: a workspace too small for one slab
    (8 slabs, new memory) and one holding everything give the same payloads, residual bits and decoded row bits."""
    sizes = [5000, 128, 300, 70001, 64 * 3 + 1]
    plan = _plan(sizes, 3, 64, 2, transform, "int4", 128)
    srcs = _senders(sizes, 3, int(torch.randint(0, 1 << 30, ())))[0]
    L = _layout(sizes, 3, 64)
    outs = []
    for ws in (Workspace(), Workspace([torch.empty(64 * L.columns * 3, dtype=torch.uint8)])):
        X = L.gather(srcs, owner_matrix(3, L.columns, "cpu"))
        payloads, _ = dct.encode(X, L, plan, 1, ws)
        row, _ = dct.decode_sum(payloads, L, plan, 1, ws)
        outs.append((payloads, X, row.clone()))
    assert torch.equal(outs[0][0], outs[1][0])
    for a, b in zip(outs[0][1:], outs[1][1:]):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
