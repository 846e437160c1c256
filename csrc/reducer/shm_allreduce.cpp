#include "reducer/shm_allreduce.h"
#include "reducer/layout.h"

#include "common/cpu_kernels.h"

#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>
#include <functional>
#include <optional>
#include <random>
#include <sstream>
#include <vector>

namespace fastddp::reducer {

namespace {

constexpr int64_t kSlotBytes = 128;              // one rank's counters, on their own cache lines
constexpr int64_t kPage = 4096;
constexpr int kReady = 0, kReduced = 1, kDone = 2;
// How long a wait busy-checks its counter before sleeping on the futex. A peer usually arrives
// within this on a latency-bound model, and a sleeping thread lets its (virtual) CPU idle, which
// costs tens to hundreds of µs to wake: the HAR MLP steps 4-8 % faster with 100 µs than with
// 6 µs (2-core VM, world 2); larger models do not change. A clock read every 64 checks.
// The budget adapts (ShmAllreduce::spin_budget_): a wait that outlasts kSpinTime (a peer that
// is descheduled or far behind) halves it, down to kMinSpin, and a wait kSpinTime would have
// caught doubles it again. When a neighbour's process takes the cores, waits for a preempted peer
// last time slices, and a full spin before each of them burnt most of the wrapper's CPU time.
constexpr auto kSpinTime = std::chrono::microseconds(100);
constexpr auto kMinSpin = std::chrono::microseconds(3);
constexpr auto kLivenessPeriod = std::chrono::milliseconds(200);

enum OpKind : int32_t { kNoOp = 0, kAllreduceOp = 1, kBroadcastOp = 2 };

struct RankSlot {
  std::atomic<uint32_t> counter[3];  // last collective (sequence number) that reached each phase
  int32_t pid;
  uint64_t start_time;  // /proc/<pid>/stat field 22: tells a live peer from a reused pid
  // The fingerprint of the rank's latest fingerprinted collective (its sequence number in
  // fingerprint_seq), written before the rank publishes `ready` for it; a peer reads it after
  // seeing that `ready`, and the rank cannot overwrite it before every peer published `done`.
  uint32_t fingerprint_seq;
  // The collective the rank runs: first sequence number, kind, bytes and dtype, written before
  // it publishes anything for it. A peer that reached the same sequence number in another
  // collective issued different collectives: each all-reduce compares them (check_peers_run).
  uint32_t op_seq;
  int64_t fingerprint[kFingerprintWords];
  int64_t op_bytes;
  int32_t op_kind;
  int32_t op_dtype;
  // Set when a collective failed on this rank: a peer waiting for it fails at once instead of
  // at the timeout (its error points at this rank's).
  std::atomic<uint32_t> failed;
};
static_assert(sizeof(RankSlot) <= kSlotBytes);

constexpr int64_t kBroadcastHeaderBytes = 64;  // BroadcastHeader's room, in front of the region

std::string describe_op(int32_t kind, int64_t bytes, int32_t dtype) {
  if (kind == kAllreduceOp)
    return "an all-reduce of " + std::to_string(bytes) + " bytes of " +
           c10::toString(static_cast<c10::ScalarType>(dtype)) + " (a gradient bucket, in a backward)";
  if (kind == kBroadcastOp)
    return "a broadcast of " + std::to_string(bytes) + " bytes of module buffers from rank 0 (in a forward)";
  return "no collective yet";
}
static_assert(std::atomic<uint32_t>::is_always_lock_free);

int64_t round_up(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

// Field 22 (start time) and the state of a process, from /proc/<pid>/stat; false if it is gone.
bool read_proc_stat(int pid, char* state, uint64_t* start_time) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto close = text.rfind(')');
  if (!in.good() && text.empty()) return false;
  if (close == std::string::npos || close + 2 >= text.size()) return false;
  std::istringstream fields(text.substr(close + 2));
  std::string field;
  fields >> field;  // field 3: state
  *state = field.empty() ? '?' : field[0];
  for (int i = 4; i <= 22 && fields >> field; ++i) {
    if (i == 22) {
      *start_time = std::stoull(field);
      return true;
    }
  }
  return false;
}

bool peer_alive(int pid, uint64_t start_time) {
  char state = '?';
  uint64_t start = 0;
  if (!read_proc_stat(pid, &state, &start)) return false;
  return state != 'Z' && state != 'X' && start == start_time;
}

uint64_t fnv1a(const std::string& s, uint64_t h = 1469598103934665603ULL) {
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ULL;
  return h;
}

std::string read_file(const char* path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// What must be equal on every rank for one mapping to reach them all: the same running kernel
// (boot id), the same /dev/shm (device + inode, so containers with private ones differ) and the
// same pid namespace (the liveness check reads peers' /proc entries). 0 when unknown.
std::vector<int64_t> host_identity() {
  struct stat shm_dir {}, pid_ns {};
  const std::string boot = read_file("/proc/sys/kernel/random/boot_id");
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  if (boot.empty() || stat("/dev/shm", &shm_dir) != 0 || stat("/proc/self/ns/pid", &pid_ns) != 0) return {0, 0, 0};
  constexpr uint64_t kMask = (1ULL << 62) - 1;  // keeps -x representable for the MIN-by-MAX trick
  return {static_cast<int64_t>(fnv1a(host, fnv1a(boot)) & kMask),
          static_cast<int64_t>(fnv1a(std::to_string(shm_dir.st_dev) + ":" + std::to_string(shm_dir.st_ino)) & kMask),
          static_cast<int64_t>(static_cast<uint64_t>(pid_ns.st_ino) & kMask)};
}

int futex_wait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::milliseconds timeout) {
  timespec ts{static_cast<time_t>(timeout.count() / 1000), static_cast<long>((timeout.count() % 1000) * 1000000)};
  return static_cast<int>(syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0));
}

void futex_wake(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

inline bool reached(uint32_t value, uint32_t seq) { return static_cast<int32_t>(value - seq) >= 0; }

// Elements per block of the reduction and the copy. The squares of a slice are summed block by
// block, by its owner as it reduces the slice and by every other rank as it copies it: the same
// blocking on both sides gives the same bits on every rank.
constexpr int64_t kBlock = 2048;

// dst[i] = sum over src of scale * src[k][i], accumulated in Acc in rank order, and the same
// values into `copy` when it is not null. Each rank's value is scaled before the sum, as torch
// DDP divides each gradient before its all-reduce: at world size 2 the result has torch's bits
// also where the sum itself would overflow or the halves are subnormal. dst may be one of the
// sources: each block is read completely before it is written. Returns the sum of squares of
// the written values when `squares` (each block is squared, and copied, while it is in L1).
template <typename T, typename Acc>
double sum_slices(T* dst, T* copy, const std::vector<const T*>& src, int64_t n, Acc scale, bool squares) {
  Acc acc[kBlock];
  double sumsq = 0.0;
  const bool scaled = scale != Acc(1);
  for (int64_t base = 0; base < n; base += kBlock) {
    const int64_t m = std::min(kBlock, n - base);
    const T* s0 = src[0] + base;
    if (scaled) {
      for (int64_t i = 0; i < m; ++i) acc[i] = static_cast<Acc>(s0[i]) * scale;
    } else {
      for (int64_t i = 0; i < m; ++i) acc[i] = static_cast<Acc>(s0[i]);
    }
    for (size_t k = 1; k < src.size(); ++k) {
      const T* s = src[k] + base;
      if (scaled) {
        for (int64_t i = 0; i < m; ++i) acc[i] += static_cast<Acc>(s[i]) * scale;
      } else {
        for (int64_t i = 0; i < m; ++i) acc[i] += static_cast<Acc>(s[i]);
      }
    }
    T* d = dst + base;
    for (int64_t i = 0; i < m; ++i) d[i] = static_cast<T>(acc[i]);
    if (copy) std::memcpy(copy + base, d, static_cast<size_t>(m) * sizeof(T));
    if (squares) sumsq += sum_squares(d, m);
  }
  return sumsq;
}

template <typename T, typename Acc>
double sum_bytes(char* dst, char* copy, const std::vector<const char*>& src, int64_t n, double scale, bool squares) {
  std::vector<const T*> typed;
  typed.reserve(src.size());
  for (const char* s : src) typed.push_back(reinterpret_cast<const T*>(s));
  return sum_slices<T, Acc>(reinterpret_cast<T*>(dst), reinterpret_cast<T*>(copy), typed, n,
                            static_cast<Acc>(scale), squares);
}

// The reduction of one slice per dtype, each compiled for AVX2 + FMA and the baseline.
FASTDDP_CPU_CLONES double reduce_slice(at::ScalarType dtype, char* dst, char* copy, const std::vector<const char*>& src,
                                       int64_t n, double scale, bool squares) {
  switch (dtype) {
    case at::kFloat: return sum_bytes<float, float>(dst, copy, src, n, scale, squares);
    case at::kDouble: return sum_bytes<double, double>(dst, copy, src, n, scale, squares);
    case at::kBFloat16: return sum_bytes<c10::BFloat16, float>(dst, copy, src, n, scale, squares);
    case at::kHalf: return sum_bytes<c10::Half, float>(dst, copy, src, n, scale, squares);
    default: TORCH_CHECK(false, "DDPWrapper: shared-memory all-reduce does not support ", dtype);
  }
}

// memcpy of `n` elements, returning the sum of squares of the copied values when `squares`
// (block by block, so each block is squared from L1 right after it was copied).
template <typename T>
double copy_elements(char* dst, const char* src, int64_t n, bool squares) {
  if (!squares) {
    std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(T));
    return 0.0;
  }
  double sumsq = 0.0;
  for (int64_t base = 0; base < n; base += kBlock) {
    const int64_t m = std::min(kBlock, n - base);
    T* d = reinterpret_cast<T*>(dst) + base;
    std::memcpy(d, reinterpret_cast<const T*>(src) + base, static_cast<size_t>(m) * sizeof(T));
    sumsq += sum_squares(d, m);
  }
  return sumsq;
}

double copy_slice(at::ScalarType dtype, char* dst, const char* src, int64_t n, bool squares) {
  switch (dtype) {
    case at::kFloat: return copy_elements<float>(dst, src, n, squares);
    case at::kDouble: return copy_elements<double>(dst, src, n, squares);
    case at::kBFloat16: return copy_elements<c10::BFloat16>(dst, src, n, squares);
    case at::kHalf: return copy_elements<c10::Half>(dst, src, n, squares);
    default: TORCH_CHECK(false, "DDPWrapper: shared-memory all-reduce does not support ", dtype);
  }
}

}  // namespace

// In front of rank 0's broadcast region: which broadcast the region holds. A rank's slot
// cannot say it: rank 0 does not wait for its peers after a broadcast, so its slot may already
// describe its next collective when a peer reads the broadcast.
struct BroadcastHeader {
  uint32_t seq;
  int64_t bytes;
};
static_assert(sizeof(BroadcastHeader) <= kBroadcastHeaderBytes);

struct ShmSegment {
  char* base = nullptr;
  int64_t size = 0;
  int64_t header_bytes = 0;
  int64_t stride = 0;  // bytes from one rank's region (two staging slots, broadcast) to the next
  ShmSegment() = default;
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;
  ~ShmSegment() {
    if (base) munmap(base, static_cast<size_t>(size));
  }
  RankSlot& slot(int rank) const { return *reinterpret_cast<RankSlot*>(base + 64 + rank * kSlotBytes); }
  char* region(int rank) const { return base + header_bytes + rank * stride; }
};

struct ShmAllreduce::Task {
  c10::intrusive_ptr<ShmWork> work;
  at::Tensor tensor;  // all-reduce: reduced in place
  int64_t chunks;     // all-reduce: chunks, one sequence number each from seq on
  double scale;
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
  const int rank = pg->getRank();
  const int world = pg->getSize();
  auto cpu_long = at::TensorOptions().dtype(at::kLong);

  // 1. Wanted by every rank; same host, same /dev/shm, same pid namespace on every rank? One
  //    MAX over (x, -x) gives both the maximum and the minimum of each value.
  const auto id = host_identity();
  auto agree = at::empty({8}, cpu_long);
  auto* a = agree.data_ptr<int64_t>();
  for (int i = 0; i < 3; ++i) {
    a[i] = id[i];
    a[3 + i] = -id[i];
  }
  a[6] = wanted ? 1 : 0;
  a[7] = wanted ? -1 : 0;
  {
    std::vector<at::Tensor> t{agree};
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::MAX;
    pg->allreduce(t, opts)->wait();
  }
  if (a[7] == 0) {  // min(wanted) == 0
    if (why) *why = a[6] ? "disabled on some rank (shm_allreduce=False or FASTDDP_SHM_ALLREDUCE=0)" : "disabled";
    return nullptr;
  }
  for (int i = 0; i < 3; ++i) {
    if (a[i] == 0 || a[i] != -a[3 + i]) {
      if (why) *why = "the ranks do not share one host's /dev/shm (different machines or containers)";
      return nullptr;
    }
  }

  // 2. Rank 0 creates and sizes the segment (fallocate: a too small /dev/shm fails here, not
  //    later with SIGBUS) and broadcasts its name; every rank maps it and registers itself.
  const int64_t header_bytes = round_up(64 + world * kSlotBytes, kPage);
  const int64_t chunk_bytes = chunk_bytes_for(gradient_bytes, world);
  const int64_t broadcast_offset = 2 * chunk_bytes;
  const int64_t stride = round_up(broadcast_offset + kBroadcastHeaderBytes + broadcast_bytes, kPage);
  const int64_t size = header_bytes + world * stride;
  std::string error;
  std::string name;
  std::string created;  // rank 0: the name to unlink, whether or not set-up succeeds
  auto name_buf = at::zeros({64}, at::TensorOptions().dtype(at::kByte));
  if (rank == 0) {
    std::random_device rd;
    std::ostringstream s;
    s << "/fastddp-" << getpid() << "-" << std::hex << ((static_cast<uint64_t>(rd()) << 32) ^ rd());
    name = s.str();
    const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) {
      error = "shm_open(" + name + "): " + std::strerror(errno);
    } else {
      created = name;
      const int rc = posix_fallocate(fd, 0, size);
      if (rc != 0) {
        error = "reserving " + std::to_string(size >> 20) + " MiB in /dev/shm: " + std::strerror(rc) +
                " (a container's /dev/shm may be too small: docker run --shm-size)";
      }
      close(fd);
    }
    if (error.empty()) std::memcpy(name_buf.data_ptr<uint8_t>(), name.data(), name.size());
  }
  {
    std::vector<at::Tensor> t{name_buf};
    c10d::BroadcastOptions opts;
    opts.rootRank = 0;
    pg->broadcast(t, opts)->wait();
  }
  name.assign(reinterpret_cast<const char*>(name_buf.data_ptr<uint8_t>()));
  auto segment = std::make_shared<ShmSegment>();
  if (!name.empty() && error.empty()) {
    const int fd = shm_open(name.c_str(), O_RDWR, 0600);
    struct stat st {};
    if (fd < 0) {
      error = "shm_open(" + name + "): " + std::strerror(errno);
    } else if (fstat(fd, &st) != 0 || st.st_size != size) {
      error = "segment " + name + " has " + std::to_string(st.st_size) + " bytes, expected " + std::to_string(size);
    } else {
      void* p = mmap(nullptr, static_cast<size_t>(size), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      if (p == MAP_FAILED) {
        error = std::string("mmap: ") + std::strerror(errno);
      } else {
        segment->base = static_cast<char*>(p);
        segment->size = size;
        segment->header_bytes = header_bytes;
        segment->stride = stride;
      }
    }
    if (fd >= 0) close(fd);
  } else if (error.empty()) {
    error = "rank 0 could not create the segment";
  }
  if (segment->base) {
    char state = '?';
    uint64_t start = 0;
    if (read_proc_stat(getpid(), &state, &start)) {
      auto& slot = segment->slot(rank);
      slot.pid = getpid();
      slot.start_time = start;
    } else {
      error = "cannot read /proc/self/stat";
    }
  }
  // 3. Everyone mapped it (or someone failed): agree, then rank 0 unlinks the name so nothing
  //    is left in /dev/shm whatever happens to the processes later.
  auto ok = at::full({2}, error.empty() ? 1 : 0, cpu_long);
  ok.data_ptr<int64_t>()[1] = error.empty() ? world : rank;  // MIN: the first rank that failed
  {
    std::vector<at::Tensor> t{ok};
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::MIN;
    pg->allreduce(t, opts)->wait();
  }
  if (!created.empty()) shm_unlink(created.c_str());
  if (ok.data_ptr<int64_t>()[0] == 0) {
    if (why) {
      *why = error.empty() ? "rank " + std::to_string(ok.data_ptr<int64_t>()[1]) +
                                 " could not set up the shared-memory segment (see its warning)"
                           : error;
    }
    return nullptr;
  }
  return std::shared_ptr<ShmAllreduce>(
      new ShmAllreduce(std::move(segment), rank, world, chunk_bytes, broadcast_offset, broadcast_bytes, timeout));
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
}

c10::intrusive_ptr<ShmWork> ShmAllreduce::allreduce_sum(const at::Tensor& t, double scale, bool sum_of_squares,
                                                        const Fingerprint* fingerprint) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "DDPWrapper: shared-memory all-reduce needs a contiguous "
              "CPU tensor, got ", t.device(), t.is_contiguous() ? "" : " (non-contiguous)");
  const auto dtype = t.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kBFloat16 || dtype == at::kHalf,
              "DDPWrapper: shared-memory all-reduce supports float32/float64/bfloat16/float16, got ", dtype);
  const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
  // At least one chunk, so that an empty tensor still meets the peers (and carries a fingerprint).
  const int64_t chunks = std::max<int64_t>(1, (bytes + chunk_bytes_ - 1) / chunk_bytes_);
  auto work = c10::make_intrusive<ShmWork>();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(Task{work, t, chunks, scale, next_seq_, {}, sum_of_squares,
                          fingerprint ? std::optional<Fingerprint>(*fingerprint) : std::nullopt});
    next_seq_ += static_cast<uint32_t>(chunks);
  }
  cv_.notify_one();
  return work;
}

void ShmAllreduce::broadcast_from_root(const std::vector<at::Tensor>& tensors) {
  int64_t bytes = 0;
  for (const auto& t : tensors) {
    TORCH_CHECK(t.device().is_cpu() && t.layout() == at::kStrided, "DDPWrapper: shared-memory broadcast needs "
                "strided CPU tensors, got ", t.device(), " ", t.layout());
    bytes += aligned_bytes(t.numel() * static_cast<int64_t>(t.element_size()));
  }
  TORCH_CHECK(bytes <= broadcast_bytes_, "DDPWrapper: module buffers of ", bytes, " bytes do not fit the ",
              broadcast_bytes_, " bytes reserved for them at construction (were buffers replaced by larger ones?)");
  if (tensors.empty()) return;
  auto work = c10::make_intrusive<ShmWork>();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(Task{work, at::Tensor(), 0, 1.0, next_seq_++, tensors});
  }
  cv_.notify_one();
  work->wait();
}

void ShmAllreduce::run() {
  while (true) {
    Task task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and nothing left
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    std::exception_ptr error;
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
    } catch (const std::exception& e) {
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (broken_.empty()) broken_ = e.what();
      }
      error = std::current_exception();
      announce_failure();
    }
    task.work->complete(error);
  }
}

void ShmAllreduce::fail(const std::string& what) const { C10_THROW_ERROR(DistBackendError, what); }

BroadcastHeader* ShmAllreduce::broadcast_header() const {
  return reinterpret_cast<BroadcastHeader*>(segment_->region(0) + broadcast_offset_);
}

void ShmAllreduce::announce_failure() const {
  auto& slot = segment_->slot(rank_);
  if (slot.failed.exchange(1, std::memory_order_acq_rel) != 0) return;
  for (auto& word : slot.counter) futex_wake(&word);  // peers asleep on this rank look now
}

void ShmAllreduce::describe_own_op(int32_t kind, uint32_t seq, int64_t bytes, int32_t dtype) const {
  auto& slot = segment_->slot(rank_);
  slot.op_seq = seq;  // made visible by the release store of the collective's first publish
  slot.op_kind = kind;
  slot.op_bytes = bytes;
  slot.op_dtype = dtype;
}

[[noreturn]] void ShmAllreduce::fail_mismatch(uint32_t seq, int32_t my_kind, const std::string& mine, int peer,
                                              int32_t their_kind, const std::string& theirs) const {
  std::string which;  // a forward (its broadcast) facing a backward (its buckets): who is ahead
  if (my_kind != their_kind && (my_kind == kBroadcastOp || their_kind == kBroadcastOp) &&
      (my_kind == kAllreduceOp || their_kind == kAllreduceOp)) {
    const int ahead = my_kind == kBroadcastOp ? rank_ : peer;
    which = " Rank " + std::to_string(ahead) + " is in a forward where rank " +
            std::to_string(ahead == rank_ ? peer : rank_) + " reduces a backward: rank " + std::to_string(ahead) +
            " ran a forward (gradients on) whose backward did not run, or one forward more.";
  }
  fail("fastddp shared-memory collectives: the ranks issued different collectives. Collective " +
       std::to_string(seq) + " is " + mine + " on rank " + std::to_string(rank_) + ", but " + theirs + " on rank " +
       std::to_string(peer) + "." + which + " Every rank must run the same forwards (with gradients on) and "
       "backwards: a forward that some ranks run and others do not (one whose loss is never backwarded, or an "
       "evaluation on one rank only) broadcasts the module's buffers on those ranks alone. Run such forwards on "
       "every rank, or on the wrapped module itself (ddp.module) under torch.no_grad().");
}

void ShmAllreduce::fail_if_peer_differs(int peer) const {
  // A failed peer that had described another collective at this rank's sequence number.
  const auto& mine = segment_->slot(rank_);
  const auto& theirs = segment_->slot(peer);
  if (theirs.op_seq != mine.op_seq) return;
  if (theirs.op_kind == mine.op_kind && theirs.op_bytes == mine.op_bytes && theirs.op_dtype == mine.op_dtype) return;
  fail_mismatch(mine.op_seq, mine.op_kind, describe_op(mine.op_kind, mine.op_bytes, mine.op_dtype), peer,
                theirs.op_kind, describe_op(theirs.op_kind, theirs.op_bytes, theirs.op_dtype));
}

void ShmAllreduce::check_peers_run(const Task& task) const {
  // Called once every peer published `ready` for the collective's first chunk: each must have
  // described the same all-reduce (it cannot have moved on, that needs this rank's `done`).
  const int64_t bytes = task.tensor.numel() * static_cast<int64_t>(task.tensor.element_size());
  const auto dtype = static_cast<int32_t>(task.tensor.scalar_type());
  for (int j = 0; j < world_; ++j) {
    if (j == rank_) continue;
    const auto& slot = segment_->slot(j);
    if (slot.op_seq == task.seq && slot.op_kind == kAllreduceOp && slot.op_bytes == bytes && slot.op_dtype == dtype)
      continue;
    const auto* header = broadcast_header();
    int32_t their_kind = slot.op_kind;
    std::string theirs;
    if (j == 0 && header->seq == task.seq) {  // rank 0 broadcast there and went on without waiting
      their_kind = kBroadcastOp;
      theirs = describe_op(kBroadcastOp, header->bytes, 0);
    } else if (slot.op_seq == task.seq) {
      theirs = describe_op(slot.op_kind, slot.op_bytes, slot.op_dtype);
    } else {
      their_kind = kNoOp;
      theirs = "part of another collective (" + describe_op(slot.op_kind, slot.op_bytes, slot.op_dtype) +
               ", from collective " + std::to_string(slot.op_seq) + " on)";
    }
    fail_mismatch(task.seq, kAllreduceOp, describe_op(kAllreduceOp, bytes, dtype), j, their_kind, theirs);
  }
}

void ShmAllreduce::publish(int which, uint32_t seq) const {
  auto* word = &segment_->slot(rank_).counter[which];
  word->store(seq, std::memory_order_release);
  futex_wake(word);
}

void ShmAllreduce::adapt_spin(std::chrono::steady_clock::duration waited) const {
  if (waited > kSpinTime) {
    spin_budget_ = std::max<std::chrono::steady_clock::duration>(kMinSpin, spin_budget_ / 2);
  } else {
    spin_budget_ = std::min<std::chrono::steady_clock::duration>(kSpinTime, spin_budget_ * 2);
  }
}

void ShmAllreduce::wait_for(int peer, int which, uint32_t seq) const {
  auto& slot = segment_->slot(peer);
  auto* word = &slot.counter[which];
  if (reached(word->load(std::memory_order_acquire), seq)) return;
  const auto begin = std::chrono::steady_clock::now();
  const auto spin_until = begin + spin_budget_;
  for (uint32_t i = 1;; ++i) {
    if (reached(word->load(std::memory_order_acquire), seq)) return adapt_spin(std::chrono::steady_clock::now() - begin);
    cpu_relax();
    if (i % 64 == 0 && std::chrono::steady_clock::now() >= spin_until) break;
  }
  sleep_until_reached(peer, which, seq);
  adapt_spin(std::chrono::steady_clock::now() - begin);
}

// Sleeps on the futex until the peer's counter reaches seq, checking every kLivenessPeriod that
// the peer is alive and that the wait is within the process group's timeout.
void ShmAllreduce::sleep_until_reached(int peer, int which, uint32_t seq) const {
  auto& slot = segment_->slot(peer);
  auto* word = &slot.counter[which];
  const auto start = std::chrono::steady_clock::now();
  auto next_check = start + kLivenessPeriod;
  while (true) {
    const uint32_t value = word->load(std::memory_order_acquire);
    if (reached(value, seq)) return;
    if (slot.failed.load(std::memory_order_acquire)) {
      fail_if_peer_differs(peer);
      fail("fastddp shared-memory all-reduce: rank " + std::to_string(peer) + " stopped in collective " +
           std::to_string(seq) + ": a collective failed there (its error says why)");
    }
    futex_wait(word, value, std::chrono::milliseconds(20));
    const auto now = std::chrono::steady_clock::now();
    if (now < next_check) continue;
    next_check = now + kLivenessPeriod;
    if (stop_.load()) fail("the DDPWrapper was destroyed while an all-reduce was waiting for rank " + std::to_string(peer));
    if (reached(word->load(std::memory_order_acquire), seq)) return;
    if (!peer_alive(slot.pid, slot.start_time)) {
      fail("fastddp shared-memory all-reduce: rank " + std::to_string(peer) + " (pid " + std::to_string(slot.pid) +
           ") exited during collective " + std::to_string(seq) + ": Connection closed by peer");
    }
    if (now - start > timeout_) {
      fail("fastddp shared-memory all-reduce: timed out after " + std::to_string(timeout_.count()) +
           " ms waiting for rank " + std::to_string(peer) + " (pid " + std::to_string(slot.pid) +
           ", alive) in collective " + std::to_string(seq) + "; it is stuck or issued different collectives");
    }
  }
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
  describe_own_op(kBroadcastOp, task.seq, bytes, 0);
  if (rank_ == 0) {
    if (last_broadcast_seq_ != 0) {
      for (int j = 1; j < world_; ++j) wait_for(j, kDone, last_broadcast_seq_);
    }
    last_broadcast_seq_ = task.seq;
    header->seq = task.seq;  // made visible by publish's release store
    header->bytes = bytes;
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
  if (header->seq != task.seq || header->bytes != bytes) {
    const auto& root = segment_->slot(0);
    const bool same = header->seq == task.seq;  // then only the size differs
    fail_mismatch(task.seq, kBroadcastOp, describe_op(kBroadcastOp, bytes, 0), 0, same ? kBroadcastOp : root.op_kind,
                  same ? describe_op(kBroadcastOp, header->bytes, 0)
                       : describe_op(root.op_kind, root.op_bytes, root.op_dtype) + " (from collective " +
                             std::to_string(root.op_seq) + " on)");
  }
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

void ShmAllreduce::wait_peers(int which, uint32_t seq) const {
  for (int k = 1; k < world_; ++k) wait_for((rank_ + k) % world_, which, seq);
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
  describe_own_op(kAllreduceOp, task.seq, task.tensor.numel() * static_cast<int64_t>(task.tensor.element_size()),
                  static_cast<int32_t>(task.tensor.scalar_type()));
  double sumsq = 0.0;
  for (int64_t c = 0; c < task.chunks; ++c) sumsq += execute_chunk(task, c, task.seq + static_cast<uint32_t>(c));
  task.work->set_sum_of_squares(sumsq);
  // Nobody reads my slots any more: the next collective (or broadcast, or fingerprint) may
  // write them, whichever chunk it starts with.
  wait_peers(kDone, task.seq + static_cast<uint32_t>(task.chunks - 1));
}

// One chunk of an all-reduce, through staging slot chunk % 2 of every rank: copy in the slices
// the peers reduce, ready, reduce my slice (my own values read in place) into my gradients and
// my slot, reduced, copy the peers' reduced slices into my gradients, done. Returns the chunk's
// sum of squares, added in rank order so that every rank arrives at the same bits.
double ShmAllreduce::execute_chunk(const Task& task, int64_t chunk, uint32_t seq) {
  const auto dtype = task.tensor.scalar_type();
  const int64_t elem = static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t per_chunk = chunk_bytes_ / elem;
  const int64_t first = chunk * per_chunk;
  const int64_t n = std::max<int64_t>(0, std::min(per_chunk, task.tensor.numel() - first));
  char* data = static_cast<char*>(task.tensor.data_ptr()) + first * elem;
  const int64_t stage_offset = (chunk % 2) * chunk_bytes_;
  char* mine = segment_->region(rank_) + stage_offset;
  auto lo = [&](int r) { return n * r / world_; };
  const int64_t my_lo = lo(rank_), my_hi = lo(rank_ + 1), my_n = my_hi - my_lo;
  // This slot last held chunk - 2: every peer must be done reading it.
  if (chunk >= 2) wait_peers(kDone, seq - 2);
  if (n > 0) {  // an empty tensor's data pointer may be null
    std::memcpy(mine, data, static_cast<size_t>(my_lo * elem));
    std::memcpy(mine + my_hi * elem, data + my_hi * elem, static_cast<size_t>((n - my_hi) * elem));
  }
  if (chunk == 0 && task.fingerprint) {
    auto& slot = segment_->slot(rank_);
    std::copy(task.fingerprint->words.begin(), task.fingerprint->words.end(), slot.fingerprint);
    slot.fingerprint_seq = task.seq;  // both made visible by publish's release store
  }
  publish(kReady, seq);
  wait_peers(kReady, seq);
  if (chunk == 0) check_peers_run(task);
  if (chunk == 0 && task.fingerprint) exchange_fingerprint(task);
  // Reduce my slice from every peer's slot and my own gradients into my gradients, and into my
  // slot for the peers (they read only their own slices of my slot until I publish `reduced`).
  std::vector<const char*> slices(world_);
  for (int j = 0; j < world_; ++j) slices[j] = segment_->region(j) + stage_offset + my_lo * elem;
  slices[rank_] = data + my_lo * elem;
  const bool sq = task.sum_of_squares;
  std::vector<double> slice_squares(world_, 0.0);
  slice_squares[rank_] = reduce_slice(dtype, data + my_lo * elem, mine + my_lo * elem, slices, my_n, task.scale, sq);
  publish(kReduced, seq);
  // Copy the other ranks' reduced slices into my gradients.
  for (int k = 1; k < world_; ++k) {
    const int j = (rank_ + k) % world_;
    wait_for(j, kReduced, seq);
    const int64_t j_lo = lo(j), j_n = lo(j + 1) - j_lo;
    slice_squares[j] = copy_slice(dtype, data + j_lo * elem, segment_->region(j) + stage_offset + j_lo * elem, j_n, sq);
  }
  publish(kDone, seq);
  double sumsq = 0.0;
  for (double v : slice_squares) sumsq += v;
  return sumsq;
}

}  // namespace fastddp::reducer
