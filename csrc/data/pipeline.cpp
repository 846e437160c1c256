#include "data/pipeline.h"

#include <ATen/ops/empty.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>

#include <unistd.h>

#include <algorithm>
#include <cstring>

namespace fastddp::data {

// One ring slot. Invariant: batch b lives in slot b % slots. A worker refills a slot with
// batch b only after the consumer has moved two batches past its previous occupant b - slots
// (released_ > b - slots + 1): a Python loop variable keeps the previous batch alive until
// next() returns, so waiting one batch longer spares a reallocation on every refill. If the
// consumer still holds a reference to that slot's buffers then (it kept a batch), the slot
// gets fresh buffers and the kept ones become the consumer's alone.
struct PrefetchPipeline::Slot {
  std::vector<at::Tensor> host;     // staging buffers, capacity x row shape (none when direct)
  int64_t capacity = 0;             // rows the host buffers hold
  std::unique_ptr<DeviceSlot> dev;  // with a device stage
  int64_t batch = -1;               // batch held, valid when ready
  int64_t rows = 0;                 // rows of that batch
  bool ready = false;
};

PrefetchPipeline::PrefetchPipeline(std::vector<at::Tensor> sources, PipelineOptions options)
    : sources_(std::move(sources)), options_(options), owner_pid_(getpid()) {
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
  if (!options_.device.is_cpu()) stage_ = make_cuda_stage(sources_, options_);
  // Never fewer slots than workers, or workers would queue behind each other's slots; one
  // more than asked for because a slot is refilled one batch after the consumer left it.
  const int64_t nslots = std::max(options_.prefetch, options_.num_workers + 1) + 1;
  TORCH_CHECK(options_.batch_rows >= 0, "PrefetchLoader: batch_rows must be >= 0, got ", options_.batch_rows);
  for (int64_t i = 0; i < nslots; ++i) {
    slots_.push_back(std::make_unique<Slot>());
    // Allocated here, on the caller's thread, when the batch size is known: the first batches
    // then wait for no allocation, and the buffers come from the caller's warm heap.
    if (options_.batch_rows > 0) prepare_host(*slots_.back(), options_.batch_rows);
  }
}

PrefetchPipeline::~PrefetchPipeline() {
  close();
  if (!pooled() || getpid() != owner_pid_) return;  // (the pool's mutex, too, is the parent's)
  std::vector<std::vector<at::Tensor>> ring;
  for (auto& slot : slots_) ring.push_back(std::move(slot->host));
  options_.pool->give(std::move(ring));
}

// Host slots come from and go back to the loader's pool: unpinned ones only (see slot_pool.h).
bool PrefetchPipeline::pooled() const { return options_.pool && !options_.pin_memory && !stage_; }

// A copy of `indices` the pipeline alone owns, checked: its workers drop their references
// without the GIL, which the last reference to a tensor Python also holds would need; a bad
// index is an error of the submitting call, raised on the caller's thread, never a worker's.
at::Tensor PrefetchPipeline::owned_indices(at::Tensor indices) const {
  TORCH_CHECK(indices.scalar_type() == at::kLong && indices.dim() == 1 && indices.device().is_cpu(),
              "PrefetchLoader: batch indices must be a 1-D int64 CPU tensor, got ",
              indices.scalar_type(), " of shape ", indices.sizes());
  indices = indices.clone(at::MemoryFormat::Contiguous);
  const int64_t rows = sources_[0].size(0);
  const int64_t* ids = indices.data_ptr<int64_t>();
  for (int64_t i = 0; i < indices.size(0); ++i) {
    TORCH_CHECK(ids[i] >= 0 && ids[i] < rows, "PrefetchLoader: index ", ids[i],
                " is out of range for a dataset of ", rows, " samples");
  }
  return indices;
}

void PrefetchPipeline::enqueue(std::vector<Span> batches) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(!finished_, "PrefetchLoader: submit() after finish()");
    for (auto& b : batches) batches_.push_back(std::move(b));
  }
  cv_.notify_all();
  // The workers start with the first batches queued: a thread that starts on work is running
  // at once, where one that went to sleep waiting for work takes a wake-up to resume.
  std::lock_guard<std::mutex> lock(threads_mutex_);
  if (workers_.empty() && !closed_)
    for (int64_t i = 0; i < options_.num_workers; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
}

void PrefetchPipeline::submit(at::Tensor indices) {
  at::Tensor owned = owned_indices(std::move(indices));
  const int64_t n = owned.size(0);
  std::vector<Span> one;
  one.push_back(Span{std::move(owned), 0, n});
  enqueue(std::move(one));
}

void PrefetchPipeline::submit_split(at::Tensor indices, int64_t batch_size) {
  TORCH_CHECK(batch_size >= 1, "PrefetchLoader: batch_size must be >= 1, got ", batch_size);
  at::Tensor owned = owned_indices(std::move(indices));
  std::vector<Span> batches;
  const int64_t n = owned.size(0);
  batches.reserve(static_cast<size_t>((n + batch_size - 1) / batch_size));
  for (int64_t start = 0; start < n; start += batch_size)
    batches.push_back(Span{owned, start, std::min(batch_size, n - start)});
  enqueue(std::move(batches));
}

void PrefetchPipeline::finish() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    finished_ = true;
  }
  cv_.notify_all();
}

int64_t PrefetchPipeline::submitted() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<int64_t>(batches_.size());
}

int64_t PrefetchPipeline::position() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return handed_;
}

bool PrefetchPipeline::take(int64_t& batch, Span& span) {
  const int64_t nslots = static_cast<int64_t>(slots_.size());
  std::unique_lock<std::mutex> lock(mutex_);
  cv_.wait(lock, [&] { return stop_ || finished_ || next_batch_ < static_cast<int64_t>(batches_.size()); });
  if (stop_ || next_batch_ >= static_cast<int64_t>(batches_.size())) return false;
  batch = next_batch_++;
  span = std::move(batches_[batch]);  // the queue keeps no reference once a worker has it
  cv_.wait(lock, [&] { return stop_ || released_ > batch - nslots + 1; });
  return !stop_;
}

void PrefetchPipeline::worker_loop(int64_t worker) {
  const int64_t nslots = static_cast<int64_t>(slots_.size());
  int64_t b = 0;
  Span span;
  while (take(b, span)) {
    Slot& slot = *slots_[b % nslots];
    const int64_t n = span.count;
    try {
      prepare(slot, n);
      if (direct()) {
        stage_->gather(*slot.dev, span.indices.narrow(0, span.offset, n), worker);
      } else {
        fill(slot, span);
        if (stage_) stage_->upload(*slot.dev, slot.host, n, worker);
      }
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
      slot.rows = n;
      slot.ready = true;
    }
    cv_.notify_all();
  }
}

void PrefetchPipeline::prepare(Slot& slot, int64_t rows) {
  prepare_host(slot, rows);
  // Device buffers are allocated on the worker (its current stream is the default one), so a
  // buffer the consumer keeps is freed by the consumer with no record_stream.
  if (stage_ && (!slot.dev || slot.dev->capacity < rows || held_elsewhere(slot.dev->buffers))) {
    slot.dev = stage_->allocate(std::max(rows, slot.dev ? slot.dev->capacity : 0));
  }
}

void PrefetchPipeline::prepare_host(Slot& slot, int64_t rows) {
  if (direct() || (slot.capacity >= rows && !held_elsewhere(slot.host))) return;
  if (pooled()) {
    std::vector<at::Tensor> kept = options_.pool->take(sources_, rows);
    if (!kept.empty()) {
      slot.host = std::move(kept);
      slot.capacity = slot.host[0].size(0);
      return;
    }
  }
  const int64_t capacity = std::max(rows, slot.capacity);
  // Normal tensors even when the pass starts inside torch.inference_mode() (the constructor
  // runs on the caller's thread): a ring slot outlives the mode, and next() gives each batch
  // the mode of its own call (see delivered()).
  c10::InferenceMode normal_tensors(false);
  slot.host.clear();
  for (const auto& s : sources_) {
    auto shape = s.sizes().vec();
    shape[0] = capacity;
    slot.host.push_back(at::empty(shape, s.options().pinned_memory(options_.pin_memory)));
  }
  slot.capacity = capacity;
}

void PrefetchPipeline::fill(Slot& slot, const Span& span) {
  const int64_t n = span.count;
  const int64_t* ids = span.indices.data_ptr<int64_t>() + span.offset;
  const int64_t rows = sources_[0].size(0);
  for (size_t s = 0; s < sources_.size(); ++s) {
    const auto& src = sources_[s];
    const size_t row_bytes = static_cast<size_t>(src.numel() / std::max<int64_t>(rows, 1)) * src.element_size();
    const char* from = static_cast<const char*>(src.data_ptr());
    char* to = static_cast<char*>(slot.host[s].data_ptr());
    for (int64_t i = 0; i < n; ++i) std::memcpy(to + i * row_bytes, from + ids[i] * row_bytes, row_bytes);
  }
}

namespace {

// A tensor of its own over `t`'s memory, as the batch DataLoader has just collated: not a view
// (no _base, detach_() works) and, outside inference mode, with a version counter of its own at
// 0 (in-place changes to one batch do not show in the next batch's _version). The slot's storage
// stays shared, so a batch still held keeps its slot from being refilled (held_elsewhere).
at::Tensor fresh_alias(const at::Tensor& t) {
  at::Tensor alias = at::empty({0}, t.options());
  alias.set_(t.storage(), t.storage_offset(), t.sizes(), t.strides());
  if (!alias.is_inference()) alias.unsafeGetTensorImpl()->set_version_counter(c10::VariableVersion(0));
  return alias;
}

// A batch shorter than its slot (a pass's last batch) in memory of its own size, pinned where the
// slot is: DataLoader's short batch has a storage of its size, and a view would make
// torch.save(batch) write, and a kept batch hold, the whole slot.
at::Tensor own_storage(const at::Tensor& rows) {
  auto options = rows.options();
  if (rows.is_cpu() && rows.is_pinned()) options = options.pinned_memory(true);
  at::Tensor out = at::empty(rows.sizes(), options);
  out.copy_(rows);
  return out;
}

// The first `rows` rows of a slot as next() hands them out. DataLoader makes a batch at next(),
// so it is an inference tensor exactly when next() runs inside torch.inference_mode(): the
// batch is made in the caller's mode over the slot's memory (a slot is a normal tensor). A short
// batch gets memory of its own size.
at::Tensor delivered(const at::Tensor& slot, int64_t rows) {
  at::Tensor view = slot.narrow(0, 0, rows);
  return fresh_alias(rows < slot.size(0) ? own_storage(view) : view);
}

}  // namespace

std::vector<at::Tensor> PrefetchPipeline::next() {
  const int64_t nslots = static_cast<int64_t>(slots_.size());
  std::unique_lock<std::mutex> lock(mutex_);
  if (handed_ > released_) {
    // The caller moved on from the batch handed out last: its slot may be refilled.
    Slot& prev = *slots_[(handed_ - 1) % nslots];
    prev.ready = false;
    if (stage_ && prev.dev) stage_->release(*prev.dev);
    released_ = handed_;
    cv_.notify_all();
  }
  if (handed_ >= static_cast<int64_t>(batches_.size())) {
    TORCH_CHECK(finished_, "PrefetchLoader: next() with no batch submitted (submit one, or call finish())");
    return {};
  }
  const int64_t b = handed_++;
  Slot& slot = *slots_[b % nslots];
  cv_.wait(lock, [&] { return error_ || (slot.ready && slot.batch == b); });
  if (error_) std::rethrow_exception(error_);
  if (stage_) stage_->wait_ready(*slot.dev);  // the current stream waits for the slot's copy
  std::vector<at::Tensor> out;
  for (const auto& t : stage_ ? slot.dev->buffers : slot.host) out.push_back(delivered(t, slot.rows));
  return out;
}

void PrefetchPipeline::close() {
  if (getpid() != owner_pid_) {  // a forked child: the threads are the parent's
    for (auto& t : workers_)
      if (t.joinable()) t.detach();
    return;
  }
  std::lock_guard<std::mutex> threads_lock(threads_mutex_);
  closed_ = true;
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
