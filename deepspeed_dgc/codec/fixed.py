"""The fixed layout: payloads whose every size the host knows from the bucket's shape and density alone.

This is the device path (``"layout": "fixed"``, the default on GPUs): the host only launches work. Nothing
the host needs depends on the data, so no size exchange, no read-back of a count and one ``all_to_all_single``
per bucket with equal splits; every owner row gets a payload of the same size.

Selection (:func:`select`): DGC's sampled top-k threshold of the whole tensor, with its lowering rounds and its
cut to the k-th largest above 1.3 k (Lin et al., ICLR 2018, section 3 and appendix), computed on the device
(every candidate threshold counted in one pass) and equal bit for bit to the exact layout's, from the same sample;
then each owner's slice sends what reaches the threshold up to a fixed **capacity** of
``ceil(capacity_factor * density * c)`` values, the largest first: Ok-Topk's cut above capacity (Li and Hoefler,
PPoPP 2022, section 3.1), per owner. Error feedback keeps what a full row could not send; a row with fewer values
pads its payload with empty slots, counted on the wire. Where no row reaches its capacity, INT4, FP8 and raw
values send exactly what the exact layout sends. The threshold is global but the capacity is per owner, so
a tensor whose slices differ (the q, k and v blocks of an attention projection fall in different owners) needs a
factor well above DGC's 1.3 (``dgc.capacity_factor``, default 2).

Positions: the slice is cut into chunks of ``2^b`` columns; each payload carries the number of values of every
chunk (uint16) and, per value, its b-bit offset inside its chunk, b the smallest of 8, 12, 15 whose chunks hold
at least 4 values at the density (:func:`position_bits`).

Values: the formats of :mod:`~deepspeed_dgc.codec.formats` with every exact zero decoded as exactly 0 and
no data-dependent size: INT4 and FP8 code 0 as 0; INT2 switches a scale group that mixes zeros and non-zeros
(empty slots included) to three levels ``{-a, 0, a}`` (``a`` its absmax, error <= a/2; flagged by a negative
scale); INT1 codes sign-or-zero (ternary), five values per byte (1.6 bits; the exact layout's 1 bit plus masks
needs sizes that depend on the data).

Payload of one owner row (``FixedPlan.payload_bytes`` bytes)::

    int32[3]  header: MAGIC, fingerprint, flags (bit 0: the sender's input was not finite)
    fp32[G]   group scales (groups restart at each tensor)
    values    codes (INT4 two per byte, INT2 four, INT1 five, FP8 one) or raw values times ``raw_scale``
    uint16[]  per sparsified tensor, the values of each of its chunks
    bytes     per sparsified tensor, the b-bit offsets of its values in their chunks (12 bits: 3 bytes per pair)
    zeros     padding to a multiple of 4 bytes

The receiver checks the headers and positions on the device: a wrong magic or fingerprint (another config or
bucket), chunk counts past the capacity or a position past the slice set a flag and fill the row with NaN (so the
step is skipped on every rank), and the flag is read on the host only after a skipped step; a sender whose input
was not finite makes every row NaN the same way.
"""

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .formats import FP8_DTYPES, FP8_MAX, INT1_DOWN, INT2_LEVEL, INT4_QMAX, VALUE_BITS, _divide_by_scale, int1_mean
from .selection import LOWER_FACTOR, LOWER_SLACK, MAX_LOWER_ROUNDS, UPPER_SLACK

MAGIC = 0x44474346  # "DGCF"
HEADER_BYTES = 12
FLAG_NOT_FINITE = 1
POSITION_BITS = (8, 12, 15)  # offsets of 15 bits travel in 16; a chunk's count always fits a uint16
MIN_PER_CHUNK = 4
TERNARY_PER_BYTE = 5  # 3^5 = 243 <= 256


def position_bits(density: float) -> int:
    """Bits per in-chunk offset (and ``log2`` of the chunk length) at ``density``: the smallest of 8, 12, 15 whose
    chunks hold at least ``MIN_PER_CHUNK`` values, so a chunk's count (16 bits) costs at most 4 bits per value."""
    for bits in POSITION_BITS:
        if density * (1 << bits) >= MIN_PER_CHUNK:
            return bits
    return POSITION_BITS[-1]


def capacity(columns: int, density: float, factor: float) -> int:
    """Values an owner's slice of ``columns`` sends at most (and always carries slots for):
    ``ceil(factor * density * columns)``, at most ``columns``."""
    return min(columns, math.ceil(factor * density * columns))


def value_code_bytes(count: int, fmt: str) -> int:
    """Bytes of ``count`` codes of ``fmt`` in the fixed layout (INT1 is ternary: five per byte)."""
    if fmt == "int1":
        return -(-count // TERNARY_PER_BYTE)
    return -(-count * VALUE_BITS[fmt] // 8)


@dataclass(frozen=True)
class FixedPlan:
    """Sizes of one bucket's payloads, from its shape and codec only (every rank computes the same).

    Attributes:
        chunks: columns ``c_i`` of each tensor in a row; sparse: whether tensor i is sparsified.
        density: top-k density of the sparsified tensors; bits: bits per in-chunk offset (chunks of ``2^bits``).
        quantize, value_format, group_size: the value codec (``quantize`` False: raw ``value_dtype`` values).
        capacity_factor: a sparsified slice of c columns has ``ceil(capacity_factor * density * c)`` slots.
        counts: value slots per row of each tensor (its capacity, or ``c_i`` when sent whole); groups: scale groups
            of each tensor; n_chunks: chunks of each sparsified tensor's slice (0 for the others).
    """
    chunks: Tuple[int, ...]
    sparse: Tuple[bool, ...]
    density: float
    quantize: bool
    value_format: str
    group_size: int
    value_dtype: torch.dtype
    capacity_factor: float
    bits: int
    counts: Tuple[int, ...]
    groups: Tuple[int, ...]
    n_chunks: Tuple[int, ...]

    @staticmethod
    def build(chunks: Sequence[int], sparse: Sequence[bool], density: float, quantize: bool, value_format: str,
              group_size: int, value_dtype: torch.dtype, capacity_factor: float = 2.0) -> "FixedPlan":
        """The plan of a bucket (see the class); ``density`` only matters for sparsified tensors."""
        bits = position_bits(density)
        counts = tuple(capacity(c, density, capacity_factor) if s else c for c, s in zip(chunks, sparse))
        groups = tuple(-(-k // group_size) if quantize else 0 for k in counts)
        n_chunks = tuple(-(-c // (1 << bits)) if s else 0 for c, s in zip(chunks, sparse))
        return FixedPlan(tuple(chunks), tuple(bool(s) for s in sparse), float(density), bool(quantize),
                         value_format, int(group_size), value_dtype, float(capacity_factor), bits, counts, groups,
                         n_chunks)

    @property
    def values(self) -> int:
        """K: value slots per row."""
        return sum(self.counts)

    @property
    def indexed(self) -> int:
        """Value slots per row that carry a position (those of sparsified tensors)."""
        return sum(k for k, s in zip(self.counts, self.sparse) if s)

    @property
    def n_groups(self) -> int:
        return sum(self.groups)

    @property
    def value_bytes(self) -> int:
        if self.quantize:
            return value_code_bytes(self.values, self.value_format)
        return self.values * torch.empty(0, dtype=self.value_dtype).element_size()

    @property
    def count_bytes(self) -> int:
        """Bytes of the chunk counts (uint16 each)."""
        return 2 * sum(self.n_chunks)

    @property
    def offset_bits(self) -> int:
        """Bits each in-chunk offset travels in (15-bit offsets in 16)."""
        return 16 if self.bits == 15 else self.bits

    @property
    def position_bytes(self) -> int:
        return -(-self.indexed * self.offset_bits // 8)

    @property
    def payload_bytes(self) -> int:
        """Bytes of one row's payload, padding included: what every row sends to every other."""
        n = HEADER_BYTES + 4 * self.n_groups + self.value_bytes + self.count_bytes + self.position_bytes
        return n + (-n % 4)


class _Constants:
    """Index tensors of a plan on one device, made once (the first bucket of that shape) and reused."""

    def __init__(self, plan: FixedPlan, device):
        gs = max(plan.group_size, 1)
        slot, gid, col_base, indexed, slot_columns = [], [], [], [], []
        group0, col0, value0 = 0, 0, 0
        for c, s, k, g in zip(plan.chunks, plan.sparse, plan.counts, plan.groups):
            j = torch.arange(k)
            slot.append((group0 + j // gs) * gs + j % gs)
            gid.append(group0 + j // gs)
            if s:
                col_base.append(torch.full((k, ), col0))
                indexed.append(value0 + j)
                slot_columns.append(torch.full((k, ), c))
            else:
                col_base.append(col0 + j)
            group0, col0, value0 = group0 + g, col0 + c, value0 + k
        cat = lambda parts: (torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)).to(device)  # noqa: E731
        self.slot, self.gid, self.col_base = cat(slot), cat(gid), cat(col_base)
        self.indexed, self.slot_columns = cat(indexed), cat(slot_columns)
        real = torch.zeros(plan.n_groups * gs, dtype=torch.bool)
        if plan.quantize and slot:
            real[torch.cat(slot)] = True
        self.real_slot = real.view(plan.n_groups, gs).to(device)
        ternary = torch.tensor([3**i for i in range(TERNARY_PER_BYTE)], dtype=torch.int32)
        bits = VALUE_BITS.get(plan.value_format, 8)
        self.digit_weights = (ternary if plan.value_format == "int1" else
                              1 << (bits * torch.arange(8 // bits, dtype=torch.int32))).to(device)
        self.slots = {k: torch.arange(k).to(device) for k, s in zip(plan.counts, plan.sparse) if s}
        self.column_index = {c: torch.arange(c).to(device) for c, s in zip(plan.chunks, plan.sparse) if s}


_CONSTANTS: Dict[Tuple[FixedPlan, str], _Constants] = {}
MAX_PLANS = 256  # a density warm-up makes a plan per step: keep the latest ones


def constants(plan: FixedPlan, device) -> _Constants:
    """The plan's index tensors on ``device`` (cached; the oldest are dropped past ``MAX_PLANS``)."""
    key = (plan, str(device))
    if key not in _CONSTANTS:
        while len(_CONSTANTS) >= MAX_PLANS:
            _CONSTANTS.pop(next(iter(_CONSTANTS)))
        _CONSTANTS[key] = _Constants(plan, device)
    return _CONSTANTS[key]


# ---- selection -----------------------------------------------------------------------------------------


def sample_threshold(mag: torch.Tensor, k: int, sample: Optional[torch.Tensor], numel: int) -> torch.Tensor:
    """DGC's first estimate: the ``ceil(s * k / m)``-th largest of the ``s`` sampled magnitudes (0-d fp32).

    Args:
        mag: 1-D fp32 magnitudes (padding 0 after the ``numel`` real elements); k: target count, ``1 <= k``;
        sample: int64 positions into ``mag`` or None (all of it); numel: real elements m.
    """
    s = mag if sample is None else mag[sample]
    k_sample = max(1, math.ceil(s.numel() * k / numel))
    return torch.topk(s, min(k_sample, s.numel()), sorted=False).values.min()


def lowering_candidates(first: torch.Tensor) -> torch.Tensor:
    """The thresholds DGC's lowering rounds try, for several tensors at once: fp32 ``(T, 11)`` from the ``(T,)``
    first estimates, column j the estimate multiplied by 0.8 j times in fp32, one multiplication after the other
    (as :func:`~deepspeed_dgc.codec.selection.topk_threshold` does; ``cumprod`` accumulates in float64 on CPU)."""
    columns = [first]
    for _ in range(MAX_LOWER_ROUNDS):
        columns.append(columns[-1] * LOWER_FACTOR)
    return torch.stack(columns, dim=1)


def corrected_threshold(mag: torch.Tensor, k: int, candidates: torch.Tensor, numel: int) -> torch.Tensor:
    """DGC's two corrections on the device (0-d fp32, nothing read back): the first of ``candidates`` (descending,
    :func:`lowering_candidates`) that keeps at least 0.8 k elements, else the last; if that keeps more than 1.3 k,
    the k-th largest magnitude instead. All candidates are counted in one pass (``bucketize``); the k-th largest is
    computed whether or not it is taken.

    Args:
        mag: 1-D fp32 magnitudes (padding 0 after the ``numel`` real elements); k: target count, ``1 <= k``;
        candidates: fp32 ``(11,)``; numel: real elements m.
    """
    bucket = torch.bucketize(mag, candidates.flip(0), right=True)  # how many candidates each magnitude reaches
    reached = torch.zeros(candidates.numel() + 1, dtype=torch.long, device=mag.device).scatter_add_(
        0, bucket, torch.ones_like(bucket))
    kept = reached.flip(0).cumsum(0)[:candidates.numel()]  # kept[j]: elements >= candidates[j]
    enough = kept >= LOWER_SLACK * k
    enough[-1] = True  # the last round is taken when none keeps 0.8 k
    first = enough.int().argmax()
    threshold = candidates[first]
    if k < numel:
        kth = torch.topk(mag, k, sorted=False).values.min()
        threshold = torch.where(kept[first] > UPPER_SLACK * k, kth, threshold)
    return threshold


def threshold_on_device(mag: torch.Tensor, k: int, sample: Optional[torch.Tensor],
                        numel: Optional[int] = None) -> torch.Tensor:
    """DGC's sampled top-k threshold with both its corrections, as a 0-d device tensor (nothing read back).

    The exact layout's :func:`~deepspeed_dgc.codec.selection.topk_threshold`, bit for bit (Lin et al., ICLR 2018,
    section 3 and appendix): the ``ceil(s * k / m)``-th largest of the ``s`` sampled magnitudes; while it keeps
    fewer than 0.8 k elements it is multiplied by 0.8 in fp32, at most 10 times; if it then keeps more than 1.3 k
    it becomes the k-th largest magnitude. :func:`select` runs the same three steps with the rounds of all a
    bucket's tensors in one set of launches.

    Args:
        mag: 1-D fp32 magnitudes (padding 0 after the real elements); k: target count, ``1 <= k``;
        sample: int64 positions into ``mag`` or None (all of it); numel: real elements m (default ``mag.numel()``).
    """
    m = mag.numel() if numel is None else numel
    return corrected_threshold(mag, k, lowering_candidates(sample_threshold(mag, k, sample, m).view(1))[0], m)


def select(acc_m: torch.Tensor, plan: FixedPlan, targets: Sequence[int], samples: Sequence[Optional[torch.Tensor]],
           reals: Sequence[int]) -> Tuple[torch.Tensor, torch.Tensor]:
    """What every row sends: sparsified tensors by threshold and capacity, the others whole.

    Args:
        acc_m: fp32 ``(R, C)`` owner matrix (padding 0).
        plan: the bucket's :class:`FixedPlan`.
        targets: top-k target count k of each tensor (over its real elements).
        samples: per tensor, positions into its ``(R, c_i)`` block (flattened) to estimate the threshold on, or None.
        reals: real elements of each tensor (:meth:`~deepspeed_dgc.codec.job.CompressJob.real_totals`): the m of
            its threshold (the rest of its block is padding).

    Returns:
        ``(values, positions)``: fp32 ``(R, K)`` in payload order (0 in empty slots) and int64 ``(R, Ks)`` columns
        inside each tensor's slice, ascending per tensor, ``c_i`` in empty slots.
    """
    R = acc_m.shape[0]
    consts = constants(plan, acc_m.device)
    values, positions = [], []
    blocks, col = [], 0
    for c in plan.chunks:
        blocks.append(acc_m[:, col:col + c])
        col += c
    mags = {i: b.abs() for i, (b, s) in enumerate(zip(blocks, plan.sparse)) if s}
    firsts = [sample_threshold(mags[i].reshape(-1), targets[i], samples[i], reals[i]) for i in mags]
    candidates = dict(zip(mags, lowering_candidates(torch.stack(firsts)))) if firsts else {}
    for i, (block, c, cap) in enumerate(zip(blocks, plan.chunks, plan.counts)):
        if i not in mags:
            values.append(block)
            continue
        mag = mags[i]
        t = corrected_threshold(mag.reshape(-1), targets[i], candidates[i], reals[i])
        # unique keys: |acc| as ordered int bits, then the lower column; empty where below the threshold
        key = torch.where(mag >= t, (mag.view(torch.int32).long() << 32) + (c - 1 - consts.column_index[c]), -1)
        top = torch.topk(key, cap, dim=1, sorted=False)
        pos = torch.where(top.values >= 0, top.indices, c)
        pos = torch.sort(pos, dim=1).values
        values.append(torch.gather(block, 1, pos.clamp(max=c - 1)) * (pos < c))
        positions.append(pos)
    empty = acc_m.new_empty(R, 0)
    return (torch.cat(values, dim=1) if values else empty,
            torch.cat(positions, dim=1) if positions else empty.long())


# ---- values ----------------------------------------------------------------------------------------------


def quantize_rows(values: torch.Tensor, plan: FixedPlan,
                  generator: Optional[torch.Generator] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group-wise quantization of every row (see the module docstring for the formats).

    Args:
        values: fp32 ``(R, K)``; plan: its :class:`FixedPlan` (quantized).
        generator: stochastic rounding (INT4/INT2) from it; None: round to nearest.

    Returns:
        ``(scales, codes, decoded)``: fp32 ``(R, G)`` (INT2's three-level groups negative), uint8 ``(R, K)``
        unpacked codes, fp32 ``(R, K)`` what the receivers decode.
    """
    R, fmt, gs = values.shape[0], plan.value_format, plan.group_size
    consts = constants(plan, values.device)
    G = plan.n_groups
    v = values.new_zeros(R, G * gs).index_copy_(1, consts.slot, values).view(R, G, gs)
    mag = v.abs()
    amax = mag.amax(dim=2) if G else mag.new_zeros(R, 0)
    u = 0.5 if generator is None else torch.rand(v.shape, generator=generator, device=v.device)
    if fmt == "int4":
        s = amax / INT4_QMAX
        q = torch.floor(_divide_by_scale(v, s[..., None]) + u).clamp_(-INT4_QMAX, INT4_QMAX)
        codes, decoded, scales = q + 8, q * s[..., None], s
    elif fmt == "int2":
        mixed = ((v == 0) & consts.real_slot).any(dim=2) & (amax > 0)
        s4 = amax / INT2_LEVEL  # four levels (q + 0.5) s, q in [-2, 1]
        q4 = torch.floor(_divide_by_scale(v, s4[..., None]) - 0.5 + u).clamp_(-2, 1)
        q3 = torch.floor(_divide_by_scale(v, amax[..., None]) + u).clamp_(-1, 1)  # three levels q a, q in [-1, 1]
        m = mixed[..., None]
        codes = torch.where(m, q3 + 1, q4 + 2)
        decoded = torch.where(m, q3 * amax[..., None], (q4 + 0.5) * s4[..., None])
        scales = torch.where(mixed, -amax, s4)
    elif fmt == "int1":
        s = int1_mean(mag.sum(dim=2), (mag * INT1_DOWN).sum(dim=2), (mag > 0).sum(dim=2).clamp(min=1))
        sign = torch.sign(v)
        codes, decoded, scales = sign + 1, sign * s[..., None], s
    elif fmt in FP8_DTYPES:
        s = amax / FP8_MAX[fmt]
        c = _divide_by_scale(v, s[..., None]).to(FP8_DTYPES[fmt])
        codes, decoded, scales = c.view(torch.uint8), c.float() * s[..., None], s
    else:
        raise ValueError(f"unknown value format {fmt!r}; allowed: {', '.join(VALUE_BITS)}")
    flat = lambda t: t.reshape(R, G * gs).index_select(1, consts.slot)  # noqa: E731
    return scales, flat(codes).to(torch.uint8), flat(decoded)


def dequantize_rows(scales: torch.Tensor, codes: torch.Tensor, plan: FixedPlan) -> torch.Tensor:
    """Inverse of :func:`quantize_rows`: fp32 ``(W, K)`` from scales ``(W, G)`` and unpacked codes ``(W, K)``."""
    consts = constants(plan, codes.device)
    s = scales.index_select(1, consts.gid)
    fmt = plan.value_format
    if fmt in FP8_DTYPES:
        return codes.contiguous().view(FP8_DTYPES[fmt]).float() * s
    c = codes.float()
    if fmt == "int4":
        return (c - 8) * s
    if fmt == "int2":
        return torch.where(s < 0, (c - 1) * -s, (c - 1.5) * s)
    return (c - 1) * s  # int1


def pack_rows(codes: torch.Tensor, plan: FixedPlan) -> torch.Tensor:
    """Pack unpacked codes ``(R, K)`` row by row, little-endian (INT1: base 3, digit i of a byte weighing 3^i):
    ``(R, value_code_bytes(K, fmt))`` uint8."""
    R, K = codes.shape
    if plan.value_format in FP8_DTYPES:
        return codes
    weights = constants(plan, codes.device).digit_weights
    per = weights.numel()
    c = torch.nn.functional.pad(codes, (0, -K % per)).view(R, -1, per).to(torch.int32)
    return (c * weights).sum(dim=2).to(torch.uint8)


def unpack_rows(packed: torch.Tensor, plan: FixedPlan) -> torch.Tensor:
    """Inverse of :func:`pack_rows`: ``(W, K)`` uint8 codes."""
    W, fmt = packed.shape[0], plan.value_format
    if fmt in FP8_DTYPES:
        return packed
    weights = constants(plan, packed.device).digit_weights
    b = packed.to(torch.int32)[..., None]
    digits = (b // weights) % 3 if fmt == "int1" else (b // weights) & ((1 << VALUE_BITS[fmt]) - 1)
    return digits.view(W, -1)[:, :plan.values].to(torch.uint8)


def pack_positions(positions: torch.Tensor, bits: int) -> torch.Tensor:
    """b-bit positions ``(R, Ks)`` as little-endian bytes ``(R, ceil(Ks * bits / 8))`` (12 bits: 3 bytes per pair)."""
    R, n = positions.shape
    p = positions.to(torch.int32)
    if bits == 8:
        return p.to(torch.uint8)
    if bits == 16:
        return torch.stack([p & 0xFF, p >> 8], dim=2).view(R, 2 * n).to(torch.uint8)
    pairs = torch.nn.functional.pad(p, (0, n % 2)).view(R, -1, 2)
    a, b = pairs[..., 0], pairs[..., 1]
    out = torch.stack([a & 0xFF, (a >> 8) | ((b & 0xF) << 4), b >> 4], dim=2).view(R, -1)
    return out[:, :-(-n * 12 // 8)].to(torch.uint8)


def unpack_positions(data: torch.Tensor, count: int, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_positions`: int64 ``(W, count)``."""
    W = data.shape[0]
    d = data.long()
    if bits == 8:
        return d[:, :count]
    if bits == 16:
        pairs = d.view(W, -1, 2)
        return (pairs[..., 0] | (pairs[..., 1] << 8))[:, :count]
    d = torch.nn.functional.pad(d, (0, -d.shape[1] % 3)).view(W, -1, 3)
    a = d[..., 0] | ((d[..., 1] & 0xF) << 8)
    b = (d[..., 1] >> 4) | (d[..., 2] << 4)
    return torch.stack([a, b], dim=2).view(W, -1)[:, :count]


# ---- payloads -----------------------------------------------------------------------------------------


def encode_positions(positions: torch.Tensor, plan: FixedPlan) -> torch.Tensor:
    """Chunk counts (uint16) then b-bit in-chunk offsets of every sparsified tensor's slots: uint8 ``(R, count_bytes
    + position_bytes)``. ``positions`` as :func:`select` gives them (``c_i`` in empty slots)."""
    R, device = positions.shape[0], positions.device
    counts, offsets, at = [], [], 0
    for c, s, cap, n_chunks in zip(plan.chunks, plan.sparse, plan.counts, plan.n_chunks):
        if not s:
            continue
        pos = positions[:, at:at + cap]
        at += cap
        valid = pos < c
        chunk = torch.where(valid, pos >> plan.bits, n_chunks)
        per_chunk = torch.zeros(R, n_chunks + 1, dtype=torch.int32, device=device).scatter_add_(
            1, chunk, torch.ones_like(chunk, dtype=torch.int32))[:, :n_chunks]
        counts.append(per_chunk)
        offsets.append(torch.where(valid, pos & ((1 << plan.bits) - 1), 0))
    if not counts:
        return torch.empty(R, 0, dtype=torch.uint8, device=device)
    per_chunk = torch.cat(counts, dim=1)
    count_bytes = torch.stack([per_chunk & 0xFF, per_chunk >> 8], dim=2).view(R, -1).to(torch.uint8)
    return torch.cat([count_bytes, pack_positions(torch.cat(offsets, dim=1), plan.offset_bits)], dim=1)


def decode_positions(data: torch.Tensor, plan: FixedPlan) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`encode_positions` for W payloads, checked on the device.

    Returns:
        ``(positions, valid, bad)``: int64 ``(W, Ks)`` columns inside each tensor's slice (0 in empty slots), bool
        ``(W, Ks)`` for the filled slots, bool ``(W,)`` for payloads whose counts or positions do not fit the plan.
    """
    W, device = data.shape[0], data.device
    raw = data[:, :plan.count_bytes].long().view(W, -1, 2)
    per_chunk = raw[..., 0] | (raw[..., 1] << 8)
    offsets = unpack_positions(data[:, plan.count_bytes:], plan.indexed, plan.offset_bits)
    consts = constants(plan, device)
    positions, valid, bad = [], [], torch.zeros(W, dtype=torch.bool, device=device)
    at_chunk, at_slot = 0, 0
    for c, s, cap, n_chunks in zip(plan.chunks, plan.sparse, plan.counts, plan.n_chunks):
        if not s:
            continue
        counts = per_chunk[:, at_chunk:at_chunk + n_chunks]
        off = offsets[:, at_slot:at_slot + cap]
        at_chunk, at_slot = at_chunk + n_chunks, at_slot + cap
        ends = counts.cumsum(dim=1)
        slots = consts.slots[cap].expand(W, cap).contiguous()
        chunk = torch.searchsorted(ends, slots, right=True)
        filled = slots < ends[:, -1:]
        pos = chunk * (1 << plan.bits) + off
        bad |= (ends[:, -1] > cap) | (counts > (1 << plan.bits)).any(dim=1) | (filled & (pos >= c)).any(dim=1)
        ok = filled & (pos < c)
        positions.append(torch.where(ok, pos, 0))
        valid.append(ok)
    if not positions:
        empty = torch.empty(W, 0, dtype=torch.long, device=device)
        return empty, empty.bool(), bad
    return torch.cat(positions, dim=1), torch.cat(valid, dim=1), bad


def encode_values(values: torch.Tensor, plan: FixedPlan, raw_scale: float = 1.0,
                  generator: Optional[torch.Generator] = None) -> Tuple[List[torch.Tensor], torch.Tensor]:
    """The value section of every row's payload (this layout's, and the equal-size payloads of
    :mod:`~deepspeed_dgc.codec.dct` and :mod:`~deepspeed_dgc.codec.masked`).

    Args:
        values: fp32 ``(R, K)``; plan: their codec (quantized, or raw ``value_dtype`` times ``raw_scale``).
        generator: stochastic rounding (INT4/INT2).

    Returns:
        ``(parts, decoded)``: uint8 ``(R, .)`` sections (fp32 scales then packed codes, or the raw values) and fp32
        ``(R, K)``, what the receivers decode.
    """
    from .wire import raw_decode, raw_encode
    if plan.quantize:
        scales, codes, decoded = quantize_rows(values, plan, generator)
        return [scales.contiguous().view(torch.uint8), pack_rows(codes, plan)], decoded
    raw = raw_encode(values, plan.value_dtype, raw_scale)
    return [raw.contiguous().view(torch.uint8).view(values.shape[0], -1)], raw_decode(raw, raw_scale)


def decode_values(received: torch.Tensor, offset: int, plan: FixedPlan,
                  raw_scale: float = 1.0) -> Tuple[torch.Tensor, int]:
    """Inverse of :func:`encode_values` for W payloads whose value section starts at byte ``offset``: fp32
    ``(W, K)`` and the offset past the section."""
    if plan.quantize:
        scales = received[:, offset:offset + 4 * plan.n_groups].contiguous().view(torch.float32)
        offset += 4 * plan.n_groups
        values = dequantize_rows(scales, unpack_rows(received[:, offset:offset + plan.value_bytes], plan), plan)
    else:
        from .wire import raw_decode
        values = raw_decode(received[:, offset:offset + plan.value_bytes].contiguous().view(plan.value_dtype),
                            raw_scale)
    return values, offset + plan.value_bytes


def header_mismatch(received: torch.Tensor, magic: int, fingerprint: int) -> torch.Tensor:
    """Bool ``(W,)``: the payloads whose ``int32`` header does not start with ``magic, fingerprint`` (on the device)."""
    header = received[:, :HEADER_BYTES].contiguous().view(torch.int32)
    return (header[:, 0] != magic) | (header[:, 1] != fingerprint)


def encode_rows(values: torch.Tensor, positions: torch.Tensor, plan: FixedPlan, fingerprint: int,
                not_finite: torch.Tensor, raw_scale: float = 1.0,
                generator: Optional[torch.Generator] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Every row's payload, and what the receivers will decode.

    Args:
        values: fp32 ``(R, K)`` and positions int64 ``(R, Ks)`` from :func:`select`.
        plan: the bucket's plan; fingerprint: int31 of config and bucket (:func:`~deepspeed_dgc.codec.wire.fingerprint`).
        not_finite: 0-d bool tensor, True when this rank's input held Inf/NaN (flagged in every header).
        raw_scale: raw values travel multiplied by it; generator: stochastic rounding.

    Returns:
        ``(payloads, decoded)``: uint8 ``(R, payload_bytes)`` and fp32 ``(R, K)`` (0 in empty slots).
    """
    R, device = values.shape[0], values.device
    header = torch.empty(R, 3, dtype=torch.int32, device=device)
    header[:, 0] = MAGIC
    header[:, 1] = fingerprint
    header[:, 2] = not_finite.to(torch.int32) * FLAG_NOT_FINITE
    value_parts, decoded = encode_values(values, plan, raw_scale, generator)
    parts = [header.view(torch.uint8)] + value_parts
    parts.append(encode_positions(positions, plan))
    n = sum(p.shape[1] for p in parts)
    if n % 4:
        parts.append(torch.zeros(R, -n % 4, dtype=torch.uint8, device=device))
    return torch.cat(parts, dim=1), decoded


def columns(positions: torch.Tensor, plan: FixedPlan) -> torch.Tensor:
    """Row columns ``(W, K)`` of every value slot, for positions ``(W, Ks)`` inside the tensors' slices (empty
    slots at any position inside the slice: they carry 0)."""
    consts = constants(plan, positions.device)
    cols = consts.col_base.expand(positions.shape[0], -1).clone()
    if positions.shape[1]:
        cols[:, consts.indexed] += positions
    return cols


def decode_sum_rows(received: torch.Tensor, plan: FixedPlan, fingerprint: int, row_numel: int,
                    raw_scale: float = 1.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """Decode every sender's payload for this row and sum them, in sender order, into a dense fp32 row.

    Args:
        received: uint8 ``(W, payload_bytes)``, row s from sender s.
        plan: the bucket's plan; fingerprint: expected in every header; row_numel: C.
        raw_scale: raw values arrive multiplied by it.

    Returns:
        ``(row, bad)``: fp32 ``(C,)`` (all NaN when a sender's input was not finite or a payload is bad) and bool
        ``(W,)``, True for the senders whose payload does not match this rank's plan (a device tensor: nothing is
        read on the host).
    """
    W, device = received.shape[0], received.device
    header = received[:, :HEADER_BYTES].contiguous().view(torch.int32)
    values, off = decode_values(received, HEADER_BYTES, plan, raw_scale)
    positions, valid, bad = decode_positions(received[:, off:off + plan.count_bytes + plan.position_bytes], plan)
    bad |= header_mismatch(received, MAGIC, fingerprint)
    if positions.shape[1]:  # an empty slot adds nothing, whatever its value says
        values[:, constants(plan, device).indexed] *= valid
    cols = columns(positions, plan)
    out = torch.zeros(row_numel, dtype=torch.float32, device=device)
    for s in range(W):
        out.index_add_(0, cols[s], values[s])
    poison = bad.any() | ((header[:, 2] & FLAG_NOT_FINITE) != 0).any()
    return out.masked_fill_(poison, float("nan")), bad


def sent_matrix(decoded: torch.Tensor, positions: torch.Tensor, plan: FixedPlan, row_numel: int) -> torch.Tensor:
    """What this rank sent, as an fp32 ``(R, C)`` matrix (0 where nothing was sent): for the residuals. ``positions``
    as :func:`select` gives them (``c_i`` in empty slots, whose values are 0)."""
    consts = constants(plan, positions.device)
    inside = torch.minimum(positions, consts.slot_columns - 1) if positions.shape[1] else positions
    cols = columns(inside, plan)
    return decoded.new_zeros(decoded.shape[0], row_numel).scatter_add_(1, cols, decoded)


def residual_rows(acc_m: torch.Tensor, sent_m: torch.Tensor, chunks: Sequence[int],
                  residual_numels: Sequence[int]) -> List[torch.Tensor]:
    """The new residual of each tensor, ``acc - sent`` (unsent elements keep ``acc`` exactly), clipped to its
    residual length."""
    res_m = acc_m - sent_m
    out, col = [], 0
    for c, rn in zip(chunks, residual_numels):
        out.append(res_m[:, col:col + c].reshape(-1)[:rn].clone())
        col += c
    return out
