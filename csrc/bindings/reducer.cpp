#include "bindings/registry.h"
#include "reducer/reducer.h"

#include <torch/csrc/distributed/c10d/python_comm_hook.h>
#include <torch/csrc/utils/pybind.h>

namespace py = pybind11;

namespace {

// Every method that takes the reducer's mutex releases the GIL first: with a Python comm hook
// the end of backward waits, holding the mutex, for Futures whose callbacks need the GIL.
void bind_reducer(py::module_& m) {
  py::class_<fastddp::reducer::Reducer, std::shared_ptr<fastddp::reducer::Reducer>>(
      m, "Reducer", "Bucketed gradient all-reduce overlapped with backward (DDPWrapper's core).")
      .def(py::init([](std::vector<at::Tensor> params, std::vector<std::string> names,
                       std::vector<std::vector<int64_t>> buckets,
                       const c10::intrusive_ptr<c10d::ProcessGroup>& pg, bool grad_as_view, bool find_unused,
                       bool static_graph, std::optional<at::ScalarType> comm_dtype, std::optional<bool> shm,
                       double shm_timeout_s, int64_t shm_broadcast_bytes, std::optional<bool> batch_copies,
                       bool single_rank_passthrough, const py::object& comm_hook_state, const py::object& comm_hook) {
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
             auto r = std::make_shared<fastddp::reducer::Reducer>(std::move(params), std::move(names), buckets, pg,
                                                                  grad_as_view, find_unused, static_graph,
                                                                  comm_dtype, shm, shm_timeout_s, shm_broadcast_bytes,
                                                                  batch_copies, single_rank_passthrough,
                                                                  std::move(hook));
             r->register_hooks();
             return r;
           }),
           py::arg("params"), py::arg("names"), py::arg("buckets"), py::arg("process_group"),
           py::arg("gradient_as_bucket_view"), py::arg("find_unused_parameters"), py::arg("static_graph"),
           py::arg("comm_dtype"), py::arg("shm_allreduce") = py::none(), py::arg("shm_timeout_s") = 1800.0, py::arg("shm_broadcast_bytes") = 0,
           py::arg("batch_copies") = py::none(), py::arg("single_rank_passthrough") = true,
           py::arg("comm_hook_state") = py::none(), py::arg("comm_hook") = py::none())
      .def("broadcast_buffers", &fastddp::reducer::Reducer::broadcast_buffers, py::arg("tensors"),
           "Shared-memory transport: copy group rank 0's tensors into every rank's (True); else False.",
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("transport", &fastddp::reducer::Reducer::transport,
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
      .def("prepare_for_backward", &fastddp::reducer::Reducer::prepare_for_backward, py::arg("outputs"),
           py::arg("sync"), "Arm the reducer for the next backward (sync=False: accumulate locally).",
           py::call_guard<py::gil_scoped_release>())
      .def("bucket_buffers", &fastddp::reducer::Reducer::bucket_buffers, "The flat gradient buffers.")
      .def("set_reduction_scale", &fastddp::reducer::Reducer::set_reduction_scale, py::arg("scale"),
           "Multiply the next reduction's result by scale (join with divide_by_initial_world_size=False).",
           py::call_guard<py::gil_scoped_release>())
      .def("shadow_reduction", &fastddp::reducer::Reducer::shadow_reduction,
           "join(): issue one reduced backward's collectives with zero gradients.",
           py::call_guard<py::gil_scoped_release>())
      .def("set_grad_stats", &fastddp::reducer::Reducer::set_grad_stats, py::arg("enabled"),
           "Accumulate the buckets' sum of squares as each all-reduce completes (for GradScaler).",
           py::call_guard<py::gil_scoped_release>())
      .def("take_grad_stats",
           [](fastddp::reducer::Reducer& r) -> std::optional<at::Tensor> {
             auto t = r.take_grad_stats();
             if (!t.defined()) return std::nullopt;
             return t;
           },
           "The float64[1] sum of squares of the last reduced backward, once; None if not fresh.",
           py::call_guard<py::gil_scoped_release>())
      .def("arrival_order", &fastddp::reducer::Reducer::arrival_order,
           "Gradient arrival order (parameter indices) of the first reduced backward.",
           py::call_guard<py::gil_scoped_release>())
      .def("rebuild_buckets", &fastddp::reducer::Reducer::rebuild_buckets, py::arg("buckets"),
           "Replace the buckets; existing gradients move into the new buffers.",
           py::call_guard<py::gil_scoped_release>())
      .def("bucket_indices", &fastddp::reducer::Reducer::bucket_indices, "Parameter indices of each bucket.")
      .def("bucket_shm", &fastddp::reducer::Reducer::bucket_shm,
           "Per bucket: True when it is reduced through shared memory.", py::call_guard<py::gil_scoped_release>())
      .def("bucket_allreduce_ms", &fastddp::reducer::Reducer::bucket_allreduce_ms,
           "Per bucket: milliseconds from launch to completion in the last reduced backward (-1: none yet).",
           py::call_guard<py::gil_scoped_release>());
}

}  // namespace

FASTDDP_BINDING(reducer, bind_reducer);
