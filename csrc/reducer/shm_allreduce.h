// Shared-memory all-reduce for the ranks of one process group that run on one host (CPU
// gradients). Gloo moves every byte of a co-located all-reduce through the kernel's TCP stack;
// here the ranks' gradient buckets live in one shared mapping and each rank sums its 1/world
// slice of every bucket straight from its peers' memory, then copies the other slices back:
// per rank, (world + 1) slice reads + one slice write for the reduction and (world - 1) slice
// copies, no system call on the data path.
//
// The process group stays in charge: it decides membership and rank numbers, carries the
// set-up handshake (which also proves that every rank sees the same /dev/shm), and everything
// that is not a bucket all-reduce. Synchronisation is three monotonic per-rank counters in the
// mapping, waited on with futexes; a waiting rank checks its peers' processes so a dead peer
// fails the collective within a second with a DistBackendError naming it.
#pragma once

#include "reducer/fingerprint.h"

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace fastddp::reducer {

struct ShmSegment;  // the mapping; arena tensors keep it alive

// The handle of one shared-memory collective. With `sum_of_squares` requested, the rank's comm
// thread also adds up the squares of the reduced values as it writes them (its own slice) and
// copies them (the peers' slices): the AMP statistics of the bucket without another pass.
class ShmWork : public c10d::Work {
 public:
  ShmWork() : c10d::Work(-1, c10d::OpType::ALLREDUCE) {}
  void complete(std::exception_ptr error) { finish(std::move(error)); }
  // Valid once wait() returned (set by the comm thread before it completes the work).
  double sum_of_squares() const { return sum_of_squares_; }
  void set_sum_of_squares(double v) { sum_of_squares_ = v; }
  // A collective that carried fingerprints: whether the ranks' differ (valid once wait() returned).
  bool fingerprint_mismatch() const { return fingerprint_mismatch_; }
  void set_fingerprint_mismatch(bool v) { fingerprint_mismatch_ = v; }

 private:
  double sum_of_squares_ = 0.0;
  bool fingerprint_mismatch_ = false;
};

class ShmAllreduce {
 public:
  // Collective over `pg` (every rank must call it). Returns nullptr on every rank when some
  // rank did not want it, the ranks do not share this host's /dev/shm, or the mapping could not
  // be set up on some rank; `why` then says why (on every rank). `arena_bytes` is the gradient
  // memory each rank needs, `broadcast_bytes` the room for broadcast_from_root (module
  // buffers); `timeout` bounds a wait for a live peer.
  static std::shared_ptr<ShmAllreduce> create(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, bool wanted,
                                              int64_t arena_bytes, int64_t broadcast_bytes,
                                              std::chrono::milliseconds timeout, std::string* why);
  ~ShmAllreduce();
  ShmAllreduce(const ShmAllreduce&) = delete;
  ShmAllreduce& operator=(const ShmAllreduce&) = delete;

  // A zero-filled tensor of `numel` elements placed at byte `offset` of this rank's arena;
  // it keeps the mapping alive.
  at::Tensor arena_tensor(int64_t offset, int64_t numel, at::ScalarType dtype) const;
  int64_t arena_bytes() const { return arena_bytes_; }

  // Sums `t` (an arena tensor) over the ranks in place and multiplies the sum by `scale` in the
  // same pass (1/world averages), asynchronously: every rank must issue the same sequence of
  // calls with tensors at the same offsets. `sum_of_squares`: also compute the sum of squares
  // of the result (ShmWork::sum_of_squares), fused into the reduction and copy passes.
  // `fingerprint`: this rank's fingerprint of the reduction, written into its slot before it
  // publishes its arrival; once every peer arrived, the ranks' are compared
  // (ShmWork::fingerprint_mismatch). Every rank passes one for the same collectives.
  c10::intrusive_ptr<ShmWork> allreduce_sum(const at::Tensor& t, double scale = 1.0, bool sum_of_squares = false,
                                            const Fingerprint* fingerprint = nullptr);

  // Copies group rank 0's `tensors` (any CPU tensors, at most broadcast_bytes() in all) into
  // every other rank's, in the same sequence as the all-reduces; returns when done here.
  void broadcast_from_root(const std::vector<at::Tensor>& tensors);
  int64_t broadcast_bytes() const { return broadcast_bytes_; }

 private:
  struct Task;
  ShmAllreduce(std::shared_ptr<ShmSegment> segment, int rank, int world, int64_t arena_bytes,
               int64_t broadcast_offset, int64_t broadcast_bytes, std::chrono::milliseconds timeout);
  void run();
  void execute(const Task& task);
  void execute_broadcast(const Task& task);
  void wait_for(int peer, int which, uint32_t seq) const;
  void publish(int which, uint32_t seq) const;
  [[noreturn]] void fail(const std::string& what) const;

  std::shared_ptr<ShmSegment> segment_;
  int rank_;
  int world_;
  int64_t arena_bytes_;       // gradient part of each rank's arena
  int64_t broadcast_offset_;  // then the broadcast region
  int64_t broadcast_bytes_;
  std::chrono::milliseconds timeout_;
  uint32_t next_seq_ = 1;  // issued on the caller's thread, under mutex_
  uint32_t last_broadcast_seq_ = 0;  // rank 0, comm thread: the region is busy until peers are done

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Task> queue_;
  std::atomic<bool> stop_{false};
  std::string broken_;  // first failure; every later collective fails with it
  std::thread thread_;
  int owner_pid_;  // a forked child inherits this object but not the thread
};

}  // namespace fastddp::reducer
