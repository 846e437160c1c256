#include "amp/bucket_stats.h"

#include "amp/amp.h"

#include <ATen/ops/zeros.h>

namespace fastddp::amp {

void BucketStats::begin(const at::Tensor& first) {
  std::lock_guard<std::mutex> lock(mutex_);
  pending_ = at::zeros({1}, first.options().dtype(at::kDouble));
  ready_ = at::Tensor();
}

void BucketStats::visit(int64_t index, const at::Tensor& buffer, std::optional<double> sum_of_squares) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(pending_.defined(), "GradScaler: bucket ", index, " was handed over outside a reduction");
  TORCH_CHECK(buffer.device() == pending_.device(), "GradScaler: gradient statistics need every bucket on one "
              "device; bucket ", index, " is on ", buffer.device(), ", bucket 0 on ", pending_.device());
  if (sum_of_squares) {
    // Only the shared-memory (CPU) reduction computes it: the statistics live on the CPU.
    pending_.data_ptr<double>()[0] += *sum_of_squares;
  } else {
    accumulate_stats_({buffer}, pending_);
  }
}

void BucketStats::end() {
  std::lock_guard<std::mutex> lock(mutex_);
  ready_ = pending_;
  pending_ = at::Tensor();
}

void BucketStats::invalidate() {
  std::lock_guard<std::mutex> lock(mutex_);
  ready_ = at::Tensor();
}

at::Tensor BucketStats::take() {
  std::lock_guard<std::mutex> lock(mutex_);
  at::Tensor out = ready_;
  ready_ = at::Tensor();
  return out;
}

}  // namespace fastddp::amp
