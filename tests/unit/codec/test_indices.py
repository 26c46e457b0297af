"""Index coding: varint gaps round trip (property), cost per position, malformed bytes, bitmaps."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepspeed_dgc.codec.indices import decode_indices, decode_positions, encode_bitmap, encode_indices
from deepspeed_dgc.codec.selection import select_topk


def _gen(seed):
    return torch.Generator().manual_seed(seed)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(0, 1 << 33), max_size=40, unique=True), min_size=1, max_size=5))
def test_index_codec_property_round_trip(segments):
    segs = [sorted(s) for s in segments]
    counts = torch.tensor([len(s) for s in segs])
    pos = torch.tensor([p for s in segs for p in s], dtype=torch.long)
    data = encode_indices(pos, counts)
    assert data.dtype == torch.uint8
    assert torch.equal(decode_indices(data, counts), pos)


@pytest.mark.parametrize("n", [1, 7, 1001, 4099])
def test_index_codec_exact_on_random_selection(n):
    x = torch.randn(n, generator=_gen(n))
    pos = select_topk(x, 0.1).nonzero().squeeze(1)
    data = encode_indices(pos, torch.tensor([pos.numel()]))
    assert torch.equal(decode_indices(data, torch.tensor([pos.numel()])), pos)


@pytest.mark.parametrize("density,max_bits", [(0.1, 8.0), (0.01, 12.0), (0.001, 16.0)])
def test_index_cost_well_under_32_bits(density, max_bits):
    n = 1 << 20
    x = torch.randn(n, generator=_gen(7))
    pos = select_topk(x, density, _gen(8)).nonzero().squeeze(1)
    bits = 8 * encode_indices(pos, torch.tensor([pos.numel()])).numel() / pos.numel()
    assert bits <= max_bits


def test_decode_rejects_truncated_bytes():
    pos = torch.tensor([5, 300, 70000])
    data = encode_indices(pos, torch.tensor([3]))
    with pytest.raises(ValueError, match="do not hold 3 complete varints"):
        decode_indices(data[:-1], torch.tensor([3]))
    with pytest.raises(ValueError, match="do not hold 4 complete varints"):
        decode_indices(data, torch.tensor([4]))
    with pytest.raises(ValueError, match="increasing"):
        encode_indices(torch.tensor([4, 2]), torch.tensor([2]))


def test_positions_of_a_row_with_implied_and_bitmap_segments():
    """A row of three tensors (7 + 10 + 5 columns, the last with 3 real elements): the first sent whole (implied
    positions), the others by bitmap over their real elements; decoded positions and per-tensor counts equal the
    mask's, and a bitmap of the wrong length or count is refused."""
    chunks, seg_real, sparse = [7, 10, 5], [7, 10, 3], [False, True, True]
    mask = torch.zeros(22, dtype=torch.bool)
    mask[:7] = True  # implied
    mask[[8, 12, 16, 18]] = True
    real_sparse = torch.cat([torch.arange(7, 17), torch.arange(17, 20)])
    index = encode_bitmap(mask[real_sparse])
    pos, counts = decode_positions(22, index, 11, 4, seg_real, chunks, sparse, "bitmap")
    assert pos.tolist() == mask.nonzero().squeeze(1).tolist() and counts.tolist() == [7, 3, 1]
    with pytest.raises(ValueError, match="bitmap marks 4 positions, the header says 5"):
        decode_positions(22, index, 12, 5, seg_real, chunks, sparse, "bitmap")
    with pytest.raises(ValueError, match="bitmap of 1 bytes for 13 elements"):
        decode_positions(22, index[:1], 11, 4, seg_real, chunks, sparse, "bitmap")
