#include "data/cuda/gather.h"

#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>

#include <algorithm>

namespace fastddp::data::cuda {
namespace {

constexpr int kThreads = 256;

constexpr int kUnroll = 4;

// Consecutive threads read consecutive vectors of a row, so each warp's reads of host memory
// are contiguous (full PCIe read requests). Each thread issues kUnroll independent loads before
// its stores: a zero-copy read waits a PCIe round trip, and only many reads in flight per SM
// cover it.
template <typename V>
__global__ void gather_rows_kernel(const V* __restrict__ src, const int64_t* __restrict__ idx,
                                   int64_t n, int64_t row_vecs, V* __restrict__ dst) {
  const int64_t total = n * row_vecs;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; base < total;
       base += stride * kUnroll) {
    V v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t t = base + u * stride;
      if (t < total) {
        const int64_t row = t / row_vecs;
        v[u] = src[idx[row] * row_vecs + (t - row * row_vecs)];
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t t = base + u * stride;
      if (t < total) dst[t] = v[u];
    }
  }
}

template <typename V>
void launch(const void* src, const int64_t* idx, int64_t n, size_t row_bytes, void* dst,
            cudaStream_t stream) {
  const int64_t row_vecs = static_cast<int64_t>(row_bytes / sizeof(V));
  const int64_t total = n * row_vecs;
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  // Enough blocks for every SM to hold several at once, no more than the work needs.
  const int64_t per_block = int64_t{kThreads} * kUnroll;
  const int64_t blocks = std::min<int64_t>((total + per_block - 1) / per_block, int64_t{sms} * 8);
  gather_rows_kernel<V><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<const V*>(src), idx, n, row_vecs, static_cast<V*>(dst));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

bool fits(const void* src, const void* dst, size_t row_bytes, size_t width) {
  return row_bytes % width == 0 && reinterpret_cast<uintptr_t>(src) % width == 0 &&
         reinterpret_cast<uintptr_t>(dst) % width == 0;
}

}  // namespace

const void* mapped_device_pointer(const void* host) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, host) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the error the failed query left behind
    return nullptr;
  }
  if (attr.type != cudaMemoryTypeHost || attr.devicePointer == nullptr) return nullptr;
  return attr.devicePointer;
}

void gather_rows(const void* src, const int64_t* idx, int64_t n, size_t row_bytes, void* dst,
                 cudaStream_t stream) {
  TORCH_CHECK(n >= 0, "gather_rows: negative row count ", n);
  if (n == 0 || row_bytes == 0) return;
  // The widest access that divides the row and keeps every row aligned.
  if (fits(src, dst, row_bytes, 16)) return launch<uint4>(src, idx, n, row_bytes, dst, stream);
  if (fits(src, dst, row_bytes, 8)) return launch<uint2>(src, idx, n, row_bytes, dst, stream);
  if (fits(src, dst, row_bytes, 4)) return launch<uint32_t>(src, idx, n, row_bytes, dst, stream);
  if (fits(src, dst, row_bytes, 2)) return launch<uint16_t>(src, idx, n, row_bytes, dst, stream);
  launch<uint8_t>(src, idx, n, row_bytes, dst, stream);
}

}  // namespace fastddp::data::cuda
