#include "bindings/registry.h"
#include "data/pipeline.h"

namespace py = pybind11;

namespace {

void bind_data(py::module_& m) {
  py::class_<fastddp::data::PrefetchPipeline>(m, "PrefetchPipeline",
      "Worker threads gather batches of rows into a ring of (pinned) staging slots; CUDA "
      "builds copy each slot to the device on a side stream. One pass over `batches`.")
      .def(py::init([](std::vector<at::Tensor> sources, std::vector<at::Tensor> batches,
                       int64_t num_workers, int64_t prefetch, bool pin_memory, const std::string& device) {
             fastddp::data::PipelineOptions opt;
             opt.num_workers = num_workers;
             opt.prefetch = prefetch;
             opt.pin_memory = pin_memory;
             opt.device = c10::Device(device);
             return std::make_unique<fastddp::data::PrefetchPipeline>(std::move(sources), std::move(batches), opt);
           }),
           py::arg("sources"), py::arg("batches"), py::arg("num_workers"), py::arg("prefetch"),
           py::arg("pin_memory"), py::arg("device"), py::call_guard<py::gil_scoped_release>())
      .def("next", &fastddp::data::PrefetchPipeline::next,
           "Next batch (a list of tensors), or [] at the end; rethrows a worker's error.",
           py::call_guard<py::gil_scoped_release>())
      .def("close", &fastddp::data::PrefetchPipeline::close, "Stop and join the worker threads.",
           py::call_guard<py::gil_scoped_release>())
      .def("__len__", &fastddp::data::PrefetchPipeline::size)
      .def_property_readonly("direct", &fastddp::data::PrefetchPipeline::direct,
                             "True when the device gathers rows straight from pinned sources.")
      .def_property_readonly("position", &fastddp::data::PrefetchPipeline::position,
                             "Batches handed to the consumer so far.");
}

}  // namespace

FASTDDP_BINDING(data, bind_data);
