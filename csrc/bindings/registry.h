// Each capability's binding file registers itself here, so adding a capability touches
// only its own files. This header and csrc/bindings/*.cpp are the only places that
// know about pybind11.
#pragma once

#include <torch/extension.h>

namespace fastddp::bindings {

using BindFn = void (*)(pybind11::module_&);

// Returns true so it can initialise a namespace-scope constant (see FASTDDP_BINDING).
bool register_binding(const char* name, BindFn fn);

// Calls every registered binding, in name order so the module layout is deterministic.
void bind_all(pybind11::module_& m);

}  // namespace fastddp::bindings

#define FASTDDP_BINDING_CAT2(a, b) a##b
#define FASTDDP_BINDING_CAT(a, b) FASTDDP_BINDING_CAT2(a, b)
// Usage (at namespace scope in csrc/bindings/<capability>.cpp):
//   FASTDDP_BINDING(sampler, [](pybind11::module_& m) { ... });
#define FASTDDP_BINDING(name, fn)                                                   \
  static const bool FASTDDP_BINDING_CAT(fastddp_binding_registered_, name) = \
      ::fastddp::bindings::register_binding(#name, fn)
