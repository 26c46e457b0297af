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

Sizes depend on ``(c_i, s, k)`` only: one ``all_to_all_single`` of equal rows, nothing read back on the host.
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
from functools import cached_property, lru_cache
from typing import List, Sequence, Tuple

import torch

from .fixed import FixedPlan, decode_values, encode_values, header_mismatch

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

    @cached_property
    def value_plan(self) -> FixedPlan:
        """The value codec as a fixed-layout plan of tensors sent whole (one per tensor: groups restart); built once
        per plan (a bucket's encode and decode read it several times)."""
        quantize = self.value_format != "none"
        return FixedPlan.build(self.counts, [False] * len(self.counts), 1.0, quantize,
                               self.value_format if quantize else "int4", self.group_size, torch.float32)

    @property
    def position_bytes(self) -> int:
        """Bytes of a row's positions, ``log2(s)`` bits each."""
        return -(-self.values * self.position_bits // 8)

    @property
    def payload_bytes(self) -> int:
        vp = self.value_plan
        n = HEADER_BYTES + 4 * vp.n_groups + vp.value_bytes + self.position_bytes
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


# largest k whose top-k by k passes of argmax is faster than torch.topk (one CPU thread, 10.9M values in 64-wide
# chunks: k = 2 takes 0.60x of torch.topk's time, 3 0.83x, 4 0.95x, 5 1.05x)
ARGMAX_TOPK_MAX = 4


def topk_indices(a: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest of each row of ``a`` ``(..., s)`` along the last dim: int64 ``(..., k)``, in no
    particular order, NaN counting as the largest (``torch.topk(a, k, sorted=False).indices``; for
    ``1 <= k <= ARGMAX_TOPK_MAX`` by k passes of argmax, each taking the chosen entries out with -inf: the same set
    where values are distinct, k distinct indices in every row without -inf, as ``|X|`` rows are)."""
    if k < 1 or k > ARGMAX_TOPK_MAX or k >= a.shape[-1]:
        return torch.topk(a, k, dim=-1, sorted=False).indices
    first = a.argmax(dim=-1, keepdim=True)
    if k == 1:
        return first
    picked, rest = [first], a.scatter(-1, first, float("-inf"))
    for j in range(1, k):
        picked.append(rest.argmax(dim=-1, keepdim=True))
        if j + 1 < k:
            rest.scatter_(-1, picked[-1], float("-inf"))
    return torch.cat(picked, dim=-1)


def owner_chunks(src: torch.Tensor, numel: int, c: int, world: int, s: int) -> torch.Tensor:
    """fp32 ``(W, m, s)``: the owner matrix of a flat tensor of ``numel`` elements, rows cut into chunks of s."""
    m = -(-c // s)
    rows = torch.nn.functional.pad(src.reshape(-1)[:numel].float(), (0, world * c - numel)).view(world, c)
    return torch.nn.functional.pad(rows, (0, m * s - c)).view(world, m, s)


def _forward(x: torch.Tensor, transform: str) -> torch.Tensor:
    return x @ dct_matrix(x.shape[-1], x.device).T if transform == "dct" else x


def _inverse(x: torch.Tensor, transform: str) -> torch.Tensor:
    return x @ dct_matrix(x.shape[-1], x.device) if transform == "dct" else x


def encode(srcs: Sequence[torch.Tensor], numels: Sequence[int], plan: ChunkPlan, world: int,
           fingerprint: int) -> Tuple[torch.Tensor, List[torch.Tensor], int]:
    """Every owner row's payload, and what left each source.

    Args:
        srcs: per tensor, fp32 ``(n_i,)`` (a rank's decoupled momentum), on one device.
        numels: n_i; plan: the bucket's :class:`ChunkPlan` (``chunks[i] = ceil(n_i / world)``).
        world: W, rows; fingerprint: int31 written in every header.

    Returns:
        ``(payloads, sent, kept)``: uint8 ``(W, payload_bytes)`` (row o for owner o); per tensor, fp32 ``(n_i,)``
        the decoded value of what was sent (the receivers' view, quantization included), to subtract from the
        source; values sent (all rows).
    """
    device = srcs[0].device
    s, k, vp = plan.chunk, plan.topk, plan.value_plan
    values, positions = [], []
    for src, n, c in zip(srcs, numels, plan.chunks):
        coef = _forward(owner_chunks(src, n, c, world, s), plan.transform)
        idx = topk_indices(coef.abs(), k)  # (W, m, k)
        values.append(coef.gather(2, idx).view(world, -1))
        positions.append(idx.view(world, -1))
    vals = torch.cat(values, dim=1)
    pos = torch.cat(positions, dim=1)
    value_bytes, decoded = encode_values(vals, vp)
    parts = [header_rows(MAGIC, fingerprint, world, device)] + value_bytes + [pack_uint(pos, plan.position_bits)]
    payload = torch.cat(parts, dim=1)
    payload = torch.nn.functional.pad(payload, (0, plan.payload_bytes - payload.shape[1]))
    sent, at = [], 0
    for n, c, m, cnt, idx in zip(numels, plan.chunks, plan.n_chunks, plan.counts, positions):
        x = torch.zeros(world, m, s, device=device).scatter_(2, idx.view(world, m, k),
                                                             decoded[:, at:at + cnt].view(world, m, k))
        sent.append(_inverse(x, plan.transform).view(world, m * s)[:, :c].reshape(-1)[:n])
        at += cnt
    return payload, sent, world * plan.values


def decode_sum(received: torch.Tensor, plan: ChunkPlan, fingerprint: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """This owner's row of the sum over senders, from the W payloads it received.

    Args:
        received: uint8 ``(W, payload_bytes)``, row r from rank r.
        plan: the bucket's plan; fingerprint: the one every header must carry.

    Returns:
        ``(out, bad)``: fp32 ``(sum_i c_i,)``, tensor i in columns ``[sum_{j<i} c_j, ...)`` (NaN everywhere when a
        payload does not match); bool ``(W,)``, the senders whose payload does not match.

    Raises:
        ValueError: ``received`` is not uint8 ``(W, payload_bytes)``.
    """
    if received.dtype != torch.uint8 or received.dim() != 2 or received.shape[1] != plan.payload_bytes:
        raise ValueError(f"decode_sum: expected uint8 (W, {plan.payload_bytes}) payloads, got {received.dtype} of shape "
                         f"{tuple(received.shape)}")
    W, device = received.shape[0], received.device
    s, k = plan.chunk, plan.topk
    bad = header_mismatch(received, MAGIC, fingerprint)
    vals, at = decode_values(received, HEADER_BYTES, plan.value_plan)
    pos = unpack_uint(received[:, at:at + plan.position_bytes], plan.position_bits, plan.values)
    outs, col = [], 0
    for c, m, cnt in zip(plan.chunks, plan.n_chunks, plan.counts):
        index = (torch.arange(m, device=device)[None, :, None] * s + pos[:, col:col + cnt].view(W, m, k)).reshape(-1)
        coef = torch.zeros(m * s, device=device).scatter_add_(0, index, vals[:, col:col + cnt].reshape(-1))
        outs.append(_inverse(coef.view(m, s), plan.transform).view(-1)[:c])
        col += cnt
    out = torch.cat(outs)
    return out.masked_fill(bad.any(), float("nan")), bad
