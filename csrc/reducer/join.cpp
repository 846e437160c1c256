// join() support in the reducer (torch DDP's uneven inputs): the divisor of an iteration
// averaged over the ranks still training, and a joined rank's shadow reduction.
#include "reducer/reducer.h"

#include "diag/status.h"

#include <algorithm>

namespace fastddp::reducer {

void Reducer::set_reduction_divisor(int64_t divisor) {
  std::lock_guard<std::mutex> lock(mutex_);
  average_.set_divisor(divisor);
}

void Reducer::shadow_reduction() {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(!expect_sync_, "DDPWrapper.join(): this rank's last forward (gradients on, outside no_sync()) "
              "was not followed by a backward before its loop ended, so its reduction is still pending "
              "and it cannot stand in for the other ranks' reductions; run backward after every such "
              "forward inside the join() block");
  if (passthrough_ || process_group_->getSize() == 1) return;
  diag::PhaseScope joining(diag::Phase::kJoin);
  // The divisor was this collective's only (set_reduction_divisor), however it ends.
  struct Restore {
    Average& average;
    ~Restore() { average.reset(); }
  } restore{average_};
  // The same collectives as a reduced backward (launch_ready_buckets_locked, then
  // finalize_backward's used map), in the same order, with zero contributions; with a
  // communication hook, the hook's (as torch DDP's joined ranks run it on zero buckets).
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  works.reserve(buckets_.size());
  for (int64_t index = 0; index < static_cast<int64_t>(buckets_.size()); ++index) {
    ensure_private_locked(index, /*lent_counts=*/true);  // .grad stays as it is, as in torch DDP
    auto& bucket = buckets_[index];
    (bucket.comm.defined() ? bucket.comm : bucket.buffer).zero_();
    bucket.direct = false;  // zero contributions: the flat buffer, not the last backward's .grad
    if (comm_hook_) {
      bucket.hook_future = run_comm_hook_locked(index);
    } else if (fingerprint_ && index + 1 == static_cast<int64_t>(buckets_.size())) {
      // A wildcard fingerprint: the ranks still training compare theirs among themselves.
      fp_collectives_ += static_cast<int64_t>(buckets_.size());
      ++fp_reductions_;
      works.push_back(launch_last_bucket_locked(bucket, false, Fingerprint::wildcard()));
    } else {
      works.push_back(allreduce_wire_locked(bucket, false));
    }
  }
  std::fill(locally_used_.begin(), locally_used_.end(), 0);
  // torch DDP's joined rank all-reduces its reducer's used map as the last all-reduce of it left
  // it (torch's _match_unused_params_allreduce, in place), so a parameter used on any rank in
  // the last iteration this rank took part in counts as used while it stays joined: the ranks
  // still training give it their averaged (zero) gradient where it would keep its .grad.
  if (find_unused_ && !static_graph_) remember_global_used_locked(allreduce_used_locked(last_global_used_));
  if (fingerprint_ && fingerprint_mismatch_locked()) {
    for (auto& work : works) work->wait();
    raise_desync_locked(fp_reported_);
  }
  for (auto& work : works) work->wait();
  for (int64_t index = 0; index < static_cast<int64_t>(buckets_.size()); ++index)
    if (buckets_[index].hook_future) take_comm_hook_result_locked(index);
}

}  // namespace fastddp::reducer
