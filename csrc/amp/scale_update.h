// torch's loss-scale update rule (torch._amp_update_scale_), the one definition used by the
// CPU path (amp.cpp) and the CUDA kernel (cuda/amp_kernels.cu): on an inf/NaN step the scale
// is multiplied by backoff_factor and the count of clean steps restarts; after
// growth_interval clean steps in a row it is multiplied by growth_factor (unless that
// overflows float32) and the count restarts.
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define FASTDDP_HOST_DEVICE __host__ __device__
#else
#include <cmath>
#define FASTDDP_HOST_DEVICE
#endif

namespace fastddp::amp {

FASTDDP_HOST_DEVICE inline void update_loss_scale(float* scale, int32_t* growth_tracker, float found_inf,
                                                  double growth_factor, double backoff_factor,
                                                  int64_t growth_interval) {
  if (found_inf != 0.f) {
    *scale = static_cast<float>(static_cast<double>(*scale) * backoff_factor);
    *growth_tracker = 0;
    return;
  }
  const int32_t successful = *growth_tracker + 1;
  if (successful == growth_interval) {
    const float grown = static_cast<float>(static_cast<double>(*scale) * growth_factor);
#ifdef __CUDA_ARCH__
    const bool finite = isfinite(grown);
#else
    const bool finite = std::isfinite(grown);
#endif
    if (finite) *scale = grown;
    *growth_tracker = 0;
  } else {
    *growth_tracker = successful;
  }
}

}  // namespace fastddp::amp
