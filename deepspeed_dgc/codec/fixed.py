"""The fixed layout: one bucket's payloads, every size known from its shape and density, coded in batched ops.

This is the device path (``"layout": "fixed"``, the default on GPUs): the host only launches work, a fixed number of
launches per bucket whatever its tensors, and reads nothing back. One ``all_to_all_single`` of equal rows per bucket.

The bucket is a padded owner matrix ``A`` (:class:`~deepspeed_dgc.codec.layout.BucketLayout`): R rows (owners), every
tensor a block of ``w_i = roundup(c_i, align)`` columns, ``align`` a multiple of the scale group and of the residual
storage's group (128). Tensors sent whole come first; sparsified ones after them.

Tensors sent whole: every column of their blocks is coded, padding included (it is zero and decodes to zero), in scale
groups of ``group_size`` columns; nothing but the codes and scales travel.

Sparsified tensors (:func:`select`): DGC's sampled top-k threshold of the whole tensor (Lin et al., ICLR 2018,
section 3 and appendix: the ``ceil(s k / m)``-th largest of about 1% sampled magnitudes, lowered by 0.8 while it keeps
fewer than 0.8 k, at most 10 times; every candidate counted in one pass), then each owner's slice sends what reaches
the threshold up to a fixed **capacity** of ``roundup(ceil(capacity_factor * density * c), group_size)`` values,
the largest first, ties by the lower column: Ok-Topk's cut above capacity (Li and Hoefler, PPoPP 2022, section 3.1),
per owner, found by a radix select over the magnitudes' bits (four passes of one byte). DGC's upper correction (the
k-th largest where the threshold keeps more than 1.3 k) is not run: the capacity bounds what a slice sends, and the
slots are paid for whether filled or not. Exact zeros are never selected (they arrive as zeros anyway). A tensor whose
sparse payload would not be smaller than sending it whole is sent whole.

Positions: the slice is cut into chunks of ``2^b`` columns; each payload carries the number of values of every chunk
(uint16) and, per value slot, its b-bit offset inside its chunk, b the smallest of 8, 12, 15 whose chunks hold at least
4 values at the density (:func:`position_bits`). Empty slots carry value 0 and offset 0.

Values: a format of :data:`~deepspeed_dgc.codec.formats.FORMATS` on groups of ``group_size`` (the whole-sent columns,
then the slots; every group within one tensor), or raw values in the communication dtype times ``raw_scale``.

Payload of one owner row (:attr:`FixedPlan.payload_bytes` bytes)::

    int32[3]  header: MAGIC, fingerprint, flags (bit 0: the sender's input was not finite)
    fp32[G]   group scales (quantized formats only): the whole-sent columns' groups, then the slots'
    values    codes of the whole-sent columns then of the slots, packed (INT4 two a byte, INT2 four, INT1 five
              ternary, FP8 one); or raw values
    uint16[]  per sparsified tensor, the values of each of its chunks
    bytes     per sparsified tensor, the b-bit in-chunk offsets of its slots (12 bits: 3 bytes per pair)
    zeros     padding to a multiple of 4 bytes

The receiver checks the headers and positions on the device: a wrong magic or fingerprint (another config or bucket),
chunk counts past the capacity or a position past the slice set a flag and fill the row with NaN (so the step is
skipped on every rank); the flag is read on the host only after a skipped step. A sender whose input was not finite
makes every row NaN the same way. Senders are summed in rank order.

Memory: the owner matrix is the one fp32 copy of the bucket; temporaries come from a
:class:`~deepspeed_dgc.codec.layout.Workspace` (the bucket's gradients once read) and the owner matrix becomes the
residual in place.
"""

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Dict, List, Optional, Tuple

import torch

from .formats import FORMATS, code_bytes, pack_codes, unpack_codes
from .layout import BucketLayout, Workspace, alignment, layout_for, round_up
from .selection import LOWER_FACTOR, LOWER_SLACK, MAX_LOWER_ROUNDS, MAX_RUN, MIN_SAMPLE, RUN_MIN_NUMEL, sample_size, \
    target_count

MAGIC = 0x44474347  # "DGCG": aligned blocks, batched (the layout of an earlier version, "DGCF", does not decode)
HEADER_BYTES = 12
FLAG_NOT_FINITE = 1
POSITION_BITS = (8, 12, 15)  # offsets of 15 bits travel in 16; a chunk's count always fits a uint16
MIN_PER_CHUNK = 4
RESIDUAL_GROUP = 128  # the fp8 residual storage's group: blocks are aligned to it too
LEVELS = MAX_LOWER_ROUNDS + 1  # DGC's candidate thresholds


def position_bits(density: float) -> int:
    """Bits per in-chunk offset (and ``log2`` of the chunk length) at ``density``: the smallest of 8, 12, 15 whose
    chunks hold at least ``MIN_PER_CHUNK`` values, so a chunk's count (16 bits) costs at most 4 bits per value."""
    for bits in POSITION_BITS:
        if density * (1 << bits) >= MIN_PER_CHUNK:
            return bits
    return POSITION_BITS[-1]


def capacity(columns: int, density: float, factor: float) -> int:
    """Values an owner's slice of ``columns`` reaching the threshold may send: ``ceil(factor * density * columns)``, at
    most ``columns`` (before the rounding up to whole scale groups, :attr:`FixedPlan.slots`)."""
    return min(columns, math.ceil(factor * density * columns))


def value_bits(quantize: bool, value_format: str, value_dtype: torch.dtype) -> float:
    """Bits one value costs on the wire: its format's (INT1 ternary: 1.6) or its raw dtype's."""
    if quantize:
        return 8.0 / FORMATS[value_format].per_byte
    return 8.0 * torch.empty(0, dtype=value_dtype).element_size()


@dataclass(frozen=True)
class FixedPlan:
    """Sizes of one bucket's payloads, from its shape and codec only (every rank computes the same).

    Attributes:
        numels, world, owners: the bucket's tensors, the partition group's size and each row's owner.
        sparse: per tensor (bucket order), whether it is sparsified (a tensor asked to be whose sparse payload would
            not be smaller is sent whole).
        density: of the sparsified tensors; bits: per in-chunk offset (chunks of ``2^bits`` columns).
        quantize, value_format, group_size: the value codec (``quantize`` False: raw ``value_dtype`` values).
        capacity_factor: a sparsified slice sends at most ``capacity(c, density, factor)`` values, in
            ``slots`` (rounded up to whole scale groups) slots.
    """
    numels: Tuple[int, ...]
    world: int
    owners: Tuple[int, ...]
    sparse: Tuple[bool, ...]
    density: float
    quantize: bool
    value_format: str
    group_size: int
    value_dtype: torch.dtype
    capacity_factor: float
    bits: int

    @staticmethod
    def build(numels, world: int, owners, sparse, density: float, quantize: bool, value_format: str, group_size: int,
              value_dtype: torch.dtype, capacity_factor: float = 2.0) -> "FixedPlan":
        """The plan of a bucket: ``sparse`` says which tensors are asked to be sparsified; those whose sparse payload
        would cost as much as sending them whole are sent whole."""
        bits = position_bits(density)
        gs = group_size if quantize else 1
        align = alignment(gs, RESIDUAL_GROUP)
        vbits = value_bits(quantize, value_format, value_dtype)
        offset_bits = 16 if bits == 15 else bits
        pays = []
        for n, want in zip(numels, sparse):
            c = -(-n // world)
            if not want or density >= 1.0:
                pays.append(False)
                continue
            slots = min(round_up(capacity(c, density, capacity_factor), gs), round_up(c, align))
            chunks = -(-c // (1 << bits))
            sparse_bits = slots * (vbits + offset_bits) + 16 * chunks + (32 * slots // gs if quantize else 0)
            whole_bits = round_up(c, align) * vbits + (32 * round_up(c, align) // gs if quantize else 0)
            pays.append(sparse_bits < whole_bits)
        return FixedPlan(tuple(int(n) for n in numels), int(world), tuple(int(o) for o in owners), tuple(pays),
                         float(density), bool(quantize), value_format, int(group_size), value_dtype,
                         float(capacity_factor), bits)

    # ---- sizes -----------------------------------------------------------------------------------------------

    @property
    def group(self) -> int:
        """Values per scale (1 for raw values)."""
        return self.group_size if self.quantize else 1

    @cached_property
    def layout(self) -> BucketLayout:
        return layout_for(self.numels, self.world, self.owners, alignment(self.group, RESIDUAL_GROUP),
                          [not s for s in self.sparse])

    @property
    def rows(self) -> int:
        return len(self.owners)

    @cached_property
    def sparse_tensors(self) -> List[int]:
        """The sparsified tensors in column order."""
        return self.layout.region(False)

    @cached_property
    def slots(self) -> Tuple[int, ...]:
        """Value slots per row of each sparsified tensor (column order): its capacity rounded up to whole groups."""
        L = self.layout
        return tuple(min(round_up(capacity(L.chunks[i], self.density, self.capacity_factor), self.group), L.widths[i])
                     for i in self.sparse_tensors)

    @cached_property
    def n_chunks(self) -> Tuple[int, ...]:
        """Chunks of ``2^bits`` columns of each sparsified tensor's slice (column order)."""
        return tuple(-(-self.layout.chunks[i] // (1 << self.bits)) for i in self.sparse_tensors)

    @property
    def dense_columns(self) -> int:
        """Columns sent whole (the first region of the layout)."""
        return self.layout.split

    @property
    def sparse_slots(self) -> int:
        return sum(self.slots)

    @property
    def values(self) -> int:
        """K: value slots per row (the whole-sent columns and the sparse slots)."""
        return self.dense_columns + self.sparse_slots

    @property
    def n_groups(self) -> int:
        return self.values // self.group_size if self.quantize else 0

    @property
    def packed_values(self) -> int:
        """K rounded up to a whole number of bytes' worth of codes."""
        return round_up(self.values, FORMATS[self.value_format].per_byte) if self.quantize else self.values

    @property
    def value_bytes(self) -> int:
        if self.quantize:
            return code_bytes(self.values, self.value_format)
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
        return -(-self.sparse_slots * self.offset_bits // 8)

    @property
    def sections(self) -> Tuple[int, int, int, int]:
        """Byte offsets in a payload row of the scales, the values, the chunk counts and the offsets."""
        scales = HEADER_BYTES
        values = scales + 4 * self.n_groups
        counts = values + self.value_bytes
        return scales, values, counts, counts + self.count_bytes

    @property
    def payload_bytes(self) -> int:
        """Bytes of one row's payload, padding included: what every row sends to every other."""
        n = self.sections[3] + self.position_bytes
        return n + (-n % 4)

    @property
    def kept(self) -> int:
        """Values one sender sends, all rows (slots counted whether filled or not)."""
        return self.rows * self.values


# ---- small device tensors of a plan -------------------------------------------------------------------------------


class _Meta:
    """O(tensors) device vectors of a plan's sparsified tensors (column order), made once per device."""

    def __init__(self, plan: FixedPlan, device):
        L = plan.layout
        idx = plan.sparse_tensors
        split = plan.dense_columns
        t = lambda xs, dtype=torch.long: _to_device(torch.tensor(list(xs), dtype=dtype), device)  # noqa: E731
        self.chunks = t(L.chunks[i] for i in idx)
        self.start = t(L.cols[i] - split for i in idx)  # first column in the sparse region
        self.groups = t(L.widths[i] // L.align for i in idx)  # align-column groups per tensor
        self.slots = t(plan.slots)
        self.slot_base = t([0] + list(_cumsum(plan.slots))[:-1])
        self.n_chunks = t(plan.n_chunks)
        self.chunk_base = t([0] + list(_cumsum(n + 1 for n in plan.n_chunks))[:-1])  # one gap bin after each tensor
        reals = [sum(row[i] for row in L.real) for i in idx]
        self.reals = t(reals)
        self.targets = t(target_count(m, plan.density) if m else 1 for m in reals)
        # sample plan: (kind, count) per tensor; kinds 0 whole, 1 independent positions, 2 runs of MAX_RUN
        kinds, draws, highs = [], [], []
        for m, k in zip(reals, (target_count(m, plan.density) if m else 1 for m in reals)):
            if k >= m or m <= MIN_SAMPLE:
                kinds.append(0), draws.append(m), highs.append(m)
            elif m >= RUN_MIN_NUMEL:
                kinds.append(2), draws.append(sample_size(m) // MAX_RUN), highs.append(m // MAX_RUN)
            else:
                kinds.append(1), draws.append(sample_size(m)), highs.append(m)
        self.kinds, self.draws = kinds, draws
        self.sample_sizes = [d * (MAX_RUN if kd == 2 else 1) for kd, d in zip(kinds, draws)]
        self.highs = t(highs, torch.float64)


def _cumsum(xs):
    total = 0
    for x in xs:
        total += x
        yield total


def _to_device(t: torch.Tensor, device) -> torch.Tensor:
    device = torch.device(device)
    return t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)


_META: Dict[Tuple[FixedPlan, str], _Meta] = {}
MAX_PLANS = 64  # a density warm-up makes a plan per step: keep the latest ones


def meta(plan: FixedPlan, device) -> _Meta:
    key = (plan, str(device))
    if key not in _META:
        while len(_META) >= MAX_PLANS:
            _META.pop(next(iter(_META)))
        _META[key] = _Meta(plan, device)
    return _META[key]


def _expand(values: torch.Tensor, repeats: torch.Tensor, total: int) -> torch.Tensor:
    """``values[i]`` repeated ``repeats[i]`` times (``total`` their sum, known on the host: no read-back)."""
    return torch.repeat_interleave(values, repeats, output_size=total)


# ---- selection ----------------------------------------------------------------------------------------------------


def draw_sample(plan: FixedPlan, generator: Optional[torch.Generator], device) -> Tuple[torch.Tensor, torch.Tensor]:
    """DGC's threshold sample of every sparsified tensor at once: ``(positions, tensor)``, int64 ``(S,)`` each, the
    element index inside the tensor's real elements (row-major over its rows) and the tensor (column order) it
    belongs to. A tensor of at most 1024 elements (or whose k keeps all) is its whole sample; from 2^21 elements the
    sample is drawn as runs of 16 (:func:`~deepspeed_dgc.codec.selection.sample_indices`). One uniform draw in float64
    for all the independent positions and run starts."""
    m = meta(plan, device)
    T = len(m.kinds)
    drawn = [d if kd else 0 for kd, d in zip(m.kinds, m.draws)]
    whole = [d if not kd else 0 for kd, d in zip(m.kinds, m.draws)]
    parts_pos, parts_tid = [], []
    ids = torch.arange(T, device=device)
    if sum(drawn):
        n = sum(drawn)
        u = torch.rand(n, dtype=torch.float64, device=device, generator=generator)
        first = u.mul_(_expand(m.highs, _host(drawn, device), n)).long()
        tid = _expand(ids, _host(drawn, device), n)
        runs = [kd == 2 for kd in m.kinds]
        if any(runs):  # runs of MAX_RUN: their draws become run starts, every position of a run follows
            length = torch.where(_host(runs, device, torch.bool), MAX_RUN, 1)[tid]
            first = torch.where(length > 1, first * MAX_RUN, first)
            reps = length
            total = sum(d * (MAX_RUN if r else 1) for d, r in zip(drawn, runs))
            starts = _expand(first, reps, total)
            tid = _expand(tid, reps, total)
            offset = torch.arange(total, device=device) - _expand(torch.cumsum(reps, 0) - reps, reps, total)
            first = starts + offset
        parts_pos.append(first)
        parts_tid.append(tid)
    if sum(whole):
        n = sum(whole)
        tid = _expand(ids, _host(whole, device), n)
        base = torch.cumsum(_host(whole, device), 0) - _host(whole, device)
        parts_pos.append(torch.arange(n, device=device) - base[tid])
        parts_tid.append(tid)
    if not parts_pos:
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return empty, empty
    return torch.cat(parts_pos), torch.cat(parts_tid)


_HOST: Dict[Tuple, torch.Tensor] = {}


def _host(xs, device, dtype=torch.long) -> torch.Tensor:
    """A small host list as a device tensor, cached (the plans' per-tensor constants)."""
    key = (tuple(xs), str(device), dtype)
    if key not in _HOST:
        if len(_HOST) > 4096:
            _HOST.clear()
        _HOST[key] = _to_device(torch.tensor(list(xs), dtype=dtype), device)
    return _HOST[key]


def first_estimates(A: torch.Tensor, plan: FixedPlan, positions: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """DGC's first threshold of every sparsified tensor: the ``ceil(s k / m)``-th largest of its ``s`` sampled
    magnitudes, all tensors in one sort (key: tensor, then magnitude descending). fp32 ``(T_s,)``."""
    L, m = plan.layout, meta(plan, A.device)
    C = L.columns
    c = m.chunks[tensor]
    flat = (positions // c) * C + plan.dense_columns + m.start[tensor] + positions % c
    mags = A.view(-1)[flat].abs_()
    key = (tensor << 32) | (0x7FFFFFFF - mags.view(torch.int32).long())
    key = torch.sort(key).values
    sizes = m.sample_sizes
    k_sample = [max(1, math.ceil(s * k / r)) if r else 1
                for s, k, r in zip(sizes, (target_count(r, plan.density) if r else 1 for r in _reals(plan)), _reals(plan))]
    at = [b + min(k, s) - 1 for b, k, s in zip([0] + list(_cumsum(sizes))[:-1], k_sample, sizes)]
    bits = 0x7FFFFFFF - (key[_host(at, A.device)] & 0xFFFFFFFF)
    return bits.to(torch.int32).view(torch.float32)


def _reals(plan: FixedPlan) -> List[int]:
    L = plan.layout
    return [sum(row[i] for row in L.real) for i in plan.sparse_tensors]


def lowering_candidates(first: torch.Tensor) -> torch.Tensor:
    """The thresholds DGC's lowering rounds try, for several tensors at once: fp32 ``(T, 11)`` from the ``(T,)``
    first estimates, column j the estimate multiplied by 0.8 j times in fp32, one multiplication after the other
    (as :func:`~deepspeed_dgc.codec.selection.topk_threshold` does)."""
    columns = [first]
    for _ in range(MAX_LOWER_ROUNDS):
        columns.append(columns[-1] * LOWER_FACTOR)
    return torch.stack(columns, dim=1)


def _smallest_positive(t: torch.Tensor) -> torch.Tensor:
    """``t`` (fp32) raised to the smallest positive float where it is lower: a threshold never selects exact zeros."""
    return t.view(torch.int32).clamp(min=1).view(torch.float32)


@dataclass
class Selection:
    """What the sparsified tensors send, per row (the ``K_s`` slots of the plan, tensor by tensor in column order).

    Attributes:
        valid: bool ``(R, K_s)``, the filled slots;
        values: fp32 ``(R, K_s)``, 0 in empty slots; positions: int32 ``(R, K_s)``, the column inside the tensor's
        slice (past its last chunk in empty slots); flat: int32 or int64 ``(R, K_s)``, the element of the owner matrix
        each slot came from (the tensor's first column of the row for empty slots, which send 0).
    """
    values: torch.Tensor
    positions: torch.Tensor
    flat: torch.Tensor
    valid: torch.Tensor


def select(A: torch.Tensor, plan: FixedPlan, ws: Workspace, generator: Optional[torch.Generator]) -> Selection:
    """DGC's threshold per sparsified tensor and the capacity cut per owner slice, in a fixed number of batched ops
    (see the module docstring). ``A``: the owner matrix ``(R, C)``, contiguous; read only."""
    R, device = A.shape[0], A.device
    L, m = plan.layout, meta(plan, device)
    T = len(plan.sparse_tensors)
    a, split = L.align, plan.dense_columns
    S = A[:, split:]  # (R, Cs)
    Cs = S.shape[1]
    G = Cs // a
    group_tensor = _expand(torch.arange(T, device=device), m.groups, G)  # (G,)

    # DGC's threshold: first estimates, the lowering rounds' candidates, every candidate counted in one pass
    positions, tensor = draw_sample(plan, generator, device)
    cand = _smallest_positive(lowering_candidates(first_estimates(A, plan, positions, tensor)))  # (T, 11) descending
    del positions, tensor
    mark = ws.mark()
    mag = torch.abs(S, out=ws.take((R, Cs), torch.float32)).view(R, G, a)
    level = torch.zeros(R, G, a, dtype=torch.uint8, device=device)
    reached = ws.take((R, G, a), torch.bool)
    cand_g = cand[group_tensor]  # (G, 11)
    for j in range(LEVELS):
        level.add_(torch.ge(mag, cand_g[None, :, j:j + 1], out=reached))
    ws.release(mark)
    # histogram of (row, tensor, level): count_ge[r, i, j] = elements of slice (r, i) with |a| >= cand[i, j]
    slice_of_group = (torch.arange(R, device=device)[:, None] * T + group_tensor[None, :])  # (R, G)
    bins = ws.take((R, G, a), torch.int32)
    bins.copy_(level)
    bins.add_((slice_of_group * (LEVELS + 1)).to(torch.int32)[..., None])
    hist = torch.bincount(bins.view(-1), minlength=R * T * (LEVELS + 1)).view(R, T, LEVELS + 1)
    ws.release(mark)
    del level, bins
    above = hist.flip(-1).cumsum(-1).flip(-1)  # above[l] = elements reaching level l or more
    count_ge = above[..., LEVELS - torch.arange(LEVELS, device=device)]  # (R, T, 11): level >= 11 - j
    total = count_ge.sum(dim=0)  # (T, 11)
    enough = total >= LOWER_SLACK * m.targets[:, None]
    enough[:, -1] = True  # the last round is taken when none keeps 0.8 k
    first = enough.int().argmax(dim=1)  # (T,)
    threshold = cand.gather(1, first[:, None])  # (T, 1)
    kept = count_ge.gather(2, first[None, :, None].expand(R, T, 1))[..., 0]  # (R, T) at the threshold

    # the capacity cut: the slots-th largest of each over-full slice (radix select over the magnitudes' bytes)
    over = kept > m.slots[None, :]
    bound, quota = _radix_select(A, S, plan, ws, group_tensor, slice_of_group, m.slots)
    bound = torch.where(over, bound, threshold.view(torch.int32).T.expand(R, T))
    quota = torch.where(over, quota, torch.full_like(quota, 255 + a))
    sel = _select_mask(S, plan, ws, group_tensor, bound, quota)
    return _compact(A, sel, plan, ws)


def _radix_select(A, S, plan, ws, group_tensor, slice_of_group, need):
    """Per slice (row, sparsified tensor), the bits of its ``need``-th largest magnitude and how many elements equal to
    it are among its ``need`` largest: four passes, one byte of the magnitudes' bits each, from the top (the sign bit
    cleared), each a histogram of the elements that match the bytes found so far."""
    R, device = A.shape[0], A.device
    T = need.numel()
    a = plan.layout.align
    Cs = S.shape[1]
    G = Cs // a
    byte_view = S.view(torch.uint8).view(R, Cs, 4)  # little-endian: byte 3 holds the sign and the high exponent
    prefix = torch.zeros(R, T, dtype=torch.int64, device=device)
    rank = need[None, :].expand(R, T).clone()
    for p in range(4):
        byte = 3 - p
        mark = ws.mark()
        digit = ws.take((R, Cs), torch.int32)
        digit.copy_(byte_view[..., byte])
        if p == 0:
            digit.bitwise_and_(0x7F)
        else:  # only elements whose higher bytes equal the prefix take part
            shift = 8 * (4 - p)
            lo = (prefix << shift)[:, group_tensor]  # (R, G) bit patterns, |a| in [lo, hi]
            hi = torch.clamp(((prefix + 1) << shift) - 1, max=0x7F800000)[:, group_tensor]
            lo_f = lo.to(torch.int32).view(torch.float32)[..., None]
            hi_f = hi.to(torch.int32).view(torch.float32)[..., None]
            inside = _abs_between(S.view(R, G, a), lo_f, hi_f, ws)
            digit.view(R, G, a).masked_fill_(inside.logical_not_(), 256)
            del inside
        bins = digit.view(R, G, a).add_((slice_of_group * 257).to(torch.int32)[..., None])
        hist = torch.bincount(bins.view(-1), minlength=R * T * 257).view(R, T, 257)[..., :256]
        ws.release(mark)
        above = hist.flip(-1).cumsum(-1).flip(-1)  # above[d]: matching elements with this byte >= d
        d = ((above >= rank[..., None]).sum(-1) - 1).clamp_(min=0)  # the byte of the rank-th largest
        higher = above.gather(2, (d + 1).clamp(max=255)[..., None])[..., 0]
        higher = torch.where(d < 255, higher, torch.zeros_like(higher))
        rank = rank - higher
        prefix = (prefix << 8) | d
    return prefix.to(torch.int32), rank


def _abs_between(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, ws: Workspace) -> torch.Tensor:
    """Bool ``lo <= |x| <= hi`` (``lo >= 0``), a new tensor; its temporaries from ``ws``."""
    mark = ws.mark()
    out = torch.ge(x, lo)
    tmp = ws.take(x.shape, torch.bool)
    other = ws.take(x.shape, torch.bool)
    out.logical_and_(torch.le(x, hi, out=tmp))
    torch.le(x, lo.neg(), out=other).logical_and_(torch.ge(x, hi.neg(), out=tmp))
    out.logical_or_(other)
    ws.release(mark)
    return out


def _select_mask(S, plan, ws, group_tensor, bound, quota) -> torch.Tensor:
    """Bool ``(R, Cs)``: the elements each slice sends: ``|a| > bound``, and of those equal to it the first ``quota``
    by column. ``bound``: int32 bits ``(R, T)``; ``quota``: ``(R, T)``."""
    R, Cs = S.shape
    a = plan.layout.align
    G = Cs // a
    x = S.view(R, G, a)
    b = bound[:, group_tensor].view(torch.float32)[..., None]  # (R, G, 1)
    mark = ws.mark()
    tmp = ws.take(x.shape, torch.bool)
    sel = torch.gt(x, b)
    sel.logical_or_(torch.lt(x, b.neg(), out=tmp))
    eq = ws.take(x.shape, torch.bool)
    torch.eq(x, b, out=eq).logical_or_(torch.eq(x, b.neg(), out=tmp))
    small = a <= 255  # a group's tie ranks fit a byte
    rank_dtype = torch.uint8 if small else torch.int16
    rank = torch.cumsum(eq, dim=-1, dtype=rank_dtype, out=ws.take(x.shape, rank_dtype))  # 1-based among ties
    in_group = rank[..., -1].long()  # ties per group
    before = torch.cumsum(in_group, dim=1) - in_group  # exclusive, over the row
    first_group = _first_group(plan, x.device)  # (T,) the first group of each tensor
    before = before - before[:, first_group][:, group_tensor]  # exclusive within the slice
    limit = (quota[:, group_tensor] - before).clamp_(0, a).to(rank_dtype)[..., None]
    eq.logical_and_(torch.le(rank, limit, out=tmp))
    sel.logical_or_(eq)
    ws.release(mark)
    return sel.view(R, Cs)


def _first_group(plan: FixedPlan, device) -> torch.Tensor:
    L = plan.layout
    firsts = [(L.cols[i] - plan.dense_columns) // L.align for i in plan.sparse_tensors]
    return _host(firsts, device)


def _compact(A, sel, plan, ws) -> Selection:
    """The selected elements of every slice into its slots, in ascending columns: a prefix count of the selection
    per row and one batched search for the column of each slot's target count."""
    R, device = A.shape[0], A.device
    L, m = plan.layout, meta(plan, device)
    T, K = len(plan.sparse_tensors), plan.sparse_slots
    Cs = sel.shape[1]
    mark = ws.mark()
    count = torch.cumsum(sel, dim=1, dtype=torch.int32, out=ws.take((R, Cs), torch.int32))
    del sel
    ends = (m.start + m.groups * L.align - 1)  # last column of each block
    upto = count[:, ends]  # (R, T) selected up to the block's end
    before = torch.cat([torch.zeros_like(upto[:, :1]), upto[:, :-1]], dim=1)
    filled = upto - before
    slot_tensor = _expand(torch.arange(T, device=device), m.slots, K)  # (K,)
    slot_local = torch.arange(K, device=device) - m.slot_base[slot_tensor]
    targets = (before[:, slot_tensor] + (slot_local + 1)[None, :]).to(torch.int32)
    col = torch.searchsorted(count, targets, out_int32=True)  # (R, K): the column of each slot's element
    ws.release(mark)
    del targets, count
    valid = slot_local[None, :] < filled[:, slot_tensor]
    empty = (m.n_chunks[slot_tensor] << plan.bits).to(torch.int32)  # past the last chunk: counted in no chunk
    positions = torch.where(valid, col - m.start[slot_tensor].to(torch.int32), empty)
    C = L.columns
    big = R * C + 1 >= 2**31
    rows = torch.arange(R, device=device, dtype=torch.int64 if big else torch.int32)[:, None]
    flat = rows * C + plan.dense_columns + torch.where(valid, col, m.start[slot_tensor].to(col.dtype))
    values = A.view(-1).index_select(0, flat.view(-1)).view(R, K)
    values.mul_(valid)
    return Selection(values, positions, flat, valid)


# ---- positions ----------------------------------------------------------------------------------------------------


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


def _chunk_counts(positions: torch.Tensor, plan: FixedPlan) -> torch.Tensor:
    """int32 ``(R, NC)``: the filled slots of every chunk of every sparsified tensor (column order)."""
    R, device = positions.shape[0], positions.device
    m = meta(plan, device)
    T, K = len(plan.sparse_tensors), plan.sparse_slots
    slot_tensor = _expand(torch.arange(T, device=device), m.slots, K)
    gap_bins = sum(plan.n_chunks) + T
    chunk = (positions.long() >> plan.bits) + m.chunk_base[slot_tensor]  # empty slots (c_i) land in the gap bin
    bins = chunk + (torch.arange(R, device=device) * gap_bins)[:, None]
    counts = torch.bincount(bins.view(-1), minlength=R * gap_bins).view(R, gap_bins)
    real = _host([b + j for b, n in zip([0] + list(_cumsum(n + 1 for n in plan.n_chunks))[:-1], plan.n_chunks)
                  for j in range(n)], device)
    return counts[:, real].to(torch.int32)


def _decode_positions(data: torch.Tensor, plan: FixedPlan) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of the position sections for W payloads, checked on the device.

    Returns:
        ``(positions, valid, bad)``: int64 ``(W, K_s)`` columns inside each slice (0 in empty slots), bool
        ``(W, K_s)`` for the filled slots, bool ``(W,)`` for payloads whose counts or positions do not fit the plan.
    """
    W, device = data.shape[0], data.device
    m = meta(plan, device)
    T, K, NC = len(plan.sparse_tensors), plan.sparse_slots, sum(plan.n_chunks)
    raw = data[:, :plan.count_bytes].long().view(W, NC, 2)
    counts = raw[..., 0] | (raw[..., 1] << 8)  # (W, NC)
    offsets = unpack_positions(data[:, plan.count_bytes:], K, plan.offset_bits)
    chunk_tensor = _expand(torch.arange(T, device=device), m.n_chunks, NC)
    filled = torch.zeros(W, T, dtype=torch.long, device=device).index_add_(1, chunk_tensor, counts)
    bad = (filled > m.slots[None, :]).any(dim=1) | (counts > (1 << plan.bits)).any(dim=1)
    # chunk counts with each tensor's unfilled slots in a gap bin after its chunks: their running sum is the slot index
    gap = (m.slots[None, :] - filled).clamp_(min=0)
    bins = torch.zeros(W, NC + T, dtype=torch.long, device=device)
    where = m.chunk_base[chunk_tensor] + (torch.arange(NC, device=device) - _expand(
        torch.cumsum(m.n_chunks, 0) - m.n_chunks, m.n_chunks, NC))
    bins[:, where] = counts
    bins[:, m.chunk_base + m.n_chunks] = gap
    ends = torch.cumsum(bins, dim=1)
    slot = torch.arange(K, device=device).expand(W, K).contiguous()
    b = torch.searchsorted(ends, slot, right=True).clamp_(max=NC + T - 1)  # (W, K) bin of each slot
    slot_tensor = _expand(torch.arange(T, device=device), m.slots, K)
    chunk = b - m.chunk_base[slot_tensor]
    valid = (chunk >= 0) & (chunk < m.n_chunks[slot_tensor])
    pos = chunk * (1 << plan.bits) + offsets
    inside = pos < m.chunks[slot_tensor]
    bad |= (valid & ~inside).any(dim=1)
    valid &= inside
    return torch.where(valid, pos, 0), valid, bad


# ---- encode and decode --------------------------------------------------------------------------------------------


_HEADERS: Dict[Tuple, torch.Tensor] = {}


def _header(fingerprint: int, device) -> torch.Tensor:
    key = (fingerprint, str(device))
    if key not in _HEADERS:
        if len(_HEADERS) > 1024:
            _HEADERS.clear()
        _HEADERS[key] = _to_device(torch.tensor([MAGIC, fingerprint, 0], dtype=torch.int32), device)
    return _HEADERS[key]


def owner_matrix(rows: int, columns: int, device) -> torch.Tensor:
    """A new fp32 ``(rows, columns)`` owner matrix (uninitialised)."""
    return torch.empty(rows, columns, dtype=torch.float32, device=device)


def encode(A: torch.Tensor, plan: FixedPlan, fingerprint: int, ws: Workspace, raw_scale: float = 1.0,
           sample_generator: Optional[torch.Generator] = None,
           rounding_generator: Optional[torch.Generator] = None, ops=None) -> torch.Tensor:
    """Every row's payload of the owner matrix ``A``, which becomes what error feedback keeps: ``A - decoded``.

    Args:
        A: fp32 ``(R, C)``, contiguous (padding zero), overwritten in place with the residual.
        plan: the bucket's plan; fingerprint: int31 of config and bucket (written in every header).
        ws: the temporaries' memory; raw_scale: raw values travel multiplied by it.
        sample_generator: draws the threshold samples; rounding_generator: stochastic rounding (INT4/INT2).
        ops: the fused ops where they code this (the CUDA op: scales, codes, packing and residual in one kernel),
            else the table of formats in torch ops (the same bits for INT4, INT2 and FP8).

    Returns:
        uint8 ``(R, payload_bytes)``.
    """
    R, device = A.shape[0], A.device
    L = plan.layout
    payload = torch.zeros(R, plan.payload_bytes, dtype=torch.uint8, device=device)
    s_at, v_at, c_at, p_at = plan.sections
    g = plan.group if plan.quantize else L.align
    grouped = A.view(R, L.columns // g, g)
    gmax, gmin = grouped.amax(dim=-1), grouped.amin(dim=-1)
    not_finite = ~(torch.isfinite(gmax).all() & torch.isfinite(gmin).all())
    header = payload[:, :HEADER_BYTES].view(torch.int32)
    header.copy_(_header(fingerprint, device))
    header[:, 2] = not_finite.to(torch.int32) * FLAG_NOT_FINITE
    sel = select(A, plan, ws, sample_generator) if plan.sparse_slots else None
    Cd, K = plan.dense_columns, plan.values
    if plan.quantize and rounding_generator is None and hasattr(ops, "fixed_encode") and A.is_cuda:
        ops.fixed_encode(A, plan, sel, payload)
    elif plan.quantize:
        fmt = FORMATS[plan.value_format]
        gs, Gd = plan.group_size, plan.dense_columns // plan.group_size
        scales = payload[:, s_at:v_at].view(torch.float32)
        mark = ws.mark()
        codes = ws.take((R, plan.packed_values), torch.uint8)
        codes[:, K:].zero_()
        if Cd:
            dense = A[:, :Cd].view(R, Gd, gs)
            tmp = ws.take(dense.shape, torch.float32)
            scales[:, :Gd] = fmt.scales(dense, gmax[:, :Gd], gmin[:, :Gd], tmp)
            fmt.encode_(dense, scales[:, :Gd], codes[:, :Cd].view(R, Gd, gs), tmp, rounding_generator)
        if sel is not None:
            slots = sel.values.view(R, -1, gs)
            decoded = torch.empty_like(slots)
            scales[:, Gd:] = fmt.scales(slots, slots.amax(dim=-1), slots.amin(dim=-1), decoded)
            fmt.encode_(slots, scales[:, Gd:], codes[:, Cd:K].view(R, -1, gs), decoded, rounding_generator)
        pack_codes(codes, plan.value_format, payload[:, v_at:c_at])
        ws.release(mark)
    else:
        values = payload[:, v_at:c_at].view(plan.value_dtype)
        if Cd:
            _raw_(A[:, :Cd], values[:, :Cd], raw_scale, ws)
        if sel is not None:
            decoded = _raw_(sel.values, values[:, Cd:K], raw_scale, Workspace())
    if sel is not None and not (plan.quantize and rounding_generator is None and hasattr(ops, "fixed_encode")
                                and A.is_cuda):  # what the slots sent leaves A (an empty slot sent 0)
        A.view(-1).index_put_((sel.flat.view(-1), ), decoded.view(-1).neg_(), accumulate=True)
    if sel is not None:
        counts = _chunk_counts(sel.positions, plan)
        both = payload[:, c_at:p_at].view(R, -1, 2)
        both[..., 0] = counts & 0xFF
        both[..., 1] = counts >> 8
        offsets = sel.positions.long() & ((1 << plan.bits) - 1)
        payload[:, p_at:p_at + plan.position_bytes] = pack_positions(offsets, plan.offset_bits)
    return payload


def _raw_(values: torch.Tensor, out: torch.Tensor, raw_scale: float, ws: Workspace) -> torch.Tensor:
    """Raw values as they travel (times ``raw_scale``, in ``out``'s dtype); their rounding error is left in ``values``.
    Returns what the receivers decode (a view of ``ws``, valid until its next release)."""
    mark = ws.mark()
    tmp = ws.take(values.shape, torch.float32)
    out.copy_(torch.mul(values, raw_scale, out=tmp) if raw_scale != 1 else values)
    tmp.copy_(out)
    values.sub_(tmp.div_(raw_scale) if raw_scale != 1 else tmp)
    ws.release(mark)
    return tmp


def header_mismatch(received: torch.Tensor, magic: int, fingerprint: int) -> torch.Tensor:
    """Bool ``(W,)``: the payloads whose ``int32`` header does not start with ``magic, fingerprint`` (on the device)."""
    header = received[:, :HEADER_BYTES].contiguous().view(torch.int32)
    return (header[:, 0] != magic) | (header[:, 1] != fingerprint)


def decode_values(received: torch.Tensor, plan: FixedPlan, ws: Workspace, raw_scale: float = 1.0) -> torch.Tensor:
    """fp32 ``(W, K)`` values of W payloads' value sections (whole-sent columns, then slots)."""
    W = received.shape[0]
    s_at, v_at, c_at, _ = plan.sections
    K = plan.values
    if not plan.quantize:
        raw = received[:, v_at:c_at].view(plan.value_dtype)
        out = ws.take((W, K), torch.float32)
        out.copy_(raw)
        return out.div_(raw_scale) if raw_scale != 1 else out
    gs = plan.group_size
    out = ws.take((W, K), torch.float32)
    mark = ws.mark()
    codes = unpack_codes(received[:, v_at:c_at], plan.value_format, ws.take((W, plan.packed_values), torch.uint8))
    scales = received[:, s_at:v_at].contiguous().view(torch.float32)
    FORMATS[plan.value_format].decode(codes[:, :K].view(W, -1, gs), scales, out.view(W, -1, gs))
    ws.release(mark)
    return out


def decode_sum(received: torch.Tensor, plan: FixedPlan, fingerprint: int, row: int, ws: Workspace,
               raw_scale: float = 1.0, ops=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Decode every sender's payload for this owner's row and sum them, senders in rank order, densely in fp32.

    Args:
        received: uint8 ``(W, payload_bytes)``, row s from sender s.
        plan: the bucket's plan; fingerprint: expected in every header; row: this owner's row of the plan.
        ws: memory for the temporaries and the result; ops: the fused ops where they decode this (the CUDA op).

    Returns:
        ``(out, bad)``: fp32 ``(C,)`` in the layout's columns (all NaN when a sender's input was not finite or a
        payload is bad), and bool ``(W,)``, the senders whose payload does not match this rank's plan (a device
        tensor: nothing is read on the host).
    """
    W, device = received.shape[0], received.device
    L = plan.layout
    header = received[:, :HEADER_BYTES].view(torch.int32)
    bad = header_mismatch(received, MAGIC, fingerprint)
    out = ws.take((L.columns, ), torch.float32)
    Cd, K = plan.dense_columns, plan.values
    cols = valid = None
    if plan.sparse_slots:  # each sender's slots: their columns in the sparse region, and which are filled
        _, _, c_at, _ = plan.sections
        positions, valid, bad_pos = _decode_positions(received[:, c_at:], plan)
        bad |= bad_pos
        m = meta(plan, device)
        slot_tensor = _expand(torch.arange(len(plan.sparse_tensors), device=device), m.slots, plan.sparse_slots)
        cols = positions + m.start[slot_tensor][None, :]
    if plan.quantize and hasattr(ops, "fixed_decode") and received.is_cuda:
        D = ws.take((W, L.columns - Cd), torch.float32) if cols is not None else None
        ops.fixed_decode(received, plan, cols, valid, D, out)
    else:
        values = decode_values(received, plan, ws, raw_scale)
        dense = out[:Cd].view(1, Cd).zero_()
        dense.index_add_(0, torch.zeros(W, dtype=torch.long, device=device), values[:, :Cd])  # one sender after another
        out[Cd:].zero_()
        if cols is not None:
            out[Cd:].index_add_(0, cols.view(-1), values[:, Cd:K].mul_(valid).reshape(-1))
    poison = bad.any() | ((header[:, 2] & FLAG_NOT_FINITE) != 0).any()
    return out.masked_fill_(poison, float("nan")), bad
