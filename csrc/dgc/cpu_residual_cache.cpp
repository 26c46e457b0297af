// Reused memory for the new residuals of 32 MB or more.
#include "cpu_common.h"

namespace dgc_cpu {

// New residuals of 32 MB or more come from here. glibc maps memory of that size afresh for each allocation (32 MB is
// its largest threshold), so each step's residual would fault in its 4 KB pages one by one as the dense pass first
// writes them, several times the cost of the pass itself (results/kernels.md).
// Freed buffers are kept, at most kKeep (past that the oldest freed is freed), and handed out again for the same
// size, the last freed first, as a caching allocator does on a GPU: a bucket's new residual takes the memory that
// the bucket before it freed. What this holds beyond the live residuals is at most kKeep freed buffers (the largest
// residuals' size each). They are 2 MB-aligned and advised for transparent huge pages (madvise
// MADV_HUGEPAGE: advice only, ignored where the kernel's THP setting is "never"). release_residual_cache() frees
// the kept ones.
class ResidualCache {
 public:
  static constexpr size_t kHuge = size_t(2) << 20;
  static constexpr size_t kFrom = 16 * kHuge;
  static constexpr size_t kKeep = 2;

  static ResidualCache& get() {
    static ResidualCache* cache = new ResidualCache();  // never destroyed: tensors may free into it at exit
    return *cache;
  }

  // uninitialised memory of `bytes` (>= kFrom). Throws std::bad_alloc when no memory is left.
  void* take(size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto it = kept_.rbegin(); it != kept_.rend(); ++it)  // the last freed first (warmest in cache)
        if (it->second == bytes) {
          void* q = it->first;
          kept_.erase(std::next(it).base());
          return q;
        }
    }
    void* q = nullptr;
    if (posix_memalign(&q, kHuge, bytes) != 0) throw std::bad_alloc();
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    madvise(q, bytes / kHuge * kHuge, MADV_HUGEPAGE);
#endif
    return q;
  }

  void give_back(void* q, size_t bytes) {
    void* drop = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      kept_.emplace_back(q, bytes);
      if (kept_.size() > kKeep) {
        drop = kept_.front().first;
        kept_.erase(kept_.begin());
      }
    }
    std::free(drop);
  }

  // frees every kept buffer; returns their bytes
  int64_t release() {
    std::vector<std::pair<void*, size_t>> all;
    {
      std::lock_guard<std::mutex> lock(mu_);
      all.swap(kept_);
    }
    int64_t bytes = 0;
    for (auto& [q, n] : all) {
      std::free(q);
      bytes += static_cast<int64_t>(n);
    }
    return bytes;
  }

 private:
  std::mutex mu_;
  std::vector<std::pair<void*, size_t>> kept_;  // oldest freed first
};

// An uninitialised fp32 tensor of n elements for a new residual (from ResidualCache from 32 MB on).
at::Tensor residual_empty(int64_t n) {
  const size_t bytes = static_cast<size_t>(n) * sizeof(float);
  if (bytes < ResidualCache::kFrom) return at::empty({n}, at::kFloat);
  void* q = ResidualCache::get().take(bytes);
  return at::from_blob(q, {n}, [bytes](void* x) { ResidualCache::get().give_back(x, bytes); },
                       at::TensorOptions().dtype(at::kFloat));
}

int64_t release_residual_cache() { return ResidualCache::get().release(); }


}  // namespace dgc_cpu
