"""decode_add (cpu_decode.cpp) against the reference: every format, flat and hierarchical rows, long position lists
decoded in parallel.
"""


import pytest
import torch

from deepspeed_dgc.codec import indices, wire
from deepspeed_dgc.codec.reference import REFERENCE

from ..jobs import make_job
from . import _leb


@pytest.mark.parametrize("hierarchical", [False, True])
def test_decode_add_equals_reference(fused, hierarchical):
    """The fused decode adds the same bits as the reference for every row; malformed bodies raise ValueError in
    both: a truncated varint, one position too many, an index past the row."""
    job = make_job([5, 3000, 2, 65537, 64], 3, hierarchical=hierarchical, seed=11)
    out = REFERENCE.compress(job)
    for row, payload in enumerate(out.payloads):
        layout = job.row_layout(row)
        body = wire.parse(payload, 0, layout)
        sums = []
        for ops in (REFERENCE, fused):
            acc = torch.randn(layout.row_numel, generator=torch.Generator().manual_seed(row))
            ops.decode_add(acc, body, layout)
            sums.append(acc)
        assert torch.equal(sums[0], sums[1])
        for bad_index, bad_n in ((body.index_bytes[:-1], body.n_indexed), (body.index_bytes, body.n_indexed + 1),
                                 (torch.tensor([0xFF, 0xFF, 0x7F], dtype=torch.uint8), 1)):
            bad = wire.Body(body.kept - body.n_indexed + bad_n, bad_n, body.scales, body.values, bad_index)
            for ops in (REFERENCE, fused):
                with pytest.raises(ValueError):
                    ops.decode_add(torch.zeros(layout.row_numel), bad, layout)


def test_long_position_lists_decode_in_parallel_as_the_reference(fused):
    """A row whose index bytes are long enough for the op to decode them in parallel chunks (from 2 x 16384 bytes;
    about 75K here), with gaps of one, two and three varint bytes and two segments: the same sums as the reference.
    Corrupted bodies raise the serial decoder's error naming the fault: a varint longer than 9 bytes or a position
    past the row in the middle of the bytes, the bytes ending inside a varint (followed in memory by a byte that
    would end it), a count that does not match, a position in a tensor's padding."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    chunks, real = [2_000_000, 1_000_000], [1_999_990, 1_000_000]
    row = sum(chunks)

    def positions(lo, hi):  # strictly increasing columns in [lo, hi): mostly gaps < 128, some of 2 and 3 bytes
        kind = torch.rand(200_000, generator=g)
        gaps = torch.where(kind < 0.98, torch.randint(0, 40, (200_000, ), generator=g),
                           torch.where(kind < 0.9995, torch.randint(128, 1000, (200_000, ), generator=g),
                                       torch.randint(16384, 20_000, (200_000, ), generator=g)))
        p = lo + torch.cumsum(gaps + 1, 0) - 1
        return p[p < hi]

    pos = torch.cat([positions(0, real[0]), positions(chunks[0], chunks[0] + real[1])])
    counts = [int((pos < chunks[0]).sum()), int((pos >= chunks[0]).sum())]
    index = indices.encode_indices(pos, torch.tensor([pos.numel()]))
    assert index.numel() >= 4 * 16384 and int((index >= 0x80).sum()) > 1000 and int((index == 0x81).sum()) > 3
    n = pos.numel()
    groups = sum(-(-c // 128) for c in counts)
    values = torch.randint(0, 256, (-(-n // 2), ), dtype=torch.uint8, generator=g)
    scales = torch.rand(groups, generator=g) + 0.1
    layout = wire.RowLayout(1, chunks, real, [True, True], True, "int4", 128, torch.float32, "varint")
    start = torch.randn(row, generator=g)
    sums = []
    for ops in (REFERENCE, fused):
        out = start.clone()
        ops.decode_add(out, wire.Body(n, n, scales, values, index), layout)
        sums.append(out)
    assert torch.equal(sums[0], sums[1])
    assert bool((sums[0] != start)[pos].float().mean() > 0.9)  # the values landed at the positions sent
    # two-byte varints only, 32K-48K bytes (two chunks, split at the middle byte), after no or one one-byte varint:
    # in one of the two, the middle byte is a varint's second
    gaps = torch.randint(128, 180, (18_000, ), generator=g)
    for lead in ([], [5]):
        p2 = torch.cumsum(torch.cat([torch.tensor(lead, dtype=torch.long), gaps]) + 1, 0) - 1
        idx2 = indices.encode_indices(p2, torch.tensor([p2.numel()]))
        assert 2 * 16384 <= idx2.numel() < 3 * 16384 and idx2.numel() == len(lead) + 2 * gaps.numel()
        layout2 = wire.RowLayout(1, [row], [row], [True], True, "int4", 128, torch.float32, "varint")
        k2 = p2.numel()
        body2 = wire.Body(k2, k2, scales[:-(-k2 // 128)], values[:-(-k2 // 2)], idx2)
        got = [start.clone(), start.clone()]
        REFERENCE.decode_add(got[0], body2, layout2)
        fused.decode_add(got[1], body2, layout2)
        assert torch.equal(got[0], got[1])

    mid = int((index[:index.numel() // 2] < 0x80).sum())  # the varints before the middle of the bytes
    cut = int(torch.nonzero(index < 0x80)[mid - 1]) + 1  # the first byte after the middle's varint
    too_long = torch.cat([index[:cut], torch.full((9, ), 0x81, dtype=torch.uint8), index[cut:]])
    past = torch.cat([index[:cut], torch.tensor(_leb(row), dtype=torch.uint8), index[cut:]])
    in_padding = indices.encode_indices(torch.cat([pos[:counts[0]], torch.tensor([real[0] + 3]), pos[counts[0]:]]),
                                        torch.tensor([n + 1]))
    bad = [(too_long, n, "varint longer than 9 bytes"), (past, n + 1, "past the partition"),
           (torch.cat([index, torch.tensor([0x80, 0x00], dtype=torch.uint8)])[:-1], n, "inside a varint"),
           (index, n + 1, f"hold {n} positions, expected {n + 1}"), (in_padding, n + 1, "points into padding")]
    for bad_index, bad_n, message in bad:
        assert bad_index.numel() >= 4 * 16384
        for ops in (REFERENCE, fused) if message != "points into padding" else (fused, ):  # (the reference does not
            with pytest.raises(ValueError) as err:                                        # look at padding)
                ops.decode_add(start.clone(), wire.Body(bad_n, bad_n, scales, values, bad_index), layout)
            if ops is fused:
                assert message in str(err.value)
