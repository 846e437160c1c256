#include "data/pipeline.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <cstring>

#ifdef FASTDDP_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include "data/gather.h"
#endif

namespace fastddp::data {

// One ring slot. Invariant: batch b lives in slot b % slots. A worker refills a slot with
// batch b only after the consumer has moved two batches past its previous occupant b - slots
// (released_ > b - slots + 1): a Python loop variable keeps the previous batch alive until
// next() returns, so waiting one batch longer spares a reallocation on every refill. If the
// consumer still holds a reference to that slot's buffers then (it kept a batch), the slot
// gets fresh buffers and the kept ones become the consumer's alone.
struct PrefetchPipeline::Slot {
  std::vector<at::Tensor> host;    // staging buffers, max_rows x row shape
  std::vector<at::Tensor> device;  // device buffers (CUDA mode)
  at::Tensor idx_host;             // direct path: the batch's indices, pinned
  at::Tensor idx_device;           // direct path: the same on the device
  int64_t batch = -1;              // batch held, valid when ready
  bool ready = false;
#ifdef FASTDDP_WITH_CUDA
  std::unique_ptr<at::cuda::CUDAEvent> copied;    // H2D copy finished (side stream)
  std::unique_ptr<at::cuda::CUDAEvent> released;  // consumer's stream done with the slot
#endif
};

namespace {

bool held_elsewhere(const std::vector<at::Tensor>& buffers) {
  for (const auto& t : buffers)
    if (t.defined() && t.storage().use_count() > 1) return true;
  return false;
}

}  // namespace

PrefetchPipeline::PrefetchPipeline(std::vector<at::Tensor> sources, std::vector<at::Tensor> batches,
                                   PipelineOptions options)
    : sources_(std::move(sources)), batches_(std::move(batches)), options_(options) {
  TORCH_CHECK(!sources_.empty(), "PrefetchLoader: need at least one source tensor");
  TORCH_CHECK(options_.num_workers >= 1, "PrefetchLoader: num_workers must be >= 1, got ",
              options_.num_workers);
  TORCH_CHECK(options_.prefetch >= 1, "PrefetchLoader: prefetch must be >= 1, got ", options_.prefetch);
  const int64_t rows = sources_[0].dim() > 0 ? sources_[0].size(0) : -1;
  for (size_t i = 0; i < sources_.size(); ++i) {
    const auto& s = sources_[i];
    TORCH_CHECK(s.device().is_cpu(), "PrefetchLoader: source ", i, " must be a CPU tensor, is on ", s.device());
    TORCH_CHECK(s.dim() >= 1 && s.size(0) == rows, "PrefetchLoader: every source needs the same first "
                "dimension; source 0 has ", rows, " rows, source ", i, " has shape ", s.sizes());
    TORCH_CHECK(s.is_contiguous(), "PrefetchLoader: source ", i, " must be contiguous");
  }
  for (size_t b = 0; b < batches_.size(); ++b) {
    const auto& idx = batches_[b];
    TORCH_CHECK(idx.scalar_type() == at::kLong && idx.dim() == 1 && idx.device().is_cpu(),
                "PrefetchLoader: batch ", b, " indices must be a 1-D int64 CPU tensor, got ",
                idx.scalar_type(), " of shape ", idx.sizes());
    batches_[b] = idx.contiguous();
    max_rows_ = std::max(max_rows_, idx.size(0));
    // Checked here, on the caller's thread, before any work starts: a bad index is one clear
    // error at the start of the pass rather than a failure in a worker halfway through it.
    check_indices(static_cast<int64_t>(b));
  }
#ifndef FASTDDP_WITH_CUDA
  TORCH_CHECK(options_.device.is_cpu(), "PrefetchLoader: device ", options_.device,
              " needs fastddp built with CUDA; rebuild with FASTDDP_WITH_CUDA=1, or use device=None");
#else
  if (options_.device.is_cuda()) {
    c10::cuda::CUDAGuard guard(options_.device);
    direct_ = true;
    for (const auto& s : sources_) {
      const void* mapped = s.numel() ? cuda::mapped_device_pointer(s.data_ptr()) : nullptr;
      mapped_.push_back(mapped);
      direct_ = direct_ && mapped != nullptr;
    }
  }
#endif
  // Never fewer slots than workers, or workers would queue behind each other's slots; one
  // more than asked for because a slot is refilled one batch after the consumer left it.
  const int64_t nslots = std::max(options_.prefetch, options_.num_workers + 1) + 1;
  for (int64_t i = 0; i < nslots; ++i) {
    slots_.push_back(std::make_unique<Slot>());
    allocate(*slots_.back(), /*host=*/!direct_, /*device=*/!options_.device.is_cpu());
  }
  const int64_t nworkers = std::min<int64_t>(options_.num_workers, std::max<int64_t>(1, size()));
  for (int64_t i = 0; i < nworkers; ++i) workers_.emplace_back([this] { worker_loop(); });
}

PrefetchPipeline::~PrefetchPipeline() { close(); }

void PrefetchPipeline::allocate(Slot& slot, bool host, bool device) {
  if (host) {
    slot.host.clear();
    for (const auto& s : sources_) {
      auto shape = s.sizes().vec();
      shape[0] = max_rows_;
      slot.host.push_back(at::empty(shape, s.options().pinned_memory(options_.pin_memory)));
    }
  }
#ifdef FASTDDP_WITH_CUDA
  if (device) {
    // Allocated on this thread's current stream (the default stream in a worker): a buffer
    // the consumer keeps is freed by the consumer, and the caching allocator orders its reuse
    // after work on that stream, with no record_stream.
    c10::cuda::CUDAGuard guard(options_.device);
    slot.device.clear();
    for (const auto& s : sources_) {
      auto shape = s.sizes().vec();
      shape[0] = max_rows_;
      slot.device.push_back(at::empty(shape, s.options().device(options_.device)));
    }
    if (direct_) {
      slot.idx_host = at::empty({max_rows_}, at::TensorOptions(at::kLong).pinned_memory(true));
      slot.idx_device = at::empty({max_rows_}, at::TensorOptions(at::kLong).device(options_.device));
    }
    if (!slot.copied) slot.copied = std::make_unique<at::cuda::CUDAEvent>(cudaEventDisableTiming);
    if (!slot.released) slot.released = std::make_unique<at::cuda::CUDAEvent>(cudaEventDisableTiming);
  }
#endif
}

void PrefetchPipeline::worker_loop() {
#ifdef FASTDDP_WITH_CUDA
  std::optional<c10::cuda::CUDAStream> stream;
  if (options_.device.is_cuda()) {
    c10::cuda::CUDAGuard guard(options_.device);
    stream = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, options_.device.index());
  }
#endif
  const int64_t nslots = static_cast<int64_t>(slots_.size());
  while (true) {
    const int64_t b = next_batch_.fetch_add(1);
    if (b >= size()) return;
    Slot& slot = *slots_[b % nslots];
    {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [&] { return stop_ || released_ > b - nslots + 1; });
      if (stop_) return;
    }
    try {
      const bool device = !options_.device.is_cpu();
      if (held_elsewhere(device ? slot.device : slot.host)) allocate(slot, !device, device);
#ifdef FASTDDP_WITH_CUDA
      if (direct_) {
        c10::cuda::CUDAStreamGuard on_side_stream(*stream);  // gather_on_device uses it
        slot.released->block(*stream);
        gather_on_device(slot, b);
        slot.copied->record(*stream);
        // idx_host is rewritten for batch b + slots: the copy out of it must be over by then.
        slot.copied->synchronize();
      } else {
        fill(slot, b);
      }
      if (stream && !direct_) {
        c10::cuda::CUDAGuard guard(options_.device);
        // The side stream waits until the consumer's stream is done with this device slot.
        slot.released->block(*stream);
        const int64_t n = batches_[b].size(0);
        for (size_t i = 0; i < sources_.size(); ++i) {
          const size_t bytes = static_cast<size_t>(n) * slot.host[i].stride(0) * slot.host[i].element_size();
          if (bytes == 0) continue;
          C10_CUDA_CHECK(cudaMemcpyAsync(slot.device[i].data_ptr(), slot.host[i].data_ptr(), bytes,
                                         cudaMemcpyHostToDevice, stream->stream()));
        }
        slot.copied->record(*stream);
        // The staging buffer is refilled only for batch b + slots; by then this copy must be
        // over, so wait here (off the consumer's path) rather than there.
        slot.copied->synchronize();
      }
#else
      fill(slot, b);
#endif
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!error_) error_ = std::current_exception();
      stop_ = true;
      cv_.notify_all();
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      slot.batch = b;
      slot.ready = true;
    }
    cv_.notify_all();
  }
}

void PrefetchPipeline::check_indices(int64_t batch) const {
  const at::Tensor& idx = batches_[batch];
  const int64_t n = idx.size(0);
  const int64_t* ids = idx.data_ptr<int64_t>();
  const int64_t rows = sources_[0].size(0);
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(ids[i] >= 0 && ids[i] < rows, "PrefetchLoader: index ", ids[i], " in batch ", batch,
                " is out of range for a dataset of ", rows, " samples");
  }
}

void PrefetchPipeline::gather_on_device(Slot& slot, int64_t batch) {
#ifdef FASTDDP_WITH_CUDA
  const at::Tensor& idx = batches_[batch];
  const int64_t n = idx.size(0);
  if (n == 0) return;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(options_.device.index()).stream();
  std::memcpy(slot.idx_host.data_ptr(), idx.data_ptr(), static_cast<size_t>(n) * sizeof(int64_t));
  C10_CUDA_CHECK(cudaMemcpyAsync(slot.idx_device.data_ptr(), slot.idx_host.data_ptr(),
                                 static_cast<size_t>(n) * sizeof(int64_t), cudaMemcpyHostToDevice, stream));
  const int64_t rows = sources_[0].size(0);
  for (size_t s = 0; s < sources_.size(); ++s) {
    const auto& src = sources_[s];
    const size_t row_bytes = static_cast<size_t>(src.numel() / std::max<int64_t>(rows, 1)) * src.element_size();
    cuda::gather_rows(mapped_[s], slot.idx_device.data_ptr<int64_t>(), n, row_bytes,
                      slot.device[s].data_ptr(), stream);
  }
#else
  (void)slot;
  (void)batch;
  TORCH_CHECK(false, "PrefetchLoader: the device gather needs a CUDA build");
#endif
}

void PrefetchPipeline::fill(Slot& slot, int64_t batch) {
  const at::Tensor& idx = batches_[batch];
  const int64_t n = idx.size(0);
  const int64_t* ids = idx.data_ptr<int64_t>();
  const int64_t rows = sources_[0].size(0);
  for (size_t s = 0; s < sources_.size(); ++s) {
    const auto& src = sources_[s];
    const size_t row_bytes = static_cast<size_t>(src.numel() / std::max<int64_t>(rows, 1)) * src.element_size();
    const char* from = static_cast<const char*>(src.data_ptr());
    char* to = static_cast<char*>(slot.host[s].data_ptr());
    for (int64_t i = 0; i < n; ++i) std::memcpy(to + i * row_bytes, from + ids[i] * row_bytes, row_bytes);
  }
}

std::vector<at::Tensor> PrefetchPipeline::next() {
  const int64_t nslots = static_cast<int64_t>(slots_.size());
  const bool device = !options_.device.is_cpu();
  std::unique_lock<std::mutex> lock(mutex_);
  if (handed_ > released_) {
    // The caller moved on from the batch handed out last: its slot may be refilled.
    Slot& prev = *slots_[(handed_ - 1) % nslots];
    prev.ready = false;
#ifdef FASTDDP_WITH_CUDA
    if (device) {
      c10::cuda::CUDAGuard guard(options_.device);
      prev.released->record(c10::cuda::getCurrentCUDAStream(options_.device.index()));
    }
#endif
    released_ = handed_;
    cv_.notify_all();
  }
  if (handed_ >= size()) return {};
  const int64_t b = handed_++;
  Slot& slot = *slots_[b % nslots];
  cv_.wait(lock, [&] { return error_ || (slot.ready && slot.batch == b); });
  if (error_) std::rethrow_exception(error_);
  const int64_t n = batches_[b].size(0);
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < sources_.size(); ++i) {
    out.push_back((device ? slot.device[i] : slot.host[i]).narrow(0, 0, n));
  }
#ifdef FASTDDP_WITH_CUDA
  if (device) {
    c10::cuda::CUDAGuard guard(options_.device);
    slot.copied->block(c10::cuda::getCurrentCUDAStream(options_.device.index()));
  }
#endif
  return out;
}

void PrefetchPipeline::close() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : workers_)
    if (t.joinable()) t.join();
  workers_.clear();
}

}  // namespace fastddp::data
