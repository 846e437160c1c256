#include "bindings/registry.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#ifdef FASTDDP_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace fastddp::bindings {
namespace {

std::vector<std::pair<std::string, BindFn>>& registry() {
  // Function-local static: safe against static-initialisation order between files.
  static std::vector<std::pair<std::string, BindFn>> entries;
  return entries;
}

pybind11::dict build_info() {
  pybind11::dict info;
  info["version"] = FASTDDP_VERSION;
  info["torch_version"] = FASTDDP_TORCH_VERSION;
#ifdef FASTDDP_WITH_CUDA
  info["cuda"] = true;
  int runtime = 0;
  info["cuda_runtime_version"] = cudaRuntimeGetVersion(&runtime) == cudaSuccess ? runtime : -1;
#else
  info["cuda"] = false;
#endif
#ifdef FASTDDP_WITH_DISTRIBUTED
  info["distributed"] = true;
#else
  info["distributed"] = false;
#endif
  pybind11::list names;
  for (const auto& entry : registry()) names.append(entry.first);
  info["capabilities"] = names;
  return info;
}

}  // namespace

bool register_binding(const char* name, BindFn fn) {
  registry().emplace_back(name, fn);
  return true;
}

void bind_all(pybind11::module_& m) {
  auto& entries = registry();
  std::sort(entries.begin(), entries.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  for (const auto& entry : entries) entry.second(m);
}

}  // namespace fastddp::bindings

PYBIND11_MODULE(_C, m) {
  m.doc() = "fastddp C++/CUDA core";
  m.def("_build_info", &fastddp::bindings::build_info,
        "Facts compiled into the extension (versions, CUDA on/off, capabilities).");
  fastddp::bindings::bind_all(m);
}
