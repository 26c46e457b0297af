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

Memory: the owner matrix is the one copy of the bucket (fp32, or bf16 for bf16 gradients: :func:`matrix_dtype`);
temporaries come from a :class:`~deepspeed_dgc.codec.layout.Workspace` (the bucket's gradients once read), in slabs
sized to it, and the owner matrix becomes the residual in place. The selection of the sparsified tensors is never
made whole: the compaction makes each slab's where it counts it (:func:`_selected`).
"""

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Dict, List, Optional, Tuple

import torch

from .formats import FORMATS, abs_into, code_bytes, pack_codes, unpack_codes
from .layout import BucketLayout, Workspace, alignment, device_constant, host_to_device, layout_for, round_up, \
    slabs
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

    @cached_property
    def kept(self) -> int:
        """Values one sender sends, all rows, as the telemetry's density counts them: the real elements of the tensors
        sent whole (not their padding columns, which are coded as zeros) and the slots of each sparsified slice, at
        most its real elements (filled or not: every payload pays for them). So the density is 1 exactly where every
        tensor goes whole, never more."""
        L, whole = self.layout, [not s for s in self.sparse]
        return sum(sum(real for real, w in zip(row, whole) if w) +
                   sum(min(slots, row[i]) for i, slots in zip(self.sparse_tensors, self.slots)) for row in L.real)


# ---- small device tensors of a plan -------------------------------------------------------------------------------


class _Meta:
    """O(tensors) device vectors of a plan's sparsified tensors (column order), made once per plan and device; int32
    where they combine with per-slot or per-element int32 tensors."""

    def __init__(self, plan: FixedPlan, device):
        L = plan.layout
        idx = plan.sparse_tensors
        split = plan.dense_columns
        t = lambda xs, dtype=torch.long: host_to_device(torch.tensor(list(xs), dtype=dtype), device)  # noqa: E731
        i32 = torch.int32
        self.ids = t(range(len(idx)))
        self.ids32 = t(range(len(idx)), i32)
        self.chunks = t(L.chunks[i] for i in idx)
        self.chunks32 = t((L.chunks[i] for i in idx), i32)
        self.start = t(L.cols[i] - split for i in idx)  # first column in the sparse region
        self.start32 = t((L.cols[i] - split for i in idx), i32)
        self.groups = t(L.widths[i] // L.align for i in idx)  # align-column groups per tensor
        self.first_group = t((L.cols[i] - split) // L.align for i in idx)
        self.slots = t(plan.slots)
        self.slots32 = t(plan.slots, i32)
        self.slot_ends32 = t(_cumsum(plan.slots), i32)
        self.slot_base32 = t([0] + list(_cumsum(plan.slots))[:-1], i32)
        self.n_chunks = t(plan.n_chunks)
        self.empty32 = t((n << plan.bits for n in plan.n_chunks), i32)  # an empty slot's position: no chunk's
        bases = [0] + list(_cumsum(n + 1 for n in plan.n_chunks))[:-1]  # one gap bin after each tensor's chunks
        self.chunk_base32 = t(bases, i32)
        self.chunk_bins = t(b + j for b, n in zip(bases, plan.n_chunks) for j in range(n))  # (NC,) the chunks' bins
        self.gap_bins = t(b + n for b, n in zip(bases, plan.n_chunks))  # (T,)
        self.bin_chunk32 = t([j for n in plan.n_chunks for j in list(range(n)) + [-1]], i32)  # bin -> chunk, gap -1
        self.chunk_tensor = t(i for i, n in enumerate(plan.n_chunks) for _ in range(n))  # (NC,)
        reals = [sum(row[i] for row in L.real) for i in idx]
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
        self.nbytes = sum(v.numel() * v.element_size() for v in vars(self).values() if isinstance(v, torch.Tensor))


def _cumsum(xs):
    total = 0
    for x in xs:
        total += x
        yield total


_META: Dict[Tuple[FixedPlan, str], _Meta] = {}
MAX_PLANS = 64  # a density warm-up makes a plan per step: keep the latest ones
MAX_CACHED_BYTES = 64 << 20  # and at most this much of their device vectors (O(tensors + chunks) each)


def meta(plan: FixedPlan, device) -> _Meta:
    """The plan's device vectors (cached: at most :data:`MAX_PLANS` plans and :data:`MAX_CACHED_BYTES`)."""
    key = (plan, str(device))
    if key not in _META:
        made = _Meta(plan, device)
        while _META and (len(_META) >= MAX_PLANS or sum(v.nbytes for v in _META.values()) + made.nbytes >
                         MAX_CACHED_BYTES):
            _META.pop(next(iter(_META)))
        _META[key] = made
    return _META[key]


def _expand(values: torch.Tensor, repeats: torch.Tensor, total: int) -> torch.Tensor:
    """``values[i]`` repeated ``repeats[i]`` times (``total`` their sum, known on the host: no read-back)."""
    return torch.repeat_interleave(values, repeats, output_size=total)


def slot_tensor(plan: FixedPlan, ws: Workspace, device) -> torch.Tensor:
    """int32 ``(K_s,)``: the sparsified tensor (column order) of each slot, in ``ws``."""
    m, K = meta(plan, device), plan.sparse_slots
    out = ws.take((K, ), torch.int32, device)
    mark = ws.mark()
    ids = torch.arange(K, dtype=torch.int32, device=device, out=ws.take((K, ), torch.int32, device))
    torch.searchsorted(m.slot_ends32, ids, right=True, out_int32=True, out=out)
    ws.release(mark)
    return out


def _per_slot(vec: torch.Tensor, slot_t: torch.Tensor, ws: Workspace) -> torch.Tensor:
    """``vec[slot_t]`` (a per-tensor vector per slot) in ``ws``."""
    return torch.index_select(vec, 0, slot_t, out=ws.take(slot_t.shape, vec.dtype, vec.device))


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
        first = u.mul_(_expand(m.highs, device_constant(drawn, device), n)).long()
        tid = _expand(ids, device_constant(drawn, device), n)
        runs = [kd == 2 for kd in m.kinds]
        if any(runs):  # runs of MAX_RUN: their draws become run starts, every position of a run follows
            length = torch.where(device_constant(runs, device, torch.bool), MAX_RUN, 1)[tid]
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
        tid = _expand(ids, device_constant(whole, device), n)
        base = torch.cumsum(device_constant(whole, device), 0) - device_constant(whole, device)
        parts_pos.append(torch.arange(n, device=device) - base[tid])
        parts_tid.append(tid)
    if not parts_pos:
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return empty, empty
    return torch.cat(parts_pos), torch.cat(parts_tid)


def first_estimates(A: torch.Tensor, plan: FixedPlan, positions: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """DGC's first threshold of every sparsified tensor: the ``ceil(s k / m)``-th largest of its ``s`` sampled
    magnitudes, all tensors in one sort (key: tensor, then magnitude descending). fp32 ``(T_s,)``."""
    L, m = plan.layout, meta(plan, A.device)
    C = L.columns
    c = m.chunks[tensor]
    flat = (positions // c) * C + plan.dense_columns + m.start[tensor] + positions % c
    mags = A.view(-1)[flat].float().abs_()
    key = (tensor << 32) | (0x7FFFFFFF - mags.view(torch.int32).long())
    key = torch.sort(key).values
    sizes = m.sample_sizes
    k_sample = [max(1, math.ceil(s * k / r)) if r else 1
                for s, k, r in zip(sizes, (target_count(r, plan.density) if r else 1 for r in _reals(plan)), _reals(plan))]
    at = [b + min(k, s) - 1 for b, k, s in zip([0] + list(_cumsum(sizes))[:-1], k_sample, sizes)]
    bits = 0x7FFFFFFF - (key[device_constant(at, A.device)] & 0xFFFFFFFF)
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
    """What the sparsified tensors send, per row (the ``K_s`` slots of the plan, tensor by tensor in column order),
    in the workspace it was made in.

    Attributes:
        valid: bool ``(R, K_s)``, the filled slots;
        values: ``(R, K_s)`` in the owner matrix's dtype, 0 in empty slots; flat: int32 or int64 ``(R, K_s)``, the
        element of the owner matrix each slot came from (the tensor's first column of the row for empty slots, which
        send 0; :func:`slot_positions` turns it into the slots' positions once the values are coded);
        slot_tensor: int32 ``(K_s,)``, each slot's tensor (column order); spare: dead memory of the selection (the
        search's scratch, ``4 R K_s`` bytes) for what follows.
    """
    values: torch.Tensor
    flat: torch.Tensor
    valid: torch.Tensor
    slot_tensor: torch.Tensor
    spare: Workspace


def _histogram(bins: torch.Tensor, size: int, into: Optional[torch.Tensor] = None) -> torch.Tensor:
    """int64 ``(size,)``: how many of ``bins`` (int32, any shape, each in ``[0, size)``) fall in each bin, added to
    ``into`` where given. One ``index_add_`` of a broadcast 1: ``torch.bincount`` would read the bins' maximum and
    minimum back to the host on a GPU (two waits)."""
    hist = torch.zeros(size, dtype=torch.long, device=bins.device) if into is None else into
    flat = bins.reshape(-1)
    return hist.index_add_(0, flat, device_constant((1, ), bins.device).expand(flat.numel()))


def _high_halves(S3: torch.Tensor) -> torch.Tensor:
    """int16 view ``(R, G, a)`` of the high 16 bits of fp32 ``S3`` (sign, exponent, 7 mantissa bits: bf16's), or of
    bf16 ``S3`` itself."""
    if S3.dtype == torch.bfloat16:
        return S3.view(torch.int16)
    return S3.view(torch.int16)[..., 1::2]  # little-endian, as every device torch runs on


def select(A: torch.Tensor, plan: FixedPlan, ws: Workspace, generator: Optional[torch.Generator]) -> Selection:
    """DGC's threshold per sparsified tensor and the capacity cut per owner slice, in a fixed number of batched ops
    (see the module docstring), in passes over slabs of the sparse region sized to the workspace's free memory.

    ``A``: the owner matrix ``(R, C)`` fp32 or bf16, contiguous; read only. Returns the slots in ``ws`` (valid until the
    caller releases it).
    """
    R, device = A.shape[0], A.device
    L, m = plan.layout, meta(plan, device)
    T, a, split = len(plan.sparse_tensors), L.align, plan.dense_columns
    G = (L.columns - split) // a
    S3 = A[:, split:].view(R, G, a)
    group_tensor = _expand(m.ids, m.groups, G)  # (G,)
    slice_group = (torch.arange(0, R * T, T, dtype=torch.int32, device=device)[:, None] +
                   group_tensor.to(torch.int32))  # (R, G): the slice (row, tensor) of each group

    # DGC's threshold: first estimates on the sample, the lowering rounds' candidates, every candidate counted at once
    positions, tensor = draw_sample(plan, generator, device)
    cand = _smallest_positive(lowering_candidates(first_estimates(A, plan, positions, tensor)))  # (T, 11) descending
    del positions, tensor
    hist_l, hist_0 = _levels_and_top_bytes(S3, cand.flip(1)[group_tensor], slice_group, R * T, ws)
    above = hist_l.view(R, T, LEVELS + 1).flip(-1).cumsum(-1).flip(-1)  # above[l]: elements of level l or more
    # (R, T, 11): |a| >= cand[j] is level >= 11 - j
    count_ge = above[..., device_constant(range(LEVELS, 0, -1), device)]
    enough = count_ge.sum(dim=0) >= LOWER_SLACK * m.targets[:, None]
    enough[:, -1] = True  # the last round is taken when none keeps 0.8 k
    first = enough.int().argmax(dim=1)  # (T,)
    threshold = cand.gather(1, first[:, None])  # (T, 1)
    kept = count_ge.gather(2, first[None, :, None].expand(R, T, 1))[..., 0]  # (R, T) at the threshold

    # the capacity cut: the slots-th largest magnitude of each over-full slice, in bf16 precision (its high 16 bits),
    # by a radix select of two byte passes over every element (the slots-th largest of an over-full slice reaches the
    # threshold, so it is the slots-th largest of those that do)
    over = kept > m.slots[None, :]
    top, rank = _radix_digit(hist_0.view(R, T, 128), m.slots[None, :].expand(R, T))
    hist_1 = _second_bytes(S3, top[:, group_tensor].to(torch.int16), slice_group, R * T, ws)
    low, rank = _radix_digit(hist_1.view(R, T, 256), rank)
    bound = torch.where(over, (top << 8) | low, -1).to(torch.int16)  # not over: every element reaching the threshold
    quota = torch.where(over, rank, 0)  # of the elements at the bound, how many (the first by column)
    rule = _rule(S3, threshold[group_tensor], bound[:, group_tensor], quota, group_tensor, m.first_group, ws)
    return _compact(A, rule, torch.minimum(kept, m.slots[None, :]), plan, ws)


def _levels_and_top_bytes(S3, asc, slice_group, slices: int, ws: Workspace) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per slice, histograms of (1) each element's level, how many of its tensor's candidate thresholds ``asc``
    (``(G, 11)`` per group, ascending) its magnitude reaches, and (2) the top byte of its magnitude's bits (the sign
    cleared: 0-127). int64 ``(slices * 12,)`` and ``(slices * 128,)``."""
    R, G, a = S3.shape
    nl = LEVELS + 1
    level_base, top_base = slice_group * nl, slice_group * 128
    hist_l = hist_0 = None
    for g0, g1 in slabs(G, R * (8 * a + 4 * LEVELS), ws):
        mark, n = ws.mark(), g1 - g0
        mag = abs_into(S3[:, g0:g1], ws.take((R, n, a), torch.float32))
        seq = ws.take((R, n, LEVELS), torch.float32)
        seq.copy_(asc[None, g0:g1])
        level = torch.searchsorted(seq, mag, right=True, out_int32=True, out=ws.take((R, n, a), torch.int32))
        level.add_(level_base[:, g0:g1, None])
        hist_l = _histogram(level, slices * nl, hist_l)
        top = mag.view(torch.int32).bitwise_right_shift_(24).add_(top_base[:, g0:g1, None])
        hist_0 = _histogram(top, slices * 128, hist_0)
        ws.release(mark)
    return hist_l, hist_0


def _second_bytes(S3, top, slice_group, slices: int, ws: Workspace) -> torch.Tensor:
    """Per slice, the histogram of the second byte of the magnitudes' bits (bits 23-16) among the elements whose top
    byte is the slice's ``top`` (int16 ``(R, G)`` per group): int64 ``(slices * 256,)``."""
    R, G, a = S3.shape
    base, dump = slice_group * 256, slices * 256
    high = _high_halves(S3)
    hist = None
    for g0, g1 in slabs(G, R * a * 9, ws):
        mark, n = ws.mark(), g1 - g0
        key = torch.bitwise_and(high[:, g0:g1], 0x7FFF, out=ws.take((R, n, a), torch.int16))
        miss = torch.ne(torch.bitwise_right_shift(key, 8, out=ws.take((R, n, a), torch.int16)), top[:, g0:g1, None],
                        out=ws.take((R, n, a), torch.bool))
        bins = ws.take((R, n, a), torch.int32)
        bins.copy_(key.bitwise_and_(0xFF)).add_(base[:, g0:g1, None]).masked_fill_(miss, dump)
        hist = _histogram(bins, dump + 1, hist)
        ws.release(mark)
    return hist[:dump]


def _radix_digit(hist: torch.Tensor, rank: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """One radix-select step per slice: from the histogram ``(S..., B)`` of a digit and the rank sought ``(S...)``
    (1-based, from the top), the digit of the ranked element and its rank among the elements with that digit."""
    B = hist.shape[-1]
    above = hist.flip(-1).cumsum(-1).flip(-1)  # above[d]: elements whose digit is d or more
    digit = ((above >= rank[..., None]).sum(-1) - 1).clamp_(min=0)
    higher = above.gather(-1, (digit + 1).clamp(max=B - 1)[..., None])[..., 0]
    return digit, rank - torch.where(digit < B - 1, higher, 0)


@dataclass
class _Rule:
    """What each slice sends, per group of its elements (:func:`_rule`); :func:`_selected` applies it to a slab.

    Attributes:
        S3: the sparse region ``(R, G, a)``, fp32 or bf16; threshold, neg_threshold: fp32 ``(G, 1)``, ``t`` and
        ``-t``; bound: int16 ``(R, G)``; limit: ``(R, G, 1)`` uint8 (``a`` up to 255) or int16, how many of a group's
        elements at the bound it sends; below: int16 0-d, -2.
    """
    S3: torch.Tensor
    threshold: torch.Tensor
    neg_threshold: torch.Tensor
    bound: torch.Tensor
    limit: torch.Tensor
    below: torch.Tensor  # int16 0-d: -2

    def keys(self, g0: int, g1: int, ws: Workspace) -> torch.Tensor:
        """int16 ``(R, g1 - g0, a)`` in ``ws``: the 16-bit magnitude (the high half's bits, sign cleared) of each
        element of groups ``[g0, g1)`` that reaches the threshold (``x >= t`` or ``x <= -t``, as the exact layout
        compares), -2 for the others (below every bound: a bound is -1 or more)."""
        R, _, a = self.S3.shape
        x, n = self.S3[:, g0:g1], g1 - g0
        key = torch.bitwise_and(_high_halves(self.S3)[:, g0:g1], 0x7FFF, out=ws.take((R, n, a), torch.int16))
        mark = ws.mark()
        reach = torch.ge(x, self.threshold[g0:g1], out=ws.take((R, n, a), torch.bool))
        reach.logical_or_(torch.le(x, self.neg_threshold[g0:g1], out=ws.take((R, n, a), torch.bool)))
        torch.where(reach, key, self.below, out=key)
        ws.release(mark)
        return key


SELECTED_BYTES = 7  # per element of a slab: the most :func:`_selected` takes at once (its result and temporaries)


def _rule(S3, threshold, bound, quota, group_tensor, first_group, ws: Workspace) -> _Rule:
    """What each slice sends: its elements reaching ``threshold`` (fp32 ``(G, 1)`` per group) whose 16-bit magnitude
    is above ``bound`` (int16 ``(R, G)``), and of those at it the first ``quota`` (``(R, T)``) by column. One pass
    over slabs counts each group's elements at the bound; the selection itself is made slab by slab where it is read
    (:func:`_selected`), never whole (it would take a byte per element beside the owner matrix)."""
    R, G, a = S3.shape
    rule = _Rule(S3, threshold, threshold.neg(), bound, None, torch.full((), -2, dtype=torch.int16, device=S3.device))
    ties = torch.empty(R, G, dtype=torch.int32, device=S3.device)
    for g0, g1 in slabs(G, R * a * 5, ws):
        mark = ws.mark()
        key = rule.keys(g0, g1, ws)
        at = torch.eq(key, bound[:, g0:g1, None], out=ws.take(key.shape, torch.bool))
        torch.sum(at, dim=-1, dtype=torch.int32, out=ties[:, g0:g1])
        ws.release(mark)
    # how many of a group's ties it may send: the slice's quota less the ties of its earlier groups
    before = torch.cumsum(ties, dim=1, dtype=torch.int32).sub_(ties)
    before.sub_(before[:, first_group][:, group_tensor])
    rank_dtype = torch.uint8 if a <= 255 else torch.int16
    rule.limit = (quota[:, group_tensor] - before).clamp_(0, a).to(rank_dtype)[..., None]
    return rule


def _selected(rule: _Rule, g0: int, g1: int, ws: Workspace) -> torch.Tensor:
    """Bool ``(R, g1 - g0, a)`` in ``ws``: what the slices send of groups ``[g0, g1)`` (:func:`_rule`); its
    temporaries (:data:`SELECTED_BYTES` an element with it) are released before it returns."""
    R, _, a = rule.S3.shape
    sel = ws.take((R, g1 - g0, a), torch.bool)
    mark = ws.mark()
    b = rule.bound[:, g0:g1, None]
    key = rule.keys(g0, g1, ws)
    torch.gt(key, b, out=sel)
    at = torch.eq(key, b, out=ws.take(key.shape, torch.bool))
    rank = torch.cumsum(at, dim=-1, dtype=rule.limit.dtype, out=ws.take(key.shape, rule.limit.dtype))  # 1-based
    at.logical_and_(torch.le(rank, rule.limit[:, g0:g1], out=ws.take(key.shape, torch.bool)))
    sel.logical_or_(at)
    ws.release(mark)
    return sel


def _compact(A, rule: _Rule, filled, plan, ws) -> Selection:
    """The selected elements of every slice (:func:`_selected`, made per slab) into its slots, in ascending columns
    (``filled`` ``(R, T)`` of them): per slab a prefix count of the selection and one batched search for the column of
    each slot's target count."""
    R, device = A.shape[0], A.device
    L, m = plan.layout, meta(plan, device)
    K, a, C = plan.sparse_slots, L.align, L.columns
    G = rule.S3.shape[1]
    # each slot's target count (past the row's selection for the slots a slice leaves empty), replaced by -1 - its
    # column once found: a negative target is never found again
    col = ws.take((R, K), torch.int32)
    found, here = ws.take((R, K), torch.int32), ws.take((R, K), torch.bool)
    mark = ws.mark()
    st = slot_tensor(plan, ws, device)
    local = torch.arange(1, K + 1, dtype=torch.int32, device=device, out=found.view(-1)[:K])
    local.sub_(torch.index_select(m.slot_base32, 0, st, out=col.view(-1)[:K]))  # 1 + the index in its tensor's slots
    ends = torch.cumsum(filled, dim=1).to(torch.int32)  # (R, T) selected in the row up to each slice's end
    torch.index_select(ends - filled.to(torch.int32), 1, st, out=col).add_(local)
    col.masked_fill_(torch.gt(col, torch.index_select(ends, 1, st, out=found), out=here), 2**31 - 1)
    del local, st
    ws.release(mark)
    carry = torch.zeros(R, 1, dtype=torch.int32, device=device)
    for g0, g1 in slabs(G, R * a * max(SELECTED_BYTES, 1 + 4), ws):  # the count takes _selected's temporaries
        inner, width = ws.mark(), (g1 - g0) * a
        sel = _selected(rule, g0, g1, ws)
        count = torch.cumsum(sel.view(R, width), dim=1, dtype=torch.int32,
                             out=ws.take((R, width), torch.int32)).add_(carry)
        torch.searchsorted(count, col, out_int32=True, out=found)
        torch.gt(col, carry, out=here).logical_and_(col <= count[:, -1:])
        torch.where(here, found.add_(g0 * a + 1).neg_(), col, out=col)
        carry.copy_(count[:, -1:])
        del count, sel
        ws.release(inner)
    valid = torch.lt(col, 0, out=here)  # found (all up to filled, NaN aside)
    col.add_(1).neg_()
    st = slot_tensor(plan, ws, device)
    mark = ws.mark()
    flat = torch.where(valid, col, _per_slot(m.start32, st, ws), out=col)
    ws.release(mark)
    if R * C + 1 >= 2**31:
        flat = flat.long()
    flat.add_(_row_starts(R, C, plan.dense_columns, flat.dtype, device))
    values = torch.index_select(A.view(-1), 0, flat.view(-1), out=ws.take((R * K, ), A.dtype, device))
    values = values.view(R, K).mul_(valid)
    return Selection(values, flat, valid, st, Workspace([found.view(-1).view(torch.uint8)]))


def _row_starts(R: int, C: int, dense_columns: int, dtype: torch.dtype, device) -> torch.Tensor:
    """``(R, 1)``: the flat index of each row's sparse region in an ``(R, C)`` owner matrix (cached)."""
    return device_constant(range(dense_columns, R * C + dense_columns, C), device, dtype).view(R, 1)


def slot_positions(sel: Selection, plan: FixedPlan, ws: Workspace) -> torch.Tensor:
    """The slots' positions, the column inside the tensor's slice (past its last chunk in empty slots), int32 or
    int64 ``(R, K_s)``, computed in place of ``sel.flat`` (which is spent)."""
    R, C = sel.flat.shape[0], plan.layout.columns
    m, device = meta(plan, sel.flat.device), sel.flat.device
    mark = ws.mark()
    cols = sel.flat.sub_(_row_starts(R, C, plan.dense_columns, sel.flat.dtype, device))
    cols.sub_(_per_slot(m.start32, sel.slot_tensor, ws))
    positions = torch.where(sel.valid, cols, _per_slot(m.empty32, sel.slot_tensor, ws), out=cols)
    ws.release(mark)
    return positions


# ---- positions ----------------------------------------------------------------------------------------------------


def pack_positions(positions: torch.Tensor, bits: int, out: Optional[torch.Tensor] = None,
                   ws: Optional[Workspace] = None) -> torch.Tensor:
    """b-bit positions ``(R, n)`` (int32 or int64) as little-endian bytes ``(R, ceil(n * bits / 8))`` (12 bits: 3 bytes
    per pair), written into ``out`` (uint8, or None for a new tensor); temporaries from ``ws``."""
    R, n = positions.shape
    out = torch.empty(R, -(-n * bits // 8), dtype=torch.uint8, device=positions.device) if out is None else out
    ws = ws or Workspace()
    if bits == 8:
        return out.copy_(positions)
    mark = ws.mark()
    tmp = ws.take((R, max(n, 1)), positions.dtype, positions.device)
    if bits == 16:
        pairs = out.view(R, n, 2)
        pairs[..., 0].copy_(torch.bitwise_and(positions, 0xFF, out=tmp[:, :n]))
        pairs[..., 1].copy_(torch.bitwise_right_shift(positions, 8, out=tmp[:, :n]))
    else:
        full = n // 2
        a, b = positions[:, 0:2 * full:2], positions[:, 1:2 * full:2]
        tri = out[:, :3 * full].view(R, full, 3)
        t = tmp[:, :full]
        tri[..., 0].copy_(torch.bitwise_and(a, 0xFF, out=t))
        tri[..., 2].copy_(torch.bitwise_right_shift(b, 4, out=t))
        u = ws.take((R, full), positions.dtype, positions.device)
        torch.bitwise_and(b, 0xF, out=t).bitwise_left_shift_(4).bitwise_or_(torch.bitwise_right_shift(a, 8, out=u))
        tri[..., 1].copy_(t)
        if n % 2:
            last = positions[:, n - 1:]
            out[:, 3 * full:3 * full + 1].copy_(torch.bitwise_and(last, 0xFF, out=tmp[:, :1]))
            out[:, 3 * full + 1:3 * full + 2].copy_(torch.bitwise_right_shift(last, 8, out=tmp[:, :1]))
    ws.release(mark)
    return out


def unpack_positions(data: torch.Tensor, count: int, bits: int, out: Optional[torch.Tensor] = None,
                     ws: Optional[Workspace] = None) -> torch.Tensor:
    """Inverse of :func:`pack_positions`: int32 ``(W, count)`` into ``out`` (or a new tensor)."""
    W = data.shape[0]
    out = torch.empty(W, count, dtype=torch.int32, device=data.device) if out is None else out
    ws = ws or Workspace()
    if bits == 8:
        return out.copy_(data[:, :count])
    mark = ws.mark()
    tmp = ws.take((W, max(count, 1)), torch.int32, data.device)
    if bits == 16:
        pairs = data[:, :2 * count].view(W, count, 2)
        out.copy_(pairs[..., 1]).bitwise_left_shift_(8).bitwise_or_(tmp[:, :count].copy_(pairs[..., 0]))
    else:
        full = count // 2
        tri = data[:, :3 * full].view(W, full, 3)
        both = out[:, :2 * full].view(W, full, 2)
        t = tmp[:, :full]
        both[..., 0].copy_(tri[..., 1]).bitwise_and_(0xF).bitwise_left_shift_(8).bitwise_or_(t.copy_(tri[..., 0]))
        both[..., 1].copy_(tri[..., 2]).bitwise_left_shift_(4).bitwise_or_(t.copy_(tri[..., 1]).bitwise_right_shift_(4))
        if count % 2:
            last, t1 = out[:, count - 1:], tmp[:, :1]
            last.copy_(data[:, 3 * full + 1:3 * full + 2]).bitwise_and_(0xF).bitwise_left_shift_(8)
            last.bitwise_or_(t1.copy_(data[:, 3 * full:3 * full + 1]))
    ws.release(mark)
    return out


def _chunk_counts(positions: torch.Tensor, st: torch.Tensor, plan: FixedPlan, ws: Workspace) -> torch.Tensor:
    """int32 ``(R, NC)``: the filled slots of every chunk of every sparsified tensor (column order), from the slots'
    ``positions`` (:func:`slot_positions`) and tensors ``st``."""
    R, K, device = positions.shape[0], plan.sparse_slots, positions.device
    m = meta(plan, device)
    width = sum(plan.n_chunks) + len(plan.sparse_tensors)  # each tensor's chunks, then its gap bin (empty slots)
    mark = ws.mark()
    bins = torch.bitwise_right_shift(positions, plan.bits, out=ws.take((R, K), torch.int32))
    bins.add_(_per_slot(m.chunk_base32, st, ws))
    bins.add_(torch.arange(0, R * width, width, dtype=torch.int32, device=device)[:, None])
    counts = _histogram(bins, R * width).view(R, width)
    ws.release(mark)
    return counts[:, m.chunk_bins].to(torch.int32)


def _decode_positions(data: torch.Tensor, plan: FixedPlan, st: torch.Tensor,
                      ws: Workspace) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of the position sections for W payloads, checked on the device (``st``: :func:`slot_tensor`).

    Returns:
        ``(positions, valid, bad)`` in ``ws``: int32 ``(W, K_s)`` columns inside each slice (0 in empty slots), bool
        ``(W, K_s)`` for the filled slots, bool ``(W,)`` for payloads whose counts or positions do not fit the plan
        (read as sending nothing).
    """
    W, device = data.shape[0], data.device
    m = meta(plan, device)
    T, K, NC = len(plan.sparse_tensors), plan.sparse_slots, sum(plan.n_chunks)
    raw = data[:, :plan.count_bytes].view(W, NC, 2)
    counts = raw[..., 1].to(torch.int32).bitwise_left_shift_(8).bitwise_or_(raw[..., 0].to(torch.int32))  # (W, NC)
    filled = torch.zeros(W, T, dtype=torch.int32, device=device).index_add_(1, m.chunk_tensor, counts)
    bad = (filled > m.slots32).any(dim=1) | (counts > (1 << plan.bits)).any(dim=1)
    counts.masked_fill_(bad[:, None], 0)
    filled.masked_fill_(bad[:, None], 0)
    # chunk counts with each tensor's unfilled slots in a gap bin after its chunks: their running sum is the slot index
    bins = torch.zeros(W, NC + T, dtype=torch.int32, device=device)
    bins[:, m.chunk_bins] = counts
    bins[:, m.gap_bins] = m.slots32 - filled
    ends = torch.cumsum(bins, dim=1, dtype=torch.int32)  # each row ends at K
    slots, valid = ws.take((W, K), torch.int32), ws.take((W, K), torch.bool)  # what is returned
    mark = ws.mark()  # the rest is released before the return
    slots.copy_(torch.arange(K, dtype=torch.int32, device=device, out=ws.take((K, ), torch.int32))[None, :])
    ws.release(mark)
    found = torch.searchsorted(ends, slots, right=True, out_int32=True, out=ws.take((W, K), torch.int32))
    chunk = torch.index_select(m.bin_chunk32, 0, found.view(-1), out=slots.view(-1)).view(W, K)  # -1: a gap bin
    torch.ge(chunk, 0, out=valid)
    offsets = unpack_positions(data[:, plan.count_bytes:], K, plan.offset_bits, out=found, ws=ws)
    positions = chunk.clamp_(min=0).bitwise_left_shift_(plan.bits).add_(offsets)
    del found, offsets
    outside = torch.ge(positions, _per_slot(m.chunks32, st, ws), out=ws.take((W, K), torch.bool))
    outside.logical_and_(valid)
    bad |= outside.any(dim=1)
    valid.logical_and_(outside.logical_not_())
    del outside
    ws.release(mark)
    return positions.mul_(valid), valid, bad


# ---- encode and decode --------------------------------------------------------------------------------------------


def owner_matrix(rows: int, columns: int, device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A new ``(rows, columns)`` owner matrix (uninitialised): fp32, or bf16 for a bucket of bf16 gradients whose
    residuals are stored in 2 bytes or fewer (see :func:`matrix_dtype`)."""
    return torch.empty(rows, columns, dtype=dtype, device=device)


FUSED_MATRIX_DTYPES = (torch.float32, torch.bfloat16)  # owner matrices the CUDA op's gather and encode take


def matrix_dtype(srcs, residual_storage: Optional[str]) -> torch.dtype:
    """The owner matrix's dtype for a bucket of ``srcs`` whose residuals are stored as ``residual_storage`` (None: no
    error feedback): bf16 where every source is bf16 and the residuals keep no more than bf16 does (``"bf16"``,
    ``"fp8"``, ``"int8"``), so that the bucket's one copy costs 2 bytes per element, not 4; else fp32. The values are
    the same bf16 sums ZeRO-3 would reduce; every scale, threshold and decoded value is still computed in fp32, and
    the residual rounds to bf16 before its storage rounds it further (the CUDA op's kernels take either dtype)."""
    if residual_storage != "fp32" and srcs and all(s.dtype == torch.bfloat16 for s in srcs):
        return torch.bfloat16
    return torch.float32


def _unit(plan: FixedPlan) -> int:
    """Columns a slab of the value section starts on: whole scale groups and whole bytes of packed codes."""
    if not plan.quantize:
        return 1
    per = FORMATS[plan.value_format].per_byte
    return plan.group_size * per // math.gcd(plan.group_size, per)


def _dense_slabs(plan: FixedPlan, rows: int, column_bytes: int, ws: Workspace) -> List[Tuple[int, int]]:
    """Column ranges of the whole-sent columns up to the last whole :func:`_unit`, in slabs whose temporaries
    (``column_bytes`` a column of all rows) fit the workspace."""
    unit = _unit(plan)
    whole = plan.dense_columns // unit
    return [(u0 * unit, u1 * unit) for u0, u1 in slabs(whole, rows * unit * column_bytes, ws) if u1 > u0]


def encode(A: torch.Tensor, plan: FixedPlan, fingerprint: int, ws: Workspace, raw_scale: float = 1.0,
           sample_generator: Optional[torch.Generator] = None,
           rounding_generator: Optional[torch.Generator] = None, ops=None) -> torch.Tensor:
    """Every row's payload of the owner matrix ``A``, which becomes what error feedback keeps: ``A - decoded``.

    Args:
        A: fp32 or bf16 (:func:`matrix_dtype`) ``(R, C)``, contiguous (padding zero), overwritten in place with the
            residual (rounded to its dtype).
        plan: the bucket's plan; fingerprint: int31 of config and bucket (written in every header).
        ws: the temporaries' memory (the payloads too); raw_scale: raw values travel multiplied by it.
        sample_generator: draws the threshold samples; rounding_generator: stochastic rounding (INT4/INT2).
        ops: the fused ops where they code this (the CUDA op: scales, codes, packing and residual in one kernel),
            else the table of formats in torch ops (the same bits for INT4, INT2 and FP8).

    Returns:
        uint8 ``(R, payload_bytes)`` in ``ws`` (valid until the caller releases it).
    """
    R, device = A.shape[0], A.device
    L = plan.layout
    payload = ws.take((R, plan.payload_bytes), torch.uint8, device).zero_()
    mark = ws.mark()
    s_at, v_at, c_at, p_at = plan.sections
    g = plan.group if plan.quantize else L.align
    grouped = A.view(R, L.columns // g, g)
    gmax, gmin = grouped.amax(dim=-1).float(), grouped.amin(dim=-1).float()  # exact for a bf16 matrix
    not_finite = ~(torch.isfinite(gmax).all() & torch.isfinite(gmin).all())
    header = payload[:, :HEADER_BYTES].view(torch.int32)
    header.copy_(device_constant((MAGIC, fingerprint, 0), device, torch.int32))
    header[:, 2] = not_finite.to(torch.int32) * FLAG_NOT_FINITE
    sel = select(A, plan, ws, sample_generator) if plan.sparse_slots else None
    if plan.quantize and rounding_generator is None and hasattr(ops, "fixed_encode") and A.is_cuda and \
            A.dtype in FUSED_MATRIX_DTYPES and (sel is None or sel.flat.dtype == torch.int32):
        ops.fixed_encode(A, plan, sel, payload)
    else:
        inner = ws.mark()
        code = _code_values if plan.quantize else _raw_values
        decoded = code(A, sel, plan, payload, gmax, gmin, ws, raw_scale, rounding_generator)
        if sel is not None:  # what the slots sent leaves A (an empty slot sent 0)
            sent = decoded.neg_() if decoded.dtype == A.dtype else sel.values.view(decoded.shape).copy_(decoded.neg_())
            A.view(-1).index_put_((sel.flat.view(-1), ), sent.view(-1), accumulate=True)
            del sent
        del decoded
        ws.release(inner)
    if sel is not None:
        # the slots' values are coded and their elements spent: the positions take the elements' memory, and the
        # values' and the selection's spare memory the counting's and the packing's temporaries
        spent = Workspace([sel.values.view(-1).view(torch.uint8)] + sel.spare.regions)
        positions = slot_positions(sel, plan, spent)
        counts = _chunk_counts(positions, sel.slot_tensor, plan, spent)
        both = payload[:, c_at:p_at].view(R, -1, 2)
        both[..., 0] = counts & 0xFF
        both[..., 1] = counts >> 8
        offsets = positions.bitwise_and_((1 << plan.bits) - 1)
        pack_positions(offsets, plan.offset_bits, payload[:, p_at:p_at + plan.position_bytes], spent)
    ws.release(mark)
    return payload


def _code_values(A, sel, plan, payload, gmax, gmin, ws, raw_scale, generator) -> Optional[torch.Tensor]:
    """The quantized value section and scales of every row (whole-sent columns in slabs, then the last ones with the
    slots); the whole-sent columns' residual left in ``A``. Returns the slots' decoded values (``ws``) or None."""
    R, K, Cd = A.shape[0], plan.values, plan.dense_columns
    fmt, gs = FORMATS[plan.value_format], plan.group_size
    per = fmt.per_byte
    s_at, v_at, c_at, _ = plan.sections
    scales, packed = payload[:, s_at:v_at].view(torch.float32), payload[:, v_at:c_at]

    def code(c0, c1, codes, tmp):
        groups = A[:, c0:c1].view(R, -1, gs)
        part = scales[:, c0 // gs:c1 // gs]
        part.copy_(fmt.scales(groups, gmax[:, c0 // gs:c1 // gs], gmin[:, c0 // gs:c1 // gs], tmp.view(groups.shape)))
        fmt.encode_(groups, part, codes.view(groups.shape), tmp.view(groups.shape), generator)

    for c0, c1 in _dense_slabs(plan, R, 5, ws):
        mark = ws.mark()
        codes = ws.take((R, c1 - c0), torch.uint8)
        code(c0, c1, codes, ws.take((R, c1 - c0), torch.float32))
        pack_codes(codes, fmt.name, packed[:, c0 // per:c1 // per])
        ws.release(mark)
    tail = Cd - Cd % _unit(plan)
    if K == tail:
        return None
    codes = ws.take((R, plan.packed_values - tail), torch.uint8)
    codes[:, K - tail:].zero_()
    if Cd > tail:
        code(tail, Cd, codes[:, :Cd - tail], ws.take((R, Cd - tail), torch.float32))
    decoded = None
    if sel is not None:
        slots = sel.values.view(R, -1, gs)
        decoded = sel.spare.take(slots.shape, torch.float32)
        scales[:, Cd // gs:] = fmt.scales(slots, slots.amax(dim=-1).float(), slots.amin(dim=-1).float(), decoded)
        fmt.encode_(slots, scales[:, Cd // gs:], codes[:, Cd - tail:K - tail].view(slots.shape), decoded, generator)
    pack_codes(codes, fmt.name, packed[:, tail // per:])
    return decoded


def _raw_values(A, sel, plan, payload, gmax, gmin, ws, raw_scale, generator) -> Optional[torch.Tensor]:
    """Raw values as they travel (the communication dtype, times ``raw_scale``); their rounding error is left in
    ``A`` for the whole-sent columns. Returns the slots' decoded values (``ws``) or None."""
    R, Cd, K = A.shape[0], plan.dense_columns, plan.values
    _, v_at, c_at, _ = plan.sections
    values = payload[:, v_at:c_at].view(plan.value_dtype)
    for c0, c1 in _dense_slabs(plan, R, 4, ws):
        mark = ws.mark()
        _round_trip_(A[:, c0:c1], values[:, c0:c1], raw_scale, ws.take((R, c1 - c0), torch.float32))
        ws.release(mark)
    if sel is None:
        return None
    decoded = sel.spare.take((R, K - Cd), torch.float32)
    _round_trip_(sel.values, values[:, Cd:K], raw_scale, decoded)
    return decoded


def _round_trip_(values: torch.Tensor, out: torch.Tensor, raw_scale: float, decoded: torch.Tensor) -> None:
    """``out`` = ``values`` times ``raw_scale`` in ``out``'s dtype; ``decoded`` what the receivers decode of it;
    ``values`` minus that left in ``values``."""
    out.copy_(torch.mul(values, raw_scale, out=decoded) if raw_scale != 1 else values)
    decoded.copy_(out)
    values.sub_(decoded.div_(raw_scale) if raw_scale != 1 else decoded)


def header_mismatch(received: torch.Tensor, magic: int, fingerprint: int) -> torch.Tensor:
    """Bool ``(W,)``: the payloads whose ``int32`` header does not start with ``magic, fingerprint`` (on the device)."""
    header = received[:, :HEADER_BYTES].view(torch.int32)
    return (header[:, 0] != magic) | (header[:, 1] != fingerprint)


def _decode_columns(received: torch.Tensor, plan: FixedPlan, c0: int, c1: int, ws: Workspace,
                    raw_scale: float = 1.0) -> torch.Tensor:
    """fp32 ``(W, c1 - c0)`` in ``ws``: columns ``[c0, c1)`` of the value section of W payloads (whole-sent columns,
    then slots; ``c0`` on a :func:`_unit`)."""
    W, n = received.shape[0], c1 - c0
    s_at, v_at, c_at, _ = plan.sections
    out = ws.take((W, n), torch.float32)
    if not plan.quantize:
        out.copy_(received[:, v_at:c_at].view(plan.value_dtype)[:, c0:c1])
        return out.div_(raw_scale) if raw_scale != 1 else out
    fmt, gs = FORMATS[plan.value_format], plan.group_size
    b0, b1 = c0 // fmt.per_byte, -(-c1 // fmt.per_byte)
    codes = unpack_codes(received[:, v_at + b0:v_at + b1], fmt.name, ws.take((W, (b1 - b0) * fmt.per_byte),
                                                                             torch.uint8))
    scales = received[:, s_at:v_at].view(torch.float32)[:, c0 // gs:c1 // gs]
    fmt.decode(codes[:, :n].view(W, -1, gs), scales, out.view(W, -1, gs))
    return out


def _sum_senders(values: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` = the sum of the rows of ``values`` ``(W, n)`` in fp32, one sender after another (rank order: the same
    bits on every device). On the CPU one ``index_add_`` (sequential); on a GPU, where ``index_add_`` adds with
    atomics in no fixed order, one add per sender (the fused CUDA op decodes in one kernel instead)."""
    if values.is_cuda:
        out.copy_(values[0])
        for row in values[1:]:
            out.add_(row)
        return
    out.view(1, -1).zero_().index_add_(0, torch.zeros(values.shape[0], dtype=torch.long, device=values.device), values)


def decode_sum(received: torch.Tensor, plan: FixedPlan, fingerprint: int, row: int, ws: Workspace,
               raw_scale: float = 1.0, ops=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Decode every sender's payload for this owner's row and sum them, senders in rank order, in fp32.

    Args:
        received: uint8 ``(W, payload_bytes)``, row s from sender s.
        plan: the bucket's plan; fingerprint: expected in every header; row: this owner's row of the plan.
        ws: memory for the temporaries and the result; ops: the fused ops where they decode this (the CUDA op).

    Returns:
        ``(out, bad)``: fp32 ``(C,)`` in the layout's columns, in ``ws`` (all NaN when a sender's input was not
        finite or a payload is bad), and bool ``(W,)``, the senders whose payload does not match this rank's plan (a
        device tensor: nothing is read on the host).
    """
    W, device = received.shape[0], received.device
    L = plan.layout
    header = received[:, :HEADER_BYTES].view(torch.int32)
    bad = header_mismatch(received, MAGIC, fingerprint)
    out = ws.take((L.columns, ), torch.float32, device)
    mark = ws.mark()
    Cd, K = plan.dense_columns, plan.values
    cols = valid = None
    if plan.sparse_slots:  # each sender's slots: their columns in the sparse region, and which are filled
        st = slot_tensor(plan, ws, device)
        positions, valid, bad_pos = _decode_positions(received[:, plan.sections[2]:], plan, st, ws)
        bad |= bad_pos
        inner = ws.mark()
        cols = positions.add_(_per_slot(meta(plan, device).start32, st, ws))
        ws.release(inner)
        ws.add(st.view(-1).view(torch.uint8))  # read: its memory takes what follows (until the release below)
    if plan.quantize and hasattr(ops, "fixed_decode") and received.is_cuda:
        D = ws.take((W, L.columns - Cd), torch.float32) if cols is not None else None
        ops.fixed_decode(received, plan, cols, valid, D, out)
    else:
        for c0, c1 in _dense_slabs(plan, W, 6, ws):
            m = ws.mark()
            _sum_senders(_decode_columns(received, plan, c0, c1, ws, raw_scale), out[c0:c1])
            ws.release(m)
        tail = Cd - Cd % _unit(plan)
        out[Cd:].zero_()
        if K > tail:
            values = _decode_columns(received, plan, tail, K, ws, raw_scale)
            if Cd > tail:
                _sum_senders(values[:, :Cd - tail], out[tail:Cd])
            if cols is not None:
                out[Cd:].index_put_((cols, ), values[:, Cd - tail:].mul_(valid), accumulate=True)
    ws.release(mark)
    poison = bad.any() | ((header[:, 2] & FLAG_NOT_FINITE) != 0).any()
    return out.masked_fill_(poison, float("nan")), bad
