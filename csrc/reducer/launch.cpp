// Launching the reductions: buckets in index order, each on its wire (the shared-memory
// transport, or the process group), through a communication hook when one is registered;
// the all-reduce of the used-parameter map; and the error a failed collective raises.
#include "reducer/reducer.h"

#include "common/checks.h"
#include "diag/status.h"
#include "diag/watchdog.h"

#include <ATen/ops/empty.h>

#include <chrono>
#include <string>
#include <vector>

namespace fastddp::reducer {

void Reducer::launch_ready_buckets_locked() {
  // Buckets launch strictly in index order, so every rank issues the same collectives in the
  // same sequence whatever order its gradients arrive in.
  while (next_launch_ < static_cast<int64_t>(buckets_.size()) && buckets_[next_launch_].pending == 0) {
    const int64_t index = next_launch_++;
    if (stats_.buckets_reduced++ == 0) stats_.backward_comm_start = now_ns();
    auto& bucket = buckets_[index];
    flush_deferred_locked(bucket);
    if (bucket.comm.defined()) {
      // torch's fp16/bf16 compression hooks: cast, then divide in the wire dtype.
      bucket.comm.copy_(real_view(bucket.buffer));
      if (process_group_->getSize() != 1) bucket.comm.div_(static_cast<double>(process_group_->getSize()));
    }
    bucket.launched = std::chrono::steady_clock::now();
    if (comm_hook_) {
      // torch DDP runs a registered hook in a world of one too (it may do more than a sum).
      bucket.hook_future = run_comm_hook_locked(index);
      continue;
    }
    if (process_group_->getSize() == 1) {
      // The sum over one rank is the bucket itself: no collective (its host-side launch costs
      // tens of microseconds per bucket on a GPU, more than the rest of the reducer's work).
      bucket.work.reset();
      continue;
    }
    bucket.squares_in_work = bucket.shm && visitors_want_squares_locked();
    if (fingerprint_ && index + 1 == static_cast<int64_t>(buckets_.size())) {
      ++fp_collectives_;
      bucket.work = launch_last_bucket_locked(bucket, bucket.squares_in_work, next_fingerprint_locked());
      continue;
    }
    if (fingerprint_) ++fp_collectives_;
    bucket.work = allreduce_wire_locked(bucket, bucket.squares_in_work);
  }
}

Scaling Reducer::wire_scaling_locked(const Bucket& bucket) const {
  // The shared-memory sum scales every rank's values as it reads them, each rank its own slice:
  // the scaling must be the same on every rank. It is, over the world size; over the ranks
  // still training (join()), a joined rank's slices would not be, so the ranks still training
  // average as their gradients enter the buckets and the sum scales nothing.
  if (!bucket.shm || bucket.comm.defined() || !average_.over_world()) return Scaling{};
  return average_.scaling();
}

c10::intrusive_ptr<c10d::Work> Reducer::allreduce_wire_locked(Bucket& bucket, bool squares,
                                                              const Fingerprint* fingerprint) {
  at::Tensor wire = bucket.comm.defined() ? bucket.comm : bucket.wire.defined() ? bucket.wire : bucket.buffer;
  if (bucket.shm && bucket.direct) {
    std::vector<at::Tensor> holders;
    auto pieces = direct_pieces_locked(bucket, &holders);
    return shm_->allreduce_sum(std::move(pieces), std::move(holders), bucket.buffer.scalar_type(),
                               wire_scaling_locked(bucket), squares, fingerprint);
  }
  if (bucket.shm) return shm_->allreduce_sum(wire, wire_scaling_locked(bucket), squares, fingerprint);
  c10d::AllreduceOptions opts;
  opts.reduceOp = reduce_avg_locked() ? c10d::ReduceOp::AVG : c10d::ReduceOp::SUM;
  std::vector<at::Tensor> tensors{wire};
  return process_group_->allreduce(tensors, opts);
}

c10::intrusive_ptr<c10::ivalue::Future> Reducer::run_comm_hook_locked(int64_t index) {
  const auto& bucket = buckets_[index];
  const size_t count = bucket.params.size();
  std::vector<size_t> offsets;
  std::vector<size_t> lengths;
  std::vector<c10::IntArrayRef> sizes;  // point into the parameters, which outlive the bucket
  std::vector<at::Tensor> params;
  offsets.reserve(count);
  lengths.reserve(count);
  sizes.reserve(count);
  params.reserve(count);
  for (size_t k = 0; k < count; ++k) {
    const auto& p = params_[bucket.params[k]];
    offsets.push_back(static_cast<size_t>(bucket.offsets[k]));
    lengths.push_back(static_cast<size_t>(p.numel()));
    sizes.push_back(p.sizes());
    params.push_back(p);
  }
  // A complex bucket's buffer() is its real view, as torch DDP hands it over (offsets, lengths
  // and sizes stay the parameters', as in torch's GradBucket).
  c10d::GradBucket grad_bucket(static_cast<size_t>(index), buckets_.size(), real_view(bucket.buffer),
                               std::move(offsets), std::move(lengths), std::move(sizes), std::move(params),
                               std::nullopt);
  auto future = comm_hook_->runHook(grad_bucket);
  TORCH_CHECK(future, "DDPWrapper: the communication hook returned no Future for bucket ", index);
  return future;
}

void Reducer::take_comm_hook_result_locked(int64_t index) {
  auto& bucket = buckets_[index];
  bucket.hook_future->wait();  // rethrows the hook's error, if its Future holds one
  const at::Tensor result = comm_hook_->parseHookResult(bucket.hook_future->value());
  bucket.hook_future.reset();
  at::Tensor flat = real_view(bucket.buffer);  // what the hook was given as bucket.buffer()
  TORCH_CHECK(result.defined() && result.numel() == flat.numel(), "DDPWrapper: the communication hook's "
              "Future for bucket ", index, " holds ", result.defined() ? std::to_string(result.numel()) : "no",
              " elements, but the bucket has ", flat.numel(), "; its value must be the reduced "
              "bucket.buffer() (a flat tensor of the same size)");
  if (!result.is_same(flat)) flat.copy_(result.reshape({-1}));
}

at::Tensor Reducer::allreduce_used_locked(const std::vector<char>& used_here) {
  auto used = at::empty({static_cast<int64_t>(used_here.size())}, at::TensorOptions().dtype(at::kInt));
  auto* u = used.data_ptr<int32_t>();
  for (size_t i = 0; i < used_here.size(); ++i) u[i] = used_here[i];
  if (process_group_->getSize() == 1) return used;
  auto used_dev = used.to(buckets_.empty() ? at::Device(at::kCPU) : buckets_[0].buffer.device());
  std::vector<at::Tensor> t{used_dev};
  process_group_->allreduce(t)->wait();
  return used_dev.cpu();
}

void Reducer::fail_collective(const std::string& what, const std::exception& error) const {
  std::string message = "DDPWrapper: " + what + " failed on rank " + std::to_string(process_group_->getRank()) +
                        ": " + error_message(error);
  // The same headline as fastddp.diag.phase's, which recognises a reported error by it.
  const std::string report = diag::collective_failed("What every rank was doing when it failed:");
  if (!report.empty()) message += "\n" + report;
  C10_THROW_ERROR(DistBackendError, message);
}

}  // namespace fastddp::reducer
