#include "bindings/registry.h"
#include "diag/status.h"
#include "diag/watchdog.h"

#include <torch/csrc/utils/pybind.h>

#include <memory>
#include <stdexcept>

namespace py = pybind11;
using fastddp::diag::Phase;
using fastddp::diag::Watchdog;
using fastddp::diag::WatchdogOptions;

namespace fastddp::bindings {
namespace {

// Whether Python code can no longer run: the interpreter is finalizing (a thread that takes the
// GIL then is ended by pthread_exit, which inside a destructor terminates the process) or gone.
bool interpreter_ending() {
#if PY_VERSION_HEX >= 0x030D0000
  return !Py_IsInitialized() || Py_IsFinalizing();
#else
  return !Py_IsInitialized() || _Py_IsFinalizing();
#endif
}

int decref_pending(void* object) {
  Py_DECREF(static_cast<PyObject*>(object));
  return 0;
}

// Drops a Python reference from any thread without waiting for the GIL: the watchdog's threads
// can hold the last one, and may end after the interpreter began to finalize. On a thread
// holding the GIL it is dropped at once; elsewhere it is handed to the interpreter's main thread
// (Py_AddPendingCall); while the interpreter ends, it is left to the process's exit.
void drop_reference(py::function* fn) {
  std::unique_ptr<py::function> owned(fn);
  if (interpreter_ending()) {
    (void)owned->release();
    return;
  }
  if (PyGILState_Check()) return;  // owned's destructor drops it here
  PyObject* object = owned->release().ptr();
  if (object != nullptr) (void)Py_AddPendingCall(decref_pending, object);  // a full queue leaves it to the exit
}

// A Python callable the watchdog may call from its own threads: each call takes the GIL unless
// the interpreter is ending (then it fails, and the report says the stack is not available).
Watchdog::StackFn stack_function(py::function fn) {
  std::shared_ptr<py::function> held(new py::function(std::move(fn)), drop_reference);
  return [held]() -> std::string {
    if (interpreter_ending()) throw std::runtime_error("the Python interpreter is shutting down");
    py::gil_scoped_acquire gil;
    return (*held)().cast<std::string>();
  };
}

void bind(py::module_& m) {
  m.def(
      "diag_enter",
      [](int32_t phase, int64_t detail) {
        TORCH_CHECK(phase >= 0 && phase <= static_cast<int32_t>(Phase::kRebuild), "diag_enter: unknown phase ", phase);
        fastddp::diag::status().enter(static_cast<Phase>(phase), detail);
      },
      py::arg("phase"), py::arg("detail") = -1, "Record the phase this process is in (for the stall watchdog).");
  m.def(
      "diag_step_started", []() { fastddp::diag::status().step_started(); },
      "Count a reducing step: a forward (gradients on, outside no_sync()) starts, before its collectives.");
  m.def(
      "diag_snapshot",
      []() {
        const auto s = fastddp::diag::status().snapshot();
        return py::make_tuple(static_cast<int32_t>(s.phase), s.detail, s.step, s.steps_done, s.seconds_in_phase);
      },
      "(phase, detail, reducing steps started, finished, seconds in the phase).");
  m.def("diag_collective_failed", &fastddp::diag::collective_failed, py::arg("headline"),
        "A collective failed on this rank: every rank's status under `headline`, also posted for the other "
        "ranks to end with ('' when no watchdog runs).",
        py::call_guard<py::gil_scoped_release>());
  py::class_<WatchdogOptions>(m, "WatchdogOptions", "How the stall watchdog runs (csrc/diag/watchdog.h).")
      .def(py::init<>())
      .def_readwrite("rank", &WatchdogOptions::rank)
      .def_readwrite("world", &WatchdogOptions::world)
      .def_readwrite("threshold_s", &WatchdogOptions::threshold_s)
      .def_readwrite("timeout_s", &WatchdogOptions::timeout_s)
      .def_readwrite("poll_s", &WatchdogOptions::poll_s)
      .def_readwrite("stack_timeout_s", &WatchdogOptions::stack_timeout_s)
      .def_readwrite("exit_on_timeout", &WatchdogOptions::exit_on_timeout);
  py::class_<Watchdog, std::shared_ptr<Watchdog>>(
      m, "Watchdog", "A thread that reports stalled waits of this rank with every rank's status (one per process).")
      .def(py::init([](c10::intrusive_ptr<c10d::Store> store, WatchdogOptions options, py::function stack) {
             auto watchdog = std::make_shared<Watchdog>(std::move(store), options, stack_function(std::move(stack)));
             watchdog->start();
             fastddp::diag::register_watchdog(watchdog);
             return watchdog;
           }),
           py::arg("store"), py::arg("options"), py::arg("stack"))
      .def("stop", &Watchdog::stop, "Stop the thread (joined, or left behind if the store does not answer).", py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("last_report", &Watchdog::last_report, "The last stall report (empty when none).")
      .def_property_readonly("store_failed", &Watchdog::store_failed,
                             "Whether the store failed under the thread (its host is gone; the thread has ended).");
}

}  // namespace

FASTDDP_BINDING(diag, bind);

}  // namespace fastddp::bindings
