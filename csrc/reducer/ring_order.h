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
#include <vector>

namespace fastddp::reducer {

class RingOrder {
 public:
  // The order for a collective of `numel` elements of `elem` bytes over `world` ranks.
  RingOrder(int64_t numel, int64_t elem, int world) {
    if (world <= 2) {
      span_ = std::numeric_limits<int64_t>::max();
      orders_.assign(1, {});
      for (int r = 0; r < world; ++r) orders_[0].push_back(r);
      return;
    }
    constexpr int64_t kMaxSegmentBytes = 1 << 20;  // gloo's kMaxSegmentSize, a multiple of elem
    const int64_t total = numel * elem;
    int64_t segments = std::max<int64_t>((total + kMaxSegmentBytes - 1) / kMaxSegmentBytes, 2 * world);
    segments = (segments + world - 1) / world * world;
    const int64_t segment_bytes = ((total + segments - 1) / segments + elem - 1) / elem * elem;
    span_ = std::max<int64_t>(1, segments / world * segment_bytes / elem);
    orders_.resize(world);
    for (int c = 0; c < world; ++c) {
      for (int k = 1; k < world; ++k) orders_[c].push_back(((c - k) % world + world) % world);
      orders_[c].push_back(c);
    }
  }

  // Calls fn(offset, count, ranks) for the runs of elements [lo, lo + n) that gloo sums in one
  // order: `offset` counts from lo, `ranks` lists the ranks in the order their values are added.
  template <class Fn>
  void for_each_run(int64_t lo, int64_t n, Fn&& fn) const {
    for (int64_t at = lo; at < lo + n;) {
      const int64_t c = at / span_;
      const int64_t end = c >= static_cast<int64_t>(orders_.size()) - 1 ? lo + n : std::min(lo + n, (c + 1) * span_);
      fn(at - lo, end - at, orders_[std::min<int64_t>(c, orders_.size() - 1)]);
      at = end;
    }
  }

 private:
  int64_t span_;                         // elements per gloo chunk
  std::vector<std::vector<int>> orders_;  // per chunk, the ranks in the order of addition
};

}  // namespace fastddp::reducer
