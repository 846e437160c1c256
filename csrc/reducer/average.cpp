// The reducer's averaging over the ranks (average.h).
#include "reducer/average.h"

#include <ATen/ops/div.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/scalar_tensor.h>
#include <c10/util/Exception.h>

namespace fastddp::reducer {

Average::Average(int64_t world, bool divide) : world_(world), divisor_(0), divide_(divide) {
  TORCH_CHECK(world >= 1, "DDPWrapper: a world of ", world, " ranks");
  set_divisor(world);
}

void Average::set_divisor(int64_t divisor) {
  TORCH_CHECK(divisor >= 1 && divisor <= world_, "DDPWrapper: the gradients are averaged over 1 to ", world_,
              " ranks, got ", divisor);
  if (divisor == divisor_) return;
  divisor_ = divisor;
  const double value = divide_ ? static_cast<double>(divisor) : 1.0 / static_cast<double>(divisor);
  operand_ = at::scalar_tensor(value, at::TensorOptions().dtype(at::kDouble));
}

void Average::into(const at::Tensor& out, const at::Tensor& in) const {
  // out= overloads take a non-const reference; `out` is a handle, its storage is what changes
  at::Tensor target = out;
  if (divide_) {
    at::div_out(target, in, operand_);
  } else {
    at::mul_out(target, in, operand_);
  }
}

Scaling Average::scaling() const {
  if (divide_) return Scaling{static_cast<double>(divisor_), true};
  return Scaling{1.0 / static_cast<double>(divisor_), false};
}

}  // namespace fastddp::reducer
