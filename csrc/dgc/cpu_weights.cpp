// The quantized all-gather's weights: group-wise absmax INT8/FP8/INT4 codes of a shard and their decode.
#include "cpu_common.h"
#include "cpu_coders.h"

namespace dgc_cpu {

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


}  // namespace dgc_cpu
