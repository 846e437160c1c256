// GradScaler's statistics over a DDPWrapper's reduced buckets: a reducer::BucketVisitor that
// adds each bucket's sum of squares (inf/NaN make it non-finite) to one float64 as soon as the
// bucket's reduction is final, overlapping the later buckets' communication. After backward
// only amp::finalize remains.
#pragma once

#include "reducer/bucket_visitor.h"

#include <ATen/core/Tensor.h>

#include <mutex>

namespace fastddp::amp {

class BucketStats : public reducer::BucketVisitor {
 public:
  bool wants_sum_of_squares() const override { return true; }
  void begin(const at::Tensor& first) override;
  void visit(int64_t index, const at::Tensor& buffer, std::optional<double> sum_of_squares) override;
  void end() override;
  void invalidate() override;

  // The float64[1] sum of squares of the last reduced backward, once; undefined when no
  // reduced backward completed since the last take() or since the gradients changed.
  at::Tensor take();

 private:
  std::mutex mutex_;
  at::Tensor pending_;  // being accumulated by the current reduction
  at::Tensor ready_;    // complete, not yet taken
};

}  // namespace fastddp::amp
