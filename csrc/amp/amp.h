// Fused AMP gradient work: one read pass for inf/NaN + sum of squares, one tiny step that
// turns that into found_inf / global norm / a single coefficient, one multiply pass, and
// torch's scale-update rule — on CPU here, on CUDA in cuda/amp_kernels.cu.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace fastddp::amp {

// stats: float64 tensor of 1 element on the grads' device. Adds the sum of squares of every
// element of `grads` to it. Any inf/NaN makes the sum non-finite, which is how found_inf is
// detected: squares of finite fp32/fp16/bf16 values cannot overflow a double. Can be called
// several times (e.g. once per all-reduced DDP bucket) before finalize().
void accumulate_stats_(const std::vector<at::Tensor>& grads, at::Tensor& stats);

// From the accumulated stats of the *scaled* gradients and the loss scale, computes
//   found_inf  float32[1]  1 if any gradient was inf/NaN
//   norm       float32[]   global L2 norm of the unscaled gradients
//   coef       float32[1]  inv_scale * min(1, max_norm / (norm + eps))   (max_norm <= 0: inv_scale)
//   inv_coef   float32[1]  1 / coef, the grad_scale a fused optimizer divides by
// with inv_scale = float(1 / double(scale)) exactly as torch.amp.GradScaler computes it.
std::vector<at::Tensor> finalize(const at::Tensor& stats, const at::Tensor& scale, double max_norm,
                                 double eps);

// grads *= coef[0], for every tensor (the coefficient stays on the device: no host sync).
void scale_(const std::vector<at::Tensor>& grads, const at::Tensor& coef);

// torch's _amp_update_scale_ rule: on found_inf, scale *= backoff and the tracker resets;
// otherwise the tracker counts up and at growth_interval the scale grows (if it stays finite).
void update_scale_(at::Tensor& scale, at::Tensor& growth_tracker, const at::Tensor& found_inf,
                   double growth_factor, double backoff_factor, int64_t growth_interval);

#ifdef FASTDDP_WITH_CUDA
namespace cuda {
void accumulate_stats_(const std::vector<at::Tensor>& grads, at::Tensor& stats);
std::vector<at::Tensor> finalize(const at::Tensor& stats, const at::Tensor& scale, double max_norm,
                                 double eps);
void scale_(const std::vector<at::Tensor>& grads, const at::Tensor& coef);
void update_scale_(at::Tensor& scale, at::Tensor& growth_tracker, const at::Tensor& found_inf,
                   double growth_factor, double backoff_factor, int64_t growth_interval);
}  // namespace cuda
#endif

}  // namespace fastddp::amp
