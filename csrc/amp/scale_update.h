// The fused step's two scalar rules, each defined once for the CPU path (amp.cpp) and the CUDA
// kernels (cuda/amp_kernels.cu).
//
// finalize_rule: from the sum of squares of the scaled gradients, the found-inf flag, the
// unscaled norm, and the coefficient that unscales and clips (torch.nn.utils.clip_grad_norm_'s
// max_norm / (norm + eps) clamped at 1, a NaN coefficient kept as torch's clamp keeps it).
//
// update_loss_scale: torch's loss-scale update rule (torch._amp_update_scale_): on an inf/NaN step the scale
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

struct FinalizeResult {
  float found_inf;  // 1 when an element was inf/NaN (the sum of squares is NaN), else 0
  float norm;       // the unscaled gradient norm; inf when the float64 sum of squares overflowed
  float coef;       // the factor that unscales (and clips, when asked) the gradients
  float inv_coef;   // 1 / coef
};

// `clip`: max_norm > 0 as the caller gave it (a float64), decided before max_norm is narrowed
FASTDDP_HOST_DEVICE inline FinalizeResult finalize_rule(double sumsq, float scale, bool clip, float max_norm,
                                                        float eps) {
#ifdef __CUDA_ARCH__
  const bool found = isnan(sumsq);  // an inf/NaN element; +inf is a finite float64 overflow
  const bool finite = isfinite(sumsq);
  const float total = static_cast<float>(sqrt(sumsq));
  const float infinity = INFINITY;
#else
  const bool found = std::isnan(sumsq);
  const bool finite = std::isfinite(sumsq);
  const float total = static_cast<float>(std::sqrt(sumsq));
  const float infinity = HUGE_VALF;
#endif
  const float inv_scale = static_cast<float>(1.0 / static_cast<double>(scale));
  const float unscaled = total * inv_scale;
  float c = inv_scale;
  if (clip && !found) {
    const float coefficient = max_norm / (unscaled + eps);
    c = inv_scale * (coefficient > 1.0f ? 1.0f : coefficient);  // NaN stays NaN, as torch.clamp
  }
  return {found ? 1.f : 0.f, finite ? unscaled : infinity, c, 1.0f / c};
}

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
