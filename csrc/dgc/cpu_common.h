// What the fused CPU op's files share: the per-tensor spec of a bucket, the kept elements, the tasks of the dense
// pass, the threshold sample, and the functions one stage calls in another. The op, by stage:
//   cpu_threshold.cpp       DGC's sampled threshold (sample, k-th largest, count at a threshold)
//   cpu_accumulate.h        acc = src / divisor + residual over a block (the sample and the dense pass)
//   cpu_dense_pass.cpp      one pass over every element: acc, new residual, candidates; rows sent whole coded in it
//   cpu_simd.h              the hand-written AVX2 primitives (compaction, codes, packing, weights)
//   cpu_coders.h            value coders (group scales, codes, packing), scalar, beside cpu_simd.h's AVX2 ones
//   cpu_compress.cpp        compress_bucket: plan, thresholds, dense pass, corrections towards k, payloads
//   cpu_decode.cpp          decode_add: varint positions, scale groups, values added into a row
//   cpu_residual_cache.cpp  reused memory for large residuals
//   cpu_weights.cpp         the quantized all-gather's weight codes
//   cpu_bindings.cpp        the Python module
// dgc_math.h (shared with the CUDA op) holds the per-format math.
#pragma once
// ATen's per-operator headers, not ATen/ATen.h (every operator's declaration: 3 s more of each file's compile)
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>

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

namespace dgc_cpu {

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

// A threshold sample: |acc| of every sampled real element (or of all real elements), the largest of their bits
// (above FLT_MAX's: an Inf or NaN among them) and, from kBinnedAtLeast values on, their count per magnitude bin.
struct Sample {
  std::vector<float> mags;
  uint32_t max_bits = 0;
  Bins hist;
};

// How the dense pass codes a row sent whole while its block is in cache: value format and scale group size.
struct PreEncode {
  int fmt;
  int64_t group_size;
};

// Declared here, defined in the stage's file.
float kth_in_bins(const std::vector<float>& v, int64_t k, const Bins& hist);  // cpu_threshold.cpp
float kth_largest(std::vector<float>& v, int64_t k);
int64_t count_at_least(const Spec& t, const Params& p, float thr);
Sample sample_magnitudes(const Spec& t, const Params& p);
int64_t dense_pass(std::vector<Spec>& specs, const Params& p, const std::vector<Task>& tasks,  // cpu_dense_pass.cpp
                   const std::vector<float>& thr, std::vector<std::vector<Kept>>& kept, bool write_residual,
                   const PreEncode* pre = nullptr);
std::vector<Task> make_tasks(const std::vector<Spec>& specs, const std::vector<int64_t>& which);
bool avx2_paths();
at::Tensor residual_empty(int64_t n);  // cpu_residual_cache.cpp

// The module's functions (cpu_bindings.cpp)
std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>, bool, int64_t, std::vector<double>> compress_bucket(
    std::vector<at::Tensor> srcs, std::vector<int64_t> offsets, std::vector<int64_t> strides,
    std::vector<at::Tensor> residuals, std::vector<int64_t> residual_numels, std::vector<int64_t> numels,
    std::vector<int64_t> chunks, std::vector<bool> sparse, std::vector<int64_t> row_owner, std::vector<int64_t> ks,
    std::vector<at::Tensor> samples, double divisor, int64_t group_size, int64_t fmt, int64_t fingerprint,
    bool want_residual, std::vector<double> fixed, bool reuse);
void decode_add(at::Tensor out, at::Tensor values, at::Tensor scales, at::Tensor index_bytes, int64_t kept,
                int64_t n_indexed, std::vector<int64_t> seg_real, std::vector<int64_t> seg_chunks,
                std::vector<bool> sparse, int64_t group_size, int64_t fmt);
float topk_threshold(at::Tensor mag, int64_t k, at::Tensor sample);
std::tuple<at::Tensor, at::Tensor> quantize_weights(at::Tensor x, int64_t wfmt, int64_t group_size,
                                                    std::vector<int64_t> segments);
void dequantize_weights(at::Tensor codes, at::Tensor scales, at::Tensor out, int64_t wfmt, int64_t group_size,
                        std::vector<int64_t> segments);
int64_t release_residual_cache();

}  // namespace dgc_cpu
