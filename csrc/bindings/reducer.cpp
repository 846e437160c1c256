#include "bindings/registry.h"
#include "reducer/layout.h"
#include "reducer/reducer.h"

#include <torch/csrc/distributed/c10d/python_comm_hook.h>
#include <torch/csrc/utils/pybind.h>

namespace py = pybind11;

namespace fastddp::bindings {
namespace {

// Raises fastddp.DesyncError (python/fastddp/ddp/fingerprint.py) with `message`: thrown as a
// pybind11 error_already_set, which torch's autograd engine and pybind11 both hand to Python
// unchanged, so loss.backward() raises it.
[[noreturn]] void raise_desync_error(const std::string& message) {
  py::gil_scoped_acquire gil;
  static py::handle cls = py::object(py::module_::import("fastddp.ddp.fingerprint").attr("DesyncError")).release();
  PyErr_SetString(cls.ptr(), message.c_str());
  throw py::error_already_set();
}

void bind_options(py::module_& m) {
  py::class_<fastddp::reducer::BucketVisitor, std::shared_ptr<fastddp::reducer::BucketVisitor>>(
      m, "BucketVisitor",
      "Sees each flat gradient bucket once its reduced values are final (csrc/reducer/bucket_visitor.h); "
      "made by the capability that consumes the buckets, e.g. amp_bucket_stats().");
  using fastddp::reducer::ReducerOptions;
  py::class_<ReducerOptions>(m, "ReducerOptions",
                             "Everything that configures a Reducer, by name (see csrc/reducer/options.h).")
      .def(py::init<>())
      .def_readwrite("gradient_as_bucket_view", &ReducerOptions::gradient_as_bucket_view)
      .def_readwrite("find_unused_parameters", &ReducerOptions::find_unused_parameters)
      .def_readwrite("static_graph", &ReducerOptions::static_graph)
      .def_readwrite("comm_dtype", &ReducerOptions::comm_dtype)
      .def_readwrite("divide_gradients", &ReducerOptions::divide_gradients)
      .def_readwrite("bucket_cap_mb", &ReducerOptions::bucket_cap_mb)
      .def_readwrite("first_bucket_mb", &ReducerOptions::first_bucket_mb)
      .def_readwrite("bucket_caps_mb", &ReducerOptions::bucket_caps_mb)
      .def_readwrite("shm_allreduce", &ReducerOptions::shm_allreduce)
      .def_readwrite("shm_timeout_s", &ReducerOptions::shm_timeout_s)
      .def_readwrite("shm_broadcast_bytes", &ReducerOptions::shm_broadcast_bytes)
      .def_readwrite("batch_copies", &ReducerOptions::batch_copies)
      .def_readwrite("single_rank_passthrough", &ReducerOptions::single_rank_passthrough)
      .def_readwrite("fingerprint", &ReducerOptions::fingerprint)
      .def_readwrite("fingerprint_unused", &ReducerOptions::fingerprint_unused);
  m.def("initial_buckets", &fastddp::reducer::initial_buckets, py::arg("params"), py::arg("options"),
        "torch DDP's bucket layout at construction (parameter indices per bucket, csrc/reducer/layout.h).");
  m.def("rebuilt_buckets", &fastddp::reducer::rebuilt_buckets, py::arg("params"), py::arg("order"),
        py::arg("options"), "torch DDP's bucket layout rebuilt in gradient arrival order `order`.");
}

// Every method that takes the reducer's mutex releases the GIL first: with a Python comm hook
// the end of backward waits, holding the mutex, for Futures whose callbacks need the GIL.
using ReducerClass = py::class_<fastddp::reducer::Reducer, std::shared_ptr<fastddp::reducer::Reducer>>;

// Construction and the calls that drive a reduction.
void bind_reducer_lifecycle(ReducerClass& cls) {
  cls.def(py::init([](std::vector<at::Tensor> params, std::vector<std::string> names,
                       const c10::intrusive_ptr<c10d::ProcessGroup>& pg, const fastddp::reducer::ReducerOptions& options,
                       const py::object& comm_hook_state, const py::object& comm_hook) {
             // torch's own adapter for Python hooks: it builds the dist.GradBucket, calls
             // hook(state, bucket) under the GIL and unpacks the Future's value.
             std::unique_ptr<c10d::CommHookInterface> hook;
             if (!comm_hook.is_none()) {
               TORCH_CHECK(PyCallable_Check(comm_hook.ptr()), "DDPWrapper: the communication hook must be callable, "
                           "got ", py::str(py::type::of(comm_hook)).cast<std::string>());
               hook = std::make_unique<c10d::PythonCommHook>(comm_hook_state, comm_hook);
             }
             // Construction may run collectives (the shared-memory handshake): no GIL meanwhile.
             py::gil_scoped_release release;
             auto r = std::make_shared<fastddp::reducer::Reducer>(std::move(params), std::move(names), pg, options,
                                                                  std::move(hook));
             r->register_hooks();
             r->set_desync_handler(raise_desync_error);
             return r;
           }),
           py::arg("params"), py::arg("names"), py::arg("process_group"), py::arg("options"),
           py::arg("comm_hook_state") = py::none(), py::arg("comm_hook") = py::none())
      .def_static("packed_bytes", &fastddp::reducer::packed_bytes, py::arg("tensors"),
                  "Bytes the tensors take packed in shared memory, each at a 64-byte aligned offset.")
      .def("remove_hooks", &fastddp::reducer::Reducer::remove_hooks,
           "torch DDP's _remove_autograd_hooks(): no later gradient reaches this reducer.",
           py::call_guard<py::gil_scoped_release>())
      .def("broadcast_buffers", &fastddp::reducer::Reducer::broadcast_buffers, py::arg("tensors"),
           "Shared-memory transport: copy group rank 0's tensors into every rank's (True); else False.",
           py::call_guard<py::gil_scoped_release>())
      .def("hold_grads_in_buckets", &fastddp::reducer::Reducer::hold_grads_in_buckets,
           "Copy gradients reduced in place into their bucket slots (lending .grad from there) and keep "
           "every later backward's gradients in the buckets.",
           py::call_guard<py::gil_scoped_release>())
      .def("prepare_for_backward", &fastddp::reducer::Reducer::prepare_for_backward, py::arg("outputs"),
           py::arg("sync"), "Arm the reducer for the next backward (sync=False: accumulate locally).",
           py::call_guard<py::gil_scoped_release>())
      .def("finish_unfinished_reduction", &fastddp::reducer::Reducer::finish_unfinished_reduction,
           "Start of a forward: finish (and report) a reduction no backward completed.",
           py::call_guard<py::gil_scoped_release>())
      .def("delay_all_reduce", &fastddp::reducer::Reducer::delay_all_reduce,
           "static_graph: reduce the armed first iteration now (torch's reducer._delay_all_reduce()).",
           py::call_guard<py::gil_scoped_release>())
      .def("set_reduction_divisor", &fastddp::reducer::Reducer::set_reduction_divisor, py::arg("divisor"),
           "Average the next reduction's gradients over `divisor` ranks instead of the world size (join with "
           "divide_by_initial_world_size=False).",
           py::call_guard<py::gil_scoped_release>())
      .def("shadow_reduction", &fastddp::reducer::Reducer::shadow_reduction,
           "join(): issue one reduced backward's collectives with zero gradients.",
           py::call_guard<py::gil_scoped_release>())
      .def("add_bucket_visitor", &fastddp::reducer::Reducer::add_bucket_visitor, py::arg("visitor"),
           "Register a visitor of every bucket once its reduced values are final (e.g. GradScaler's statistics).",
           py::call_guard<py::gil_scoped_release>())
      .def("rebuild_buckets_in_arrival_order", &fastddp::reducer::Reducer::rebuild_buckets_in_arrival_order,
           "Re-plan the buckets in group rank 0's gradient arrival order (a collective); True if they changed.",
           py::call_guard<py::gil_scoped_release>());
}

// What the wrapper reads back: transport, layout, statistics.
void bind_reducer_queries(ReducerClass& cls) {
  cls.def_property_readonly("transport", &fastddp::reducer::Reducer::transport,
                             "'shm' (co-located CPU ranks, shared memory) or 'c10d'.")
      .def_property_readonly("passthrough", &fastddp::reducer::Reducer::passthrough,
                             "A world of one without comm_dtype: gradients are left where autograd put them.")
      .def_property_readonly("grads_in_buckets", &fastddp::reducer::Reducer::grads_in_buckets,
                             "Whether param.grad are views into bucket_buffers() after a reduced backward.")
      .def_property_readonly("has_comm_hook", &fastddp::reducer::Reducer::has_comm_hook,
                             "A Python communication hook reduces the buckets.")
      .def_property_readonly("batch_copies", &fastddp::reducer::Reducer::batch_copies,
                             "Gradients are copied into a full bucket with one multi-tensor copy.")
      .def_property_readonly("transport_note", &fastddp::reducer::Reducer::transport_note,
                             "Why the shared-memory path is not used (empty when it is).")
      .def("bucket_buffers", &fastddp::reducer::Reducer::bucket_buffers, "The flat gradient buffers.",
           py::call_guard<py::gil_scoped_release>())
      .def("arrival_order", &fastddp::reducer::Reducer::arrival_order,
           "Gradient arrival order (parameter indices) the bucket rebuild follows; empty until recorded.",
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("graph_static",
                             py::cpp_function(&fastddp::reducer::Reducer::graph_static,
                                              py::call_guard<py::gil_scoped_release>()),
                             "torch's reducer._ddp_graph_static(): the same parameters unused in every reducing forward.")
      .def_property_readonly("reductions",
                             py::cpp_function(&fastddp::reducer::Reducer::reductions,
                                              py::call_guard<py::gil_scoped_release>()),
                             "Reduced backwards finished so far.")
      .def(
          "iteration_stats",
          [](const fastddp::reducer::Reducer& self) {
            const auto s = [&] {
              py::gil_scoped_release release;
              return self.iteration_stats();
            }();
            py::dict out;
            out["backward_compute_start"] = s.backward_compute_start;
            out["backward_compute_end"] = s.backward_compute_end;
            out["backward_comm_start"] = s.backward_comm_start;
            out["backward_comm_end"] = s.backward_comm_end;
            out["buckets_reduced"] = s.buckets_reduced;
            out["unused_parameter_bytes"] = s.unused_parameter_bytes;
            out["ready_order"] = s.ready_order;
            return out;
          },
          "The last reducing backward's phase times (ns since the epoch, -1 when not reached) and counts.")
      .def_property_readonly("logged_error",
                             py::cpp_function(&fastddp::reducer::Reducer::logged_error,
                                              py::call_guard<py::gil_scoped_release>()),
                             "The last error raised of those torch DDP's logger keeps (empty if none).")
      .def_property_readonly("options", &fastddp::reducer::Reducer::options, "The ReducerOptions it was built with.")
      .def_property_readonly("fingerprinting", &fastddp::reducer::Reducer::fingerprinting,
                             "Whether reductions carry fingerprints the ranks compare (a mismatch raises DesyncError).")
      .def("bucket_indices", &fastddp::reducer::Reducer::bucket_indices, "Parameter indices of each bucket.",
           py::call_guard<py::gil_scoped_release>())
      .def("bucket_shm", &fastddp::reducer::Reducer::bucket_shm,
           "Per bucket: True when it is reduced through shared memory.", py::call_guard<py::gil_scoped_release>())
      .def("bucket_allreduce_ms", &fastddp::reducer::Reducer::bucket_allreduce_ms,
           "Per bucket: milliseconds from launch to completion in the last reduced backward (-1: none yet).",
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("relocations",
                             py::cpp_function(&fastddp::reducer::Reducer::relocations,
                                              py::call_guard<py::gil_scoped_release>()),
                             "Buckets moved to new memory because a lent .grad view was held across a backward.");
}

void bind_reducer(py::module_& m) {
  bind_options(m);
  m.def("shm_process_exiting", &fastddp::reducer::ShmAllreduce::note_process_exiting,
        "At interpreter exit: a shared-memory peer that waits for this rank is told its process ended.");
  ReducerClass cls(m, "Reducer", "Bucketed gradient all-reduce overlapped with backward (DDPWrapper's core).");
  bind_reducer_lifecycle(cls);
  bind_reducer_queries(cls);
}

}  // namespace

FASTDDP_BINDING(reducer, bind_reducer);

}  // namespace fastddp::bindings
