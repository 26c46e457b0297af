// Value coders: packing, absmax, group scales, a row sent whole coded block by block (encode_block), the packing
// of a segment's codes into a payload. Scalar loops (built for AVX2 too, target_clones) beside cpu_simd.h's AVX2 ones.
#pragma once

#include "cpu_common.h"
#include "cpu_simd.h"

namespace dgc_cpu {
namespace {

// Packs the one-byte codes c[0, n) of a piece that encode_block made (the code in the low bits, bit 7 INT2/INT1's
// non-zero mark) into packed[0, ceil(n BITS / 8)) (formats.pack_bits: the first code in the low bits) and, where
// `nonzero` is given, the marks into nonzero[0, ceil(n / 8)) (bit x % 8 of byte x / 8). Every byte is written whole,
// the bits past n 0, so pieces that start at multiples of 8 values write disjoint bytes.
template <int BITS>
void pack_piece(const uint8_t* __restrict c, int64_t n, uint8_t* __restrict packed, uint8_t* __restrict nonzero) {
  constexpr int per = 8 / BITS;
  constexpr uint8_t low = (1 << BITS) - 1;
  for (int64_t x = kHaveAvx2 ? pack_piece_avx2<BITS>(c, n, packed, nonzero) : 0; x < n; x += 8) {
    const int64_t m = std::min<int64_t>(8, n - x);
    uint8_t marks = 0, bytes[BITS] = {};
    for (int64_t q = 0; q < m; ++q) {
      marks |= static_cast<uint8_t>((c[x + q] >> 7) << q);
      bytes[q / per] |= static_cast<uint8_t>((c[x + q] & low) << ((q % per) * BITS));
    }
    if (nonzero) nonzero[x / 8] = marks;
    for (int64_t b = 0; b < (m * BITS + 7) / 8; ++b) packed[x / per + b] = bytes[b];
  }
}

// max |v[x]| over v[0, len) as float, 0 for none, the same max a serial std::max loop finds (a NaN is never picked):
// eight running maxima in a GCC vector, which the compiler keeps in registers of the target's width. With kNanWins,
// a NaN where v holds one (torch's amax, which the weight quantizer must follow: a NaN weight makes its group's scale
// NaN): the maximum of the magnitudes' bits as integers, which order as the values for magnitudes and put every NaN
// above infinity (an integer max also vectorizes in fewer instructions than a float compare and select).
template <bool kNanWins = false, typename T>
inline float absmax_of(const T* __restrict v, int64_t len) {
  typedef float v8f __attribute__((vector_size(32)));
  typedef int32_t v8i __attribute__((vector_size(32)));
  int64_t x = 0;
  if constexpr (kNanWins) {
    v8i m = {0, 0, 0, 0, 0, 0, 0, 0};
    for (; x + 8 <= len; x += 8) {
      v8i b;
      for (int l = 0; l < 8; ++l) b[l] = static_cast<int32_t>(dgc::f32_bits(static_cast<float>(v[x + l])) & 0x7FFFFFFFu);
      m = b > m ? b : m;
    }
    int32_t r = 0;
    for (int l = 0; l < 8; ++l) r = std::max(r, m[l]);
    for (; x < len; ++x) r = std::max(r, static_cast<int32_t>(dgc::f32_bits(static_cast<float>(v[x])) & 0x7FFFFFFFu));
    return dgc::f32_from_bits(static_cast<uint32_t>(r));
  } else {
    v8f m = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    for (; x + 8 <= len; x += 8) {
      v8f a;
      for (int l = 0; l < 8; ++l) a[l] = std::fabs(static_cast<float>(v[x + l]));
      m = a > m ? a : m;
    }
    float r = 0.0f;
    for (int l = 0; l < 8; ++l) r = std::max(r, m[l]);
    for (; x < len; ++x) r = std::max(r, std::fabs(static_cast<float>(v[x])));
    return r;
  }
}

// The scale of a group of values v[0, n) with absmax, the fp32 sum of their magnitudes in value order and their count
// of non-zeros (dgc::group_scale). INT1's is their mean magnitude; where that sum passes the largest float (finite
// magnitudes from about 2.7e36 in a group of 128) the mean is taken of the magnitudes times 2^-64 (summed in value
// order) and times 2^64 after, which is finite, as formats.group_scales takes it (an Inf scale would decode to Inf).
inline float value_group_scale(int fmt, const float* v, int64_t n, float absmax, float mag_sum, float nonzero) {
  if (fmt != dgc::kInt1 || !std::isinf(mag_sum)) return dgc::group_scale(fmt, absmax, mag_sum, nonzero);
  float small = 0.0f;
  for (int64_t x = 0; x < n; ++x) small += std::fabs(v[x]) * 0x1p-64f;
  return dgc::group_scale(fmt, absmax, small, nonzero) * 0x1p64f;  // (the mean's clamped count, as above)
}

// sums[g] = |a[g gs]| + |a[g gs + 1]| + ... over the whole groups of gs values in a[0, len), each added in value order
// (INT1's scale is the mean magnitude, summed as the reference's index_add_ sums it). One group's sum is a chain of
// dependent additions (3-4 cycles each); eight groups' chains side by side, one lane each, keep the adders busy
// without changing any chain's order. Returns the count of groups summed (the rest, and a short last group, are the
// caller's).
DGC_SIMD_CLONES int64_t group_mag_sums(const float* __restrict a, int64_t len, int64_t gs, float* __restrict sums) {
  typedef float v8f __attribute__((vector_size(32)));
  const int64_t whole = len / gs;
  int64_t g = 0;
  for (; g + 8 <= whole; g += 8) {
    v8f acc = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    const float* __restrict base = a + g * gs;
    for (int64_t y = 0; y < gs; ++y) {
      v8f v;
      for (int l = 0; l < 8; ++l) v[l] = std::fabs(base[l * gs + y]);
      acc += v;
    }
    for (int l = 0; l < 8; ++l) sums[g + l] = acc[l];
  }
  return g;
}

// Codes the scale groups of a[0, len) (columns j0 + x of a row sent whole; j0 a multiple of the group size):
// the group statistics and scale as step 4 of compress_bucket computes them, the codes into dst.codes (FP8: a byte
// each; INT4/INT2/INT1 packed, with INT2/INT1's non-zero marks into dst.nonzero), and a[x] -= what the code decodes
// to (the new residual). The same results, bit for bit, as step 4's loops and packing.
template <int F>
DGC_SIMD_CLONES void encode_block(float* __restrict a, int64_t len, int64_t j0, int64_t gs, Kept& dst) {
  constexpr bool masked = F == dgc::kInt2 || F == dgc::kInt1;
  constexpr int bits = dgc::format_bits(F);
  // FP8's code bytes go where they are sent; narrower codes to a buffer that stays in L1, packed after (j0 is a
  // multiple of 8, so the piece's packed bytes and marks are its own)
  thread_local std::vector<uint8_t> piece;
  if (bits < 8 && piece.size() < static_cast<size_t>(len)) piece.resize(len);
  uint8_t* __restrict codes = bits < 8 ? piece.data() : dst.codes.get() + j0;
  const uint8_t sat = dgc::e4m3_saturated_code();  // FP8 e4m3 only: c10's code above 464, once per block
  float sums[kPiece / 2];  // INT1: the magnitude sums of the first groups (of at least 2 values) of the piece
  const int64_t summed = F == dgc::kInt1 && len <= kPiece ? group_mag_sums(a, len, gs, sums) : 0;
  for (int64_t g0 = 0, g = j0 / gs, k = 0; g0 < len; g0 += gs, ++g, ++k) {  // g: the group's index in the row
    const int64_t g1 = std::min(g0 + gs, len);
    // the block is finite (checked by the caller), so a max in any order is the same max; INT1's sum of
    // magnitudes stays in value order (its scale must equal the reference's bit for bit)
    const float absmax = absmax_of(a + g0, g1 - g0);
    float mag_sum = 0.0f;
    int64_t nonzero = g1 - g0;
    if (F == dgc::kInt1) {  // INT1's scale needs its count of non-zeros; INT2 counts its zeros while coding, below
      int64_t zeros = 0;
      for (int64_t y = g0; y < g1; ++y) zeros += a[y] == 0.0f;
      nonzero -= zeros;
      if (k < summed) mag_sum = sums[k];
      else
        for (int64_t y = g0; y < g1; ++y) mag_sum += std::fabs(a[y]);
    }
    const float scale = value_group_scale(F, a + g0, g1 - g0, absmax, mag_sum, static_cast<float>(nonzero));
    dst.gscale[g] = scale;
    if (F == dgc::kInt1) dst.gmixed[g] = nonzero < g1 - g0 && scale > 0.0f;  // INT2's: after coding, below
    if constexpr (F == dgc::kInt1) {  // encode_value's INT1 without branches (the loop vectorizes)
      for (int64_t y = g0; y < g1; ++y) {
        const float v = a[y];
        const bool pos = v >= 0.0f, nz = v != 0.0f;
        const float signed_scale = pos ? scale : -scale;
        a[y] = v - (nz ? signed_scale : 0.0f);
        codes[y] = static_cast<uint8_t>(static_cast<uint8_t>(pos) | (static_cast<uint8_t>(nz) << 7));
      }
    } else if constexpr (F == dgc::kFp8E4M3 || F == dgc::kFp8E5M2) {
      // the AVX2 coder where it runs; the rest (or all, without AVX2): codes, then what they decode to, with selects,
      // in two loops that each vectorize (GCC gives up on one)
      int64_t zeros = 0;  // not counted for FP8
      const int64_t done =
          kHaveAvx2 && scale > 0.0f ? g0 + encode_group_avx2<F>(a + g0, codes + g0, g1 - g0, scale, sat, &zeros) : g0;
      for (int64_t y = done; y < g1; ++y) {
        const float x = dgc::divide_by_scale(a[y], scale);
        codes[y] = F == dgc::kFp8E4M3 ? dgc::fp8_e4m3_code(x, sat) : dgc::fp8_e5m2_code(x);
      }
      for (int64_t y = done; y < g1; ++y)
        a[y] -= (F == dgc::kFp8E4M3 ? dgc::fp8_unit<4, 3>(codes[y]) : dgc::fp8_unit<5, 2>(codes[y])) * scale;
    } else {
      int64_t zeros = 0;
      const int64_t done =
          kHaveAvx2 && scale > 0.0f ? g0 + encode_group_avx2<F>(a + g0, codes + g0, g1 - g0, scale, sat, &zeros) : g0;
      for (int64_t y = done; y < g1; ++y) {
        const float v = a[y];
        uint8_t c;
        const float decoded = dgc::encode_value(F, v, scale, &c);
        a[y] = v - decoded;
        codes[y] = masked ? static_cast<uint8_t>(c | ((v != 0.0f) << 7)) : c;
        zeros += v == 0.0f;
      }
      if (F == dgc::kInt2) dst.gmixed[g] = zeros > 0 && scale > 0.0f;
    }
  }
  if constexpr (bits < 8)
    pack_piece<bits>(codes, len, dst.codes.get() + j0 / (8 / bits), masked ? dst.nonzero.get() + j0 / 8 : nullptr);
}

// Packs the n codes of one segment, codes v0 .. v0 + n - 1 of a row, into the row's zeroed value bytes: BITS bits
// (< 8) each, the first code in the low bits (formats.pack_bits). A byte shared with the segment before or after
// (v0 or v0 + n not a multiple of 8 / BITS) is or-ed into, so the segments of one row must be packed one after
// another; the whole bytes between are written in parallel.
template <int BITS>
void pack_segment(const uint8_t* codes, int64_t n, int64_t v0, uint8_t* values) {
  constexpr int per = 8 / BITS;
  constexpr uint8_t low = (1 << BITS) - 1;
  auto put = [&](int64_t x) {  // one code into its (possibly shared) byte
    const int64_t v = v0 + x;
    values[v / per] |= static_cast<uint8_t>((codes[x] & low) << ((v % per) * BITS));
  };
  int64_t x = 0;
  for (; x < n && (v0 + x) % per != 0; ++x) put(x);
  const int64_t full = (n - x) / per;
  const uint8_t* src = codes + x;
  uint8_t* dst = values + (v0 + x) / per;
  at::parallel_for(0, full, kBlock, [src, dst](int64_t b, int64_t e) {  // whole bytes
    pack_piece<BITS>(src + b * per, (e - b) * per, dst + b, nullptr);
  });
  for (x += full * per; x < n; ++x) put(x);
}

// Copies the first n_bits bits of src (whole bytes, the bits past n_bits 0) to dst from bit `shift` of dst[0]
// (shift < 8): dst[0]'s bits below `shift` are kept (or-ed into: they belong to the codes before), every later byte
// up to the last one holding a copied bit is written whole (its bits past the copy 0). In parallel over bytes.
[[maybe_unused]] void copy_packed(const uint8_t* src, int64_t n_bits, int shift, uint8_t* dst) {
  const int64_t n = (n_bits + 7) / 8;  // bytes of src
  if (shift == 0) {
    at::parallel_for(0, n, kBlock, [&](int64_t b, int64_t e) { std::memcpy(dst + b, src + b, e - b); });
    return;
  }
  const int64_t m = (n_bits + shift + 7) / 8;  // bytes of dst touched
  dst[0] |= static_cast<uint8_t>(src[0] << shift);
  at::parallel_for(1, m, kBlock, [&](int64_t b, int64_t e) {
    for (int64_t k = b; k < e; ++k)
      dst[k] = static_cast<uint8_t>((src[k - 1] >> (8 - shift)) | (k < n ? src[k] << shift : 0));
  });
}

}  // namespace
}  // namespace dgc_cpu
