"""Values at shared positions: the payloads of ``shared_mask``, where every rank sends the same coordinates.

With owner-chosen shared masks (SCAPE, arXiv 2607.01678, section 3; see :class:`~deepspeed_dgc.config.SharedMaskConfig`)
every sender knows, for tensor i and owner o, the same ``k_i`` in-partition positions ``mask_i[o]``. A payload then
carries no positions at all::

    int32[3]  header: MAGIC, fingerprint, 0
    fp32[G]   group scales (groups restart at each tensor)
    values    codes of acc[o, mask_i[o]] for every tensor, in tensor order
    zeros     padding to a multiple of 4 bytes

and the owner sums the W compacted buffers densely (senders in rank order) before scattering the sum to its
partition. Every size follows from ``k_i``: one all-to-all of equal rows, nothing read back on the host.
The masks themselves travel once per step, from each owner to every rank, as ``ceil(log2 c_i)``-bit positions
(:func:`pack_masks`).
"""

from typing import List, Sequence, Tuple

import torch

from .dct import header_rows, pack_uint, unpack_uint
from .fixed import FixedPlan, decode_values, encode_values, header_mismatch

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


def value_plan(counts: Sequence[int], value_format: str, group_size: int) -> FixedPlan:
    """The value codec: one fixed-layout tensor sent whole per tensor of the bucket (groups restart)."""
    return FixedPlan.build(counts, [False] * len(counts), 1.0, True, value_format, group_size, torch.float32)


def payload_bytes(plan: FixedPlan) -> int:
    n = HEADER_BYTES + 4 * plan.n_groups + plan.value_bytes
    return n + (-n % 4)


def encode(rows: Sequence[torch.Tensor], masks: Sequence[torch.Tensor], plan: FixedPlan,
           fingerprint: int) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """Every owner's payload of the values at its mask, and what was sent.

    Args:
        rows: per tensor, fp32 ``(W, c_i)``, the accumulator as an owner matrix (padding zero).
        masks: per tensor, int64 ``(W, k_i)``, owner o's positions in row o.
        plan: :func:`value_plan` of the ``k_i``; fingerprint: int31 written in every header.

    Returns:
        ``(payloads, sent)``: uint8 ``(W, payload_bytes)``; per tensor, fp32 ``(W, c_i)``, the decoded values at the
        mask and 0 elsewhere (what error feedback subtracts).
    """
    W, device = rows[0].shape[0], rows[0].device
    vals = torch.cat([r.gather(1, m) for r, m in zip(rows, masks)], dim=1)
    value_bytes, decoded = encode_values(vals, plan)
    payload = torch.cat([header_rows(MAGIC, fingerprint, W, device)] + value_bytes, dim=1)
    payload = torch.nn.functional.pad(payload, (0, payload_bytes(plan) - payload.shape[1]))
    sent, at = [], 0
    for r, m in zip(rows, masks):
        k = m.shape[1]
        sent.append(torch.zeros_like(r).scatter_(1, m, decoded[:, at:at + k]))
        at += k
    return payload, sent


def decode_sum(received: torch.Tensor, masks: Sequence[torch.Tensor], chunks: Sequence[int], plan: FixedPlan,
               fingerprint: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """This owner's row of the sum over senders.

    Args:
        received: uint8 ``(W, payload_bytes)``, row s from rank s.
        masks: per tensor, int64 ``(k_i,)``, this owner's positions; chunks: ``c_i``.

    Returns:
        ``(out, bad)``: fp32 ``(sum_i c_i,)`` (NaN everywhere when a payload does not match the plan); bool ``(W,)``.
    """
    W = received.shape[0]
    bad = header_mismatch(received, MAGIC, fingerprint)
    vals, _ = decode_values(received, HEADER_BYTES, plan)
    total = vals[0].clone()
    for s in range(1, W):  # senders in rank order, the same on every rank
        total += vals[s]
    outs, col = [], 0
    for m, c in zip(masks, chunks):
        k = m.numel()
        outs.append(torch.zeros(c, device=received.device).scatter_(0, m, total[col:col + k]))
        col += k
    out = torch.cat(outs)
    return out.masked_fill(bad.any(), float("nan")), bad
