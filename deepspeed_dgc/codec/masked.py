"""Values at shared positions: the payloads of ``shared_mask``, where every rank sends the same coordinates.

With owner-chosen shared masks (SCAPE, arXiv 2607.01678, section 3; see :class:`~deepspeed_dgc.config.SharedMaskConfig`)
every sender knows, for tensor i and owner o, the same ``k_i`` in-partition positions ``mask_i[o]``. A payload then
carries no positions at all::

    int32[3]  header: MAGIC, fingerprint, 0
    fp32[G]   group scales (groups restart at each tensor)
    values    codes of acc[o, mask_i[o]] for every tensor, in tensor order
    zeros     padding to a multiple of 4 bytes

and the owner sums the W compacted buffers densely (senders in rank order) before scattering the sum to its
partition. A bucket's values are gathered from its padded owner matrix
(:class:`~deepspeed_dgc.codec.layout.BucketLayout`) in one gather, at the masks' columns in that matrix. Every size follows from ``k_i``: one all-to-all of equal rows, nothing read back on the host.
The masks themselves travel once per step, from each owner to every rank, as ``ceil(log2 c_i)``-bit positions
(:func:`pack_masks`).
"""

from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch

from .dct import header_rows, pack_uint, unpack_uint
from .fixed import header_mismatch
from .formats import code_bytes, decode_segments, encode_segments

MAGIC = 0x4447434D  # "DGCM"
HEADER_BYTES = 12


def position_bits(c: int) -> int:
    """Bits of a position inside a partition of ``c`` columns (at least 1)."""
    return max(1, (c - 1).bit_length())


def mask_bytes(chunks: Sequence[int], counts: Sequence[int]) -> int:
    """Bytes of one owner's masks of tensors with ``c_i`` columns and ``k_i`` positions each, padded to 4."""
    n = sum(-(-k * position_bits(c) // 8) for c, k in zip(chunks, counts))
    return n + (-n % 4)


def pack_masks(masks: Sequence[torch.Tensor], chunks: Sequence[int]) -> torch.Tensor:
    """One owner's positions, tensor i's ``(k_i,)`` below ``c_i``, as uint8 ``(mask_bytes,)``."""
    parts = [pack_uint(m.view(1, -1), position_bits(c))[0] for m, c in zip(masks, chunks)]
    out = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    return torch.nn.functional.pad(out, (0, -out.numel() % 4))


def unpack_masks(data: torch.Tensor, chunks: Sequence[int], counts: Sequence[int]) -> List[torch.Tensor]:
    """Inverse of :func:`pack_masks` for W owners: per tensor, int64 ``(W, k_i)`` (clamped below ``c_i``)."""
    out, at = [], 0
    for c, k in zip(chunks, counts):
        nbytes = -(-k * position_bits(c) // 8)
        out.append(unpack_uint(data[:, at:at + nbytes], position_bits(c), k).clamp_(max=c - 1))
        at += nbytes
    return out


@dataclass(frozen=True)
class ValuePlan:
    """The values of one bucket's payload: ``counts[i]`` values of tensor i, in ``value_format`` with one fp32 scale per
    ``group_size`` values (groups restart at each tensor)."""
    counts: Tuple[int, ...]
    value_format: str
    group_size: int

    @property
    def values(self) -> int:
        return sum(self.counts)

    @property
    def n_groups(self) -> int:
        return sum(-(-k // self.group_size) for k in self.counts)

    @property
    def value_bytes(self) -> int:
        return code_bytes(self.values, self.value_format)

    @property
    def payload_bytes(self) -> int:
        n = HEADER_BYTES + 4 * self.n_groups + self.value_bytes
        return n + (-n % 4)


def value_plan(counts: Sequence[int], value_format: str, group_size: int) -> ValuePlan:
    """The value codec of a bucket whose tensor i sends ``counts[i]`` values."""
    return ValuePlan(tuple(int(k) for k in counts), value_format, int(group_size))


def payload_bytes(plan: ValuePlan) -> int:
    return plan.payload_bytes


def encode(A: torch.Tensor, cols: torch.Tensor, plan: ValuePlan, fingerprint: int) -> torch.Tensor:
    """Every owner's payload of the values at its masks; what was sent leaves ``A``.

    Args:
        A: fp32 ``(W, C)``, the error-feedback accumulator as a padded owner matrix; on return ``A - decoded`` at the
            masks (what error feedback keeps), unchanged elsewhere.
        cols: int64 ``(W, K)``, row o: owner o's mask positions as columns of ``A`` (tensor by tensor).
        plan: :func:`value_plan` of the masks' sizes; fingerprint: int31 written in every header.

    Returns:
        uint8 ``(W, payload_bytes)``.
    """
    W, device = A.shape[0], A.device
    vals = A.gather(1, cols)
    scales, packed, decoded = encode_segments(vals, list(plan.counts), plan.value_format, plan.group_size)
    payload = torch.cat([header_rows(MAGIC, fingerprint, W, device), scales.view(torch.uint8), packed], dim=1)
    payload = torch.nn.functional.pad(payload, (0, plan.payload_bytes - payload.shape[1]))
    A.scatter_add_(1, cols, decoded.neg_())
    return payload


def decode_sum(received: torch.Tensor, own_cols: torch.Tensor, columns: int, plan: ValuePlan,
               fingerprint: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """This owner's row of the sum over senders.

    Args:
        received: uint8 ``(W, payload_bytes)``, row s from rank s.
        own_cols: int64 ``(K,)``, this owner's mask positions as columns of the owner matrix; columns: C.

    Returns:
        ``(out, bad)``: fp32 ``(C,)`` (NaN everywhere when a payload does not match the plan); bool ``(W,)``.
    """
    W, device = received.shape[0], received.device
    bad = header_mismatch(received, MAGIC, fingerprint)
    G = plan.n_groups
    scales = received[:, HEADER_BYTES:HEADER_BYTES + 4 * G].contiguous().view(torch.float32)
    vals = decode_segments(scales, received[:, HEADER_BYTES + 4 * G:HEADER_BYTES + 4 * G + plan.value_bytes],
                           list(plan.counts), plan.value_format, plan.group_size)
    total = torch.zeros(1, vals.shape[1], device=device).index_add_(0, torch.zeros(W, dtype=torch.long, device=device),
                                                                     vals)  # senders in rank order
    out = torch.zeros(columns, device=device).scatter_(0, own_cols, total[0])
    return out.masked_fill(bad.any(), float("nan")), bad
