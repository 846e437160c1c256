// Everything that configures a Reducer, by name, with its default in one place (as c10d's
// ProcessGroupNCCL::Options). Bound to Python as fastddp._C.ReducerOptions.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace fastddp::reducer {

struct ReducerOptions {
  // param.grad is a view into its bucket after a reduced backward (else a copy of it).
  bool gradient_as_bucket_view = true;
  // Search each forward's outputs for the parameters this iteration uses; the rest are ready
  // at once with a zero contribution.
  bool find_unused_parameters = false;
  // The same used parameters, reached the same number of times, in every iteration.
  bool static_graph = false;
  // All-reduce in this dtype (bf16/fp16 compression); none: in the parameters' dtype.
  std::optional<at::ScalarType> comm_dtype;
  // Average each gradient by dividing it by the world size (torch's allreduce_hook:
  // tensor.div_) instead of multiplying it by the inverse (torch DDP's reducer); the last bits
  // differ at a world size that is not a power of two (average.h).
  bool divide_gradients = false;

  // Bucket planning (torch DDP's bucket_cap_mb and bucket_cap_mb_list): buckets of at most
  // bucket_cap_mb MiB, the first at most first_bucket_mb; with bucket_caps_mb, the k-th
  // bucket of each (device, dtype) holds at most bucket_caps_mb[k] MiB (the last for the rest).
  double bucket_cap_mb = 25.0;
  double first_bucket_mb = 1.0;
  std::vector<double> bucket_caps_mb;

  // Shared-memory transport for co-located CPU ranks: nullopt does no handshake (one process,
  // a GPU model, a copy made on one rank); otherwise this rank's wish, agreed with the others'.
  std::optional<bool> shm_allreduce;
  double shm_timeout_s = 1800.0;    // a wait for a live peer gives up after this
  int64_t shm_broadcast_bytes = 0;  // room for the per-forward buffer broadcast (packed_bytes)

  // One multi-tensor copy per full bucket instead of one copy per gradient; nullopt: on GPUs.
  std::optional<bool> batch_copies;
  // A world of one without comm_dtype or hook leaves the gradients where autograd put them.
  bool single_rank_passthrough = true;

  // Every reduction carries a fingerprint (fingerprint.h) that the ranks compare as a by-product
  // of the reduction; a mismatch raises one error on every rank naming the ranks and what differs.
  // Skipped in a world of one and with a communication hook.
  bool fingerprint = true;
  // With find_unused_parameters, also compare the set of parameters the reducing forward used
  // (torch DDP allows it to differ between ranks, so this is off by default).
  bool fingerprint_unused = false;
};

}  // namespace fastddp::reducer
