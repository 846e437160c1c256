// Chunked multi-tensor launcher: packs (tensor, chunk) work items for many tensors into one
// kernel argument block and launches a kernel per full block, so a list of hundreds of
// gradients costs a handful of launches. Every fused AMP kernel goes through it.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <vector>

namespace fastddp::amp::cuda {

constexpr int kMaxTensors = 48;   // per launch; the argument block stays under 4 KiB
constexpr int kMaxBlocks = 320;
constexpr int64_t kChunkSize = 65536;
constexpr int kThreads = 512;

struct TensorListMeta {
  void* addresses[kMaxTensors];
  int64_t sizes[kMaxTensors];
  unsigned char block_to_tensor[kMaxBlocks];
  int block_to_chunk[kMaxBlocks];
};

// Calls launch(meta, blocks) for every full argument block. All tensors must share a dtype
// and device; launch must enqueue on the current stream and check the launch.
template <typename Launch>
void multi_tensor_apply(const std::vector<at::Tensor>& tensors, Launch&& launch) {
  TensorListMeta meta;
  int ntensors = 0;
  int nblocks = 0;
  for (size_t t = 0; t < tensors.size(); ++t) {
    const int64_t n = tensors[t].numel();
    if (n == 0) continue;
    meta.addresses[ntensors] = tensors[t].data_ptr();
    meta.sizes[ntensors] = n;
    ++ntensors;
    const int64_t chunks = (n + kChunkSize - 1) / kChunkSize;
    for (int64_t c = 0; c < chunks; ++c) {
      meta.block_to_tensor[nblocks] = static_cast<unsigned char>(ntensors - 1);
      meta.block_to_chunk[nblocks] = static_cast<int>(c);
      ++nblocks;
      const bool blocks_full = nblocks == kMaxBlocks;
      const bool tensors_full = ntensors == kMaxTensors && c == chunks - 1;
      if (blocks_full || tensors_full) {
        launch(meta, nblocks);
        nblocks = 0;
        if (c == chunks - 1) {
          ntensors = 0;
        } else {
          // The current tensor continues in the next argument block, as its slot 0.
          meta.addresses[0] = meta.addresses[ntensors - 1];
          meta.sizes[0] = meta.sizes[ntensors - 1];
          ntensors = 1;
        }
      }
    }
  }
  if (nblocks > 0) launch(meta, nblocks);
}

}  // namespace fastddp::amp::cuda
