#include "reducer/reducer.h"

#include "reducer/claims.h"

#include "diag/status.h"

#include "reducer/layout.h"

#include <ATen/ops/scalar_tensor.h>
#include <c10/util/Logging.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <functional>

namespace fastddp::reducer {

namespace {

// torch DDP's words (logged, not raised) for a gradient made by backward(create_graph=True)
constexpr const char* kCreateGraphWarning =
    "Using DistributedDataParallel with create_graph=True  is not well-supported. The higher-order gradient will "
    " not be synchronized across ranks, and backpropagation  through all_reduce operations will not occur. If you "
    "require  DDP to work with higher-order gradients for your use case,  please ping "
    "https://github.com/pytorch/pytorch/issues/63929";

}  // namespace

Reducer::Reducer(std::vector<at::Tensor> params, std::vector<std::string> names,
                 c10::intrusive_ptr<c10d::ProcessGroup> process_group, const ReducerOptions& options,
                 std::unique_ptr<c10d::CommHookInterface> comm_hook)
    : params_(std::move(params)),
      names_(std::move(names)),
      process_group_(std::move(process_group)),
      options_(options),
      gradient_as_bucket_view_(options.gradient_as_bucket_view),
      find_unused_(options.find_unused_parameters),
      static_graph_(options.static_graph),
      comm_dtype_(options.comm_dtype),
      average_(process_group_ ? process_group_->getSize() : 1, options.divide_gradients),
      comm_hook_(std::move(comm_hook)) {
  TORCH_CHECK(process_group_, "DDPWrapper: process group is null");
  TORCH_CHECK(names_.size() == params_.size(), "DDPWrapper: ", params_.size(), " parameters but ",
              names_.size(), " names");
  const auto& shm_allreduce = options_.shm_allreduce;
  TORCH_CHECK(!comm_hook_ || (!comm_dtype_ && !shm_allreduce), "DDPWrapper: a communication hook does its "
              "own reduction; it cannot be combined with comm_dtype (got ", comm_dtype_ ? c10::toString(*comm_dtype_) : "None",
              ") or the shared-memory transport (shm_allreduce=", shm_allreduce ? (*shm_allreduce ? "True" : "False") : "None",
              ")");
  passthrough_ = options_.single_rank_passthrough && process_group_->getSize() == 1 && !comm_dtype_ && !comm_hook_;
  bool any_cuda = false;
  for (const auto& p : params_) any_cuda = any_cuda || p.is_cuda();
  batch_copies_ = options_.batch_copies.value_or(any_cuda);
  const int64_t n = static_cast<int64_t>(params_.size());
  ready_.assign(n, 0);
  locally_used_.assign(n, 0);
  last_global_used_.assign(n, 0);
  hooks_per_backward_.assign(n, 0);
  hooks_left_.assign(n, 0);
  lent_.assign(n, c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>(at::Tensor().getIntrusivePtr()));
  lent_from_.assign(n, nullptr);
  direct_.assign(n, 0);
  unset_at_forward_.assign(n, 0);
  unused_now_.assign(n, 0);
  missing_now_.assign(n, 0);
  fingerprint_ = options_.fingerprint && process_group_->getSize() > 1 && !comm_hook_ && !passthrough_;
  if (shm_allreduce) {
    // Collective over the group: every rank of a CPU model takes part (the caller decides that
    // from the parameters' device, the same on every rank) and says whether it wants shared
    // memory, so all agree on the transport.
    TORCH_CHECK(options_.shm_timeout_s > 0, "DDPWrapper: shared-memory all-reduce timeout must be > 0 s, got ",
                options_.shm_timeout_s);
    TORCH_CHECK(options_.shm_broadcast_bytes >= 0, "DDPWrapper: shm_broadcast_bytes must be >= 0, got ",
                options_.shm_broadcast_bytes);
    for (const auto& p : params_)
      TORCH_CHECK(p.device().is_cpu(), "DDPWrapper: shared-memory all-reduce is for CPU parameters, got ", p.device());
    const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(options_.shm_timeout_s * 1000.0));
    shm_ = ShmAllreduce::create(process_group_, *shm_allreduce, wire_bytes(), options_.shm_broadcast_bytes,
                                timeout, &transport_note_);
  } else {
    transport_note_ = "not a multi-process CPU model";
  }
  record_arrival_ = rebuilds_buckets(options_);
  install_buckets_locked(initial_buckets(params_, options_));
}

std::vector<int64_t> Reducer::arrival_order() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return arrival_;
}

int64_t Reducer::reductions() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return reductions_;
}

bool Reducer::graph_static() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return graph_static_;
}

IterationStats Reducer::iteration_stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

std::string Reducer::logged_error() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return logged_error_;
}

void Reducer::fail_logged_locked(const std::string& message) {
  logged_error_ = message;
  TORCH_CHECK(false, message);
}

bool Reducer::reduce_avg_locked() {
  if (!average_.over_world()) return false;  // join(): averaged over the ranks still training
  if (!reduce_avg_) {
    bool avg = false;
    // (torch's allreduce_hook divides before a SUM: the division is kept, and so its bits)
    if (!comm_dtype_ && !comm_hook_ && !options_.divide_gradients && process_group_->getSize() > 1 &&
        !buckets_.empty() && buckets_.front().buffer.is_cuda()) {
      try {
        avg = process_group_->getBackend(c10::DeviceType::CUDA)->getBackendName() == "nccl";
      } catch (const c10::Error&) {
        avg = false;  // no CUDA backend registered: keep the portable SUM + pre-division
      }
    }
    reduce_avg_ = avg;
  }
  return *reduce_avg_;
}

void Reducer::register_hooks() {
  std::weak_ptr<Reducer> weak = weak_from_this();
  TORCH_CHECK(!weak.expired(), "DDPWrapper: the reducer must be owned by a shared_ptr before hooks are registered");
  for (int64_t i = 0; i < static_cast<int64_t>(params_.size()); ++i) {
    auto acc = torch::autograd::impl::grad_accumulator(params_[i]);
    TORCH_CHECK(acc, "DDPWrapper: parameter ", names_[i], " has no gradient accumulator (is it a leaf "
                "tensor that requires grad?)");
    hook_keys_.push_back(acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [weak, i](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
          if (auto reducer = weak.lock()) reducer->mark_ready(i);
          return outputs;
        })));
    grad_accumulators_.push_back(std::move(acc));
  }
  claims::add(shared_from_this(), params_);
}

Reducer::~Reducer() { claims::remove(this); }

void Reducer::yield_unstarted_reduction() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!expect_sync_ || hooks_seen_ || static_graph_) return;
  expect_sync_ = false;  // its gradients arrive as outside a reduction (note_gradient_outside_reduction_locked)
  unused_pending_.clear();
}

void Reducer::remove_hooks() {
  claims::remove(this);
  for (size_t i = 0; i < hook_keys_.size(); ++i) grad_accumulators_[i]->del_post_hook(hook_keys_[i]);
  hook_keys_.clear();  // the accumulators stay: the unused-parameter search maps them to parameters
}

void Reducer::mark_ready(int64_t index) {
  std::lock_guard<std::mutex> lock(mutex_);
  try {
    mark_ready_locked(index);
  } catch (const c10::Error& e) {
    backward_error_ = e.what_without_backtrace();  // named by the next forward's refusal
    throw;
  }
}

void Reducer::mark_ready_locked(int64_t index) {
  // Used means a .grad exists (torch DDP's rule): a hook can fire without a gradient (a custom
  // Function returned None for this input). Under no_sync() the use counts for the next
  // reduction too, so what accumulated here is averaged even if that iteration skips it.
  const auto& grad = params_[index].grad();
  TORCH_CHECK(passthrough_ || !grad.defined() || grad.layout() == at::kStrided, "DDPWrapper: parameter '",
              names_[index], "' got a gradient of layout ", grad.layout(), " (e.g. from nn.Embedding(sparse=True)); "
              "the reducer all-reduces dense flat buckets only. Use sparse=False for that layer, or torch's "
              "DistributedDataParallel for sparse gradients.");
  if (grad.defined()) locally_used_[index] = 1;
  if (!expect_sync_) {
    note_gradient_outside_reduction_locked(index);
    return;
  }
  if (grad.defined() && grad.requires_grad()) check_create_graph_locked(index);
  diag::status().backward_started();  // a reducing backward (no_sync's stay "outside")
  hooks_seen_ = true;
  nosync_forward_pending_ = false;  // a no_sync() forward backwarded with this reduction
  mark_pending_unused_locked();
  if (!static_graph_ || !static_first_iteration_) stats_.ready_order.push_back(index);
  if (static_graph_) {
    if (!static_arrival_completes_locked(index)) return;
  } else if (!callback_queued_) {
    // Queued at the first gradient so that a parameter that never gets one is reported at the
    // end of this backward pass when no later one can bring it (awaits_later_backward_locked;
    // static_graph queues it once every bucket is launched instead).
    queue_finalize_locked();
  }
  TORCH_CHECK(!ready_[index], "Expected to mark a variable ready only once. DDPWrapper: parameter '", names_[index], "' received its gradient twice in one "
              "reduction. This happens when two backward passes over one forward both reach it (one loss per "
              "head over a shared trunk: sum the losses and call backward once), when a parameter is used in "
              "several reentrant backward passes (e.g. torch.utils.checkpoint with use_reentrant=True: use "
              "static_graph=True or use_reentrant=False), or when find_unused_parameters=True marked it unused "
              "although the graph uses it later (set find_unused_parameters=False).");
  ready_[index] = 1;
  if (record_arrival_) arrival_.push_back(index);
  copy_grad_to_bucket_locked(index);
  if (--buckets_[param_bucket_[index]].pending == 0) launch_ready_buckets_locked();
  if (static_graph_ && next_launch_ == static_cast<int64_t>(buckets_.size()) && !callback_queued_)
    queue_finalize_locked();
}

void Reducer::note_gradient_outside_reduction_locked(int64_t index) {
  // no_sync(), or a backward not preceded by a forward: the gradients change after the last
  // reduction, so what visitors computed from it is stale, and a new gradient (after
  // zero_grad(set_to_none)) lives outside the buckets.
  if (nosync_forward_pending_) ++nosync_steps_;  // a no_sync() micro-step that accumulated
  nosync_forward_pending_ = false;
  invalidate_visitors_locked();
  const auto& grad = params_[index].grad();
  if (grad.defined() && !is_slot(grad, index)) buckets_hold_grads_ = false;
}

void Reducer::check_create_graph_locked(int64_t index) {
  // backward(create_graph=True): torch DDP logs its warning and reduces the values of one such
  // gradient per backward; at a second one it fails ("a leaf Variable that requires grad is
  // being used in an in-place operation."). The same here, with the reason.
  C10_LOG_EVERY_N(WARNING, 1000) << kCreateGraphWarning;
  TORCH_CHECK(++grads_requiring_grad_ == 1, "DDPWrapper: parameter '", names_[index], "' is the second one in "
              "this backward whose gradient requires grad (backward(create_graph=True)). torch DDP reduces such "
              "a gradient for one parameter only and fails at the second (\"a leaf Variable that requires grad is "
              "being used in an in-place operation.\"); DDPWrapper refuses it too. For a gradient penalty, take "
              "the inner gradient with torch.autograd.grad(..., create_graph=True) and call backward() without "
              "create_graph.");
}

bool Reducer::static_arrival_completes_locked(int64_t index) {
  if (static_first_iteration_) {
    // Count the arrivals; everything is reduced at the end of this backward. (As in torch
    // DDP, the order kept for the rebuild is the next backward's, each at its last arrival.)
    ++hooks_per_backward_[index];
    return false;
  }
  // torch's sentence first (scripts match it), then which parameter
  if (hooks_left_[index] <= 0)
    fail_logged_locked(c10::str(
        "Your training graph has changed in this iteration, e.g., one parameter is unused in first iteration, but "
        "then got used in the second iteration. this is not compatible with static_graph set to True. "
        "(DDPWrapper: parameter '", names_[index], "' received more gradients in this backward pass than in the "
        "first iteration (", hooks_per_backward_[index], "); use find_unused_parameters=True instead of "
        "static_graph=True for a graph that changes.)"));
  return --hooks_left_[index] <= 0;  // else later reentrant passes add to this gradient
}

void Reducer::queue_finalize() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (expect_sync_ && !callback_queued_) queue_finalize_locked();
}

void Reducer::queue_finalize_locked() {
  callback_queued_ = true;
  std::weak_ptr<Reducer> weak = weak_from_this();
  torch::autograd::Engine::get_default_engine().queue_callback([weak] {
    if (auto reducer = weak.lock()) reducer->finalize_backward();
  });
}

std::vector<at::Tensor> Reducer::bucket_buffers() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<at::Tensor> out;
  for (const auto& b : buckets_) out.push_back(b.buffer);
  return out;
}

void Reducer::add_bucket_visitor(std::shared_ptr<BucketVisitor> visitor) {
  TORCH_CHECK(visitor, "DDPWrapper: the bucket visitor is null");
  std::lock_guard<std::mutex> lock(mutex_);
  visitors_.push_back(std::move(visitor));
}

void Reducer::invalidate_visitors_locked() {
  for (const auto& v : visitors_) v->invalidate();
}

bool Reducer::visitors_want_squares_locked() const {
  for (const auto& v : visitors_)
    if (v->wants_sum_of_squares()) return true;
  return false;
}

std::vector<std::vector<int64_t>> Reducer::bucket_indices() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::vector<int64_t>> out;
  for (const auto& b : buckets_) out.push_back(b.params);
  return out;
}

std::vector<double> Reducer::bucket_allreduce_ms() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<double> out;
  for (const auto& b : buckets_) out.push_back(b.last_allreduce_ms);
  return out;
}

bool Reducer::broadcast_buffers(const std::vector<at::Tensor>& tensors) {
  if (!shm_) return false;
  for (const auto& t : tensors)
    if (!t.device().is_cpu() || t.layout() != at::kStrided) return false;
  // Buffers a forward replaced by larger ones no longer fit the room reserved at construction.
  if (packed_bytes(tensors) > shm_->broadcast_bytes()) return false;
  diag::PhaseScope broadcasting(diag::Phase::kBroadcast);
  shm_->broadcast_from_root(tensors);
  return true;
}

int64_t Reducer::relocations() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return relocations_;
}

std::vector<bool> Reducer::bucket_shm() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<bool> out;
  for (const auto& b : buckets_) out.push_back(b.shm);
  return out;
}

}  // namespace fastddp::reducer
