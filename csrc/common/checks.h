// Error helpers shared by every capability. Boundary checks are TORCH_CHECKs at each API edge
// that print the offending values; CUDA launches are followed by C10_CUDA_KERNEL_LAUNCH_CHECK().
#pragma once

#include <torch/types.h>

namespace fastddp {

// An exception's message for a user-facing error: a c10::Error's without its C++ frames
// (the caller's own context names where it happened), any other exception's what().
inline std::string error_message(const std::exception& e) {
  const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
  return c10_error ? c10_error->what_without_backtrace() : e.what();
}

}  // namespace fastddp
