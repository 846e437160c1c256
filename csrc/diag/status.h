// What this process is doing in fastddp, for the stall watchdog (watchdog.h): one process-wide
// board of atomics that the reducer and the Python wrapper update at phase changes (a relaxed
// store and a clock read each), and that the watchdog thread reads without any lock.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>

namespace fastddp::diag {

enum class Phase : int32_t {
  kOutside = 0,    // not inside fastddp (the Python stack says where)
  kForward = 1,    // DDPWrapper.forward: the module's forward
  kBackward = 2,   // backward, from the first gradient hook to the end-of-backward wait
  kAllreduce = 3,  // waiting for bucket `detail`'s all-reduce
  kUsedMap = 4,    // waiting for the used-parameter map (find_unused_parameters)
  kBroadcast = 5,  // broadcasting module buffers from rank 0
  kJoin = 6,       // join()'s collectives (uneven inputs)
  kSetup = 7,      // DDPWrapper construction: parameter broadcast and cross-rank checks
  kRebuild = 8,    // the bucket rebuild after the first step (rank 0's order, broadcast)
};

// True for the phases that wait on the other ranks (a stall there is a hang candidate).
constexpr bool waits_on_peers(Phase p) {
  return p == Phase::kAllreduce || p == Phase::kUsedMap || p == Phase::kBroadcast || p == Phase::kJoin ||
         p == Phase::kSetup || p == Phase::kRebuild;
}

std::string phase_name(Phase p);

// Snapshot::detail of a kForward with gradients off (an evaluation): no reduction follows it.
constexpr int64_t kForwardWithoutGradients = 1;

struct Snapshot {
  Phase phase = Phase::kOutside;
  int64_t detail = -1;       // bucket index for kAllreduce; kForwardWithoutGradients for kForward
  int64_t step = 0;          // reducing steps started: forwards with gradients on, outside no_sync()
  int64_t steps_done = 0;    // reducing steps whose reduction finished
  double seconds_in_phase = 0.0;
};

class Status {
 public:
  void enter(Phase phase, int64_t detail = -1) {
    since_ns_.store(now_ns(), std::memory_order_relaxed);
    detail_.store(detail, std::memory_order_relaxed);
    phase_.store(static_cast<int32_t>(phase), std::memory_order_release);
  }
  // The first gradient hook of a backward: enters kBackward unless already there.
  void backward_started() {
    if (phase_.load(std::memory_order_relaxed) != static_cast<int32_t>(Phase::kBackward)) enter(Phase::kBackward);
  }
  void step_started() { step_.fetch_add(1, std::memory_order_relaxed); }
  void step_finished() { steps_done_.store(step_.load(std::memory_order_relaxed), std::memory_order_relaxed); }
  Snapshot snapshot() const;
  // Nanoseconds on the steady clock when the current phase was entered (a stall's identity).
  int64_t phase_since_ns() const { return since_ns_.load(std::memory_order_relaxed); }

  static int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }

 private:
  std::atomic<int32_t> phase_{0};
  std::atomic<int64_t> detail_{-1};
  std::atomic<int64_t> since_ns_{now_ns()};
  std::atomic<int64_t> step_{0};
  std::atomic<int64_t> steps_done_{0};
};

// The process's board.
Status& status();

// Enters `phase` for the lifetime of the scope, then returns to the phase it found.
class PhaseScope {
 public:
  explicit PhaseScope(Phase phase, int64_t detail = -1) : saved_(status().snapshot()) {
    status().enter(phase, detail);
  }
  ~PhaseScope() { status().enter(saved_.phase, saved_.detail); }
  PhaseScope(const PhaseScope&) = delete;
  PhaseScope& operator=(const PhaseScope&) = delete;

 private:
  Snapshot saved_;
};

}  // namespace fastddp::diag
