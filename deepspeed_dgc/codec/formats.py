"""Value formats: group-wise quantization of the values sent (gradients) and gathered (weights).

Pure functions on tensors. Every format has group-wise fp32 scales; groups never span two segments
(tensors), so a small tensor never shares a scale with a large neighbour. Codes are packed
little-endian into bytes: element i at bits ``(i % per_byte) * bits`` of byte ``i // per_byte``.

- gradients (:func:`quantize_values`): INT4 (ZeRO++ qgZ's format, Wang et al., arXiv 2306.10209,
  section 4.2), INT2, INT1 (1-bit Adam's compressor, Tang et al., ICML 2021, section 3), FP8 e4m3/e5m2
  (OCP FP8, Micikevicius et al., arXiv 2209.05433), with optional stochastic rounding;
- weights (:func:`quantize_weights`): INT8, FP8 e4m3, INT4 with absmax scales (ZeRO++ qwZ, section 4.1).
"""

from typing import Dict, Optional, Sequence, Tuple

import torch

from .layout import device_constant, host_to_device

INT4_QMAX = 7  # symmetric: codes -7..7, stored with an offset of 8 in one nibble


def int4_packed_bytes(numel: int) -> int:
    """Bytes of ``numel`` INT4 codes packed two per byte: ``ceil(numel / 2)``."""
    return (numel + 1) // 2


class Segments:
    """Segment lengths known on the host, with what :func:`int4_group_ids` needs of them on the device (copied once,
    from pinned memory without waiting, and cached: :func:`host_segments`), so group ids need no read-back."""

    def __init__(self, lengths: Tuple[int, ...], device):
        self.lengths = lengths
        self.numel = sum(lengths)
        counts = torch.tensor(lengths, dtype=torch.long)
        self._device = torch.device(device)
        self.counts = host_to_device(counts, self._device)
        self._shifts: Dict[int, Tuple[torch.Tensor, int]] = {}

    def shift(self, group_size: int) -> Tuple[torch.Tensor, int]:
        """Per segment, where its values move in a layout padded to whole groups; and the number of groups."""
        if group_size not in self._shifts:
            groups = [-(-n // group_size) for n in self.lengths]
            shift, g0, v0 = [], 0, 0
            for n, g in zip(self.lengths, groups):
                shift.append(g0 * group_size - v0)
                g0, v0 = g0 + g, v0 + n
            self._shifts[group_size] = (host_to_device(torch.tensor(shift, dtype=torch.long), self._device), g0)
        return self._shifts[group_size]


_SEGMENTS: Dict[Tuple[Tuple[int, ...], str], Segments] = {}


def div_by_constant(t: torch.Tensor, q: float, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``t / q`` for a format's constant ``q`` (its largest code, say 7 for INT4) as an IEEE division on every device,
    into ``out`` where given (``t`` itself: in place). On a GPU torch divides by a Python number as a product with its
    reciprocal, ``t * (1 / q)``, which rounds about half of the quotients differently; the CPU and the fused ops
    (CPU and CUDA) divide. A 0-d tensor on the device (cached) takes torch's division there too."""
    if t.device.type != "cpu":
        q = device_constant((q, ), t.device, torch.float32).view(())
    return torch.div(t, q) if out is None else torch.div(t, q, out=out)


def host_segments(lengths: Sequence[int], device) -> Segments:
    """The cached :class:`Segments` of these lengths on ``device``."""
    key = (tuple(int(n) for n in lengths), str(device))
    if key not in _SEGMENTS:
        _SEGMENTS[key] = Segments(key[0], device)
    return _SEGMENTS[key]


def int4_group_ids(segment_counts, group_size: int) -> Tuple[torch.Tensor, int]:
    """Scale group of each value when groups restart at every segment (tensor) boundary.

    Args:
        segment_counts: int64 tensor, shape ``(S,)``, values per segment; or, known on the host (nothing is read
            back from the device then), ``(m, device)`` for one segment of m values or a :class:`Segments`.
        group_size: values per group.

    Returns:
        ``(group_ids, n_groups)``: int64 tensor of shape ``(sum(segment_counts),)`` and
        ``sum(ceil(count / group_size))``.
    """
    if isinstance(segment_counts, tuple):
        m, device = segment_counts
        return torch.arange(m, device=device).div_(group_size, rounding_mode="floor"), -(-m // group_size)
    if isinstance(segment_counts, Segments):
        shift, n_groups = segment_counts.shift(group_size)
        m = segment_counts.numel
        padded_pos = torch.arange(m, device=shift.device) + torch.repeat_interleave(shift, segment_counts.counts,
                                                                                  output_size=m)
        return padded_pos.div_(group_size, rounding_mode="floor"), n_groups
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
    return div_by_constant(scales, INT4_QMAX, out=scales)


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
        segment_counts = (m, values.device)
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
        segment_counts = (numel, packed.device)
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


INT1_DOWN, INT1_UP = 2.0**-64, 2.0**64  # INT1's mean of huge magnitudes is taken at 2^-64 their size (group_scales)


def int1_mean(sums: torch.Tensor, small_sums: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """INT1's group scales: ``sums / counts`` (fp32 sums of the groups' magnitudes, counts of their non-zeros,
    >= 1), and where a sum passed the largest float (finite magnitudes from about 2.7e36 in groups of 128)
    ``small_sums / counts * 2^64``, ``small_sums`` the sums of the magnitudes times ``INT1_DOWN``: finite, as the
    mean is (``value_group_scale`` in csrc/dgc/cpu_coders.h takes it the same way). Shapes broadcast; fp32."""
    return torch.where(torch.isinf(sums), small_sums / counts * INT1_UP, sums / counts)


def group_scales(values: torch.Tensor, gid: torch.Tensor, n_groups: int, fmt: str) -> torch.Tensor:
    """Group-wise scales of ``fmt``: absmax / qmax (INT4: 7, INT2: 1.5, FP8: the format's largest
    finite value), and for INT1 the mean magnitude (the scale that minimises the L2 error of
    ``s * sign(v)``; 1-bit Adam, Tang et al., ICML 2021, section 3) over the group's non-zero values,
    summed in fp32 in value order (where that sum overflows, of the magnitudes times 2^-64, multiplied back: the
    scale stays finite for any finite values). fp32, shape ``(n_groups,)``."""
    if fmt == "int4":
        return int4_group_scales(values, gid, n_groups)
    mag = values.float().abs()
    if fmt == "int1":  # exact zeros are sent as zeros (ZERO_MASKED), so they take no part in the mean
        sums = torch.zeros(n_groups, dtype=torch.float32, device=values.device).index_add_(0, gid, mag)
        counts = torch.zeros(n_groups, dtype=torch.float32, device=values.device).index_add_(0, gid, (mag > 0).float())
        small = torch.zeros(n_groups, dtype=torch.float32, device=values.device).index_add_(0, gid, mag * INT1_DOWN)
        return int1_mean(sums, small, counts.clamp_(min=1))
    scales = torch.zeros(n_groups, dtype=torch.float32, device=values.device)
    scales.scatter_reduce_(0, gid, mag, reduce="amax", include_self=True)
    return div_by_constant(scales, INT2_LEVEL if fmt == "int2" else FP8_MAX[fmt], out=scales)


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

    Exact zeros decode to exactly 0 in every format, so a coordinate whose gradient is always zero (an
    unused embedding row) never moves. INT4 and FP8 code 0 as 0; INT1 and INT2 have no zero code, so a
    group holding both zeros and non-zeros (a *mixed* group) is flagged by a negative scale and a bitmap
    of its non-zero elements follows the scales (:data:`ZERO_MASKED`, :func:`split_scales`). The masks
    cost one bit per value of the mixed groups only; 1-bit Adam needed user-given momentum masks for the
    same reason (DeepSpeed PR #817).

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
        ``(n_groups,)`` (INT1/INT2: followed by the zero masks as fp32 words, see above) and the fp32
        decoded values ``(m,)``.

    Raises:
        ValueError: unknown format, or stochastic rounding asked for INT1/FP8.
    """
    if fmt not in VALUE_BITS:
        raise ValueError(f"unknown value format {fmt!r}; allowed: {', '.join(VALUE_BITS)}")
    if generator is not None and fmt not in ("int4", "int2"):
        raise ValueError(f"stochastic rounding is defined for int4 and int2, not {fmt!r}")
    m = values.numel()
    if segment_counts is None:
        segment_counts = (m, values.device)
    if fmt == "int4" and generator is None:
        return quantize_int4(values, group_size, segment_counts, return_dequantized=True)
    v = values.float()
    gid, n_groups = int4_group_ids(segment_counts, group_size)
    scales = group_scales(v, gid, n_groups, fmt)
    s = scales[gid]
    if fmt == "int1":
        positive = v >= 0
        decoded = torch.where(positive, s, -s).masked_fill_(v == 0, 0.0)
        return pack_bits(positive.to(torch.uint8), 1), _with_zero_masks(v, gid, scales), decoded
    if fmt in FP8_DTYPES:
        codes = _divide_by_scale(v, s).to(FP8_DTYPES[fmt])
        return codes.view(torch.uint8), scales, codes.float() * s
    # code offsets: INT4 nibbles hold q + 8 (as quantize_int4), INT2 codes q + 2
    lo, hi, offset, code_offset = (-INT4_QMAX, INT4_QMAX, 0.0, 8) if fmt == "int4" else (-2, 1, 0.5, 2)
    t = _divide_by_scale(v, s) - offset
    u = 0.5 if generator is None else torch.rand(m, generator=generator, device=v.device)
    q = torch.floor(t + u).clamp_(lo, hi)
    codes = (q + code_offset).to(torch.uint8)
    if fmt == "int2":
        return pack_bits(codes, 2), _with_zero_masks(v, gid, scales), ((q + offset) * s).masked_fill_(v == 0, 0.0)
    return pack_bits(codes, VALUE_BITS[fmt]), scales, (q + offset) * s


ZERO_MASKED = ("int1", "int2")  # formats without a code for 0: their mixed groups carry a non-zero bitmap
_WORD = 4  # the masks travel as fp32 words after the scales


def _with_zero_masks(v: torch.Tensor, gid: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Scales of a ZERO_MASKED format with mixed groups flagged (negated) and their non-zero bitmaps appended.

    A group is mixed when its scale is positive and it holds an exact zero. The bitmap has one bit per
    value of the mixed groups, in value order (1: non-zero), packed as :func:`pack_bits`, zero-padded to
    whole fp32 words. Returns fp32 ``(n_groups + words,)``; just the scales when no group is mixed.
    """
    zero = v == 0
    has_zero = torch.zeros_like(scales).index_add_(0, gid, zero.float()) > 0
    mixed = has_zero & (scales > 0)
    in_mixed = mixed[gid]
    bits = pack_bits((~zero[in_mixed]).to(torch.uint8), 1)
    if bits.numel() == 0:
        return scales
    bits = torch.cat([bits, bits.new_zeros(-bits.numel() % _WORD)])
    return torch.cat([torch.where(mixed, -scales, scales), bits.view(torch.float32)])


def split_scales(side: torch.Tensor, gid: torch.Tensor, n_groups: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`_with_zero_masks`: the scales (positive) and a bool non-zero mask of the values.

    Args:
        side: fp32 scale section as received, ``(n_groups + words,)``.
        gid: int64 scale group of each value, ``(m,)``; n_groups: groups.

    Returns:
        ``(scales, nonzero)``: fp32 ``(n_groups,)`` and bool ``(m,)`` (False: the value is exactly 0).

    Raises:
        ValueError: the words after the scales do not hold the bitmap of the flagged groups.
    """
    scales = side[:n_groups]
    in_mixed = (scales < 0)[gid]
    n_bits = int(in_mixed.sum())
    words = -(-n_bits // (8 * _WORD))
    if side.numel() != n_groups + words:
        raise ValueError(f"{side.numel()} scale words for {n_groups} groups and a zero mask of {n_bits} values "
                         f"({words} words)")
    nonzero = torch.ones_like(in_mixed)
    if n_bits:
        nonzero[in_mixed] = unpack_bits(side[n_groups:].contiguous().view(torch.uint8), 1, n_bits).bool()
    return scales.abs(), nonzero


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
        segment_counts = (numel, packed.device)
    gid, n_groups = int4_group_ids(segment_counts, group_size)
    masked = fmt in ZERO_MASKED
    if ((scales.numel() < n_groups if masked else n_groups != scales.numel()) or gid.numel() != numel
            or packed.numel() != packed_bytes(numel, fmt)):
        raise ValueError(f"dequantize_values: {scales.numel()} scales and {packed.numel()} bytes for {n_groups} "
                         f"groups of {numel} {fmt} values")
    if not masked:  # fp8
        return packed.view(FP8_DTYPES[fmt]).float() * scales[gid]
    scales, nonzero = split_scales(scales, gid, n_groups)
    s = scales[gid]
    codes = unpack_bits(packed, VALUE_BITS[fmt], numel).float()
    decoded = torch.where(codes > 0, s, -s) if fmt == "int1" else (codes - 2 + 0.5) * s
    return decoded.masked_fill_(~nonzero, 0.0)


# ---- weight formats (quantized parameter all-gather) ----------------------------------------
# Group-wise absmax scaling as in ZeRO++ qwZ (Wang et al., arXiv 2306.10209, section 4.1):
# s = absmax / qmax per group of group_size consecutive elements, code = v / s.
WEIGHT_QMAX = {"int8": 127.0, "fp8_e4m3": 448.0, "int4": float(INT4_QMAX)}


def weight_code_bytes(numel: int, fmt: str) -> int:
    """Bytes of the codes of ``numel`` weights in ``fmt`` (1 per element, INT4 half of that, rounded up)."""
    return int4_packed_bytes(numel) if fmt == "int4" else numel


def weight_num_groups(numel: int, group_size: int, segments: Optional[Sequence[int]] = None) -> int:
    """Scale groups of ``numel`` weights: ``ceil(numel / group_size)``, or with ``segments`` (groups restart at each)
    the sum of ``ceil(segment / group_size)``."""
    if segments is None:
        return -(-numel // group_size)
    return sum(-(-s // group_size) for s in segments)


def quantize_weights(x: torch.Tensor, fmt: str, group_size: int,
                     segments: Optional[Sequence[int]] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize a flat weight shard with group-wise absmax scales.

    Formats: ``"int8"`` (symmetric, round to nearest, error <= s/2), ``"fp8_e4m3"`` (the value
    divided by s cast to float8 e4m3fn: relative error <= 2^-4, absolute <= 16 s in the top
    binade), ``"int4"`` (as :func:`quantize_int4`). Group-wise absmax scaling as ZeRO++ qwZ (Wang et al.,
    arXiv 2306.10209, section 4.1).

    Args:
        x: 1-D float tensor of n >= 0 finite weights (fp32, bf16 or fp16; math in fp32).
        fmt: one of ``WEIGHT_QMAX``.
        group_size: elements per scale.
        segments: lengths of consecutive segments (one per parameter), summing to n; groups restart at each, so
            a small-valued parameter never shares a scale with a large one. None: one segment.

    Returns:
        ``(codes, scales)``: uint8 codes of shape ``(weight_code_bytes(n, fmt),)`` and fp32 scales
        of shape ``(weight_num_groups(n, group_size, segments),)``.

    Raises:
        ValueError: unknown format, or segments that do not add up to n.
    """
    if fmt not in WEIGHT_QMAX:
        raise ValueError(f"unknown weight format {fmt!r}; allowed: {', '.join(WEIGHT_QMAX)}")
    n = x.numel()
    counts = _segment_tensor(n, segments, x.device)
    if fmt == "int4":
        return quantize_int4(x, group_size, counts)
    v = x.float()
    if segments is None or len(segments) == 1:  # one segment: whole groups of a padded view (no index tensors)
        groups = weight_num_groups(n, group_size)
        padded = torch.nn.functional.pad(v, (0, groups * group_size - n)).view(groups, group_size)
        scales = div_by_constant(padded.abs().amax(dim=1), WEIGHT_QMAX[fmt])
        scaled = _divide_by_scale(padded, scales[:, None]).view(-1)[:n]
    else:
        gid, n_groups = int4_group_ids(counts, group_size)
        scales = torch.zeros(n_groups, dtype=torch.float32, device=x.device)
        scales.scatter_reduce_(0, gid, v.abs(), reduce="amax", include_self=True)
        div_by_constant(scales, WEIGHT_QMAX[fmt], out=scales)
        scaled = _divide_by_scale(v, scales[gid])
    if fmt == "int8":
        codes = torch.round(scaled).clamp_(-127, 127).to(torch.int8)
    else:
        codes = scaled.to(torch.float8_e4m3fn)
    return codes.view(torch.uint8), scales


def dequantize_weights(codes: torch.Tensor, scales: torch.Tensor, numel: int, fmt: str, group_size: int,
                       segments: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Inverse of :func:`quantize_weights`: fp32 tensor of shape ``(numel,)``.

    Raises:
        ValueError: the number of scales does not match the segments.
    """
    counts = _segment_tensor(numel, segments, codes.device)
    if fmt == "int4":
        return dequantize_int4(codes, scales, numel, group_size, counts)
    values = codes[:numel].view(torch.int8 if fmt == "int8" else torch.float8_e4m3fn).float()
    if segments is None or len(segments) == 1:
        groups = weight_num_groups(numel, group_size)
        if groups != scales.numel():
            raise ValueError(f"dequantize_weights: {scales.numel()} scales for {groups} groups of {numel} weights")
        padded = torch.nn.functional.pad(values, (0, groups * group_size - numel)).view(groups, group_size)
        return (padded * scales[:, None]).view(-1)[:numel]
    gid, n_groups = int4_group_ids(counts, group_size)
    if n_groups != scales.numel():
        raise ValueError(f"dequantize_weights: {scales.numel()} scales for {n_groups} groups of {numel} weights")
    return values * scales[gid]


def _segment_tensor(n: int, segments: Optional[Sequence[int]], device):
    """Segment counts for :func:`int4_group_ids`: ``(n, device)`` for one segment (no device tensor), else int64."""
    if segments is None or len(segments) == 1:
        if segments is not None and segments[0] != n:
            raise ValueError(f"segments of {sum(segments)} elements for {n} weights")
        return (n, device)
    if sum(segments) != n:
        raise ValueError(f"segments of {sum(segments)} elements for {n} weights")
    return host_segments(segments, device)


# ---- the value formats of whole aligned groups (the fixed layout and the fixed-size codecs) -------------------
# One table, FORMATS: each format says how a group's scale is found, how values become codes (and, in place, what
# error feedback keeps), how codes decode and how many codes fit in a byte. The callers give the groups as a view
# (..., G, g) of fp32 values (an owner matrix's aligned blocks, or slots of kept values), so a bucket is one call
# whatever its tensors; ``tmp`` is fp32 scratch of the same shape (a workspace view: no new memory).


class ValueFormat:
    """A value format on whole groups of ``g`` values (see the table's comment above).

    Attributes:
        name: the config's name; per_byte: codes per byte in the fixed layout (INT1: ternary, five per byte).
    """

    name = ""
    per_byte = 1

    def scales(self, groups: torch.Tensor, gmax: torch.Tensor, gmin: torch.Tensor, tmp: torch.Tensor,
               padding: Optional[torch.Tensor] = None) -> torch.Tensor:
        """fp32 ``(..., G)``: each group's scale, from its values ``(..., G, g)`` and their maxima and minima
        ``(..., G)`` (NaN propagates); ``tmp`` may be overwritten. ``padding``: per group (broadcastable to
        ``(..., G)``), how many of its values are padding, zeros that are not values (INT2 does not count them as
        zeros), or None: none."""
        raise NotImplementedError

    def encode_(self, groups: torch.Tensor, scales: torch.Tensor, codes: torch.Tensor, tmp: torch.Tensor,
                generator: Optional[torch.Generator] = None) -> None:
        """Write the codes of ``groups`` into ``codes`` (uint8, same shape), leave in ``groups`` the error of what the
        receivers decode (``v - decoded`` in fp32: error feedback's residual) and in ``tmp`` the decoded values.
        ``generator``: stochastic rounding (INT4/INT2)."""
        raise NotImplementedError

    def decode(self, codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """fp32 values of ``codes`` ``(..., G, g)`` at ``scales`` ``(..., G)``, written into ``out``."""
        raise NotImplementedError


def _safe(scales: torch.Tensor) -> torch.Tensor:
    """Scales with 0 (an all-zero group) and NaN replaced by 1, broadcastable over a group's values: a true division
    by them is the value itself there (0 in an all-zero group; a bucket with NaN is poisoned whatever it sends)."""
    return torch.where(scales > 0, scales, torch.ones_like(scales))[..., None]


def abs_into(src: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``|src|`` written into ``out`` (its shape), in ``out``'s dtype: fp32 magnitudes of a bf16 owner matrix's values
    (exact), without a temporary of ``src``'s dtype. Returns ``out``."""
    if src.dtype == out.dtype:
        return torch.abs(src, out=out)
    return out.copy_(src).abs_()


def _absmax(gmax: torch.Tensor, gmin: torch.Tensor) -> torch.Tensor:
    """Each group's largest magnitude from its maximum and minimum (+0, never -0, for an all-zero group: the same
    bits whatever the shape of the batch, and the CUDA op's)."""
    return torch.maximum(gmax, gmin.neg()).add_(0.0)


class _Int4(ValueFormat):
    """Symmetric INT4, ``s = absmax / 7``, codes ``floor(v / s + 1/2) + 8`` (ZeRO++ qgZ's format, Wang et al., arXiv
    2306.10209, section 4.2); error <= s/2, or below s with stochastic rounding (``floor(v / s + u)``)."""

    name, per_byte = "int4", 2

    def scales(self, groups, gmax, gmin, tmp, padding=None):
        scales = _absmax(gmax, gmin)
        return div_by_constant(scales, INT4_QMAX, out=scales)

    def encode_(self, groups, scales, codes, tmp, generator=None):
        s = _safe(scales)
        torch.div(groups, s, out=tmp)
        _add_rounding(tmp, generator).floor_().clamp_(-INT4_QMAX, INT4_QMAX).add_(8)
        codes.copy_(tmp)
        groups.sub_(tmp.sub_(8).mul_(scales[..., None]))

    def decode(self, codes, scales, out):
        out.copy_(codes)
        return out.sub_(8).mul_(scales[..., None])


def _add_rounding(t: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
    """``t + 1/2`` (then floor: round to nearest), or ``t + u`` with u uniform in [0, 1) from ``generator``
    (stochastic rounding, unbiased; Gupta et al., ICML 2015), in place."""
    if generator is None:
        return t.add_(0.5)
    return t.add_(torch.rand(t.shape, generator=generator, device=t.device))


class _Int2(ValueFormat):
    """INT2: four levels ``(q + 1/2) s``, ``s = absmax / 1.5``, ``q = floor(v / s - 1/2 + 1/2)`` in [-2, 1]; a group
    that mixes exact zeros and non-zeros takes three levels ``q a`` (``a`` its absmax, ``q = floor(v / a + 1/2)`` in
    [-1, 1], error <= a/2), flagged by a negative scale, so zeros decode to exactly 0."""

    name, per_byte = "int2", 4

    def scales(self, groups, gmax, gmin, tmp, padding=None):
        amax = _absmax(gmax, gmin)
        if padding is None:
            mixed = (groups == 0).any(dim=-1)
        else:
            mixed = groups.shape[-1] - torch.count_nonzero(groups, dim=-1) > padding
        mixed &= amax > 0
        return torch.where(mixed, amax.neg(), div_by_constant(amax, INT2_LEVEL))

    def encode_(self, groups, scales, codes, tmp, generator=None):
        mixed = (scales < 0)[..., None]
        d = _safe(scales.abs())
        torch.div(groups, d, out=tmp).add_(torch.where(mixed, 0.0, -0.5))
        _add_rounding(tmp, generator).floor_().clamp_(min=torch.where(mixed, -1.0, -2.0)).clamp_(max=1.0)
        offset = torch.where(mixed, 1.0, 2.0)
        codes.copy_(tmp.add_(offset))
        groups.sub_(tmp.sub_(offset).add_(torch.where(mixed, 0.0, 0.5)).mul_(scales.abs()[..., None]))

    def decode(self, codes, scales, out):
        out.copy_(codes)
        mixed = (scales < 0)[..., None]
        return out.sub_(torch.where(mixed, 1.0, 1.5)).mul_(scales.abs()[..., None])


class _Int1(ValueFormat):
    """INT1 as sign or zero, ``s * sign(v)`` with s the mean magnitude of the group's non-zero values (1-bit Adam's
    compressor, Tang et al., ICML 2021, section 3), coded ternary (five codes a byte, 1.6 bits) so zeros stay 0."""

    name, per_byte = "int1", 5

    def scales(self, groups, gmax, gmin, tmp, padding=None):
        mag = abs_into(groups, tmp)
        counts = torch.count_nonzero(groups, dim=-1).clamp_(min=1)
        sums = mag.sum(dim=-1)
        return int1_mean(sums, mag.mul_(INT1_DOWN).sum(dim=-1), counts)

    def encode_(self, groups, scales, codes, tmp, generator=None):
        sign = torch.sign(groups, out=tmp) if groups.dtype == tmp.dtype else tmp.copy_(groups).sign_()  # bf16 groups
        codes.copy_(sign.add_(1))
        groups.sub_(tmp.sub_(1).mul_(scales[..., None]))

    def decode(self, codes, scales, out):
        out.copy_(codes)
        return out.sub_(1).mul_(scales[..., None])


class _FP8(ValueFormat):
    """FP8 (OCP, Micikevicius et al., arXiv 2209.05433): ``v / s`` cast to e4m3 or e5m2, ``s = absmax / max``."""

    per_byte = 1

    def __init__(self, name: str):
        self.name, self.dtype, self.max = name, FP8_DTYPES[name], FP8_MAX[name]

    def scales(self, groups, gmax, gmin, tmp, padding=None):
        scales = _absmax(gmax, gmin)
        return div_by_constant(scales, self.max, out=scales)

    def encode_(self, groups, scales, codes, tmp, generator=None):
        fp8 = codes.view(self.dtype)
        fp8.copy_(torch.div(groups, _safe(scales), out=tmp))
        groups.sub_(tmp.copy_(fp8).mul_(scales[..., None]))

    def decode(self, codes, scales, out):
        out.copy_(codes.view(self.dtype))
        return out.mul_(scales[..., None])


FORMATS: Dict[str, ValueFormat] = {f.name: f for f in (_Int4(), _Int2(), _Int1(), _FP8("fp8_e4m3"), _FP8("fp8_e5m2"))}
assert set(FORMATS) == set(VALUE_BITS)


def code_bytes(count: int, fmt: str) -> int:
    """Bytes of ``count`` codes of ``fmt`` packed ``per_byte`` to a byte (INT1: ternary)."""
    return -(-count // FORMATS[fmt].per_byte)


_TERNARY = (1, 3, 9, 27, 81)


def pack_codes(codes: torch.Tensor, fmt: str, out: torch.Tensor) -> torch.Tensor:
    """Pack codes ``(R, K)`` (uint8; K a multiple of the format's ``per_byte``) row by row into ``out``
    ``(R, K / per_byte)`` uint8: little-endian bit fields (INT4 two a byte, INT2 four), INT1's ternary codes as base-3
    digits (digit i of a byte weighing 3^i), FP8 as they are."""
    per = FORMATS[fmt].per_byte
    if per == 1:
        return out.copy_(codes)
    parts = codes.view(codes.shape[0], -1, per)
    out.copy_(parts[..., 0])
    tmp = torch.empty_like(out)
    for j in range(1, per):
        if fmt == "int1":
            torch.mul(parts[..., j], _TERNARY[j], out=tmp)
            out.add_(tmp)
        else:
            torch.bitwise_left_shift(parts[..., j], j * VALUE_BITS[fmt], out=tmp)
            out.bitwise_or_(tmp)
    return out


def unpack_codes(packed: torch.Tensor, fmt: str, out: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: ``out`` ``(R, K)`` uint8 from ``packed`` ``(R, K / per_byte)``."""
    per = FORMATS[fmt].per_byte
    if per == 1:
        return out.copy_(packed)
    parts = out.view(out.shape[0], -1, per)
    for j in range(per):
        if fmt == "int1":
            torch.div(packed, _TERNARY[j], rounding_mode="floor", out=parts[..., j])
            parts[..., j].remainder_(3)
        else:
            torch.bitwise_right_shift(packed, j * VALUE_BITS[fmt], out=parts[..., j])
            parts[..., j].bitwise_and_((1 << VALUE_BITS[fmt]) - 1)
    return out


def _segment_groups(counts: Sequence[int], group_size: int, device):
    """For values of consecutive segments (``counts``) whose groups restart at each segment: where each value goes in
    a layout padded to whole groups (int64 ``(K,)``), how many padding values each group has (int64 ``(G,)``), and
    ``G``. Made per call from O(segments) cached device vectors (nothing per value is kept between calls)."""
    key = (tuple(counts), group_size, str(device))
    if key not in _SEGMENT_GROUPS:
        if len(_SEGMENT_GROUPS) > 256:
            _SEGMENT_GROUPS.clear()
        padded = [-(-k // group_size) * group_size for k in counts]
        K, G = sum(counts), sum(padded) // group_size
        shift = torch.tensor([p0 - k0 for p0, k0 in zip(_prefix(padded), _prefix(counts))], dtype=torch.long)
        lens = torch.tensor(list(counts), dtype=torch.long)
        pads = [(p // group_size - 1, pp - k) for p, pp, k in zip(_prefix(padded, inclusive=True), padded, counts)
                if pp > k]
        last = torch.tensor([g for g, _ in pads], dtype=torch.long)
        amount = torch.tensor([n for _, n in pads], dtype=torch.long)
        device = torch.device(device)
        _SEGMENT_GROUPS[key] = tuple(host_to_device(t, device) for t in (shift, lens, last, amount)) + (K, G)
    shift, lens, last, amount, K, G = _SEGMENT_GROUPS[key]
    dest = torch.arange(K, device=shift.device).add_(torch.repeat_interleave(shift, lens, output_size=K))
    padding = torch.zeros(G, dtype=torch.long, device=shift.device).index_put_((last, ), amount)
    return dest, padding, G


_SEGMENT_GROUPS: Dict[Tuple, Tuple] = {}


def _prefix(xs, inclusive: bool = False):
    out, total = [], 0
    for x in xs:
        total += x
        out.append(total if inclusive else total - x)
    return out


def encode_segments(values: torch.Tensor, counts: Sequence[int], fmt: str, group_size: int,
                    generator: Optional[torch.Generator] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Values of consecutive segments (tensors) of every row in ``fmt``, groups restarting at each segment.

    Args:
        values: fp32 ``(R, K)``, ``K = sum(counts)``; counts: values per segment; group_size: values per scale.
        generator: stochastic rounding (INT4/INT2).

    Returns:
        ``(scales, packed, decoded)``: fp32 ``(R, G)`` (``G = sum ceil(count / group_size)``), uint8
        ``(R, code_bytes(K, fmt))`` and fp32 ``(R, K)``, what the receivers decode.
    """
    R, device = values.shape[0], values.device
    dest, padding, G = _segment_groups(counts, group_size, device)
    K, f = values.shape[1], FORMATS[fmt]
    padded = values.new_zeros(R, G * group_size).index_copy_(1, dest, values).view(R, G, group_size)
    tmp = torch.empty_like(padded)
    scales = f.scales(padded, padded.amax(dim=-1), padded.amin(dim=-1), tmp, padding)
    codes = torch.zeros(R, G * group_size, dtype=torch.uint8, device=device)
    f.encode_(padded, scales, codes.view(R, G, group_size), tmp, generator)
    compact = torch.zeros(R, -(-K // f.per_byte) * f.per_byte, dtype=torch.uint8, device=device)
    compact[:, :K] = codes.index_select(1, dest)
    packed = pack_codes(compact, fmt, torch.empty(R, compact.shape[1] // f.per_byte, dtype=torch.uint8, device=device))
    return scales, packed, tmp.view(R, -1).index_select(1, dest)


def decode_segments(scales: torch.Tensor, packed: torch.Tensor, counts: Sequence[int], fmt: str,
                    group_size: int) -> torch.Tensor:
    """Inverse of :func:`encode_segments`: fp32 ``(W, K)`` from scales ``(W, G)`` and packed codes."""
    W, device = packed.shape[0], packed.device
    dest, _, G = _segment_groups(counts, group_size, device)
    f = FORMATS[fmt]
    K = sum(counts)
    codes = unpack_codes(packed, fmt, torch.empty(W, packed.shape[1] * f.per_byte, dtype=torch.uint8, device=device))
    spread = torch.zeros(W, G * group_size, dtype=torch.uint8, device=device).index_copy_(1, dest, codes[:, :K])
    out = torch.empty(W, G, group_size, dtype=torch.float32, device=device)
    return f.decode(spread.view(W, G, group_size), scales, out).view(W, -1).index_select(1, dest)
