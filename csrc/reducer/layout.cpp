#include "reducer/layout.h"

#include <torch/csrc/distributed/c10d/reducer.hpp>

#include <algorithm>
#include <limits>

namespace fastddp::reducer {

namespace {

// torch DDP converts MiB to bytes with int(mb * 1024 * 1024): truncation, as here.
size_t mib_to_bytes(double mib) { return static_cast<size_t>(mib * 1024.0 * 1024.0); }

void check_caps(const ReducerOptions& options) {
  TORCH_CHECK(options.bucket_cap_mb >= 0 && options.first_bucket_mb >= 0, "DDPWrapper: bucket caps must be >= 0, "
              "got bucket_cap_mb=", options.bucket_cap_mb, ", first_bucket_mb=", options.first_bucket_mb);
  for (double cap : options.bucket_caps_mb)
    TORCH_CHECK(cap >= 0, "DDPWrapper: every bucket_cap_mb_list entry must be >= 0, got ", cap);
}

std::vector<size_t> listed_caps(const ReducerOptions& options) {
  std::vector<size_t> limits;
  for (double cap : options.bucket_caps_mb) limits.push_back(mib_to_bytes(cap));
  return limits;
}

std::vector<std::vector<int64_t>> as_int64(const std::vector<std::vector<size_t>>& buckets) {
  std::vector<std::vector<int64_t>> out;
  out.reserve(buckets.size());
  for (const auto& bucket : buckets) out.emplace_back(bucket.begin(), bucket.end());
  return out;
}

}  // namespace

int64_t packed_bytes(const std::vector<at::Tensor>& tensors) {
  int64_t bytes = 0;
  for (const auto& t : tensors) bytes += aligned_bytes(t.numel() * static_cast<int64_t>(t.element_size()));
  return bytes;
}

bool rebuilds_buckets(const ReducerOptions& options) {
  return options.static_graph || !options.find_unused_parameters;
}

std::vector<std::vector<int64_t>> initial_buckets(const std::vector<at::Tensor>& params, const ReducerOptions& options) {
  check_caps(options);
  if (params.empty()) return {};  // every parameter has a sparse gradient (reduced apart)
  std::vector<size_t> limits = listed_caps(options);
  if (limits.empty()) {
    const size_t cap = mib_to_bytes(options.bucket_cap_mb);
    const size_t first = mib_to_bytes(options.first_bucket_mb);
    if (rebuilds_buckets(options)) {
      // One bucket until the rebuild: the registration order need not be the order gradients
      // arrive in, and a bucket launched early could meet another collective of the backward.
      limits = {static_cast<size_t>(std::numeric_limits<int64_t>::max())};
    } else {
      limits = first < cap ? std::vector<size_t>{first, cap} : std::vector<size_t>{cap};
    }
  }
  auto buckets = std::get<0>(c10d::compute_bucket_assignment_by_size(params, limits));
  std::reverse(buckets.begin(), buckets.end());
  return as_int64(buckets);
}

std::vector<std::vector<int64_t>> rebuilt_buckets(const std::vector<at::Tensor>& params,
                                                  const std::vector<int64_t>& order, const ReducerOptions& options) {
  check_caps(options);
  const int64_t n = static_cast<int64_t>(params.size());
  TORCH_CHECK(static_cast<int64_t>(order.size()) == n, "DDPWrapper: a bucket order must name each of the ", n,
              " parameters once, got ", order.size(), " indices");
  std::vector<char> seen(params.size(), 0);
  std::vector<at::Tensor> ordered;
  ordered.reserve(params.size());
  for (int64_t i : order) {
    TORCH_CHECK(i >= 0 && i < n, "DDPWrapper: bucket order names parameter ", i, " of ", n);
    TORCH_CHECK(!seen[i], "DDPWrapper: bucket order names parameter ", i, " twice");
    seen[i] = 1;
    ordered.push_back(params[i]);
  }
  if (params.empty()) return {};
  std::vector<size_t> limits = listed_caps(options);
  if (limits.empty()) limits = {mib_to_bytes(options.first_bucket_mb), mib_to_bytes(options.bucket_cap_mb)};
  return as_int64(std::get<0>(c10d::compute_bucket_assignment_by_size(ordered, limits, {}, order)));
}

}  // namespace fastddp::reducer
