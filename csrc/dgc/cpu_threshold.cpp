// DGC's sampled top-k threshold (Lin et al., ICLR 2018, section 3 and appendix): the sample, its k-th largest
// magnitude (by bins), the count of elements at a threshold.
#include "cpu_common.h"
#include "cpu_accumulate.h"

namespace dgc_cpu {

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


}  // namespace dgc_cpu
