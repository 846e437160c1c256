// PrefetchPipeline: worker threads gather whole batches (rows of in-memory tensors selected by
// index tensors) into a ring of staging slots; with a device stage (CUDA builds) each filled
// slot is brought to the device on a side stream, or gathered there directly from page-locked
// sources. Batches are submitted one at a time, so the caller decides how far ahead of the
// consumer the batch plan is read; the worker threads start with the first batch submitted.
// One pipeline serves one pass; a SlotPool in the options carries its host slots to the next.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <sys/types.h>

#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "common/fork_safe.h"
#include "data/device_stage.h"

namespace fastddp::data {

class PrefetchPipeline {
 public:
  // sources: contiguous CPU tensors sharing their first dimension (rows are gathered from each).
  PrefetchPipeline(std::vector<at::Tensor> sources, PipelineOptions options);
  ~PrefetchPipeline();

  PrefetchPipeline(const PrefetchPipeline&) = delete;
  PrefetchPipeline& operator=(const PrefetchPipeline&) = delete;

  // Queues the next batch: a 1-D int64 CPU tensor of row numbers in [0, rows).
  void submit(at::Tensor indices);
  // Queues consecutive batches of `batch_size` rows of `indices` (the last one may be
  // shorter): a whole pass planned at once costs one call and one copy of its indices.
  void submit_split(at::Tensor indices, int64_t batch_size);
  // No batch follows the ones submitted so far.
  void finish();

  // The next batch (one tensor per source), or an empty vector when every submitted batch was
  // handed out and finish() was called. Blocks until it is ready; rethrows a worker's error.
  // Tensors on the device are ready for use on the caller's current stream.
  std::vector<at::Tensor> next();

  // Stops and joins the workers (idempotent; also done by the destructor).
  void close();

  int64_t submitted() const;
  // True when the device gathers rows straight from page-locked sources (no staging copy).
  bool direct() const { return stage_ && stage_->direct(); }
  int64_t position() const;

 private:
  struct Slot;
  // One submitted batch: `count` rows of `indices` from `offset` (the batches of one
  // submit_split share its tensor, so queueing a batch makes no tensor).
  struct Span {
    at::Tensor indices;
    int64_t offset = 0;
    int64_t count = 0;
  };

  void worker_loop(int64_t worker);
  at::Tensor owned_indices(at::Tensor indices) const;
  void enqueue(std::vector<Span> batches);
  bool take(int64_t& batch, Span& span);
  void prepare(Slot& slot, int64_t rows);
  void prepare_host(Slot& slot, int64_t rows);
  bool pooled() const;
  void fill(Slot& slot, const Span& span);

  std::vector<at::Tensor> sources_;
  PipelineOptions options_;
  std::unique_ptr<DeviceStage> stage_;  // null when batches stay on the host
  std::vector<std::unique_ptr<Slot>> slots_;
  // A forked child (a DataLoader worker that collects a pipeline left in a reference cycle)
  // has none of the threads: it neither joins nor locks (close()), nor destroys cv_, which a
  // parent thread may have been waiting on (common/fork_safe.h).
  pid_t owner_pid_;
  std::mutex threads_mutex_;          // guards workers_ and closed_
  std::vector<std::thread> workers_;  // started by the first submit
  bool closed_ = false;

  mutable std::mutex mutex_;
  ParentOnly<std::condition_variable> cv_owner_;
  std::condition_variable& cv_ = *cv_owner_;
  std::vector<Span> batches_;  // submitted; an entry's tensor is dropped once a worker takes it
  bool finished_ = false;
  int64_t next_batch_ = 0;  // next batch number a worker takes
  int64_t handed_ = 0;      // batches handed to the consumer
  int64_t released_ = 0;    // batches the consumer has moved past
  bool stop_ = false;
  std::exception_ptr error_;
};

}  // namespace fastddp::data
