// Boundary checks shared by every capability. A misuse fails here, at the API edge,
// with the offending values in the message, instead of deep inside a kernel.
#pragma once

#include <torch/types.h>

#define FASTDDP_CHECK_CONTIGUOUS(x) \
  TORCH_CHECK((x).is_contiguous(), #x " must be contiguous (got strides ", (x).strides(), ")")

#define FASTDDP_CHECK_DEVICE(x, dev)                                                  \
  TORCH_CHECK((x).device() == (dev), #x " must be on ", (dev), " but is on ", \
              (x).device())

#define FASTDDP_CHECK_DTYPE(x, dt) \
  TORCH_CHECK((x).scalar_type() == (dt), #x " must have dtype ", (dt), " but has ", (x).scalar_type())

#define FASTDDP_CHECK_DIM(x, d) \
  TORCH_CHECK((x).dim() == (d), #x " must be ", (d), "-D but has shape ", (x).sizes())

// Every CUDA launch is followed by this: a bad launch configuration is reported at the
// launch site, not at the next unrelated synchronisation.
#define FASTDDP_CUDA_CHECK_LAUNCH() C10_CUDA_KERNEL_LAUNCH_CHECK()

namespace fastddp {

// An exception's message for a user-facing error: a c10::Error's without its C++ frames
// (the caller's own context names where it happened), any other exception's what().
inline std::string error_message(const std::exception& e) {
  const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
  return c10_error ? c10_error->what_without_backtrace() : e.what();
}

}  // namespace fastddp
