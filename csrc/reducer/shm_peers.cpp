// The shared-memory transport's dealings with its peers: publishing this rank's progress,
// waiting for theirs (a short spin, then the futex, with the liveness and timeout checks), and
// the errors that name who issued what when the ranks disagree, a peer failed, left or died.
#include "reducer/shm_allreduce.h"
#include "reducer/shm_protocol.h"
#include "reducer/shm_segment.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <string>

namespace fastddp::reducer {

void ShmAllreduce::leave(uint32_t state) const {
  auto& slot = segment_->slot(rank_);
  uint32_t running = kRunning;  // the first reason stays
  if (!slot.state.compare_exchange_strong(running, state, std::memory_order_acq_rel)) return;
  for (auto& word : slot.counter) futex_wake(&word);  // peers asleep on this rank look now
}

void ShmAllreduce::describe_own_op(const OpDescriptor& op) const {
  segment_->slot(rank_).op = op;  // made visible by the release store of the collective's first publish
}

void ShmAllreduce::publish(int which, uint32_t seq) const {
  auto* word = &segment_->slot(rank_).counter[which];
  word->store(seq, std::memory_order_release);
  futex_wake(word);
}

void ShmAllreduce::adapt_spin(std::chrono::steady_clock::duration waited) const {
  if (waited > kSpinTime) {
    spin_budget_ = std::max<std::chrono::steady_clock::duration>(kMinSpin, spin_budget_ / 2);
  } else {
    spin_budget_ = std::min<std::chrono::steady_clock::duration>(kSpinTime, spin_budget_ * 2);
  }
}

void ShmAllreduce::wait_for(int peer, int which, uint32_t seq) const {
  auto& slot = segment_->slot(peer);
  auto* word = &slot.counter[which];
  if (seq_reached(word->load(std::memory_order_acquire), seq)) return;
  const auto begin = std::chrono::steady_clock::now();
  const auto spin_until = begin + spin_budget_;
  for (uint32_t i = 1;; ++i) {
    if (seq_reached(word->load(std::memory_order_acquire), seq)) return adapt_spin(std::chrono::steady_clock::now() - begin);
    cpu_relax();
    if (i % 64 == 0 && std::chrono::steady_clock::now() >= spin_until) break;
  }
  sleep_until_reached(peer, which, seq);
  adapt_spin(std::chrono::steady_clock::now() - begin);
}

void ShmAllreduce::wait_peers(int which, uint32_t seq) const {
  for (int k = 1; k < world_; ++k) wait_for((rank_ + k) % world_, which, seq);
}

// Sleeps on the futex until the peer's counter reaches seq, checking every kLivenessPeriod that
// the peer is alive and that the wait is within the process group's timeout.
void ShmAllreduce::sleep_until_reached(int peer, int which, uint32_t seq) const {
  auto& slot = segment_->slot(peer);
  auto* word = &slot.counter[which];
  const auto start = std::chrono::steady_clock::now();
  auto next_check = start + kLivenessPeriod;
  while (true) {
    const uint32_t value = word->load(std::memory_order_acquire);
    if (seq_reached(value, seq)) return;
    const uint32_t state = slot.state.load(std::memory_order_acquire);
    if (state != kRunning) {
      if (seq_reached(word->load(std::memory_order_acquire), seq)) return;  // published before it left
      fail_if_peer_differs(peer);
      if (state == kClosed || state == kExited) fail_closed(peer, state == kExited);
      fail("fastddp shared-memory all-reduce: rank " + std::to_string(peer) + " stopped in collective " +
           std::to_string(seq) + ": a collective failed there (its error says why)");
    }
    futex_wait(word, value, std::chrono::milliseconds(20));
    const auto now = std::chrono::steady_clock::now();
    if (now < next_check) continue;
    next_check = now + kLivenessPeriod;
    if (stop_.load()) fail("the DDPWrapper was destroyed while an all-reduce was waiting for rank " + std::to_string(peer));
    if (seq_reached(word->load(std::memory_order_acquire), seq)) return;
    if (!peer_alive(slot.pid, slot.start_time)) {
      fail("fastddp shared-memory all-reduce: rank " + std::to_string(peer) + " (pid " + std::to_string(slot.pid) +
           ") exited during collective " + std::to_string(seq) + ": Connection closed by peer");
    }
    if (now - start > timeout_) {
      fail("fastddp shared-memory all-reduce: timed out after " + std::to_string(timeout_.count()) +
           " ms waiting for rank " + std::to_string(peer) + " (pid " + std::to_string(slot.pid) +
           ", alive) in collective " + std::to_string(seq) + "; it is stuck or issued different collectives");
    }
  }
}

void ShmAllreduce::check_peers_run(uint32_t seq) const {
  // Called once every peer published `ready` for the collective's first chunk: each must have
  // described the same all-reduce (it cannot have moved on, that needs this rank's `done`).
  const auto& mine = segment_->slot(rank_).op;
  for (int j = 0; j < world_; ++j) {
    if (j == rank_) continue;
    const auto& theirs = segment_->slot(j).op;
    if (theirs == mine) continue;
    const auto* header = broadcast_header();
    // Rank 0 may have broadcast there and gone on without waiting: its region says so.
    fail_mismatch(mine, j, j == 0 && header->seq == seq ? *header : theirs);
  }
}

void ShmAllreduce::fail_if_peer_differs(int peer) const {
  // A failed peer that had described another collective at this rank's sequence number.
  const auto& mine = segment_->slot(rank_).op;
  const auto& theirs = segment_->slot(peer).op;
  if (theirs.seq == mine.seq && theirs != mine) fail_mismatch(mine, peer, theirs);
}

[[noreturn]] void ShmAllreduce::fail_mismatch(const OpDescriptor& mine, int peer, const OpDescriptor& theirs) const {
  std::string which;  // a forward (its broadcast) facing a backward (its buckets): who is ahead
  const auto kinds = std::minmax(mine.kind, theirs.kind);
  if (kinds.first == kAllreduceOp && kinds.second == kBroadcastOp) {
    const int ahead = mine.kind == kBroadcastOp ? rank_ : peer;
    which = " Rank " + std::to_string(ahead) + " is in a forward where rank " +
            std::to_string(ahead == rank_ ? peer : rank_) + " reduces a backward: rank " + std::to_string(ahead) +
            " ran a forward (gradients on) whose backward did not run, or one forward more.";
  }
  const std::string their_op = theirs.seq == mine.seq ? theirs.describe()
                                                      : "part of another collective (" + theirs.describe() +
                                                            ", from collective " + std::to_string(theirs.seq) + " on)";
  fail("fastddp shared-memory collectives: the ranks issued different collectives. Collective " +
       std::to_string(mine.seq) + " is " + mine.describe() + " on rank " + std::to_string(rank_) + ", but " +
       their_op + " on rank " + std::to_string(peer) + "." + which + " Every rank must run the same forwards (with "
       "gradients on) and backwards: a forward that some ranks run and others do not (one whose loss is never "
       "backwarded, or an evaluation on one rank only) broadcasts the module's buffers on those ranks alone. Run "
       "such forwards on every rank, or on the wrapped module itself (ddp.module) under torch.no_grad().");
}

[[noreturn]] void ShmAllreduce::fail_closed(int peer, bool exited) const {
  const auto& mine = segment_->slot(rank_).op;
  const auto& theirs = segment_->slot(peer).op;
  const std::string me = std::to_string(rank_), them = std::to_string(peer);
  const std::string last = "after its last collective (" +
                           (theirs.kind == kNoOp ? std::string("none") : theirs.describe() + ", from collective " +
                                                                             std::to_string(theirs.seq) + " on") +
                           "), while rank " + me + " waits for it in collective " + std::to_string(mine.seq) +
                           ", " + mine.describe();
  if (exited)
    fail("fastddp shared-memory collectives: rank " + them + "'s process ended (its script returned, exited or "
         "raised: the report of every rank says which) " + last + ".");
  fail("fastddp shared-memory collectives: rank " + them + " destroyed its DDPWrapper " + last + ": rank " + me +
       " ran a forward (gradients on) or a backward that rank " + them + " did not. Every rank must run the same "
       "forwards (with gradients on) and backwards with the wrapper before it is destroyed.");
}

void ShmAllreduce::fail(const std::string& what) const { C10_THROW_ERROR(DistBackendError, what); }

}  // namespace fastddp::reducer
