// The Reducer's side of the fingerprints (fingerprint.h): what it puts in each reduction's
// fingerprint, how the fingerprint travels beside the last bucket, and the error on a mismatch.
#include "reducer/reducer.h"

#include <ATen/autocast_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <cmath>

namespace fastddp::reducer {

namespace {

// The process-group transport's result, [max f, max -f] per word: the ranks agree iff
// max == min for every word (a joined rank's wildcard is below every value).
bool wire_differs(const at::Tensor& host) {
  const int64_t* r = host.data_ptr<int64_t>();
  for (int w = 0; w < kFingerprintWords; ++w)
    if (r[w] != -r[kFingerprintWords + w]) return true;
  return false;
}

// The header of the last bucket: one slot per rank of kFingerprintWords words, each word's 64
// bits as four 16-bit chunks, which fp32 and fp64 hold exactly; a rank writes only its own
// slot and zeros the others, so the SUM all-reduce of the bucket gathers every rank's.
constexpr int64_t kChunks = 4;

template <typename T>
void write_slot(T* header, int64_t elems, int rank, const Fingerprint& fp) {
  std::fill(header, header + elems, T(0));
  T* slot = header + static_cast<int64_t>(rank) * kFingerprintWords * kChunks;
  for (int w = 0; w < kFingerprintWords; ++w) {
    const auto bits = static_cast<uint64_t>(fp.words[w]);
    for (int64_t c = 0; c < kChunks; ++c) slot[w * kChunks + c] = static_cast<T>((bits >> (16 * c)) & 0xffff);
  }
}

template <typename T>
std::vector<Fingerprint> read_slots(const T* header, int world) {
  std::vector<Fingerprint> out(world);
  for (int r = 0; r < world; ++r) {
    const T* slot = header + static_cast<int64_t>(r) * kFingerprintWords * kChunks;
    for (int w = 0; w < kFingerprintWords; ++w) {
      uint64_t bits = 0;
      for (int64_t c = 0; c < kChunks; ++c)
        bits |= static_cast<uint64_t>(std::llround(static_cast<double>(slot[w * kChunks + c]))) << (16 * c);
      out[r].words[w] = static_cast<int64_t>(bits);
    }
  }
  return out;
}

}  // namespace

int64_t Reducer::fingerprint_header_elems(const at::Tensor& first, bool compress) const {
  const int world = process_group_->getSize();
  // Two ranks only: from three on, gloo's order of addition follows the bucket's length
  // (ring_order.h), so a header would change the gradients' bits; the fingerprint then goes in
  // an all-reduce of its own beside the bucket's.
  if (!fingerprint_ || compress || !first.device().is_cpu() || world > 2) return 0;
  if (first.scalar_type() != at::kFloat && first.scalar_type() != at::kDouble) return 0;
  return static_cast<int64_t>(world) * kFingerprintWords * kChunks;
}

int64_t Reducer::layout_hash_locked() const {
  uint64_t h = kFpSeed;
  for (const auto& bucket : buckets_) {
    h = fp_mix(h, static_cast<int64_t>(bucket.params.size()));
    for (int64_t i : bucket.params) {
      const auto& p = params_[i];
      h = fp_mix(h, static_cast<int64_t>(p.scalar_type()));
      h = fp_mix(h, p.dim());
      for (int64_t s : p.sizes()) h = fp_mix(h, s);
    }
  }
  return fp_finish(h);
}

void Reducer::note_reducing_forward_locked() {
  fp_nosync_ = nosync_steps_;  // since the last reduction (a reducing forward may have had no backward)
  if (!params_.empty()) {
    const auto device_type = params_.front().device().type();
    fp_autocast_ = at::autocast::is_autocast_enabled(device_type)
                       ? 1 + static_cast<int64_t>(at::autocast::get_autocast_dtype(device_type))
                       : 0;
  }
  std::fill(unused_now_.begin(), unused_now_.end(), 0);
  std::fill(missing_now_.begin(), missing_now_.end(), 0);
  fp_unused_ = 0;
  fp_missing_ = 0;
}

void Reducer::note_unused_locked(const std::vector<char>& reached) {
  uint64_t h = kFpSeed;
  for (int64_t i = 0; i < static_cast<int64_t>(params_.size()); ++i) {
    if (reached[i]) continue;
    unused_now_[i] = 1;
    h = fp_mix(h, i);
  }
  if (options_.fingerprint_unused) fp_unused_ = fp_finish(h);
}

void Reducer::check_fingerprints_locked(const std::string& missing_error) {
  const bool desync = fingerprint_mismatch_locked();
  if (!desync && missing_error.empty()) return;
  for (int64_t index = 0; index < static_cast<int64_t>(buckets_.size()); ++index) {
    auto& bucket = buckets_[index];
    if (bucket.work) wait_bucket_locked(*bucket.work, index);
    bucket.work.reset();
  }
  if (desync) raise_desync_locked(fp_reported_);
  fail_logged_locked(missing_error);
}

Fingerprint Reducer::next_fingerprint_locked() {
  Fingerprint f;
  auto& w = f.words;
  w[kFpStep] = fp_reductions_++ & kFpMask;
  w[kFpBuckets] = static_cast<int64_t>(buckets_.size());
  w[kFpLayout] = fp_layout_;
  uint64_t h = kFpSeed;
  for (int64_t i = 0; i < static_cast<int64_t>(params_.size()); ++i)
    if (params_[i].requires_grad()) h = fp_mix(h, i);
  w[kFpRequiresGrad] = fp_finish(h);
  w[kFpUnused] = fp_unused_;
  w[kFpNoSync] = fp_nosync_ & kFpMask;
  w[kFpAutocast] = fp_autocast_;
  w[kFpMissing] = fp_missing_;
  w[kFpSeq] = fp_collectives_ & kFpMask;
  return f;
}

c10::intrusive_ptr<c10d::Work> Reducer::launch_last_bucket_locked(Bucket& bucket, bool squares,
                                                                  const Fingerprint& fp) {
  fp_sent_ = fp;
  fp_work_.reset();
  fp_shm_work_.reset();
  fp_header_work_.reset();
  if (bucket.shm) {
    // The fingerprint rides in this rank's slot of the collective: no extra synchronisation.
    fp_shm_work_ = allreduce_wire_locked(bucket, squares, &fp);
    return fp_shm_work_;
  }
  if (bucket.header > 0) {
    // Gathered by the bucket's own all-reduce: no extra collective.
    const int64_t total = bucket.buffer.numel();
    const int rank = process_group_->getRank();
    if (bucket.wire.scalar_type() == at::kFloat) {
      write_slot(bucket.wire.data_ptr<float>() + total, bucket.header, rank, fp);
    } else {
      write_slot(bucket.wire.data_ptr<double>() + total, bucket.header, rank, fp);
    }
    fp_header_work_ = allreduce_wire_locked(bucket, squares);
    return fp_header_work_;
  }
  auto work = allreduce_wire_locked(bucket, squares);
  auto host = at::empty({2 * kFingerprintWords}, at::TensorOptions().dtype(at::kLong));
  int64_t* v = host.data_ptr<int64_t>();
  for (int w = 0; w < kFingerprintWords; ++w) {
    v[w] = fp.words[w];
    v[kFingerprintWords + w] = fp.is_wildcard() ? kFpWildcard : -fp.words[w];
  }
  const auto device = bucket.buffer.device();
  fp_wire_ = device.is_cpu() ? host : host.to(device, /*non_blocking=*/false);
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::MAX;
  std::vector<at::Tensor> tensors{fp_wire_};
  fp_work_ = process_group_->allreduce(tensors, opts);
  return work;
}

bool Reducer::fingerprint_mismatch_locked() {
  const int64_t last = static_cast<int64_t>(buckets_.size()) - 1;  // the fingerprint's carrier
  if (fp_shm_work_) {
    auto work = std::move(fp_shm_work_);
    wait_bucket_locked(*work, last);
    fp_reported_ = fp_sent_;
    return static_cast<const ShmWork&>(*work).fingerprint_mismatch();
  }
  if (fp_header_work_) {
    auto work = std::move(fp_header_work_);
    wait_bucket_locked(*work, last);
    fp_reported_ = fp_sent_;
    const auto& bucket = buckets_.back();
    const int64_t total = bucket.buffer.numel();
    const int world = process_group_->getSize();
    return fingerprints_differ(bucket.wire.scalar_type() == at::kFloat
                                   ? read_slots(bucket.wire.data_ptr<float>() + total, world)
                                   : read_slots(bucket.wire.data_ptr<double>() + total, world));
  }
  if (!fp_work_) return false;
  auto work = std::move(fp_work_);
  wait_bucket_locked(*work, last);
  if (!fp_wire_.is_cuda()) {
    fp_reported_ = fp_sent_;
    return wire_differs(fp_wire_);
  }
  // On a GPU, reading the result now would wait for the whole backward: the result goes to
  // pinned memory behind an event and is read at the next reduction, long after it arrived.
  bool previous = false;
  if (fp_event_) {
    fp_event_->synchronize();
    previous = wire_differs(fp_host_);
    fp_reported_ = fp_host_sent_;
  }
  fp_host_ = at::empty({2 * kFingerprintWords}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  fp_host_.copy_(fp_wire_, /*non_blocking=*/true);
  const c10::impl::VirtualGuardImpl guard(fp_wire_.device().type());
  fp_event_.emplace(fp_wire_.device().type());
  fp_event_->record(guard.getStream(fp_wire_.device()));
  fp_host_sent_ = fp_sent_;
  return previous;
}

void Reducer::raise_desync_locked(const Fingerprint& mine) {
  const int64_t n = static_cast<int64_t>(params_.size());
  DesyncDetail detail;
  detail.fingerprint = mine;
  detail.requires_grad.resize(params_.size());
  for (int64_t i = 0; i < n; ++i) detail.requires_grad[i] = params_[i].requires_grad();
  detail.missing = missing_now_;
  detail.unused = unused_now_;
  const auto packed = pack_detail(detail);
  auto local = at::empty({static_cast<int64_t>(packed.size())}, at::TensorOptions().dtype(at::kLong));
  std::copy(packed.begin(), packed.end(), local.data_ptr<int64_t>());
  const auto device = buckets_.empty() ? at::Device(at::kCPU) : buckets_.front().buffer.device();
  if (!device.is_cpu()) local = local.to(device);
  std::vector<std::vector<at::Tensor>> gathered(1);
  for (int r = 0; r < process_group_->getSize(); ++r) gathered[0].push_back(at::empty_like(local));
  std::vector<at::Tensor> input{local};
  process_group_->allgather(gathered, input)->wait();
  std::vector<DesyncDetail> per_rank;
  for (const auto& t : gathered[0]) {
    const auto host = t.cpu();
    per_rank.push_back(unpack_detail(host.data_ptr<int64_t>(), n));
  }
  const std::string message = explain_desync(per_rank, names_, find_unused_);
  if (desync_handler_) desync_handler_(message);
  TORCH_CHECK(false, message);
}

void Reducer::set_desync_handler(std::function<void(const std::string&)> handler) {
  std::lock_guard<std::mutex> lock(mutex_);
  desync_handler_ = std::move(handler);
}

}  // namespace fastddp::reducer
