// acc = src / divisor + residual over a block of a row: the threshold sample and the dense pass.
#pragma once

#include "cpu_common.h"

namespace dgc_cpu {
namespace {

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

}  // namespace
}  // namespace dgc_cpu
