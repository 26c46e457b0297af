"""Compressor: top-k threshold estimation, INT4 group quantization and index coding.

Pure functions on tensors; they know nothing of processes or DeepSpeed (GRACE's
Compressor role, Xu et al., ICDCS 2021). This PyTorch code is the reference path:
fused kernels must reproduce it, and tests use it as the oracle.
"""

import math
from typing import Optional, Tuple

import torch

# DGC's threshold correction (Lin et al., ICLR 2018, arXiv 1712.01887, section 3 / appendix):
# sample |x|, take the top-k threshold of the sample, then correct towards the target count.
SAMPLE_FRACTION = 0.01
MIN_SAMPLE = 1024
UPPER_SLACK = 1.3  # kept > 1.3 k: exact top-k among the kept
LOWER_SLACK = 0.8  # kept < 0.8 k: lower the threshold
LOWER_FACTOR = 0.8
MAX_LOWER_ROUNDS = 10

INT4_QMAX = 7  # symmetric: codes -7..7, stored with an offset of 8 in one nibble


def target_count(numel: int, density: float) -> int:
    """Number of elements top-k selection aims to keep: ``ceil(density * numel)``, at least 1.

    Args:
        numel: elements in the tensor (>= 1).
        density: fraction in (0, 1].
    """
    return min(numel, max(1, math.ceil(density * numel)))


def sample_indices(numel: int, k: int, generator: Optional[torch.Generator] = None, device=None) -> Optional[torch.Tensor]:
    """Random positions on which DGC estimates the top-k threshold (Lin et al. 2018, appendix).

    Args:
        numel: elements m to select from.
        k: target count (:func:`target_count`).
        generator: random generator on ``device``; None uses torch's default.
        device: where the indices live.

    Returns:
        int64 tensor of ``max(1024, m // 100)`` positions in ``[0, m)`` drawn with replacement, or
        None when every element is its own sample (``m <= 1024``) or no selection is needed (``k >= m``).
    """
    if k >= numel or numel <= MIN_SAMPLE:
        return None
    n_sample = max(MIN_SAMPLE, int(numel * SAMPLE_FRACTION))
    return torch.randint(0, numel, (n_sample, ), device=device, generator=generator)


def topk_threshold(mag: torch.Tensor, k: int, sample: Optional[torch.Tensor]) -> torch.Tensor:
    """DGC's top-k threshold: estimated on a sample, then corrected towards k.

    The threshold is the ``ceil(s * k / m)``-th largest of the ``s`` sampled magnitudes. If it keeps
    fewer than 0.8 k elements it is multiplied by 0.8 (fp32), at most 10 times; if it then keeps more
    than 1.3 k, it becomes the k-th largest of the kept magnitudes (an exact top-k up to ties).
    Lin et al., ICLR 2018, "Deep Gradient Compression", section 3 and the sampling of its appendix.
    The fused ops compute the same value (``csrc/dgc/dgc_cpu.cpp``).

    Args:
        mag: 1-D fp32 tensor of m >= 1 finite magnitudes.
        k: target count, ``1 <= k < m``.
        sample: int64 positions into ``mag`` (:func:`sample_indices`), or None for all of ``mag``.

    Returns:
        0-d fp32 tensor: keep the elements with ``mag >= threshold``.
    """
    m = mag.numel()
    s = mag if sample is None else mag[sample]
    k_sample = max(1, math.ceil(s.numel() * k / m))
    threshold = torch.topk(s, k_sample, sorted=False).values.min()
    count = int((mag >= threshold).sum())
    rounds = 0
    while count < LOWER_SLACK * k and rounds < MAX_LOWER_ROUNDS:
        threshold = threshold * LOWER_FACTOR
        count = int((mag >= threshold).sum())
        rounds += 1
    return _cap_upper(mag, k, threshold, count)


def _cap_upper(mag: torch.Tensor, k: int, threshold: torch.Tensor, count: int) -> torch.Tensor:
    """DGC's upper correction: more than 1.3 k kept (``count``) becomes the k-th largest of the kept."""
    if count > UPPER_SLACK * k:
        threshold = torch.topk(mag[mag >= threshold], k, sorted=False).values.min()
    return threshold


def reused_threshold(mag: torch.Tensor, k: int, threshold: float) -> torch.Tensor:
    """A threshold estimated at an earlier step, reused (Ok-Topk's threshold reuse: Li and Hoefler, PPoPP 2022,
    "Near-Optimal Sparse Allreduce for Distributed Deep Learning", section 3.1.3).

    The count it keeps may differ from k; no lowering rounds run (error feedback carries what stays below it to
    the next step), but if it keeps more than 1.3 k it becomes the k-th largest of the kept, as in
    :func:`topk_threshold`, so a payload never grows past that bound. The fused CPU op computes the same.

    Args:
        mag: 1-D fp32 tensor of m >= 1 finite magnitudes.
        k: target count, ``1 <= k < m``.
        threshold: the reused threshold, in the units of ``mag`` (>= 0); rounded to fp32.

    Returns:
        0-d fp32 tensor: keep the elements with ``mag >= threshold``.
    """
    t = torch.tensor(threshold, dtype=torch.float32, device=mag.device)
    return _cap_upper(mag, k, t, int((mag >= t).sum()))


def select_topk(x: torch.Tensor, density: float, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Select about ``density * numel`` elements of largest magnitude, as DGC does.

    :func:`sample_indices` then :func:`topk_threshold` on ``|x|``.

    Args:
        x: 1-D floating tensor of n >= 1 elements, finite.
        density: target fraction kept, in (0, 1]; 1 keeps everything.
        generator: random generator for the sample (on ``x.device``); None uses torch's default.

    Returns:
        Bool mask, shape ``(n,)``, True where the element is kept. Its count is at least k (more only
        on ties) when the exact step ran, and otherwise within [0.8 k, 1.3 k] unless 10 lowering
        rounds did not reach 0.8 k (e.g. most elements are exactly zero).
    """
    n = x.numel()
    k = target_count(n, density)
    if k >= n:
        return torch.ones(n, dtype=torch.bool, device=x.device)
    mag = x.abs()
    return mag >= topk_threshold(mag, k, sample_indices(n, k, generator, x.device))


def int4_packed_bytes(numel: int) -> int:
    """Bytes of ``numel`` INT4 codes packed two per byte: ``ceil(numel / 2)``."""
    return (numel + 1) // 2


def int4_group_ids(segment_counts: torch.Tensor, group_size: int) -> Tuple[torch.Tensor, int]:
    """Scale group of each value when groups restart at every segment (tensor) boundary.

    Args:
        segment_counts: int64 tensor, shape ``(S,)``, values per segment.
        group_size: values per group.

    Returns:
        ``(group_ids, n_groups)``: int64 tensor of shape ``(sum(segment_counts),)`` and
        ``sum(ceil(count / group_size))``.
    """
    counts = segment_counts.long()
    if counts.numel() == 1:  # one segment (weights, dense buckets of one tensor): consecutive runs, no shifts
        m = int(counts.sum())
        return torch.arange(m, device=counts.device).div_(group_size, rounding_mode="floor"), -(-m // group_size)
    groups = (counts + group_size - 1) // group_size
    n_groups = int(groups.sum())
    m = int(counts.sum())
    # value i of segment s sits at i + shift_s in a layout where each segment is padded to whole groups
    shift = (torch.cumsum(groups, 0) - groups) * group_size - (torch.cumsum(counts, 0) - counts)
    padded_pos = torch.arange(m, device=counts.device) + torch.repeat_interleave(shift, counts, output_size=m)
    return padded_pos.div_(group_size, rounding_mode="floor"), n_groups


def int4_group_scales(values: torch.Tensor, gid: torch.Tensor, n_groups: int) -> torch.Tensor:
    """Group-wise absmax INT4 scales: ``max |v| / 7`` over the values of each group (0 for an empty group).

    Args:
        values: float tensor of m values; gid: int64 group of each value (:func:`int4_group_ids`).
        n_groups: number of groups.

    Returns:
        fp32 tensor of shape ``(n_groups,)``.
    """
    scales = torch.zeros(n_groups, dtype=torch.float32, device=values.device)
    scales.scatter_reduce_(0, gid, values.float().abs(), reduce="amax", include_self=True)
    return scales.div_(INT4_QMAX)


def quantize_int4(values: torch.Tensor,
                  group_size: int,
                  segment_counts: Optional[torch.Tensor] = None,
                  return_dequantized: bool = False):
    """Symmetric group-wise INT4 quantization with absmax scales.

    Consecutive runs of ``group_size`` values of one segment share one scale
    ``s = absmax / 7`` (a group never spans two segments, so a small tensor never shares a
    scale with a large neighbour); a value is stored as ``round(v / s)`` in [-7, 7], offset by
    8 into a nibble, two per byte (element 2i in the low nibble) over the whole stream. The
    rounding error is at most ``s / 2`` per value. This is the number format of ZeRO++ qgZ
    (Wang et al., arXiv 2306.10209, section 4.2), without its swizzle.

    Args:
        values: 1-D float tensor of m >= 0 finite values (any float dtype; math in fp32).
        group_size: values per scale group.
        segment_counts: int64 ``(S,)`` values per segment, summing to m; None: one segment.
        return_dequantized: also return what :func:`dequantize_int4` will decode.

    Returns:
        ``(packed, scales)``: packed uint8 codes of shape ``(ceil(m/2),)`` and fp32 scales of
        shape ``(n_groups,)`` (see :func:`int4_group_ids`); with ``return_dequantized``,
        ``(packed, scales, dequantized)`` where ``dequantized`` is fp32 of shape ``(m,)``.
    """
    m = values.numel()
    if segment_counts is None:
        segment_counts = torch.tensor([m], device=values.device)
    v = values.float()
    gid, n_groups = int4_group_ids(segment_counts, group_size)
    scales = int4_group_scales(v, gid, n_groups)
    q = torch.round(_divide_by_scale(v, scales[gid])).clamp_(-INT4_QMAX, INT4_QMAX)
    packed = pack_nibbles((q.to(torch.int16) + 8).to(torch.uint8))
    if return_dequantized:
        return packed, scales, q.mul_(scales[gid])
    return packed, scales


def dequantize_int4(packed: torch.Tensor,
                    scales: torch.Tensor,
                    numel: int,
                    group_size: int,
                    segment_counts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Inverse of :func:`quantize_int4`.

    Args:
        packed: uint8 tensor of ``ceil(numel/2)`` bytes.
        scales: fp32 scales, one per group.
        numel: number of values m.
        group_size: as used to quantize.
        segment_counts: as used to quantize (None: one segment).

    Returns:
        fp32 tensor of shape ``(numel,)``.

    Raises:
        ValueError: the number of scales does not match the segments.
    """
    if segment_counts is None:
        segment_counts = torch.tensor([numel], device=packed.device)
    gid, n_groups = int4_group_ids(segment_counts, group_size)
    if n_groups != scales.numel() or gid.numel() != numel:
        raise ValueError(f"dequantize_int4: {scales.numel()} scales for {n_groups} groups of {numel} values")
    codes = unpack_nibbles(packed, numel).to(torch.float32) - 8.0
    return codes * scales[gid]


def _divide_by_scale(v: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``v / scale``, and 0 where the scale is 0 (an all-zero group).

    A true division, not a multiply by ``1 / scale``: for a subnormal scale (a group whose absmax
    is below 1e-38, as residuals of rarely-updated rows become) the reciprocal overflows to inf and
    ``0 * inf`` is NaN, while ``|v| / scale`` stays within the code range.
    """
    return torch.where(scale > 0, v / torch.where(scale > 0, scale, torch.ones_like(scale)), torch.zeros_like(v))


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Pack uint8 codes in [0, 15] two per byte: element 2i low nibble, 2i+1 high nibble."""
    if codes.numel() % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    pairs = codes.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def unpack_nibbles(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: uint8 codes of shape ``(numel,)``."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=1).view(-1)[:numel]


# ---- value formats of the kept values ----------------------------------------------------
# Every format has group-wise scales (groups restart at each tensor, as for INT4) and packs its
# codes little-endian into bytes: element i at bits (i % per_byte) * bits of byte i // per_byte.
VALUE_BITS = {"int4": 4, "int2": 2, "int1": 1, "fp8_e4m3": 8, "fp8_e5m2": 8}
FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FP8_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
INT2_LEVEL = 1.5  # INT2 levels are +-0.5 s and +-1.5 s with s = absmax / 1.5


def packed_bytes(numel: int, fmt: str) -> int:
    """Bytes of ``numel`` codes of value format ``fmt``: ``ceil(numel * bits / 8)``."""
    return -(-numel * VALUE_BITS[fmt] // 8)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes below ``2**bits`` (bits in 1, 2, 4, 8), little-endian within each byte.

    For 4 bits this is :func:`pack_nibbles`. Returns uint8 of shape ``(ceil(n * bits / 8),)``.
    """
    if bits == 8:
        return codes.to(torch.uint8)
    per = 8 // bits
    pad = -codes.numel() % per
    c = torch.cat([codes, codes.new_zeros(pad)]) if pad else codes
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
    return (c.view(-1, per).to(torch.uint8) << shifts).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: uint8 codes of shape ``(numel,)``."""
    if bits == 8:
        return packed[:numel]
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    return ((packed[:, None] >> shifts) & ((1 << bits) - 1)).view(-1)[:numel]


def group_scales(values: torch.Tensor, gid: torch.Tensor, n_groups: int, fmt: str) -> torch.Tensor:
    """Group-wise scales of ``fmt``: absmax / qmax (INT4: 7, INT2: 1.5, FP8: the format's largest
    finite value), and for INT1 the mean magnitude (the scale that minimises the L2 error of
    ``s * sign(v)``; 1-bit Adam, Tang et al., ICML 2021, section 3). fp32, shape ``(n_groups,)``."""
    if fmt == "int4":
        return int4_group_scales(values, gid, n_groups)
    mag = values.float().abs()
    if fmt == "int1":
        sums = torch.zeros(n_groups, dtype=torch.float32, device=values.device).index_add_(0, gid, mag)
        counts = torch.zeros(n_groups, dtype=torch.float32, device=values.device).index_add_(0, gid, torch.ones_like(mag))
        return sums / counts.clamp_(min=1)
    scales = torch.zeros(n_groups, dtype=torch.float32, device=values.device)
    scales.scatter_reduce_(0, gid, mag, reduce="amax", include_self=True)
    return scales.div_(INT2_LEVEL if fmt == "int2" else FP8_MAX[fmt])


def quantize_values(values: torch.Tensor,
                    fmt: str,
                    group_size: int,
                    segment_counts: Optional[torch.Tensor] = None,
                    generator: Optional[torch.Generator] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize kept values to ``fmt`` with group-wise scales; returns what the receiver decodes too.

    Formats (s = the group's scale, :func:`group_scales`):

    - ``"int4"``: symmetric codes ``round(v / s)`` in [-7, 7] (:func:`quantize_int4`); error <= s/2.
    - ``"int2"``: four levels ``(q + 0.5) s``, q in [-2, 1]; error <= s/2 = absmax/3.
    - ``"int1"``: ``s * sign(v)`` with s the group's mean magnitude (1-bit Adam's compressor,
      Tang et al., ICML 2021, section 3; signSGD with error feedback, Karimireddy et al., ICML 2019).
    - ``"fp8_e4m3"``, ``"fp8_e5m2"``: ``v / s`` cast to float8 (OCP FP8, Micikevicius et al.,
      arXiv 2209.05433): relative error <= 2^-4 (e4m3) or 2^-3 (e5m2) for normal values; values
      below the smallest subnormal times s flush to zero (e4m3 spans 2^-9..448, e5m2 2^-16..57344,
      so a group whose values span more than about 2e5 (e4m3) or 4e9 (e5m2) loses its smallest).
      The error is carried by error feedback like any other.

    Stochastic rounding (``generator`` given; INT4 and INT2 only): the code is
    ``floor(v / s + u)`` with u uniform in [0, 1) drawn from ``generator``, so ``E[decoded] = v``
    (Gupta et al., ICML 2015); the error is below one step s.

    Args:
        values: 1-D float tensor of m >= 0 finite values (math in fp32).
        fmt: a key of ``VALUE_BITS``.
        group_size: values per scale group.
        segment_counts: int64 ``(S,)`` values per segment (groups restart at each); None: one segment.
        generator: random generator on the values' device for stochastic rounding; None rounds to nearest.

    Returns:
        ``(packed, scales, decoded)``: uint8 codes ``(packed_bytes(m, fmt),)``, fp32 scales
        ``(n_groups,)`` and the fp32 decoded values ``(m,)``.

    Raises:
        ValueError: unknown format, or stochastic rounding asked for INT1/FP8.
    """
    if fmt not in VALUE_BITS:
        raise ValueError(f"unknown value format {fmt!r}; allowed: {', '.join(VALUE_BITS)}")
    if generator is not None and fmt not in ("int4", "int2"):
        raise ValueError(f"stochastic rounding is defined for int4 and int2, not {fmt!r}")
    m = values.numel()
    if segment_counts is None:
        segment_counts = torch.tensor([m], device=values.device)
    if fmt == "int4" and generator is None:
        return quantize_int4(values, group_size, segment_counts, return_dequantized=True)
    v = values.float()
    gid, n_groups = int4_group_ids(segment_counts, group_size)
    scales = group_scales(v, gid, n_groups, fmt)
    s = scales[gid]
    if fmt == "int1":
        positive = v >= 0
        return pack_bits(positive.to(torch.uint8), 1), scales, torch.where(positive, s, -s)
    if fmt in FP8_DTYPES:
        codes = _divide_by_scale(v, s).to(FP8_DTYPES[fmt])
        return codes.view(torch.uint8), scales, codes.float() * s
    # code offsets: INT4 nibbles hold q + 8 (as quantize_int4), INT2 codes q + 2
    lo, hi, offset, code_offset = (-INT4_QMAX, INT4_QMAX, 0.0, 8) if fmt == "int4" else (-2, 1, 0.5, 2)
    t = _divide_by_scale(v, s) - offset
    u = 0.5 if generator is None else torch.rand(m, generator=generator, device=v.device)
    q = torch.floor(t + u).clamp_(lo, hi)
    codes = (q + code_offset).to(torch.uint8)
    return pack_bits(codes, VALUE_BITS[fmt]), scales, (q + offset) * s


def dequantize_values(packed: torch.Tensor, scales: torch.Tensor, numel: int, fmt: str, group_size: int,
                      segment_counts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Inverse of :func:`quantize_values` (either rounding): fp32 tensor of shape ``(numel,)``.

    Raises:
        ValueError: unknown format, or the number of scales or bytes does not match.
    """
    if fmt == "int4":
        return dequantize_int4(packed, scales, numel, group_size, segment_counts)
    if fmt not in VALUE_BITS:
        raise ValueError(f"unknown value format {fmt!r}; allowed: {', '.join(VALUE_BITS)}")
    if segment_counts is None:
        segment_counts = torch.tensor([numel], device=packed.device)
    gid, n_groups = int4_group_ids(segment_counts, group_size)
    if n_groups != scales.numel() or gid.numel() != numel or packed.numel() != packed_bytes(numel, fmt):
        raise ValueError(f"dequantize_values: {scales.numel()} scales and {packed.numel()} bytes for {n_groups} "
                         f"groups of {numel} {fmt} values")
    s = scales[gid]
    if fmt in FP8_DTYPES:
        return packed.view(FP8_DTYPES[fmt]).float() * s
    codes = unpack_bits(packed, VALUE_BITS[fmt], numel).float()
    if fmt == "int1":
        return torch.where(codes > 0, s, -s)
    return (codes - 2 + 0.5) * s  # int2


# ---- index coding -------------------------------------------------------------------------
# Sorted positions are sent as gaps (position minus previous position minus 1; the first gap
# is the first position) in LEB128 varints: 7 bits per byte, high bit set on all but the last
# byte of a value. At density d the mean gap is about 1/d, so a kept element costs 8 bits of
# index for d >= 1/128 and 16 bits down to d = 1/16384, instead of 32.

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


# ---- weight formats (quantized parameter all-gather) ----------------------------------------
# Group-wise absmax scaling as in ZeRO++ qwZ (Wang et al., arXiv 2306.10209, section 4.1):
# s = absmax / qmax per group of group_size consecutive elements, code = v / s.
WEIGHT_QMAX = {"int8": 127.0, "fp8_e4m3": 448.0, "int4": float(INT4_QMAX)}


def weight_code_bytes(numel: int, fmt: str) -> int:
    """Bytes of the codes of ``numel`` weights in ``fmt`` (1 per element, INT4 half of that, rounded up)."""
    return int4_packed_bytes(numel) if fmt == "int4" else numel


def weight_num_groups(numel: int, group_size: int) -> int:
    """Scale groups of ``numel`` weights: ``ceil(numel / group_size)``."""
    return -(-numel // group_size)


def quantize_weights(x: torch.Tensor, fmt: str, group_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize a flat weight shard with group-wise absmax scales.

    Formats: ``"int8"`` (symmetric, round to nearest, error <= s/2), ``"fp8_e4m3"`` (the value
    divided by s cast to float8 e4m3fn: relative error <= 2^-4, absolute <= 16 s in the top
    binade), ``"int4"`` (as :func:`quantize_int4`).

    Args:
        x: 1-D float tensor of n >= 0 finite weights (fp32, bf16 or fp16; math in fp32).
        fmt: one of ``WEIGHT_QMAX``.
        group_size: elements per scale.

    Returns:
        ``(codes, scales)``: uint8 codes of shape ``(weight_code_bytes(n, fmt),)`` and fp32 scales
        of shape ``(weight_num_groups(n, group_size),)``.

    Raises:
        ValueError: unknown format.
    """
    if fmt not in WEIGHT_QMAX:
        raise ValueError(f"unknown weight format {fmt!r}; allowed: {', '.join(WEIGHT_QMAX)}")
    if fmt == "int4":
        return quantize_int4(x, group_size)
    n = x.numel()
    groups = weight_num_groups(n, group_size)
    padded = torch.nn.functional.pad(x.float(), (0, groups * group_size - n)).view(groups, group_size)
    scales = padded.abs().amax(dim=1) / WEIGHT_QMAX[fmt]
    scaled = _divide_by_scale(padded, scales[:, None])
    if fmt == "int8":
        codes = torch.round(scaled).clamp_(-127, 127).to(torch.int8)
    else:
        codes = scaled.to(torch.float8_e4m3fn)
    return codes.view(-1)[:n].view(torch.uint8), scales


def dequantize_weights(codes: torch.Tensor, scales: torch.Tensor, numel: int, fmt: str, group_size: int) -> torch.Tensor:
    """Inverse of :func:`quantize_weights`: fp32 tensor of shape ``(numel,)``."""
    if fmt == "int4":
        return dequantize_int4(codes, scales, numel, group_size)
    values = codes.view(torch.int8 if fmt == "int8" else torch.float8_e4m3fn).float()
    groups = scales.numel()
    padded = torch.nn.functional.pad(values, (0, groups * group_size - numel)).view(groups, group_size)
    return (padded * scales[:, None]).view(-1)[:numel]
