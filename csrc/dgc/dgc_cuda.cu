// CUDA kernels of deepspeed_dgc. The per-element math is dgc_math.h, shared with the CPU build (it
// needs only c10's header-only FP8 types); launchers take raw pointers and a stream, the binding is
// dgc_cuda_binding.cpp. Build with --fmad=false (and IEEE division, no flush-to-zero) so results equal
// the PyTorch reference.
//
// accumulate:        acc_m[r, col + j] = src[offset + r*stride + j] / divisor + residual[r*c + j]
//                    for the real elements of every owner row, 0 in padding (the dense pass).
// int4_encode:       per kept value, code = clamp(rint(v / scale), -7, 7) as a nibble, and the decoded value.
// values_encode:     the same for any value format (dgc::encode_value): one unpacked code per value.
// dequant_add:       out[pos[i]] += (nibble_i - 8) * scales[gid[i]] (positions of one sender are distinct).
// values_decode_add: the same for any value format, a value whose non-zero flag is 0 adding 0.
// weights_encode:    per weight, its INT8 / FP8 e4m3 / INT4 code (dgc::encode_weight), unpacked.
// weights_decode:    out[i] = decode_weight(code_i, scales[gid[i]]) in out's dtype.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "dgc_math.h"

namespace {

template <typename T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <>
__device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }

template <typename T>
__global__ void accumulate_kernel(float* __restrict__ acc_m, int64_t acc_cols, int64_t col, const T* __restrict__ src,
                                  int64_t offset, int64_t stride, int64_t n, int64_t c,
                                  const int64_t* __restrict__ owners, int64_t rows, const float* __restrict__ residual,
                                  float divisor, bool divide) {
  const int64_t total = rows * c;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = idx / c, j = idx - r * c;
    float a = 0.0f;
    if (j < dgc::real_count(n, owners[r], c)) {
      const float s = to_float<T>(src[offset + r * stride + j]);
      a = residual ? dgc::accumulate(s, divisor, divide, residual[r * c + j])
                   : (divide ? dgc::divide_by(s, divisor) : s);
    }
    acc_m[r * acc_cols + col + j] = a;
  }
}

__global__ void int4_encode_kernel(const float* __restrict__ vals, const float* __restrict__ scales,
                                   const int64_t* __restrict__ gid, int64_t k, uint8_t* __restrict__ nibbles,
                                   float* __restrict__ decoded) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < k;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float s = scales[gid[i]];
    const float q = dgc::int4_quantize(vals[i], s);
    nibbles[i] = dgc::int4_nibble(q);
    decoded[i] = q * s;
  }
}

__global__ void dequant_add_kernel(float* __restrict__ out, const int64_t* __restrict__ pos,
                                   const uint8_t* __restrict__ packed, const float* __restrict__ scales,
                                   const int64_t* __restrict__ gid, int64_t k) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < k;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint8_t nib = (packed[i >> 1] >> ((i & 1) * 4)) & 0x0F;
    out[pos[i]] += dgc::int4_dequantize(nib, scales[gid[i]]);
  }
}

__global__ void values_encode_kernel(const float* __restrict__ vals, const float* __restrict__ scales,
                                     const int64_t* __restrict__ gid, int64_t k, int fmt, uint8_t* __restrict__ codes,
                                     float* __restrict__ decoded) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < k;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint8_t code;
    decoded[i] = dgc::encode_value(fmt, vals[i], scales[gid[i]], &code);
    codes[i] = code;
  }
}

__global__ void values_decode_add_kernel(float* __restrict__ out, const int64_t* __restrict__ pos,
                                         const uint8_t* __restrict__ packed, const float* __restrict__ scales,
                                         const int64_t* __restrict__ gid, const bool* __restrict__ nonzero, int64_t k,
                                         int fmt) {
  const int bits = dgc::format_bits(fmt);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < k;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float v = dgc::decode_value(fmt, dgc::unpack_code(packed, i, bits), scales[gid[i]]);
    if (nonzero && !nonzero[i]) v = 0.0f;
    out[pos[i]] += v;
  }
}

__global__ void weights_encode_kernel(const float* __restrict__ x, const float* __restrict__ scales,
                                      const int64_t* __restrict__ gid, int64_t n, int wfmt, uint8_t* __restrict__ codes) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    codes[i] = dgc::encode_weight(wfmt, x[i], scales[gid[i]]);
}

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

template <typename T>
__global__ void weights_decode_kernel(const uint8_t* __restrict__ codes, const float* __restrict__ scales,
                                      const int64_t* __restrict__ gid, int64_t n, int wfmt, T* __restrict__ out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint8_t code = wfmt == dgc::kWInt4 ? static_cast<uint8_t>((codes[i >> 1] >> ((i & 1) * 4)) & 0x0F) : codes[i];
    out[i] = from_float<T>(dgc::decode_weight(wfmt, code, scales[gid[i]]));
  }
}

constexpr int kThreads = 256;

inline int blocks_for(int64_t n) {
  int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<int>(b < 65535 * 8 ? (b < 1 ? 1 : b) : 65535 * 8);
}

}  // namespace

// dtype: 0 fp32, 1 bf16, 2 fp16
extern "C" cudaError_t dgc_cuda_accumulate(float* acc_m, int64_t acc_cols, int64_t col, const void* src, int dtype,
                                           int64_t offset, int64_t stride, int64_t n, int64_t c, const int64_t* owners,
                                           int64_t rows, const float* residual, float divisor, cudaStream_t stream) {
  if (rows * c == 0) return cudaSuccess;
  const bool divide = divisor != 1.0f;
  const int blocks = blocks_for(rows * c);
  switch (dtype) {
    case 0:
      accumulate_kernel<float><<<blocks, kThreads, 0, stream>>>(acc_m, acc_cols, col, static_cast<const float*>(src),
                                                                offset, stride, n, c, owners, rows, residual, divisor,
                                                                divide);
      break;
    case 1:
      accumulate_kernel<__nv_bfloat16><<<blocks, kThreads, 0, stream>>>(
          acc_m, acc_cols, col, static_cast<const __nv_bfloat16*>(src), offset, stride, n, c, owners, rows, residual,
          divisor, divide);
      break;
    case 2:
      accumulate_kernel<__half><<<blocks, kThreads, 0, stream>>>(acc_m, acc_cols, col, static_cast<const __half*>(src),
                                                                 offset, stride, n, c, owners, rows, residual, divisor,
                                                                 divide);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

extern "C" cudaError_t dgc_cuda_int4_encode(const float* vals, const float* scales, const int64_t* gid, int64_t k,
                                            uint8_t* nibbles, float* decoded, cudaStream_t stream) {
  if (k == 0) return cudaSuccess;
  int4_encode_kernel<<<blocks_for(k), kThreads, 0, stream>>>(vals, scales, gid, k, nibbles, decoded);
  return cudaGetLastError();
}

extern "C" cudaError_t dgc_cuda_dequant_add(float* out, const int64_t* pos, const uint8_t* packed, const float* scales,
                                            const int64_t* gid, int64_t k, cudaStream_t stream) {
  if (k == 0) return cudaSuccess;
  dequant_add_kernel<<<blocks_for(k), kThreads, 0, stream>>>(out, pos, packed, scales, gid, k);
  return cudaGetLastError();
}

extern "C" cudaError_t dgc_cuda_values_encode(const float* vals, const float* scales, const int64_t* gid, int64_t k,
                                              int fmt, uint8_t* codes, float* decoded, cudaStream_t stream) {
  if (k == 0) return cudaSuccess;
  if (fmt < 0 || fmt >= dgc::kNumValueFormats) return cudaErrorInvalidValue;
  values_encode_kernel<<<blocks_for(k), kThreads, 0, stream>>>(vals, scales, gid, k, fmt, codes, decoded);
  return cudaGetLastError();
}

extern "C" cudaError_t dgc_cuda_values_decode_add(float* out, const int64_t* pos, const uint8_t* packed,
                                                  const float* scales, const int64_t* gid, const bool* nonzero,
                                                  int64_t k, int fmt, cudaStream_t stream) {
  if (k == 0) return cudaSuccess;
  if (fmt < 0 || fmt >= dgc::kNumValueFormats) return cudaErrorInvalidValue;
  values_decode_add_kernel<<<blocks_for(k), kThreads, 0, stream>>>(out, pos, packed, scales, gid, nonzero, k, fmt);
  return cudaGetLastError();
}

extern "C" cudaError_t dgc_cuda_weights_encode(const float* x, const float* scales, const int64_t* gid, int64_t n,
                                               int wfmt, uint8_t* codes, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (wfmt < 0 || wfmt > 2) return cudaErrorInvalidValue;
  weights_encode_kernel<<<blocks_for(n), kThreads, 0, stream>>>(x, scales, gid, n, wfmt, codes);
  return cudaGetLastError();
}

// dtype of out: 0 fp32, 1 bf16, 2 fp16
extern "C" cudaError_t dgc_cuda_weights_decode(const uint8_t* codes, const float* scales, const int64_t* gid,
                                               int64_t n, int wfmt, void* out, int dtype, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (wfmt < 0 || wfmt > 2) return cudaErrorInvalidValue;
  switch (dtype) {
    case 0:
      weights_decode_kernel<float><<<blocks_for(n), kThreads, 0, stream>>>(codes, scales, gid, n, wfmt,
                                                                          static_cast<float*>(out));
      break;
    case 1:
      weights_decode_kernel<__nv_bfloat16><<<blocks_for(n), kThreads, 0, stream>>>(
          codes, scales, gid, n, wfmt, static_cast<__nv_bfloat16*>(out));
      break;
    case 2:
      weights_decode_kernel<__half><<<blocks_for(n), kThreads, 0, stream>>>(codes, scales, gid, n, wfmt,
                                                                           static_cast<__half*>(out));
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}
