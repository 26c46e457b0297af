// Per-element math of deepspeed_dgc's compressor, shared by the CPU (C++) and CUDA builds.
//
// Every function reproduces, bit for bit, what the PyTorch reference path in
// deepspeed_dgc/codec/formats.py and deepspeed_dgc/codec/reference.py computes in fp32: the accumulation
// of the gradient with the error-feedback residual, the group-wise absmax INT4 code
// (ZeRO++ qgZ's number format, Wang et al., arXiv 2306.10209, section 4.2) and the LEB128
// varint length of an index gap. Build with floating-point contraction off (-ffp-contract=off,
// nvcc --fmad=false): a fused multiply-add would round differently from the reference.
#pragma once

#include <cmath>
#include <cstdint>

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

// Bytes of the LEB128 varint of a non-negative gap (7 bits per byte).
DGC_HD int varint_length(uint64_t v) {
  int n = 1;
  while (v >= 128) {
    v >>= 7;
    ++n;
  }
  return n;
}

}  // namespace dgc
