#include "amp/amp.h"

#include "amp/multi_tensor.h"
#include "amp/scale_update.h"
#include "common/cpu_kernels.h"

#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <cmath>
#include <limits>

namespace fastddp::amp {
namespace {

constexpr int64_t kChunk = 1 << 16;

void check_grads(const std::vector<at::Tensor>& grads, const c10::Device& device, const char* op) {
  for (size_t i = 0; i < grads.size(); ++i) {
    const auto& g = grads[i];
    TORCH_CHECK(g.device() == device, op, ": gradient ", i, " is on ", g.device(), " but the others are on ",
                device, "; all gradients handled in one call must share a device");
    // Every kernel here is elementwise (or a sum), so any dense layout is one span of numel()
    // elements starting at data_ptr(): channels_last and transposed gradients need no copy.
    TORCH_CHECK(g.is_non_overlapping_and_dense(), op, ": gradient ", i, " of shape ", g.sizes(), " has strides ",
                g.strides(), ", which leave gaps or overlap; give it a dense layout (.contiguous())");
    // NotImplementedError, as torch's unscale kernel raises for complex gradients
    TORCH_CHECK_NOT_IMPLEMENTED(at::isFloatingType(g.scalar_type()), op, ": gradient ", i, " has dtype ",
                                g.scalar_type(), "; GradScaler handles floating-point gradients only (as "
                                "torch.amp.GradScaler)");
  }
}

bool on_cuda(const std::vector<at::Tensor>& grads, const at::Tensor& other) {
  return other.is_cuda() || (!grads.empty() && grads[0].is_cuda());
}

void require_cuda_build(const char* op) {
#ifndef FASTDDP_WITH_CUDA
  TORCH_CHECK(false, op, ": CUDA tensors need fastddp built with CUDA; rebuild with FASTDDP_WITH_CUDA=1");
#endif
}

}  // namespace

void accumulate_stats_(const std::vector<at::Tensor>& grads, at::Tensor& stats) {
  TORCH_CHECK(stats.scalar_type() == at::kDouble && stats.numel() == 1,
              "accumulate_stats_: stats must be a float64 tensor of 1 element, got ", stats.scalar_type(),
              " of shape ", stats.sizes());
  check_grads(grads, stats.device(), "accumulate_stats_");
  if (on_cuda(grads, stats)) {
    require_cuda_build("accumulate_stats_");
#ifdef FASTDDP_WITH_CUDA
    cuda::accumulate_stats_(grads, stats);
#endif
    return;
  }
  const auto plan = plan_chunks(grads, kChunk);
  std::vector<double> partial(plan.size(), 0.0);
  for_each_chunk(plan, [&](int64_t i, const Chunk& c) {
    const auto& g = grads[c.tensor];
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.scalar_type(), "accumulate_stats_", [&] {
      partial[i] = sum_squares(g.const_data_ptr<scalar_t>() + c.begin, c.end - c.begin);
    });
  });
  double total = 0;
  for (double v : partial) total += v;
  stats.data_ptr<double>()[0] += total;
}

std::vector<at::Tensor> finalize(const at::Tensor& stats, const at::Tensor& scale, double max_norm, double eps) {
  TORCH_CHECK(stats.scalar_type() == at::kDouble && stats.numel() == 1,
              "finalize: stats must be a float64 tensor of 1 element, got ", stats.scalar_type());
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == 1,
              "finalize: scale must be a float32 tensor of 1 element, got ", scale.scalar_type(), " of shape ",
              scale.sizes());
  TORCH_CHECK(stats.device() == scale.device(), "finalize: stats on ", stats.device(), " but scale on ",
              scale.device(), "; keep the loss scale on the gradients' device");
  if (stats.is_cuda()) {
    require_cuda_build("finalize");
#ifdef FASTDDP_WITH_CUDA
    return cuda::finalize(stats, scale, max_norm, eps);
#endif
  }
  const auto opts = scale.options();
  at::Tensor found_inf = at::empty({1}, opts);
  at::Tensor norm = at::empty({}, opts);
  at::Tensor coef = at::empty({1}, opts);
  at::Tensor inv_coef = at::empty({1}, opts);
  const FinalizeResult r = finalize_rule(stats.data_ptr<double>()[0], scale.data_ptr<float>()[0], max_norm > 0,
                                         static_cast<float>(max_norm), static_cast<float>(eps));
  found_inf.data_ptr<float>()[0] = r.found_inf;
  norm.data_ptr<float>()[0] = r.norm;
  coef.data_ptr<float>()[0] = r.coef;
  inv_coef.data_ptr<float>()[0] = r.inv_coef;
  return {found_inf, norm, coef, inv_coef};
}

void scale_(const std::vector<at::Tensor>& grads, const at::Tensor& coef) {
  TORCH_CHECK(coef.scalar_type() == at::kFloat && coef.numel() == 1,
              "scale_: coef must be a float32 tensor of 1 element, got ", coef.scalar_type());
  check_grads(grads, coef.device(), "scale_");
  if (on_cuda(grads, coef)) {
    require_cuda_build("scale_");
#ifdef FASTDDP_WITH_CUDA
    cuda::scale_(grads, coef);
#endif
    return;
  }
  const float c = coef.data_ptr<float>()[0];
  // As torch's unscale kernel: a coefficient of 1 leaves the values as they are (a multiply
  // would flush subnormals to zero under torch.set_flush_denormal(True)).
  if (c == 1.0f) return;
  const auto plan = plan_chunks(grads, kChunk);
  for_each_chunk(plan, [&](int64_t, const Chunk& ch) {
    const auto& g = grads[ch.tensor];
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.scalar_type(), "scale_", [&] {
      scale_in_place(g.data_ptr<scalar_t>() + ch.begin, ch.end - ch.begin, c);
    });
  });
}

void update_scale_(at::Tensor& scale, at::Tensor& growth_tracker, const at::Tensor& found_inf,
                   double growth_factor, double backoff_factor, int64_t growth_interval) {
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == 1, "update_scale_: scale must be float32[1], got ",
              scale.scalar_type(), " of shape ", scale.sizes());
  TORCH_CHECK(growth_tracker.scalar_type() == at::kInt && growth_tracker.numel() == 1,
              "update_scale_: growth_tracker must be int32[1], got ", growth_tracker.scalar_type(),
              " of shape ", growth_tracker.sizes());
  TORCH_CHECK(found_inf.scalar_type() == at::kFloat && found_inf.numel() == 1,
              "update_scale_: found_inf must be float32[1], got ", found_inf.scalar_type(), " of shape ",
              found_inf.sizes());
  TORCH_CHECK(scale.device() == growth_tracker.device() && scale.device() == found_inf.device(),
              "update_scale_: scale, growth_tracker and found_inf must share a device, got ", scale.device(),
              ", ", growth_tracker.device(), ", ", found_inf.device());
  // growth_interval <= 0 is accepted as torch's kernel accepts it: the count of clean steps
  // (>= 1) never equals it, so the scale only backs off.
  if (scale.is_cuda()) {
    require_cuda_build("update_scale_");
#ifdef FASTDDP_WITH_CUDA
    cuda::update_scale_(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval);
#endif
    return;
  }
  update_loss_scale(scale.data_ptr<float>(), growth_tracker.data_ptr<int32_t>(), found_inf.data_ptr<float>()[0],
                    growth_factor, backoff_factor, growth_interval);
}

}  // namespace fastddp::amp
