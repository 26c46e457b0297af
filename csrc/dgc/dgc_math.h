// Per-element math of deepspeed_dgc's compressor, shared by the CPU (C++) and CUDA builds.
//
// Every function reproduces, bit for bit, what the PyTorch reference path in
// deepspeed_dgc/codec/formats.py and deepspeed_dgc/codec/reference.py computes in fp32: the accumulation
// of the gradient with the error-feedback residual, the group-wise absmax INT4 code
// (ZeRO++ qgZ's number format, Wang et al., arXiv 2306.10209, section 4.2) and the LEB128
// varint length of an index gap. Build with floating-point contraction off (-ffp-contract=off,
// nvcc --fmad=false): a fused multiply-add would round differently from the reference.
#pragma once

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define DGC_HD __host__ __device__ __forceinline__
#else
#define DGC_HD inline
#endif

namespace dgc {

constexpr int32_t kMagic = 0x44474331;  // "DGC1", first int32 of every payload
constexpr int kHeaderInt32 = 5;         // MAGIC, fingerprint, kept, index bytes, scale groups
constexpr float kInt4Qmax = 7.0f;       // symmetric codes -7..7
constexpr int kInt4Offset = 8;          // stored as code + 8 in one nibble

// x / divisor as torch computes x.div(scalar): a true division on the CPU; on CUDA PyTorch
// multiplies by the fp32 reciprocal (ATen's div_true_kernel_cuda with a CPU scalar), so the
// device code does the same.
DGC_HD float divide_by(float x, float divisor) {
#if defined(__CUDA_ARCH__)
  return x * (1.0f / divisor);
#else
  return x / divisor;
#endif
}

// acc = src / divisor + residual (fp32, each operation rounded once, as the reference:
// x.float().div(divisor) then add_(residual)). The divisor holds the world size and the loss scale.
DGC_HD float accumulate(float src, float divisor, bool divide, float residual) {
  float a = divide ? divide_by(src, divisor) : src;
  return a + residual;
}

// Elements of a tensor of n elements that owner `owner` holds when every owner gets c = ceil(n/W).
DGC_HD int64_t real_count(int64_t n, int64_t owner, int64_t c) {
  int64_t rest = n - owner * c;
  return rest <= 0 ? 0 : (rest < c ? rest : c);
}

// Scale of a group: absmax / 7.
DGC_HD float int4_scale(float absmax) { return absmax / kInt4Qmax; }

// round(v / scale) clamped to [-7, 7], as a float (keeps the sign of a zero, as the reference).
// Round half to even (the default rounding mode), like torch.round. An all-zero group
// (scale 0) codes as +0.
DGC_HD float int4_quantize(float v, float scale) {
  if (!(scale > 0.0f)) return 0.0f;
#if defined(__CUDA_ARCH__)
  float q = rintf(v / scale);
#else
  float q = std::nearbyint(v / scale);
#endif
  return q < -kInt4Qmax ? -kInt4Qmax : (q > kInt4Qmax ? kInt4Qmax : q);
}

// Nibble of a quantized value: code + 8 in [1, 15].
DGC_HD uint8_t int4_nibble(float q) { return static_cast<uint8_t>(static_cast<int>(q) + kInt4Offset); }

// Value a nibble decodes to: (nibble - 8) * scale.
DGC_HD float int4_dequantize(uint8_t nibble, float scale) {
  return static_cast<float>(static_cast<int>(nibble) - kInt4Offset) * scale;
}

// Value formats of gradient payloads (formats.VALUE_BITS), in the order the Python side numbers them.
enum ValueFormat : int { kInt4 = 0, kInt2 = 1, kInt1 = 2, kFp8E4M3 = 3, kFp8E5M2 = 4 };
constexpr int kNumValueFormats = 5;

DGC_HD constexpr int format_bits(int fmt) { return fmt == kInt4 ? 4 : fmt == kInt2 ? 2 : fmt == kInt1 ? 1 : 8; }

// INT2 and INT1 have no code for 0: their groups mixing zeros and non-zeros carry a non-zero bitmap.
DGC_HD bool zero_masked(int fmt) { return fmt == kInt2 || fmt == kInt1; }

// Bytes of n codes packed little-endian: ceil(n * bits / 8).
DGC_HD int64_t packed_bytes(int64_t n, int fmt) { return (n * format_bits(fmt) + 7) / 8; }

// v / scale, and 0 for a scale that is not positive (an all-zero group), as formats._divide_by_scale.
DGC_HD float divide_by_scale(float v, float scale) { return scale > 0.0f ? v / scale : 0.0f; }

// The scale of a group from its absmax, the sum of its magnitudes (in value order) and its count of
// non-zero values: absmax / 7 (INT4), / 1.5 (INT2), / 448 (e4m3), / 57344 (e5m2); INT1: the mean
// magnitude of the non-zero values (formats.group_scales).
DGC_HD float group_scale(int fmt, float absmax, float mag_sum, float nonzero) {
  switch (fmt) {
    case kInt4: return absmax / kInt4Qmax;
    case kInt2: return absmax / 1.5f;
    case kInt1: return mag_sum / (nonzero < 1.0f ? 1.0f : nonzero);
    case kFp8E4M3: return absmax / 448.0f;
    default: return absmax / 57344.0f;
  }
}

DGC_HD float floor_float(float x) {
#if defined(__CUDA_ARCH__)
  return floorf(x);
#else
  return std::floor(x);
#endif
}

// Code of v in a group of scale `scale` (rounded to nearest), stored in *code; returns the value it
// decodes to (formats.quantize_values): INT4 round(v/s) in [-7, 7] + 8; INT2 floor(v/s - 0.5 + 0.5) in
// [-2, 1] + 2, decoding to (q + 0.5) s; INT1 the sign bit (v >= 0), decoding to +-s; FP8 the bits of
// v/s as float8. Exact zeros decode to +0 in INT2 and INT1 (their bitmap says so).
DGC_HD float encode_value(int fmt, float v, float scale, uint8_t* code) {
  switch (fmt) {
    case kInt4: {
      const float q = int4_quantize(v, scale);
      *code = int4_nibble(q);
      return q * scale;
    }
    case kInt2: {
      const float t = divide_by_scale(v, scale) - 0.5f;
      float q = floor_float(t + 0.5f);
      q = q < -2.0f ? -2.0f : (q > 1.0f ? 1.0f : q);
      *code = static_cast<uint8_t>(static_cast<int>(q) + 2);
      return v == 0.0f ? 0.0f : (q + 0.5f) * scale;
    }
    case kInt1:
      *code = v >= 0.0f ? 1 : 0;
      return v == 0.0f ? 0.0f : (v >= 0.0f ? scale : -scale);
    case kFp8E4M3: {
      const c10::Float8_e4m3fn f(divide_by_scale(v, scale));
      *code = f.x;
      return static_cast<float>(f) * scale;
    }
    default: {
      const c10::Float8_e5m2 f(divide_by_scale(v, scale));
      *code = f.x;
      return static_cast<float>(f) * scale;
    }
  }
}

// What a code decodes to with scale 1: decode_value(fmt, code, s) == decode_unit(fmt, code) * s exactly for every
// format (the unit values are exact small integers, +-1, k + 0.5 or FP8 values), so a 256-entry table of them
// decodes without branches.
DGC_HD float decode_unit(int fmt, uint8_t code) {
  switch (fmt) {
    case kInt4: return static_cast<float>(static_cast<int>(code) - kInt4Offset);
    case kInt2: return static_cast<float>(code) - 2.0f + 0.5f;
    case kInt1: return code ? 1.0f : -1.0f;
    case kFp8E4M3: return static_cast<float>(c10::Float8_e4m3fn(code, c10::Float8_e4m3fn::from_bits()));
    default: return static_cast<float>(c10::Float8_e5m2(code, c10::Float8_e5m2::from_bits()));
  }
}

// The value a code decodes to (formats.dequantize_values), before the zero bitmap of INT2/INT1.
DGC_HD float decode_value(int fmt, uint8_t code, float scale) { return decode_unit(fmt, code) * scale; }

// Code i of a packed stream (little-endian within each byte).
DGC_HD uint8_t unpack_code(const uint8_t* packed, int64_t i, int bits) {
  if (bits == 8) return packed[i];
  const int64_t bit = i * bits;
  return static_cast<uint8_t>((packed[bit >> 3] >> (bit & 7)) & ((1 << bits) - 1));
}

// Weight formats of the quantized all-gather (formats.WEIGHT_QMAX), numbered as the Python side does.
enum WeightFormat : int { kWInt8 = 0, kWFp8E4M3 = 1, kWInt4 = 2 };

DGC_HD float weight_qmax(int wfmt) { return wfmt == kWInt8 ? 127.0f : wfmt == kWFp8E4M3 ? 448.0f : kInt4Qmax; }

// Code of weight v in a group of scale `scale` (formats.quantize_weights): INT8 round(v/s) in [-127, 127]
// as a two's-complement byte; FP8 e4m3 the bits of v/s; INT4 as encode_value.
DGC_HD uint8_t encode_weight(int wfmt, float v, float scale) {
  if (wfmt == kWInt4) return int4_nibble(int4_quantize(v, scale));
  const float x = divide_by_scale(v, scale);
  if (wfmt == kWFp8E4M3) return c10::Float8_e4m3fn(x).x;
#if defined(__CUDA_ARCH__)
  float q = rintf(x);
#else
  float q = std::nearbyint(x);
#endif
  q = q < -127.0f ? -127.0f : (q > 127.0f ? 127.0f : q);
  return static_cast<uint8_t>(static_cast<int8_t>(q));
}

#if !defined(__CUDACC__)
// fp32 -> float8 on the host as c10 converts (torch/headeronly/util/Float8_e4m3fn.h, Float8_e5m2.h: round to
// nearest even, subnormals kept), but with selects instead of branches, so that the loops calling them vectorize
// (c10's own conversion, called per value, does not). Both paths of c10's conversion are computed and one is kept.
//
// e4m3fn has no infinity, and torch versions differ in what magnitudes above 464 (the midpoint of 448 and 480, the
// first that rounds past 448), infinity included, become: 0x7f (NaN) in older ones, 0x7e (448, saturated) in 2.13.
// `sat` is that code as this build's c10 makes it (e4m3_saturated_code()); NaN stays 0x7f either way.
inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float f32_from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// c10's two paths for a magnitude `bits` (sign cleared) below the format's overflow, of a float8 with E exponent
// and M mantissa bits (bias 2^(E-1) - 1): below the smallest normal, the magic-number addition that rounds into the
// subnormal codes; from it, the exponent rebias with round-to-nearest-even on the bits cut off.
template <int E, int M>
inline uint8_t fp8_finite_code(uint32_t bits) {
  constexpr int bias = (1 << (E - 1)) - 1;
  constexpr uint32_t denorm_mask = static_cast<uint32_t>((127 - bias) + (23 - M) + 1) << 23;
  constexpr uint32_t smallest_normal = static_cast<uint32_t>(127 - bias + 1) << 23;
  constexpr int cut = 23 - M;
  const uint8_t denormal = static_cast<uint8_t>(f32_bits(f32_from_bits(bits) + f32_from_bits(denorm_mask)) - denorm_mask);
  const uint8_t normal = static_cast<uint8_t>((bits + (static_cast<uint32_t>(bias - 127) << 23) +
                                               ((UINT32_C(1) << (cut - 1)) - 1) + ((bits >> cut) & 1u)) >> cut);
  return bits < smallest_normal ? denormal : normal;
}

inline uint8_t fp8_e4m3_code(float f, uint8_t sat) {
  uint32_t bits = f32_bits(f);
  const uint32_t sign = bits & UINT32_C(0x80000000);
  bits ^= sign;
  uint8_t r = fp8_finite_code<4, 3>(bits);
  r = bits > UINT32_C(0x43E80000) ? sat : r;            // above 464.0f
  r = bits > UINT32_C(0x7F800000) ? uint8_t(0x7F) : r;  // NaN
  return static_cast<uint8_t>(r | (sign >> 24));
}

inline uint8_t fp8_e5m2_code(float f) {
  uint32_t bits = f32_bits(f);
  const uint32_t sign = bits & UINT32_C(0x80000000);
  bits ^= sign;
  uint8_t r = fp8_finite_code<5, 2>(bits);
  r = bits >= (UINT32_C(143) << 23) ? (bits > UINT32_C(0x7F800000) ? uint8_t(0x7F) : uint8_t(0x7C)) : r;  // 65536.0f up
  return static_cast<uint8_t>(r | (sign >> 24));
}

// The value of a float8 code at scale 1, as decode_unit gives it (c10's conversion), computed with selects so that
// loops calling it vectorize (a 256-entry table would be a gather): the exponent rebiased for normal codes, the
// mantissa times 2^(1 - bias - M) (exact) for subnormal ones; e4m3fn's 0x7f / 0xff are NaN, e5m2's top exponent is
// infinity or NaN.
template <int E, int M>
inline float fp8_unit(uint8_t code) {
  constexpr int bias = (1 << (E - 1)) - 1;
  constexpr uint32_t emax = (1u << E) - 1;
  const uint32_t c = code;
  const uint32_t sign = (c & 0x80u) << 24;
  const uint32_t e = (c >> M) & emax;
  const uint32_t m = c & ((1u << M) - 1);
  const uint32_t normal = sign | ((e + 127 - bias) << 23) | (m << (23 - M));
  constexpr float sub_unit = 1.0f / static_cast<float>(1u << (bias - 1 + M));  // 2^(1 - bias - M)
  const uint32_t subnormal = sign | f32_bits(static_cast<float>(static_cast<int32_t>(m)) * sub_unit);
  uint32_t bits = e == 0 ? subnormal : normal;
  if constexpr (E == 4)
    bits = (c & 0x7Fu) == 0x7Fu ? (sign | UINT32_C(0x7FF00000)) : bits;  // e4m3fn: the only NaN (c10's bits), no infinity
  else
    bits = e == emax ? (sign | UINT32_C(0x7F800000) | (m << (23 - M)) | (m ? UINT32_C(0x400000) : 0u)) : bits;
  return f32_from_bits(bits);
}

// What c10 makes of an e4m3fn magnitude above 464 (see fp8_e4m3_code).
inline uint8_t e4m3_saturated_code() { return c10::Float8_e4m3fn(470.0f).x; }

// encode_weight with fp8_e4m3_code for FP8 (the same code; `sat` from e4m3_saturated_code()), for the host's loops.
inline uint8_t encode_weight(int wfmt, float v, float scale, uint8_t sat) {
  return wfmt == kWFp8E4M3 ? fp8_e4m3_code(divide_by_scale(v, scale), sat) : encode_weight(wfmt, v, scale);
}
#endif

// What a weight code decodes to with scale 1 (decode_weight(w, code, s) == decode_weight_unit(w, code) * s exactly).
DGC_HD float decode_weight_unit(int wfmt, uint8_t code) {
  if (wfmt == kWInt4) return static_cast<float>(static_cast<int>(code) - kInt4Offset);
  if (wfmt == kWFp8E4M3) return static_cast<float>(c10::Float8_e4m3fn(code, c10::Float8_e4m3fn::from_bits()));
  return static_cast<float>(static_cast<int8_t>(code));
}

// The weight a code decodes to (formats.dequantize_weights).
DGC_HD float decode_weight(int wfmt, uint8_t code, float scale) { return decode_weight_unit(wfmt, code) * scale; }

// Bytes of the LEB128 varint of a non-negative gap (7 bits per byte): ceil(bit width / 7), at least 1. Without a
// loop: the gaps of a top-k selection need one or two bytes at random, a branch a mispredicted step.
DGC_HD int varint_length(uint64_t v) {
#ifdef __CUDA_ARCH__
  const int bits = 64 - __clzll(static_cast<long long>(v | 1));
#else
  const int bits = 64 - __builtin_clzll(v | 1);
#endif
  return (bits + 6) / 7;
}

}  // namespace dgc
