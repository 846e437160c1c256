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

// torch DDP's bucket layouts, computed by torch's own assignment
// (c10d::compute_bucket_assignment_by_size) with the size limits torch DDP gives it, so a
// communication hook sees the buckets it sees under torch DDP: each lists parameter indices in
// the order they are laid out in the flat buffer.
//
// The layout at construction: parameters taken in registration order, the buckets listed in
// reverse (the gradients of the last layers arrive first). Without find_unused_parameters (or
// with static_graph) one bucket per (device, dtype) until the rebuild; with it, buckets of
// first_bucket_mb then bucket_cap_mb, never rebuilt. bucket_caps_mb, when given, are the limits.
std::vector<std::vector<int64_t>> initial_buckets(const std::vector<at::Tensor>& params, const ReducerOptions& options);

// Whether the buckets are rebuilt once in gradient arrival order (torch DDP: unless
// find_unused_parameters without static_graph).
bool rebuilds_buckets(const ReducerOptions& options);

// The rebuilt layout: parameters taken in `order` (every index once), limits first_bucket_mb
// then bucket_cap_mb (or bucket_caps_mb), each bucket closed once it reaches its limit.
std::vector<std::vector<int64_t>> rebuilt_buckets(const std::vector<at::Tensor>& params,
                                                  const std::vector<int64_t>& order, const ReducerOptions& options);

}  // namespace fastddp::reducer
