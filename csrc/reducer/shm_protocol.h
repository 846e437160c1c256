// What the two halves of the shared-memory transport share (shm_allreduce.cpp runs the
// collectives, shm_peers.cpp waits for and reports on the peers): the per-rank counters a
// collective publishes, how long a wait spins, the broadcast region's header, and the futex
// and counter helpers. Internal to csrc/reducer.
#pragma once

#include "reducer/shm_segment.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <ctime>

namespace fastddp::reducer {

inline constexpr int kReady = 0, kReduced = 1, kDone = 2;
// How long a wait busy-checks its counter before sleeping on the futex. A peer usually arrives
// within this on a latency-bound model, and a sleeping thread lets its (virtual) CPU idle, which
// costs tens to hundreds of µs to wake: the HAR MLP steps 4-8 % faster with 100 µs than with
// 6 µs (2-core VM, world 2); larger models do not change. A clock read every 64 checks.
// The budget adapts (ShmAllreduce::spin_budget_): a wait that outlasts kSpinTime (a peer that
// is descheduled or far behind) halves it, down to kMinSpin, and a wait kSpinTime would have
// caught doubles it again. When a neighbour's process takes the cores, waits for a preempted peer
// last time slices, and a full spin before each of them burnt most of the wrapper's CPU time.
inline constexpr auto kSpinTime = std::chrono::microseconds(100);
inline constexpr auto kMinSpin = std::chrono::microseconds(3);
inline constexpr auto kLivenessPeriod = std::chrono::milliseconds(200);

// In front of rank 0's broadcast region: the descriptor of the broadcast the region holds. Rank
// 0's slot cannot say it: rank 0 does not wait for its peers after a broadcast, so its slot may
// already describe its next collective when a peer reads the broadcast.
inline constexpr int64_t kBroadcastHeaderBytes = 64;
static_assert(sizeof(OpDescriptor) <= kBroadcastHeaderBytes);

inline int futex_wait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::milliseconds timeout) {
  timespec ts{static_cast<time_t>(timeout.count() / 1000), static_cast<long>((timeout.count() % 1000) * 1000000)};
  return static_cast<int>(syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0));
}

inline void futex_wake(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

inline bool seq_reached(uint32_t value, uint32_t seq) { return static_cast<int32_t>(value - seq) >= 0; }

}  // namespace fastddp::reducer
