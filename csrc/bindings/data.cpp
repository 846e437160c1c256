#include "bindings/registry.h"
#include "data/pipeline.h"

namespace py = pybind11;

namespace fastddp::bindings {
namespace {

using fastddp::data::PipelineOptions;
using fastddp::data::PrefetchPipeline;
using fastddp::data::SlotPool;

void bind_data(py::module_& m) {
  py::class_<SlotPool, std::shared_ptr<SlotPool>>(m, "SlotPool",
      "A loader's unpinned host staging slots, handed from one pass's pipeline to the next.")
      .def(py::init<>())
      .def_property_readonly("size", &SlotPool::size, "Slots held between passes.");

  py::class_<PipelineOptions>(m, "PipelineOptions", "Settings of one PrefetchPipeline.")
      .def(py::init<>())
      .def_readwrite("num_workers", &PipelineOptions::num_workers, "Gather threads (>= 1).")
      .def_readwrite("prefetch", &PipelineOptions::prefetch, "Ring slots (batches in flight).")
      .def_readwrite("pin_memory", &PipelineOptions::pin_memory, "Page-locked staging buffers.")
      .def_readwrite("batch_rows", &PipelineOptions::batch_rows,
                     "Rows of the largest batch when known (slots are then allocated up front).")
      .def_property(
          "device", [](const PipelineOptions& o) { return o.device.str(); },
          [](PipelineOptions& o, const std::string& d) { o.device = c10::Device(d); },
          "Where batches are delivered (\"cpu\" or a CUDA device).")
      .def_readwrite("pool", &PipelineOptions::pool,
                     "A SlotPool the pass takes its unpinned host slots from and returns them to (or None).");

  py::class_<PrefetchPipeline>(m, "PrefetchPipeline",
      "Worker threads gather submitted batches of rows into a ring of (pinned) staging slots; "
      "CUDA builds bring each slot to the device on a side stream. One pass.")
      .def(py::init<std::vector<at::Tensor>, PipelineOptions>(), py::arg("sources"), py::arg("options"),
           py::call_guard<py::gil_scoped_release>())
      .def("submit", &PrefetchPipeline::submit, py::arg("indices"),
           "Queue the next batch (1-D int64 CPU tensor of row numbers in [0, rows)).",
           py::call_guard<py::gil_scoped_release>())
      .def("submit_split", &PrefetchPipeline::submit_split, py::arg("indices"), py::arg("batch_size"),
           "Queue consecutive batches of batch_size rows of indices (the last may be shorter).",
           py::call_guard<py::gil_scoped_release>())
      .def("finish", &PrefetchPipeline::finish, "No batch follows the ones submitted.",
           py::call_guard<py::gil_scoped_release>())
      .def("next", &PrefetchPipeline::next,
           "Next batch (a list of tensors), or [] at the end; rethrows a worker's error.",
           py::call_guard<py::gil_scoped_release>())
      .def("close", &PrefetchPipeline::close, "Stop and join the worker threads.",
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("submitted", &PrefetchPipeline::submitted, "Batches submitted so far.")
      .def_property_readonly("direct", &PrefetchPipeline::direct,
                             "True when the device gathers rows straight from pinned sources.")
      .def_property_readonly("position", &PrefetchPipeline::position,
                             "Batches handed to the consumer so far.");
}

}  // namespace

FASTDDP_BINDING(data, bind_data);

}  // namespace fastddp::bindings
