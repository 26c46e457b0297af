"""Index coding: where the kept values of a payload sit in the owner's row.

Sorted positions are sent as gaps (position minus previous position minus 1; the first gap is the
first position) in LEB128 varints: 7 bits per byte, high bit set on all but the last byte of a value.
At density d the mean gap is about 1/d, so a kept element costs 8 bits of index for d >= 1/128 and
16 bits down to d = 1/16384, instead of 32. Above density 1/8 a bitmap (one bit per real element of
the sparse tensors) is smaller. Tensors sent whole carry no positions: theirs are implied; so does a
payload that keeps every real element of its row (no index bytes: every position is implied).
"""

from typing import List, Sequence, Tuple

import torch

from .formats import pack_bits, unpack_bits

_VARINT_LIMITS = (1 << 7, 1 << 14, 1 << 21, 1 << 28, 1 << 35)


def encode_indices(positions: torch.Tensor, segment_counts: torch.Tensor) -> torch.Tensor:
    """Varint-code sorted positions, segment by segment.

    Args:
        positions: int64 tensor, shape ``(K,)``; within each segment strictly increasing and >= 0.
        segment_counts: int64 tensor, shape ``(S,)``, positions per segment (sum K); each segment's
            gaps restart from position 0.

    Returns:
        uint8 tensor of the varint bytes (about one byte per position when gaps are < 128).
    """
    if positions.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=positions.device)
    gaps = positions.clone()
    gaps[1:] -= positions[:-1] + 1
    starts = torch.cumsum(segment_counts, 0) - segment_counts
    starts = starts[segment_counts > 0]
    gaps[starts] = positions[starts]
    if bool((gaps < 0).any()):
        raise ValueError("encode_indices: positions must be strictly increasing within each segment")
    nbytes = torch.ones_like(gaps)
    for limit in _VARINT_LIMITS[:-1]:
        nbytes += (gaps >= limit).long()
    ends = torch.cumsum(nbytes, 0)  # exclusive end offset of each value
    total = int(ends[-1])
    value_of_byte = torch.repeat_interleave(torch.arange(gaps.numel(), device=gaps.device), nbytes)
    byte_in_value = torch.arange(total, device=gaps.device) - (ends - nbytes)[value_of_byte]
    chunk = (gaps[value_of_byte] >> (7 * byte_in_value)) & 0x7F
    more = (byte_in_value < nbytes[value_of_byte] - 1).long() << 7
    return (chunk | more).to(torch.uint8)


def decode_indices(data: torch.Tensor, segment_counts: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`encode_indices`.

    Args:
        data: uint8 varint bytes.
        segment_counts: int64 tensor, shape ``(S,)``, positions per segment.

    Returns:
        int64 positions, shape ``(sum(segment_counts),)``, relative to each segment's start.

    Raises:
        ValueError: the bytes do not hold exactly ``sum(segment_counts)`` complete varints.
    """
    k = int(segment_counts.sum()) if segment_counts.numel() else 0
    device = data.device
    if data.numel() == 0:
        if k:
            raise ValueError(f"decode_indices: no index bytes for {k} positions")
        return torch.empty(0, dtype=torch.long, device=device)
    b = data.long()
    is_last = (b & 0x80) == 0
    if not bool(is_last[-1]) or int(is_last.sum()) != k:
        raise ValueError(f"decode_indices: {data.numel()} bytes do not hold {k} complete varints")
    value_of_byte = torch.cumsum(is_last.long(), 0) - is_last.long()
    last_pos = is_last.nonzero().squeeze(1)
    starts = torch.cat([last_pos.new_zeros(1), last_pos[:-1] + 1])
    byte_in_value = torch.arange(b.numel(), device=device) - starts[value_of_byte]
    gaps = torch.zeros(k, dtype=torch.long, device=device)
    gaps.index_add_(0, value_of_byte, (b & 0x7F) << (7 * byte_in_value))
    steps = gaps + 1
    csum = torch.cumsum(steps, 0)
    seg_of = torch.repeat_interleave(torch.arange(segment_counts.numel(), device=device), segment_counts)
    seg_base = (torch.cumsum(segment_counts, 0) - segment_counts)  # index of each segment's first value
    base = torch.where(seg_base > 0, csum[(seg_base - 1).clamp(min=0)], torch.zeros_like(seg_base))
    return csum - base[seg_of] - 1




def encode_bitmap(mask: torch.Tensor) -> torch.Tensor:
    """One bit per element of a bool mask, little-endian within each byte: uint8 ``(ceil(n / 8),)``."""
    return pack_bits(mask.to(torch.uint8), 1)


def starts(chunks: Sequence[int]) -> List[int]:
    """Column where each tensor's segment of a row begins (exclusive prefix sums of ``chunks``)."""
    out, col = [], 0
    for c in chunks:
        out.append(col)
        col += c
    return out


def segment_counts(pos: torch.Tensor, seg_ends: torch.Tensor) -> torch.Tensor:
    """Kept positions per tensor: ``pos`` (sorted columns of a row) counted by ``seg_ends`` ranges."""
    below_end = torch.searchsorted(pos, seg_ends)
    return torch.diff(below_end, prepend=below_end.new_zeros(1))


def decode_positions(row_numel: int, index_bytes: torch.Tensor, kept: int, n_indexed: int, seg_real: Sequence[int],
                     chunks: Sequence[int], sparse: Sequence[bool],
                     index_coding: str = "varint") -> Tuple[torch.Tensor, torch.Tensor]:
    """Sorted positions (columns of the row) of a payload's ``kept`` values, and their count per tensor.

    Args:
        row_numel: columns of the row (``sum(chunks)``).
        index_bytes: the payload's index section: varint gaps, or a bitmap over the real elements of
            the sparse tensors (a payload sent whole is read with every tensor implied:
            :func:`~deepspeed_dgc.codec.wire.implied_view`).
        kept: values in the payload; n_indexed: how many of them carry an index.
        seg_real: real elements of each tensor in this row; chunks: columns per tensor; sparse: per tensor.
        index_coding: ``"varint"`` or ``"bitmap"``.

    Returns:
        ``(pos, counts)``: int64 ``(kept,)`` sorted columns, int64 ``(T,)`` kept per tensor.

    Raises:
        ValueError: the index bytes are malformed, point past the row, or do not add up to ``kept``.
    """
    device = index_bytes.device
    implied = torch.cat([
        torch.arange(col, col + r, device=device) for col, r, s in zip(starts(chunks), seg_real, sparse) if not s
    ] or [torch.empty(0, dtype=torch.long, device=device)])
    if index_coding == "bitmap":
        cols = torch.cat([
            torch.arange(col, col + r, device=device) for col, r, s in zip(starts(chunks), seg_real, sparse) if s
        ] or [torch.empty(0, dtype=torch.long, device=device)])
        if index_bytes.numel() != -(-cols.numel() // 8):
            raise ValueError(f"bitmap of {index_bytes.numel()} bytes for {cols.numel()} elements")
        indexed = cols[unpack_bits(index_bytes, 1, cols.numel()).bool()]
        if indexed.numel() != n_indexed:
            raise ValueError(f"bitmap marks {indexed.numel()} positions, the header says {n_indexed}")
    else:
        indexed = decode_indices(index_bytes, torch.tensor([n_indexed], device=device))
    if n_indexed and (int(indexed.max()) >= row_numel or int(indexed.min()) < 0):
        raise ValueError(f"index past the partition of {row_numel} elements")  # also an int64 wrap-around
    pos = torch.sort(torch.cat([implied, indexed])).values if n_indexed else implied
    if pos.numel() != kept:
        raise ValueError(f"payload holds {pos.numel()} positions for {kept} kept values")
    seg_ends = torch.cumsum(torch.tensor(list(chunks), dtype=torch.long, device=device), 0)
    return pos, segment_counts(pos, seg_ends)
