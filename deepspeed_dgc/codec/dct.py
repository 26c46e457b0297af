"""Chunked top-k of a transform, DeMo's codec, on ZeRO-3's owner rows with every size fixed by the shape.

DeMo (Peng, Quesnelle and Kingma, "DeMo: Decoupled Momentum Optimization", arXiv 2411.19870, section 3,
Algorithm 1; code: bloc97/DeMo ``demo.py``, ``TransformDCT`` and ``CompressDCT``) sends, per chunk of a tensor,
the k coefficients of largest magnitude of the chunk's orthonormal DCT-II. Here the chunks are cut inside the
owners' partitions, so that no chunk spans two owners and each owner decodes only its own:

- tensor i of a bucket is an owner matrix ``(W, c_i)`` (row o: owner o's slice ``flat[o*c_i:(o+1)*c_i]``,
  zero-padded past ``n_i``), each row cut into ``m_i = ceil(c_i / s)`` chunks of ``s`` columns (the last one
  zero-padded);
- each chunk is transformed (``"dct"``: ``X = x D^T`` with D the orthonormal DCT-II matrix, ``D D^T = I``;
  ``"none"``: ``X = x``, plain chunked top-k as SparseLoCo, arXiv 2508.15706, section 3) and its ``k`` largest
  ``|X|`` are kept (``torch.topk``, DeMo's ``CompressDCT.compress``);
- the kept values travel in a value format of :mod:`~deepspeed_dgc.codec.fixed` (INT4, INT2, INT1 ternary, FP8,
  with an fp32 absmax scale per ``group_size`` values, groups restarting at each tensor) or raw fp32, and each
  carries its in-chunk position in ``log2(s)`` bits (s is a power of two).

Sizes depend on ``(c_i, s, k)`` only: one ``all_to_all_single`` of equal rows, nothing read back on the host. A bucket
is one padded owner matrix (:class:`~deepspeed_dgc.codec.layout.BucketLayout`, blocks aligned to s), so every chunk of
every tensor is transformed by one matrix product and topped by one batched selection along the chunk axis. Products
that a tensor alone would have made of one or two rows are computed as such (a batched product of those rows): BLAS
rounds those by another kernel, and this keeps every result bit for bit what the per-tensor computation gave where
BLAS rounds every product of more rows as it rounds a large one's (MKL on Intel CPUs). Where it does not (MKL on AMD
EPYC rounds products of 3, 5-7 and 9-11 rows, and batched products of 5-7 and 9-11, by other kernels), tensors of
those many rows get coefficients within fp32 rounding of their own products', not the same bits; nothing else
depends on it (the slabs are products of at least ``GEMM_MIN_ROWS`` rows).
A row's payload (:attr:`ChunkPlan.payload_bytes` bytes)::

    int32[3]  header: MAGIC, fingerprint, 0
    fp32[G]   group scales (quantized formats only)
    values    codes (or raw fp32), K = sum_i m_i k per row
    bytes     the K in-chunk positions, log2(s) bits each, little-endian
    zeros     padding to a multiple of 4 bytes

The receiver sums every sender's coefficients of its own row densely (``scatter_add``, senders in rank order) and
transforms back once per tensor: the sum is linear, so ``IDCT(sum_r X_r) = sum_r IDCT(X_r)``. A payload whose
header does not match (another config or bucket) makes the receiver's row NaN and sets a flag (read on the host
only after a skipped step, as the fixed layout's).
"""

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Dict, List, Tuple

import torch

from .fixed import header_mismatch
from .formats import code_bytes, decode_segments, encode_segments
from .layout import BucketLayout, Workspace, slabs

MAGIC = 0x44474344  # "DGCD"
HEADER_BYTES = 12
TRANSFORMS = ("dct", "none")


@lru_cache(maxsize=None)
def _dct_matrix_cpu(s: int) -> torch.Tensor:
    n = torch.arange(s, dtype=torch.float64)
    d = torch.cos(math.pi * (n[None, :] + 0.5) * n[:, None] / s) * math.sqrt(2.0 / s)
    d[0] /= math.sqrt(2.0)
    return d.float()


_MATRICES = {}


def dct_matrix(s: int, device) -> torch.Tensor:
    """The orthonormal DCT-II matrix, fp32 ``(s, s)``: ``D[k, j] = a_k cos(pi (j + 1/2) k / s)``, ``a_0 = sqrt(1/s)``,
    ``a_k = sqrt(2/s)`` (computed in float64, cached per device). Forward ``X = x D^T``, inverse ``x = X D``."""
    key = (s, str(device))
    if key not in _MATRICES:
        _MATRICES[key] = _dct_matrix_cpu(s).to(device)
    return _MATRICES[key]


@dataclass(frozen=True)
class ChunkPlan:
    """Sizes of one bucket's payloads (every rank computes the same from the shape and the codec).

    Attributes:
        chunks: columns ``c_i`` of each tensor in an owner row.
        chunk: s, columns per transform chunk (a power of two, 2 to 4096); topk: k values kept per chunk.
        transform: ``"dct"`` or ``"none"``.
        value_format: a format of :mod:`~deepspeed_dgc.codec.fixed`, or ``"none"`` (raw fp32).
        group_size: values per scale.
    """
    chunks: Tuple[int, ...]
    chunk: int
    topk: int
    transform: str
    value_format: str
    group_size: int

    def __post_init__(self):
        s, k = self.chunk, self.topk
        if s < 2 or s > 4096 or s & (s - 1):
            raise ValueError(f"chunk size must be a power of two from 2 to 4096, got {s}")
        if not 1 <= k <= s:
            raise ValueError(f"top-k per chunk must be 1 to the chunk size {s}, got {k}")
        if self.transform not in TRANSFORMS:
            raise ValueError(f"unknown transform {self.transform!r}; allowed: {', '.join(TRANSFORMS)}")

    @property
    def n_chunks(self) -> Tuple[int, ...]:
        """``m_i = ceil(c_i / s)`` per tensor."""
        return tuple(-(-c // self.chunk) for c in self.chunks)

    @property
    def counts(self) -> Tuple[int, ...]:
        """Values per row of each tensor: ``m_i k``."""
        return tuple(m * self.topk for m in self.n_chunks)

    @property
    def values(self) -> int:
        """K, values per row."""
        return sum(self.counts)

    @property
    def position_bits(self) -> int:
        return self.chunk.bit_length() - 1

    @property
    def quantize(self) -> bool:
        return self.value_format != "none"

    @property
    def n_groups(self) -> int:
        """Scales per row: groups of ``group_size`` values restarting at each tensor (0 for raw values)."""
        return sum(-(-k // self.group_size) for k in self.counts) if self.quantize else 0

    @property
    def value_bytes(self) -> int:
        return code_bytes(self.values, self.value_format) if self.quantize else 4 * self.values

    @property
    def position_bytes(self) -> int:
        """Bytes of a row's positions, ``log2(s)`` bits each."""
        return -(-self.values * self.position_bits // 8)

    @property
    def payload_bytes(self) -> int:
        n = HEADER_BYTES + 4 * self.n_groups + self.value_bytes + self.position_bytes
        return n + (-n % 4)


_HEADERS = {}
MAX_HEADERS = 1024


def header_rows(magic: int, fingerprint: int, world: int, device) -> torch.Tensor:
    """uint8 ``(W, 12)``: the header ``int32[magic, fingerprint, 0]`` of every row, made once per bucket shape and
    device (no host data copied to the device per bucket)."""
    key = (magic, fingerprint, world, str(device))
    if key not in _HEADERS:
        while len(_HEADERS) >= MAX_HEADERS:
            _HEADERS.pop(next(iter(_HEADERS)))
        _HEADERS[key] = torch.tensor([magic, fingerprint, 0], dtype=torch.int32).expand(world, 3).contiguous().view(
            torch.uint8).to(device)
    return _HEADERS[key]


def _pack_group(bits: int) -> int:
    """Values per 64-bit word of the word-wise packing: the fewest whose bits fill whole bytes (0: none fits)."""
    g = 8 // math.gcd(bits, 8)
    return g if g * bits <= 64 else 0


def pack_uint(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Non-negative integers below ``2^bits`` ``(R, n)`` as little-endian bit strings: uint8 ``(R, ceil(n bits / 8))``.

    Every ``g`` values (``g bits`` a multiple of 8, at most 64) are shifted into one int64 word and its ``g bits / 8``
    low bytes written: a few passes over ``n / g`` words (one int32 per bit of every value otherwise, for the widths
    where no such ``g`` exists: 9, 11, 13 and 15 bits). The bytes are the same either way.
    """
    R, n = x.shape
    g = _pack_group(bits)
    if R == 0 or n == 0:
        return torch.zeros(R, -(-n * bits // 8), dtype=torch.uint8, device=x.device)
    if g == 0:
        shifts = torch.arange(bits, dtype=torch.int32, device=x.device)
        b = ((x.to(torch.int32)[..., None] >> shifts) & 1).reshape(R, n * bits)
        b = torch.nn.functional.pad(b, (0, -(n * bits) % 8)).view(R, -1, 8)
        return (b << torch.arange(8, dtype=torch.int32, device=x.device)).sum(dim=2).to(torch.uint8)
    words = torch.nn.functional.pad(x.long(), (0, -n % g)).view(R, -1, g)
    word = words[..., 0].clone()
    for j in range(1, g):
        word |= words[..., j] << (j * bits)
    nbytes = g * bits // 8
    out = torch.stack([(word >> (8 * i)) & 0xFF for i in range(nbytes)], dim=2).to(torch.uint8)
    return out.view(R, -1)[:, :-(-(n * bits) // 8)]


def unpack_uint(data: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_uint`: int64 ``(R, n)``."""
    R = data.shape[0]
    g = _pack_group(bits)
    if R == 0 or n == 0:
        return torch.zeros(R, n, dtype=torch.long, device=data.device)
    if g == 0:
        b = (data.to(torch.int32)[..., None] >> torch.arange(8, dtype=torch.int32, device=data.device)) & 1
        b = b.reshape(R, -1)[:, :n * bits].reshape(R, n, bits)
        return (b << torch.arange(bits, dtype=torch.int32, device=data.device)).sum(dim=2).long()
    nbytes = g * bits // 8
    words = -(-n // g)
    raw = torch.nn.functional.pad(data[:, :-(-(n * bits) // 8)], (0, words * nbytes - (-(-(n * bits) // 8))))
    raw = raw.long().view(R, words, nbytes)
    word = raw[..., 0].clone()
    for i in range(1, nbytes):
        word |= raw[..., i] << (8 * i)
    mask = (1 << bits) - 1
    return torch.stack([(word >> (j * bits)) & mask for j in range(g)], dim=2).view(R, -1)[:, :n]


# largest k for which k passes of argmax take less time than torch.topk of k in 64-wide chunks on one CPU thread
# (at k = 5 torch.topk is the cheaper; the timings are in results/profile.md)
ARGMAX_TOPK_MAX = 4


def topk_(a: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The k largest of each row of ``a`` ``(..., s)`` along the last dim: ``(values, indices)``, ``(..., k)`` each, in
    no particular order, NaN counting as the largest; ``a`` is overwritten. For ``1 <= k <= ARGMAX_TOPK_MAX`` by k
    passes of argmax, each taking the chosen entry out with -inf (the same set as ``torch.topk`` where values are
    distinct, k distinct indices in every row without -inf, as ``|X|`` rows are); else ``torch.topk(sorted=False)``."""
    if k < 1 or k > ARGMAX_TOPK_MAX or k >= a.shape[-1]:
        top = torch.topk(a, k, dim=-1, sorted=False)
        return top.values, top.indices
    values, indices = [], []
    for j in range(k):
        idx = a.argmax(dim=-1, keepdim=True)
        values.append(a.gather(-1, idx))
        indices.append(idx)
        if j + 1 < k:
            a.scatter_(-1, idx, float("-inf"))
    return torch.cat(values, dim=-1), torch.cat(indices, dim=-1)


def layout_align(plan: ChunkPlan) -> int:
    """The block alignment of a bucket coded by ``plan``: whole transform chunks."""
    return plan.chunk


def _small_rows(L: BucketLayout, plan: ChunkPlan, rows: int, device) -> Dict[int, torch.Tensor]:
    """The rows of the ``(rows * C / s, s)`` chunk matrix that belong to tensors whose own product would have had one
    or two rows (``rows * m_i``), grouped by that count: count -> int64 ``(B, count)`` (cached per layout)."""
    key = (L.key, plan.chunk, rows, str(device))
    if key not in _SMALL:
        if len(_SMALL) > 256:
            _SMALL.clear()
        s, M = plan.chunk, L.columns // plan.chunk
        groups: Dict[int, List[List[int]]] = {}
        for i in range(L.tensors):
            m = L.widths[i] // s
            if rows * m <= 2:
                groups.setdefault(rows * m, []).append([r * M + L.cols[i] // s + j for r in range(rows) for j in range(m)])
        _SMALL[key] = {n: torch.tensor(g, dtype=torch.long).to(device) for n, g in groups.items()}
    return _SMALL[key]


_SMALL: Dict[Tuple, Dict[int, torch.Tensor]] = {}


def padding_mask(L: BucketLayout, s: int, device) -> torch.Tensor:
    """Bool ``(R, C / s, s)``: the padding of the owner matrix (kept at 0), made from the layout's per-tensor real
    counts (O(T) cached values; the mask itself is a temporary)."""
    key = ("real", L.key, s, str(device))
    if key not in _SMALL:
        per_tensor = torch.tensor([[L.real[r][i] for i in L.placement] for r in range(L.rows)], dtype=torch.int32)
        chunks = torch.tensor([L.widths[i] // s for i in L.placement], dtype=torch.long)
        _SMALL[key] = (per_tensor.to(device), chunks.to(device), int(chunks.sum()))
    real, chunks, M = _SMALL[key]
    T = chunks.numel()
    tensor = torch.repeat_interleave(torch.arange(T, device=device), chunks, output_size=M)
    first = torch.cumsum(chunks, 0) - chunks
    start = ((torch.arange(M, device=device) - first[tensor]) * s).to(torch.int32)  # the chunk's first column
    limit = real[:, tensor] - start[None, :]  # (R, M): real columns of each chunk (may be <= 0 or > s)
    return torch.arange(s, dtype=torch.int32, device=device)[None, None, :] >= limit[..., None]


GEMM_MIN_ROWS = 64  # a slab of chunks is one product of at least this many rows (BLAS rounds 1-2 rows otherwise)


def _signed_topk_(coef: torch.Tensor, k: int, values: torch.Tensor, idx: torch.Tensor, ws: Workspace) -> None:
    """The k coefficients of largest magnitude of each row of ``coef`` ``(n, s)`` (signed) into ``values`` and
    ``idx`` ``(n, k)``; ``coef`` is overwritten."""
    negative = torch.signbit(coef, out=ws.take(coef.shape, torch.bool, coef.device))
    v, i = topk_(coef.abs_(), k)
    torch.where(negative.gather(1, i), v.neg(), v, out=values)
    idx.copy_(i)


def encode(X: torch.Tensor, L: BucketLayout, plan: ChunkPlan, fingerprint: int,
           ws: Workspace) -> Tuple[torch.Tensor, int]:
    """Every owner row's payload of the momenta ``X``, and what was sent leaves ``X``.

    Args:
        X: fp32 ``(R, C)``, the padded owner matrix of a rank's decoupled momenta (blocks aligned to the chunk, padding
            0); on return it holds what stays: ``X - IDCT(decoded)`` on the real elements, 0 in the padding.
        L: its layout; plan: the bucket's :class:`ChunkPlan` (``chunks[i] = c_i``); fingerprint: int31 in every header.
        ws: memory for the temporaries: the transform runs over slabs of chunks that fit it (the same bits whatever
            the slabs: each chunk is its own row of the products).

    Returns:
        ``(payloads, kept)``: uint8 ``(R, payload_bytes)`` (row o for owner o) and the values sent (all rows).
    """
    R, device = X.shape[0], X.device
    s, k = plan.chunk, plan.topk
    N = R * (L.columns // s)
    chunks = X.view(N, s)
    dct = plan.transform == "dct"
    small = _small_rows(L, plan, R, device) if dct else {}
    mark = ws.mark()
    values, idx = ws.take((N, k), torch.float32), ws.take((N, k), torch.int64)

    for r0, r1 in slabs(N, s * 5, ws, min_size=GEMM_MIN_ROWS):  # the transform and the top-k, a slab at a time
        inner = ws.mark()
        coef = ws.take((r1 - r0, s), torch.float32)
        if dct:
            torch.mm(chunks[r0:r1], dct_matrix(s, device).T, out=coef)
        else:
            coef.copy_(chunks[r0:r1])
        _signed_topk_(coef, k, values[r0:r1], idx[r0:r1], ws)
        ws.release(inner)
    kept_small = {}
    for n, index in small.items():  # tensors whose own product has one or two rows: theirs, batched
        inner = ws.mark()
        x = chunks[index]
        kept_small[n] = x
        coef = torch.bmm(x, dct_matrix(s, device).T.expand(index.shape[0], s, s)).view(-1, s)
        vals, picked = ws.take((coef.shape[0], k), torch.float32), ws.take((coef.shape[0], k), torch.int64)
        _signed_topk_(coef, k, vals, picked, ws)
        values.index_copy_(0, index.view(-1), vals)
        idx.index_copy_(0, index.view(-1), picked)
        ws.release(inner)
    values = values.view(R, -1)
    counts = list(plan.counts)
    if plan.quantize:
        scales, packed, decoded = encode_segments(values, counts, plan.value_format, plan.group_size)
        parts = [scales.view(torch.uint8), packed]
    else:
        decoded = values
        parts = [values.contiguous().view(torch.uint8)]
    decoded = decoded.view(N, k)
    for r0, r1 in slabs(N, s * 4, ws, min_size=GEMM_MIN_ROWS):  # what was sent leaves X, a slab at a time
        inner = ws.mark()
        sent = ws.take((r1 - r0, s), torch.float32).zero_().scatter_(1, idx[r0:r1], decoded[r0:r1])
        if dct:
            chunks[r0:r1].addmm_(sent, dct_matrix(s, device), alpha=-1)
        else:
            chunks[r0:r1].sub_(sent)
        ws.release(inner)
    for n, index in small.items():
        sent = torch.zeros(index.numel(), s, device=device).scatter_(1, idx[index.view(-1)], decoded[index.view(-1)])
        chunks[index] = kept_small[n] - torch.bmm(sent.view(*index.shape, s), dct_matrix(s, device).expand(
            index.shape[0], s, s))
    X.view(R, -1, s).masked_fill_(padding_mask(L, s, device), 0.0)
    payload = torch.cat([header_rows(MAGIC, fingerprint, R, device)] + parts + [pack_uint(idx.view(R, -1),
                                                                                        plan.position_bits)], dim=1)
    ws.release(mark)
    payload = torch.nn.functional.pad(payload, (0, plan.payload_bytes - payload.shape[1]))
    return payload, R * plan.values


def decode_sum(received: torch.Tensor, L: BucketLayout, plan: ChunkPlan, fingerprint: int,
               ws: Workspace) -> Tuple[torch.Tensor, torch.Tensor]:
    """This owner's row of the sum over senders, from the W payloads it received.

    Args:
        received: uint8 ``(W, payload_bytes)``, row r from rank r.
        L: the bucket's layout; plan: the bucket's plan; fingerprint: the one every header must carry.
        ws: memory for the temporaries and the result.

    Returns:
        ``(out, bad)``: fp32 ``(C,)`` in the layout's columns (NaN everywhere when a payload does not match); bool
        ``(W,)``, the senders whose payload does not match.

    Raises:
        ValueError: ``received`` is not uint8 ``(W, payload_bytes)``.
    """
    if received.dtype != torch.uint8 or received.dim() != 2 or received.shape[1] != plan.payload_bytes:
        raise ValueError(f"decode_sum: expected uint8 (W, {plan.payload_bytes}) payloads, got {received.dtype} of shape "
                         f"{tuple(received.shape)}")
    device = received.device
    s, k = plan.chunk, plan.topk
    M, K = L.columns // s, plan.values
    bad = header_mismatch(received, MAGIC, fingerprint)
    at = HEADER_BYTES
    if plan.quantize:
        G = plan.n_groups
        scales = received[:, at:at + 4 * G].contiguous().view(torch.float32)
        vals = decode_segments(scales, received[:, at + 4 * G:at + 4 * G + plan.value_bytes], list(plan.counts),
                               plan.value_format, plan.group_size)
    else:
        vals = received[:, at:at + plan.value_bytes].contiguous().view(torch.float32)
    at += 4 * plan.n_groups + plan.value_bytes
    pos = unpack_uint(received[:, at:at + plan.position_bytes], plan.position_bits, K)
    index = (torch.arange(K, device=device) // k * s)[None, :] + pos
    out = ws.take((M * s, ), torch.float32).zero_().scatter_add_(0, index.view(-1), vals.reshape(-1))
    if plan.transform == "dct":  # back from the coefficients in place, a slab of chunks at a time
        rows, d = out.view(M, s), dct_matrix(s, device)
        patches = [(index, torch.bmm(rows[index], d.expand(index.shape[0], s, s)))
                   for index in _small_rows(L, plan, 1, device).values()]
        for r0, r1 in slabs(M, s * 4, ws, min_size=GEMM_MIN_ROWS):
            mark = ws.mark()
            rows[r0:r1] = torch.mm(rows[r0:r1], d, out=ws.take((r1 - r0, s), torch.float32))
            ws.release(mark)
        for index, product in patches:
            rows[index] = product
    return out.masked_fill_(bad.any(), float("nan")), bad
