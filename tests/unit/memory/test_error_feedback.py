"""Error feedback: staging, commit and rollback, storage dtypes, pinned-host offload, and conservation of every
gradient through real compression against a float64 oracle."""

import pytest
import torch

from deepspeed_dgc.codec import wire
from deepspeed_dgc.codec.job import CompressJob
from deepspeed_dgc.codec.reference import REFERENCE
from deepspeed_dgc.codec.selection import draw_samples, target_count
from deepspeed_dgc.memory.error_feedback import ErrorFeedback


def _values(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.rand(n, generator=g).pow(3) * 10


def test_stage_commit_rollback():
    m = ErrorFeedback()
    a, b = torch.randn(10), torch.randn(10)
    m.stage(1, a)
    assert m.get(1) is a and m.committed == {}
    m.commit()
    assert m.get(1) is a
    m.stage(1, b)
    assert m.get(1) is b  # later micro-steps of the window build on the staged value
    m.rollback()
    assert m.get(1) is a  # a skipped step leaves the committed residual as it was
    assert m.state_bytes() == 40
    assert m.residual_norm() == pytest.approx(float(a.norm()), rel=1e-6)


@pytest.mark.parametrize("storage", ["fp32", "bf16", "fp8", "int8"])
def test_offloaded_residuals_equal_device_ones_and_reuse_their_host_buffers(storage):
    """residual_offload: every read gives the bits the same memory without offload gives, through commits, a
    rollback, a load and a new shape; the committed copies are host tensors whose buffers are allocated once per
    key and shape, then overwritten (a rollback leaves them as they were)."""
    gen = torch.Generator().manual_seed(5)
    plain, off = ErrorFeedback(storage), ErrorFeedback(storage, offload=True)
    ptrs = None

    def parts(m, k):
        stored = m.committed[k]
        return stored if isinstance(stored, tuple) else (stored, )

    for step in range(4):
        for m in (plain, off):
            g = torch.Generator().manual_seed(100 + step)
            for k, n in ((1, 300), (2, 1000)):
                m.stage(k, torch.randn(n, generator=g) * 10.0**step)
            m.rollback() if step == 2 else m.commit()
        for k in (1, 2):
            assert torch.equal(off.get(k), plain.get(k))
            assert all(t.device.type == "cpu" for t in parts(off, k))
        now = [t.data_ptr() for k in (1, 2) for t in parts(off, k)]
        assert ptrs is None or now == ptrs  # the same host buffers, overwritten
        ptrs = now
    assert off.host_state_bytes() == off.state_bytes() == plain.state_bytes() and plain.host_state_bytes() == 0
    assert off.residual_norm() == plain.residual_norm()
    loaded = {1: torch.randn(300, generator=gen), 2: torch.randn(7, generator=gen)}  # key 2 changes shape
    plain.load(loaded)
    off.load(loaded)
    assert all(torch.equal(off.get(k), plain.get(k)) for k in (1, 2)) and off.get(2).numel() == 7
    assert all(torch.equal(a, b) for a, b in zip(off.residuals().values(), plain.residuals().values()))


@pytest.mark.parametrize("storage, rel", [("fp32", 0.0), ("bf16", 2.0**-8), ("fp8", 2.0**-4)])
def test_residual_storage_round_trip_and_bytes(storage, rel):
    m = ErrorFeedback(storage)
    r = _values(1000, 9)
    m.stage(1, r.clone())
    assert torch.equal(m.get(1), r)  # staged residuals stay exact until the step commits them
    m.commit()
    back = m.get(1)
    # fp8 e4m3 below its smallest normal (2^-6 after scaling by absmax/448) rounds to subnormal steps of 2^-9
    tiny = float(r.abs().max()) / 448 * 2.0**-10 if storage == "fp8" else 0.0
    assert back.dtype == torch.float32 and bool(((back - r).abs() <= rel * r.abs() + tiny + 1e-12).all())
    assert m.state_bytes() == {"fp32": 4000, "bf16": 2000, "fp8": 1000 + 4 * 8}[storage]
    m.load({2: r})
    assert set(m.committed) == {2} and torch.allclose(m.residuals()[2], back)
    with pytest.raises(ValueError, match="unknown residual storage 'fp16'; allowed: fp32, bf16, fp8, int8"):
        ErrorFeedback("fp16")


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
@pytest.mark.parametrize("storage", ["fp32", "bf16", "fp8", "int8"])
def test_a_window_end_stage_holds_the_storage_form_and_commits_the_same_bits(storage, offload):
    """``final`` (the accumulation window's last micro-step): the residual is staged in the storage form at once, so
    the window holds storage bytes instead of an fp32 copy; what it reads back, commits and exports are the bits the
    plain path commits; a rollback still restores the committed residual. Fresh random inputs per case."""
    seed = int(torch.randint(1 << 30, ()))
    plain, early = ErrorFeedback(storage, offload=offload), ErrorFeedback(storage, offload=offload)
    early.final = True
    g = torch.Generator().manual_seed(seed)
    first = {k: torch.randn(n, generator=g) * 10 for k, n in ((1, 300), (2, 1000))}
    for m in (plain, early):
        for k, r in first.items():
            m.stage(k, r.clone())
        m.commit()
    second = {k: torch.randn(r.numel(), generator=g) for k, r in first.items()}
    for m in (plain, early):
        for k, r in second.items():
            m.stage(k, r.clone())
    per_element = {"fp32": 4.0, "bf16": 2.0, "fp8": 1.0 + 4.0 / 128, "int8": 1.0 + 2.0 / 64}[storage]
    assert plain.staged_bytes() == 4 * 1300  # fp32 until the commit
    assert early.staged_bytes() == pytest.approx(per_element * 1300, abs=8)
    # the most held: the committed residuals and the window's staged ones together
    assert plain.peak_bytes == plain.state_bytes() + 4 * 1300
    assert early.peak_bytes == early.state_bytes() + early.staged_bytes()
    for k in second:  # a read in the window gives what the commit will store
        plain_committed = ErrorFeedback(storage)
        plain_committed.stage(k, second[k].clone())
        plain_committed.commit()
        assert torch.equal(early.get(k), plain_committed.get(k))
    early_rb = ErrorFeedback(storage)
    early_rb.load({k: plain.committed_value(k) for k in first})
    before = early_rb.get(1)
    early_rb.final = True
    early_rb.stage(1, torch.randn(300, generator=g))
    early_rb.rollback()
    assert torch.equal(early_rb.get(1), before)  # the committed residual, as before the window
    for m in (plain, early):
        m.commit()
    for k in second:
        assert torch.equal(early.get(k), plain.get(k))
    exported = early.export(), plain.export()
    for k in second:
        a, b = exported[0][k], exported[1][k]
        assert all(torch.equal(x, y) for x, y in zip(a if isinstance(a, tuple) else (a, ), b if isinstance(b, tuple) else (b, )))
    assert early.state_bytes() == plain.state_bytes()


# what one stored residual may lose, relative to the largest residual (int8: one step, its group's absmax / 127, the
# scale rounded up to bf16)
STORAGE_REL = {"fp32": 0.0, "bf16": 2.0**-8, "fp8": 2.0**-4, "int8": (1 + 2.0**-7) / 127}


@pytest.mark.parametrize("storage", ["fp32", "bf16", "fp8", "int8"])
@pytest.mark.parametrize("fmt", ["int4", "int1"])
def test_error_feedback_conserves_every_gradient(storage, fmt):
    """One sender, 20 steps of top-1% with INT4 or INT1 through the reference encoder and the wire: what the
    payloads decode to, summed over the steps, plus the last stored residual equals the float64 sum of all
    gradients, within the storage's rounding of each stored residual (none for fp32); every step sends 0.8 k to
    1.3 k values, each within the format's bound of the float64 accumulator."""
    n, steps, density = 5000, 20, 0.01
    gen = torch.Generator().manual_seed(0)
    memory = ErrorFeedback(storage)
    grad_total = torch.zeros(n, dtype=torch.float64)
    sent_total = torch.zeros(n, dtype=torch.float64)
    lost = 0.0  # what the storage's rounding may have dropped, summed over the steps
    k = target_count(n, density)
    for step in range(steps):
        g = torch.randn(n, generator=gen) * (1 + step % 3)
        grad_total += g.double()
        previous = memory.get(0)
        acc64 = g.double() + (previous.double() if previous is not None else 0.0)
        job = CompressJob(srcs=[g], offsets=[0], row_strides=[n], numels=[n], chunks=[n], sparse=[True], row_owner=[0],
                          residuals=[previous], residual_numels=[n], divisor=1.0, density=density,
                          samples=draw_samples([n], [True], density, gen, "cpu"), group_size=128, quantize=True,
                          value_dtype=torch.float32, fingerprint=1, want_residual=True, value_format=fmt)
        out = REFERENCE.compress(job)
        sent = wire.decode_sum(out.payloads, job.row_layout(0), REFERENCE.decode_add).double()
        kept = sent != 0
        assert 0.8 * k <= int(kept.sum()) <= 1.3 * k
        bound = {"int4": 1 / 14, "int1": 1.0}[fmt] * float(acc64[kept].abs().max())
        assert float((sent[kept] - acc64[kept]).abs().max()) <= bound * (1 + 1e-5)
        memory.stage(0, out.residuals[0])
        memory.commit()
        lost += STORAGE_REL[storage] * float((acc64 - sent).abs().max()) * 1.01
        sent_total += sent
    final = memory.get(0).double()
    torch.testing.assert_close(sent_total + final, grad_total, rtol=0, atol=1e-4 + lost)
    assert float(sent_total.abs().sum()) > 0.1 * float(grad_total.abs().sum())  # a real share of the gradient went out


def test_int8_storage_round_trip_bytes_and_unbiased_rounding():
    """int8: every stored value within one step (its group's bf16 scale) of the fp32 value, 1 + 2/64 bytes per element;
    averaged over many seeds the stored values approach the float64 values (stochastic rounding is unbiased): within
    5 standard errors of a rounding whose variance is at most step^2 / 4. Fresh random inputs."""
    from deepspeed_dgc.memory import int8_storage as i8
    seed = int(torch.randint(1 << 30, ()))
    r = _values(1000, seed)
    m = ErrorFeedback("int8")
    m.stage(1, r.clone())
    m.commit()
    codes, scales = m.committed[1]
    assert codes.dtype == torch.int8 and scales.dtype == torch.bfloat16 and m.state_bytes() == 1000 + 2 * 16
    step = scales.float().repeat_interleave(64)[:1000]
    assert bool(((m.get(1) - r).abs() <= step * (1 + 1e-6)).all())
    assert bool((step >= r.abs().view(-1).new_zeros(1024).index_copy_(0, torch.arange(1000), r.abs()).view(16, 64)
                 .amax(dim=1).repeat_interleave(64)[:1000] / 127).all())  # the scale never clips a value
    n_seeds, total = 400, torch.zeros(1000, dtype=torch.float64)
    for k in range(n_seeds):
        m.round_seed = (seed, k)
        m.stage(1, r.clone())
        m.commit()
        total += m.get(1).double()
    bias = (total / n_seeds - r.double()).abs()
    assert bool((bias <= 5 * step.double() / 2 / n_seeds**0.5 + 1e-12).all()), float((bias / step).max())
    m.round_seed = (seed, 0)  # the same seed draws the same noise
    again = ErrorFeedback("int8")
    again.round_seed = (seed, 0)
    for x in (m, again):
        x.stage(1, r.clone())
        x.commit()
    assert torch.equal(m.get(1), again.get(1))
    assert i8.group_for(16) == 16 and i8.group_for(128) == 64 and i8.group_for(96) == 32


@pytest.mark.parametrize("storage, lo, hi", [("int8", 0.98, 1.02), ("bf16", 1.3, 2.0)])
def test_a_decaying_momentum_keeps_its_decay_in_int8_not_in_bf16(storage, lo, hi):
    """``m <- 0.999 m + g`` for 500 steps with small ``g``, stored after every step, against the float64 oracle: with
    int8's stochastic rounding the stored momentum's projection on the oracle stays near 1 (unbiased); bf16 rounds
    0.999 m back to m, so the decay is lost and the momentum stays too large (why bf16 momentum drifts on long
    runs). Fresh random inputs."""
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    n = 4096
    store = ErrorFeedback(storage)
    store.stage("m", torch.randn(n, generator=g))
    store.commit()
    oracle = store.get("m").double()
    for t in range(500):
        gt = torch.randn(n, generator=g) * 1e-3
        store.round_seed = (t, )
        store.stage("m", store.get("m") * 0.999 + gt)
        store.commit()
        oracle = oracle * 0.999 + gt.double()
    got = store.get("m").double()
    projection = float((got * oracle).sum() / (oracle * oracle).sum())
    assert lo <= projection <= hi, projection


@pytest.mark.parametrize("storage", ["fp32", "bf16", "fp8", "int8"])
def test_offloaded_blocks_equal_device_ones_with_two_host_buffers(storage):
    """Bucket blocks with ``offload``: staged at the window's end and written back at once (a thread on the CPU),
    fetched ahead of their bucket, through commits and a rollback, every read equals the same store on the device,
    bit for bit; the device holds none of it between steps, the host the committed blocks and a second buffer each
    (the window writes into the one the commit does not hold, so a rollback keeps the committed one); the two buffers
    alternate and are allocated once. Fresh random inputs."""
    check_offloaded_blocks(storage, "cpu")


def check_offloaded_blocks(storage: str, device: str) -> None:
    """The body of the test above on ``device`` (tests/gpu runs it on CUDA: the side stream's copies)."""
    from deepspeed_dgc.codec.layout import layout_for
    seed = int(torch.randint(1 << 30, ()))
    numels = [1000, 3000, 256]
    L = layout_for(numels, 2, (0, 1), 128)
    plain, off = ErrorFeedback(storage), ErrorFeedback(storage, offload=True)
    buckets = [("a", "b", "c"), ("d", "e", "f")]
    seen = []
    for step in range(6):
        for m in (plain, off):
            m.round_seed, m.final = (seed, step), True
            g = torch.Generator().manual_seed(seed + step)
            for bkey in buckets:
                A = torch.zeros(L.rows, L.columns, device=device)
                L.gather([(torch.randn(n, generator=g) * 10.0**(step % 3)).to(device) for n in numels], A)
                m.add_block(list(bkey), numels, L, A)
                m.stage_block(list(bkey), numels, L, A)
            m.rollback() if step == 3 else m.commit()
        a, b = plain.residuals(), off.residuals()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        keys = [k for bkey in buckets for k in bkey]  # read outside a bucket: an offloaded block comes to the device
        got = off.get_many(keys)
        assert all(x.device.type == torch.device(device).type and torch.equal(x, y)
                   for x, y in zip(got, plain.get_many(keys)))
        assert off.device_state_bytes() == 0 and plain.device_state_bytes() == plain.state_bytes()
        # the second buffers exist from the second write-back on
        assert off.host_state_bytes() == (2 if step else 1) * off.state_bytes() and plain.host_state_bytes() == 0
        assert all(off.blocks[k].host and off.blocks[k].parts[0].device.type == "cpu" for k in buckets)
        assert all(t.is_pinned() for k in buckets for t in off.blocks[k].parts) or device == "cpu"
        seen.append(off.blocks[buckets[0]].parts[0].data_ptr())
    assert len(set(seen)) == 2 and seen[0] != seen[1]  # two host buffers, alternating
    assert off.export().keys() == plain.export().keys()


@pytest.mark.parametrize("storage", ["fp32", "fp8", "int8"])
@pytest.mark.parametrize("offload", [False, True])
def test_get_many_decodes_each_block_once(storage, offload, monkeypatch):
    """``get_many`` gives every key's residual, bit for bit what ``get`` gives one key at a time (staged and committed
    blocks, a residual kept per key, a key without one), decoding each bucket block once where ``get`` decodes the
    whole block for each of its keys. Fresh random inputs."""
    from deepspeed_dgc.codec.layout import layout_for
    numels = [1000, 3000, 256]
    L = layout_for(numels, 2, (0, 1), 128)
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    m = ErrorFeedback(storage, offload=offload)
    m.round_seed, m.final = (3, 0), True
    for step, bkey in enumerate([("a", "b", "c"), ("d", "e", "f")]):
        A = L.gather([torch.randn(n, generator=g) for n in numels], torch.zeros(L.rows, L.columns))
        m.add_block(list(bkey), numels, L, A)
        m.stage_block(list(bkey), numels, L, A)
        if step == 0:
            m.commit()  # one committed block, one staged
    m.stage("x", torch.randn(77, generator=g))
    keys = ["a", "b", "c", "d", "e", "f", "x", "nothing"]
    one_by_one = [m.get(k) for k in keys]
    decoded = []
    real = ErrorFeedback._decoded_block
    monkeypatch.setattr(ErrorFeedback, "_decoded_block", staticmethod(lambda parts: decoded.append(1) or real(parts)))
    together = m.get_many(keys)
    assert len(decoded) == 2  # one decode per block, not per key
    assert one_by_one[-1] is None and together[-1] is None
    for x, y in zip(one_by_one[:-1], together[:-1]):
        assert x.shape == y.shape and torch.equal(x.view(torch.int32), y.view(torch.int32))
    decoded.clear()
    m.get("a")
    assert len(decoded) == 1 and m._memo is None  # outside get_many nothing is kept


@pytest.mark.parametrize("storage, rel", [("bf16", 2.0**-7), ("fp8", 2.0**-4 + 2.0**-7), ("int8", None)])
@pytest.mark.parametrize("final", [True, False])
def test_a_bf16_owner_matrix_is_staged_and_committed_in_the_storage_form(storage, rel, final):
    """A bf16 owner matrix (bf16 gradients, ``fixed.matrix_dtype``) through a window of two micro-steps: the first
    stages the matrix itself (bf16, 2 B per element), the second adds it and stages its sum, in the storage form at
    once when it is the window's end (``final``) or at the commit when the window's end was not known. What is
    committed is the storage form (fp8 / int8 codes, or the bf16 matrix), as many bytes as an fp32 matrix's, and
    within the storage's and bf16's rounding of the float64 sum (int8: its stochastic step, absmax / 127 per group of
    64). Fresh random inputs."""
    from deepspeed_dgc.codec.layout import layout_for
    numels = [1000, 3000, 256]
    L = layout_for(numels, 2, (0, 1), 128)
    keys = ["a", "b", "c"]
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    parts = [[(torch.randn(n, generator=g) * 10.0**i).bfloat16() for i, n in enumerate(numels)] for _ in range(2)]
    oracle = {k: parts[0][i].double() + parts[1][i].double() for i, k in enumerate(keys)}
    stores = {}
    for dtype in (torch.bfloat16, torch.float32):
        m = ErrorFeedback(storage)
        m.round_seed = (7, 0)
        for micro in range(2):
            m.final = final and micro == 1
            A = L.gather([p.to(dtype) for p in parts[micro]], torch.empty(L.rows, L.columns, dtype=dtype))
            m.add_block(keys, numels, L, A)
            held = m.stage_block(keys, numels, L, A)
            staged = m.staged_blocks[tuple(keys)].parts
            if not m.final:  # before the window's end the matrix itself is held
                assert held and staged[0] is A and m.staged_bytes() == A.numel() * A.element_size()
            else:
                assert held == (storage == "bf16" and dtype == torch.bfloat16)
                assert staged[0].dtype == {"bf16": torch.bfloat16, "fp8": torch.uint8, "int8": torch.int8}[storage]
        m.commit()
        committed = m.blocks[tuple(keys)].parts
        assert committed[0].dtype == {"bf16": torch.bfloat16, "fp8": torch.uint8, "int8": torch.int8}[storage]
        stores[dtype] = m
    assert stores[torch.bfloat16].state_bytes() == stores[torch.float32].state_bytes()
    got = stores[torch.bfloat16].residuals()
    for i, k in enumerate(keys):
        err = (got[k].double() - oracle[k]).abs()
        if rel is not None:
            absmax = float(oracle[k].abs().max())
            assert bool((err <= rel * oracle[k].abs() + absmax * 2.0**-9 / 448 * 2).all()), (k, float(err.max()))
        else:
            # a stochastic step of at most the tensor's absmax / 127 (the bf16 scale rounded up), and bf16's rounding
            step = float(oracle[k].abs().max()) / 127 * (1 + 2.0**-7)
            assert bool((err <= step + 2.0**-8 * oracle[k].abs()).all()), (k, float(err.max()), step)
