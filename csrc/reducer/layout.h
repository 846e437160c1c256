// The bucket layout rules, in one place: how parameters are grouped into buckets, and the
// 64-byte alignment of every flat buffer placed in shared memory (gradient buckets and the
// packed module buffers of the per-forward broadcast).
#pragma once

#include "reducer/options.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace fastddp::reducer {

// Every tensor packed into the shared-memory broadcast region starts on its own cache line,
// so vector loads and stores stay aligned.
constexpr int64_t kBufferAlignment = 64;

inline int64_t aligned_bytes(int64_t bytes) {
  return (bytes + kBufferAlignment - 1) / kBufferAlignment * kBufferAlignment;
}

// Bytes `tensors` take packed one after the other, each at an aligned offset.
int64_t packed_bytes(const std::vector<at::Tensor>& tensors);

// Bucket indices, filled in `order` (every parameter index once), grouped by (device, dtype),
// within the caps of `options` (bucket_cap_mb, first_bucket_mb, bucket_caps_mb).
std::vector<std::vector<int64_t>> plan_buckets(const std::vector<at::Tensor>& params,
                                               const std::vector<int64_t>& order, const ReducerOptions& options);

// Reverse registration order: the gradients of the last layers arrive first in backward.
std::vector<int64_t> registration_order_reversed(int64_t count);

}  // namespace fastddp::reducer
