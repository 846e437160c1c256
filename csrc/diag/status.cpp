#include "diag/status.h"

namespace fastddp::diag {

std::string phase_name(Phase p) {
  switch (p) {
    case Phase::kOutside: return "outside fastddp";
    case Phase::kForward: return "forward";
    case Phase::kBackward: return "backward";
    case Phase::kAllreduce: return "all-reduce";
    case Phase::kUsedMap: return "all-reduce of the used-parameter map";
    case Phase::kBroadcast: return "buffer broadcast";
    case Phase::kJoin: return "join";
    case Phase::kSetup: return "DDPWrapper set-up";
    case Phase::kRebuild: return "bucket rebuild";
  }
  return "unknown";
}

Snapshot Status::snapshot() const {
  Snapshot s;
  s.phase = static_cast<Phase>(phase_.load(std::memory_order_acquire));
  s.detail = detail_.load(std::memory_order_relaxed);
  s.step = step_.load(std::memory_order_relaxed);
  s.steps_done = steps_done_.load(std::memory_order_relaxed);
  s.seconds_in_phase = static_cast<double>(now_ns() - since_ns_.load(std::memory_order_relaxed)) * 1e-9;
  return s;
}

Status& status() {
  static Status board;
  return board;
}

}  // namespace fastddp::diag
