#include "bindings/index_iterator.h"
#include "bindings/registry.h"
#include "sampler/sampler.h"

namespace py = pybind11;

namespace fastddp::bindings {
namespace {

void bind_sampler(py::module_& m) {
  m.def(
      "sampler_epoch_indices",
      [](int64_t length, int64_t replicas, int64_t rank, bool shuffle, int64_t seed, int64_t epoch,
         bool drop_last, int order) {
        TORCH_CHECK(order == 0 || order == 1, "sampler order must be 0 (torch) or 1 (stateless), got ", order);
        fastddp::sampler::Plan plan{length, replicas, rank, shuffle, seed, epoch, drop_last,
                                    static_cast<fastddp::sampler::Order>(order)};
        return fastddp::sampler::epoch_indices(plan);
      },
      py::arg("length"), py::arg("replicas"), py::arg("rank"), py::arg("shuffle"), py::arg("seed"),
      py::arg("epoch"), py::arg("drop_last"), py::arg("order"),
      "This rank's indices for one epoch as an int64 tensor (order 0: torch's, 1: stateless).",
      py::call_guard<py::gil_scoped_release>());
  m.def("sampler_num_samples", &fastddp::sampler::num_samples, py::arg("length"),
        py::arg("replicas"), py::arg("drop_last"),
        "Samples per rank, as torch.utils.data.DistributedSampler computes num_samples.");
  fastddp::bindings::add_index_iterator(m);
}

}  // namespace

FASTDDP_BINDING(sampler, bind_sampler);

}  // namespace fastddp::bindings
