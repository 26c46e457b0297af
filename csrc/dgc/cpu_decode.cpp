// decode_add: one sender's payload parsed and its values added into an owner's dense fp32 row.
#include "cpu_common.h"

namespace dgc_cpu {

namespace {

using Positions = std::vector<int64_t, NoInit<int64_t>>;

enum class Varint { kOk, kEndsInside, kTooLong, kPastRow };

// The varint gap at ib[b, nb) and the position it leads to from prev (prev + 1 + gap), b moved past it: kOk, or what
// is wrong (the bytes end inside it, it is longer than 9 bytes, the position is at or past `row`). kEnded: the caller
// knows a byte below 0x80 ends ib[b, nb), so the end is not checked per byte.
template <bool kEnded = false>
inline Varint next_position(const uint8_t* ib, int64_t& b, int64_t nb, int64_t row, int64_t& prev) {
  uint64_t gap = 0;
  for (int shift = 0;; shift += 7) {
    if (!kEnded && b >= nb) return Varint::kEndsInside;
    if (shift > 56) return Varint::kTooLong;
    const uint8_t byte = ib[b++];
    gap |= static_cast<uint64_t>(byte & 0x7F) << shift;
    if (!(byte & 0x80)) break;
  }
  if (gap >= static_cast<uint64_t>(row) || prev + 1 + static_cast<int64_t>(gap) >= row) return Varint::kPastRow;
  prev += 1 + static_cast<int64_t>(gap);
  return Varint::kOk;
}

// The positions (columns of a row) that the varint gaps ib[0, nb) encode, each the one before + 1 + its gap (the
// first from -1), as wire.py writes a row's index bytes. Throws std::invalid_argument for bytes ending inside a
// varint, a varint longer than 9 bytes, a position at or past `row`, or a count other than n_indexed.
Positions decode_positions_serial(const uint8_t* ib, int64_t nb, int64_t row, int64_t n_indexed) {
  Positions pos;
  pos.reserve(std::min(n_indexed, nb));  // (each position takes a byte at least: a header's count is not trusted)
  int64_t prev = -1;
  for (int64_t b = 0; b < nb;) {
    switch (next_position(ib, b, nb, row, prev)) {
      case Varint::kEndsInside: throw std::invalid_argument("index bytes end inside a varint");
      case Varint::kTooLong: throw std::invalid_argument("varint longer than 9 bytes");
      case Varint::kPastRow:
        throw std::invalid_argument("index past the partition of " + std::to_string(row) + " elements");
      case Varint::kOk: break;
    }
    pos.push_back(prev);
  }
  if (static_cast<int64_t>(pos.size()) != n_indexed)
    throw std::invalid_argument(std::to_string(nb) + " index bytes hold " + std::to_string(pos.size()) +
                                " positions, expected " + std::to_string(n_indexed));
  return pos;
}

constexpr int64_t kIndexChunk = 16384;  // index bytes per chunk of decode_positions (at least)

// decode_positions_serial's positions, from 2 kIndexChunk index bytes on in parallel over chunks of the bytes. A
// varint ends at a byte below 0x80, so each chunk starts after such a byte and holds whole varints: the count of
// those bytes says where each chunk's positions go, each chunk decodes its gaps into positions relative to its
// start, and then each adds the position its first follows. Bad input seen on the way is left to the serial loop,
// which throws its error for the first bad varint, as before.
Positions decode_positions(const uint8_t* ib, int64_t nb, int64_t row, int64_t n_indexed) {
  const int64_t C = std::min<int64_t>(4 * at::get_num_threads(), nb / kIndexChunk);
  if (C < 2 || ib[nb - 1] >= 0x80) return decode_positions_serial(ib, nb, row, n_indexed);
  std::vector<int64_t> start(C + 1, nb), base(C + 1, 0), step(C, 0);
  start[0] = 0;
  for (int64_t c = 1; c < C; ++c) {  // chunk starts: after a varint's last byte
    int64_t b = std::max(start[c - 1], nb * c / C);
    while (b < nb && ib[b - 1] >= 0x80) ++b;
    start[c] = b;
  }
  at::parallel_for(0, C, 1, [&](int64_t cb, int64_t ce) {
    for (int64_t c = cb; c < ce; ++c) {
      int64_t n = 0;
      for (int64_t b = start[c]; b < start[c + 1]; ++b) n += ib[b] < 0x80;
      base[c + 1] = n;
    }
  });
  for (int64_t c = 0; c < C; ++c) base[c + 1] += base[c];
  if (base[C] != n_indexed) return decode_positions_serial(ib, nb, row, n_indexed);
  Positions pos(n_indexed);
  std::atomic<bool> bad(false);
  at::parallel_for(0, C, 1, [&](int64_t cb, int64_t ce) {
    for (int64_t c = cb; c < ce; ++c) {
      // q: the last position, relative to the position chunk c's first follows + 1 (a relative position past the
      // row is bad too, so no sum of gaps can overflow)
      int64_t q = -1, k = base[c];
      for (int64_t b = start[c]; b < start[c + 1];) {
        if (next_position<true>(ib, b, start[c + 1], row, q) != Varint::kOk) {  // (chunks end after a varint)
          bad = true;
          return;
        }
        pos[k++] = q;
      }
      step[c] = q + 1;
    }
  });
  if (bad) return decode_positions_serial(ib, nb, row, n_indexed);
  std::vector<int64_t> add(C, 0);  // what chunk c's relative positions need added
  for (int64_t c = 1; c < C; ++c) add[c] = add[c - 1] + step[c - 1];
  if (add[C - 1] + step[C - 1] - 1 >= row) return decode_positions_serial(ib, nb, row, n_indexed);
  at::parallel_for(0, C, 1, [&](int64_t cb, int64_t ce) {
    for (int64_t c = cb; c < ce; ++c)
      for (int64_t k = base[c]; k < base[c + 1]; ++k) pos[k] += add[c];
  });
  return pos;
}

}  // namespace

namespace {

// A segment's kept values in the row: implied columns (a tensor sent whole: first column, count) or decoded ones
// (first index into the positions, count).
struct Run {
  bool implied;
  int64_t first, count;
};

// A scale group of the payload: its run, its values [x0, x1) of that run, its first value in the payload and its
// first bit of the zero bitmap.
struct DecodeGroup {
  int64_t run, x0, x1, v0, mb0;
};

// The checks of decode_add's arguments; returns the row's length (columns).
int64_t check_decode_args(const at::Tensor& out, int64_t fmt, const std::vector<int64_t>& seg_real,
                          const std::vector<int64_t>& seg_chunks, const std::vector<bool>& sparse, int64_t group_size,
                          int64_t kept, int64_t n_indexed) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous(), "decode_add: out must be contiguous fp32");
  TORCH_CHECK(fmt >= 0 && fmt < dgc::kNumValueFormats, "decode_add: unknown value format ", fmt);
  const size_t T = seg_chunks.size();
  TORCH_CHECK(seg_real.size() == T && sparse.size() == T, "decode_add: per-tensor lists differ in length");
  TORCH_CHECK(group_size >= 2, "decode_add: group_size must be >= 2");
  int64_t row = 0;
  for (size_t i = 0; i < T; ++i) {
    TORCH_CHECK(seg_chunks[i] >= 0 && seg_real[i] >= 0 && seg_real[i] <= seg_chunks[i],
                "decode_add: tensor ", i, " has ", seg_real[i], " real elements in ", seg_chunks[i], " columns");
    row += seg_chunks[i];
  }
  TORCH_CHECK(out.numel() >= row, "decode_add: out has ", out.numel(), " elements for a row of ", row);
  if (kept < 0 || n_indexed < 0) throw std::invalid_argument("negative kept or indexed count");
  return row;
}

// Each segment's run: implied (all real) for tensors sent whole, its decoded positions for sparse ones. Throws
// std::invalid_argument where a position points into a tensor sent whole, into padding or past the row, or where
// the positions do not add up to `kept`.
std::vector<Run> segment_runs(const Positions& pos, const std::vector<int64_t>& seg_real,
                              const std::vector<int64_t>& seg_chunks, const std::vector<bool>& sparse, int64_t kept) {
  const size_t T = seg_chunks.size();
  std::vector<int64_t> col(T + 1, 0);
  for (size_t i = 0; i < T; ++i) col[i + 1] = col[i] + seg_chunks[i];
  size_t next = 0;
  int64_t total = 0;
  std::vector<Run> runs;
  for (size_t i = 0; i < T; ++i) {
    Run run{!sparse[i], 0, 0};
    // (positions ascend, so pos[next] is the first at or past col[i]; a binary search finds the segment's first
    // position at or past its real elements: in its padding if before col[i + 1])
    if (!sparse[i]) {
      if (next < pos.size() && pos[next] < col[i + 1])
        throw std::invalid_argument("index " + std::to_string(pos[next]) + " points into a tensor sent whole");
      run.first = col[i];
      run.count = seg_real[i];
    } else {
      run.first = static_cast<int64_t>(next);
      next = std::lower_bound(pos.begin() + next, pos.end(), col[i] + seg_real[i]) - pos.begin();
      if (next < pos.size() && pos[next] < col[i + 1])
        throw std::invalid_argument("index " + std::to_string(pos[next]) + " points into padding");
      run.count = static_cast<int64_t>(next) - run.first;
    }
    runs.push_back(run);
    total += run.count;
  }
  if (next < pos.size())
    throw std::invalid_argument("index " + std::to_string(pos[next]) + " past the partition of " +
                                std::to_string(col[T]) + " elements");
  if (total != kept)
    throw std::invalid_argument("payload holds " + std::to_string(total) + " positions for " + std::to_string(kept) +
                                " kept values");
  return runs;
}

// The payload's scale groups (they restart at every run); INT2/INT1: groups flagged by a negative scale carry one
// bit per value (1: non-zero) after the scales. Throws std::invalid_argument where the scale words do not match.
std::vector<DecodeGroup> decode_groups(const std::vector<Run>& runs, const float* sc, int64_t n_words,
                                       int64_t group_size, int64_t fmt) {
  const bool masked = dgc::zero_masked(fmt);
  int64_t expected_groups = 0;
  for (const Run& run : runs) expected_groups += (run.count + group_size - 1) / group_size;
  if (masked ? n_words < expected_groups : n_words != expected_groups)
    throw std::invalid_argument(std::to_string(n_words) + " scales for " + std::to_string(expected_groups) + " groups");
  std::vector<DecodeGroup> groups;
  groups.reserve(expected_groups);
  int64_t n_bits = 0, v = 0;
  for (size_t ri = 0; ri < runs.size(); ++ri) {
    for (int64_t g0 = 0; g0 < runs[ri].count; g0 += group_size) {
      const int64_t g1 = std::min(g0 + group_size, runs[ri].count);
      groups.push_back({static_cast<int64_t>(ri), g0, g1, v + g0, n_bits});
      if (masked && sc[groups.size() - 1] < 0.0f) n_bits += g1 - g0;
    }
    v += runs[ri].count;
  }
  if (masked && n_words != expected_groups + (n_bits + 31) / 32)
    throw std::invalid_argument(std::to_string(n_words) + " scale words for " + std::to_string(expected_groups) +
                                " groups and a zero mask of " + std::to_string(n_bits) + " values");
  return groups;
}

}  // namespace

// One sender's payload decoded and added into an owner's row: check_decode_args, decode_positions, segment_runs,
// decode_groups, then its groups' values added (the loop as one lambda per code width, in parallel over groups).
void decode_add(at::Tensor out, at::Tensor values, at::Tensor scales, at::Tensor index_bytes, int64_t kept,
                int64_t n_indexed, std::vector<int64_t> seg_real, std::vector<int64_t> seg_chunks,
                std::vector<bool> sparse, int64_t group_size, int64_t fmt) {
  const int64_t row = check_decode_args(out, fmt, seg_real, seg_chunks, sparse, group_size, kept, n_indexed);
  const float* sc = scales.data_ptr<float>();
  const Positions pos = decode_positions(index_bytes.data_ptr<uint8_t>(), index_bytes.numel(), row, n_indexed);
  const std::vector<Run> runs = segment_runs(pos, seg_real, seg_chunks, sparse, kept);
  const std::vector<DecodeGroup> groups = decode_groups(runs, sc, scales.numel(), group_size, fmt);
  if (values.numel() < dgc::packed_bytes(kept, fmt)) throw std::invalid_argument("too few value bytes");
  const bool masked = dgc::zero_masked(fmt);
  float* o = out.data_ptr<float>();
  const uint8_t* vals = values.data_ptr<uint8_t>();
  const uint8_t* mask = reinterpret_cast<const uint8_t*>(sc + groups.size());
  float unit[256];  // code -> value at scale 1 (exact: value = unit[code] * scale)
  for (int c = 0; c < 256; ++c) unit[c] = dgc::decode_unit(static_cast<int>(fmt), static_cast<uint8_t>(c));
  // One sender's positions are distinct: groups add into disjoint elements. Per group, its values are decoded into
  // v first (the code width a constant: loops without a branch per value), then added at their columns.
  auto add_groups = [&](auto bits_tag) {
    constexpr int B = decltype(bits_tag)::value;
    at::parallel_for(0, static_cast<int64_t>(groups.size()), 64, [&](int64_t b, int64_t e) {
      thread_local std::vector<float> buf;  // (a group holds at most min(group_size, kept) values)
      buf.resize(std::max<int64_t>(1, std::min(group_size, kept)));
      float* __restrict v = buf.data();
      for (int64_t gi = b; gi < e; ++gi) {
        const DecodeGroup& gr = groups[gi];
        const Run& run = runs[gr.run];
        const int64_t len = gr.x1 - gr.x0;
        const float scale = std::fabs(sc[gi]);
        for (int64_t x = 0; x < len; ++x) v[x] = unit[dgc::unpack_code(vals, gr.v0 + x, B)] * scale;
        if (masked && sc[gi] < 0.0f)  // a mixed group: zero where its bit is 0
          for (int64_t x = 0; x < len; ++x) {
            const int64_t mb = gr.mb0 + x;
            if (!((mask[mb >> 3] >> (mb & 7)) & 1)) v[x] = 0.0f;
          }
        if (run.implied) {
          float* __restrict dst = o + run.first + gr.x0;
          for (int64_t x = 0; x < len; ++x) dst[x] += v[x];
        } else {
          const int64_t* __restrict at_ = pos.data() + run.first + gr.x0;
          for (int64_t x = 0; x < len; ++x) o[at_[x]] += v[x];
        }
      }
    });
  };
  switch (dgc::format_bits(fmt)) {
    case 8: add_groups(std::integral_constant<int, 8>()); break;
    case 4: add_groups(std::integral_constant<int, 4>()); break;
    case 2: add_groups(std::integral_constant<int, 2>()); break;
    default: add_groups(std::integral_constant<int, 1>()); break;
  }
}


}  // namespace dgc_cpu
