// compress_bucket: one bucket's payloads, one per owner row, by stage.
#include "cpu_common.h"
#include "cpu_coders.h"

namespace dgc_cpu {

namespace {

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

// One compress_bucket call as it goes through its stages: the checked inputs and what each stage leaves.
struct BucketPlan {
  std::vector<Spec> specs;
  Params p{1.0f, false};
  int64_t R = 0;
  size_t T = 0;
  int64_t group_size = 0, fmt = 0, fingerprint = 0;
  bool want_residual = false, reuse = false;
  std::vector<double> fixed;
  std::vector<at::Tensor> res_out;           // the new residuals (want_residual)
  std::vector<float> thr;                    // stage 1: each tensor's threshold (-1: every real element kept)
  std::vector<std::vector<Kept>> kept;       // stage 2-3: kept[i][r]
  std::vector<at::Tensor> early;             // payloads allocated before the dense pass (rows sent whole)
  std::vector<uint8_t> whole;                // stage 3b: row r keeps every real element (no positions sent)
};

// Stage 0: the inputs checked, each tensor's Spec (where its rows are, its real elements per row), the residuals.
BucketPlan plan_bucket(std::vector<at::Tensor>& srcs, const std::vector<int64_t>& offsets,
                       const std::vector<int64_t>& strides, const std::vector<at::Tensor>& residuals,
                       const std::vector<int64_t>& residual_numels, const std::vector<int64_t>& numels,
                       const std::vector<int64_t>& chunks, const std::vector<bool>& sparse,
                       const std::vector<int64_t>& row_owner, const std::vector<int64_t>& ks,
                       const std::vector<at::Tensor>& samples, double divisor, int64_t group_size, int64_t fmt,
                       int64_t fingerprint, bool want_residual, std::vector<double> fixed, bool reuse) {
  BucketPlan b;
  const size_t T = b.T = srcs.size();
  const int64_t R = b.R = static_cast<int64_t>(row_owner.size());
  TORCH_CHECK(offsets.size() == T && strides.size() == T && residuals.size() == T && residual_numels.size() == T &&
                  numels.size() == T && chunks.size() == T && sparse.size() == T && ks.size() == T &&
                  samples.size() == T && fixed.size() == T,
              "compress_bucket: per-tensor lists differ in length");
  TORCH_CHECK(group_size >= 2, "compress_bucket: group_size must be >= 2");
  TORCH_CHECK(fmt >= 0 && fmt < dgc::kNumValueFormats, "compress_bucket: unknown value format ", fmt);
  TORCH_CHECK(fingerprint >= 0 && fingerprint <= INT32_MAX, "compress_bucket: fingerprint must fit in an int31");
  TORCH_CHECK(divisor > 0, "compress_bucket: divisor must be > 0");
  b.group_size = group_size;
  b.fmt = fmt;
  b.fingerprint = fingerprint;
  b.want_residual = want_residual;
  b.reuse = reuse;
  b.fixed = std::move(fixed);
  b.p = Params{static_cast<float>(divisor), divisor != 1.0};
  int exponent = 0;
  if (std::frexp(b.p.divisor, &exponent) == 0.5f && std::isnormal(1.0f / b.p.divisor)) b.p.inverse = 1.0f / b.p.divisor;
  b.specs.resize(T);
  int64_t col = 0;
  for (size_t i = 0; i < T; ++i) {
    Spec& t = b.specs[i];
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
      b.res_out.push_back(out);
    }
  }
  b.thr.assign(T, -1.0f);
  b.kept.assign(T, std::vector<Kept>(R));
  b.early.resize(R);
  b.whole.assign(R, 0);
  return b;
}

// Stage 1: each sparse tensor's threshold, fixed or DGC's from its sample (tensors sent whole keep every element).
void estimate_thresholds(BucketPlan& b) {
  for (size_t i = 0; i < b.T; ++i) {
    Spec& t = b.specs[i];
    if (t.sparse && !(b.fixed[i] < 0) && (!b.reuse || t.k < t.m)) {
      b.thr[i] = static_cast<float>(b.fixed[i]);
      continue;
    }
    if (!t.sparse || t.k >= t.m) continue;
    Sample smp = sample_magnitudes(t, b.p);
    if (smp.max_bits > UINT32_C(0x7F7FFFFF)) {  // an Inf or NaN
      b.thr[i] = INFINITY;  // the dense pass finds the non-finite value and aborts
      continue;
    }
    const int64_t n_sample = static_cast<int64_t>(smp.mags.size());
    int64_t ksample = std::max<int64_t>(
        1, static_cast<int64_t>(std::ceil(static_cast<double>(n_sample * t.k) / t.m)));
    b.thr[i] = smp.hist.empty() ? kth_largest(smp.mags, ksample) : kth_in_bins(smp.mags, ksample, smp.hist);
  }
}

// Buckets of FP8 or INT4 (no zero bitmap) with no sparse tensor (what a sparse one keeps is known after the dense
// pass only): every tensor is sent whole, the payloads' sizes are known before the dense pass, so they are allocated
// here and the dense pass writes its codes straight into their value bytes (stage 4 then copies nothing), each
// tensor's whose codes start a byte (INT4: at an even value of the row).
void allocate_whole_payloads(BucketPlan& b) {
  const int64_t per_byte = 8 / dgc::format_bits(b.fmt);
  if (dgc::zero_masked(b.fmt) || std::any_of(b.specs.begin(), b.specs.end(), [](const Spec& t) { return t.sparse; }))
    return;
  for (int64_t r = 0; r < b.R; ++r) {
    int64_t n = 0, g = 0;
    for (const Spec& t : b.specs) {
      n += t.real[r];
      g += (t.real[r] + b.group_size - 1) / b.group_size;
    }
    b.early[r] = at::empty({payload_bytes(4 * g, n, b.fmt, 0)}, at::kByte);
    uint8_t* values = b.early[r].data_ptr<uint8_t>() + 4 * dgc::kHeaderInt32 + 4 * g;
    for (size_t i = 0, v0 = 0; i < b.T; v0 += b.specs[i].real[r], ++i)
      if (b.specs[i].real[r] && v0 % per_byte == 0)
        b.kept[i][r].codes = std::shared_ptr<uint8_t[]>(values + v0 / per_byte, [](uint8_t*) {});
  }
}

// Stage 2: the dense pass (acc, the new residual, the candidates |acc| >= thr). Returns false where an accumulated
// value is not finite (nothing is sent then).
bool accumulate_and_collect(BucketPlan& b) {
  allocate_whole_payloads(b);
  std::vector<int64_t> all(b.T);
  for (size_t i = 0; i < b.T; ++i) all[i] = static_cast<int64_t>(i);
  const PreEncode pre{static_cast<int>(b.fmt), b.group_size};
  if (dense_pass(b.specs, b.p, make_tasks(b.specs, all), b.thr, b.kept, b.want_residual, &pre)) return false;
  if (b.want_residual)  // padding slots of an untrimmed residual (R * c elements) stay exactly 0
    for (auto& t : b.specs)
      for (int64_t r = 0; r < b.R; ++r)
        for (int64_t j = t.real[r]; j < t.c && r * t.c + j < t.residual_numel; ++j) t.residual_out[r * t.c + j] = 0.0f;
  return true;
}

// Stage 3: DGC's corrections towards k: lower the threshold while fewer than 0.8 k are kept (then collect again),
// keep the k largest when more than 1.3 k are.
void correct_towards_k(BucketPlan& b) {
  for (size_t i = 0; i < b.T; ++i) {
    Spec& t = b.specs[i];
    const bool is_fixed = t.sparse && !(b.fixed[i] < 0);
    if (!t.sparse || t.k >= t.m || (is_fixed && !b.reuse)) continue;
    int64_t cnt = 0;
    for (auto& kr : b.kept[i]) cnt += kr.size();
    if (cnt < kLowerSlack * t.k && !is_fixed) {
      float th = b.thr[i];
      for (int rounds = 0; cnt < kLowerSlack * t.k && rounds < kMaxLowerRounds; ++rounds) {
        th = th * kLowerFactor;
        cnt = count_at_least(t, b.p, th);
      }
      b.thr[i] = th;
      for (auto& kr : b.kept[i]) kr = Kept();
      std::vector<float> thr_i(b.T, INFINITY);
      thr_i[i] = th;
      dense_pass(b.specs, b.p, make_tasks(b.specs, {static_cast<int64_t>(i)}), thr_i, b.kept, false);
    }
    if (cnt > kUpperSlack * t.k) {
      std::vector<float> mags;
      for (auto& kr : b.kept[i])
        for (float a : kr.acc) mags.push_back(std::fabs(a));
      float th = kth_largest(mags, t.k);
      b.thr[i] = th;
      for (auto& kr : b.kept[i]) {
        Kept f;
        for (int64_t x = 0; x < kr.size(); ++x)
          if (std::fabs(kr.acc[x]) >= th) {
            f.push(kr.col(x), kr.acc[x]);
          }
        kr = std::move(f);
      }
    }
  }
}

// Varint bytes of row r's positions: the gaps between the kept columns of its sparse tensors (the first from -1).
int64_t index_bytes_of(const BucketPlan& b, int64_t r) {
  int64_t n = 0, prev = -1;
  for (size_t i = 0; i < b.T; ++i) {
    const Kept& kr = b.kept[i][r];
    const int64_t cnt = kr.size();
    if (!b.specs[i].sparse || cnt == 0) continue;
    n += dgc::varint_length(static_cast<uint64_t>(b.specs[i].col + kr.col(0) - prev - 1));
    n += kr.all ? cnt - 1 : kr.gap_bytes;  // (consecutive columns: a byte each)
    prev = b.specs[i].col + kr.col(cnt - 1);
  }
  return n;
}

// Bytes of a payload's scales, values and positions for count(i) values kept of tensor i and index_bytes of
// positions, as wire.RowLayout.sections_bytes (no header, padding or INT2/INT1 zero-bitmap words).
template <typename Count>
int64_t sections_bytes(const BucketPlan& b, Count&& count, int64_t index_bytes) {
  int64_t n = 0, groups = 0;
  for (size_t i = 0; i < b.T; ++i) {
    const int64_t c = count(i);
    n += c;
    groups += (c + b.group_size - 1) / b.group_size;
  }
  return 4 * groups + dgc::packed_bytes(n, static_cast<int>(b.fmt)) + index_bytes;
}

// Stage 3b: rows whose sparse payload would not be smaller than the row sent whole (every real element, no
// positions) go whole, as wire.RowLayout.sends_whole decides: their sparse tensors' elements are collected again, all
// of them (a dense pass over those rows alone, acc only: encode_segment writes their new residual). Marks every row
// keeping all its real elements in b.whole.
void send_whole_rows(BucketPlan& b) {
  std::vector<Task> tasks;
  for (int64_t r = 0; r < b.R; ++r) {
    const int64_t sparse = sections_bytes(b, [&](size_t i) { return b.kept[i][r].size(); }, index_bytes_of(b, r));
    if (sparse < sections_bytes(b, [&](size_t i) { return b.specs[i].real[r]; }, 0)) continue;
    b.whole[r] = 1;
    for (size_t i = 0; i < b.T; ++i) {
      const Spec& t = b.specs[i];
      if (b.kept[i][r].size() == t.real[r]) continue;  // (tensors sent whole, and sparse ones keeping all)
      b.kept[i][r] = Kept();
      for (int64_t j0 = 0; j0 < t.real[r]; j0 += kTask)
        tasks.push_back({static_cast<int64_t>(i), r, j0, std::min(j0 + kTask, t.real[r])});
    }
  }
  if (!tasks.empty()) dense_pass(b.specs, b.p, tasks, std::vector<float>(b.T, -1.0f), b.kept, false);
}

// Stage 4's map of the payloads: per row its values, scale groups, index bytes and zero-bitmap bits; the kept values
// of tensor i in row r are segment s = r T + i, whose groups start at group seg_start[s] and value seg_v0[s] of the
// row; where each payload's parts are.
struct PayloadMap {
  struct Group {  // a group's scale and whether it mixes zeros and non-zeros (INT2/INT1)
    float scale;
    bool mixed;
  };
  BucketPlan& b;
  std::vector<int64_t> n_kept, n_groups, n_index, mask_bits, first_group, seg_start, seg_v0, scale_words;
  int64_t total_groups = 0, total_kept = 0;
  std::unique_ptr<Group[]> groups;  // the groups of segments the dense pass did not code
  std::vector<at::Tensor> payloads;
  std::vector<uint8_t*> bases;

  explicit PayloadMap(BucketPlan& b_)
      : b(b_), n_kept(b_.R, 0), n_groups(b_.R, 0), n_index(b_.R, 0), mask_bits(b_.R, 0), first_group(b_.R + 1, 0),
        seg_start(b_.R * b_.T + 1), seg_v0(b_.R * b_.T), scale_words(b_.R), bases(b_.R) {}
  int64_t T() const { return static_cast<int64_t>(b.T); }
  Kept& kept_of(int64_t sg) const { return b.kept[sg % T()][sg / T()]; }
  // the values [x0, x1) of kept_of(sg) in group gi of segment sg (value seg_v0[sg] + x0 of the row on)
  std::pair<int64_t, int64_t> range_of(int64_t sg, int64_t gi) const {
    const int64_t x0 = (gi - seg_start[sg]) * b.group_size;
    return std::make_pair(x0, std::min(x0 + b.group_size, kept_of(sg).size()));
  }
  // fn(sg, g0, g1) for the groups [g0, g1) of [lo, hi), one segment sg at a time (empty segments skipped)
  template <typename Fn>
  void for_segments(int64_t lo, int64_t hi, Fn&& fn) const {
    int64_t sg = std::upper_bound(seg_start.begin(), seg_start.end(), lo) - seg_start.begin() - 1;
    for (int64_t gi = lo; gi < hi;) {
      while (gi >= seg_start[sg + 1]) ++sg;
      const int64_t g1 = std::min(hi, seg_start[sg + 1]);
      fn(sg, gi, g1);
      gi = g1;
    }
  }
  // fn(i, x0, x1) for each mixed group of row r in the row's order: the values [x0, x1) of kept[i][r]
  template <typename Fn>
  void each_mixed(int64_t r, Fn&& fn) const {
    for (int64_t i = 0; i < T(); ++i) {
      const int64_t sg = r * T() + i;
      const Kept& kr = b.kept[i][r];
      for (int64_t gi = seg_start[sg]; gi < seg_start[sg + 1]; ++gi)
        if (kr.pre ? kr.gmixed[gi - seg_start[sg]] != 0 : groups[gi].mixed) {
          const auto [x0, x1] = range_of(sg, gi);
          fn(static_cast<size_t>(i), x0, x1);
        }
    }
  }
  float* scales_of(int64_t r) const { return reinterpret_cast<float*>(bases[r] + 4 * dgc::kHeaderInt32); }
  uint8_t* values_of(int64_t r) const { return bases[r] + 4 * dgc::kHeaderInt32 + 4 * scale_words[r]; }
};

// Stage 4a: per row, its segments' groups (serially: where each starts), values and varint index bytes (none for a
// row keeping every real element).
void count_segments(PayloadMap& pm) {
  BucketPlan& b = pm.b;
  for (int64_t r = 0; r < b.R; ++r) {
    pm.first_group[r] = pm.total_groups;
    for (size_t i = 0; i < b.T; ++i) {
      const Kept& kr = b.kept[i][r];
      const int64_t cnt = kr.size();
      pm.seg_start[r * b.T + i] = pm.total_groups;
      pm.seg_v0[r * b.T + i] = pm.n_kept[r];
      pm.total_groups += (cnt + b.group_size - 1) / b.group_size;
      pm.n_kept[r] += cnt;
    }
    pm.n_index[r] = b.whole[r] ? 0 : index_bytes_of(b, r);
    pm.n_groups[r] = pm.total_groups - pm.first_group[r];
    TORCH_CHECK(pm.n_kept[r] <= INT32_MAX && pm.n_index[r] <= INT32_MAX, "compress_bucket: row ", r,
                " does not fit the int32 header (", pm.n_kept[r], " values)");
  }
  pm.first_group[b.R] = pm.seg_start[b.R * b.T] = pm.total_groups;
}

// Stage 4b: the scale of every group the dense pass did not code, in parallel over groups (the groups of rows sent
// whole, pre, keep theirs in kept[i][r].gscale and gmixed), and each row's zero-bitmap bits.
void group_scales(PayloadMap& pm) {
  const BucketPlan& b = pm.b;
  const bool masked = dgc::zero_masked(b.fmt);
  pm.groups.reset(new PayloadMap::Group[std::max<int64_t>(pm.total_groups, 1)]);
  at::parallel_for(0, pm.total_groups, 256, [&](int64_t lo, int64_t hi) {
    pm.for_segments(lo, hi, [&](int64_t sg, int64_t g0, int64_t g1) {
      const Kept& kr = pm.kept_of(sg);
      if (kr.pre) return;
      const float* acc = kr.values();
      for (int64_t gi = g0; gi < g1; ++gi) {
        const auto [x0, x1] = pm.range_of(sg, gi);
        float absmax = 0.0f, mag_sum = 0.0f, nonzero = 0.0f;
        bool has_zero = false;
        for (int64_t x = x0; x < x1; ++x) {
          const float mag = std::fabs(acc[x]);
          absmax = std::max(absmax, mag);
          mag_sum += mag;
          nonzero += mag > 0.0f;
          has_zero |= acc[x] == 0.0f;
        }
        const float scale = value_group_scale(static_cast<int>(b.fmt), acc + x0, x1 - x0, absmax, mag_sum, nonzero);
        pm.groups[gi] = {scale, masked && has_zero && scale > 0.0f};
      }
    });
  });
  for (int64_t r = 0; r < b.R && masked; ++r)  // the bits of each row's zero bitmap
    pm.each_mixed(r, [&](size_t, int64_t x0, int64_t x1) { pm.mask_bits[r] += x1 - x0; });
}

// Stage 4c: each row's payload allocated (or the one allocated before the dense pass taken) and its header written.
// Every byte is written later but the zero bitmap, the bytes that packed codes of two tensors share (both or-ed into)
// and the padding: those are zeroed here and before packing.
void allocate_payloads(PayloadMap& pm) {
  const BucketPlan& b = pm.b;
  for (int64_t r = 0; r < b.R; ++r) {
    pm.scale_words[r] = pm.n_groups[r] + (pm.mask_bits[r] + 31) / 32;
    TORCH_CHECK(pm.scale_words[r] <= INT32_MAX, "compress_bucket: row ", r, " does not fit the int32 header (",
                pm.n_kept[r], " values)");  // its values and index bytes were checked before the groups
    const int64_t bytes = payload_bytes(4 * pm.scale_words[r], pm.n_kept[r], b.fmt, pm.n_index[r]);
    TORCH_CHECK(!b.early[r].defined() || b.early[r].numel() == bytes, "compress_bucket: internal error: row ", r,
                " was allocated ", b.early[r].numel(), " bytes before the dense pass, needs ", bytes);
    pm.payloads.push_back(b.early[r].defined() ? b.early[r] : at::empty({bytes}, at::kByte));
    pm.bases[r] = pm.payloads[r].data_ptr<uint8_t>();
    const int64_t mask_at = 4 * dgc::kHeaderInt32 + 4 * pm.n_groups[r];
    const int64_t mask_bytes = 4 * (pm.scale_words[r] - pm.n_groups[r]);
    const int64_t end = mask_at + mask_bytes + dgc::packed_bytes(pm.n_kept[r], b.fmt) + pm.n_index[r];
    std::memset(pm.bases[r] + mask_at, 0, mask_bytes);
    std::memset(pm.bases[r] + end, 0, bytes - end);
    pm.total_kept += pm.n_kept[r];
    int32_t* header = reinterpret_cast<int32_t*>(pm.bases[r]);
    header[0] = dgc::kMagic;
    header[1] = static_cast<int32_t>(b.fingerprint);
    header[2] = static_cast<int32_t>(pm.n_kept[r]);
    header[3] = static_cast<int32_t>(pm.n_index[r]);
    header[4] = static_cast<int32_t>(pm.scale_words[r]);
  }
}

// The varint gaps of the sparse tensors' kept columns in row r, from index on.
void write_positions(const PayloadMap& pm, int64_t r, uint8_t* index) {
  const BucketPlan& b = pm.b;
  uint8_t* const index_end = index + pm.n_index[r];
  int64_t prev = -1;
  for (size_t i = 0; i < b.T; ++i) {
    const Spec& t = b.specs[i];
    const Kept& kr = b.kept[i][r];
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

// Stage 4d: the zero bitmaps and varint positions, serially per row, rows in parallel (before the codes, which
// overwrite an in-place acc).
void write_bitmaps_and_positions(const PayloadMap& pm) {
  const BucketPlan& b = pm.b;
  const bool masked = dgc::zero_masked(b.fmt);
  at::parallel_for(0, b.R, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      uint8_t* mask = reinterpret_cast<uint8_t*>(pm.scales_of(r) + pm.n_groups[r]);  // after the scales
      int64_t mb = 0;  // the next bit of the row's bitmap
      if (masked)
        pm.each_mixed(r, [&](size_t i, int64_t x0, int64_t x1) {
          const Kept& kr = b.kept[i][r];
          if (kr.pre) {
            const uint8_t* nz = kr.nonzero.get();
            for (int64_t x = x0; x < x1; ++x, ++mb)
              mask[mb >> 3] |= static_cast<uint8_t>(((nz[x >> 3] >> (x & 7)) & 1) << (mb & 7));
            return;
          }
          const float* acc = kr.values();
          for (int64_t x = x0; x < x1; ++x, ++mb) mask[mb >> 3] |= static_cast<uint8_t>((acc[x] != 0.0f) << (mb & 7));
        });
      if (!b.whole[r]) write_positions(pm, r, pm.values_of(r) + dgc::packed_bytes(pm.n_kept[r], b.fmt));
    }
  });
}

// Stage 4e, one segment's groups [g0, g1) in format F: signed scales, codes (8-bit ones into the payload, narrower
// ones into the row's scratch) and the new residual. Segments the dense pass coded (pre) only take their scales and,
// for 8-bit codes not made in place, a copy of the codes.
template <int F>
void encode_segment(const PayloadMap& pm, int64_t sg, int64_t g0, int64_t g1, uint8_t* scratch_row) {
  const BucketPlan& b = pm.b;
  const int bits = dgc::format_bits(F);
  const int64_t r = sg / pm.T();
  float* scales = pm.scales_of(r) + (g0 - pm.first_group[r]);
  const Kept& kr = pm.kept_of(sg);
  if (kr.pre) {
    const int64_t k0 = g0 - pm.seg_start[sg];
    for (int64_t k = k0; k < k0 + (g1 - g0); ++k) scales[k - k0] = kr.gmixed[k] ? -kr.gscale[k] : kr.gscale[k];
    const int64_t x0 = k0 * b.group_size, x1 = std::min((k0 + (g1 - g0)) * b.group_size, kr.size());
    uint8_t* dst = pm.values_of(r) + pm.seg_v0[sg] + x0;
    if (bits == 8 && kr.codes.get() + x0 != dst) std::memcpy(dst, kr.codes.get() + x0, x1 - x0);
    return;
  }
  const Spec& t = b.specs[sg % pm.T()];
  const float* acc = kr.values();
  uint8_t* codes = (bits < 8 ? scratch_row : pm.values_of(r)) + pm.seg_v0[sg];  // value x of the segment at x
  float* res = t.residual_out ? t.residual_out + r * t.c : nullptr;
  for (int64_t gi = g0; gi < g1; ++gi) {
    const float scale = pm.groups[gi].scale;
    scales[gi - g0] = pm.groups[gi].mixed ? -scale : scale;
    const auto [x0, x1] = pm.range_of(sg, gi);
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
}

// Stage 4e: codes and residuals in parallel over groups: 8-bit codes straight into the payload, narrower ones into a
// scratch row (a byte may hold the codes of two groups), packed by pack_rows.
template <int F>
void encode_groups(const PayloadMap& pm, std::vector<std::unique_ptr<uint8_t[]>>& scratch) {
  const int64_t grain = std::max<int64_t>(1, kBlock / pm.b.group_size);
  at::parallel_for(0, pm.total_groups, grain, [&](int64_t lo, int64_t hi) {
    pm.for_segments(lo, hi, [&](int64_t sg, int64_t g0, int64_t g1) {
      encode_segment<F>(pm, sg, g0, g1, scratch[sg / pm.T()].get());
    });
  });
}

// Stage 4f: each row's narrow codes packed, a tensor at a time (neighbours may share a byte); codes the dense pass
// packed are copied (whole bytes; shifted where the tensor starts inside a byte) unless made in place.
void pack_rows(const PayloadMap& pm, const std::vector<std::unique_ptr<uint8_t[]>>& scratch) {
  const BucketPlan& b = pm.b;
  const int bits = dgc::format_bits(b.fmt);
  for (int64_t r = 0; r < b.R && bits < 8; ++r) {
    const int64_t per = 8 / bits;
    uint8_t* values = pm.values_of(r);
    int64_t v0 = 0;
    for (size_t i = 0; i < b.T; v0 += b.kept[i][r].size(), ++i) {
      const Kept& kr = b.kept[i][r];
      const int64_t cnt = kr.size();
      if (cnt == 0) continue;
      const int64_t first = v0 / per, last = (v0 + cnt - 1) / per;
      if (kr.pre) {
        if (kr.codes.get() != values + first) copy_packed(kr.codes.get(), cnt * bits, (v0 % per) * bits, values + first);
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
}

// Stage 4: the payloads (4a-4f). Returns the payloads and the kept count of all rows.
std::pair<std::vector<at::Tensor>, int64_t> write_payloads(BucketPlan& b) {
  PayloadMap pm(b);
  count_segments(pm);
  group_scales(pm);
  allocate_payloads(pm);
  write_bitmaps_and_positions(pm);
  std::vector<std::unique_ptr<uint8_t[]>> scratch(b.R);  // unpacked narrow codes of the rows coded here
  for (int64_t r = 0; r < b.R && dgc::format_bits(b.fmt) < 8; ++r) {
    bool coded_here = false;
    for (size_t i = 0; i < b.T; ++i) coded_here |= !b.kept[i][r].pre && b.kept[i][r].size() > 0;
    if (coded_here) scratch[r].reset(new uint8_t[std::max<int64_t>(pm.n_kept[r], 1)]);
  }
  switch (b.fmt) {
    case dgc::kInt4: encode_groups<dgc::kInt4>(pm, scratch); break;
    case dgc::kInt2: encode_groups<dgc::kInt2>(pm, scratch); break;
    case dgc::kInt1: encode_groups<dgc::kInt1>(pm, scratch); break;
    case dgc::kFp8E4M3: encode_groups<dgc::kFp8E4M3>(pm, scratch); break;
    default: encode_groups<dgc::kFp8E5M2>(pm, scratch); break;
  }
  pack_rows(pm, scratch);
  return {std::move(pm.payloads), pm.total_kept};
}

}  // namespace

// acc = src / divisor + residual (the divisor holds the world size and the loss scale: everything here is in unscaled
// units). fixed[i] not < 0 (a NaN too, which keeps nothing): tensor i (if sparse) keeps |acc| >= fixed[i] instead of
// estimating a threshold from its sample, without DGC's corrections. reuse: the fixed thresholds are top-k thresholds
// of an earlier step (Ok-Topk's threshold reuse): they apply only where k < m, and more than 1.3 k kept still becomes
// the k largest. Returns the payloads, the new residuals, finiteness, the kept count and, per tensor, the threshold
// that selected it (-1: every real element was kept).
//
// One bucket compressed: plan_bucket, estimate_thresholds (1), accumulate_and_collect (2, the dense pass),
// correct_towards_k (3), send_whole_rows (3b), write_payloads (4). Returns the payloads (one per row), the new
// residuals, whether every accumulated value was finite, the kept count and each tensor's threshold (-1: none).
std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>, bool, int64_t, std::vector<double>> compress_bucket(
    std::vector<at::Tensor> srcs, std::vector<int64_t> offsets, std::vector<int64_t> strides,
    std::vector<at::Tensor> residuals, std::vector<int64_t> residual_numels, std::vector<int64_t> numels,
    std::vector<int64_t> chunks, std::vector<bool> sparse, std::vector<int64_t> row_owner, std::vector<int64_t> ks,
    std::vector<at::Tensor> samples, double divisor, int64_t group_size, int64_t fmt, int64_t fingerprint,
    bool want_residual, std::vector<double> fixed, bool reuse) {
  BucketPlan b = plan_bucket(srcs, offsets, strides, residuals, residual_numels, numels, chunks, sparse, row_owner, ks,
                             samples, divisor, group_size, fmt, fingerprint, want_residual, std::move(fixed), reuse);
  estimate_thresholds(b);
  if (!accumulate_and_collect(b)) {
    std::vector<at::Tensor> payloads;
    for (int64_t r = 0; r < b.R; ++r) payloads.push_back(header_only_payload(fingerprint));
    return {payloads, {}, false, 0, std::vector<double>(b.T, -1.0)};
  }
  correct_towards_k(b);
  send_whole_rows(b);
  auto [payloads, total_kept] = write_payloads(b);
  std::vector<double> used(b.T, -1.0);
  for (size_t i = 0; i < b.T; ++i)
    if (b.thr[i] >= 0) used[i] = static_cast<double>(b.thr[i]);
  return {payloads, b.res_out, true, total_kept, used};
}


}  // namespace dgc_cpu
