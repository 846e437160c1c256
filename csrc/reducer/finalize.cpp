// The end of a reduced backward (the autograd engine's final callback): the last buckets are
// launched, the used-parameter map and the fingerprints are settled, every bucket's collective
// is waited for in index order (visitors read each one as it completes) and the reduced values
// reach .grad. Also a reduction no backward finished: reported (missing gradients) at the next
// forward, or, after a backward that raised, issued for the other ranks and refused.
#include "reducer/reducer.h"

#include "diag/status.h"

#include <torch/csrc/autograd/function.h>

#include <algorithm>
#include <optional>

namespace fastddp::reducer {

namespace {

// torch DDP's words when a forward finds the previous reduction unfinished
constexpr const char* kUnfinishedReduction =
    "Expected to have finished reduction in the prior iteration before starting a new one. This error indicates "
    "that your module has parameters that were not used in producing loss. ";

double ms_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

void Reducer::finalize_backward() {
  std::lock_guard<std::mutex> lock(mutex_);
  callback_queued_ = false;
  if (!expect_sync_ || continued_by_outer_backward_locked() || awaits_later_backward_locked()) return;
  // static_graph's first iteration is settled by the backward that brings the gradients. One
  // that reached the outputs but no parameter is torch.autograd.grad with respect to the
  // inputs (a gradient penalty, create_graph=True) before loss.backward() in the same
  // iteration: the outputs' pre-hook stays armed for that later backward. (torch DDP settles
  // the iteration here instead, and its gradients then stay rank-local.)
  if (static_graph_ && static_first_iteration_ && !hooks_seen_) return;
  finalize_locked();
}

bool Reducer::continued_by_outer_backward_locked() const {
  // A reentrant backward (torch.utils.checkpoint(use_reentrant=True) around the model's last
  // layers) runs inside a node of the outer backward and ends before that backward brings the
  // rest of the gradients: the first of them queues this callback again, on the outer backward
  // (torch DDP queues its callback once the last bucket is ready). A reduction that no later
  // gradient completes is finished, and reported, when the next forward starts
  // (finish_unfinished_reduction).
  return !static_graph_ && next_launch_ < static_cast<int64_t>(buckets_.size()) &&
         torch::autograd::get_current_node();
}

bool Reducer::awaits_later_backward_locked() const {
  // torch DDP finalises a reduction once its last bucket is ready, so a forward's gradients may
  // come from several backward passes (one per head's loss, say). A backward that leaves some
  // out while an output of the forward is still to be backwarded through waits for that
  // backward; with every output reached (the usual single loss), the gradients still missing
  // are reported now, before an optimizer step can apply unreduced gradients, and so is a
  // parameter frozen after wrapping, which no backward can bring. Otherwise the next forward
  // reports them (finish_unfinished_reduction), where torch DDP does.
  if (static_graph_ || outputs_unreached_ == 0 || next_launch_ >= static_cast<int64_t>(buckets_.size()))
    return false;
  for (int64_t i = 0; i < static_cast<int64_t>(params_.size()); ++i)
    if (!ready_[i] && !params_[i].requires_grad()) return false;
  return true;
}

void Reducer::finalize_locked(bool at_next_forward, bool write_grads) {
  mark_pending_unused_locked();  // a backward's first gradient marked them, unless none came
  stats_.backward_compute_end = now_ns();
  expect_sync_ = false;
  nosync_steps_ = 0;  // the micro-steps this reduction sums
  const bool static_first = static_graph_ && static_first_iteration_;
  if (!static_first) record_arrival_ = false;  // one reduced backward's order is the one kept
  ++reductions_;
  if (static_first) settle_static_first_locked();
  const std::string missing_error = missing_gradients_locked(at_next_forward);
  if (!missing_error.empty() && !fingerprint_) fail_logged_locked(missing_error);
  if (!missing_error.empty()) {
    // The other ranks may be waiting in this reduction's collectives: issue them all (what they
    // carry does not matter, this rank raises), with a fingerprint that names what is missing.
    for (auto& bucket : buckets_) bucket.pending = 0;
  }
  launch_ready_buckets_locked();
  if (static_first) {
    // torch DDP's logger sees static_graph's first iteration this way: every bucket launched
    // from the end-of-backward callback, none counted as reduced, the compute ending after them
    stats_.buckets_reduced = 0;
    stats_.backward_compute_end = now_ns();
  }
  if (passthrough_) {
    // The gradients are autograd's own and a world of one sums nothing: no bucket to wait
    // for, no gradient to put back (parameters unused here keep .grad, as in torch DDP).
    for (auto& bucket : buckets_) bucket.last_allreduce_ms = 0.0;
    stats_.backward_comm_end = now_ns();
    diag::status().step_finished();
    diag::status().enter(diag::Phase::kOutside);
    return;
  }
  const at::Tensor global_used = global_used_locked(static_first);
  // Usage is counted from one reduction to the next, no_sync() iterations in between included.
  std::fill(locally_used_.begin(), locally_used_.end(), 0);
  if (fingerprint_) check_fingerprints_locked(missing_error);
  finish_buckets_locked();
  average_.reset();
  if (write_grads) write_grads_locked(global_used);
  stats_.backward_comm_end = now_ns();
  diag::status().step_finished();
  diag::status().enter(diag::Phase::kOutside);
}

void Reducer::settle_static_first_locked() {
  static_first_iteration_ = false;
  for (int64_t i = 0; i < static_cast<int64_t>(params_.size()); ++i) {
    if (hooks_per_backward_[i] == 0) {
      mark_unused_locked(i);
    } else {
      copy_grad_to_bucket_locked(i);
      ready_[i] = 1;
      --buckets_[param_bucket_[i]].pending;
    }
  }
}

at::Tensor Reducer::global_used_locked(bool static_first) {
  if (!(find_unused_ && !static_graph_) && !static_first) return static_global_used_;
  // Which parameters were used on any rank: those unused everywhere keep their .grad.
  diag::PhaseScope waiting(diag::Phase::kUsedMap);
  at::Tensor global_used;
  try {
    global_used = allreduce_used_locked(locally_used_);
  } catch (const std::exception& e) {
    fail_collective("the all-reduce of the used-parameter map", e);
  }
  // static_graph: the parameters unused on every rank in the first iteration stay unused.
  if (static_first) static_global_used_ = global_used;
  remember_global_used_locked(global_used);
  return global_used;
}

void Reducer::remember_global_used_locked(const at::Tensor& global_used) {
  const auto* u = global_used.data_ptr<int32_t>();
  for (size_t i = 0; i < last_global_used_.size(); ++i) last_global_used_[i] = u[i] != 0;
}

void Reducer::finish_buckets_locked() {
  const bool visiting = !visitors_.empty() && !buckets_.empty();
  if (visiting)
    for (const auto& v : visitors_) v->begin(buckets_[0].buffer);
  for (int64_t index = 0; index < static_cast<int64_t>(buckets_.size()); ++index) {
    auto& bucket = buckets_[index];
    std::optional<double> fused_squares;  // the reduction already summed this bucket's squares
    if (bucket.hook_future) {
      diag::PhaseScope waiting(diag::Phase::kAllreduce, index);
      take_comm_hook_result_locked(index);
      bucket.last_allreduce_ms = ms_since(bucket.launched);
    } else if (bucket.work) {
      wait_bucket_locked(*bucket.work, index);
      bucket.last_allreduce_ms = ms_since(bucket.launched);
      // squares_in_work is set only where the work came from ShmAllreduce::allreduce_sum.
      if (bucket.squares_in_work) fused_squares = static_cast<const ShmWork&>(*bucket.work).sum_of_squares();
      bucket.work.reset();
    } else {
      bucket.last_allreduce_ms = 0.0;  // a world of one: nothing to reduce
    }
    // A compressed bucket's squares were taken of the reduced bf16/fp16 values, which the copy
    // below widens exactly: the same numbers the buffer then holds.
    if (bucket.comm.defined()) real_view(bucket.buffer).copy_(bucket.comm);
    // The bucket is final: visitors read it while the later buckets are still on the wire.
    if (visiting)
      for (const auto& v : visitors_) v->visit(index, bucket.buffer, fused_squares);
  }
  if (visiting)
    for (const auto& v : visitors_) v->end();
}

void Reducer::write_grads_locked(const at::Tensor& global_used) {
  const int32_t* gu = global_used.defined() ? global_used.data_ptr<int32_t>() : nullptr;
  bool all_views = true;
  bool direct = false;
  // In torch DDP's order (bucket by bucket, each in its own order), which decides what a .grad
  // tensor shared by two parameters ends up holding.
  for (const auto& bucket : buckets_) {
    for (const int64_t i : bucket.params) {
      if (gu && gu[i] == 0) continue;  // unused on every rank: .grad untouched, as in torch DDP
      if (direct_[i]) {  // reduced in place: .grad holds the result, its slot nothing
        direct = true;
        continue;
      }
      if (!gradient_as_bucket_view_) {
        all_views = lend_or_copy_locked(i) && all_views;
        continue;
      }
      auto& grad = params_[i].mutable_grad();
      if (!grad.defined() || !is_slot(grad, i)) grad = grad_view_locked(i);
    }
  }
  views_but_direct_ = all_views;
  buckets_hold_grads_ = all_views && !direct;
}

bool Reducer::lend_or_copy_locked(int64_t index) {
  auto& grad = params_[index].mutable_grad();
  const auto& view = bucket_view(index);
  if (grad.defined() && grad.unsafeGetTensorImpl() == lent_[index]._unsafe_get_target() &&
      is_slot(grad, index))
    return true;  // a lent alias (lent by the hook, or accumulated in place): it holds the result
  if (!grad.defined() || unshared_like(grad, view)) {
    lend_locked(index);
    return true;
  }
  grad.copy_(view);
  return false;
}

bool Reducer::unshared_like(const at::Tensor& grad, const at::Tensor& view) {
  // torch copies the result into .grad (or into a new tensor when it has none). Where only the
  // parameter holds .grad, nobody can tell that tensor from an alias of the bucket.
  return grad.use_count() == 1 && grad.storage().use_count() == 1 && plain_like(grad, view);
}

bool Reducer::plain_like(const at::Tensor& grad, const at::Tensor& view) {
  return !grad.requires_grad() && grad.layout() == at::kStrided && grad.scalar_type() == view.scalar_type() &&
         grad.device() == view.device() && grad.sizes() == view.sizes() && grad.strides() == view.strides();
}

void Reducer::lend_locked(int64_t index) {
  const auto& view = bucket_view(index);
  // A new TensorImpl over the same memory (no dispatch, no autograd metadata): the views
  // themselves are never handed out, so a lent alias's liveness says whether anyone holds it.
  auto& grad = params_[index].mutable_grad();
  grad = at::Tensor(view.unsafeGetTensorImpl()->shallow_copy_and_detach(c10::VariableVersion(0),
                                                                        /*allow_tensor_metadata_change=*/true));
  lent_[index] = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>(grad.getIntrusivePtr());
  lent_from_[index] = view.storage().unsafeGetStorageImpl();
}

void Reducer::wait_bucket_locked(c10d::Work& work, int64_t index) const {
  diag::PhaseScope waiting(diag::Phase::kAllreduce, index);
  try {
    work.wait();
  } catch (const std::exception& e) {
    fail_collective("the all-reduce of bucket " + std::to_string(index), e);
  }
}

void Reducer::finish_unfinished_reduction() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!failed_backward_.empty()) fail_logged_locked(failed_backward_);
  if (!expect_sync_ || !hooks_seen_) return;
  if (static_graph_ && !static_first_iteration_ && !callback_queued_) {
    // static_graph finalises a reduction once every expected gradient arrived: this backward
    // stopped short of that, because it raised or because the graph changed. As below, the rest
    // of the reduction is issued (the other ranks are told which parameters this rank lacks
    // instead of waiting) and every later forward is refused.
    std::string missing;
    std::string indices;
    for (int64_t i = 0; i < static_cast<int64_t>(params_.size()); ++i) {
      if (ready_[i]) continue;
      missing += (missing.empty() ? "" : ", ") + names_[i];
      indices += (indices.empty() ? "" : " ") + std::to_string(i);
    }
    // torch's sentences first (scripts match them; torch raises them at this forward too)
    failed_backward_ = "Expected to have finished reduction in the prior iteration before starting a new one. This "
                       "error indicates that your training graph has changed in this iteration, e.g., one parameter "
                       "is used in first iteration, but then got unused in the second iteration. this is not "
                       "compatible with static_graph set to True.\nParameter indices which did not receive grad for "
                       "rank " + std::to_string(process_group_->getRank()) + ": " + indices + "\n"
                       "DDPWrapper: the previous backward pass did not reduce all gradients (static_graph=True): "
                       "these parameters received fewer gradients than in the first iteration: " + missing +
                       ". That backward raised (" + failed_backward_cause_locked() + "), or the graph changed: "
                       "static_graph=True needs the same used parameters, each reached the same number of times, "
                       "in every iteration (else use find_unused_parameters=True). The reduction cannot finish, so "
                       "this wrapper cannot go on; after a failed backward, build a new wrapper (from the model's "
                       "state, on every rank).";
    finish_failed_reduction_locked();
  }
  if (static_graph_) return;
  if (!callback_queued_) {
    finalize_locked(true);  // no later backward brought the missing gradients: reports them
    return;
  }
  // Queued but never run: that backward raised (autograd drops a failed backward's callbacks),
  // with part of its buckets launched. The rest are issued, so that the other ranks are told
  // instead of waiting; this wrapper then refuses every forward, as torch DDP does after it.
  // torch's sentence first (scripts match it; torch raises it at this forward too)
  failed_backward_ = std::string(kUnfinishedReduction) +
                     "\nDDPWrapper: a backward pass raised before its gradients were reduced (" +
                     failed_backward_cause_locked() +
                     "), so this wrapper's buckets hold part of that reduction and it cannot go on; torch's "
                     "DistributedDataParallel refuses every forward after this too. Build a new wrapper to go on "
                     "(from the model's state, on every rank).";
  finish_failed_reduction_locked();
}

std::string Reducer::failed_backward_cause_locked() const {
  if (backward_error_.empty()) return "e.g. out of memory inside backward";
  const size_t cut = 300;
  const char* close = backward_error_.size() > cut ? "...\"" : "\"";
  return "with DDPWrapper's error: \"" + backward_error_.substr(0, cut) + close;
}

void Reducer::delay_all_reduce() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!failed_backward_.empty()) fail_logged_locked(failed_backward_);
  const char* state = !static_graph_              ? "the wrapper was built without static_graph=True"
                      : !static_first_iteration_ ? "static_graph's first iteration is reduced already"
                      : !expect_sync_             ? "no reduction is armed (no reducing forward or "
                                                    "prepare_for_backward() since the last one)"
                                                  : nullptr;
  // torch's reducer issues every bucket's collective regardless and then fails an internal
  // assert when no backward is armed; refused here before any collective the other ranks would
  // have to match.
  TORCH_CHECK(state == nullptr, "DDPWrapper.reducer._delay_all_reduce(): ", state, ". It reduces the first "
              "iteration of a static_graph=True wrapper at once, after that iteration's backward (as Lightning "
              "does after the first manual backward); call it once, then.");
  callback_queued_ = false;  // a callback an output's pre-hook queued finds the reduction done
  finalize_locked();
}

void Reducer::finish_failed_reduction_locked() {
  callback_queued_ = false;
  try {
    finalize_locked(false, /*write_grads=*/false);
  } catch (const std::exception&) {
    // The missing gradients' report: the other ranks raise theirs; this one raises the cause.
  }
  fail_logged_locked(failed_backward_);
}

void Reducer::refuse_incomplete_static_locked() const {
  // The first iteration with static_graph is finalised once backward reaches an output's
  // grad_fn (later ones: finish_unfinished_reduction, at the start of the forward).
  TORCH_CHECK(false, "DDPWrapper: the first backward pass with static_graph=True ran without passing through "
              "the outputs of the preceding forward, so its gradients were not reduced. Compute the loss from "
              "the tensors DDPWrapper's forward returned.");
}

std::string Reducer::missing_gradients_locked(bool at_next_forward) {
  std::string missing;
  int64_t missing_count = 0;
  std::string frozen;  // parameters whose requires_grad was turned off after wrapping
  uint64_t missing_hash = kFpSeed;
  for (int64_t i = 0; i < static_cast<int64_t>(params_.size()); ++i) {
    if (!ready_[i]) {
      if (missing_count++ < 20) missing += (missing.empty() ? "" : ", ") + names_[i];
      const bool requires_grad = params_[i].requires_grad();
      if (!requires_grad) frozen += (frozen.empty() ? "" : ", ") + names_[i];
      missing_now_[i] = requires_grad;  // a frozen one is reported as such, not as unused
      missing_hash = fp_mix(missing_hash, i);
    }
  }
  if (missing_count == 0) return std::string();
  fp_missing_ = fp_finish(missing_hash) | 1;
  if (!frozen.empty() && !static_graph_ && outputs_unreached_ > 0 && !at_next_forward) {
    // reported before a later backward over this forward could bring the others: the frozen
    // ones are why (awaits_later_backward_locked)
    return c10::str("DDPWrapper: these parameters now have requires_grad=False but required grad when the "
                    "wrapper was built: ", frozen, ". No backward pass can bring their gradients, so this "
                    "forward's reduction cannot finish. Freeze parameters before wrapping the model (or wrap it "
                    "again after changing them), or pass find_unused_parameters=True.");
  }
  // torch's sentences first where torch raises too (scripts match them)
  return c10::str((at_next_forward ? kUnfinishedReduction : ""), "DDPWrapper: ", missing_count, " parameter(s) received no gradient in the last backward pass: ", missing,
              (missing_count > 20 ? ", ..." : ""), ". Their reduction cannot finish. ",
              (!frozen.empty()
                   ? "These now have requires_grad=False but required grad when the wrapper was built: " + frozen +
                         ". Freeze parameters before wrapping the model (or wrap it again after changing them), "
                         "or pass find_unused_parameters=True."
                   : static_graph_
                   ? std::string("With static_graph=True these received fewer gradients than in the first "
                                 "iteration: that backward raised, or the graph changed (use "
                                 "find_unused_parameters=True instead of static_graph=True).")
                   : find_unused_
                   ? std::string("find_unused_parameters=True is on, so the forward's outputs reach these "
                                 "parameters but this backward did not: make sure the loss uses every forward "
                                 "output that depends on parameters (a backward through gradients taken with "
                                 "torch.autograd.grad(create_graph=True), e.g. a gradient penalty, can skip "
                                 "some; add the forward's loss to it).")
                   : std::string("If some parameters are legitimately unused in some iterations, pass "
                                 "find_unused_parameters=True; also make sure every forward output that depends "
                                 "on parameters takes part in the loss.")));
}

}  // namespace fastddp::reducer
