"""INT8 storage of state kept between steps (residuals, momenta) with stochastic rounding.

Each group of ``group`` consecutive values of a row (64 by default) is stored as int8 codes ``c`` in [-127, 127] and one
bf16 absmax scale ``s`` (the group's largest magnitude over 127, rounded up to bf16), so a value decodes as ``c * s``:
``1 + 2 / 64 = 1.03125`` bytes per element. The codes are rounded stochastically (``floor(v + u)``, ``u`` uniform in
[0, 1)), so a stored value is unbiased: ``E[c s] = x``. Round-to-nearest would drop every change below
half a step, and a momentum that decays by 0.999 per step changes by less than that at almost every element (with
bf16 and round-to-nearest the decay itself is lost); stochastic rounding keeps such changes in expectation (Gupta et
al., "Deep Learning with Limited Numerical Precision", ICML 2015, section 3; Q-GaLore rounds its INT8 weights so,
arXiv 2407.08296; the block-wise absmax scales are those of Dettmers et al.'s 8-bit optimizer states, arXiv
2110.02861, which round to nearest).

Decoding and encoding again rounds again (a group's largest code may be 126, so its scale changes): a checkpoint keeps
the codes and scales themselves (:meth:`~deepspeed_dgc.memory.error_feedback.ErrorFeedback.export`).

The noise is drawn from a generator seeded by the caller's seed and a slab index: slabs are fixed column ranges of the
matrix (independent of free memory), so the same state, seed and shape give the same codes on every run.
"""

import hashlib
from typing import Dict, Tuple

import torch

INT8_GROUP = 64  # values per bf16 scale
INT8_BYTES = 1.0 + 2.0 / INT8_GROUP  # bytes per element
SLAB_ELEMENTS = 1 << 22  # values rounded per generator draw: the noise temporary is at most 16 MiB
MIN_SLABS = 4  # ... and at most a quarter of the matrix

_GENERATORS: Dict[str, torch.Generator] = {}


def round_seed(*parts) -> int:
    """A 63-bit seed from ``parts`` (ints and strings), the same in every process (not Python's salted ``hash``)."""
    digest = hashlib.blake2b("/".join(str(p) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _generator(device: torch.device, seed: int) -> torch.Generator:
    key = str(device)
    gen = _GENERATORS.get(key)
    if gen is None:
        gen = _GENERATORS[key] = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def _round_up_bf16(x: torch.Tensor) -> torch.Tensor:
    """The least bf16 number at or above each element of ``x`` (fp32, >= 0; inf and NaN stay so), as bf16."""
    bits = x.view(torch.int32).to(torch.int64)
    up = torch.where(torch.isfinite(x), (bits + 0xFFFF) & 0xFFFF0000, bits).to(torch.int32)
    return up.view(torch.float32).to(torch.bfloat16)  # exact: the low 16 bits are 0 (or the value is inf/NaN)


def group_for(align: int) -> int:
    """The scale group of a block whose tensors' column ranges are multiples of ``align``: 64, or ``align`` when it is
    smaller (a power of two), so a group never spans two tensors."""
    g = INT8_GROUP
    while align % g:
        g //= 2
    return g


def encode_(A: torch.Tensor, group: int, seed: int, ws=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """INT8 codes and bf16 absmax scales of ``A``, rounded stochastically; ``A`` is overwritten.

    Args:
        A: fp32 or bf16 ``(R, C)``, ``C`` a multiple of ``group``; group: values per scale (a power of two); seed: the
            noise's seed (:func:`round_seed`); ws: a :class:`~deepspeed_dgc.codec.layout.Workspace` of dead memory for the
            noise (4 bytes per value of a slab), or None.

    Returns:
        ``(codes, scales)``: int8 ``(R, C)`` and bf16 ``(R, C / group)``. A non-finite value makes its group's scale
        non-finite, so the group decodes to non-finite values (never to silent finite ones).
    """
    R, C = A.shape
    groups = A.view(R, C // group, group)
    amax = torch.maximum(groups.amax(dim=-1), groups.amin(dim=-1).neg_()).float()
    scales = _round_up_bf16(amax.div_(127.0))
    s = scales.float()
    groups.div_(torch.where(s > 0, s, torch.ones_like(s))[..., None])  # now |v| <= 127 (up to one fp32 rounding)
    codes = torch.empty(R, C, dtype=torch.int8, device=A.device)
    # at least MIN_SLABS slabs (the noise of one is a quarter of the matrix, so it fits in memory the bucket freed),
    # their widths set by the shape alone, so the same shape draws the same noise whatever memory is free
    width = max(group, min(SLAB_ELEMENTS // max(R, 1), -(-C // MIN_SLABS)) // group * group)
    for i, c0 in enumerate(range(0, C, width)):
        v = A[:, c0:c0 + width]
        mark = ws.mark() if ws is not None else None
        noise = ws.take(v.shape, torch.float32, A.device) if ws is not None else torch.empty(v.shape, device=A.device)
        torch.rand(v.shape, generator=_generator(A.device, seed + i), device=A.device, out=noise)
        # floor(v + u), u uniform in [0, 1): up with probability frac(v), so E[code] = v
        codes[:, c0:c0 + width].copy_(noise.add_(v).floor_().clamp_(-127.0, 127.0))
        if ws is not None:
            ws.release(mark)
    return codes, scales


def decode(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 ``(R, C)`` values of int8 ``codes`` ``(R, C)`` with bf16 ``scales`` ``(R, C / group)`` (a new tensor)."""
    R, C = codes.shape
    out = codes.float()
    out.view(R, scales.shape[1], C // scales.shape[1]).mul_(scales.float()[..., None])
    return out


def decode_into(out: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """:func:`decode` into ``out`` (fp32, the shape of ``codes``, may be a column slice of a larger matrix)."""
    R, C = codes.shape
    out.copy_(codes)
    out.view(R, scales.shape[1], C // scales.shape[1]).mul_(scales.float()[..., None])
    return out


def encode_flat(r: torch.Tensor, seed: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """A flat fp32 ``(n,)`` tensor stored as one row in groups of 64 (the last one padded with zeros): int8 ``(n,)``
    codes and bf16 ``(ceil(n / 64),)`` scales. ``r`` is not changed."""
    n = r.numel()
    padded = torch.zeros(1, -(-max(n, 1) // INT8_GROUP) * INT8_GROUP, dtype=torch.float32, device=r.device)
    padded[0, :n].copy_(r.reshape(-1))
    codes, scales = encode_(padded, INT8_GROUP, seed)
    return codes.view(-1)[:n].clone(), scales.view(-1)


def decode_flat(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`encode_flat`: fp32 ``(n,)`` for ``n`` codes."""
    n = codes.numel()
    padded = torch.zeros(1, scales.numel() * INT8_GROUP, dtype=torch.int8, device=codes.device)
    padded[0, :n].copy_(codes)
    return decode(padded, scales.view(1, -1)).view(-1)[:n]
