// The hand-written AVX2 primitives, built for AVX2 and called where the CPU has it (kHaveAvx2), with scalar
// stand-ins elsewhere: compaction, streamed copies, value and weight codes, packing, the dense pass's accumulate.
#pragma once

#include "cpu_common.h"

namespace dgc_cpu {
namespace {

// Appends column j0 + x and value a[x] to out if |a[x]| >= thr (never for a NaN).
inline void keep_at_least(const float* a, int64_t x, float thr, int64_t j0, Kept& out) {
  if (std::fabs(a[x]) >= thr) {
    out.push(j0 + x, a[x]);
  }
}

#ifdef DGC_X86_AVX2_PATHS
// the sign bits of 8 int32 lanes (all ones or zero each) as bits 0-7
__attribute__((target("avx2"))) inline uint32_t mask_of(__m256i m) {
  return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_castsi256_ps(m)));
}

// compact_at_least with AVX2 where the CPU has it: 16 magnitudes' bits against thr's per step by two signed compares
// (both are in [0, 2^31)) and a movemask, then only the set bits are visited, in order: no horizontal max and no
// branch per element. The same elements in the same order as compact_at_least.
[[maybe_unused]] __attribute__((target("avx2"))) void compact_at_least_avx2(const float* __restrict a, int64_t len, float thr,
                                                           int64_t j0, Kept& out) {
  const uint32_t thr_bits = thr > 0.0f ? dgc::f32_bits(thr) : 0u;
  const __m256i below = _mm256_set1_epi32(static_cast<int32_t>(thr_bits) - 1);
  const __m256i abs_bits = _mm256_set1_epi32(0x7FFFFFFF);
  int64_t x0 = 0;
  for (; x0 + 16 <= len; x0 += 16) {
    const __m256i lo = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + x0)), abs_bits);
    const __m256i hi = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + x0 + 8)), abs_bits);
    uint32_t m = mask_of(_mm256_cmpgt_epi32(lo, below)) | mask_of(_mm256_cmpgt_epi32(hi, below)) << 8;
    for (; m; m &= m - 1) keep_at_least(a, x0 + __builtin_ctz(m), thr, j0, out);
  }
  for (; x0 < len; ++x0) keep_at_least(a, x0, thr, j0, out);
}
const bool kHaveAvx2 = __builtin_cpu_supports("avx2");

// dst[0, n) = src[0, n), with non-temporal stores from dst's first 32-byte boundary (dst's lines are not read first)
[[maybe_unused]] __attribute__((target("avx2"))) void stream_copy(float* __restrict dst, const float* __restrict src, int64_t n) {
  int64_t x = 0;
  for (; x < n && (reinterpret_cast<uintptr_t>(dst + x) & 31) != 0; ++x) dst[x] = src[x];
  for (; x + 8 <= n; x += 8) _mm256_stream_ps(dst + x, _mm256_loadu_ps(src + x));
  for (; x < n; ++x) dst[x] = src[x];
}
inline void stream_fence() { _mm_sfence(); }  // streamed stores are seen by every thread after it

// 32 int32 lanes (each in [0, 255]) narrowed to 32 bytes in lane order: two saturating packs, which interleave the
// 128-bit halves, then one dword permutation that puts them back in order
__attribute__((target("avx2"))) inline __m256i narrow_to_bytes(__m256i w0, __m256i w1, __m256i w2, __m256i w3) {
  const __m256i b = _mm256_packus_epi16(_mm256_packs_epi32(w0, w1), _mm256_packs_epi32(w2, w3));
  return _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// 8 int32 lanes of bits v
__attribute__((target("avx2"))) inline __m256i u32(uint32_t v) { return _mm256_set1_epi32(static_cast<int32_t>(v)); }

// fp8_code_unit_avx2's lanes one at a time by the scalar functions (the rare vectors holding a magnitude past the
// format's largest finite value), out of line so that the vector path stays small where it is inlined
template <int E, int M>
__attribute__((target("avx2"), noinline, cold)) __m256i fp8_code_unit_scalar(__m256 x, uint8_t sat, __m256* unit) {
  alignas(32) float in[8], units[8];
  alignas(32) int32_t codes[8];
  _mm256_store_ps(in, x);
  for (int l = 0; l < 8; ++l) {
    const uint8_t c = E == 4 ? dgc::fp8_e4m3_code(in[l], sat) : dgc::fp8_e5m2_code(in[l]);
    codes[l] = c;
    units[l] = dgc::fp8_unit<E, M>(c);
  }
  *unit = _mm256_load_ps(units);
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(codes));
}

// dgc::fp8_e4m3_code / fp8_e5m2_code of 8 values (E exponent, M mantissa bits) with AVX2, in int32 lanes ([0, 255]),
// and in *unit the value each code decodes to at scale 1 (dgc::fp8_unit): below the format's largest finite value the
// rounded magnitude's fp32 bits are the code's value (the cut-off bits cleared after the round-to-nearest-even carry;
// below the smallest normal, c10's magic-number sum less the magic number, exact), so the unit costs no decode. The
// rare vectors holding a magnitude past that (e4m3 above 464, e5m2 from 61440, NaN: saturated, infinite or NaN codes)
// take the scalar functions lane by lane.
template <int E, int M>
__attribute__((target("avx2"))) inline __m256i fp8_code_unit_avx2(__m256 x, uint8_t sat, __m256* unit) {
  constexpr int bias = (1 << (E - 1)) - 1;
  constexpr uint32_t denorm_mask = static_cast<uint32_t>((127 - bias) + (23 - M) + 1) << 23;
  constexpr uint32_t smallest_normal = static_cast<uint32_t>(127 - bias + 1) << 23;
  constexpr int cut = 23 - M;
  constexpr uint32_t limit = E == 4 ? UINT32_C(0x43E80000) : (UINT32_C(143) << 23) - (UINT32_C(1) << (cut - 1)) - 1;
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i sign = _mm256_and_si256(bits, u32(0x80000000u));
  const __m256i mag = _mm256_xor_si256(bits, sign);
  const __m256i over = _mm256_cmpgt_epi32(mag, u32(limit));
  const __m256i sub = _mm256_cmpgt_epi32(u32(smallest_normal), mag);
  const __m256i carried = _mm256_add_epi32(_mm256_add_epi32(mag, u32((UINT32_C(1) << (cut - 1)) - 1)),
                                           _mm256_and_si256(_mm256_srli_epi32(mag, cut), u32(1)));
  const __m256i norm_unit = _mm256_and_si256(carried, u32(~((UINT32_C(1) << cut) - 1)));
  const __m256i norm_code = _mm256_add_epi32(_mm256_srli_epi32(carried, cut), u32(static_cast<uint32_t>(bias - 127) << M));
  if (_mm256_testz_si256(_mm256_or_si256(over, sub), _mm256_set1_epi32(-1))) {
    // every lane a normal FP8 value (the common case): its code is in [1 << M, 255 >> 1], no subnormal blend
    *unit = _mm256_castsi256_ps(_mm256_or_si256(norm_unit, sign));
    return _mm256_or_si256(norm_code, _mm256_srli_epi32(sign, 24));
  }
  if (!_mm256_testz_si256(over, _mm256_set1_epi32(-1))) return fp8_code_unit_scalar<E, M>(x, sat, unit);
  const __m256 magic = _mm256_castsi256_ps(u32(denorm_mask));
  const __m256 den_sum = _mm256_add_ps(_mm256_castsi256_ps(mag), magic);
  const __m256i den_code = _mm256_sub_epi32(_mm256_castps_si256(den_sum), u32(denorm_mask));
  const __m256i den_unit = _mm256_castps_si256(_mm256_sub_ps(den_sum, magic));
  *unit = _mm256_castsi256_ps(_mm256_or_si256(_mm256_blendv_epi8(norm_unit, den_unit, sub), sign));
  return _mm256_or_si256(_mm256_and_si256(_mm256_blendv_epi8(norm_code, den_code, sub), u32(0xFF)),
                         _mm256_srli_epi32(sign, 24));
}

// The codes of 8 values v of a scale group of scale s > 0 in int32 lanes ([0, 255]; INT2 and INT1: bit 7 set for
// a non-zero value, as encode_block), and in *decoded the values they decode to (dgc::encode_value's, each lane the
// same IEEE operations in the same order: the division, round half to even or floor, the clamp, the decode). INT1
// needs no division (the sign and the scale) and takes any scale. `sat`: e4m3_saturated_code() (FP8 e4m3 only).
template <int F>
__attribute__((target("avx2"))) inline __m256i code8_avx2(__m256 v, __m256 s, uint8_t sat, __m256* decoded) {
  const __m256 half = _mm256_set1_ps(0.5f), zero = _mm256_setzero_ps();
  if constexpr (F == dgc::kInt4) {
    const __m256 q = _mm256_min_ps(_mm256_set1_ps(dgc::kInt4Qmax), _mm256_max_ps(_mm256_set1_ps(-dgc::kInt4Qmax),
        _mm256_round_ps(_mm256_div_ps(v, s), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));  // NaN kept
    *decoded = _mm256_mul_ps(q, s);
    return _mm256_add_epi32(_mm256_cvttps_epi32(q), u32(dgc::kInt4Offset));
  } else if constexpr (F == dgc::kInt2) {
    const __m256 q = _mm256_min_ps(_mm256_set1_ps(1.0f), _mm256_max_ps(_mm256_set1_ps(-2.0f),
        _mm256_floor_ps(_mm256_add_ps(_mm256_sub_ps(_mm256_div_ps(v, s), half), half))));  // NaN kept
    const __m256 nz = _mm256_cmp_ps(v, zero, _CMP_NEQ_OQ);
    *decoded = _mm256_and_ps(_mm256_mul_ps(_mm256_add_ps(q, half), s), nz);  // +0 for a zero value
    return _mm256_or_si256(_mm256_add_epi32(_mm256_cvttps_epi32(q), u32(2)),
                           _mm256_and_si256(_mm256_castps_si256(nz), u32(0x80)));
  } else if constexpr (F == dgc::kInt1) {  // +-s by the sign (v >= 0: +s, -0 included), +0 for a zero value
    const __m256 pos = _mm256_cmp_ps(v, zero, _CMP_GE_OQ), nz = _mm256_cmp_ps(v, zero, _CMP_NEQ_UQ);
    *decoded = _mm256_and_ps(_mm256_blendv_ps(_mm256_sub_ps(zero, s), s, pos), nz);
    return _mm256_or_si256(_mm256_and_si256(_mm256_castps_si256(pos), u32(1)),
                           _mm256_and_si256(_mm256_castps_si256(nz), u32(0x80)));
  } else {
    constexpr int E = F == dgc::kFp8E4M3 ? 4 : 5, M = F == dgc::kFp8E4M3 ? 3 : 2;
    __m256 unit;
    const __m256i code = fp8_code_unit_avx2<E, M>(_mm256_div_ps(v, s), sat, &unit);
    *decoded = _mm256_mul_ps(unit, s);
    return code;
  }
}

// The codes of the 32 values v[0, 32) of a scale group of scale s > 0 (code8_avx2) as 32 bytes in value order, and
// v[x] - what each code decodes to (the new residual) into res[0, 32): with non-temporal stores where Stream (res
// 32-byte aligned), else plain ones (res may be v).
template <int F, bool Stream>
__attribute__((target("avx2"))) inline __m256i code32_avx2(const float* v, __m256 s, uint8_t sat, float* res) {
  __m256i w[4];
  for (int l = 0; l < 4; ++l) {
    const __m256 x = _mm256_loadu_ps(v + 8 * l);
    __m256 decoded;
    w[l] = code8_avx2<F>(x, s, sat, &decoded);
    if (Stream) _mm256_stream_ps(res + 8 * l, _mm256_sub_ps(x, decoded));
    else _mm256_storeu_ps(res + 8 * l, _mm256_sub_ps(x, decoded));
  }
  return narrow_to_bytes(w[0], w[1], w[2], w[3]);
}

// The codes of one scale group of scale > 0 (encode_block's loop) with AVX2 where the CPU has it, 32 values a step
// (code32_avx2): a[x] -= what each code decodes to (the new residual), one code byte each into codes. GCC's own
// vectorization of encode_value spilled registers and blended per lane, and was slower than this loop
// (results/kernels.md). Returns the count of values done (a multiple of 32), and in *zeros
// the zero values among them (counted from INT2/INT1's non-zero marks; 0 for the others); the caller codes the rest.
template <int F>
__attribute__((target("avx2"))) int64_t encode_group_avx2(float* __restrict a, uint8_t* __restrict codes, int64_t len,
                                                          float scale, uint8_t sat, int64_t* zeros) {
  const __m256 s = _mm256_set1_ps(scale);
  int64_t x = 0, nonzero = 0;
  for (; x + 32 <= len; x += 32) {
    const __m256i b = code32_avx2<F, false>(a + x, s, sat, a + x);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + x), b);
    if (dgc::zero_masked(F)) nonzero += __builtin_popcount(static_cast<uint32_t>(_mm256_movemask_epi8(b)));
  }
  *zeros = dgc::zero_masked(F) ? x - nonzero : 0;
  return x;
}

// 32 one-byte codes v (the code in the low bits, bit 7 INT2/INT1's non-zero mark) packed as pack_piece packs them, with
// AVX2: into packed[0, 4 BITS) and, where `nonzero` is given, the marks into nonzero[0, 4). The marks are the bytes'
// top bits (one movemask); INT4 pairs c0 + 16 c1 and INT2 quadruples c0 + 4 c1 + 16 c2 + 64 c3 are multiply-adds of
// the masked codes (u8 x s8 into 16 bits, then 16 x 16 into 32 bits), narrowed to bytes; INT1's bits are the codes'
// bit 0 moved to bit 7, then one movemask.
template <int BITS>
__attribute__((target("avx2"))) inline void pack32_avx2(__m256i v, uint8_t* __restrict packed,
                                                        uint8_t* __restrict nonzero) {
  if (nonzero) {
    const uint32_t marks = static_cast<uint32_t>(_mm256_movemask_epi8(v));
    std::memcpy(nonzero, &marks, 4);
  }
  if constexpr (BITS == 4) {
    const __m256i w = _mm256_maddubs_epi16(_mm256_and_si256(v, _mm256_set1_epi8(0x0F)), _mm256_set1_epi16(0x1001));
    const __m256i b = _mm256_permute4x64_epi64(_mm256_packus_epi16(w, w), 0x08);  // each half's 8 bytes
    _mm_storeu_si128(reinterpret_cast<__m128i*>(packed), _mm256_castsi256_si128(b));
  } else if constexpr (BITS == 2) {
    const __m256i w = _mm256_maddubs_epi16(_mm256_and_si256(v, _mm256_set1_epi8(0x03)), _mm256_set1_epi16(0x0401));
    const __m256i d = _mm256_madd_epi16(w, _mm256_set1_epi32(0x00100001));  // one packed byte per int32 lane
    const __m256i b = _mm256_packus_epi16(_mm256_packs_epi32(d, d), _mm256_setzero_si256());
    const __m256i q = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(packed), _mm256_castsi256_si128(q));
  } else {
    const uint32_t bits = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_slli_epi16(v, 7)));
    std::memcpy(packed, &bits, 4);
  }
}

// pack_piece's loop with AVX2 where the CPU has it, 32 codes a step (pack32_avx2); returns the count done (a multiple
// of 32).
template <int BITS>
__attribute__((target("avx2"))) int64_t pack_piece_avx2(const uint8_t* __restrict c, int64_t n,
                                                         uint8_t* __restrict packed, uint8_t* __restrict nonzero) {
  int64_t x = 0;
  for (; x + 32 <= n; x += 32)
    pack32_avx2<BITS>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + x)), packed + x * BITS / 8,
                      nonzero ? nonzero + x / 8 : nullptr);
  return x;
}

// 8 values from v as fp32: loaded (float) or widened exactly (bf16: its bits shifted up)
__attribute__((target("avx2"))) inline __m256 load8(const float* v) { return _mm256_loadu_ps(v); }
__attribute__((target("avx2"))) inline __m256 load8(const c10::BFloat16* v) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// acc of 8 elements as accumulate_block computes them, each lane one IEEE operation at a time: s * inverse (Mode 1)
// or s / divisor (Mode 2) or s (Mode 0), then + res where there is one
template <int Mode, typename T>
__attribute__((target("avx2"))) inline __m256 acc8_avx2(const T* s, const float* res, __m256 vinv, __m256 vd) {
  __m256 a = load8(s);
  if (Mode == 1) a = _mm256_mul_ps(a, vinv);
  if (Mode == 2) a = _mm256_div_ps(a, vd);
  return res ? _mm256_add_ps(a, _mm256_loadu_ps(res)) : a;
}

// The INT8 or FP8 e4m3 weight codes of one group of scale > 0 (quantize_weight_groups' loop: dgc::encode_weight of
// v / scale) with AVX2 where the CPU has it, for fp32 and bf16 weights; returns the count done (a multiple of 32, 0
// for fp16).
template <int W, typename T>
__attribute__((target("avx2"))) int64_t weight_codes_avx2(const T* __restrict v, uint8_t* __restrict codes,
                                                          int64_t len, float scale, uint8_t sat) {
  static_assert(W == dgc::kWInt8 || W == dgc::kWFp8E4M3, "INT8 and FP8 e4m3 only");
  if constexpr (!std::is_same<T, float>::value && !std::is_same<T, c10::BFloat16>::value) {
    return 0;
  } else {
    const __m256 s = _mm256_set1_ps(scale), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
    int64_t x = 0;
    for (; x + 32 <= len; x += 32) {
      __m256i w[4];
      for (int k = 0; k < 4; ++k) {
        const __m256 q = _mm256_div_ps(load8(v + x + 8 * k), s);
        if constexpr (W == dgc::kWFp8E4M3) {
          __m256 unit;  // not needed here
          w[k] = fp8_code_unit_avx2<4, 3>(q, sat, &unit);
        } else {  // round half to even, clamp, the int8's two's-complement byte
          const __m256 r = _mm256_round_ps(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          w[k] = _mm256_and_si256(_mm256_cvttps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, r))), u32(0xFF));
        }
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + x), narrow_to_bytes(w[0], w[1], w[2], w[3]));
    }
    return x;
  }
}

// 8 INT8 weight codes (the low 8 bytes of `bytes8`) times `scale`, rounded to bf16 as WeightStore<BFloat16> rounds
// (NaN as 0x7FC0): their bits in int32 lanes.
__attribute__((target("avx2"))) inline __m256i int8_bf16_bits8(__m128i bytes8, __m256 scale) {
  const __m256i u = _mm256_castps_si256(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes8)), scale));
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, lsb), _mm256_set1_epi32(0x7FFF)), 16);
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF)), _mm256_set1_epi32(0x7F800000));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
}

// INT8 weight codes c[0, len) at `scale` into bf16 o, 16 at a time with AVX2 (dequantize_weight_groups' loops: the
// signed byte times scale, rounded once to bf16), in one pass without the fp32 buffer; returns the count done (a
// multiple of 16).
[[maybe_unused]] __attribute__((target("avx2"))) int64_t int8_to_bf16_avx2(const uint8_t* __restrict c, float scale,
                                                          uint16_t* __restrict o, int64_t len) {
  const __m256 s = _mm256_set1_ps(scale);
  int64_t x = 0;
  for (; x + 16 <= len; x += 16) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + x));
    // (the pack interleaves the two vectors' 128-bit halves; the permutation puts them back in order)
    const __m256i packed = _mm256_packus_epi32(int8_bf16_bits8(b, s), int8_bf16_bits8(_mm_srli_si128(b, 8), s));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + x), _mm256_permute4x64_epi64(packed, 0xD8));
  }
  return x;
}

// The dense pass over [j0, j0 + len) of a sparse row in one loop, with AVX2 where the CPU has it: acc (the operations
// of accumulate_block: s * inverse or s / divisor, then + res, each one IEEE operation) is streamed to dst with
// non-temporal stores, and the columns j0 + x and values of |acc| >= thr are appended to out in order (as
// compact_at_least). Where accumulate_block, compact_at_least and stream_copy pass a piece through an L1 scratch
// buffer three times, this keeps acc in registers, which is faster on large sparse rows (results/kernels.md). A lane with a non-finite acc is counted (the caller then gives up the bucket) and never
// kept. fp32 and bf16 sources (load8); returns -1 for any other (the caller takes the three steps).
template <typename T, int Mode>  // Mode 0: s, 1: s * inverse, 2: s / divisor
__attribute__((target("avx2"))) int64_t accumulate_compact_avx2(const T* __restrict s, const float* __restrict res,
                                                                const Params& p, float* __restrict dst, int64_t len,
                                                                float thr, int64_t j0, Kept& out) {
  if constexpr (!std::is_same<T, float>::value && !std::is_same<T, c10::BFloat16>::value) {
    return -1;
  } else {
    int64_t nonfinite = 0, x = 0;
    const float inv = p.inverse, d = p.divisor;
    // one element as accumulate_block computes it; kept as keep_at_least keeps it
    auto one = [&](int64_t y) {
      float a = static_cast<float>(s[y]);
      if (Mode == 1) a = a * inv;
      if (Mode == 2) a = a / d;
      if (res) a = a + res[y];
      return a;
    };
    auto scalar = [&](int64_t y) {
      dst[y] = one(y);
      nonfinite += !(std::fabs(dst[y]) <= FLT_MAX);
      keep_at_least(dst, y, thr, j0, out);
    };
    for (; x < len && (reinterpret_cast<uintptr_t>(dst + x) & 31) != 0; ++x) scalar(x);
    // lanes whose magnitude's bits are above `below` are kept: none for a NaN threshold (as |a| >= NaN)
    const uint32_t thr_bits = thr > 0.0f ? dgc::f32_bits(thr) : 0u;
    const __m256i below = _mm256_set1_epi32(std::isnan(thr) ? INT32_MAX : static_cast<int32_t>(thr_bits) - 1);
    const __m256i abs_bits = _mm256_set1_epi32(0x7FFFFFFF);
    const __m256i finite_max = _mm256_set1_epi32(0x7F7FFFFF);  // FLT_MAX's bits: above it Inf and NaN
    const __m256 vinv = _mm256_set1_ps(inv), vd = _mm256_set1_ps(d);
    for (; x + 16 <= len; x += 16) {
      const __m256 a0 = acc8_avx2<Mode>(s + x, res ? res + x : nullptr, vinv, vd);
      const __m256 a1 = acc8_avx2<Mode>(s + x + 8, res ? res + x + 8 : nullptr, vinv, vd);
      _mm256_stream_ps(dst + x, a0);
      _mm256_stream_ps(dst + x + 8, a1);
      // magnitudes' bits: against FLT_MAX's (non-finite) and thr's (kept), two signed compares each (all in [0, 2^31))
      const __m256i m0 = _mm256_and_si256(_mm256_castps_si256(a0), abs_bits);
      const __m256i m1 = _mm256_and_si256(_mm256_castps_si256(a1), abs_bits);
      const uint32_t bad = mask_of(_mm256_cmpgt_epi32(m0, finite_max)) | mask_of(_mm256_cmpgt_epi32(m1, finite_max)) << 8;
      nonfinite += __builtin_popcount(bad);
      uint32_t keep = (mask_of(_mm256_cmpgt_epi32(m0, below)) | mask_of(_mm256_cmpgt_epi32(m1, below)) << 8) & ~bad;
      for (; keep; keep &= keep - 1) {  // rare (about the density): acc again from the lines just read
        const int64_t y = x + __builtin_ctz(keep);
        out.push(j0 + y, one(y));
      }
    }
    for (; x < len; ++x) scalar(x);
    return nonfinite;
  }
}
#else
constexpr bool kHaveAvx2 = false;
inline void compact_at_least_avx2(const float* a, int64_t len, float thr, int64_t j0, Kept& out) {
  compact_at_least(a, len, thr, j0, out);
}
inline void stream_copy(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void stream_fence() {}
template <int F>
inline int64_t encode_group_avx2(float*, uint8_t*, int64_t, float, uint8_t, int64_t* zeros) {
  *zeros = 0;
  return 0;
}
template <int W, typename T>
inline int64_t weight_codes_avx2(const T*, uint8_t*, int64_t, float, uint8_t) { return 0; }
template <int BITS>
inline int64_t pack_piece_avx2(const uint8_t*, int64_t, uint8_t*, uint8_t*) { return 0; }
template <typename T, int Mode>
inline int64_t accumulate_compact_avx2(const T*, const float*, const Params&, float*, int64_t, float, int64_t, Kept&) {
  return -1;
}
inline int64_t int8_to_bf16_avx2(const uint8_t*, float, uint16_t*, int64_t) { return 0; }
#endif

}  // namespace
}  // namespace dgc_cpu
