// Sum of squares of a run of floating-point values, accumulated in double: the CPU core of the
// AMP inf/NaN check and gradient norm. Squares of finite fp32/fp16/bf16 values cannot overflow
// a double, so a non-finite result means an inf/NaN input. Shared by the AMP kernels and the
// shared-memory all-reduce (which squares each block it has just written, while it is in L1).
#pragma once

#include <cstdint>

namespace fastddp {

template <typename T>
double sum_squares(const T* p, int64_t n) {
  // Four independent accumulators let the compiler vectorise the loop (a single one is a
  // serial dependency chain, as floating-point addition may not be reordered).
  double acc[4] = {0, 0, 0, 0};
  int64_t k = 0;
  for (; k + 4 <= n; k += 4) {
    for (int j = 0; j < 4; ++j) {
      const double v = static_cast<double>(p[k + j]);
      acc[j] += v * v;
    }
  }
  for (; k < n; ++k) {
    const double v = static_cast<double>(p[k]);
    acc[0] += v * v;
  }
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

}  // namespace fastddp
