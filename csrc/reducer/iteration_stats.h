// What the last reducing backward did and when, for torch DDP's sampled runtime statistics
// (_get_ddp_logging_data(): forward, backward compute and communication times). The reducer
// records it on every reducing backward (a clock read per phase); the wrapper samples it at
// torch's iterations.
#pragma once

#include <chrono>
#include <cstdint>
#include <vector>

namespace fastddp::reducer {

// Host time in nanoseconds since the epoch, the clock torch's logger reports.
inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch()).count();
}

struct IterationStats {
  int64_t backward_compute_start = -1;  // the reducer armed for the backward (the forward's end)
  int64_t backward_compute_end = -1;    // the reduction finalised: every gradient arrived
  int64_t backward_comm_start = -1;     // the first bucket's collective launched
  int64_t backward_comm_end = -1;       // every bucket reduced, its gradients in place
  int64_t buckets_reduced = 0;          // buckets launched in this backward
  int64_t unused_parameter_bytes = 0;   // parameters the graph did not reach (find_unused / static_graph)
  std::vector<int64_t> ready_order;     // parameter indices as their gradients arrived (not in
                                        // static_graph's first iteration, as torch's)

  // A new backward: times unset, counts zero (the order keeps its memory).
  void reset() {
    backward_compute_start = backward_compute_end = backward_comm_start = backward_comm_end = -1;
    buckets_reduced = unused_parameter_bytes = 0;
    ready_order.clear();
  }
};

}  // namespace fastddp::reducer
