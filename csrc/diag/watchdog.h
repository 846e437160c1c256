// The stall watchdog: one thread per process that watches the status board (status.h). When
// this rank has waited on its peers (an all-reduce, a broadcast, join) for longer than the
// threshold, it asks every rank, through the c10d store (which keeps working while the process
// group is stuck), what it is doing, and prints one report that names the lagging ranks and
// where they are. It keeps waiting. When the wait fails at the process-group timeout (or on a
// lost peer), the failing rank's error carries a fresh report and posts it for every other rank,
// whose watchdog prints it and exits with status 1, so that nothing is left hanging and torchrun
// tears the job down.
//
// Store keys (under the store's prefix): "request" (a counter: each stall report is one
// generation), "status/<generation>/<rank>" (one rank's answer), "report" and "reports" (the
// latest stall report and a counter: every rank keeps the latest, see last_report()), "abort"
// (the report every rank ends with).
#pragma once

#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "common/fork_safe.h"
#include "diag/status.h"

namespace fastddp::diag {

struct WatchdogOptions {
  int64_t rank = 0;
  int64_t world = 1;
  double threshold_s = 30.0;      // a wait on peers longer than this is reported
  double timeout_s = 1800.0;      // the process group's timeout: every rank ends then
  double poll_s = 0.5;            // how often the store is read for requests
  double stack_timeout_s = 2.0;   // how long the Python stack may take to read
  bool exit_on_timeout = true;    // end the process when an abort is posted or a wait outlives the timeout
};

// For the error path of a collective that failed on this rank (a timeout, a lost peer): the
// running watchdog's collect_report(headline), also posted for every other rank to end with
// (they print it and exit with status 1; this rank ends with its own error). "" when no
// watchdog runs.
// (The collection runs on a thread of its own and is given up after a few seconds.)
std::string collective_failed(const std::string& headline);

class Watchdog;
// Makes `watchdog` the one collective_failed uses (held weakly).
void register_watchdog(const std::shared_ptr<Watchdog>& watchdog);

class Watchdog : public std::enable_shared_from_this<Watchdog> {
 public:
  // Where the training thread is in Python: a one-line summary, then more lines. Called on a
  // thread of its own (it takes the GIL); an answer that does not come within
  // options.stack_timeout_s is reported as unavailable.
  using StackFn = std::function<std::string()>;

  // Checks the options; the thread starts with start().
  Watchdog(c10::intrusive_ptr<c10d::Store> store, WatchdogOptions options, StackFn stack);
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // Starts the thread, which holds the watchdog alive while it runs (a shared_ptr must own it).
  void start();
  // Stops the thread (idempotent). It is joined when it ends within a few seconds; one stuck in
  // a store call (a store cut off from this host answers nothing, at exit too) is left behind,
  // detached, with a line on stderr, so that stop() and the process's exit never hang.
  void stop();
  // The latest stall report of any rank, or the report an abort carried (empty when none).
  std::string last_report() const;
  const WatchdogOptions& options() const { return options_; }
  // Asks every rank for its status now and returns the report under `headline` (blocks for
  // up to a few seconds while the ranks answer; one collection at a time).
  std::string collect_report(const std::string& headline);
  // Posts `report` for every other rank to end with (see collective_failed).
  void post_abort(const std::string& report);
  // This rank ends with its own error (a collective failed here): an abort another rank posts
  // meanwhile does not end this process, so that the error that names the cause is raised.
  void ends_with_own_error() { abort_handled_ = true; }
  // The store failed under the thread (its host is gone: the rank that hosted it exited, or
  // a killed torchrun agent): the thread has ended, and every later store call fails too
  // (c10d prints a warning with a C++ stack trace for each).
  bool store_failed() const { return store_failed_; }

 private:
  void run();
  void answer_requests();
  void take_shared_report();
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
  // A forked child has none of the threads: stop() leaves them, and cv_ is not destroyed there
  // (its thread may have been waiting on it; common/fork_safe.h).
  pid_t owner_pid_;
  ParentOnly<std::condition_variable> cv_owner_;
  std::condition_variable& cv_ = *cv_owner_;
  bool stop_ = false;
  bool finished_ = false;  // run() returned
  std::string last_report_;
  std::mutex report_mutex_;
  std::atomic<int64_t> answered_{0};  // the last request generation this rank answered
  // requests answered at most per poll: enough for every rank of a job asking at once
  static constexpr int64_t kRequestBacklog = 64;
  // This rank posted an abort, printed another's, or ends with its own error: later aborts
  // neither end nor print anything here.
  std::atomic<bool> abort_handled_{false};
  std::atomic<bool> store_failed_{false};
  int64_t reports_seen_ = 0;  // stall reports (any rank's) taken from the store
  int64_t reported_since_ = -1;   // phase_since_ns of the wait last reported (one report a wait)
  std::thread thread_;
};

}  // namespace fastddp::diag
