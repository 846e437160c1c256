#include "diag/watchdog.h"

#include "common/checks.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <memory>
#include <sstream>
#include <vector>

namespace fastddp::diag {
namespace {

using Seconds = std::chrono::duration<double>;

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }

std::string text(const std::vector<uint8_t>& b) { return {b.begin(), b.end()}; }

// One rank's answer: "phase detail step steps_done seconds\n<python stack>".
struct Answer {
  bool present = false;
  Phase phase = Phase::kOutside;
  int64_t detail = -1, step = 0, done = 0;
  double seconds = 0.0;
  std::string stack;
};

Answer parse(const std::string& s) {
  Answer a;
  std::istringstream in(s);
  int32_t phase = 0;
  if (!(in >> phase >> a.detail >> a.step >> a.done >> a.seconds)) return a;
  a.present = true;
  a.phase = static_cast<Phase>(phase);
  std::getline(in, a.stack);  // the rest of the first line (empty)
  std::string line;
  a.stack.clear();
  while (std::getline(in, line)) a.stack += (a.stack.empty() ? "" : "\n") + line;
  return a;
}

bool evaluating(const Answer& a) { return a.phase == Phase::kForward && a.detail == kForwardWithoutGradients; }

std::string doing(const Answer& a) {
  std::ostringstream o;
  o << phase_name(a.phase);
  if (a.phase == Phase::kAllreduce) o << " of bucket " << a.detail;
  if (evaluating(a)) o << " without gradients";
  o << " for " << std::fixed;
  o.precision(1);
  o << a.seconds << " s (reducing steps: " << a.step << " started, " << a.done << " finished)";
  return o.str();
}

std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

std::string indent(const std::string& s, const std::string& pad) {
  std::string out = pad;
  for (char c : s) {
    out += c;
    if (c == '\n') out += pad;
  }
  return out;
}

std::mutex registry_mutex;
std::weak_ptr<Watchdog> registered;  // the running watchdog (see register_watchdog)

}  // namespace

void register_watchdog(const std::shared_ptr<Watchdog>& watchdog) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  registered = watchdog;
}

std::string collective_failed(const std::string& headline) {
  std::shared_ptr<Watchdog> dog;
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    dog = registered.lock();
  }
  if (!dog) return "";
  // Before the collection: the other ranks fail too and post their aborts meanwhile; two ranks
  // that both raise (one naming the cause, the other that it stopped) must not end each other.
  dog->ends_with_own_error();
  // On its own thread, with a deadline: a store cut off from this host answers nothing for
  // its whole timeout on every call, and the error must not wait for that.
  auto done = std::make_shared<std::promise<std::string>>();
  auto answer = done->get_future();
  std::thread([dog, headline, done] {
    try {
      std::string report = dog->collect_report(headline);
      dog->post_abort(report);
      done->set_value(std::move(report));
    } catch (const std::exception& e) {
      done->set_value(std::string("(no report: the c10d store failed: ") + error_message(e) + ")");
    }
  }).detach();
  const auto& o = dog->options();
  const double budget = 2 * o.poll_s + o.stack_timeout_s + 3;
  if (answer.wait_for(Seconds(budget)) != std::future_status::ready)
    return "(no report: the c10d store did not answer within " + std::to_string(static_cast<int>(budget)) + " s)";
  return answer.get();
}

Watchdog::Watchdog(c10::intrusive_ptr<c10d::Store> store, WatchdogOptions options, StackFn stack)
    : store_(std::move(store)), options_(options), stack_(std::move(stack)), owner_pid_(getpid()) {
  TORCH_CHECK(store_, "fastddp watchdog: needs a c10d store");
  TORCH_CHECK(options_.world >= 1 && options_.rank >= 0 && options_.rank < options_.world,
              "fastddp watchdog: rank ", options_.rank, " outside a world of ", options_.world);
  TORCH_CHECK(options_.threshold_s > 0 && options_.threshold_s < options_.timeout_s,
              "fastddp watchdog: the stall threshold (", options_.threshold_s, " s) must be > 0 and below the "
              "process-group timeout (", options_.timeout_s, " s); set FASTDDP_STALL_THRESHOLD_S (or "
              "DDPWrapper(stall_threshold_s=...)) below the timeout given to init_process_group");
  TORCH_CHECK(options_.poll_s > 0 && options_.stack_timeout_s > 0, "fastddp watchdog: poll_s (", options_.poll_s,
              ") and stack_timeout_s (", options_.stack_timeout_s, ") must be > 0");
}

void Watchdog::start() {
  TORCH_CHECK(!thread_.joinable(), "fastddp watchdog: already started");
  thread_ = std::thread([self = shared_from_this()] {
    self->run();
    {
      std::lock_guard<std::mutex> lock(self->mutex_);
      self->finished_ = true;
    }
    self->cv_.notify_all();
  });
}

Watchdog::~Watchdog() { stop(); }

void Watchdog::stop() {
  if (getpid() != owner_pid_) {  // a forked child: the thread is the parent's
    if (thread_.joinable()) thread_.detach();
    return;
  }
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    auto current = registered.lock();
    if (!current || current.get() == this) registered.reset();
  }
  std::unique_lock<std::mutex> lock(mutex_);
  stop_ = true;
  cv_.notify_all();
  if (!thread_.joinable()) return;
  if (thread_.get_id() == std::this_thread::get_id()) {  // the thread itself dropped the last owner
    thread_.detach();
    return;
  }
  const auto bound = Seconds(options_.poll_s + options_.stack_timeout_s + 3);
  if (cv_.wait_for(lock, bound, [this] { return finished_; })) {
    lock.unlock();
    thread_.join();
    return;
  }
  thread_.detach();  // it owns the watchdog: whatever it returns to is still alive
  std::fprintf(stderr, "fastddp watchdog (rank %lld): the c10d store did not answer within %.0f s; its "
               "thread is left behind as this rank stops\n", static_cast<long long>(options_.rank),
               bound.count());
}

std::string Watchdog::last_report() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return last_report_;
}

void Watchdog::run() {
  const auto period = Seconds(options_.poll_s);
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      if (cv_.wait_for(lock, period, [this] { return stop_; })) return;
    }
    try {
      check_abort();
      answer_requests();
      take_shared_report();
      watch_own_wait();
    } catch (const std::exception& e) {
      store_failed_ = true;
      // The store is gone (its host rank exited): nothing more can be collected. Between
      // steps that is how a job ends (the host rank finished first): nothing to say then.
      if (status().snapshot().phase != Phase::kOutside) {
        std::fprintf(stderr, "fastddp watchdog (rank %lld): the c10d store failed (%s); stall reports are off\n",
                     static_cast<long long>(options_.rank), error_message(e).c_str());
      }
      return;
    }
  }
}

void Watchdog::check_abort() {
  if (abort_handled_ || !store_->check({"abort"})) return;  // the poster ends with its own error
  const std::string report = text(store_->get("abort"));
  if (options_.exit_on_timeout) end_process(report);
  abort_handled_ = true;  // print it once, keep running
  std::fprintf(stderr, "%s\n", report.c_str());
  std::lock_guard<std::mutex> lock(mutex_);
  last_report_ = report;
}

void Watchdog::post_abort(const std::string& report) {
  abort_handled_ = true;
  store_->set("abort", bytes(report + "\nfastddp: a collective failed on rank " + std::to_string(options_.rank) +
                             " (see its error); every rank ends."));
}

void Watchdog::take_shared_report() {
  const int64_t reports = store_->add("reports", 0);
  if (reports <= reports_seen_) return;
  reports_seen_ = reports;
  const std::string report = text(store_->get("report"));
  std::lock_guard<std::mutex> lock(mutex_);
  last_report_ = report;
}

void Watchdog::answer_requests() {
  const int64_t generation = store_->add("request", 0);
  int64_t answered = answered_.load();
  if (generation <= answered) return;
  // Every request since the last one answered, not only the newest: ranks that wait on each
  // other start their reports at the same moment, and each collector waits for its own.
  const auto line = bytes(status_line());
  const std::string rank = std::to_string(options_.rank);
  for (int64_t g = std::max(answered + 1, generation - kRequestBacklog + 1); g <= generation; ++g)
    store_->set("status/" + std::to_string(g) + "/" + rank, line);
  while (answered < generation && !answered_.compare_exchange_weak(answered, generation)) {
  }
}

void Watchdog::watch_own_wait() {
  if (abort_handled_) return;  // the job is ending with an error already reported: no second report
  const Snapshot mine = status().snapshot();
  if (!waits_on_peers(mine.phase) || mine.seconds_in_phase < options_.threshold_s) return;
  const int64_t since = status().phase_since_ns();
  if (since != reported_since_) {
    reported_since_ = since;
    const std::string report = report_stall(mine);
    std::fprintf(stderr, "%s\n", report.c_str());
    std::fflush(stderr);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      last_report_ = report;
    }
    // Shared, so that every rank holds it (an uncaught error on any rank ends with it).
    store_->set("report", bytes(report));
    reports_seen_ = store_->add("reports", 1);
  }
  // A backstop: every wait in fastddp gives up at the process-group timeout and its error
  // ends the ranks (collective_failed). A wait still going well past it is not bounded by
  // anything else, so this rank posts the report and ends.
  const double backstop_s = options_.timeout_s + std::max(10.0, 0.1 * options_.timeout_s);
  if (options_.exit_on_timeout && mine.seconds_in_phase >= backstop_s) {
    std::string report;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      report = last_report_;
    }
    post_abort(report + "\nfastddp: rank " + std::to_string(options_.rank) + " has waited " +
               std::to_string(static_cast<int64_t>(mine.seconds_in_phase)) + " s, past the process-group timeout (" +
               std::to_string(static_cast<int64_t>(options_.timeout_s)) + " s).");
    // The other ranks read the report on their next poll: leaving before that would break
    // their collectives first, and they would end with a connection error instead of it.
    std::this_thread::sleep_for(Seconds(2 * options_.poll_s + 0.5));
    end_process(text(store_->get("abort")));
  }
}

std::string Watchdog::status_line() {
  const Snapshot s = status().snapshot();
  std::ostringstream o;
  o << static_cast<int32_t>(s.phase) << ' ' << s.detail << ' ' << s.step << ' ' << s.steps_done << ' '
    << s.seconds_in_phase << '\n'
    << python_stack();
  return o.str();
}

std::string Watchdog::python_stack() {
  if (!stack_) return "Python stack not available";
  auto done = std::make_shared<std::promise<std::string>>();
  auto answer = done->get_future();
  // Its own thread: taking the GIL blocks for as long as the training thread holds it.
  std::thread([stack = stack_, done] {
    try {
      done->set_value(stack());
    } catch (const std::exception& e) {
      done->set_value(std::string("Python stack not available: ") + error_message(e));
    }
  }).detach();
  if (answer.wait_for(Seconds(options_.stack_timeout_s)) != std::future_status::ready)
    return "Python stack not available: the training thread has held the GIL for " +
           std::to_string(options_.stack_timeout_s) + " s (it is stuck in native code)";
  return answer.get();
}

namespace {

std::string step_skew(const std::vector<Answer>& answers) {
  // Ranks waiting in different collectives and at different reducing steps: the usual cause is
  // a forward whose backward did not run on one rank (a step skipped after the forward).
  int64_t low = -1, high = -1, low_rank = -1, high_rank = -1;
  for (int64_t r = 0; r < static_cast<int64_t>(answers.size()); ++r) {
    const Answer& a = answers[static_cast<size_t>(r)];
    if (!a.present) continue;
    if (low_rank < 0 || a.step < low) low = a.step, low_rank = r;
    if (high_rank < 0 || a.step > high) high = a.step, high_rank = r;
  }
  if (low == high) return "";
  return "\n  rank " + std::to_string(high_rank) + " started " + std::to_string(high) + " reducing steps, rank " +
         std::to_string(low_rank) + " " + std::to_string(low) + ": a forward (gradients on, outside no_sync()) "
         "whose backward did not run, or a forward more, on rank " + std::to_string(high_rank) +
         "; every rank must run the same reducing forwards and backwards.";
}

}  // namespace

std::string Watchdog::report_stall(const Snapshot& mine) {
  Answer self;
  self.present = true;
  self.phase = mine.phase, self.detail = mine.detail, self.step = mine.step, self.done = mine.steps_done;
  self.seconds = mine.seconds_in_phase;
  return collect_report("fastddp stall report: rank " + std::to_string(options_.rank) + " has been waiting in " +
                        doing(self) + ".");
}

std::string Watchdog::collect_report(const std::string& headline) {
  std::lock_guard<std::mutex> one_at_a_time(report_mutex_);
  const int64_t generation = store_->add("request", 1);
  const std::string prefix = "status/" + std::to_string(generation) + "/";
  answer_requests();  // this request (this rank's own line) and any other rank's still open
  std::vector<Answer> answers(static_cast<size_t>(options_.world));
  const auto deadline = std::chrono::steady_clock::now() + Seconds(2 * options_.poll_s + options_.stack_timeout_s + 1);
  std::vector<std::string> ended(static_cast<size_t>(options_.world));  // why a rank ended, if it said
  for (int64_t r = 0; r < options_.world; ++r) {
    const std::string key = prefix + std::to_string(r);
    const std::string exit_key = "exit/" + std::to_string(r);  // posted by fastddp.diag's excepthook
    while (!store_->check({key}) && !store_->check({exit_key}) && std::chrono::steady_clock::now() < deadline) {
      answer_requests();  // a rank collecting its own report at the same time waits for this one's line
      std::this_thread::sleep_for(Seconds(options_.poll_s / 5));
    }
    if (store_->check({key})) answers[static_cast<size_t>(r)] = parse(text(store_->get(key)));
    else if (store_->check({exit_key})) ended[static_cast<size_t>(r)] = text(store_->get(exit_key));
  }
  std::ostringstream o;
  o << headline << "\n";
  std::string lagging, silent, gone;
  bool all_evaluating = true;  // every lagging rank is in a forward without gradients
  for (int64_t r = 0; r < options_.world; ++r) {
    const Answer& a = answers[static_cast<size_t>(r)];
    o << "  rank " << r << ": ";
    if (!a.present) {
      const std::string& why = ended[static_cast<size_t>(r)];
      o << (why.empty() ? "no answer (the process is gone or its watchdog cannot reach the store)"
                        : "ended " + why) << "\n";
      (why.empty() ? silent : gone) += ((why.empty() ? silent : gone).empty() ? "" : ", ") + std::to_string(r);
      continue;
    }
    o << doing(a) << "\n" << indent(a.stack, "      ") << "\n";
    if (!waits_on_peers(a.phase) && r != options_.rank) {  // this rank reports because it waits
      lagging += (lagging.empty() ? "" : "; ") + ("rank " + std::to_string(r) + " (" + phase_name(a.phase) + ", " +
                                                  first_line(a.stack) + ")");
      all_evaluating = all_evaluating && evaluating(a);
    }
  }
  if (!lagging.empty()) {
    o << "  lagging: " << lagging << ". The other ranks wait for it in fastddp.";
    if (all_evaluating)
      o << " It runs forwards without gradients (an evaluation): if it evaluates alone on purpose (on rank 0 "
           "only, say), the wait ends when it returns to training; FASTDDP_STALL_THRESHOLD_S (or "
           "DDPWrapper(stall_threshold_s=...)) sets how long a wait lasts before it is reported.";
  }
  else if (!gone.empty())
    o << "  lagging: rank(s) " << gone << " ended (see above)"
      << (silent.empty() ? "" : "; rank(s) " + silent + " did not answer") << ".";
  else if (!silent.empty())
    o << "  lagging: rank(s) " << silent << " did not answer.";
  else
    o << "  every rank waits on the others: they issued different collectives (see above)." << step_skew(answers);
  return o.str();
}

void Watchdog::end_process(const std::string& report) {
  std::fprintf(stderr, "%s\nfastddp: rank %lld exits with status 1 (the job cannot go on: see the report above).\n",
               report.c_str(), static_cast<long long>(options_.rank));
  std::fflush(stderr);
  std::fflush(stdout);
  std::_Exit(1);
}

}  // namespace fastddp::diag
