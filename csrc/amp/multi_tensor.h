// The one multi-tensor utility every fused AMP op uses on the CPU: a list of tensors cut into
// chunks of at most `chunk` elements, processed in parallel (at::parallel_for) with one
// partial result per chunk so reductions are deterministic.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace fastddp::amp {

struct Chunk {
  int64_t tensor;
  int64_t begin;
  int64_t end;
};

inline std::vector<Chunk> plan_chunks(const std::vector<at::Tensor>& tensors, int64_t chunk) {
  std::vector<Chunk> plan;
  for (int64_t t = 0; t < static_cast<int64_t>(tensors.size()); ++t) {
    const int64_t n = tensors[t].numel();
    for (int64_t b = 0; b < n; b += chunk) plan.push_back({t, b, std::min(n, b + chunk)});
  }
  return plan;
}

// Calls fn(chunk_index, chunk) for every chunk, in parallel.
template <typename Fn>
void for_each_chunk(const std::vector<Chunk>& plan, Fn&& fn) {
  at::parallel_for(0, static_cast<int64_t>(plan.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) fn(i, plan[i]);
  });
}

}  // namespace fastddp::amp
