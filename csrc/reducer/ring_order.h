// The order in which gloo's ring all-reduce (the process group's on CPU, which torch DDP's
// buckets go through) adds the ranks' values, so that the shared-memory sum can add them in the
// same order and give torch DDP's bits at any world size. Floating-point addition is
// commutative but not associative: the result depends on the grouping alone.
//
// gloo cuts a collective of `total` bytes into `segments` = max(ceil(total / 1 MiB), 2 x world)
// rounded up to a multiple of world, each of ceil(total / segments) bytes rounded up to the
// element size; rank c ends up holding chunk c (segments c x segments/world onwards). Its
// reduce-scatter passes each chunk down the ring: rank c-1 sends its values to rank c-2, which
// adds its own and sends the sum on, until rank c adds its own last. So chunk c is
// ((x[c-1] + x[c-2]) + ...) + x[c], indices modulo world. At two ranks every order gives the
// same bits, and the sum keeps rank order.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

namespace fastddp::reducer {

class RingOrder {
 public:
  // The order for a collective of `numel` elements of `elem` bytes over `world` ranks.
  RingOrder(int64_t numel, int64_t elem, int world) : world_(world) {
    if (world <= 2) {
      span_ = std::numeric_limits<int64_t>::max();
      return;
    }
    constexpr int64_t kMaxSegmentBytes = 1 << 20;  // gloo's kMaxSegmentSize, a multiple of elem
    const int64_t total = numel * elem;
    int64_t segments = std::max<int64_t>((total + kMaxSegmentBytes - 1) / kMaxSegmentBytes, 2 * world);
    segments = (segments + world - 1) / world * world;
    const int64_t segment_bytes = ((total + segments - 1) / segments + elem - 1) / elem * elem;
    span_ = std::max<int64_t>(1, segments / world * segment_bytes / elem);
  }

  // The j-th rank whose values chunk c adds (j = 0 first): c-1, c-2, ... down the ring, c last.
  // At two ranks or fewer, rank order.
  int rank(int64_t c, int j) const {
    if (world_ <= 2) return j;
    if (j == world_ - 1) return static_cast<int>(c);
    return static_cast<int>(((c - 1 - j) % world_ + world_) % world_);
  }

  // Calls fn(offset, count, c) for the runs of elements [lo, lo + n) that gloo sums in one
  // order: `offset` counts from lo, and rank(c, j) lists the ranks in the order their values
  // are added.
  template <class Fn>
  void for_each_run(int64_t lo, int64_t n, Fn&& fn) const {
    const int64_t last = std::max(world_, 1) - 1;  // the last chunk runs to the end
    for (int64_t at = lo; at < lo + n;) {
      const int64_t c = std::min(at / span_, last);
      const int64_t end = c == last ? lo + n : std::min(lo + n, (c + 1) * span_);
      fn(at - lo, end - at, c);
      at = end;
    }
  }

 private:
  int world_;
  int64_t span_;  // elements per gloo chunk
};

}  // namespace fastddp::reducer
