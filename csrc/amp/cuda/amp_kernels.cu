#include "amp/amp.h"
#include "amp/cuda/multi_tensor_apply.cuh"
#include "amp/scale_update.h"

#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>

#include <map>

namespace fastddp::amp::cuda {
namespace {

// 16-byte vector loads/stores when a chunk is aligned; scalar code for the rest.
template <typename T>
struct alignas(16) Vec16 {
  static constexpr int kSize = 16 / sizeof(T);
  T v[kSize];
};

template <typename T>
__device__ bool aligned16(const T* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

// An element in double: half/bfloat16 through float (their conversion), double as it is (through
// float it would turn values beyond float32's range into inf).
template <typename T>
__device__ double as_double(T x) {
  return static_cast<double>(static_cast<float>(x));
}
__device__ double as_double(double x) { return x; }

// Sum of squares, NaN exactly when an element is inf/NaN (x - x), as the CPU sum_squares.
template <typename scalar_t>
__global__ void sumsq_kernel(TensorListMeta meta, double* __restrict__ out) {
  const int t = meta.block_to_tensor[blockIdx.x];
  const int64_t begin = static_cast<int64_t>(meta.block_to_chunk[blockIdx.x]) * kChunkSize;
  const int64_t n = min(meta.sizes[t] - begin, kChunkSize);
  const scalar_t* p = static_cast<const scalar_t*>(meta.addresses[t]) + begin;
  double acc = 0.0;
  constexpr int V = Vec16<scalar_t>::kSize;
  if (aligned16(p)) {
    const int64_t nvec = n / V;
    const auto* pv = reinterpret_cast<const Vec16<scalar_t>*>(p);
    for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x) {
      const Vec16<scalar_t> v = pv[i];
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const double x = as_double(v.v[j]);
        acc += x * x + (x - x);
      }
    }
    for (int64_t i = nvec * V + threadIdx.x; i < n; i += blockDim.x) {
      const double x = as_double(p[i]);
      acc += x * x + (x - x);
    }
  } else {
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      const double x = as_double(p[i]);
      acc += x * x + (x - x);
    }
  }
  // Block reduction: warp shuffles, then one value per warp in shared memory.
  __shared__ double warp_sums[kThreads / 32];
  for (int offset = 16; offset > 0; offset >>= 1) acc += __shfl_down_sync(0xffffffff, acc, offset);
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = acc;
  __syncthreads();
  if (threadIdx.x < 32) {
    acc = threadIdx.x < blockDim.x / 32 ? warp_sums[threadIdx.x] : 0.0;
    for (int offset = 16; offset > 0; offset >>= 1) acc += __shfl_down_sync(0xffffffff, acc, offset);
    if (threadIdx.x == 0) atomicAdd(out, acc);
  }
}

template <typename scalar_t>
__global__ void scale_kernel(TensorListMeta meta, const float* __restrict__ coef) {
  const int t = meta.block_to_tensor[blockIdx.x];
  const int64_t begin = static_cast<int64_t>(meta.block_to_chunk[blockIdx.x]) * kChunkSize;
  const int64_t n = min(meta.sizes[t] - begin, kChunkSize);
  scalar_t* p = static_cast<scalar_t*>(meta.addresses[t]) + begin;
  const float c = *coef;
  constexpr int V = Vec16<scalar_t>::kSize;
  if (aligned16(p)) {
    const int64_t nvec = n / V;
    auto* pv = reinterpret_cast<Vec16<scalar_t>*>(p);
    for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x) {
      Vec16<scalar_t> v = pv[i];
#pragma unroll
      for (int j = 0; j < V; ++j) v.v[j] = static_cast<scalar_t>(static_cast<float>(v.v[j]) * c);
      pv[i] = v;
    }
    for (int64_t i = nvec * V + threadIdx.x; i < n; i += blockDim.x)
      p[i] = static_cast<scalar_t>(static_cast<float>(p[i]) * c);
  } else {
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) p[i] = static_cast<scalar_t>(static_cast<float>(p[i]) * c);
  }
}

// double inputs keep double math in the multiply
template <>
__global__ void scale_kernel<double>(TensorListMeta meta, const float* __restrict__ coef) {
  const int t = meta.block_to_tensor[blockIdx.x];
  const int64_t begin = static_cast<int64_t>(meta.block_to_chunk[blockIdx.x]) * kChunkSize;
  const int64_t n = min(meta.sizes[t] - begin, kChunkSize);
  double* p = static_cast<double*>(meta.addresses[t]) + begin;
  const double c = *coef;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) p[i] *= c;
}

__global__ void finalize_kernel(const double* __restrict__ stats, const float* __restrict__ scale, bool clip,
                                float max_norm, float eps, float* found_inf, float* norm, float* coef,
                                float* inv_coef) {
  const FinalizeResult r = finalize_rule(stats[0], scale[0], clip, max_norm, eps);
  found_inf[0] = r.found_inf;
  norm[0] = r.norm;
  coef[0] = r.coef;
  inv_coef[0] = r.inv_coef;
}

__global__ void update_scale_kernel(float* scale, int32_t* tracker, const float* found_inf, double growth,
                                    double backoff, int64_t interval) {
  update_loss_scale(scale, tracker, *found_inf, growth, backoff, interval);
}

// Kernels run per dtype: group the list by dtype, keeping each group's order.
std::map<at::ScalarType, std::vector<at::Tensor>> by_dtype(const std::vector<at::Tensor>& tensors) {
  std::map<at::ScalarType, std::vector<at::Tensor>> groups;
  for (const auto& t : tensors) groups[t.scalar_type()].push_back(t);
  return groups;
}

}  // namespace

void accumulate_stats_(const std::vector<at::Tensor>& grads, at::Tensor& stats) {
  c10::cuda::CUDAGuard guard(stats.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  for (auto& [dtype, group] : by_dtype(grads)) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "fastddp_sumsq", [&] {
      multi_tensor_apply(group, [&](const TensorListMeta& meta, int blocks) {
        sumsq_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(meta, stats.data_ptr<double>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
  }
}

std::vector<at::Tensor> finalize(const at::Tensor& stats, const at::Tensor& scale, double max_norm, double eps) {
  c10::cuda::CUDAGuard guard(stats.device());
  const auto opts = scale.options();
  at::Tensor found_inf = at::empty({1}, opts);
  at::Tensor norm = at::empty({}, opts);
  at::Tensor coef = at::empty({1}, opts);
  at::Tensor inv_coef = at::empty({1}, opts);
  finalize_kernel<<<1, 1, 0, c10::cuda::getCurrentCUDAStream()>>>(
      stats.data_ptr<double>(), scale.data_ptr<float>(), max_norm > 0, static_cast<float>(max_norm),
      static_cast<float>(eps),
      found_inf.data_ptr<float>(), norm.data_ptr<float>(), coef.data_ptr<float>(), inv_coef.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {found_inf, norm, coef, inv_coef};
}

void scale_(const std::vector<at::Tensor>& grads, const at::Tensor& coef) {
  c10::cuda::CUDAGuard guard(coef.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  for (auto& [dtype, group] : by_dtype(grads)) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "fastddp_scale", [&] {
      multi_tensor_apply(group, [&](const TensorListMeta& meta, int blocks) {
        scale_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(meta, coef.data_ptr<float>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
  }
}

void update_scale_(at::Tensor& scale, at::Tensor& growth_tracker, const at::Tensor& found_inf,
                   double growth_factor, double backoff_factor, int64_t growth_interval) {
  c10::cuda::CUDAGuard guard(scale.device());
  update_scale_kernel<<<1, 1, 0, c10::cuda::getCurrentCUDAStream()>>>(
      scale.data_ptr<float>(), growth_tracker.data_ptr<int32_t>(), found_inf.data_ptr<float>(), growth_factor,
      backoff_factor, growth_interval);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace fastddp::amp::cuda
