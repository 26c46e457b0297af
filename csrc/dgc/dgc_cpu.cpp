// Fused CPU kernels of deepspeed_dgc (OpenMP). The PyTorch reference in
// deepspeed_dgc/codec/reference.py is the oracle: for the same inputs and sample these functions give
// the same selection, the same payload bytes and the same residual bits.
//
// compress_bucket: one read of every gradient and residual element and one write of the new
//   residual (residual += grad, threshold compare, compaction of the kept elements; a tensor sent
//   whole is coded in the same pass); then, on the kept elements only (about density * n), group
//   scales, codes, bit packing, varint index gaps, the payload of every owner row and the residual's
//   quantization error.
// decode_add: parse one payload body and scatter-add its dequantized values into a dense
//   fp32 partition.
// topk_threshold: DGC's sampled top-k threshold (Lin et al., ICLR 2018, section 3 and appendix).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <type_traits>
#include <utility>
#include <stdexcept>
#include <string>
#include <vector>

#ifdef __linux__
#include <sys/mman.h>
#endif

#include "dgc_math.h"

// AVX2 intrinsics in functions built for AVX2 (target attribute) and called where the CPU has it: GCC on x86-64
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define DGC_X86_AVX2_PATHS 1
#include <immintrin.h>
#endif

// The passes over every element are built twice on x86-64 where the build's own target lacks AVX2 (the prebuilt op
// is portable: x86-64-v2): once for the target and once for AVX2, picked at load time by the CPU (GCC's
// target_clones). Both round every operation the same (IEEE, no contraction: -ffp-contract=off), only the vectors
// are wider.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__AVX2__)
#define DGC_SIMD_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define DGC_SIMD_CLONES
#endif

namespace {

constexpr int64_t kBlock = 1 << 15;  // elements per block of work (and the dense pass's tasks are multiples of it)
constexpr int64_t kTask = 1 << 18;   // the most elements per task of the dense pass (make_tasks)
constexpr int64_t kPiece = 1 << 10;  // elements the dense pass carries from one step to the next in L1
constexpr int64_t kBinnedAtLeast = 4096;  // values from which a k-th largest is found by bins
constexpr int64_t kAhead = 128;      // samples ahead whose lines the threshold sample's loop prefetches
constexpr double kUpperSlack = 1.3;
constexpr double kLowerSlack = 0.8;
constexpr float kLowerFactor = 0.8f;
constexpr int kMaxLowerRounds = 10;

struct Spec {
  // source element (r, j) of tensor i lives at src[offset + r * stride + j]
  const void* src = nullptr;
  at::ScalarType dtype = at::kFloat;
  int64_t offset = 0, stride = 0;
  const float* residual = nullptr;  // element (r, j) at residual[r * c + j]; null: none
  float* residual_out = nullptr;
  int64_t residual_numel = 0;
  int64_t n = 0, c = 0, col = 0;
  bool sparse = false;
  int64_t k = 0;
  const int64_t* sample = nullptr;  // indices into the real elements (row-major); null: all of them
  int64_t n_sample = 0;
  std::vector<int64_t> real;        // real elements of each row
  std::vector<int64_t> real_prefix; // exclusive prefix sums of real
  int64_t m = 0;                    // real elements in all rows
};

struct Params {
  float divisor;
  bool divide;
  // 1 / divisor where the divisor is a power of two (a world size of 2, 4, 8..., a loss scale), else 0: then x *
  // inverse is x / divisor exactly (the same real number, rounded once), and a multiply costs less than a division
  float inverse = 0.0f;
};

template <typename T>
inline float src_value(const Spec& t, int64_t r, int64_t j) {
  return static_cast<float>(static_cast<const T*>(t.src)[t.offset + r * t.stride + j]);
}

template <typename T>
inline float acc_at(const Spec& t, const Params& p, int64_t r, int64_t j) {
  float s = src_value<T>(t, r, j);
  if (t.residual == nullptr) return p.divide ? s / p.divisor : s;
  return dgc::accumulate(s, p.divisor, p.divide, t.residual[r * t.c + j]);
}

template <typename F>
inline void dispatch_dtype(at::ScalarType dtype, F&& f) {
  switch (dtype) {
    case at::kFloat: f(float()); break;
    case at::kBFloat16: f(c10::BFloat16()); break;
    case at::kHalf: f(c10::Half()); break;
    default: throw std::invalid_argument(std::string("dgc: unsupported gradient dtype ") + c10::toString(dtype));
  }
}

// Magnitude bins for the radix select: the top 12 bits of a float (sign, exponent, 3 mantissa bits; the bits of
// floats >= +0 order as their values)
constexpr int kBinShift = 20;
constexpr int64_t kBins = int64_t(1) << (32 - kBinShift);
using Bins = std::vector<int64_t>;

// The k-th largest (1-based) of magnitudes v (sign bits clear, no NaN) from hist, v's count per bin: the bin that
// holds it, then nth_element on that bin's values only (about 10x faster than nth_element on all of 168K sampled
// magnitudes).
float kth_in_bins(const std::vector<float>& v, int64_t k, const Bins& hist) {
  int64_t above = 0, bin = static_cast<int64_t>(hist.size()) - 1;
  for (; bin > 0 && above + hist[bin] < k; --bin) above += hist[bin];
  std::vector<float> in_bin;
  in_bin.reserve(hist[bin]);
  for (float x : v)
    if ((dgc::f32_bits(x) >> kBinShift) == static_cast<uint32_t>(bin)) in_bin.push_back(x);
  std::nth_element(in_bin.begin(), in_bin.begin() + (k - above - 1), in_bin.end(), std::greater<float>());
  return in_bin[k - above - 1];
}

// k-th largest of v (1-based), as torch.topk(v, k).values.min(). Magnitudes take kth_in_bins; anything else, or few
// values, takes nth_element on all of v.
float kth_largest(std::vector<float>& v, int64_t k) {
  const int64_t n = static_cast<int64_t>(v.size());
  if (n >= kBinnedAtLeast) {
    Bins hist(kBins, 0);
    uint32_t any_sign_or_nan = 0;
    for (float x : v) {
      const uint32_t b = dgc::f32_bits(x);
      any_sign_or_nan |= (b >> 31) | (b > UINT32_C(0x7F800000));
      ++hist[b >> kBinShift];
    }
    if (!any_sign_or_nan) return kth_in_bins(v, k, hist);
  }
  std::nth_element(v.begin(), v.begin() + (k - 1), v.end(), std::greater<float>());
  return v[k - 1];
}

// std::allocator but for resize(), which leaves the new elements uninitialised: for arrays written in full next
template <typename V>
struct NoInit : std::allocator<V> {
  template <typename U>
  struct rebind {
    using other = NoInit<U>;
  };
  using std::allocator<V>::allocator;
  template <typename U, typename... A>
  void construct(U* q, A&&... a) {
    ::new (static_cast<void*>(q)) U(std::forward<A>(a)...);
  }
  template <typename U>
  void construct(U* q) noexcept {
    ::new (static_cast<void*>(q)) U;
  }
};

// The kept elements of one tensor in one row: columns j and accumulated values. `all`: every real element is
// kept (a tensor sent whole, or k >= m), j is implicit (x) and acc was written in place by the dense pass.
// kept elements (rare among many) are compacted into acc; a row sent whole is accumulated in place: straight into
// its slot of the new residual (`ext`, overwritten by acc - decoded when it is coded) or into `whole`.
struct Kept {
  std::vector<int64_t, NoInit<int64_t>> j;
  std::vector<float, NoInit<float>> acc;
  int64_t gap_bytes = 0;  // varint bytes of the gaps between consecutive columns of j (j[x] - j[x - 1] - 1, x >= 1)
  bool all = false;
  std::shared_ptr<float[]> whole;  // uninitialised: every element is written by the dense pass
  float* ext = nullptr;
  int64_t n_all = 0;
  // A row sent whole and coded by the dense pass itself (`pre`): each scale group's scale and whether it mixes
  // zeros and non-zeros; the codes as sent, one byte each (FP8) or packed (INT4/INT2/INT1: formats.pack_bits, the
  // first value in the low bits of byte 0); and for INT2/INT1's zero bitmaps, bit x % 8 of nonzero[x / 8] set where
  // value x is non-zero. ext then holds the new residual (acc - sent) instead of acc.
  bool pre = false;
  std::vector<float> gscale;
  std::vector<uint8_t> gmixed;
  std::shared_ptr<uint8_t[]> codes;
  std::shared_ptr<uint8_t[]> nonzero;
  int64_t size() const { return all ? n_all : static_cast<int64_t>(acc.size()); }
  // appends column c, value a (c after the last column)
  void push(int64_t c, float a) {
    if (!j.empty()) gap_bytes += dgc::varint_length(static_cast<uint64_t>(c - j.back() - 1));
    j.push_back(c);
    acc.push_back(a);
  }
  int64_t col(int64_t x) const { return all ? x : j[x]; }
  const float* values() const { return all ? ext : acc.data(); }
};

struct Task {
  int64_t i, r, j0, j1;
};

// Number of real elements of tensor t with |acc| >= thr.
int64_t count_at_least(const Spec& t, const Params& p, float thr) {
  int64_t total = 0;
  dispatch_dtype(t.dtype, [&](auto tag) {
    using T = decltype(tag);
    for (size_t r = 0; r < t.real.size(); ++r) {
      int64_t rr = static_cast<int64_t>(r);
      total += at::parallel_reduce(0, t.real[r], kBlock, int64_t(0), [&](int64_t b, int64_t e, int64_t ident) {
        int64_t cnt = ident;
        for (int64_t j = b; j < e; ++j) cnt += std::fabs(acc_at<T>(t, p, rr, j)) >= thr;
        return cnt;
      }, std::plus<int64_t>());
    }
  });
  return total;
}

// acc of elements [j0, j1) of row r into buf, and how many of them are Inf or NaN (vectorizable loops: the branches
// are hoisted; the count costs nothing in a pass bound by memory).
template <typename T>
DGC_SIMD_CLONES int64_t accumulate_block(const Spec& t, const Params& p, int64_t r, int64_t j0, int64_t j1,
                                         float* __restrict buf) {
  const T* __restrict s = static_cast<const T*>(t.src) + t.offset + r * t.stride + j0;
  const int64_t len = j1 - j0;
  const float d = p.divisor;
  const float* __restrict res = t.residual ? t.residual + r * t.c + j0 : nullptr;
  int64_t nonfinite = 0;
  auto run = [&](auto acc_of) {
    for (int64_t x = 0; x < len; ++x) {
      const float a = acc_of(x);
      buf[x] = a;
      nonfinite += !(std::fabs(a) <= FLT_MAX);
    }
  };
  const float inv = p.inverse;
  if (res == nullptr) {
    if (p.divide && inv != 0.0f)
      run([&](int64_t x) { return static_cast<float>(s[x]) * inv; });
    else if (p.divide)
      run([&](int64_t x) { return static_cast<float>(s[x]) / d; });
    else
      run([&](int64_t x) { return static_cast<float>(s[x]); });
  } else if (p.divide && inv != 0.0f) {
    run([&](int64_t x) { return static_cast<float>(s[x]) * inv + res[x]; });
  } else if (p.divide) {
    run([&](int64_t x) { return static_cast<float>(s[x]) / d + res[x]; });
  } else {
    run([&](int64_t x) { return static_cast<float>(s[x]) + res[x]; });
  }
  return nonfinite;
}

// A threshold sample: |acc| of every sampled real element (or of all real elements), the largest of their bits
// (above FLT_MAX's: an Inf or NaN among them) and, from kBinnedAtLeast values on, their count per magnitude bin.
struct Sample {
  std::vector<float> mags;
  uint32_t max_bits = 0;
  Bins hist;
};

// The sample of tensor t, in one parallel pass. A run of consecutive positions within one row is accumulated by one
// accumulate_block call (vectorized; the samples of large tensors come in runs of 16).
// Throws std::out_of_range for a sampled position outside [0, t.m).
Sample sample_magnitudes(const Spec& t, const Params& p) {
  const int64_t ns = t.sample ? t.n_sample : t.m;
  Sample out;
  out.mags.resize(ns);
  const int64_t R = static_cast<int64_t>(t.real.size());
  // one chunk per thread, each with its own bins (merged after)
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), (ns + 4095) / 4096));
  const bool binned = ns >= kBinnedAtLeast;
  std::vector<Bins> hists(chunks, Bins(binned ? kBins : 0, 0));
  std::vector<uint32_t> max_bits(chunks, 0);
  dispatch_dtype(t.dtype, [&](auto tag) {
    using T = decltype(tag);
    auto row_of = [&](int64_t idx) {
      return std::upper_bound(t.real_prefix.begin(), t.real_prefix.begin() + R, idx) - t.real_prefix.begin() - 1;
    };
    at::parallel_for(0, chunks, 1, [&](int64_t cb, int64_t ce) {  // random reads: overlap their cache misses
      for (int64_t c = cb; c < ce; ++c) {
        const int64_t b = ns * c / chunks, e = ns * (c + 1) / chunks;
        float* mags = out.mags.data();
        for (int64_t s = b; s < e;) {
          if (t.sample && s + kAhead < e) {  // the reads of a later sample started now: more misses in flight
            const int64_t ahead = t.sample[s + kAhead];
            if (ahead >= 0 && ahead < t.m) {
              const int64_t ra = row_of(ahead), ja = ahead - t.real_prefix[ra];
              __builtin_prefetch(static_cast<const T*>(t.src) + t.offset + ra * t.stride + ja);
              if (t.residual) __builtin_prefetch(t.residual + ra * t.c + ja);
            }
          }
          const int64_t idx = t.sample ? t.sample[s] : s;
          if (idx < 0 || idx >= t.m) throw std::out_of_range("dgc: sample index out of range");
          const int64_t r = row_of(idx), j = idx - t.real_prefix[r];
          // the run of consecutive positions from here within row r (sample_indices draws runs of 16 on large
          // tensors): its acc as the dense pass computes it (the same numbers as acc_at), in one vectorized call
          int64_t len = 1;
          if (t.sample)
            while (s + len < e && t.sample[s + len] == idx + len && j + len < t.real[r]) ++len;
          else
            len = std::min(e - s, t.real[r] - j);
          if (len == 1) mags[s] = acc_at<T>(t, p, r, j);
          else accumulate_block<T>(t, p, r, j, j + len, mags + s);
          s += len;
        }
        uint32_t top = 0;
        Bins& hist = hists[c];
        for (int64_t s = b; s < e; ++s) {
          const float m = std::fabs(mags[s]);
          mags[s] = m;
          const uint32_t bits = dgc::f32_bits(m);
          top = std::max(top, bits);
          if (binned) ++hist[bits >> kBinShift];
        }
        max_bits[c] = top;
      }
    });
  });
  out.max_bits = *std::max_element(max_bits.begin(), max_bits.end());
  if (binned) {
    out.hist = std::move(hists[0]);
    for (int64_t c = 1; c < chunks; ++c)
      for (size_t x = 0; x < out.hist.size(); ++x) out.hist[x] += hists[c][x];
  }
  return out;
}

// Appends column j0 + x and value a[x] to out if |a[x]| >= thr (never for a NaN).
inline void keep_at_least(const float* a, int64_t x, float thr, int64_t j0, Kept& out) {
  if (std::fabs(a[x]) >= thr) {
    out.push(j0 + x, a[x]);
  }
}

// Appends the columns j0 + x and values of a[0, len) with |a[x]| >= thr to out (rare: about the density). A filter
// first, 16 elements at a time: the largest magnitude's bits against thr's, an unsigned integer max (which vectorizes;
// a float max does not without -ffast-math). For magnitudes and a threshold >= +0 the bits order as the values, so the
// filter passes every block holding a kept element (and a NaN, which the exact test then drops).
DGC_SIMD_CLONES void compact_at_least(const float* __restrict a, int64_t len, float thr, int64_t j0, Kept& out) {
  typedef uint32_t __attribute__((may_alias)) bits_t;
  const bits_t* __restrict u = reinterpret_cast<const bits_t*>(a);
  const uint32_t thr_bits = thr > 0.0f ? dgc::f32_bits(thr) : 0u;
  auto take = [&](int64_t x0, int64_t x1) {
    for (int64_t x = x0; x < x1; ++x) keep_at_least(a, x, thr, j0, out);
  };
  int64_t x0 = 0;
  for (; x0 + 16 <= len; x0 += 16) {
    uint32_t m = 0;
    for (int k = 0; k < 16; ++k) {
      const uint32_t b = u[x0 + k] & UINT32_C(0x7FFFFFFF);
      m = m > b ? m : b;
    }
    if (m >= thr_bits) take(x0, x0 + 16);
  }
  take(x0, len);
}

#ifdef DGC_X86_AVX2_PATHS
// the sign bits of 8 int32 lanes (all ones or zero each) as bits 0-7
__attribute__((target("avx2"))) inline uint32_t mask_of(__m256i m) {
  return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_castsi256_ps(m)));
}

// compact_at_least with AVX2 where the CPU has it: 16 magnitudes' bits against thr's per step by two signed compares
// (both are in [0, 2^31)) and a movemask, then only the set bits are visited, in order: no horizontal max and no
// branch per element. The same elements in the same order as compact_at_least.
__attribute__((target("avx2"))) void compact_at_least_avx2(const float* __restrict a, int64_t len, float thr,
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
__attribute__((target("avx2"))) void stream_copy(float* __restrict dst, const float* __restrict src, int64_t n) {
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
__attribute__((target("avx2"))) int64_t int8_to_bf16_avx2(const uint8_t* __restrict c, float scale,
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

// How the dense pass codes a row sent whole while its block is in cache: value format and scale group size.
struct PreEncode {
  int fmt;
  int64_t group_size;
};

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
void copy_packed(const uint8_t* src, int64_t n_bits, int shift, uint8_t* dst) {
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

#ifdef DGC_X86_AVX2_PATHS
// the largest of 8 int32 lanes
__attribute__((target("avx2"))) inline int32_t hmax_epi32(__m256i v) {
  __m128i m = _mm_max_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  m = _mm_max_epi32(m, _mm_shuffle_epi32(m, 0x4E));
  return _mm_cvtsi128_si32(_mm_max_epi32(m, _mm_shuffle_epi32(m, 0xB1)));
}

// acc of n elements (the operations of accumulate_block: s * inverse or s / divisor, then + res) into buf, with AVX2,
// n a multiple of gs and gs of 16; per scale group k of gs elements, gmax[k] = the largest of its magnitudes' bits
// (an integer max: above FLT_MAX's 0x7F7FFFFF only where an acc is not finite, else the bits of its absmax) and,
// where Masked (INT2, INT1), gnz[k] = its count of non-zero values.
template <typename T, int Mode, bool Masked>  // Mode 0: s, 1: s * inverse, 2: s / divisor
__attribute__((target("avx2"))) void accumulate_groups_avx2(const T* __restrict s, const float* __restrict res,
                                                            const Params& p, float* __restrict buf, int64_t n,
                                                            int64_t gs, int32_t* gmax, int32_t* gnz) {
  const __m256 vinv = _mm256_set1_ps(p.inverse), vd = _mm256_set1_ps(p.divisor), zero = _mm256_setzero_ps();
  const __m256i abs_bits = u32(0x7FFFFFFF);
  for (int64_t k = 0, x = 0; x < n; ++k) {
    __m256i m0 = _mm256_setzero_si256(), m1 = _mm256_setzero_si256();
    int32_t nz = 0;
    for (const int64_t end = x + gs; x < end; x += 16) {
      const __m256 a0 = acc8_avx2<Mode>(s + x, res ? res + x : nullptr, vinv, vd);
      const __m256 a1 = acc8_avx2<Mode>(s + x + 8, res ? res + x + 8 : nullptr, vinv, vd);
      _mm256_storeu_ps(buf + x, a0);
      _mm256_storeu_ps(buf + x + 8, a1);
      m0 = _mm256_max_epi32(m0, _mm256_and_si256(_mm256_castps_si256(a0), abs_bits));
      m1 = _mm256_max_epi32(m1, _mm256_and_si256(_mm256_castps_si256(a1), abs_bits));
      if (Masked)
        nz += __builtin_popcount(static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(a0, zero, _CMP_NEQ_UQ))) |
                                 static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(a1, zero, _CMP_NEQ_UQ))) << 8);
    }
    gmax[k] = hmax_epi32(_mm256_max_epi32(m0, m1));
    if (Masked) gnz[k] = nz;
  }
}

// The 32 code bytes b of values j .. j + 31 of a row sent whole (j a multiple of 32) where encode_block puts them:
// FP8's as they are into dst.codes, narrower ones packed (with INT2/INT1's non-zero marks into dst.nonzero)
template <int F>
__attribute__((target("avx2"))) inline void put_codes_avx2(__m256i b, int64_t j, Kept& dst) {
  constexpr int bits = dgc::format_bits(F);
  if constexpr (bits == 8) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst.codes.get() + j), b);
  else pack32_avx2<bits>(b, dst.codes.get() + j * bits / 8, dgc::zero_masked(F) ? dst.nonzero.get() + j / 8 : nullptr);
}

// Codes the n values of buf (n a multiple of gs, gs of 32; columns j0 + x of a row sent whole, j0 a multiple of gs)
// as encode_block codes them, from accumulate_groups_avx2's statistics of their finite values: each group's scale
// into dst.gscale (and INT2/INT1's mixed flag into dst.gmixed), the codes into dst.codes (FP8: a byte each; else
// packed, with INT2/INT1's non-zero marks into dst.nonzero) and the new residual (acc - decoded) into res[0, n), with
// non-temporal stores where `stream` (res 32-byte aligned). A group of scale <= 0 (all zeros) takes encode_value.
template <int F>
__attribute__((target("avx2"))) void code_groups_avx2(const float* __restrict buf, int64_t n, int64_t gs, int64_t j0,
                                                      const int32_t* gmax, const int32_t* gnz, float* __restrict res,
                                                      bool stream, Kept& dst) {
  constexpr bool masked = F == dgc::kInt2 || F == dgc::kInt1;
  const uint8_t sat = dgc::e4m3_saturated_code();
  float sums[kPiece / 32];  // INT1: the magnitude sums of the piece's groups, in value order (group_mag_sums)
  const int64_t summed = F == dgc::kInt1 ? group_mag_sums(buf, n, gs, sums) : 0;
  for (int64_t x = 0, k = 0, g = j0 / gs; x < n; ++k, ++g) {
    float mag_sum = 0.0f;
    if (F == dgc::kInt1 && k < summed) mag_sum = sums[k];
    else if (F == dgc::kInt1)
      for (int64_t y = x; y < x + gs; ++y) mag_sum += std::fabs(buf[y]);
    const int64_t nonzero = masked ? gnz[k] : gs;
    const float scale = value_group_scale(F, buf + x, gs, dgc::f32_from_bits(static_cast<uint32_t>(gmax[k])), mag_sum,
                                          static_cast<float>(nonzero));
    dst.gscale[g] = scale;
    if (masked) dst.gmixed[g] = nonzero < gs && scale > 0.0f;
    const __m256 s = _mm256_set1_ps(scale);
    const int64_t end = x + gs;
    if ((F == dgc::kInt1 || scale > 0.0f) && stream)
      for (; x < end; x += 32) put_codes_avx2<F>(code32_avx2<F, true>(buf + x, s, sat, res + x), j0 + x, dst);
    else if (F == dgc::kInt1 || scale > 0.0f)
      for (; x < end; x += 32) put_codes_avx2<F>(code32_avx2<F, false>(buf + x, s, sat, res + x), j0 + x, dst);
    else  // an all-zero group
      for (; x < end; x += 32) {
        alignas(32) uint8_t c32[32];
        for (int y = 0; y < 32; ++y) {
          const float v = buf[x + y];
          uint8_t c;
          res[x + y] = v - dgc::encode_value(F, v, scale, &c);
          c32[y] = masked ? static_cast<uint8_t>(c | ((v != 0.0f) << 7)) : c;
        }
        put_codes_avx2<F>(_mm256_load_si256(reinterpret_cast<const __m256i*>(c32)), j0 + x, dst);
      }
  }
}

// A row sent whole's block [j0, j0 + len) in one pass with AVX2 (fp32 and bf16 sources, groups of a multiple of 32
// values): per piece of whole scale groups, acc into an L1 buffer with each group's absmax (accumulate_groups_avx2),
// then codes and the new residual straight into res (code_groups_avx2). Where accumulate_block, encode_block (its
// absmax, zero counts, codes and packing passes) and stream_copy pass a piece through L1 five times or more, this
// passes it twice. Returns the count of non-finite acc found (then nothing more is coded: the caller gives up the
// bucket) and in *done the elements coded (whole groups; the caller codes the rest); -1 where it does not apply.
template <typename T, int F>
__attribute__((target("avx2"))) int64_t accumulate_encode_avx2(const T* __restrict s, const float* __restrict rs,
                                                               const Params& p, float* __restrict res, int64_t len,
                                                               int64_t j0, int64_t gs, float* buf, Kept& dst,
                                                               int64_t* done) {
  if constexpr (!std::is_same<T, float>::value && !std::is_same<T, c10::BFloat16>::value) {
    return -1;
  } else {
    if (gs % 32 != 0) return -1;
    constexpr bool masked = F == dgc::kInt2 || F == dgc::kInt1;
    const int64_t piece = std::max(kPiece, gs), whole = len / gs * gs;
    const bool stream = (reinterpret_cast<uintptr_t>(res) & 31) == 0;
    int32_t gmax[kPiece / 32], gnz[kPiece / 32];
    for (int64_t x0 = 0; x0 < whole; x0 += piece) {
      const int64_t n = std::min(piece, whole - x0);
      const T* sx = s + x0;
      const float* rx = rs ? rs + x0 : nullptr;
      if (!p.divide) accumulate_groups_avx2<T, 0, masked>(sx, rx, p, buf, n, gs, gmax, gnz);
      else if (p.inverse != 0.0f) accumulate_groups_avx2<T, 1, masked>(sx, rx, p, buf, n, gs, gmax, gnz);
      else accumulate_groups_avx2<T, 2, masked>(sx, rx, p, buf, n, gs, gmax, gnz);
      if (*std::max_element(gmax, gmax + n / gs) > 0x7F7FFFFF) {  // not finite: the bucket is given up
        stream_fence();
        return 1;
      }
      code_groups_avx2<F>(buf, n, gs, j0 + x0, gmax, gnz, res + x0, stream, dst);
    }
    stream_fence();  // the streamed residual is seen by every thread after it
    *done = whole;
    return 0;
  }
}
#else
template <typename T, int F>
inline int64_t accumulate_encode_avx2(const T*, const float*, const Params&, float*, int64_t, int64_t, int64_t,
                                      float*, Kept&, int64_t*) {
  return -1;
}
#endif

// The dense pass over one block: acc, residual write (acc), compaction of |acc| >= thr.
// With `direct` (every element kept): acc goes straight to direct[j0, j1), nothing is compacted; and with
// `pre` (set for rows whose out.pre is on) the block is coded at once (encode_block) where it is finite.
// The block is worked through in pieces that stay in L1 between accumulation and compaction or coding; where acc goes
// to the new residual and the CPU has AVX2, each piece is made in a scratch buffer and streamed to the residual with
// non-temporal stores (the residual's lines are not read from memory first: about 10% of the pass at 16M elements).
template <typename T>
int64_t dense_block(const Spec& t, const Params& p, int64_t r, int64_t j0, int64_t j1, float thr, Kept& out,
                    bool write_residual, float* direct, const PreEncode* pre) {
  // acc goes to `direct`, else straight into the new residual (which is acc where nothing is sent), else a buffer
  thread_local std::vector<float> buf, scratch;
  float* res = write_residual && t.residual_out ? t.residual_out + r * t.c + j0 : nullptr;
  float* a = direct ? direct + j0 : res;
  const int64_t len = j1 - j0;
  // pieces of whole scale groups when coding (the group size divides kBlock, so it is a power of two)
  const int64_t piece = pre ? std::max<int64_t>(kPiece, pre->group_size) : kPiece;
  const bool into_buf = a == nullptr;  // acc is only compacted: each piece into one L1 buffer
  if (into_buf) {
    buf.resize(piece);
    a = buf.data();
  }
  const bool stream = kHaveAvx2 && res != nullptr && a == res;
  if (!direct && t.m > 0) {  // room for 1.5 times the block's expected share of the k kept, so that appending
    const int64_t expect = static_cast<int64_t>(1.5 * static_cast<double>(t.k) / t.m * len) + 64;  // seldom grows
    out.j.reserve(out.j.size() + expect);
    out.acc.reserve(out.acc.size() + expect);
  }
  const T* s = static_cast<const T*>(t.src) + t.offset + r * t.stride + j0;  // the block's sources and residual
  const float* rs = t.residual ? t.residual + r * t.c + j0 : nullptr;
  if (stream && !direct) {  // a sparse row into the new residual: one loop (fp32 and bf16 sources)
    const int64_t bad = !p.divide ? accumulate_compact_avx2<T, 0>(s, rs, p, a, len, thr, j0, out)
                        : p.inverse != 0.0f ? accumulate_compact_avx2<T, 1>(s, rs, p, a, len, thr, j0, out)
                                            : accumulate_compact_avx2<T, 2>(s, rs, p, a, len, thr, j0, out);
    if (bad >= 0) {
      stream_fence();
      return bad;
    }
  }
  if (stream || (direct && pre)) scratch.resize(piece);
  int64_t nonfinite = 0, x_start = 0;
  if (kHaveAvx2 && direct && pre) {  // a row sent whole: whole groups in one pass (fp32 and bf16 sources)
    const int64_t gs = pre->group_size;
    float* buf = scratch.data();
    int64_t bad;
    switch (pre->fmt) {
      case dgc::kInt4: bad = accumulate_encode_avx2<T, dgc::kInt4>(s, rs, p, a, len, j0, gs, buf, out, &x_start); break;
      case dgc::kInt2: bad = accumulate_encode_avx2<T, dgc::kInt2>(s, rs, p, a, len, j0, gs, buf, out, &x_start); break;
      case dgc::kInt1: bad = accumulate_encode_avx2<T, dgc::kInt1>(s, rs, p, a, len, j0, gs, buf, out, &x_start); break;
      case dgc::kFp8E4M3:
        bad = accumulate_encode_avx2<T, dgc::kFp8E4M3>(s, rs, p, a, len, j0, gs, buf, out, &x_start);
        break;
      default: bad = accumulate_encode_avx2<T, dgc::kFp8E5M2>(s, rs, p, a, len, j0, gs, buf, out, &x_start); break;
    }
    if (bad > 0) return bad;  // (its streamed stores fenced)
  }
  for (int64_t x0 = x_start; x0 < len; x0 += piece) {
    const int64_t n = std::min(piece, len - x0);
    float* v = stream ? scratch.data() : into_buf ? a : a + x0;
    const int64_t bad = accumulate_block<T>(t, p, r, j0 + x0, j0 + x0 + n, v);
    nonfinite += bad;
    if (!direct) {
      if (kHaveAvx2) compact_at_least_avx2(v, n, thr, j0 + x0, out);
      else compact_at_least(v, n, thr, j0 + x0, out);
    } else if (pre && bad == 0) {  // a piece that is not finite is not coded: the whole bucket is given up
      switch (pre->fmt) {
        case dgc::kInt4: encode_block<dgc::kInt4>(v, n, j0 + x0, pre->group_size, out); break;
        case dgc::kInt2: encode_block<dgc::kInt2>(v, n, j0 + x0, pre->group_size, out); break;
        case dgc::kInt1: encode_block<dgc::kInt1>(v, n, j0 + x0, pre->group_size, out); break;
        case dgc::kFp8E4M3: encode_block<dgc::kFp8E4M3>(v, n, j0 + x0, pre->group_size, out); break;
        default: encode_block<dgc::kFp8E5M2>(v, n, j0 + x0, pre->group_size, out); break;
      }
    }
    if (stream) stream_copy(a + x0, v, n);
  }
  if (stream) stream_fence();  // before the pass returns
  return nonfinite;
}

// Runs the dense pass over `tasks`, returns the non-finite count; kept[i][r] gets the candidates.
// With `pre`, rows kept whole are coded in the same pass (their blocks must hold whole scale groups).
int64_t dense_pass(std::vector<Spec>& specs, const Params& p, const std::vector<Task>& tasks,
                   const std::vector<float>& thr, std::vector<std::vector<Kept>>& kept, bool write_residual,
                   const PreEncode* pre = nullptr) {
  if (pre && kBlock % pre->group_size != 0) pre = nullptr;
  std::vector<Kept> parts(tasks.size());
  std::vector<int64_t> nonfinite(tasks.size(), 0);
  for (const Task& task : tasks)  // tensors keeping every real element: acc written in place, j implicit
    if (thr[task.i] < 0.0f && !kept[task.i][task.r].all) {
      Kept& k = kept[task.i][task.r];
      const Spec& t = specs[task.i];
      k.all = true;
      k.n_all = t.real[task.r];
      if (write_residual && t.residual_out) {
        k.ext = t.residual_out + task.r * t.c;
      } else {
        k.whole.reset(new float[std::max<int64_t>(k.n_all, 1)]);
        k.ext = k.whole.get();
      }
      if (pre) {
        k.pre = true;
        const int64_t n_groups = (k.n_all + pre->group_size - 1) / pre->group_size;
        k.gscale.assign(n_groups, 0.0f);
        k.gmixed.assign(n_groups, 0);
        if (!k.codes)  // else the payload's bytes
          k.codes.reset(new uint8_t[std::max<int64_t>(dgc::packed_bytes(k.n_all, pre->fmt), 1)]);
        if (dgc::zero_masked(pre->fmt)) k.nonzero.reset(new uint8_t[std::max<int64_t>((k.n_all + 7) / 8, 1)]);
      }
    }
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t x = b; x < e; ++x) {
      const Task& task = tasks[x];
      const Spec& t = specs[task.i];
      Kept& dst = kept[task.i][task.r];
      float* direct = dst.all ? dst.ext : nullptr;
      dispatch_dtype(t.dtype, [&](auto tag) {
        using T = decltype(tag);
        nonfinite[x] = dense_block<T>(t, p, task.r, task.j0, task.j1, thr[task.i], direct ? dst : parts[x],
                                      write_residual, direct, direct && dst.pre ? pre : nullptr);
      });
    }
  });
  int64_t total = 0;
  for (int64_t bad : nonfinite) total += bad;
  // each task's candidates appended to its destination's in task order: where each part goes, one resize per
  // destination, then the copies in parallel (a serial append is a serial step of the whole bucket)
  // (and the varint bytes of each destination's gaps: the parts' own, and those from one part's last column to the
  // next part's first)
  std::vector<int64_t> at(tasks.size(), 0);
  std::vector<std::vector<int64_t>> end(kept.size()), last(kept.size());
  for (size_t i = 0; i < kept.size(); ++i)
    for (const Kept& dst : kept[i]) {
      end[i].push_back(static_cast<int64_t>(dst.j.size()));
      last[i].push_back(dst.j.empty() ? -1 : dst.j.back());
    }
  for (size_t x = 0; x < tasks.size(); ++x) {
    const Kept& part = parts[x];
    Kept& dst = kept[tasks[x].i][tasks[x].r];
    int64_t& e = end[tasks[x].i][tasks[x].r];
    at[x] = e;
    if (dst.all || part.j.empty()) continue;
    int64_t& prev = last[tasks[x].i][tasks[x].r];
    dst.gap_bytes += part.gap_bytes + (e ? dgc::varint_length(static_cast<uint64_t>(part.j[0] - prev - 1)) : 0);
    prev = part.j.back();
    e += static_cast<int64_t>(part.j.size());
  }
  for (size_t i = 0; i < kept.size(); ++i)
    for (size_t r = 0; r < kept[i].size(); ++r)
      if (!kept[i][r].all) {
        kept[i][r].j.resize(end[i][r]);
        kept[i][r].acc.resize(end[i][r]);
      }
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t x = b; x < e; ++x) {
      Kept& dst = kept[tasks[x].i][tasks[x].r];
      if (dst.all || parts[x].j.empty()) continue;
      std::memcpy(dst.j.data() + at[x], parts[x].j.data(), parts[x].j.size() * sizeof(int64_t));
      std::memcpy(dst.acc.data() + at[x], parts[x].acc.data(), parts[x].acc.size() * sizeof(float));
    }
  });
  return total;
}

// The dense pass's tasks over tensors `which`: each row in blocks of a multiple of kBlock elements, a quarter of
// one thread's even share of the pass, at most kTask. Fewer, longer tasks cost less than many of kBlock
// (results/kernels.md); four per thread or more keep the threads evenly loaded.
std::vector<Task> make_tasks(const std::vector<Spec>& specs, const std::vector<int64_t>& which) {
  int64_t total = 0;
  for (int64_t i : which) total += specs[i].m;
  const int64_t share = total / (4 * std::max(1, at::get_num_threads()));
  const int64_t step = std::min(kTask, std::max<int64_t>(1, share / kBlock) * kBlock);
  std::vector<Task> tasks;
  for (int64_t i : which) {
    const Spec& t = specs[i];
    for (size_t r = 0; r < t.real.size(); ++r)
      for (int64_t j0 = 0; j0 < t.real[r]; j0 += step)
        tasks.push_back({i, static_cast<int64_t>(r), j0, std::min(j0 + step, t.real[r])});
  }
  return tasks;
}

// Bytes of a row's payload: the header, scale_bytes of scales (and zero bitmap), n values of fmt packed, index_bytes
// of varint positions, padded to a multiple of 4.
int64_t payload_bytes(int64_t scale_bytes, int64_t n, int64_t fmt, int64_t index_bytes) {
  const int64_t bytes = 4 * dgc::kHeaderInt32 + scale_bytes + dgc::packed_bytes(n, static_cast<int>(fmt)) + index_bytes;
  return bytes + (4 - bytes % 4) % 4;
}

at::Tensor header_only_payload(int64_t fingerprint) {
  at::Tensor payload = at::empty({4 * dgc::kHeaderInt32}, at::kByte);
  int32_t* h = reinterpret_cast<int32_t*>(payload.data_ptr<uint8_t>());
  h[0] = dgc::kMagic;
  h[1] = static_cast<int32_t>(fingerprint);
  h[2] = h[3] = h[4] = 0;
  return payload;
}

}  // namespace

float topk_threshold(at::Tensor mag, int64_t k, at::Tensor sample) {
  TORCH_CHECK(mag.dim() == 1 && mag.scalar_type() == at::kFloat && mag.is_contiguous(), "mag: contiguous 1-D fp32");
  TORCH_CHECK(k >= 1 && k <= mag.numel(), "topk_threshold: k must be in [1, ", mag.numel(), "], got ", k);
  at::Tensor s = sample.numel() ? mag.index_select(0, sample) : mag;
  std::vector<float> v(s.data_ptr<float>(), s.data_ptr<float>() + s.numel());
  const int64_t m = mag.numel();
  int64_t ks = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(static_cast<double>(v.size() * k) / m)));
  float thr = kth_largest(v, ks);
  const float* x = mag.data_ptr<float>();
  auto count = [&](float t) {
    int64_t cnt = 0;
    for (int64_t i = 0; i < m; ++i) cnt += x[i] >= t;
    return cnt;
  };
  int64_t cnt = count(thr);
  for (int rounds = 0; cnt < kLowerSlack * k && rounds < kMaxLowerRounds; ++rounds) {
    thr = thr * kLowerFactor;
    cnt = count(thr);
  }
  if (cnt > kUpperSlack * k) {
    std::vector<float> kept;
    for (int64_t i = 0; i < m; ++i)
      if (x[i] >= thr) kept.push_back(x[i]);
    thr = kth_largest(kept, k);
  }
  return thr;
}

// New residuals of 32 MB or more come from here. glibc maps memory of that size afresh for each allocation (32 MB is
// its largest threshold), so each step's residual would fault in its 4 KB pages one by one as the dense pass first
// writes them, several times the cost of the pass itself (results/kernels.md).
// Freed buffers are kept, at most kKeep (past that the oldest freed is freed), and handed out again for the same
// size, the last freed first, as a caching allocator does on a GPU: a bucket's new residual takes the memory that
// the bucket before it freed. What this holds beyond the live residuals is at most kKeep freed buffers (the largest
// residuals' size each). They are 2 MB-aligned and advised for transparent huge pages (madvise
// MADV_HUGEPAGE: advice only, ignored where the kernel's THP setting is "never"). release_residual_cache() frees
// the kept ones.
class ResidualCache {
 public:
  static constexpr size_t kHuge = size_t(2) << 20;
  static constexpr size_t kFrom = 16 * kHuge;
  static constexpr size_t kKeep = 2;

  static ResidualCache& get() {
    static ResidualCache* cache = new ResidualCache();  // never destroyed: tensors may free into it at exit
    return *cache;
  }

  // uninitialised memory of `bytes` (>= kFrom). Throws std::bad_alloc when no memory is left.
  void* take(size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto it = kept_.rbegin(); it != kept_.rend(); ++it)  // the last freed first (warmest in cache)
        if (it->second == bytes) {
          void* q = it->first;
          kept_.erase(std::next(it).base());
          return q;
        }
    }
    void* q = nullptr;
    if (posix_memalign(&q, kHuge, bytes) != 0) throw std::bad_alloc();
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    madvise(q, bytes / kHuge * kHuge, MADV_HUGEPAGE);
#endif
    return q;
  }

  void give_back(void* q, size_t bytes) {
    void* drop = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      kept_.emplace_back(q, bytes);
      if (kept_.size() > kKeep) {
        drop = kept_.front().first;
        kept_.erase(kept_.begin());
      }
    }
    std::free(drop);
  }

  // frees every kept buffer; returns their bytes
  int64_t release() {
    std::vector<std::pair<void*, size_t>> all;
    {
      std::lock_guard<std::mutex> lock(mu_);
      all.swap(kept_);
    }
    int64_t bytes = 0;
    for (auto& [q, n] : all) {
      std::free(q);
      bytes += static_cast<int64_t>(n);
    }
    return bytes;
  }

 private:
  std::mutex mu_;
  std::vector<std::pair<void*, size_t>> kept_;  // oldest freed first
};

// An uninitialised fp32 tensor of n elements for a new residual (from ResidualCache from 32 MB on).
at::Tensor residual_empty(int64_t n) {
  const size_t bytes = static_cast<size_t>(n) * sizeof(float);
  if (bytes < ResidualCache::kFrom) return at::empty({n}, at::kFloat);
  void* q = ResidualCache::get().take(bytes);
  return at::from_blob(q, {n}, [bytes](void* x) { ResidualCache::get().give_back(x, bytes); },
                       at::TensorOptions().dtype(at::kFloat));
}

int64_t release_residual_cache() { return ResidualCache::get().release(); }

// acc = src / divisor + residual (the divisor holds the world size and the loss scale: everything here is in unscaled
// units). fixed[i] not < 0 (a NaN too, which keeps nothing): tensor i (if sparse) keeps |acc| >= fixed[i] instead of
// estimating a threshold from its sample, without DGC's corrections. reuse: the fixed thresholds are top-k thresholds
// of an earlier step (Ok-Topk's threshold reuse): they apply only where k < m, and more than 1.3 k kept still becomes
// the k largest. Returns the payloads, the new residuals, finiteness, the kept count and, per tensor, the threshold
// that selected it (-1: every real element was kept).
std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>, bool, int64_t, std::vector<double>> compress_bucket(
    std::vector<at::Tensor> srcs, std::vector<int64_t> offsets, std::vector<int64_t> strides,
    std::vector<at::Tensor> residuals, std::vector<int64_t> residual_numels, std::vector<int64_t> numels,
    std::vector<int64_t> chunks, std::vector<bool> sparse, std::vector<int64_t> row_owner, std::vector<int64_t> ks,
    std::vector<at::Tensor> samples, double divisor, int64_t group_size, int64_t fmt, int64_t fingerprint,
    bool want_residual, std::vector<double> fixed, bool reuse) {
  const size_t T = srcs.size();
  const int64_t R = static_cast<int64_t>(row_owner.size());
  TORCH_CHECK(offsets.size() == T && strides.size() == T && residuals.size() == T && residual_numels.size() == T &&
                  numels.size() == T && chunks.size() == T && sparse.size() == T && ks.size() == T &&
                  samples.size() == T && fixed.size() == T,
              "compress_bucket: per-tensor lists differ in length");
  TORCH_CHECK(group_size >= 2, "compress_bucket: group_size must be >= 2");
  TORCH_CHECK(fmt >= 0 && fmt < dgc::kNumValueFormats, "compress_bucket: unknown value format ", fmt);
  TORCH_CHECK(fingerprint >= 0 && fingerprint <= INT32_MAX, "compress_bucket: fingerprint must fit in an int31");
  TORCH_CHECK(divisor > 0, "compress_bucket: divisor must be > 0");
  Params p{static_cast<float>(divisor), divisor != 1.0};
  int exponent = 0;
  if (std::frexp(p.divisor, &exponent) == 0.5f && std::isnormal(1.0f / p.divisor)) p.inverse = 1.0f / p.divisor;

  std::vector<Spec> specs(T);
  std::vector<at::Tensor> res_out;
  int64_t col = 0;
  for (size_t i = 0; i < T; ++i) {
    Spec& t = specs[i];
    const at::Tensor& s = srcs[i];
    TORCH_CHECK(s.device().is_cpu() && s.dim() == 1 && s.is_contiguous(), "compress_bucket: sources must be contiguous 1-D CPU tensors");
    t.src = s.data_ptr();
    t.dtype = s.scalar_type();
    t.offset = offsets[i];
    t.stride = strides[i];
    t.n = numels[i];
    t.c = chunks[i];
    TORCH_CHECK(t.offset >= 0 && t.stride >= t.c && t.n >= 0 && t.c >= 0 && ks[i] >= 0,
                "compress_bucket: tensor ", i, ": offsets, chunks and ks must be >= 0 and row strides >= chunks");
    t.col = col;
    col += t.c;
    t.sparse = sparse[i];
    t.k = ks[i];
    int64_t prefix = 0;
    for (int64_t r = 0; r < R; ++r) {
      t.real.push_back(dgc::real_count(t.n, row_owner[r], t.c));
      t.real_prefix.push_back(prefix);
      prefix += t.real.back();
      TORCH_CHECK(t.real.back() == 0 || t.offset + r * t.stride + t.real.back() <= s.numel(),
                  "compress_bucket: tensor ", i, " row ", r, " reads past its source");
    }
    t.real_prefix.push_back(prefix);
    t.m = prefix;
    TORCH_CHECK(!t.sparse || t.m == 0 || t.k >= 1, "compress_bucket: tensor ", i, ": ks must be >= 1 when sparse");
    int64_t used = 0;  // residual elements the job touches: (r, j) at r * c + j for the real ones
    for (int64_t r = 0; r < R; ++r)
      if (t.real[r]) used = r * t.c + t.real[r];
    TORCH_CHECK(residual_numels[i] >= used && residual_numels[i] <= R * t.c, "compress_bucket: tensor ", i,
                ": residual_numels must be in [", used, ", ", R * t.c, "], got ", residual_numels[i]);
    if (residuals[i].numel()) {
      TORCH_CHECK(residuals[i].scalar_type() == at::kFloat && residuals[i].is_contiguous() &&
                      residuals[i].numel() == residual_numels[i],
                  "compress_bucket: residual ", i, " must be contiguous fp32 of ", residual_numels[i], " elements");
      t.residual = residuals[i].data_ptr<float>();
    }
    if (samples[i].numel()) {
      TORCH_CHECK(samples[i].scalar_type() == at::kLong && samples[i].is_contiguous(), "compress_bucket: samples must be int64");
      t.sample = samples[i].data_ptr<int64_t>();
      t.n_sample = samples[i].numel();
    }
    if (want_residual) {
      at::Tensor out = residual_empty(residual_numels[i]);
      t.residual_out = out.data_ptr<float>();
      t.residual_numel = residual_numels[i];
      res_out.push_back(out);
    }
  }

  // 1. thresholds: fixed ones, else from the samples (tensors sent whole keep every real element)
  std::vector<float> thr(T, -1.0f);
  for (size_t i = 0; i < T; ++i) {
    Spec& t = specs[i];
    if (t.sparse && !(fixed[i] < 0) && (!reuse || t.k < t.m)) {
      thr[i] = static_cast<float>(fixed[i]);
      continue;
    }
    if (!t.sparse || t.k >= t.m) continue;
    Sample smp = sample_magnitudes(t, p);
    if (smp.max_bits > UINT32_C(0x7F7FFFFF)) {  // an Inf or NaN
      thr[i] = INFINITY;  // the dense pass finds the non-finite value and aborts
      continue;
    }
    const int64_t n_sample = static_cast<int64_t>(smp.mags.size());
    int64_t ksample = std::max<int64_t>(
        1, static_cast<int64_t>(std::ceil(static_cast<double>(n_sample * t.k) / t.m)));
    thr[i] = smp.hist.empty() ? kth_largest(smp.mags, ksample) : kth_in_bins(smp.mags, ksample, smp.hist);
  }

  // 2. the dense pass: acc, new residual (acc), candidates |acc| >= thr
  std::vector<std::vector<Kept>> kept(T, std::vector<Kept>(R));
  // Buckets of FP8 or INT4 (no zero bitmap) with no sparse tensor (one keeping all its elements, k >= m, still sends
  // its positions): every tensor is sent whole, the payloads' sizes are known now, so they are allocated here and the
  // dense pass writes its codes straight into their value bytes (step 4 then copies nothing), each tensor's whose
  // codes start a byte (INT4: at an even value of the row)
  std::vector<at::Tensor> early(R);
  const int64_t per_byte = 8 / dgc::format_bits(fmt);
  if (!dgc::zero_masked(fmt) && std::none_of(specs.begin(), specs.end(), [](const Spec& t) { return t.sparse; }))
    for (int64_t r = 0; r < R; ++r) {
      int64_t n = 0, g = 0;
      for (const Spec& t : specs) {
        n += t.real[r];
        g += (t.real[r] + group_size - 1) / group_size;
      }
      early[r] = at::empty({payload_bytes(4 * g, n, fmt, 0)}, at::kByte);
      uint8_t* values = early[r].data_ptr<uint8_t>() + 4 * dgc::kHeaderInt32 + 4 * g;
      for (size_t i = 0, v0 = 0; i < T; v0 += specs[i].real[r], ++i)
        if (specs[i].real[r] && v0 % per_byte == 0)
          kept[i][r].codes = std::shared_ptr<uint8_t[]>(values + v0 / per_byte, [](uint8_t*) {});
    }
  std::vector<int64_t> all(T);
  for (size_t i = 0; i < T; ++i) all[i] = static_cast<int64_t>(i);
  const PreEncode pre{static_cast<int>(fmt), group_size};
  int64_t nonfinite = dense_pass(specs, p, make_tasks(specs, all), thr, kept, want_residual, &pre);
  if (nonfinite) {
    std::vector<at::Tensor> payloads;
    for (int64_t r = 0; r < R; ++r) payloads.push_back(header_only_payload(fingerprint));
    return {payloads, {}, false, 0, std::vector<double>(T, -1.0)};
  }
  if (want_residual)  // padding slots of an untrimmed residual (R * c elements) stay exactly 0
    for (auto& t : specs)
      for (int64_t r = 0; r < R; ++r)
        for (int64_t j = t.real[r]; j < t.c && r * t.c + j < t.residual_numel; ++j) t.residual_out[r * t.c + j] = 0.0f;

  // 3. DGC's corrections towards k: lower the threshold while fewer than 0.8 k are kept (then
  //    collect again), keep the k largest when more than 1.3 k are
  for (size_t i = 0; i < T; ++i) {
    Spec& t = specs[i];
    const bool is_fixed = t.sparse && !(fixed[i] < 0);
    if (!t.sparse || t.k >= t.m || (is_fixed && !reuse)) continue;
    int64_t cnt = 0;
    for (auto& kr : kept[i]) cnt += kr.size();
    if (cnt < kLowerSlack * t.k && !is_fixed) {
      float th = thr[i];
      for (int rounds = 0; cnt < kLowerSlack * t.k && rounds < kMaxLowerRounds; ++rounds) {
        th = th * kLowerFactor;
        cnt = count_at_least(t, p, th);
      }
      thr[i] = th;
      for (auto& kr : kept[i]) kr = Kept();
      std::vector<float> thr_i(T, INFINITY);
      thr_i[i] = th;
      dense_pass(specs, p, make_tasks(specs, {static_cast<int64_t>(i)}), thr_i, kept, false);
    }
    if (cnt > kUpperSlack * t.k) {
      std::vector<float> mags;
      for (auto& kr : kept[i])
        for (float a : kr.acc) mags.push_back(std::fabs(a));
      float th = kth_largest(mags, t.k);
      thr[i] = th;
      for (auto& kr : kept[i]) {
        Kept f;
        for (int64_t x = 0; x < kr.size(); ++x)
          if (std::fabs(kr.acc[x]) >= th) {
            f.push(kr.col(x), kr.acc[x]);
          }
        kr = std::move(f);
      }
    }
  }

  // 4. payloads. Per row: its scale groups (serially: where each starts), then every group's scale in parallel,
  //    then sizes and allocation; then codes and residuals in parallel over blocks of values (blocks of whole
  //    bytes, so no two tasks write one byte), and last, serially per row, the zero bitmap of INT2/INT1's mixed
  //    groups and the varint positions of the sparse tensors.
  const bool masked = dgc::zero_masked(fmt);
  const int bits = dgc::format_bits(fmt);
  struct Group {  // a sparse group's scale and whether it mixes zeros and non-zeros (INT2/INT1)
    float scale;
    bool mixed;
  };
  std::vector<int64_t> n_kept(R, 0), n_groups(R, 0), n_index(R, 0), mask_bits(R, 0), first_group(R + 1, 0);
  // segment s = r T + i: the groups of kept[i][r], from group seg_start[s] and value seg_v0[s] of the row
  std::vector<int64_t> seg_start(R * T + 1), seg_v0(R * T);
  int64_t total_groups = 0;
  for (int64_t r = 0; r < R; ++r) {
    first_group[r] = total_groups;
    int64_t prev = -1;
    for (size_t i = 0; i < T; ++i) {
      const Kept& kr = kept[i][r];
      const int64_t cnt = kr.size();
      seg_start[r * T + i] = total_groups;
      seg_v0[r * T + i] = n_kept[r];
      total_groups += (cnt + group_size - 1) / group_size;
      n_kept[r] += cnt;
      if (specs[i].sparse && cnt > 0) {  // varint bytes of the gaps: the first from the row's previous position
        n_index[r] += dgc::varint_length(static_cast<uint64_t>(specs[i].col + kr.col(0) - prev - 1));
        n_index[r] += kr.all ? cnt - 1 : kr.gap_bytes;  // (consecutive columns: a byte each)
        prev = specs[i].col + kr.col(cnt - 1);
      }
    }
    n_groups[r] = total_groups - first_group[r];
    TORCH_CHECK(n_kept[r] <= INT32_MAX && n_index[r] <= INT32_MAX, "compress_bucket: row ", r,
                " does not fit the int32 header (", n_kept[r], " values)");
  }
  first_group[R] = seg_start[R * T] = total_groups;
  // fn(sg, g0, g1) for the groups [g0, g1) of [b, e), one segment sg at a time (empty segments skipped)
  auto for_segments = [&](int64_t b, int64_t e, auto&& fn) {
    int64_t sg = std::upper_bound(seg_start.begin(), seg_start.end(), b) - seg_start.begin() - 1;
    for (int64_t gi = b; gi < e;) {
      while (gi >= seg_start[sg + 1]) ++sg;
      const int64_t g1 = std::min(e, seg_start[sg + 1]);
      fn(sg, gi, g1);
      gi = g1;
    }
  };
  auto kept_of = [&](int64_t sg) -> Kept& { return kept[sg % static_cast<int64_t>(T)][sg / static_cast<int64_t>(T)]; };
  // the values [x0, x1) of kept_of(sg) in group gi of segment sg (value seg_v0[sg] + x0 of the row on)
  auto range_of = [&](int64_t sg, int64_t gi) {
    const int64_t x0 = (gi - seg_start[sg]) * group_size;
    return std::make_pair(x0, std::min(x0 + group_size, kept_of(sg).size()));
  };
  // A record for each group of the segments the dense pass did not code (its statistics and scale made here); the
  // groups of rows sent whole (pre) keep theirs in kept[i][r].gscale and gmixed and are handled a segment at a time
  std::unique_ptr<Group[]> groups(new Group[std::max<int64_t>(total_groups, 1)]);  // those records written below
  at::parallel_for(0, total_groups, 256, [&](int64_t b, int64_t e) {
    for_segments(b, e, [&](int64_t sg, int64_t g0, int64_t g1) {
      const Kept& kr = kept_of(sg);
      if (kr.pre) return;
      const float* acc = kr.values();
      for (int64_t gi = g0; gi < g1; ++gi) {
        const auto [x0, x1] = range_of(sg, gi);
        float absmax = 0.0f, mag_sum = 0.0f, nonzero = 0.0f;
        bool has_zero = false;
        for (int64_t x = x0; x < x1; ++x) {
          const float mag = std::fabs(acc[x]);
          absmax = std::max(absmax, mag);
          mag_sum += mag;
          nonzero += mag > 0.0f;
          has_zero |= acc[x] == 0.0f;
        }
        const float scale = value_group_scale(static_cast<int>(fmt), acc + x0, x1 - x0, absmax, mag_sum, nonzero);
        groups[gi] = {scale, masked && has_zero && scale > 0.0f};
      }
    });
  });
  // fn(i, x0, x1) for each mixed group of row r in the row's order: the values [x0, x1) of kept[i][r]
  auto each_mixed = [&](int64_t r, auto&& fn) {
    for (size_t i = 0; i < T; ++i) {
      const int64_t sg = r * static_cast<int64_t>(T) + static_cast<int64_t>(i);
      const Kept& kr = kept[i][r];
      for (int64_t gi = seg_start[sg]; gi < seg_start[sg + 1]; ++gi)
        if (kr.pre ? kr.gmixed[gi - seg_start[sg]] != 0 : groups[gi].mixed) {
          const auto [x0, x1] = range_of(sg, gi);
          fn(i, x0, x1);
        }
    }
  };
  for (int64_t r = 0; r < R && masked; ++r)  // the bits of each row's zero bitmap
    each_mixed(r, [&](size_t, int64_t x0, int64_t x1) { mask_bits[r] += x1 - x0; });
  std::vector<at::Tensor> payloads;
  std::vector<int64_t> scale_words(R);
  std::vector<uint8_t*> bases(R);
  int64_t total_kept = 0;
  for (int64_t r = 0; r < R; ++r) {
    scale_words[r] = n_groups[r] + (mask_bits[r] + 31) / 32;
    TORCH_CHECK(scale_words[r] <= INT32_MAX, "compress_bucket: row ", r, " does not fit the int32 header (",
                n_kept[r], " values)");  // its values and index bytes were checked before the groups
    const int64_t bytes = payload_bytes(4 * scale_words[r], n_kept[r], fmt, n_index[r]);
    TORCH_CHECK(!early[r].defined() || early[r].numel() == bytes, "compress_bucket: internal error: row ", r,
                " was allocated ", early[r].numel(), " bytes before the dense pass, needs ", bytes);
    payloads.push_back(early[r].defined() ? early[r] : at::empty({bytes}, at::kByte));
    bases[r] = payloads[r].data_ptr<uint8_t>();
    // Every byte is written below but the zero bitmap and the bytes that packed codes of two tensors share (both
    // or-ed into) and the padding: those are zeroed here and before packing
    const int64_t mask_at = 4 * dgc::kHeaderInt32 + 4 * n_groups[r];
    const int64_t end = mask_at + 4 * (scale_words[r] - n_groups[r]) + dgc::packed_bytes(n_kept[r], fmt) + n_index[r];
    std::memset(bases[r] + mask_at, 0, 4 * (scale_words[r] - n_groups[r]));
    std::memset(bases[r] + end, 0, bytes - end);
    total_kept += n_kept[r];
    int32_t* header = reinterpret_cast<int32_t*>(bases[r]);
    header[0] = dgc::kMagic;
    header[1] = static_cast<int32_t>(fingerprint);
    header[2] = static_cast<int32_t>(n_kept[r]);
    header[3] = static_cast<int32_t>(n_index[r]);
    header[4] = static_cast<int32_t>(scale_words[r]);
  }
  auto scales_of = [&](int64_t r) { return reinterpret_cast<float*>(bases[r] + 4 * dgc::kHeaderInt32); };
  auto values_of = [&](int64_t r) { return bases[r] + 4 * dgc::kHeaderInt32 + 4 * scale_words[r]; };
  // zero bitmaps and varint positions (serially per row; before the codes, which overwrite an in-place acc)
  at::parallel_for(0, R, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      uint8_t* mask = reinterpret_cast<uint8_t*>(scales_of(r) + n_groups[r]);  // after the scales
      int64_t mb = 0;  // the next bit of the row's bitmap
      if (masked)
        each_mixed(r, [&](size_t i, int64_t x0, int64_t x1) {
          const Kept& kr = kept[i][r];
          if (kr.pre) {
            const uint8_t* nz = kr.nonzero.get();
            for (int64_t x = x0; x < x1; ++x, ++mb)
              mask[mb >> 3] |= static_cast<uint8_t>(((nz[x >> 3] >> (x & 7)) & 1) << (mb & 7));
            return;
          }
          const float* acc = kr.values();
          for (int64_t x = x0; x < x1; ++x, ++mb) mask[mb >> 3] |= static_cast<uint8_t>((acc[x] != 0.0f) << (mb & 7));
        });
      uint8_t* index = values_of(r) + dgc::packed_bytes(n_kept[r], fmt);
      uint8_t* const index_end = index + n_index[r];
      int64_t prev = -1;
      for (size_t i = 0; i < T; ++i) {
        const Spec& t = specs[i];
        const Kept& kr = kept[i][r];
        if (!t.sparse) continue;
        for (int64_t x = 0; x < kr.size(); ++x) {
          const int64_t j = kr.col(x);
          uint64_t gap = static_cast<uint64_t>(t.col + j - prev - 1);
          prev = t.col + j;
          if (gap < 16384 && index + 2 <= index_end) {  // one or two bytes without a branch: both written, the
            const bool two = gap >= 128;                 // second overwritten by the next varint where unused
            index[0] = static_cast<uint8_t>((gap & 0x7F) | (two ? 0x80 : 0));
            index[1] = static_cast<uint8_t>(gap >> 7);
            index += 1 + two;
            continue;
          }
          while (gap >= 128) {
            *index++ = static_cast<uint8_t>((gap & 0x7F) | 0x80);
            gap >>= 7;
          }
          *index++ = static_cast<uint8_t>(gap);
        }
      }
    }
  });
  // codes and residuals, in parallel over groups: 8-bit codes straight into the payload, narrower ones unpacked
  // into a scratch row first and packed after (a byte may hold the codes of two groups); codes the dense pass made
  // (rows sent whole) are packed from where it put them, with no copy
  std::vector<std::unique_ptr<uint8_t[]>> scratch(R);
  for (int64_t r = 0; r < R && bits < 8; ++r) {
    bool coded_here = false;
    for (size_t i = 0; i < T; ++i) coded_here |= !kept[i][r].pre && kept[i][r].size() > 0;
    if (coded_here) scratch[r].reset(new uint8_t[std::max<int64_t>(n_kept[r], 1)]);
  }
  auto encode_groups = [&](auto fmt_tag) {
    constexpr int F = decltype(fmt_tag)::value;
    const int64_t grain = std::max<int64_t>(1, kBlock / group_size);
    at::parallel_for(0, total_groups, grain, [&](int64_t b, int64_t e) {
      for_segments(b, e, [&](int64_t sg, int64_t g0, int64_t g1) {
        const int64_t r = sg / static_cast<int64_t>(T);
        float* scales = scales_of(r) + (g0 - first_group[r]);
        const Kept& kr = kept_of(sg);
        if (kr.pre) {  // codes made by the dense pass, residual written there too: only the scales, signed, and the
          const int64_t k0 = g0 - seg_start[sg];  // 8-bit codes (FP8: no zero mark) where not made in place (the
          for (int64_t k = k0; k < k0 + (g1 - g0); ++k)  // narrower ones are packed below)
            scales[k - k0] = kr.gmixed[k] ? -kr.gscale[k] : kr.gscale[k];
          const int64_t x0 = k0 * group_size, x1 = std::min((k0 + (g1 - g0)) * group_size, kr.size());
          if (bits == 8 && kr.codes.get() + x0 != values_of(r) + seg_v0[sg] + x0)
            std::memcpy(values_of(r) + seg_v0[sg] + x0, kr.codes.get() + x0, x1 - x0);
          return;
        }
        const Spec& t = specs[sg % static_cast<int64_t>(T)];
        const float* acc = kr.values();
        uint8_t* codes = (bits < 8 ? scratch[r].get() : values_of(r)) + seg_v0[sg];  // value x of kept_of(sg) at x
        float* res = t.residual_out ? t.residual_out + r * t.c : nullptr;
        for (int64_t gi = g0; gi < g1; ++gi) {
          const float scale = groups[gi].scale;
          scales[gi - g0] = groups[gi].mixed ? -scale : scale;
          const auto [x0, x1] = range_of(sg, gi);
          if (res && kr.all)  // columns are x: a loop without indirection
            for (int64_t x = x0; x < x1; ++x) {
              const float a = acc[x];
              res[x] = a - dgc::encode_value(F, a, scale, codes + x);
            }
          else
            for (int64_t x = x0; x < x1; ++x) {
              const float a = acc[x];
              const float decoded = dgc::encode_value(F, a, scale, codes + x);
              if (res) res[kr.col(x)] = a - decoded;
            }
        }
      });
    });
  };
  switch (fmt) {
    case dgc::kInt4: encode_groups(std::integral_constant<int, dgc::kInt4>()); break;
    case dgc::kInt2: encode_groups(std::integral_constant<int, dgc::kInt2>()); break;
    case dgc::kInt1: encode_groups(std::integral_constant<int, dgc::kInt1>()); break;
    case dgc::kFp8E4M3: encode_groups(std::integral_constant<int, dgc::kFp8E4M3>()); break;
    default: encode_groups(std::integral_constant<int, dgc::kFp8E5M2>()); break;
  }
  for (int64_t r = 0; r < R && bits < 8; ++r) {  // each tensor's codes in turn (neighbours may share a byte)
    const int64_t per = 8 / bits;
    uint8_t* values = values_of(r);
    int64_t v0 = 0;
    for (size_t i = 0; i < T; v0 += kept[i][r].size(), ++i) {
      const Kept& kr = kept[i][r];
      const int64_t cnt = kr.size();
      if (cnt == 0) continue;
      const int64_t first = v0 / per, last = (v0 + cnt - 1) / per;
      if (kr.pre) {  // packed by the dense pass: in place already, or copied (whole bytes; shifted where the
        if (kr.codes.get() != values + first)  // tensor starts inside a byte)
          copy_packed(kr.codes.get(), cnt * bits, (v0 % per) * bits, values + first);
        continue;
      }
      // packing or-s into the tensor's last byte (and into its first, shared with the tensor before, where it starts
      // inside a byte): the last byte is zeroed first unless it is that shared first byte
      if (v0 % per == 0 || last != first) values[last] = 0;
      const uint8_t* codes = scratch[r].get() + v0;
      if (bits == 4) pack_segment<4>(codes, cnt, v0, values);
      else if (bits == 2) pack_segment<2>(codes, cnt, v0, values);
      else pack_segment<1>(codes, cnt, v0, values);
    }
  }
  std::vector<double> used(T, -1.0);
  for (size_t i = 0; i < T; ++i)
    if (thr[i] >= 0) used[i] = static_cast<double>(thr[i]);
  return {payloads, res_out, true, total_kept, used};
}

namespace {

using Positions = std::vector<int64_t, NoInit<int64_t>>;

enum class Varint { kOk, kEndsInside, kTooLong, kPastRow };

// The varint gap at ib[b, nb) and the position it leads to from prev (prev + 1 + gap), b moved past it: kOk, or what
// is wrong (the bytes end inside it, it is longer than 9 bytes, the position is at or past `row`). kEnded: the caller
// knows a byte below 0x80 ends ib[b, nb), so the end is not checked per byte.
template <bool kEnded = false>
inline Varint next_position(const uint8_t* ib, int64_t& b, int64_t nb, int64_t row, int64_t& prev) {
  uint64_t gap = 0;
  for (int shift = 0;; shift += 7) {
    if (!kEnded && b >= nb) return Varint::kEndsInside;
    if (shift > 56) return Varint::kTooLong;
    const uint8_t byte = ib[b++];
    gap |= static_cast<uint64_t>(byte & 0x7F) << shift;
    if (!(byte & 0x80)) break;
  }
  if (gap >= static_cast<uint64_t>(row) || prev + 1 + static_cast<int64_t>(gap) >= row) return Varint::kPastRow;
  prev += 1 + static_cast<int64_t>(gap);
  return Varint::kOk;
}

// The positions (columns of a row) that the varint gaps ib[0, nb) encode, each the one before + 1 + its gap (the
// first from -1), as wire.py writes a row's index bytes. Throws std::invalid_argument for bytes ending inside a
// varint, a varint longer than 9 bytes, a position at or past `row`, or a count other than n_indexed.
Positions decode_positions_serial(const uint8_t* ib, int64_t nb, int64_t row, int64_t n_indexed) {
  Positions pos;
  pos.reserve(std::min(n_indexed, nb));  // (each position takes a byte at least: a header's count is not trusted)
  int64_t prev = -1;
  for (int64_t b = 0; b < nb;) {
    switch (next_position(ib, b, nb, row, prev)) {
      case Varint::kEndsInside: throw std::invalid_argument("index bytes end inside a varint");
      case Varint::kTooLong: throw std::invalid_argument("varint longer than 9 bytes");
      case Varint::kPastRow:
        throw std::invalid_argument("index past the partition of " + std::to_string(row) + " elements");
      case Varint::kOk: break;
    }
    pos.push_back(prev);
  }
  if (static_cast<int64_t>(pos.size()) != n_indexed)
    throw std::invalid_argument(std::to_string(nb) + " index bytes hold " + std::to_string(pos.size()) +
                                " positions, expected " + std::to_string(n_indexed));
  return pos;
}

constexpr int64_t kIndexChunk = 16384;  // index bytes per chunk of decode_positions (at least)

// decode_positions_serial's positions, from 2 kIndexChunk index bytes on in parallel over chunks of the bytes. A
// varint ends at a byte below 0x80, so each chunk starts after such a byte and holds whole varints: the count of
// those bytes says where each chunk's positions go, each chunk decodes its gaps into positions relative to its
// start, and then each adds the position its first follows. Bad input seen on the way is left to the serial loop,
// which throws its error for the first bad varint, as before.
Positions decode_positions(const uint8_t* ib, int64_t nb, int64_t row, int64_t n_indexed) {
  const int64_t C = std::min<int64_t>(4 * at::get_num_threads(), nb / kIndexChunk);
  if (C < 2 || ib[nb - 1] >= 0x80) return decode_positions_serial(ib, nb, row, n_indexed);
  std::vector<int64_t> start(C + 1, nb), base(C + 1, 0), step(C, 0);
  start[0] = 0;
  for (int64_t c = 1; c < C; ++c) {  // chunk starts: after a varint's last byte
    int64_t b = std::max(start[c - 1], nb * c / C);
    while (b < nb && ib[b - 1] >= 0x80) ++b;
    start[c] = b;
  }
  at::parallel_for(0, C, 1, [&](int64_t cb, int64_t ce) {
    for (int64_t c = cb; c < ce; ++c) {
      int64_t n = 0;
      for (int64_t b = start[c]; b < start[c + 1]; ++b) n += ib[b] < 0x80;
      base[c + 1] = n;
    }
  });
  for (int64_t c = 0; c < C; ++c) base[c + 1] += base[c];
  if (base[C] != n_indexed) return decode_positions_serial(ib, nb, row, n_indexed);
  Positions pos(n_indexed);
  std::atomic<bool> bad(false);
  at::parallel_for(0, C, 1, [&](int64_t cb, int64_t ce) {
    for (int64_t c = cb; c < ce; ++c) {
      // q: the last position, relative to the position chunk c's first follows + 1 (a relative position past the
      // row is bad too, so no sum of gaps can overflow)
      int64_t q = -1, k = base[c];
      for (int64_t b = start[c]; b < start[c + 1];) {
        if (next_position<true>(ib, b, start[c + 1], row, q) != Varint::kOk) {  // (chunks end after a varint)
          bad = true;
          return;
        }
        pos[k++] = q;
      }
      step[c] = q + 1;
    }
  });
  if (bad) return decode_positions_serial(ib, nb, row, n_indexed);
  std::vector<int64_t> add(C, 0);  // what chunk c's relative positions need added
  for (int64_t c = 1; c < C; ++c) add[c] = add[c - 1] + step[c - 1];
  if (add[C - 1] + step[C - 1] - 1 >= row) return decode_positions_serial(ib, nb, row, n_indexed);
  at::parallel_for(0, C, 1, [&](int64_t cb, int64_t ce) {
    for (int64_t c = cb; c < ce; ++c)
      for (int64_t k = base[c]; k < base[c + 1]; ++k) pos[k] += add[c];
  });
  return pos;
}

}  // namespace

void decode_add(at::Tensor out, at::Tensor values, at::Tensor scales, at::Tensor index_bytes, int64_t kept,
                int64_t n_indexed, std::vector<int64_t> seg_real, std::vector<int64_t> seg_chunks,
                std::vector<bool> sparse, int64_t group_size, int64_t fmt) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous(), "decode_add: out must be contiguous fp32");
  TORCH_CHECK(fmt >= 0 && fmt < dgc::kNumValueFormats, "decode_add: unknown value format ", fmt);
  const size_t T = seg_chunks.size();
  TORCH_CHECK(seg_real.size() == T && sparse.size() == T, "decode_add: per-tensor lists differ in length");
  TORCH_CHECK(group_size >= 2, "decode_add: group_size must be >= 2");
  int64_t row = 0;
  for (size_t i = 0; i < T; ++i) {
    TORCH_CHECK(seg_chunks[i] >= 0 && seg_real[i] >= 0 && seg_real[i] <= seg_chunks[i],
                "decode_add: tensor ", i, " has ", seg_real[i], " real elements in ", seg_chunks[i], " columns");
    row += seg_chunks[i];
  }
  TORCH_CHECK(out.numel() >= row, "decode_add: out has ", out.numel(), " elements for a row of ", row);
  if (kept < 0 || n_indexed < 0) throw std::invalid_argument("negative kept or indexed count");
  float* o = out.data_ptr<float>();
  const uint8_t* vals = values.data_ptr<uint8_t>();
  const float* sc = scales.data_ptr<float>();
  const uint8_t* ib = index_bytes.data_ptr<uint8_t>();
  const int64_t nb = index_bytes.numel();
  const Positions pos = decode_positions(ib, nb, row, n_indexed);  // varint gaps -> columns of the row
  // positions per segment: implied (all real) for tensors sent whole, decoded for sparse ones
  std::vector<int64_t> col(T + 1, 0);
  for (size_t i = 0; i < T; ++i) col[i + 1] = col[i] + seg_chunks[i];
  size_t next = 0;
  int64_t expected_groups = 0, total = 0;
  struct Run {
    bool implied;
    int64_t first, count;  // implied: first column; else first index into pos
  };
  std::vector<Run> runs;
  for (size_t i = 0; i < T; ++i) {
    Run run{!sparse[i], 0, 0};
    // (positions ascend, so pos[next] is the first at or past col[i]; a binary search finds the segment's first
    // position at or past its real elements: in its padding if before col[i + 1])
    if (!sparse[i]) {
      if (next < pos.size() && pos[next] < col[i + 1])
        throw std::invalid_argument("index " + std::to_string(pos[next]) + " points into a tensor sent whole");
      run.first = col[i];
      run.count = seg_real[i];
    } else {
      run.first = static_cast<int64_t>(next);
      next = std::lower_bound(pos.begin() + next, pos.end(), col[i] + seg_real[i]) - pos.begin();
      if (next < pos.size() && pos[next] < col[i + 1])
        throw std::invalid_argument("index " + std::to_string(pos[next]) + " points into padding");
      run.count = static_cast<int64_t>(next) - run.first;
    }
    runs.push_back(run);
    total += run.count;
    expected_groups += (run.count + group_size - 1) / group_size;
  }
  if (next < pos.size())
    throw std::invalid_argument("index " + std::to_string(pos[next]) + " past the partition of " +
                                std::to_string(col[T]) + " elements");
  if (total != kept)
    throw std::invalid_argument("payload holds " + std::to_string(total) + " positions for " + std::to_string(kept) +
                                " kept values");
  const bool masked = dgc::zero_masked(fmt);
  const int64_t n_words = scales.numel();
  if (masked ? n_words < expected_groups : n_words != expected_groups)
    throw std::invalid_argument(std::to_string(n_words) + " scales for " + std::to_string(expected_groups) + " groups");
  // groups restart at every segment; INT2/INT1: groups flagged by a negative scale carry one bit per value
  // (1: non-zero) after the scales
  struct Group {
    int64_t run, x0, x1, v0, mb0;
  };
  std::vector<Group> groups;
  groups.reserve(expected_groups);
  int64_t n_bits = 0, v = 0;
  for (size_t ri = 0; ri < runs.size(); ++ri) {
    for (int64_t g0 = 0; g0 < runs[ri].count; g0 += group_size) {
      const int64_t g1 = std::min(g0 + group_size, runs[ri].count);
      groups.push_back({static_cast<int64_t>(ri), g0, g1, v + g0, n_bits});
      if (masked && sc[groups.size() - 1] < 0.0f) n_bits += g1 - g0;
    }
    v += runs[ri].count;
  }
  if (masked && n_words != expected_groups + (n_bits + 31) / 32)
    throw std::invalid_argument(std::to_string(n_words) + " scale words for " + std::to_string(expected_groups) +
                                " groups and a zero mask of " + std::to_string(n_bits) + " values");
  if (values.numel() < dgc::packed_bytes(kept, fmt)) throw std::invalid_argument("too few value bytes");
  const uint8_t* mask = reinterpret_cast<const uint8_t*>(sc + expected_groups);
  const int bits = dgc::format_bits(fmt);
  float unit[256];  // code -> value at scale 1 (exact: value = unit[code] * scale)
  for (int c = 0; c < 256; ++c) unit[c] = dgc::decode_unit(static_cast<int>(fmt), static_cast<uint8_t>(c));
  // One sender's positions are distinct: groups add into disjoint elements. Per group, its values are decoded into
  // v first (the code width a constant: loops without a branch per value), then added at their columns.
  auto add_groups = [&](auto bits_tag) {
    constexpr int B = decltype(bits_tag)::value;
    at::parallel_for(0, static_cast<int64_t>(groups.size()), 64, [&](int64_t b, int64_t e) {
      thread_local std::vector<float> buf;  // (a group holds at most min(group_size, kept) values)
      buf.resize(std::max<int64_t>(1, std::min(group_size, kept)));
      float* __restrict v = buf.data();
      for (int64_t gi = b; gi < e; ++gi) {
        const Group& gr = groups[gi];
        const Run& run = runs[gr.run];
        const int64_t len = gr.x1 - gr.x0;
        const float scale = std::fabs(sc[gi]);
        for (int64_t x = 0; x < len; ++x) v[x] = unit[dgc::unpack_code(vals, gr.v0 + x, B)] * scale;
        if (masked && sc[gi] < 0.0f)  // a mixed group: zero where its bit is 0
          for (int64_t x = 0; x < len; ++x) {
            const int64_t mb = gr.mb0 + x;
            if (!((mask[mb >> 3] >> (mb & 7)) & 1)) v[x] = 0.0f;
          }
        if (run.implied) {
          float* __restrict dst = o + run.first + gr.x0;
          for (int64_t x = 0; x < len; ++x) dst[x] += v[x];
        } else {
          const int64_t* __restrict at_ = pos.data() + run.first + gr.x0;
          for (int64_t x = 0; x < len; ++x) o[at_[x]] += v[x];
        }
      }
    });
  };
  switch (bits) {
    case 8: add_groups(std::integral_constant<int, 8>()); break;
    case 4: add_groups(std::integral_constant<int, 4>()); break;
    case 2: add_groups(std::integral_constant<int, 2>()); break;
    default: add_groups(std::integral_constant<int, 1>()); break;
  }
}

namespace {

// Group starts of the weight layout: groups of group_size restart at every segment; the last entry is n.
std::vector<int64_t> weight_group_starts(int64_t n, int64_t group_size, const std::vector<int64_t>& segments) {
  TORCH_CHECK(group_size >= 1, "weights: group_size must be >= 1");
  std::vector<int64_t> segs = segments.empty() ? std::vector<int64_t>{n} : segments;
  std::vector<int64_t> starts;
  int64_t at = 0;
  for (int64_t len : segs) {
    TORCH_CHECK(len >= 0, "weights: negative segment length ", len);
    for (int64_t g = 0; g < len; g += group_size) starts.push_back(at + g);
    at += len;
  }
  TORCH_CHECK(at == n, "weights: segments of ", at, " elements for ", n, " weights");
  starts.push_back(n);
  return starts;
}

// Weight groups [b, e) of the layout `starts` (formats.quantize_weights): each group's scale absmax / qmax into sc[g]
// and one code per weight into dst (INT4: a nibble per byte, packed after). Bounds and pointers in locals: a uint8
// store may alias anything, so they would be reloaded every element and the loops not vectorize.
template <int W, typename T>
DGC_SIMD_CLONES void quantize_weight_groups(const T* v, const int64_t* starts, int64_t b, int64_t e, uint8_t* dst,
                                            float* sc, float qmax, uint8_t sat) {
  for (int64_t g = b; g < e; ++g) {
    const int64_t len = starts[g + 1] - starts[g];
    const T* __restrict vg = v + starts[g];
    uint8_t* __restrict dg = dst + starts[g];
    const float scale = absmax_of<true>(vg, len) / qmax;  // NaN for a group holding a NaN, as the reference
    sc[g] = scale;
    int64_t x = 0;
    if constexpr (W != dgc::kWInt4)
      if (kHaveAvx2 && scale > 0.0f) x = weight_codes_avx2<W>(vg, dg, len, scale, sat);
    for (; x < len; ++x) dg[x] = dgc::encode_weight(W, static_cast<float>(vg[x]), scale, sat);
  }
}

// What a weight code decodes to at scale 1 (decode_weight_unit), without a table (a lookup per value is a gather,
// which keeps the loop scalar): FP8 e4m3 through fp8_unit's selects instead of c10's branches.
template <int W>
inline float weight_unit(uint8_t code) {
  if constexpr (W == dgc::kWFp8E4M3) return dgc::fp8_unit<4, 3>(code);
  else return dgc::decode_weight_unit(W, code);
}

// v rounded to T as torch's copy_ rounds it; bf16 as c10's round_to_nearest_even, with an integer select instead of
// its NaN branch (so that the loops storing it vectorize), stored as its bits.
template <typename T>
struct WeightStore {
  using type = T;
  static T from(float v) { return static_cast<T>(v); }
};
template <>
struct WeightStore<c10::BFloat16> {
  using type = uint16_t;
  static uint16_t from(float v) {
    const uint32_t u = dgc::f32_bits(v);
    const uint16_t r = static_cast<uint16_t>((u + ((u >> 16) & 1u) + UINT32_C(0x7FFF)) >> 16);
    return (u & UINT32_C(0x7FFFFFFF)) > UINT32_C(0x7F800000) ? static_cast<uint16_t>(0x7FC0) : r;
  }
};

// Weight groups [b, e) decoded into o: weight_unit(code) * scale rounded once to T (INT4: two codes a byte, low
// nibble first). Each run of up to 256 weights is decoded to fp32, then rounded to T: two loops that vectorize.
template <int W, typename T>
DGC_SIMD_CLONES void dequantize_weight_groups(const uint8_t* in, const float* sc, const int64_t* starts, int64_t b,
                                              int64_t e, T* o) {
  using S = WeightStore<T>;
  static_assert(sizeof(typename S::type) == sizeof(T), "a weight is stored as T's bits");
  typename S::type* __restrict out = reinterpret_cast<typename S::type*>(o);
  const uint8_t* __restrict codes = in;
  constexpr int64_t kRun = 256;
  float tmp[kRun];
  for (int64_t g = b; g < e; ++g) {
    const float scale = sc[g];
    for (int64_t i = starts[g]; i < starts[g + 1]; i += kRun) {
      const int64_t len = std::min(kRun, starts[g + 1] - i);
      if constexpr (W == dgc::kWInt4) {
        auto nibble = [&](int64_t k) { return static_cast<uint8_t>((codes[k >> 1] >> ((k & 1) * 4)) & 0x0F); };
        const int64_t x0 = i & 1;  // a run starting in a byte's high nibble (segments of odd length)
        if (x0) tmp[0] = weight_unit<W>(nibble(i)) * scale;
        const int64_t pairs = (len - x0) / 2;
        const uint8_t* __restrict bytes = codes + ((i + x0) >> 1);
        float* __restrict t = tmp + x0;
        for (int64_t k = 0; k < pairs; ++k) {  // whole bytes: low nibble, high nibble
          t[2 * k] = weight_unit<W>(bytes[k] & 0x0F) * scale;
          t[2 * k + 1] = weight_unit<W>(bytes[k] >> 4) * scale;
        }
        if (x0 + 2 * pairs < len) tmp[len - 1] = weight_unit<W>(nibble(i + len - 1)) * scale;
      } else if constexpr (W == dgc::kWInt8 && std::is_same<T, c10::BFloat16>::value) {  // (the all-gather's case)
        const int64_t x0 = kHaveAvx2 ? int8_to_bf16_avx2(codes + i, scale, out + i, len) : 0;
        for (int64_t x = x0; x < len; ++x) out[i + x] = S::from(weight_unit<W>(codes[i + x]) * scale);
        continue;
      } else {
        for (int64_t x = 0; x < len; ++x) tmp[x] = weight_unit<W>(codes[i + x]) * scale;
      }
      for (int64_t x = 0; x < len; ++x) out[i + x] = S::from(tmp[x]);
    }
  }
}

}  // namespace

// Group-wise absmax quantization of a flat weight shard (formats.quantize_weights): wfmt 0 INT8, 1 FP8 e4m3,
// 2 INT4. x: contiguous 1-D fp32/bf16/fp16 of n elements; segments: lengths (groups restart at each), empty for
// one. Returns (codes uint8 (n, or ceil(n/2) for INT4), scales fp32 (groups,)).
std::tuple<at::Tensor, at::Tensor> quantize_weights(at::Tensor x, int64_t wfmt, int64_t group_size,
                                                    std::vector<int64_t> segments) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 1 && x.is_contiguous(), "quantize_weights: x must be contiguous 1-D CPU");
  TORCH_CHECK(wfmt >= 0 && wfmt <= 2, "quantize_weights: unknown weight format ", wfmt);
  const int64_t n = x.numel();
  const std::vector<int64_t> starts = weight_group_starts(n, group_size, segments);
  const int64_t G = static_cast<int64_t>(starts.size()) - 1;
  at::Tensor scales = at::empty({G}, at::kFloat);
  at::Tensor codes = at::empty({wfmt == dgc::kWInt4 ? (n + 1) / 2 : n}, at::kByte);  // every byte written
  float* sc = scales.data_ptr<float>();
  uint8_t* out = codes.data_ptr<uint8_t>();
  const float qmax = dgc::weight_qmax(static_cast<int>(wfmt));
  const uint8_t sat = dgc::e4m3_saturated_code();
  const bool int4 = wfmt == dgc::kWInt4;
  // INT4: unpacked first (a byte may hold two groups' codes); every element written
  std::unique_ptr<uint8_t[]> nibbles(int4 ? new uint8_t[std::max<int64_t>(n, 1)] : nullptr);
  uint8_t* dst = int4 ? nibbles.get() : out;
  dispatch_dtype(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* v = static_cast<const T*>(x.data_ptr());
    const int64_t grain = std::max<int64_t>(1, kBlock / std::max<int64_t>(group_size, 1));
    at::parallel_for(0, G, grain, [&](int64_t b, int64_t e) {  // per group: absmax, scale, codes
      if (wfmt == dgc::kWInt8)
        quantize_weight_groups<dgc::kWInt8>(v, starts.data(), b, e, dst, sc, qmax, sat);
      else if (wfmt == dgc::kWFp8E4M3)
        quantize_weight_groups<dgc::kWFp8E4M3>(v, starts.data(), b, e, dst, sc, qmax, sat);
      else
        quantize_weight_groups<dgc::kWInt4>(v, starts.data(), b, e, dst, sc, qmax, sat);
    });
  });
  if (int4) {
    if (n % 2) out[n / 2] = 0;  // the last byte holds one nibble, or-ed into it
    pack_segment<4>(nibbles.get(), n, 0, out);
  }
  return {codes, scales};
}

// Inverse of quantize_weights into `out` (contiguous 1-D fp32/bf16/fp16 of n elements, written in place; a value
// is rounded to out's dtype once, as copy_ of the fp32 result does).
void dequantize_weights(at::Tensor codes, at::Tensor scales, at::Tensor out, int64_t wfmt, int64_t group_size,
                        std::vector<int64_t> segments) {
  TORCH_CHECK(out.device().is_cpu() && out.dim() == 1 && out.is_contiguous(), "dequantize_weights: out must be contiguous 1-D CPU");
  TORCH_CHECK(wfmt >= 0 && wfmt <= 2, "dequantize_weights: unknown weight format ", wfmt);
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && scales.scalar_type() == at::kFloat &&
                  scales.is_contiguous(), "dequantize_weights: codes must be contiguous uint8 and scales fp32");
  const int64_t n = out.numel();
  const std::vector<int64_t> starts = weight_group_starts(n, group_size, segments);
  const int64_t G = static_cast<int64_t>(starts.size()) - 1;
  if (scales.numel() != G)
    throw std::invalid_argument("dequantize_weights: " + std::to_string(scales.numel()) + " scales for " +
                                std::to_string(G) + " groups of " + std::to_string(n) + " weights");
  TORCH_CHECK(codes.numel() >= (wfmt == dgc::kWInt4 ? (n + 1) / 2 : n), "dequantize_weights: too few code bytes");
  const float* sc = scales.data_ptr<float>();
  const uint8_t* in = codes.data_ptr<uint8_t>();
  dispatch_dtype(out.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    T* o = static_cast<T*>(out.data_ptr());
    const int64_t grain = std::max<int64_t>(1, kBlock / std::max<int64_t>(group_size, 1));
    at::parallel_for(0, G, grain, [&](int64_t b, int64_t e) {
      if (wfmt == dgc::kWInt8)
        dequantize_weight_groups<dgc::kWInt8>(in, sc, starts.data(), b, e, o);
      else if (wfmt == dgc::kWFp8E4M3)
        dequantize_weight_groups<dgc::kWFp8E4M3>(in, sc, starts.data(), b, e, o);
      else
        dequantize_weight_groups<dgc::kWInt4>(in, sc, starts.data(), b, e, o);
    });
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "deepspeed_dgc fused CPU kernels (compress_bucket, decode_add, quantize_weights, dequantize_weights, topk_threshold)";
  // the calling convention of these functions; op_builder/dgc.py rebuilds a prebuilt module of another one
  m.attr("ABI") = 4;
  m.def("compress_bucket", &compress_bucket, "fused residual add, top-k selection, quantize (any value format) and pack per owner row",
        py::call_guard<py::gil_scoped_release>());
  m.def("decode_add", &decode_add, "decode one payload body and scatter-add it into a dense fp32 partition",
        py::call_guard<py::gil_scoped_release>());
  m.def("quantize_weights", &quantize_weights, "group-wise absmax INT8/FP8/INT4 codes and scales of a weight shard",
        py::call_guard<py::gil_scoped_release>());
  m.def("dequantize_weights", &dequantize_weights, "decode a weight shard's codes into a float tensor in place",
        py::call_guard<py::gil_scoped_release>());
  m.def("topk_threshold", &topk_threshold, "DGC's sampled top-k threshold of a 1-D fp32 magnitude tensor",
        py::call_guard<py::gil_scoped_release>());
  m.def("release_residual_cache", &release_residual_cache,
        "free the residual buffers of 32 MB or more kept for reuse; returns their bytes");
  m.def("avx2_paths", []() { return kHaveAvx2; });  // whether the hand-written AVX2 passes run here
  m.def("simd_info", []() {  // the widest vectors the element passes run with here
#if defined(__AVX512F__)
    return std::string("avx512");
#elif defined(__AVX2__)
    return std::string("avx2");
#elif defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
    return std::string(__builtin_cpu_supports("avx2") ? "avx2 (target_clones)" : "baseline (target_clones)");
#else
    return std::string("baseline");
#endif
  });
}
