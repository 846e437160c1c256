// The device side of PrefetchPipeline, behind one interface so that the pipeline itself is
// plain C++ over host memory: a CUDA build provides the stage in data/cuda/ (side streams,
// events, the zero-copy gather kernel); a CPU build has none and refuses a device.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "data/slot_pool.h"

namespace fastddp::data {

struct PipelineOptions {
  int64_t num_workers = 2;
  int64_t prefetch = 4;     // ring slots
  bool pin_memory = false;  // page-locked staging (needs a CUDA-capable torch at run time)
  c10::Device device = c10::Device(c10::kCPU);
  int64_t batch_rows = 0;   // rows of the largest batch when known: slots are allocated up front
  std::shared_ptr<SlotPool> pool;  // the loader's unpinned host slots, kept between passes (optional)
};

// One ring slot's device buffers and whatever the stage needs to order their use.
struct DeviceSlot {
  virtual ~DeviceSlot() = default;
  std::vector<at::Tensor> buffers;  // capacity x row shape, one per source
  int64_t capacity = 0;             // rows
};

class DeviceStage {
 public:
  virtual ~DeviceStage() = default;
  // True when rows are gathered on the device straight from page-locked sources.
  virtual bool direct() const = 0;
  // Fresh buffers for `rows` rows of every source.
  virtual std::unique_ptr<DeviceSlot> allocate(int64_t rows) = 0;
  // Worker `worker`: gather rows `indices` of the sources into the slot (direct path only).
  virtual void gather(DeviceSlot& slot, const at::Tensor& indices, int64_t worker) = 0;
  // Worker `worker`: copy the first `rows` rows of the host staging buffers into the slot.
  virtual void upload(DeviceSlot& slot, const std::vector<at::Tensor>& host, int64_t rows,
                      int64_t worker) = 0;
  // Consumer: the caller's current stream is done with the slot once its queued work ends.
  virtual void release(DeviceSlot& slot) = 0;
  // Consumer: the caller's current stream waits for the slot's gather or upload.
  virtual void wait_ready(DeviceSlot& slot) = 0;
};

// The stage for options.device (a CUDA device): defined in data/cuda/ in CUDA builds; in a
// CPU build it raises, naming the rebuild that is needed.
std::unique_ptr<DeviceStage> make_cuda_stage(const std::vector<at::Tensor>& sources,
                                             const PipelineOptions& options);

}  // namespace fastddp::data
