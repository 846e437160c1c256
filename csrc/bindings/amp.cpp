#include "amp/amp.h"
#include "bindings/registry.h"

namespace py = pybind11;

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
}

}  // namespace

FASTDDP_BINDING(amp, bind_amp);
