// SlotPool: the host staging buffers of one loader's passes, handed from a pass's pipeline to
// the next one's. A pass is one PrefetchPipeline; without the pool every pass allocates its
// ring afresh, and the allocator serves blocks of a few MB from memory the kernel has not
// mapped yet: the first write to each 4 KiB page is a page fault. On the video clips
// (4.8 MB batches, 48 batches a pass) that was 1,600 faults a pass.
//
// Only unpinned buffers are pooled: they are written and read on the CPU alone, so a buffer
// is free for reuse exactly when no tensor but the pool's refers to its storage. Pinned
// staging buffers come from torch's caching host allocator, which already reuses them and
// orders the reuse after the device copies that read them.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <mutex>
#include <vector>

namespace fastddp::data {

// True when a tensor other than these refers to the storage of one of them (a batch the
// consumer kept is a view of its slot's buffers).
bool held_elsewhere(const std::vector<at::Tensor>& buffers);

class SlotPool {
 public:
  // One slot's buffers (one per source) for at least `rows` rows shaped as `sources`' rows,
  // that nobody else holds; empty when the pool has none.
  std::vector<at::Tensor> take(const std::vector<at::Tensor>& sources, int64_t rows);
  // Returns a finished pass's ring. The pool then keeps at most one ring and one slot more
  // (the last batch, which the consumer usually still holds when the pass ends), dropping
  // first the buffers a consumer still holds, then the oldest: memory stays what one pass uses.
  void give(std::vector<std::vector<at::Tensor>> ring);
  int64_t size() const;

 private:
  mutable std::mutex mutex_;
  std::vector<std::vector<at::Tensor>> free_;
};

}  // namespace fastddp::data
