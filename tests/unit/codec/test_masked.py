"""Values at shared positions (codec/masked.py) in one process, against float64: the owner's row is the sum of what
the senders sent at its mask, error feedback keeps exactly the rest, sizes from the counts alone, masks round-trip,
bad payloads flagged."""

import pytest
import torch

from deepspeed_dgc.codec import masked

FORMATS = ["int4", "int2", "int1", "fp8_e4m3", "fp8_e5m2"]


def _seed():
    return int(torch.randint(0, 1 << 30, ()))


def _case(world, chunks, counts, seed):
    g = torch.Generator().manual_seed(seed)
    masks = [torch.stack([torch.randperm(c, generator=g)[:k] for _ in range(world)]) for c, k in zip(chunks, counts)]
    senders = [[torch.randn(world, c, generator=g) * torch.exp(2 * torch.randn(world, c, generator=g)) for c in chunks]
               for _ in range(world)]
    return masks, senders


def _matrix(rows, chunks):
    """The senders' rows of each tensor side by side: an owner matrix ``(W, C)`` and each tensor's first column."""
    cols = [sum(chunks[:i]) for i in range(len(chunks))]
    return torch.cat(rows, dim=1).contiguous(), cols


def _columns(masks, cols):
    return torch.cat([m + c for m, c in zip(masks, cols)], dim=1)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("world", [2, 3])
def test_owner_gets_the_sum_of_what_was_sent_at_its_mask(fmt, world):
    chunks, counts = [500, 37, 2049], [25, 37, 1]
    masks, senders = _case(world, chunks, counts, _seed())
    plan = masked.value_plan(counts, fmt, 16)
    outs = []
    for rows in senders:
        A, cols = _matrix(rows, chunks)
        before = A.clone()
        payload = masked.encode(A, _columns(masks, cols), plan, 9)
        assert payload.shape == (world, masked.payload_bytes(plan))
        sent = before - A  # what left the accumulator: the decoded values at the mask, 0 elsewhere
        for i, (m, c0, c) in enumerate(zip(masks, cols, chunks)):
            r, x = before[:, c0:c0 + c], sent[:, c0:c0 + c]
            off = torch.ones_like(r, dtype=torch.bool).scatter_(1, m, False)
            assert torch.all(x[off] == 0)  # nothing outside the mask is sent
            if fmt == "int4":  # absmax/7 per group of 16: error at most half a step
                err = (r.gather(1, m) - x.gather(1, m)).abs()
                assert bool((err <= r.gather(1, m).abs().amax() / 14 * (1 + 1e-5) + 1e-30).all())
        outs.append((payload, sent, cols, before))
    for o in range(world):
        cols = outs[0][2]
        got, bad = masked.decode_sum(torch.stack([p[o] for p, _, _, _ in outs]), _columns(masks, cols)[o], sum(chunks),
                                     plan, 9)
        assert not bool(bad.any())
        for c0, c in zip(cols, chunks):
            want = sum(sent[o, c0:c0 + c].double() for _, sent, _, _ in outs)
            # an fp32 sum of W terms errs by at most W - 1 half-ulps of the sum of their magnitudes, and what left
            # each accumulator (before - after) is itself rounded once (INT1's values of opposite signs cancel)
            magnitude = sum(sent[o, c0:c0 + c].double().abs() + before[o, c0:c0 + c].double().abs()
                            for _, sent, _, before in outs)
            err = (got[c0:c0 + c].double() - want).abs()
            assert bool((err <= 2 * world * 2**-24 * magnitude).all()), float((err - world * 2**-24 * magnitude).max())


def test_a_payload_of_another_plan_is_flagged():
    chunks, counts = [300], [30]
    masks, senders = _case(2, chunks, counts, _seed())
    plan = masked.value_plan(counts, "int4", 16)
    payloads = []
    for rows, fp in zip(senders, (4, 5)):
        A, cols = _matrix(rows, chunks)
        payloads.append(masked.encode(A, _columns(masks, cols), plan, fp))
    got, bad = masked.decode_sum(torch.stack([p[0] for p in payloads]), _columns(masks, [0])[0], 300, plan, 4)
    assert bad.tolist() == [False, True] and bool(torch.isnan(got).all())


@pytest.mark.parametrize("chunks,counts", [([1, 2, 3], [1, 1, 3]), ([40000, 17], [2000, 4]), ([65536, 65537], [7, 9])])
def test_masks_round_trip_and_sizes(chunks, counts):
    world = 3
    masks, _ = _case(world, chunks, counts, _seed())
    packed = torch.stack([masked.pack_masks([m[o] for m in masks], chunks) for o in range(world)])
    assert packed.shape[1] == masked.mask_bytes(chunks, counts) and packed.shape[1] % 4 == 0
    back = masked.unpack_masks(packed, chunks, counts)
    assert all(torch.equal(a, b) for a, b in zip(back, masks))
    assert [masked.position_bits(c) for c in (1, 2, 3, 65536, 65537)] == [1, 1, 2, 16, 17]
