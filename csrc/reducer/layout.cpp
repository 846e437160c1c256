#include "reducer/layout.h"

#include <map>
#include <tuple>

namespace fastddp::reducer {

namespace {

constexpr double kMiB = 1024.0 * 1024.0;

int64_t mib_to_bytes(double mib) { return static_cast<int64_t>(mib * kMiB); }

}  // namespace

int64_t packed_bytes(const std::vector<at::Tensor>& tensors) {
  int64_t bytes = 0;
  for (const auto& t : tensors) bytes += aligned_bytes(t.numel() * static_cast<int64_t>(t.element_size()));
  return bytes;
}

std::vector<int64_t> registration_order_reversed(int64_t count) {
  std::vector<int64_t> order;
  order.reserve(static_cast<size_t>(count));
  for (int64_t i = count - 1; i >= 0; --i) order.push_back(i);
  return order;
}

std::vector<std::vector<int64_t>> plan_buckets(const std::vector<at::Tensor>& params,
                                               const std::vector<int64_t>& order, const ReducerOptions& options) {
  const auto& caps = options.bucket_caps_mb;
  TORCH_CHECK(options.bucket_cap_mb >= 0 && options.first_bucket_mb >= 0, "DDPWrapper: bucket caps must be >= 0, got "
              "bucket_cap_mb=", options.bucket_cap_mb, ", first_bucket_mb=", options.first_bucket_mb);
  const int64_t n = static_cast<int64_t>(params.size());
  std::vector<char> seen(params.size(), 0);
  for (int64_t i : order) {
    TORCH_CHECK(i >= 0 && i < n, "DDPWrapper: bucket order names parameter ", i, " of ", n);
    TORCH_CHECK(!seen[i], "DDPWrapper: bucket order names parameter ", i, " twice");
    seen[i] = 1;
  }
  const int64_t cap = mib_to_bytes(options.bucket_cap_mb);
  const int64_t cap_first = mib_to_bytes(std::min(options.first_bucket_mb, options.bucket_cap_mb));
  // Per (device type, device index, dtype): the open bucket, its bytes, and how many opened.
  using Key = std::tuple<int, int, int>;
  struct Open {
    int64_t bucket = -1;
    int64_t used = 0;
    int64_t opened = 0;
  };
  std::map<Key, Open> open;
  std::vector<std::vector<int64_t>> buckets;
  for (int64_t i : order) {
    const auto& p = params[i];
    const Key key{static_cast<int>(p.device().type()), p.device().index(), static_cast<int>(p.scalar_type())};
    const int64_t size = p.numel() * static_cast<int64_t>(p.element_size());
    auto& slot = open[key];
    if (slot.bucket >= 0) {
      const int64_t limit = !caps.empty()
                                ? mib_to_bytes(caps[std::min<size_t>(slot.opened - 1, caps.size() - 1)])
                                : (slot.bucket == 0 ? cap_first : cap);
      if (slot.used + size > limit) slot.bucket = -1;
    }
    if (slot.bucket < 0) {
      slot.bucket = static_cast<int64_t>(buckets.size());
      slot.used = 0;
      ++slot.opened;
      buckets.emplace_back();
    }
    buckets[slot.bucket].push_back(i);
    slot.used += size;
  }
  return buckets;
}

}  // namespace fastddp::reducer
