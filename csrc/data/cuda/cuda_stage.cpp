// The CUDA device stage of PrefetchPipeline: each worker brings its slots to the device on its
// own side stream (a copy of the pinned staging buffer, or, when every source is page-locked,
// a gather kernel reading the rows straight out of host memory), and events order a slot's
// reuse after the consumer's stream is done with it.
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>

#include "data/cuda/gather.h"
#include "data/device_stage.h"

namespace fastddp::data {
namespace {

struct CudaSlot final : DeviceSlot {
  at::Tensor idx_host;    // direct path: the batch's indices, pinned
  at::Tensor idx_device;  // direct path: the same on the device
  at::cuda::CUDAEvent copied{cudaEventDisableTiming};    // gather/copy finished (side stream)
  at::cuda::CUDAEvent released{cudaEventDisableTiming};  // consumer's stream done with the slot
};

class CudaStage final : public DeviceStage {
 public:
  CudaStage(const std::vector<at::Tensor>& sources, const PipelineOptions& options)
      : sources_(sources), device_(options.device) {
    TORCH_CHECK(device_.is_cuda(), "PrefetchLoader: no device stage for ", device_);
    c10::cuda::CUDAGuard guard(device_);
    direct_ = true;
    for (const auto& s : sources_) {
      const void* mapped = s.numel() ? cuda::mapped_device_pointer(s.data_ptr()) : nullptr;
      mapped_.push_back(mapped);
      direct_ = direct_ && mapped != nullptr;
    }
    for (int64_t i = 0; i < options.num_workers; ++i)
      streams_.push_back(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device_.index()));
  }

  bool direct() const override { return direct_; }

  std::unique_ptr<DeviceSlot> allocate(int64_t rows) override {
    // Allocated on this thread's current stream (the default stream in a worker): a buffer
    // the consumer keeps is freed by the consumer, and the caching allocator orders its reuse
    // after work on that stream, with no record_stream.
    c10::cuda::CUDAGuard guard(device_);
    auto slot = std::make_unique<CudaSlot>();
    for (const auto& s : sources_) {
      auto shape = s.sizes().vec();
      shape[0] = rows;
      slot->buffers.push_back(at::empty(shape, s.options().device(device_)));
    }
    if (direct_) {
      slot->idx_host = at::empty({rows}, at::TensorOptions(at::kLong).pinned_memory(true));
      slot->idx_device = at::empty({rows}, at::TensorOptions(at::kLong).device(device_));
    }
    slot->capacity = rows;
    return slot;
  }

  void gather(DeviceSlot& base, const at::Tensor& indices, int64_t worker) override {
    auto& slot = static_cast<CudaSlot&>(base);
    const c10::cuda::CUDAStream& stream = streams_.at(worker);
    c10::cuda::CUDAStreamGuard on_side_stream(stream);
    slot.released.block(stream);
    const int64_t n = indices.size(0);
    if (n > 0) {
      std::memcpy(slot.idx_host.data_ptr(), indices.data_ptr(), static_cast<size_t>(n) * sizeof(int64_t));
      C10_CUDA_CHECK(cudaMemcpyAsync(slot.idx_device.data_ptr(), slot.idx_host.data_ptr(),
                                     static_cast<size_t>(n) * sizeof(int64_t), cudaMemcpyHostToDevice,
                                     stream.stream()));
      const int64_t rows = sources_[0].size(0);
      for (size_t s = 0; s < sources_.size(); ++s) {
        const auto& src = sources_[s];
        const size_t row_bytes = static_cast<size_t>(src.numel() / std::max<int64_t>(rows, 1)) * src.element_size();
        cuda::gather_rows(mapped_[s], slot.idx_device.data_ptr<int64_t>(), n, row_bytes,
                          slot.buffers[s].data_ptr(), stream.stream());
      }
    }
    slot.copied.record(stream);
    // idx_host is rewritten for the slot's next batch: the copy out of it must be over by then.
    slot.copied.synchronize();
  }

  void upload(DeviceSlot& base, const std::vector<at::Tensor>& host, int64_t rows, int64_t worker) override {
    auto& slot = static_cast<CudaSlot&>(base);
    const c10::cuda::CUDAStream& stream = streams_.at(worker);
    c10::cuda::CUDAGuard guard(device_);
    // The side stream waits until the consumer's stream is done with this device slot.
    slot.released.block(stream);
    for (size_t i = 0; i < host.size(); ++i) {
      const size_t bytes = static_cast<size_t>(rows) * host[i].stride(0) * host[i].element_size();
      if (bytes == 0) continue;
      C10_CUDA_CHECK(cudaMemcpyAsync(slot.buffers[i].data_ptr(), host[i].data_ptr(), bytes,
                                     cudaMemcpyHostToDevice, stream.stream()));
    }
    slot.copied.record(stream);
    // The staging buffer is refilled for the slot's next batch; by then this copy must be
    // over, so wait here (off the consumer's path) rather than there.
    slot.copied.synchronize();
  }

  void release(DeviceSlot& base) override {
    c10::cuda::CUDAGuard guard(device_);
    static_cast<CudaSlot&>(base).released.record(c10::cuda::getCurrentCUDAStream(device_.index()));
  }

  void wait_ready(DeviceSlot& base) override {
    c10::cuda::CUDAGuard guard(device_);
    static_cast<CudaSlot&>(base).copied.block(c10::cuda::getCurrentCUDAStream(device_.index()));
  }

 private:
  std::vector<at::Tensor> sources_;
  c10::Device device_;
  bool direct_ = false;
  std::vector<const void*> mapped_;  // direct: device-visible addresses of the sources
  std::vector<c10::cuda::CUDAStream> streams_;  // one side stream per worker
};

}  // namespace

std::unique_ptr<DeviceStage> make_cuda_stage(const std::vector<at::Tensor>& sources,
                                             const PipelineOptions& options) {
  return std::make_unique<CudaStage>(sources, options);
}

}  // namespace fastddp::data
