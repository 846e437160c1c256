#include "amp/amp.h"
#include "amp/bucket_stats.h"
#include "bindings/registry.h"

namespace py = pybind11;

namespace fastddp::bindings {
namespace {

void bind_amp(py::module_& m) {
  m.def("amp_accumulate_stats_", &fastddp::amp::accumulate_stats_, py::arg("grads"), py::arg("stats"),
        "stats[0] += sum of squares of all grads (float64; non-finite if any grad is inf/NaN). One read pass.",
        py::call_guard<py::gil_scoped_release>());
  m.def("amp_finalize", &fastddp::amp::finalize, py::arg("stats"), py::arg("scale"), py::arg("max_norm"),
        py::arg("eps"),
        "[found_inf, norm, coef, inv_coef] from the stats of scaled grads: coef = inv_scale * min(1, "
        "max_norm/(norm+eps)); computed on the device, no host sync.",
        py::call_guard<py::gil_scoped_release>());
  m.def("amp_scale_", &fastddp::amp::scale_, py::arg("grads"), py::arg("coef"),
        "grads *= coef[0] (coef stays on the device).", py::call_guard<py::gil_scoped_release>());
  m.def("amp_update_scale_", &fastddp::amp::update_scale_, py::arg("scale"), py::arg("growth_tracker"),
        py::arg("found_inf"), py::arg("growth_factor"), py::arg("backoff_factor"), py::arg("growth_interval"),
        "torch's loss-scale update rule (backoff on found_inf, growth every growth_interval clean steps).",
        py::call_guard<py::gil_scoped_release>());
  // The statistics visitor is handed to Python as the reducer's BucketVisitor, which is what
  // DDPWrapper.register_bucket_visitor takes; amp_take_bucket_stats reads it back.
  m.def(
      "amp_bucket_stats",
      []() -> std::shared_ptr<fastddp::reducer::BucketVisitor> { return std::make_shared<fastddp::amp::BucketStats>(); },
      "A BucketVisitor that sums the squares of a DDPWrapper's reduced buckets as each reduction completes.");
  m.def(
      "amp_take_bucket_stats",
      [](const std::shared_ptr<fastddp::reducer::BucketVisitor>& visitor) -> std::optional<at::Tensor> {
        auto stats = std::dynamic_pointer_cast<fastddp::amp::BucketStats>(visitor);
        TORCH_CHECK(stats, "amp_take_bucket_stats: the visitor was not made by amp_bucket_stats()");
        auto t = stats->take();
        if (!t.defined()) return std::nullopt;
        return t;
      },
      py::arg("visitor"),
      "The float64[1] sum of squares of the last reduced backward, once; None if not fresh.",
      py::call_guard<py::gil_scoped_release>());
}

}  // namespace

FASTDDP_BINDING(amp, bind_amp);

}  // namespace fastddp::bindings
