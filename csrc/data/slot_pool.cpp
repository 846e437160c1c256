#include "data/slot_pool.h"

#include <algorithm>

namespace fastddp::data {

bool held_elsewhere(const std::vector<at::Tensor>& buffers) {
  for (const auto& t : buffers)
    if (t.defined() && t.storage().use_count() > 1) return true;
  return false;
}

namespace {

// Same dtype and row shape as each source, at least `rows` rows.
bool fits(const std::vector<at::Tensor>& buffers, const std::vector<at::Tensor>& sources, int64_t rows) {
  if (buffers.size() != sources.size()) return false;
  for (size_t i = 0; i < buffers.size(); ++i) {
    const auto& b = buffers[i];
    const auto& s = sources[i];
    if (b.scalar_type() != s.scalar_type() || b.dim() != s.dim() || b.size(0) < rows) return false;
    if (!std::equal(b.sizes().begin() + 1, b.sizes().end(), s.sizes().begin() + 1)) return false;
  }
  return true;
}

}  // namespace

std::vector<at::Tensor> SlotPool::take(const std::vector<at::Tensor>& sources, int64_t rows) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (fits(*it, sources, rows) && !held_elsewhere(*it)) {
      std::vector<at::Tensor> out = std::move(*it);
      free_.erase(it);
      return out;
    }
  }
  return {};
}

void SlotPool::give(std::vector<std::vector<at::Tensor>> ring) {
  std::lock_guard<std::mutex> lock(mutex_);
  const size_t keep = ring.size() + 1;
  for (auto& buffers : ring)
    if (!buffers.empty()) free_.push_back(std::move(buffers));
  while (free_.size() > keep) {
    auto kept = std::find_if(free_.begin(), free_.end(), held_elsewhere);
    free_.erase(kept != free_.end() ? kept : free_.begin());
  }
}

int64_t SlotPool::size() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<int64_t>(free_.size());
}

}  // namespace fastddp::data
