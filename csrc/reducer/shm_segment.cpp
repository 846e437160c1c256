// The shared segment and its set-up handshake (shm_segment.h).
#include "reducer/shm_segment.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <algorithm>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <vector>

namespace fastddp::reducer {

namespace {

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

}  // namespace

std::string OpDescriptor::describe() const {
  if (kind == kAllreduceOp)
    return "an all-reduce of " + std::to_string(bytes) + " bytes of " +
           c10::toString(static_cast<c10::ScalarType>(dtype)) + " (a gradient bucket, in a backward)";
  if (kind == kBroadcastOp)
    return "a broadcast of " + std::to_string(bytes) + " bytes of module buffers from rank 0 (in a forward)";
  return "no collective yet";
}

ShmSegment::~ShmSegment() {
  if (base) munmap(base, static_cast<size_t>(size));
}

bool peer_alive(int pid, uint64_t start_time) {
  char state = '?';
  uint64_t start = 0;
  if (!read_proc_stat(pid, &state, &start)) return false;
  return state != 'Z' && state != 'X' && start == start_time;
}

namespace {

// Step 1: wanted by every rank, and the same host, /dev/shm and pid namespace on every rank.
// One MAX over (x, -x) gives both the maximum and the minimum of each value.
bool ranks_share_host(c10d::ProcessGroup& pg, bool wanted, std::string* why) {
  const auto id = host_identity();
  auto agree = at::empty({8}, at::TensorOptions().dtype(at::kLong));
  auto* a = agree.data_ptr<int64_t>();
  for (int i = 0; i < 3; ++i) {
    a[i] = id[i];
    a[3 + i] = -id[i];
  }
  a[6] = wanted ? 1 : 0;
  a[7] = wanted ? -1 : 0;
  std::vector<at::Tensor> t{agree};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::MAX;
  pg.allreduce(t, opts)->wait();
  if (a[7] == 0) {  // min(wanted) == 0
    if (why) *why = a[6] ? "disabled on some rank (shm_allreduce=False or FASTDDP_SHM_ALLREDUCE=0)" : "disabled";
    return false;
  }
  for (int i = 0; i < 3; ++i) {
    if (a[i] == 0 || a[i] != -a[3 + i]) {
      if (why) *why = "the ranks do not share one host's /dev/shm (different machines or containers)";
      return false;
    }
  }
  return true;
}

// Step 2, rank 0: creates the named segment and sizes it (fallocate: a too small /dev/shm fails
// here, not later with SIGBUS). Returns the name to unlink ("" if none was created).
std::string create_segment(int64_t size, std::string* name, std::string* error) {
  std::random_device rd;
  std::ostringstream s;
  s << "/fastddp-" << getpid() << "-" << std::hex << ((static_cast<uint64_t>(rd()) << 32) ^ rd());
  *name = s.str();
  const int fd = shm_open(name->c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    *error = "shm_open(" + *name + "): " + std::strerror(errno);
    return "";
  }
  const int rc = posix_fallocate(fd, 0, size);
  if (rc != 0) {
    *error = "reserving " + std::to_string(size >> 20) + " MiB in /dev/shm: " + std::strerror(rc) +
             " (a container's /dev/shm may be too small: docker run --shm-size)";
  }
  close(fd);
  return *name;
}

// Step 2, every rank: rank 0's name (empty if it failed), broadcast over the group.
std::string broadcast_name(c10d::ProcessGroup& pg, const std::string& name) {
  auto buf = at::zeros({64}, at::TensorOptions().dtype(at::kByte));
  std::memcpy(buf.data_ptr<uint8_t>(), name.data(), std::min<size_t>(name.size(), 63));
  std::vector<at::Tensor> t{buf};
  c10d::BroadcastOptions opts;
  opts.rootRank = 0;
  pg.broadcast(t, opts)->wait();
  return std::string(reinterpret_cast<const char*>(buf.data_ptr<uint8_t>()));
}

// Step 2, every rank: maps the segment (checking its size) and registers this process in its
// slot, so that peers can tell whether it is still alive.
void map_and_register(const std::string& name, int rank, ShmSegment* segment, std::string* error) {
  const int fd = shm_open(name.c_str(), O_RDWR, 0600);
  struct stat st {};
  if (fd < 0) {
    *error = "shm_open(" + name + "): " + std::strerror(errno);
    return;
  }
  if (fstat(fd, &st) != 0 || st.st_size != segment->size) {
    *error = "segment " + name + " has " + std::to_string(st.st_size) + " bytes, expected " +
             std::to_string(segment->size);
  } else {
    void* p = mmap(nullptr, static_cast<size_t>(segment->size), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      *error = std::string("mmap: ") + std::strerror(errno);
    } else {
      segment->base = static_cast<char*>(p);
    }
  }
  close(fd);
  if (!segment->base) return;
  char state = '?';
  uint64_t start = 0;
  if (!read_proc_stat(getpid(), &state, &start)) {
    *error = "cannot read /proc/self/stat";
    return;
  }
  auto& slot = segment->slot(rank);
  slot.pid = getpid();
  slot.start_time = start;
}

// Step 3: whether every rank mapped the segment; if not, why (this rank's error, or the first
// rank that failed).
bool all_mapped(c10d::ProcessGroup& pg, const std::string& error, std::string* why) {
  auto ok = at::full({2}, error.empty() ? 1 : 0, at::TensorOptions().dtype(at::kLong));
  ok.data_ptr<int64_t>()[1] = error.empty() ? pg.getSize() : pg.getRank();  // MIN: the first that failed
  std::vector<at::Tensor> t{ok};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::MIN;
  pg.allreduce(t, opts)->wait();
  if (ok.data_ptr<int64_t>()[0] != 0) return true;
  if (why) {
    *why = error.empty() ? "rank " + std::to_string(ok.data_ptr<int64_t>()[1]) +
                               " could not set up the shared-memory segment (see its warning)"
                         : error;
  }
  return false;
}

}  // namespace

std::shared_ptr<ShmSegment> map_shared_segment(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, bool wanted,
                                               int64_t region_bytes, std::string* why) {
  TORCH_CHECK(pg, "DDPWrapper: process group is null");
  if (!ranks_share_host(*pg, wanted, why)) return nullptr;
  auto segment = std::make_shared<ShmSegment>();
  segment->header_bytes = round_up(64 + pg->getSize() * kSlotBytes, kPage);
  segment->stride = round_up(region_bytes, kPage);
  segment->size = segment->header_bytes + pg->getSize() * segment->stride;
  std::string error;
  std::string name;
  std::string created;  // rank 0: the name to unlink, whether or not set-up succeeds
  if (pg->getRank() == 0) created = create_segment(segment->size, &name, &error);
  name = broadcast_name(*pg, error.empty() ? name : "");
  if (name.empty()) {
    if (error.empty()) error = "rank 0 could not create the segment";
  } else if (error.empty()) {
    map_and_register(name, pg->getRank(), segment.get(), &error);
  }
  // Everyone mapped it (or someone failed): agree, then rank 0 unlinks the name so nothing is
  // left in /dev/shm whatever happens to the processes later.
  const bool ok = all_mapped(*pg, error, why);
  if (!created.empty()) shm_unlink(created.c_str());
  return ok ? segment : nullptr;
}

}  // namespace fastddp::reducer
