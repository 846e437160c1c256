// The reducer's extension point after a reduction: a visitor sees each flat bucket as soon as
// its reduced values are final, while the later buckets are still on the wire, so a consumer
// (fastddp.GradScaler's inf/NaN check and norm) reads the gradients while they are hot instead
// of in another pass after backward. The reducer knows nothing of what visitors compute.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace fastddp::reducer {

class BucketVisitor {
 public:
  virtual ~BucketVisitor() = default;

  // Whether a reduction that reads every element anyway (the shared-memory sum) should also
  // sum the squares of each bucket's result and hand that to visit().
  virtual bool wants_sum_of_squares() const { return false; }

  // A reduced backward starts handing over its buckets; `first` is bucket 0's buffer.
  virtual void begin(const at::Tensor& first) { (void)first; }
  // Bucket `index` holds its final values in `buffer`; `sum_of_squares` is set when the
  // reduction computed it (see wants_sum_of_squares). Called with the reducer's lock held,
  // in bucket order.
  virtual void visit(int64_t index, const at::Tensor& buffer, std::optional<double> sum_of_squares) = 0;
  // Every bucket of this backward was visited.
  virtual void end() {}
  // The gradients changed after the last reduction (a no_sync() backward, a new reducing
  // forward): anything computed from the visited buckets is stale.
  virtual void invalidate() {}
};

}  // namespace fastddp::reducer
