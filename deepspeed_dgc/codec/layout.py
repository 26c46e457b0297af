"""One bucket as a padded owner matrix, and the memory a bucket may reuse while it is reduced.

ZeRO-3 gives owner o of a tensor of n elements the slice ``flat[o*c : (o+1)*c]``, ``c = ceil(n / W)``. A bucket of T
tensors becomes one fp32 matrix of R rows (row r holds what goes to owner ``owners[r]``) in which every tensor has a
block of ``w = roundup(c, align)`` columns: its slice, then zeros. Aligned blocks make the batched stages plain
reshapes: a scale group, a residual storage group or a transform chunk (``align`` a multiple of each) never spans two
tensors, so ``A.view(R, C // g, g)`` holds the groups of every tensor at once, and a per-tensor value reaches its
elements by broadcasting a per-group vector. Tensors are placed in two regions, ``first`` ones before the others
(the fixed layout puts the tensors it sends whole before the sparsified ones), each in bucket order.

:class:`BucketLayout` is made once per bucket shape (the host's sizes only; its small device tensors are cached with it,
O(T) elements). :class:`Workspace` hands out typed views of memory whose contents are dead for the rest of a bucket
(the bucket's gradients once read, the owner matrix once encoded), so that a stage's temporaries need no new memory.
"""

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Dict, List, Optional, Sequence, Tuple

import torch


def round_up(x: int, m: int) -> int:
    """The smallest multiple of ``m`` that is at least ``x``."""
    return -(-x // m) * m


def real_count(numel: int, owner: int, chunk: int) -> int:
    """Elements of a tensor of ``numel`` elements that ``owner`` holds when every owner gets ``chunk`` (the rest of its
    row is padding): ``clamp(numel - owner * chunk, 0, chunk)``."""
    return max(0, min(chunk, numel - owner * chunk))


@dataclass(frozen=True)
class LayoutKey:
    """What a bucket's layout depends on (hashable: the cache key).

    Attributes:
        numels: n_i of each tensor, in bucket order.
        world: W, ranks of the partition group (``c_i = ceil(n_i / W)``).
        owners: the owner index of each row (flat: ``0..W-1``; hierarchical: the owners ``k L + l`` of a local rank).
        align: every tensor's block is a multiple of this many columns.
        first: per tensor, whether it is placed in the first region.
    """
    numels: Tuple[int, ...]
    world: int
    owners: Tuple[int, ...]
    align: int
    first: Tuple[bool, ...]


class BucketLayout:
    """The padded owner matrix of one bucket shape (see the module docstring).

    Attributes:
        key: the :class:`LayoutKey`; rows: R; chunks: ``c_i``; widths: ``w_i = roundup(c_i, align)``; cols: the first
        column of each tensor's block; placement: tensor indices in column order; split: the first column of the
        second region; columns: C (a multiple of ``align``); real: ``real[r][i]``, elements of tensor i in row r.
    """

    def __init__(self, key: LayoutKey):
        self.key = key
        self.rows = len(key.owners)
        self.align = key.align
        self.chunks = [-(-n // key.world) for n in key.numels]
        self.widths = [round_up(max(c, 1), key.align) for c in self.chunks]
        self.placement = [i for i, f in enumerate(key.first) if f] + [i for i, f in enumerate(key.first) if not f]
        self.cols = [0] * len(key.numels)
        col = 0
        for i in self.placement:
            self.cols[i] = col
            col += self.widths[i]
        self.columns = col
        self.split = sum(self.widths[i] for i, f in enumerate(key.first) if f)
        self.real = [[real_count(n, o, c) for n, c in zip(key.numels, self.chunks)] for o in key.owners]
        self._device: Dict[str, Dict[str, torch.Tensor]] = {}
        self._zeros: Dict[Tuple[str, torch.dtype], torch.Tensor] = {}

    @property
    def numels(self) -> Tuple[int, ...]:
        return self.key.numels

    @property
    def tensors(self) -> int:
        return len(self.key.numels)

    def region(self, first: bool) -> List[int]:
        """Tensor indices of a region in column order."""
        return [i for i in self.placement if self.key.first[i] == first]

    @cached_property
    def max_pad(self) -> int:
        """The longest run of zeros between two slices in :meth:`gather`."""
        return max([w - real for row in self.real for w, real in zip(self.widths, row)] or [0])

    def zeros(self, dtype: torch.dtype, device) -> torch.Tensor:
        """A cached 1-D zero tensor of :attr:`max_pad` elements (views of it pad the slices in :meth:`gather`)."""
        key = (str(device), dtype)
        if key not in self._zeros:
            self._zeros[key] = torch.zeros(self.max_pad, dtype=dtype, device=device)
        return self._zeros[key]

    def gather(self, srcs: Sequence[torch.Tensor], out: torch.Tensor, by_row: bool = False) -> torch.Tensor:
        """Copy per-tensor sources into ``out`` ``(R, C)`` in one ``torch.cat`` (converted to ``out``'s dtype): row r,
        tensor i is ``srcs[i].view(-1)[o_r c_i : o_r c_i + real]`` (``by_row``: ``[r c_i : ...]``, sources that hold
        only these rows) followed by zeros. Returns ``out``.

        Args:
            srcs: T tensors of ``n_i`` elements (any shape, contiguous); out: ``(R, C)``, contiguous.
        """
        zeros = self.zeros(srcs[0].dtype, srcs[0].device) if self.max_pad else None
        pieces = []
        for r, owner in enumerate(self.key.owners):
            for i in self.placement:
                c, real, width = self.chunks[i], self.real[r][i], self.widths[i]
                if real:
                    pieces.append(srcs[i].view(-1).narrow(0, (r if by_row else owner) * c, real))
                if width > real:
                    pieces.append(zeros.narrow(0, 0, width - real))
        return torch.cat(pieces, out=out.view(-1)).view(self.rows, self.columns)

    def scatter(self, matrix: torch.Tensor, dsts: Sequence[torch.Tensor]) -> None:
        """The inverse of :meth:`gather` (owner rows): copy the real part of each block of ``matrix`` ``(R, C)`` into
        ``dsts[i].view(-1)[o_r c_i : o_r c_i + real]`` (converted to the destinations' dtype), as one batched copy
        (``torch._foreach_copy_`` over views); the padding is dropped."""
        to, frm = [], []
        for r, owner in enumerate(self.key.owners):
            for i in self.placement:
                c, real = self.chunks[i], self.real[r][i]
                if real:
                    to.append(dsts[i].view(-1).narrow(0, owner * c, real))
                    frm.append(matrix[r].narrow(0, self.cols[i], real))
        if to:
            torch._foreach_copy_(to, frm)

    def row_slices(self, row_vec: torch.Tensor, row: int) -> List[torch.Tensor]:
        """Per tensor, in bucket order, the real part of its block in one row vector ``(C,)`` (views)."""
        return [row_vec.narrow(0, self.cols[i], self.real[row][i]) for i in range(self.tensors)]

    def block(self, matrix: torch.Tensor, i: int) -> torch.Tensor:
        """Tensor i's block of an ``(R, C)`` matrix: ``(R, w_i)`` (a view)."""
        return matrix.narrow(1, self.cols[i], self.widths[i])

    def flat_of(self, matrix: torch.Tensor, i: int, numel: Optional[int] = None) -> torch.Tensor:
        """Tensor i's real elements of an ``(R, C)`` matrix as one flat tensor in row-major order (a copy): what a
        per-tensor residual of ``R c_i`` elements, cut to ``numel`` (default ``n_i``), holds."""
        c = self.chunks[i]
        flat = self.block(matrix, i)[:, :c].reshape(-1)
        return flat[:self.key.numels[i] if numel is None else numel].clone()

    def place(self, matrix: torch.Tensor, i: int, flat: torch.Tensor) -> None:
        """Inverse of :meth:`flat_of`: write a flat tensor of up to ``R c_i`` elements into tensor i's block (row-major,
        the rest of the block zero)."""
        c = self.chunks[i]
        block = self.block(matrix, i)
        block.zero_()
        rows = torch.nn.functional.pad(flat.reshape(-1).to(matrix.dtype), (0, self.rows * c - flat.numel()))
        block[:, :c].copy_(rows.view(self.rows, c))

    def device_meta(self, device) -> Dict[str, torch.Tensor]:
        """Small device tensors of this layout (made once per device, nothing read back): ``group_tensor``, the tensor
        of each ``align``-column group in column order (int64, ``(C / align,)``)."""
        key = str(device)
        if key not in self._device:
            per_group = []
            for i in self.placement:
                per_group += [i] * (self.widths[i] // self.align)
            self._device[key] = {"group_tensor": host_to_device(torch.tensor(per_group, dtype=torch.long), device)}
        return self._device[key]


def host_to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on ``device``: through pinned memory without waiting on a GPU."""
    device = torch.device(device)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


_CONSTANTS: Dict[Tuple, torch.Tensor] = {}
MAX_CONSTANTS = 4096


def device_constant(values: Sequence, device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A small host list (a plan's per-tensor constants, a payload header, a format's divisor) as a 1-D ``dtype``
    tensor on ``device``, made once by :func:`host_to_device` and cached by its values (at most
    :data:`MAX_CONSTANTS`; the cache is emptied past that). Shared: callers read it, never write to it."""
    key = (tuple(values), str(device), dtype)
    if key not in _CONSTANTS:
        if len(_CONSTANTS) > MAX_CONSTANTS:
            _CONSTANTS.clear()
        _CONSTANTS[key] = host_to_device(torch.tensor(list(values), dtype=dtype), device)
    return _CONSTANTS[key]


_LAYOUTS: Dict[LayoutKey, BucketLayout] = {}
MAX_LAYOUTS = 64  # a density warm-up does not change a layout; bucket shapes are few


def layout_for(numels: Sequence[int], world: int, owners: Sequence[int], align: int,
               first: Optional[Sequence[bool]] = None) -> BucketLayout:
    """The cached :class:`BucketLayout` of a bucket shape (the oldest dropped past ``MAX_LAYOUTS``)."""
    key = LayoutKey(tuple(int(n) for n in numels), int(world), tuple(int(o) for o in owners), int(align),
                    tuple(bool(f) for f in (first if first is not None else [False] * len(numels))))
    if key not in _LAYOUTS:
        while len(_LAYOUTS) >= MAX_LAYOUTS:
            _LAYOUTS.pop(next(iter(_LAYOUTS)))
        _LAYOUTS[key] = BucketLayout(key)
    return _LAYOUTS[key]


def padded_elements(numels: Sequence[int], world: int, rows: int, align: int) -> int:
    """Elements of the padded owner matrix of tensors of ``numels`` elements, ``rows`` rows: ``sum_i rows *
    roundup(ceil(n_i / W), align)``. A bucket's state in a block (a residual or a momentum) holds this many values:
    ``rows`` is W on the flat topology and the N nodes' rows on the hierarchical one."""
    return sum(rows * round_up(max(-(-n // world), 1), align) for n in numels)


def alignment(*multiples: int) -> int:
    """The least common multiple of ``multiples`` (a block alignment that every group and chunk size divides)."""
    out = 1
    for m in multiples:
        out = out * m // math.gcd(out, m)
    return out


class Workspace:
    """Typed views of byte regions whose contents are dead, handed out first-fit in order (a bump allocator).

    A bucket's stages take their temporaries from here; a request that does not fit gets a new tensor. The caller
    owns the lifetimes: :meth:`mark` and :meth:`release` bracket the views of one stage, and nothing taken after a mark
    may be used after the release.

    Args:
        regions: 1-D uint8 tensors whose contents may be overwritten.
    """

    ALIGN = 64  # bytes: every view starts on a cache line

    def __init__(self, regions: Sequence[torch.Tensor] = ()):
        self.regions = [r for r in regions if r.numel()]
        self._used = [0] * len(self.regions)

    @property
    def capacity(self) -> int:
        return sum(r.numel() for r in self.regions)

    @property
    def free(self) -> int:
        """Bytes of the largest free tail of a region (what one more :meth:`take` can get without new memory)."""
        return max((r.numel() - round_up(u, self.ALIGN) for r, u in zip(self.regions, self._used)), default=0)

    def take(self, shape: Sequence[int], dtype: torch.dtype, device=None) -> torch.Tensor:
        """An uninitialised tensor of ``shape`` and ``dtype``: a view of a region where one has room, else new."""
        numel = math.prod(shape)
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        for k, region in enumerate(self.regions):
            start = round_up(self._used[k], self.ALIGN)
            if start + nbytes <= region.numel():
                self._used[k] = start + nbytes
                return region.narrow(0, start, nbytes).view(dtype).view(*shape)
        return torch.empty(tuple(shape), dtype=dtype, device=device if device is not None else
                           (self.regions[0].device if self.regions else None))

    def mark(self) -> Tuple[int, ...]:
        """The current fill of every region (for :meth:`release`)."""
        return tuple(self._used)

    def release(self, mark: Tuple[int, ...]) -> None:
        """Give back everything taken since ``mark``, and drop the regions added since (memory that was dead inside
        the stage, such as a temporary of it already read, is live again outside it)."""
        del self.regions[len(mark):]
        self._used = list(mark)

    def add(self, region: torch.Tensor) -> None:
        """Another dead region (say, the owner matrix once encoded), until the :meth:`release` of a mark taken before
        it."""
        if region.numel():
            self.regions.append(region)
            self._used.append(0)


MAX_SLABS = 8


def slabs(units: int, unit_bytes: int, ws: Workspace, at_most: int = MAX_SLABS,
          min_size: int = 1) -> List[Tuple[int, int]]:
    """``[start, end)`` ranges of equal size covering ``units`` units, as few as let one range's temporaries
    (``unit_bytes`` a unit) fit the workspace's free memory; at most ``at_most`` (beyond that they take new memory),
    none shorter than ``min_size`` (a short last range joins the one before). A bucket's passes over its elements run
    one range after another, so their temporaries stay within the dead memory; how many ranges depends on the ratio
    of the two, not on the bucket's tensors."""
    if units <= 0:
        return [(0, 0)]
    need, free = units * unit_bytes, ws.free
    count = 1 if need <= free else min(at_most, units, -(-need // max(free, 1)))
    step = max(-(-units // count), min_size)
    ranges = [(u, min(units, u + step)) for u in range(0, units, step)]
    if len(ranges) > 1 and ranges[-1][1] - ranges[-1][0] < min_size:
        ranges[-2:] = [(ranges[-2][0], units)]
    return ranges


def storage_region(tensors: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """The bytes that ``tensors`` cover as one 1-D uint8 view, when they are views of one storage that together tile a
    contiguous range of it (ZeRO-3's gradients in its bucket buffer); else None."""
    if not tensors:
        return None
    storage = tensors[0].untyped_storage()
    ptr = storage.data_ptr()
    spans = []
    for t in tensors:
        if t.untyped_storage().data_ptr() != ptr or not t.is_contiguous():
            return None
        start = t.storage_offset() * t.element_size()
        spans.append((start, start + t.numel() * t.element_size()))
    spans.sort()
    for (_, end), (start, _) in zip(spans, spans[1:]):
        if start != end:
            return None
    begin, end = spans[0][0], spans[-1][1]
    return torch.empty(0, dtype=torch.uint8, device=tensors[0].device).set_(storage, begin, (end - begin, ))
