// CUDA kernels of deepspeed_dgc. The per-element math is dgc_math.h, shared with the CPU build (it
// needs only c10's header-only FP8 types); launchers take raw pointers and a stream, the binding is
// dgc_cuda_binding.cpp. Build with --fmad=false (and IEEE division, no flush-to-zero) so results equal
// the PyTorch reference.
//
// The exact layout's kernels (payloads of the kept count; the fixed layout's are dgc_cuda_fixed.cu):
// accumulate:        acc_m[r, col + j] = src[offset + r*stride + j] / divisor + residual[r*c + j]
//                    for the real elements of every owner row, 0 in padding (the dense pass).
// dequant_add:       out[pos[i]] += (nibble_i - 8) * scales[gid[i]] (positions of one sender are distinct).
// values_decode_add: the same for any value format, a value whose non-zero flag is 0 adding 0.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "dgc_cuda_util.cuh"
#include "dgc_math.h"

namespace {

using dgc_cuda::blocks_for;
using dgc_cuda::kThreads;
using dgc_cuda::to_float;


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

__global__ void dequant_add_kernel(float* __restrict__ out, const int64_t* __restrict__ pos,
                                   const uint8_t* __restrict__ packed, const float* __restrict__ scales,
                                   const int64_t* __restrict__ gid, int64_t k) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < k;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint8_t nib = (packed[i >> 1] >> ((i & 1) * 4)) & 0x0F;
    out[pos[i]] += dgc::int4_dequantize(nib, scales[gid[i]]);
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

extern "C" cudaError_t dgc_cuda_dequant_add(float* out, const int64_t* pos, const uint8_t* packed, const float* scales,
                                            const int64_t* gid, int64_t k, cudaStream_t stream) {
  if (k == 0) return cudaSuccess;
  dequant_add_kernel<<<blocks_for(k), kThreads, 0, stream>>>(out, pos, packed, scales, gid, k);
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
