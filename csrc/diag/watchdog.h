// The stall watchdog: one thread per process that watches the status board (status.h). When
// this rank has waited on its peers (an all-reduce, a broadcast, join) for longer than the
// threshold, it asks every rank, through the c10d store (which keeps working while the process
// group is stuck), what it is doing, and prints one report that names the lagging ranks and
// where they are. It keeps waiting; when the wait reaches the process-group timeout it posts the
// report for every rank to end with, and every rank prints it and exits with status 1, so that
// torchrun tears the job down.
//
// Store keys (under the store's prefix): "request" (a counter: each stall report is one
// generation), "status/<generation>/<rank>" (one rank's answer), "abort" (the final report).
#pragma once

#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "diag/status.h"

namespace fastddp::diag {

struct WatchdogOptions {
  int64_t rank = 0;
  int64_t world = 1;
  double threshold_s = 30.0;      // a wait on peers longer than this is reported
  double timeout_s = 1800.0;      // the process group's timeout: every rank ends then
  double poll_s = 0.5;            // how often the store is read for requests
  double stack_timeout_s = 2.0;   // how long the Python stack may take to read
  bool exit_on_timeout = true;    // end the process at the timeout (else only report)
};

class Watchdog {
 public:
  // Where the training thread is in Python: a one-line summary, then more lines. Called on a
  // thread of its own (it takes the GIL); an answer that does not come within
  // options.stack_timeout_s is reported as unavailable.
  using StackFn = std::function<std::string()>;

  Watchdog(c10::intrusive_ptr<c10d::Store> store, WatchdogOptions options, StackFn stack);
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // Stops and joins the thread (idempotent).
  void stop();
  // The last stall report this rank printed or received (empty when none).
  std::string last_report() const;
  const WatchdogOptions& options() const { return options_; }

 private:
  void run();
  void answer_requests();
  void check_abort();
  void watch_own_wait();
  std::string report_stall(const Snapshot& mine);
  std::string status_line();
  std::string python_stack();
  void end_process(const std::string& report);

  c10::intrusive_ptr<c10d::Store> store_;
  WatchdogOptions options_;
  StackFn stack_;

  mutable std::mutex mutex_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::string last_report_;
  int64_t answered_ = 0;          // the last request generation this rank answered
  int64_t reported_since_ = -1;   // phase_since_ns of the wait last reported (one report a wait)
  std::thread thread_;
};

}  // namespace fastddp::diag
