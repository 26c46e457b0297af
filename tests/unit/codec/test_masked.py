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


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("world", [2, 3])
def test_owner_gets_the_sum_of_what_was_sent_at_its_mask(fmt, world):
    chunks, counts = [500, 37, 2049], [25, 37, 1]
    masks, senders = _case(world, chunks, counts, _seed())
    plan = masked.value_plan(counts, fmt, 16)
    outs = [masked.encode(rows, masks, plan, 9) for rows in senders]
    for rows, (payload, sent) in zip(senders, outs):
        assert payload.shape == (world, masked.payload_bytes(plan))
        for r, x, m in zip(rows, sent, masks):
            off = torch.ones_like(r, dtype=torch.bool).scatter_(1, m, False)
            assert torch.all(x[off] == 0)  # nothing outside the mask is sent
            rest = r - x
            assert torch.allclose(rest.double() + x.double(), r.double(), rtol=0, atol=float(r.abs().max()) * 2**-22)
            if fmt == "int4":  # absmax/7 per group of 16: error at most half a step
                err = (r.gather(1, m) - x.gather(1, m)).abs()
                assert bool((err <= r.gather(1, m).abs().amax() / 14 * (1 + 1e-5)).all())
    for o in range(world):
        got, bad = masked.decode_sum(torch.stack([p[o] for p, _ in outs]), [m[o] for m in masks], chunks, plan, 9)
        assert not bool(bad.any())
        col = 0
        for i, c in enumerate(chunks):
            want = sum(sent[i][o].double() for _, sent in outs)
            # an fp32 sum of W terms errs by at most W - 1 half-ulps of the sum of their magnitudes (INT1's values of
            # opposite signs cancel, so |want| can be far below the terms: a tolerance relative to it was flaky)
            magnitude = sum(sent[i][o].double().abs() for _, sent in outs)
            err = (got[col:col + c].double() - want).abs()
            assert bool((err <= world * 2**-24 * magnitude).all()), float((err - world * 2**-24 * magnitude).max())
            col += c


def test_a_payload_of_another_plan_is_flagged():
    chunks, counts = [300], [30]
    masks, senders = _case(2, chunks, counts, _seed())
    plan = masked.value_plan(counts, "int4", 16)
    outs = [masked.encode(rows, masks, plan, fp) for rows, fp in zip(senders, (4, 5))]
    got, bad = masked.decode_sum(torch.stack([p[0] for p, _ in outs]), [m[0] for m in masks], chunks, plan, 4)
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
