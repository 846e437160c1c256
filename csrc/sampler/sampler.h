// DistributedSampler core: this rank's indices for one epoch, as an int64 tensor.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace fastddp::sampler {

enum class Order : int { kTorch = 0, kStateless = 1 };

struct Plan {
  int64_t length = 0;       // dataset length
  int64_t replicas = 1;     // number of ranks
  int64_t rank = 0;         // this rank
  bool shuffle = true;
  int64_t seed = 0;
  int64_t epoch = 0;
  bool drop_last = false;
  Order order = Order::kTorch;
};

// Samples per rank, exactly as torch.utils.data.DistributedSampler computes num_samples.
int64_t num_samples(int64_t length, int64_t replicas, bool drop_last);

// This rank's indices for plan.epoch. kTorch reproduces torch's sampler exactly (the same
// randperm seeded with seed + epoch, the same wrap-around padding or truncation, the same
// rank::replicas stride). kStateless computes only this rank's share of a seeded bijection,
// in O(num_samples) time and memory, never materialising the whole permutation.
at::Tensor epoch_indices(const Plan& plan);

}  // namespace fastddp::sampler
