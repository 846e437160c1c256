// PrefetchPipeline: worker threads gather whole batches (rows of in-memory tensors selected by
// index tensors) into a ring of staging slots; in a CUDA build each filled slot is copied to a
// device slot on a dedicated stream. When every source already lives in page-locked memory,
// the device gathers the rows itself straight from it (direct path: no CPU copy, no staging).
// One pipeline serves one pass over a list of batches.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <atomic>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace fastddp::data {

struct PipelineOptions {
  int64_t num_workers = 2;
  int64_t prefetch = 4;        // ring slots
  bool pin_memory = false;     // page-locked staging (needs a CUDA-capable torch at run time)
  c10::Device device = c10::Device(c10::kCPU);
};

class PrefetchPipeline {
 public:
  // sources: CPU tensors sharing their first dimension (rows are gathered from each);
  // batches: int64 CPU index tensors, yielded in this order.
  PrefetchPipeline(std::vector<at::Tensor> sources, std::vector<at::Tensor> batches,
                   PipelineOptions options);
  ~PrefetchPipeline();

  PrefetchPipeline(const PrefetchPipeline&) = delete;
  PrefetchPipeline& operator=(const PrefetchPipeline&) = delete;

  // The next batch (one tensor per source), or an empty vector when the pass is over.
  // Blocks until it is ready; rethrows a worker's error. Tensors on the device are ready for
  // use on the caller's current stream.
  std::vector<at::Tensor> next();

  // Stops and joins the workers (idempotent; also done by the destructor).
  void close();

  int64_t size() const { return static_cast<int64_t>(batches_.size()); }
  // True when the device gathers rows straight from page-locked sources (no staging copy).
  bool direct() const { return direct_; }
  int64_t position() const { return handed_; }

 private:
  struct Slot;

  void worker_loop();
  void check_indices(int64_t batch) const;
  void fill(Slot& slot, int64_t batch);
  void gather_on_device(Slot& slot, int64_t batch);
  void allocate(Slot& slot, bool host, bool device);

  std::vector<at::Tensor> sources_;
  std::vector<at::Tensor> batches_;
  PipelineOptions options_;
  int64_t max_rows_ = 0;
  bool direct_ = false;                  // CUDA: gather on the device from pinned sources
  std::vector<const void*> mapped_;      // direct: device-visible addresses of the sources
  std::vector<std::unique_ptr<Slot>> slots_;
  std::vector<std::thread> workers_;

  std::mutex mutex_;
  std::condition_variable cv_;
  std::atomic<int64_t> next_batch_{0};  // next batch number a worker takes
  int64_t handed_ = 0;                   // batches handed to the consumer
  int64_t released_ = 0;                 // batches the consumer has moved past
  bool stop_ = false;
  std::exception_ptr error_;
};

}  // namespace fastddp::data
