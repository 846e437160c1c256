// Shared-memory all-reduce for the ranks of one process group that run on one host (CPU
// gradients). Gloo moves every byte of a co-located all-reduce through the kernel's TCP stack;
// here the ranks meet in one shared mapping holding, per rank, a small staging ring of two
// fixed-size chunk slots. A bucket is reduced chunk by chunk: each rank copies its chunk into a
// slot, sums its 1/world slice of that chunk straight from its peers' slots, and copies the
// other slices back into its own gradients; the two slots alternate, so a rank fills the next
// chunk while its peers still read the last. Per rank, of each chunk: (world - 1)/world
// copied in, world slice reads and two slice writes (gradients, slot) for the reduction,
// (world - 1)/world copied out; no system call on the data path. The mapping's size does not grow with the model: gradients stay in private memory, and
// each rank maps world x (2 chunks + the broadcast region), so neither RSS nor /dev/shm holds a
// second copy of the model's gradients.
//
// The process group stays in charge: it decides membership and rank numbers, carries the
// set-up handshake (which also proves that every rank sees the same /dev/shm), and everything
// that is not a bucket all-reduce. Synchronisation is three monotonic per-rank counters in the
// mapping (one sequence number per chunk), waited on with futexes; a waiting rank checks its
// peers' processes so a dead peer fails the collective within a second with a DistBackendError
// naming it. Each rank also describes the collective it runs (kind, size, dtype) in its slot, and
// rank 0 which broadcast its broadcast region holds: ranks that issued different collectives at
// one sequence number (a forward, and so a buffer broadcast, on some ranks only) fail with an
// error naming both instead of reading each other's data or waiting for ever; a rank whose
// collective failed, or whose wrapper was destroyed, marks its slot so that a peer waiting for
// it fails at once.
#pragma once

#include "common/fork_safe.h"
#include "reducer/fingerprint.h"
#include "reducer/ring_order.h"
#include "reducer/shm_kernels.h"

#include <ATen/core/Tensor.h>
#include <ATen/record_function.h>
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

struct ShmSegment;       // the mapping
struct OpDescriptor;  // a collective as a rank announces it (shm_segment.h)

// The handle of one shared-memory collective. With `sum_of_squares` requested, the rank's comm
// thread also adds up the squares of the reduced values as it writes them (its own slice) and
// copies them (the peers' slices): the AMP statistics of the bucket without another pass.
// While a profiler runs, c10d::Work records the collective as an event named `title` (as gloo's
// are "gloo:all_reduce"), from its launch until the comm thread completes it; without one no
// title is passed, so c10d sets up no recording for the collective. No tensor goes with the
// event: it would hold the bucket's memory until the event ends.
class ShmWork : public c10d::Work {
 public:
  ShmWork(c10d::OpType type, const char* title) : c10d::Work(-1, type, at::hasCallbacks() ? title : nullptr) {}
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

// A contiguous run of a collective's elements in a rank's memory. An all-reduce's elements are
// the concatenation of its pieces, in order: a bucket's flat buffer is one piece; a bucket whose
// large gradients are reduced in place in their .grad tensors is several.
struct ShmPiece {
  char* data;
  int64_t numel;
};

class ShmAllreduce {
 public:
  // Collective over `pg` (every rank must call it). Returns nullptr on every rank when some
  // rank did not want it, the ranks do not share this host's /dev/shm, or the mapping could not
  // be set up on some rank; `why` then says why (on every rank). `gradient_bytes` is the
  // gradient memory each rank reduces per backward (it sizes the chunks, see chunk_bytes_for),
  // `broadcast_bytes` the room for broadcast_from_root (module buffers); `timeout` bounds a
  // wait for a live peer.
  static std::shared_ptr<ShmAllreduce> create(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, bool wanted,
                                              int64_t gradient_bytes, int64_t broadcast_bytes,
                                              std::chrono::milliseconds timeout, std::string* why);
  // The chunk (staging slot) size for `gradient_bytes` of gradients over `world` ranks: the
  // 2 x world slots a rank touches (its own two, and each peer's two it reads) add up to a sixth
  // of the gradients, each between 64 KiB and 1 MiB. Every chunk costs two rounds of waits for
  // the peers (the HAR MLP, 2.8 MiB of gradients, steps 4 % slower with 96 KiB chunks than with
  // 176 KiB ones), every slot resident memory beside a small model's gradients.
  static int64_t chunk_bytes_for(int64_t gradient_bytes, int world);
  // The process is ending (called at interpreter exit): a wrapper destroyed from now on leaves
  // its slot as kExited, so a peer still waiting says that this rank's process ended (its
  // script returned, exited or raised) rather than that it destroyed its wrapper.
  static void note_process_exiting();
  ~ShmAllreduce();
  ShmAllreduce(const ShmAllreduce&) = delete;
  ShmAllreduce& operator=(const ShmAllreduce&) = delete;

  int64_t chunk_bytes() const { return chunk_bytes_; }

  // Sums `t` (a contiguous CPU tensor, the same size on every rank) over the ranks in place,
  // each rank's values scaled by `scale` in the same pass (the average over the ranks, as torch
  // DDP scales them before its all-reduce), asynchronously: every rank must issue the same sequence of
  // calls with tensors at the same offsets. `sum_of_squares`: also compute the sum of squares
  // of the result (ShmWork::sum_of_squares), fused into the reduction and copy passes.
  // `fingerprint`: this rank's fingerprint of the reduction, written into its slot before it
  // publishes its arrival; once every peer arrived, the ranks' are compared
  // (ShmWork::fingerprint_mismatch). Every rank passes one for the same collectives.
  c10::intrusive_ptr<ShmWork> allreduce_sum(const at::Tensor& t, Scaling scale = {}, bool sum_of_squares = false,
                                            const Fingerprint* fingerprint = nullptr);
  // The same over `pieces` of `dtype` elements (the same total on every rank; each rank may cut
  // its memory into other pieces). `holders` keep the pieces' memory alive until the collective
  // ends; the comm thread lets go of them before the work completes.
  c10::intrusive_ptr<ShmWork> allreduce_sum(std::vector<ShmPiece> pieces, std::vector<at::Tensor> holders,
                                            at::ScalarType dtype, Scaling scale, bool sum_of_squares,
                                            const Fingerprint* fingerprint);

  // Copies group rank 0's `tensors` (any CPU tensors, at most broadcast_bytes() in all) into
  // every other rank's, in the same sequence as the all-reduces; returns when done here.
  void broadcast_from_root(const std::vector<at::Tensor>& tensors);
  int64_t broadcast_bytes() const { return broadcast_bytes_; }

 private:
  struct Task;
  ShmAllreduce(std::shared_ptr<ShmSegment> segment, int rank, int world, int64_t chunk_bytes,
               int64_t broadcast_offset, int64_t broadcast_bytes, std::chrono::milliseconds timeout);
  void run();
  // Runs one task on the calling thread (the comm thread, or a broadcast's caller while the
  // comm thread is idle); the error it raised, after marking this rank failed.
  std::exception_ptr perform(const Task& task);
  void check_in_owner() const;  // fails in a forked child (no comm thread there)
  void execute(const Task& task);
  double execute_chunk(const Task& task, const RingOrder& order, int64_t chunk, uint32_t seq);
  void exchange_fingerprint(const Task& task);
  void wait_peers(int which, uint32_t seq) const;
  void execute_broadcast(const Task& task);
  void wait_for(int peer, int which, uint32_t seq) const;
  void sleep_until_reached(int peer, int which, uint32_t seq) const;
  void adapt_spin(std::chrono::steady_clock::duration waited) const;
  void publish(int which, uint32_t seq) const;
  void describe_own_op(const OpDescriptor& op) const;
  void check_peers_run(uint32_t seq) const;  // every peer described this rank's all-reduce
  void leave(uint32_t state) const;  // marks this rank's slot kFailed or kClosed (SlotState)
  [[noreturn]] void fail_closed(int peer, bool exited) const;
  OpDescriptor* broadcast_header() const;  // which broadcast rank 0's broadcast region holds
  [[noreturn]] void fail_mismatch(const OpDescriptor& mine, int peer, const OpDescriptor& theirs) const;
  void fail_if_peer_differs(int peer) const;
  [[noreturn]] void fail(const std::string& what) const;

  std::shared_ptr<ShmSegment> segment_;
  int rank_;
  int world_;
  int64_t chunk_bytes_;       // each of a rank's two staging slots
  int64_t broadcast_offset_;  // then the broadcast region
  int64_t broadcast_bytes_;
  std::chrono::milliseconds timeout_;
  uint32_t next_seq_ = 1;  // issued on the caller's thread, under mutex_
  uint32_t last_broadcast_seq_ = 0;  // rank 0, the running task: the region is busy until peers are done
  // the running task: how long a wait busy-checks before sleeping (adapt_spin, kSpinTime in shm_protocol.h)
  mutable std::chrono::steady_clock::duration spin_budget_;

  std::mutex mutex_;
  ParentOnly<std::condition_variable> cv_owner_;  // a forked child leaves it (common/fork_safe.h)
  std::condition_variable& cv_ = *cv_owner_;
  std::deque<Task> queue_;
  bool busy_ = false;  // a task is running (on the comm thread or a broadcast's caller); under mutex_
  std::atomic<bool> stop_{false};
  std::string broken_;  // first failure; every later collective fails with it
  std::thread thread_;
  int owner_pid_;  // a forked child inherits this object but not the thread
};

}  // namespace fastddp::reducer
