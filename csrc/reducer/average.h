// How the reducer averages the gradients over the ranks, with torch DDP's bits: each rank's
// gradient is scaled as it enters its bucket (or by the shared-memory sum as it reads it), then
// the ranks' values are summed. torch DDP's reducer multiplies by 1 / divisor; torch's
// allreduce_hook divides by the world size (tensor.div_). The two round differently where
// 1 / divisor is inexact (a world size that is not a power of two), so the reducer does what
// the script asked for. The divisor is the world size; inside join() with
// divide_by_initial_world_size=False, the number of ranks still training, for one reduction.
#pragma once

#include "reducer/shm_kernels.h"

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace fastddp::reducer {

class Average {
 public:
  // `divide`: x / divisor (torch's allreduce_hook), else x * (1 / divisor) (torch's reducer).
  Average(int64_t world, bool divide);

  // The divisor of the next reduction (join()); reset() restores the world size.
  void set_divisor(int64_t divisor);
  void reset() { set_divisor(world_); }

  int64_t divisor() const { return divisor_; }
  bool over_world() const { return divisor_ == world_; }
  bool identity() const { return divisor_ == 1; }

  // out = in averaged, the copy and the scaling in one pass (out may alias in).
  void into(const at::Tensor& out, const at::Tensor& in) const;
  // The same scaling for the shared-memory sum, which applies it as it reads each rank's values.
  Scaling scaling() const;

 private:
  int64_t world_;
  int64_t divisor_;
  bool divide_;
  // A 0-dim CPU double (divisor_, or 1 / divisor_): it scales tensors of any device and dtype
  // without promoting them, as torch's Python scalar does.
  at::Tensor operand_;
};

}  // namespace fastddp::reducer
