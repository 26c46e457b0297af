// The dense pass: one read of every gradient and residual element and one write of the new residual, the
// elements at or over the threshold compacted as it goes, rows sent whole coded while in cache.
#include "cpu_common.h"
#include "cpu_accumulate.h"
#include "cpu_coders.h"

namespace dgc_cpu {

namespace {

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

}  // namespace

// Runs the dense pass over `tasks`, returns the non-finite count; kept[i][r] gets the candidates.
// With `pre`, rows kept whole are coded in the same pass (their blocks must hold whole scale groups).
int64_t dense_pass(std::vector<Spec>& specs, const Params& p, const std::vector<Task>& tasks,
                   const std::vector<float>& thr, std::vector<std::vector<Kept>>& kept, bool write_residual,
                   const PreEncode* pre) {
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


bool avx2_paths() { return kHaveAvx2; }

}  // namespace dgc_cpu
