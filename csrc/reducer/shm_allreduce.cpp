#include "reducer/shm_allreduce.h"
#include "reducer/layout.h"
#include "reducer/shm_protocol.h"
#include "reducer/shm_segment.h"

#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstring>
#include <optional>
#include <vector>

namespace fastddp::reducer {

struct ShmAllreduce::Task {
  c10::intrusive_ptr<ShmWork> work;
  std::vector<ShmPiece> pieces;     // all-reduce: the elements reduced in place, in order
  std::vector<at::Tensor> holders;  // all-reduce: what keeps the pieces' memory alive
  int64_t numel;                    // all-reduce: elements over all pieces
  at::ScalarType dtype;
  int64_t chunks;     // all-reduce: chunks, one sequence number each from seq on
  Scaling scale;
  uint32_t seq;
  std::vector<at::Tensor> broadcast;  // non-empty: a broadcast from rank 0 of these tensors
  bool sum_of_squares = false;        // all-reduce: also square the result (ShmWork)
  std::optional<Fingerprint> fingerprint;  // compared with the peers' in this collective
};

std::shared_ptr<ShmAllreduce> ShmAllreduce::create(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, bool wanted,
                                                   int64_t gradient_bytes, int64_t broadcast_bytes,
                                                   std::chrono::milliseconds timeout, std::string* why) {
  TORCH_CHECK(pg, "DDPWrapper: process group is null");
  TORCH_CHECK(gradient_bytes >= 0 && broadcast_bytes >= 0, "DDPWrapper: shared-memory all-reduce of ",
              gradient_bytes, " gradient bytes and a broadcast region of ", broadcast_bytes, " bytes");
  const int64_t chunk_bytes = chunk_bytes_for(gradient_bytes, pg->getSize());
  const int64_t broadcast_offset = 2 * chunk_bytes;  // after the two staging slots
  auto segment = map_shared_segment(pg, wanted, broadcast_offset + kBroadcastHeaderBytes + broadcast_bytes, why);
  if (!segment) return nullptr;
  return std::shared_ptr<ShmAllreduce>(
      new ShmAllreduce(std::move(segment), pg->getRank(), pg->getSize(), chunk_bytes, broadcast_offset, broadcast_bytes, timeout));
}

int64_t ShmAllreduce::chunk_bytes_for(int64_t gradient_bytes, int world) {
  constexpr int64_t kMin = 64 << 10, kMax = 1 << 20;
  // A rank touches 2 x world slots (its two and its peers' two each): a sixth of the gradients.
  return std::clamp(round_up(gradient_bytes / (12 * static_cast<int64_t>(world)), kPage), kMin, kMax);
}

ShmAllreduce::ShmAllreduce(std::shared_ptr<ShmSegment> segment, int rank, int world, int64_t chunk_bytes,
                           int64_t broadcast_offset, int64_t broadcast_bytes, std::chrono::milliseconds timeout)
    : segment_(std::move(segment)),
      rank_(rank),
      world_(world),
      chunk_bytes_(chunk_bytes),
      broadcast_offset_(broadcast_offset),
      broadcast_bytes_(broadcast_bytes),
      timeout_(timeout),
      spin_budget_(kSpinTime),
      owner_pid_(getpid()) {
  thread_ = std::thread([this] { run(); });
}

namespace {
std::atomic<bool> process_exiting{false};
}  // namespace

void ShmAllreduce::note_process_exiting() { process_exiting.store(true, std::memory_order_relaxed); }

ShmAllreduce::~ShmAllreduce() {
  if (getpid() != owner_pid_) {  // forked child (e.g. a DataLoader worker): no thread to join
    thread_.detach();
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  // after its last collective: a peer waiting for another one fails at once
  leave(process_exiting.load(std::memory_order_relaxed) ? kExited : kClosed);
}

c10::intrusive_ptr<ShmWork> ShmAllreduce::allreduce_sum(const at::Tensor& t, Scaling scale, bool sum_of_squares,
                                                        const Fingerprint* fingerprint) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "DDPWrapper: shared-memory all-reduce needs a contiguous "
              "CPU tensor, got ", t.device(), t.is_contiguous() ? "" : " (non-contiguous)");
  std::vector<ShmPiece> pieces{{static_cast<char*>(t.data_ptr()), t.numel()}};
  return allreduce_sum(std::move(pieces), {t}, t.scalar_type(), scale, sum_of_squares, fingerprint);
}

c10::intrusive_ptr<ShmWork> ShmAllreduce::allreduce_sum(std::vector<ShmPiece> pieces, std::vector<at::Tensor> holders,
                                                        at::ScalarType dtype, Scaling scale, bool sum_of_squares,
                                                        const Fingerprint* fingerprint) {
  check_in_owner();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kBFloat16 || dtype == at::kHalf,
              "DDPWrapper: shared-memory all-reduce supports float32/float64/bfloat16/float16, got ", dtype);
  int64_t numel = 0;
  for (const auto& p : pieces) {
    TORCH_CHECK(p.numel >= 0 && (p.data != nullptr || p.numel == 0), "DDPWrapper: shared-memory all-reduce piece "
                "of ", p.numel, " elements at ", static_cast<const void*>(p.data));
    numel += p.numel;
  }
  const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
  // At least one chunk, so that an empty tensor still meets the peers (and carries a fingerprint).
  const int64_t chunks = std::max<int64_t>(1, (bytes + chunk_bytes_ - 1) / chunk_bytes_);
  auto work = c10::make_intrusive<ShmWork>(c10d::OpType::ALLREDUCE, "fastddp:shm_all_reduce");
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(Task{work, std::move(pieces), std::move(holders), numel, dtype, chunks, scale, next_seq_, {},
                          sum_of_squares, fingerprint ? std::optional<Fingerprint>(*fingerprint) : std::nullopt});
    next_seq_ += static_cast<uint32_t>(chunks);
  }
  cv_.notify_one();
  return work;
}

void ShmAllreduce::broadcast_from_root(const std::vector<at::Tensor>& tensors) {
  check_in_owner();
  int64_t bytes = 0;
  for (const auto& t : tensors) {
    TORCH_CHECK(t.device().is_cpu() && t.layout() == at::kStrided, "DDPWrapper: shared-memory broadcast needs "
                "strided CPU tensors, got ", t.device(), " ", t.layout());
    bytes += aligned_bytes(t.numel() * static_cast<int64_t>(t.element_size()));
  }
  TORCH_CHECK(bytes <= broadcast_bytes_, "DDPWrapper: module buffers of ", bytes, " bytes do not fit the ",
              broadcast_bytes_, " bytes reserved for them at construction (were buffers replaced by larger ones?)");
  if (tensors.empty()) return;
  auto work = c10::make_intrusive<ShmWork>(c10d::OpType::BROADCAST, "fastddp:shm_broadcast");
  Task task{work, {}, {}, 0, at::kFloat, 0, Scaling{}, 0, tensors};
  bool inline_here = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    task.seq = next_seq_++;
    // A forward's broadcast usually finds the comm thread idle (the backward's reductions are
    // over): it runs on this thread then, which saves the two thread hand-offs that cost more
    // than the copy of a model's buffers. Otherwise it queues behind the pending collectives.
    inline_here = queue_.empty() && !busy_;
    if (inline_here) {
      busy_ = true;  // the comm thread leaves later tasks queued until this one is done
    } else {
      queue_.push_back(std::move(task));
    }
  }
  if (inline_here) {
    std::exception_ptr error = perform(task);
    task = Task{};
    bool queued_meanwhile = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      busy_ = false;
      queued_meanwhile = !queue_.empty();
    }
    // Waking the idle comm thread for nothing costs a context switch on a busy core.
    if (queued_meanwhile) cv_.notify_one();
    work->complete(error);
  } else {
    cv_.notify_one();
  }
  work->wait();
}

void ShmAllreduce::run() {
  while (true) {
    Task task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      // A broadcast's caller running its task keeps the tasks queued behind it waiting.
      cv_.wait(lock, [this] { return !busy_ && (stop_ || !queue_.empty()); });
      if (queue_.empty()) return;  // stop_ and nothing left
      task = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
    }
    std::exception_ptr error = perform(task);
    // The task's tensors go before the waiter wakes: the Reducer counts who holds a bucket's
    // memory right after wait() (move_lent_grads_locked, ensure_private_locked), and a
    // reference this thread still held would read as a script keeping a gradient.
    auto work = std::move(task.work);
    task = Task{};
    {
      std::lock_guard<std::mutex> lock(mutex_);
      busy_ = false;
    }
    work->complete(error);
  }
}

std::exception_ptr ShmAllreduce::perform(const Task& task) {
  try {
    std::string broken;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      broken = broken_;
      if (broken.empty() && stop_) broken = "the DDPWrapper was destroyed while an all-reduce was pending";
    }
    if (!broken.empty()) fail(broken);
    if (task.broadcast.empty()) {
      execute(task);
    } else {
      execute_broadcast(task);
    }
    return nullptr;
  } catch (const std::exception& e) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (broken_.empty()) broken_ = e.what();
    }
    leave(kFailed);
    return std::current_exception();
  }
}

void ShmAllreduce::check_in_owner() const {
  // A forked child shares the mapping and the rank's slot but has no comm thread: its
  // collectives would never run, and one run on its own thread would publish into the parent's
  // slot.
  const int pid = getpid();
  TORCH_CHECK(pid == owner_pid_, "DDPWrapper: process ", pid, " is a fork of rank ", rank_, "'s process ", owner_pid_,
              " and cannot run the wrapper's collectives (a forward with gradients on or a backward in a "
              "DataLoader worker or another forked child). Run the DDPWrapper in the process that built it; in a "
              "child use the wrapped module (ddp.module) under torch.no_grad().");
}

OpDescriptor* ShmAllreduce::broadcast_header() const {
  return reinterpret_cast<OpDescriptor*>(segment_->region(0) + broadcast_offset_);
}

void ShmAllreduce::execute_broadcast(const Task& task) {
  // Rank 0 packs its tensors into its broadcast region and publishes `ready`; every other rank
  // copies them out and publishes `done`. Rank 0 does not wait for that: it packs the region
  // again only after every rank is done with the previous broadcast, so a forward on rank 0
  // never waits for a slower peer here. The counters stay monotonic: the next collective's
  // sequence number is higher.
  auto* header = broadcast_header();
  char* region = segment_->region(0) + broadcast_offset_ + kBroadcastHeaderBytes;
  int64_t pos = 0;
  int64_t bytes = 0;
  for (const auto& t : task.broadcast) bytes += aligned_bytes(t.numel() * static_cast<int64_t>(t.element_size()));
  const OpDescriptor mine{bytes, task.seq, kBroadcastOp, 0};
  describe_own_op(mine);
  if (rank_ == 0) {
    if (last_broadcast_seq_ != 0) {
      for (int j = 1; j < world_; ++j) wait_for(j, kDone, last_broadcast_seq_);
    }
    last_broadcast_seq_ = task.seq;
    *header = mine;  // made visible by publish's release store
    for (const auto& t : task.broadcast) {
      const int64_t n = t.numel() * static_cast<int64_t>(t.element_size());
      if (n == 0) continue;  // an empty buffer's data pointer may be null
      if (t.is_contiguous()) {
        std::memcpy(region + pos, t.data_ptr(), static_cast<size_t>(n));
      } else {
        at::from_blob(region + pos, t.sizes(), t.options()).copy_(t);
      }
      pos += aligned_bytes(n);
    }
    publish(kReady, task.seq);
    return;
  }
  wait_for(0, kReady, task.seq);
  if (*header != mine) fail_mismatch(mine, 0, header->seq == task.seq ? *header : segment_->slot(0).op);
  for (const auto& t : task.broadcast) {
    const int64_t n = t.numel() * static_cast<int64_t>(t.element_size());
    if (n == 0) continue;
    if (t.is_contiguous()) {
      std::memcpy(t.data_ptr(), region + pos, static_cast<size_t>(n));
    } else {
      t.copy_(at::from_blob(region + pos, t.sizes(), t.options()));
    }
    pos += aligned_bytes(n);
  }
  publish(kDone, task.seq);
}

void ShmAllreduce::exchange_fingerprint(const Task& task) {
  // Written before `ready` of the collective's first chunk; read once every peer is ready. A
  // peer without a fingerprint for this collective issued a different one: a mismatch.
  std::vector<Fingerprint> all(world_);
  for (int j = 0; j < world_; ++j) {
    const auto& slot = segment_->slot(j);
    if (slot.fingerprint_seq != task.seq) {
      all[j].words.fill(-1);
      continue;
    }
    std::copy(slot.fingerprint, slot.fingerprint + kFingerprintWords, all[j].words.begin());
  }
  task.work->set_fingerprint_mismatch(fingerprints_differ(all));
}

void ShmAllreduce::execute(const Task& task) {
  describe_own_op({task.numel * static_cast<int64_t>(c10::elementSize(task.dtype)), task.seq, kAllreduceOp,
                   static_cast<int32_t>(task.dtype)});
  // gloo's order of addition (ring_order.h)
  const RingOrder order(task.numel, static_cast<int64_t>(c10::elementSize(task.dtype)), world_);
  double sumsq = 0.0;
  for (int64_t c = 0; c < task.chunks; ++c) sumsq += execute_chunk(task, order, c, task.seq + static_cast<uint32_t>(c));
  task.work->set_sum_of_squares(sumsq);
  // Nobody reads my slots any more: the next collective (or broadcast, or fingerprint) may
  // write them, whichever chunk it starts with.
  wait_peers(kDone, task.seq + static_cast<uint32_t>(task.chunks - 1));
}

namespace {

// Calls fn(data, k, count) for the collective's elements [lo, lo + n), piece by piece: `data`
// points at element lo + k in its piece's memory, and `count` elements follow it there.
template <class Fn>
void for_each_run(const std::vector<ShmPiece>& pieces, int64_t elem, int64_t lo, int64_t n, Fn&& fn) {
  int64_t start = 0;
  for (const auto& piece : pieces) {
    const int64_t end = start + piece.numel;
    if (end > lo && start < lo + n) {
      const int64_t a = std::max(lo, start), b = std::min(lo + n, end);
      fn(piece.data + (a - start) * elem, a - lo, b - a);
    }
    if (end >= lo + n) return;
    start = end;
  }
}

}  // namespace

// One chunk of an all-reduce, through staging slot chunk % 2 of every rank: copy in the slices
// the peers reduce, ready, reduce my slice (my own values read in place) into my gradients and
// my slot, reduced, copy the peers' reduced slices into my gradients, done. Returns the chunk's
// sum of squares, added in rank order so that every rank arrives at the same bits (one piece:
// a visitor that wants the squares keeps the bucket's gradients in its flat buffer).
double ShmAllreduce::execute_chunk(const Task& task, const RingOrder& order, int64_t chunk, uint32_t seq) {
  const auto dtype = task.dtype;
  const int64_t elem = static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t per_chunk = chunk_bytes_ / elem;
  const int64_t first = chunk * per_chunk;
  const int64_t n = std::max<int64_t>(0, std::min(per_chunk, task.numel - first));
  const int64_t stage_offset = (chunk % 2) * chunk_bytes_;
  char* mine = segment_->region(rank_) + stage_offset;
  auto lo = [&](int r) { return n * r / world_; };
  const int64_t my_lo = lo(rank_), my_hi = lo(rank_ + 1), my_n = my_hi - my_lo;
  // This slot last held chunk - 2: every peer must be done reading it.
  if (chunk >= 2) wait_peers(kDone, seq - 2);
  auto copy_in = [&](int64_t at) {
    return [&, at](char* data, int64_t k, int64_t count) {
      std::memcpy(mine + (at + k) * elem, data, static_cast<size_t>(count * elem));
    };
  };
  for_each_run(task.pieces, elem, first, my_lo, copy_in(0));
  for_each_run(task.pieces, elem, first + my_hi, n - my_hi, copy_in(my_hi));
  if (chunk == 0 && task.fingerprint) {
    auto& slot = segment_->slot(rank_);
    std::copy(task.fingerprint->words.begin(), task.fingerprint->words.end(), slot.fingerprint);
    slot.fingerprint_seq = task.seq;  // both made visible by publish's release store
  }
  publish(kReady, seq);
  wait_peers(kReady, seq);
  if (chunk == 0) check_peers_run(task.seq);
  if (chunk == 0 && task.fingerprint) exchange_fingerprint(task);
  // Reduce my slice from every peer's slot and my own gradients into my gradients, and into my
  // slot for the peers (they read only their own slices of my slot until I publish `reduced`).
  const bool sq = task.sum_of_squares;
  std::vector<double> slice_squares(world_, 0.0);
  std::vector<const char*> slices(world_);
  // Added in gloo's order; the copies below cut the slices at the same places, so that a slice's
  // squares are summed in the same blocks by its owner and by its readers.
  order.for_each_run(first + my_lo, my_n, [&](int64_t at, int64_t length, int64_t c) {
    for_each_run(task.pieces, elem, first + my_lo + at, length, [&](char* data, int64_t k, int64_t count) {
      const int64_t offset = my_lo + at + k;
      for (int j = 0; j < world_; ++j) {
        const int r = order.rank(c, j);
        slices[j] = r == rank_ ? data : segment_->region(r) + stage_offset + offset * elem;
      }
      slice_squares[rank_] += reduce_slice(dtype, data, mine + offset * elem, slices, count, task.scale, sq);
    });
  });
  publish(kReduced, seq);
  // Copy the other ranks' reduced slices into my gradients.
  for (int k = 1; k < world_; ++k) {
    const int j = (rank_ + k) % world_;
    wait_for(j, kReduced, seq);
    const int64_t j_lo = lo(j), j_n = lo(j + 1) - j_lo;
    const char* reduced = segment_->region(j) + stage_offset;
    order.for_each_run(first + j_lo, j_n, [&](int64_t at, int64_t length, int64_t) {
      for_each_run(task.pieces, elem, first + j_lo + at, length, [&](char* data, int64_t i, int64_t count) {
        slice_squares[j] += copy_slice(dtype, data, reduced + (j_lo + at + i) * elem, count, sq);
      });
    });
  }
  publish(kDone, seq);
  double sumsq = 0.0;
  for (double v : slice_squares) sumsq += v;
  return sumsq;
}

}  // namespace fastddp::reducer
