// The mapping behind the shared-memory all-reduce (shm_allreduce.h): one /dev/shm segment that
// every rank of a process group on one host maps, a header of per-rank slots (counters, the
// collective the rank runs, its fingerprint, its process) and then one region per rank (its
// staging slots and, on rank 0, the broadcast region). map_shared_segment runs the set-up
// handshake over the process group; the protocol on top is ShmAllreduce's.
#pragma once

#include "reducer/fingerprint.h"

#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

namespace fastddp::reducer {

constexpr int64_t kSlotBytes = 128;  // one rank's slot, on cache lines of its own
constexpr int64_t kPage = 4096;

inline int64_t round_up(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

enum OpKind : int32_t { kNoOp = 0, kAllreduceOp = 1, kBroadcastOp = 2 };
// kClosed: the rank destroyed its wrapper; kExited: it did so while its process was ending
enum SlotState : uint32_t { kRunning = 0, kFailed = 1, kClosed = 2, kExited = 3 };

// A collective as a rank announces it in shared memory: its first sequence number, kind, size
// and dtype. Two ranks at one sequence number with different descriptors issued different
// collectives. Lives in mapped memory: plain data, no constructor runs.
struct OpDescriptor {
  int64_t bytes;
  uint32_t seq;
  int32_t kind;  // OpKind
  int32_t dtype;  // c10::ScalarType of an all-reduce; 0 for a broadcast
  bool operator==(const OpDescriptor& o) const {
    return seq == o.seq && kind == o.kind && bytes == o.bytes && dtype == o.dtype;
  }
  bool operator!=(const OpDescriptor& o) const { return !(*this == o); }
  // "an all-reduce of 424 bytes of Float (a gradient bucket, in a backward)", ...
  std::string describe() const;
};

struct RankSlot {
  std::atomic<uint32_t> counter[3];  // last collective (sequence number) that reached each phase
  int32_t pid;
  uint64_t start_time;  // /proc/<pid>/stat field 22: tells a live peer from a reused pid
  // SlotState: kFailed once a collective failed on this rank (a peer's error points at this
  // rank's), kClosed once its transport was destroyed after its last collective. A peer waiting
  // for a collective this rank will never run fails at once instead of at the timeout.
  std::atomic<uint32_t> state;
  // The fingerprint of the rank's latest fingerprinted collective (its sequence number in
  // fingerprint_seq), written before the rank publishes `ready` for it; a peer reads it after
  // seeing that `ready`, and the rank cannot overwrite it before every peer published `done`.
  uint32_t fingerprint_seq;
  int64_t fingerprint[kFingerprintWords];
  // The collective the rank runs, written before it publishes anything for it. A peer that
  // reached the same sequence number in another collective issued different collectives: each
  // all-reduce compares them (ShmAllreduce::check_peers_run).
  OpDescriptor op;
};
static_assert(sizeof(RankSlot) <= kSlotBytes);
static_assert(std::atomic<uint32_t>::is_always_lock_free);

struct ShmSegment {
  char* base = nullptr;
  int64_t size = 0;
  int64_t header_bytes = 0;
  int64_t stride = 0;  // bytes from one rank's region (two staging slots, broadcast) to the next
  ShmSegment() = default;
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;
  ~ShmSegment();
  RankSlot& slot(int rank) const { return *reinterpret_cast<RankSlot*>(base + 64 + rank * kSlotBytes); }
  char* region(int rank) const { return base + header_bytes + rank * stride; }
};

// Collective over `pg`: maps one segment of `region_bytes` per rank (rounded up to pages) after
// the slots on every rank, and registers this process in its slot. Returns nullptr on every
// rank, `why` saying why, when some rank did not want it, the ranks do not share this host's
// /dev/shm, or some rank could not map it. The name is unlinked before it returns: nothing is
// left in /dev/shm whatever happens to the processes later.
std::shared_ptr<ShmSegment> map_shared_segment(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, bool wanted,
                                               int64_t region_bytes, std::string* why);

// Whether the process `pid` started at `start_time` (/proc/<pid>/stat field 22, so a reused
// pid is not taken for it) is alive and not a zombie.
bool peer_alive(int pid, uint64_t start_time);

}  // namespace fastddp::reducer
