// CUDA kernels of the fixed layout (deepspeed_dgc/codec/fixed.py): a bucket's owner matrix gathered from its tensors,
// every scale group coded and packed into the payload in one kernel (the residual left in place), and every
// sender's payload decoded and summed into this owner's row. One launch per stage whatever the bucket's tensors;
// small per-tensor tables instead of per-element index tensors. The per-element math is dgc_math.h and the
// reference's (deepspeed_dgc/codec/formats.py, FORMATS); build with --fmad=false, IEEE division, no flush-to-zero.
//
// owner_gather:   out[r, col] = src_t[base_r * c_t + j] / divisor for the tensor t whose block holds column col
//                 (j = col - col_t), 0 in padding; base_r the row's owner (or the row itself for row sources).
// fixed_encode:   per scale group of the whole-sent columns (out of the owner matrix) and of the slots: its scale
//                 (INT4/INT2/FP8 from the absmax, INT1 the mean non-zero magnitude), the codes packed per_byte to a
//                 byte into the payload, the scales into it, and v - decoded written back to the owner matrix.
// fixed_decode_dense: out[j] = sum over senders, in rank order, of what sender s's code j decodes to.
// fixed_decode_slots: D[s, col] = what sender s's slot k decodes to, at its column (filled slots only).
// sum_rows:       out[j] = sum over rows, in order, of D[s, j].
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "dgc_cuda_util.cuh"
#include "dgc_math.h"

namespace {

using dgc_cuda::blocks_for;
using dgc_cuda::from_float;
using dgc_cuda::kThreads;
using dgc_cuda::to_float;



// table: T rows of (source pointer, c, n, first column), in column order. row_base: (2, rows), each row's chunk to
// read (its owner's, or the row itself for sources that hold only these rows) and its owner, whose chunk of the
// tensor (min(c, n - owner c) elements) is what the row holds. O: the owner matrix's dtype (fp32, or bf16 for a
// bucket of bf16 gradients: fixed.matrix_dtype), rounded to nearest even once, after the division.
template <typename T, typename O>
__global__ void owner_gather_kernel(O* __restrict__ out, int64_t rows, int64_t columns,
                                    const int64_t* __restrict__ table, int tensors,
                                    const int64_t* __restrict__ row_base, float divisor, bool divide) {
  const int64_t total = rows * columns;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = idx / columns, col = idx - r * columns;
    int lo = 0, hi = tensors - 1;  // the last tensor whose block starts at or before col
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (table[4 * mid + 3] <= col) lo = mid; else hi = mid - 1;
    }
    const int64_t c = table[4 * lo + 1], n = table[4 * lo + 2], j = col - table[4 * lo + 3];
    float v = 0.0f;
    if (j < c && row_base[rows + r] * c + j < n) {
      v = to_float<T>(reinterpret_cast<const T*>(table[4 * lo])[row_base[r] * c + j]);
      if (divide) v = dgc::divide_by(v, divisor);
    }
    out[idx] = from_float<O>(v);
  }
}

__device__ __forceinline__ float nan_max(float a, float b) { return (a != a || b != b) ? a + b : fmaxf(a, b); }

// The fixed layout's per-format math (formats.FORMATS): code of v at the group's scale (nearest), and what it decodes
// to. INT4 floor(v/s + 1/2) in [-7, 7] + 8; INT2 four levels floor(v/s - 1/2 + 1/2) in [-2, 1] + 2 decoding to
// (q + 1/2) s, or (scale < 0: the group mixes zeros) three levels floor(v/a + 1/2) in [-1, 1] + 1 decoding to q a;
// INT1 sign + 1 decoding to sign s; FP8 the float8 of v/s.
__device__ __forceinline__ float fixed_code(int fmt, float v, float scale, uint8_t* code) {
  switch (fmt) {
    case dgc::kInt4: {
      const float s = scale > 0.0f ? scale : 1.0f;
      float q = floorf(v / s + 0.5f);
      q = q < -7.0f ? -7.0f : (q > 7.0f ? 7.0f : q);
      *code = static_cast<uint8_t>(static_cast<int>(q) + 8);
      return q * scale;
    }
    case dgc::kInt2: {
      const bool mixed = scale < 0.0f;
      const float a = fabsf(scale);
      const float d = a > 0.0f ? a : 1.0f;
      float t = v / d + (mixed ? 0.0f : -0.5f);
      float q = floorf(t + 0.5f);
      const float lo = mixed ? -1.0f : -2.0f;
      q = q < lo ? lo : (q > 1.0f ? 1.0f : q);
      *code = static_cast<uint8_t>(static_cast<int>(q) + (mixed ? 1 : 2));
      return (q + (mixed ? 0.0f : 0.5f)) * a;
    }
    case dgc::kInt1: {
      const float sign = v > 0.0f ? 1.0f : (v < 0.0f ? -1.0f : 0.0f);
      *code = static_cast<uint8_t>(static_cast<int>(sign) + 1);
      return sign * scale;
    }
    case dgc::kFp8E4M3: {
      const c10::Float8_e4m3fn f(v / (scale > 0.0f ? scale : 1.0f));
      *code = f.x;
      return static_cast<float>(f) * scale;
    }
    default: {
      const c10::Float8_e5m2 f(v / (scale > 0.0f ? scale : 1.0f));
      *code = f.x;
      return static_cast<float>(f) * scale;
    }
  }
}

__device__ __forceinline__ float fixed_decode(int fmt, uint8_t code, float scale) {
  switch (fmt) {
    case dgc::kInt4: return (static_cast<float>(code) - 8.0f) * scale;
    case dgc::kInt2: return scale < 0.0f ? (static_cast<float>(code) - 1.0f) * -scale : (static_cast<float>(code) - 1.5f) * scale;
    case dgc::kInt1: return (static_cast<float>(code) - 1.0f) * scale;
    case dgc::kFp8E4M3: return static_cast<float>(c10::Float8_e4m3fn(code, c10::Float8_e4m3fn::from_bits())) * scale;
    default: return static_cast<float>(c10::Float8_e5m2(code, c10::Float8_e5m2::from_bits())) * scale;
  }
}

// Codes per byte in the fixed layout (formats.FORMATS: INT1 ternary, five a byte).
__host__ __device__ __forceinline__ int per_byte(int fmt) {
  return fmt == dgc::kInt4 ? 2 : fmt == dgc::kInt2 ? 4 : fmt == dgc::kInt1 ? 5 : 1;
}

// Code j of a packed row (INT1: base-3 digit j % 5 of byte j / 5).
__device__ __forceinline__ uint8_t packed_code(const uint8_t* row, int64_t j, int fmt) {
  switch (fmt) {
    case dgc::kInt4: return (row[j >> 1] >> ((j & 1) * 4)) & 0x0F;
    case dgc::kInt2: return (row[j >> 2] >> ((j & 3) * 2)) & 0x03;
    case dgc::kInt1: {
      uint8_t b = row[j / 5];
      for (int d = static_cast<int>(j % 5); d > 0; --d) b /= 3;
      return b % 3;
    }
    default: return row[j];
  }
}

// T: the owner matrix's dtype (fp32, or bf16: fixed.matrix_dtype); the slots' values are in it too. Every scale and
// code is computed in fp32 from the values; the residual is rounded to T once, as the torch ops' in-place sub_ rounds
// it, except a slot's: the torch ops add the decoded value's negation rounded to T (index_put_ with accumulate), so
// for bf16 it is rounded twice here too (for fp32 both are v - decoded exactly).
template <typename T>
struct EncodeArgs {
  T* A;                     // owner matrix (R, C); the whole-sent columns are [0, Cd)
  int64_t C, Cd;
  const T* slots;           // (R, Ks) slot values, or null
  int64_t Ks;
  const int32_t* flat;      // (R, Ks) the owner matrix element of each slot, -1 for an empty slot
  const int32_t* padding;   // per group of the whole-sent columns, its padding columns (INT2), or null
  uint8_t* payload;         // (R, P)
  int64_t P, scales_at, values_at;
  int fmt, group, span;     // span: codes per block, a multiple of the group and of per_byte
  int64_t K, Kp;            // codes per row, and rounded up to whole bytes
};

template <typename T>
__device__ __forceinline__ float code_value(const EncodeArgs<T>& a, int64_t r, int64_t k) {
  if (k < a.Cd) return to_float<T>(a.A[r * a.C + k]);
  if (k < a.K) return to_float<T>(a.slots[r * a.Ks + (k - a.Cd)]);
  return 0.0f;
}

// One block per (span of codes, row): the scales of its groups (shared memory), then its bytes.
template <typename T>
__global__ void fixed_encode_kernel(EncodeArgs<T> a) {
  extern __shared__ float sh[];  // [groups in span] scales, then [kThreads] reduction scratch x 4
  const int64_t r = blockIdx.y, k0 = static_cast<int64_t>(blockIdx.x) * a.span;
  const int groups = a.span / a.group;
  float* scales = sh;
  float* red = sh + groups;
  for (int gi = 0; gi < groups; ++gi) {
    const int64_t g0 = k0 + static_cast<int64_t>(gi) * a.group;
    if (g0 >= a.K) {
      if (threadIdx.x == 0) scales[gi] = 0.0f;
      continue;
    }
    float amax = 0.0f, sum = 0.0f, small = 0.0f, nonzero = 0.0f;
    for (int j = threadIdx.x; j < a.group; j += blockDim.x) {
      const float v = code_value(a, r, g0 + j);
      const float m = fabsf(v);
      amax = nan_max(amax, m);
      sum += m;
      small += m * 5.421010862427522e-20f;  // 2^-64 (formats.INT1_DOWN)
      nonzero += v != 0.0f ? 1.0f : 0.0f;
    }
    red[threadIdx.x] = amax;
    red[blockDim.x + threadIdx.x] = sum;
    red[2 * blockDim.x + threadIdx.x] = small;
    red[3 * blockDim.x + threadIdx.x] = nonzero;
    __syncthreads();
    for (int step = blockDim.x / 2; step > 0; step >>= 1) {
      if (threadIdx.x < step) {
        red[threadIdx.x] = nan_max(red[threadIdx.x], red[threadIdx.x + step]);
        for (int q = 1; q < 4; ++q) red[q * blockDim.x + threadIdx.x] += red[q * blockDim.x + threadIdx.x + step];
      }
      __syncthreads();
    }
    if (threadIdx.x == 0) {
      const float m = red[0];
      float s;
      switch (a.fmt) {
        case dgc::kInt4: s = m / 7.0f; break;
        case dgc::kInt2: {
          const int64_t g = g0 / a.group;
          const float pad = (a.padding && g0 < a.Cd) ? static_cast<float>(a.padding[g]) : 0.0f;
          const float zeros = static_cast<float>(a.group) - red[3 * blockDim.x];
          s = (zeros > pad && m > 0.0f) ? -m : m / 1.5f;
          break;
        }
        case dgc::kInt1: {
          const float count = red[3 * blockDim.x] < 1.0f ? 1.0f : red[3 * blockDim.x];
          const float total = red[blockDim.x];
          s = isinf(total) ? red[2 * blockDim.x] / count * 18446744073709551616.0f : total / count;
          break;
        }
        case dgc::kFp8E4M3: s = m / 448.0f; break;
        default: s = m / 57344.0f; break;
      }
      scales[gi] = s;
      reinterpret_cast<float*>(a.payload + r * a.P + a.scales_at)[g0 / a.group] = s;
    }
    __syncthreads();
  }
  const int per = per_byte(a.fmt);
  const int64_t end = (k0 + a.span < a.Kp ? k0 + a.span : a.Kp);
  uint8_t* out = a.payload + r * a.P + a.values_at;
  for (int64_t b = k0 / per + threadIdx.x; b < end / per; b += blockDim.x) {
    int byte = 0, weight = 1;
    for (int q = 0; q < per; ++q) {
      const int64_t k = b * per + q;
      uint8_t code = 0;
      if (k < a.K) {
        const float v = code_value(a, r, k);
        const float decoded = fixed_code(a.fmt, v, scales[(k - k0) / a.group], &code);
        if (k < a.Cd) {
          a.A[r * a.C + k] = from_float<T>(v - decoded);
        } else {
          const int64_t f = a.flat[r * a.Ks + (k - a.Cd)];
          if (f >= 0) a.A[f] = from_float<T>(v + to_float<T>(from_float<T>(-decoded)));
        }
      }
      if (a.fmt == dgc::kInt1) {
        byte += code * weight;
        weight *= 3;
      } else {
        byte |= static_cast<int>(code) << (q * (8 / per));
      }
    }
    out[b] = static_cast<uint8_t>(byte);
  }
}

__global__ void fixed_decode_dense_kernel(const uint8_t* __restrict__ received, int64_t senders, int64_t P,
                                          int64_t scales_at, int64_t values_at, int fmt, int group, int64_t Cd,
                                          float* __restrict__ out) {
  for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < Cd;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float acc = 0.0f;
    for (int64_t s = 0; s < senders; ++s) {  // in rank order, as the reference's index_add_
      const uint8_t* row = received + s * P;
      const float scale = reinterpret_cast<const float*>(row + scales_at)[j / group];
      acc = acc + fixed_decode(fmt, packed_code(row + values_at, j, fmt), scale);
    }
    out[j] = acc;
  }
}

__global__ void fixed_decode_slots_kernel(const uint8_t* __restrict__ received, int64_t senders, int64_t P,
                                          int64_t scales_at, int64_t values_at, int fmt, int group, int64_t Cd,
                                          int64_t Ks, const int32_t* __restrict__ cols, const bool* __restrict__ valid,
                                          float* __restrict__ D, int64_t Cs) {
  const int64_t total = senders * Ks;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (!valid[idx]) continue;
    const int64_t s = idx / Ks, k = idx - s * Ks;
    const uint8_t* row = received + s * P;
    const int64_t j = Cd + k;
    const float scale = reinterpret_cast<const float*>(row + scales_at)[j / group];
    D[s * Cs + cols[idx]] = fixed_decode(fmt, packed_code(row + values_at, j, fmt), scale);
  }
}

__global__ void sum_rows_kernel(const float* __restrict__ D, int64_t rows, int64_t n, float* __restrict__ out) {
  for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < n;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float acc = 0.0f;
    for (int64_t s = 0; s < rows; ++s) acc = acc + D[s * n + j];
    out[j] = acc;
  }
}

// Weights with groups restarting at each segment: segments (S x 2) = (first element, first group), in order.
__device__ __forceinline__ int64_t weight_group(const int64_t* seg, int S, int64_t i, int64_t group) {
  int lo = 0, hi = S - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (seg[2 * mid] <= i) lo = mid; else hi = mid - 1;
  }
  return seg[2 * lo + 1] + (i - seg[2 * lo]) / group;
}

// One block per group: its absmax / qmax (NaN propagates). groups_of: (S x 2) again; n_groups total.
__global__ void weights_scales_kernel(const float* __restrict__ x, int64_t n, const int64_t* __restrict__ seg, int S,
                                      int64_t group, int64_t n_groups, float qmax, float* __restrict__ scales) {
  __shared__ float red[kThreads];
  for (int64_t g = blockIdx.x; g < n_groups; g += gridDim.x) {
    int lo = 0, hi = S - 1;  // the segment holding group g
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (seg[2 * mid + 1] <= g) lo = mid; else hi = mid - 1;
    }
    const int64_t seg_end = lo + 1 < S ? seg[2 * (lo + 1)] : n;
    const int64_t start = seg[2 * lo] + (g - seg[2 * lo + 1]) * group;
    const int64_t stop = start + group < seg_end ? start + group : seg_end;
    float m = 0.0f;
    for (int64_t i = start + threadIdx.x; i < stop; i += blockDim.x) m = nan_max(m, fabsf(x[i]));
    red[threadIdx.x] = m;
    __syncthreads();
    for (int step = blockDim.x / 2; step > 0; step >>= 1) {
      if (threadIdx.x < step) red[threadIdx.x] = nan_max(red[threadIdx.x], red[threadIdx.x + step]);
      __syncthreads();
    }
    if (threadIdx.x == 0) scales[g] = red[0] / qmax;
    __syncthreads();
  }
}

__global__ void weights_encode_seg_kernel(const float* __restrict__ x, const float* __restrict__ scales, int64_t n,
                                          const int64_t* __restrict__ seg, int S, int64_t group, int wfmt,
                                          uint8_t* __restrict__ codes) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    codes[i] = dgc::encode_weight(wfmt, x[i], scales[weight_group(seg, S, i, group)]);
}


template <typename T>
__global__ void weights_decode_seg_kernel(const uint8_t* __restrict__ codes, const float* __restrict__ scales,
                                          int64_t n, const int64_t* __restrict__ seg, int S, int64_t group, int wfmt,
                                          T* __restrict__ out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint8_t code = wfmt == dgc::kWInt4 ? static_cast<uint8_t>((codes[i >> 1] >> ((i & 1) * 4)) & 0x0F) : codes[i];
    out[i] = from_float<T>(dgc::decode_weight(wfmt, code, scales[weight_group(seg, S, i, group)]));
  }
}

}  // namespace

namespace {

template <typename O>
cudaError_t launch_owner_gather(O* out, int64_t rows, int64_t columns, const int64_t* table, int tensors,
                                const int64_t* row_base, int dtype, float divisor, cudaStream_t stream) {
  const bool divide = divisor != 1.0f;
  const int blocks = blocks_for(rows * columns);
  switch (dtype) {
    case 0:
      owner_gather_kernel<float, O><<<blocks, kThreads, 0, stream>>>(out, rows, columns, table, tensors, row_base,
                                                                     divisor, divide);
      break;
    case 1:
      owner_gather_kernel<__nv_bfloat16, O><<<blocks, kThreads, 0, stream>>>(out, rows, columns, table, tensors,
                                                                             row_base, divisor, divide);
      break;
    case 2:
      owner_gather_kernel<__half, O><<<blocks, kThreads, 0, stream>>>(out, rows, columns, table, tensors, row_base,
                                                                      divisor, divide);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_fixed_encode(T* A, int64_t rows, int64_t C, int64_t Cd, const T* slots, int64_t Ks,
                                const int32_t* flat, const int32_t* padding, uint8_t* payload, int64_t P,
                                int64_t scales_at, int64_t values_at, int fmt, int group, int span, int64_t K,
                                int64_t Kp, cudaStream_t stream) {
  EncodeArgs<T> a{A, C, Cd, slots, Ks, flat, padding, payload, P, scales_at, values_at, fmt, group, span, K, Kp};
  const dim3 grid(static_cast<unsigned>((Kp + span - 1) / span), static_cast<unsigned>(rows));
  const size_t shared = sizeof(float) * (span / group + 4 * kThreads);
  fixed_encode_kernel<T><<<grid, kThreads, shared, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace

// dtype: of the sources, 0 fp32, 1 bf16, 2 fp16; out_dtype: of the owner matrix out, 0 fp32, 1 bf16
extern "C" cudaError_t dgc_cuda_owner_gather(void* out, int out_dtype, int64_t rows, int64_t columns,
                                             const int64_t* table, int tensors, const int64_t* row_base, int dtype,
                                             float divisor, cudaStream_t stream) {
  if (rows * columns == 0) return cudaSuccess;
  switch (out_dtype) {
    case 0:
      return launch_owner_gather(static_cast<float*>(out), rows, columns, table, tensors, row_base, dtype, divisor,
                                 stream);
    case 1:
      return launch_owner_gather(static_cast<__nv_bfloat16*>(out), rows, columns, table, tensors, row_base, dtype,
                                 divisor, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

// A_dtype: of the owner matrix A and the slots' values, 0 fp32, 1 bf16
extern "C" cudaError_t dgc_cuda_fixed_encode(void* A, int A_dtype, int64_t rows, int64_t C, int64_t Cd,
                                             const void* slots, int64_t Ks, const int32_t* flat,
                                             const int32_t* padding, uint8_t* payload, int64_t P, int64_t scales_at,
                                             int64_t values_at, int fmt, int group, int span, int64_t K, int64_t Kp,
                                             cudaStream_t stream) {
  if (rows == 0 || Kp == 0) return cudaSuccess;
  if (fmt < 0 || fmt >= dgc::kNumValueFormats || span % group || span % per_byte(fmt)) return cudaErrorInvalidValue;
  switch (A_dtype) {
    case 0:
      return launch_fixed_encode(static_cast<float*>(A), rows, C, Cd, static_cast<const float*>(slots), Ks, flat,
                                 padding, payload, P, scales_at, values_at, fmt, group, span, K, Kp, stream);
    case 1:
      return launch_fixed_encode(static_cast<__nv_bfloat16*>(A), rows, C, Cd,
                                 static_cast<const __nv_bfloat16*>(slots), Ks, flat, padding, payload, P, scales_at,
                                 values_at, fmt, group, span, K, Kp, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

extern "C" cudaError_t dgc_cuda_fixed_decode(const uint8_t* received, int64_t senders, int64_t P, int64_t scales_at,
                                             int64_t values_at, int fmt, int group, int64_t Cd, int64_t Ks,
                                             const int32_t* cols, const bool* valid, float* D, int64_t Cs, float* out,
                                             cudaStream_t stream) {
  if (fmt < 0 || fmt >= dgc::kNumValueFormats) return cudaErrorInvalidValue;
  if (Cd) fixed_decode_dense_kernel<<<blocks_for(Cd), kThreads, 0, stream>>>(received, senders, P, scales_at,
                                                                            values_at, fmt, group, Cd, out);
  if (Ks && Cs) {
    cudaError_t err = cudaMemsetAsync(D, 0, sizeof(float) * senders * Cs, stream);
    if (err != cudaSuccess) return err;
    fixed_decode_slots_kernel<<<blocks_for(senders * Ks), kThreads, 0, stream>>>(
        received, senders, P, scales_at, values_at, fmt, group, Cd, Ks, cols, valid, D, Cs);
    sum_rows_kernel<<<blocks_for(Cs), kThreads, 0, stream>>>(D, senders, Cs, out + Cd);
  }
  return cudaGetLastError();
}

extern "C" cudaError_t dgc_cuda_weights_encode_seg(const float* x, int64_t n, const int64_t* seg, int S,
                                                   int64_t group, int64_t n_groups, int wfmt, float* scales,
                                                   uint8_t* codes, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (wfmt < 0 || wfmt > 2) return cudaErrorInvalidValue;
  const float qmax = wfmt == dgc::kWInt8 ? 127.0f : wfmt == dgc::kWFp8E4M3 ? 448.0f : 7.0f;
  const int grid = static_cast<int>(n_groups < 65535 * 8 ? n_groups : 65535 * 8);
  weights_scales_kernel<<<grid, kThreads, 0, stream>>>(x, n, seg, S, group, n_groups, qmax, scales);
  weights_encode_seg_kernel<<<blocks_for(n), kThreads, 0, stream>>>(x, scales, n, seg, S, group, wfmt, codes);
  return cudaGetLastError();
}

// dtype of out: 0 fp32, 1 bf16, 2 fp16
extern "C" cudaError_t dgc_cuda_weights_decode_seg(const uint8_t* codes, const float* scales, int64_t n,
                                                   const int64_t* seg, int S, int64_t group, int wfmt, void* out,
                                                   int dtype, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (wfmt < 0 || wfmt > 2) return cudaErrorInvalidValue;
  switch (dtype) {
    case 0:
      weights_decode_seg_kernel<float><<<blocks_for(n), kThreads, 0, stream>>>(codes, scales, n, seg, S, group, wfmt,
                                                                              static_cast<float*>(out));
      break;
    case 1:
      weights_decode_seg_kernel<__nv_bfloat16><<<blocks_for(n), kThreads, 0, stream>>>(
          codes, scales, n, seg, S, group, wfmt, static_cast<__nv_bfloat16*>(out));
      break;
    case 2:
      weights_decode_seg_kernel<__half><<<blocks_for(n), kThreads, 0, stream>>>(codes, scales, n, seg, S, group, wfmt,
                                                                               static_cast<__half*>(out));
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}
