// Arming a backward (reducer.h): what a forward's outputs reach, the static graph's first
// iteration, the per-backward reset and the parameters marked unused before a backward runs.
#include "reducer/reducer.h"

#include "reducer/claims.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <unordered_map>
#include <unordered_set>

namespace fastddp::reducer {

namespace {

// Runs a callback when the autograd engine reaches the node it is attached to.
class NodeReachedHook : public torch::autograd::FunctionPreHook {
 public:
  explicit NodeReachedHook(std::function<void()> on_reached) : on_reached_(std::move(on_reached)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    on_reached_();
    return grads;
  }

 private:
  std::function<void()> on_reached_;
};

// Which of `accumulators` (the parameters' AccumulateGrad nodes) the autograd graph behind
// `outputs` reaches: a walk of the graph from the outputs' grad_fn. (A template: the pointer
// type torch hands out for them differs between torch versions.)
template <typename NodePtr>
std::vector<char> reached_accumulators(const std::vector<at::Tensor>& outputs,
                                       const std::vector<NodePtr>& accumulators) {
  std::unordered_map<const torch::autograd::Node*, int64_t> accumulator_index;
  for (int64_t i = 0; i < static_cast<int64_t>(accumulators.size()); ++i)
    accumulator_index[accumulators[i].get()] = i;
  std::unordered_set<const torch::autograd::Node*> seen;
  std::vector<const torch::autograd::Node*> stack;
  for (const auto& out : outputs) {
    if (!out.defined() || !out.requires_grad()) continue;
    const auto edge = torch::autograd::impl::gradient_edge(out);
    if (edge.function && seen.insert(edge.function.get()).second) stack.push_back(edge.function.get());
  }
  std::vector<char> reached(accumulators.size(), 0);
  while (!stack.empty()) {
    const auto* node = stack.back();
    stack.pop_back();
    auto it = accumulator_index.find(node);
    if (it != accumulator_index.end()) reached[it->second] = 1;
    for (const auto& edge : node->next_edges()) {
      if (edge.function && seen.insert(edge.function.get()).second) stack.push_back(edge.function.get());
    }
  }
  return reached;
}

}  // namespace

void Reducer::prepare_for_backward(const std::vector<at::Tensor>& outputs, bool sync) {
  if (sync) {  // before this reducer's lock: the others take their own
    for (const auto& other : claims::sharing(this)) other->yield_unstarted_reduction();
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (!sync) {
    // A forward under no_sync() leaves the reducer as it is, as torch DDP's does: a reduction
    // a reducing forward asked for still happens in the next backward (one backward through
    // both forwards' graphs, or a reducing forward whose own backward never ran). Its
    // backward, if one runs, counts as a no_sync() micro-step for the fingerprints.
    nosync_forward_pending_ = true;
    return;
  }
  if (static_graph_ && static_first_iteration_ && expect_sync_ && hooks_seen_ && !callback_queued_)
    refuse_incomplete_static_locked();
  reset_for_backward_locked();
  note_reducing_forward_locked();
  if (static_graph_) {
    prepare_static_locked(outputs);
    return;
  }
  watch_outputs_locked(outputs);
  if (find_unused_) {
    // Parameters whose AccumulateGrad the graph does not reach get no gradient this iteration
    // and are ready right away (zero contribution).
    const auto reached = reached_accumulators(outputs, grad_accumulators_);
    note_unused_locked(reached);
    note_graph_static_locked();
    // torch DDP's hint, on stderr as there (the binding runs without the GIL, so c10's default
    // handler prints it): the graph walk costs every iteration and found nothing to skip.
    if (std::all_of(reached.begin(), reached.end(), [](char r) { return r != 0; })) {
      // torch's words exactly (its double space included): logs are searched for them
      TORCH_WARN_ONCE("find_unused_parameters=True was specified in DDP constructor, but did not find any unused "
                      "parameters in the forward pass. This flag results in an extra traversal of the autograd graph "
                      "every iteration,  which can adversely affect performance. If your model indeed never has any "
                      "unused parameters in the forward pass, consider turning this flag off. Note that this warning "
                      "may be a false positive if your model has flow control causing later iterations to have "
                      "unused parameters.");
    }
    for (int64_t i = 0; i < static_cast<int64_t>(params_.size()); ++i)
      if (!reached[i]) unused_pending_.push_back(i);
  }
}

void Reducer::note_graph_static_locked() {
  // torch compares each search's unused set with the one before, and stays false once it differed:
  // the same as comparing every search with the first.
  if (!graph_static_) return;
  if (first_unused_.empty()) {
    first_unused_ = unused_now_;
  } else {
    graph_static_ = unused_now_ == first_unused_;
  }
}

void Reducer::watch_outputs_locked(const std::vector<at::Tensor>& outputs) {
  const uint64_t forward = ++forward_;
  outputs_unreached_ = 0;
  std::unordered_set<const torch::autograd::Node*> seen;
  std::weak_ptr<Reducer> weak = weak_from_this();
  for (const auto& out : outputs) {
    // A leaf (a parameter returned as it is) has no node of this forward's graph: its
    // AccumulateGrad lives as long as the parameter and would gather a hook per forward.
    if (!out.defined() || !out.grad_fn()) continue;
    const auto edge = torch::autograd::impl::gradient_edge(out);
    if (!edge.function || !seen.insert(edge.function.get()).second) continue;
    ++outputs_unreached_;
    auto reached = std::make_shared<std::atomic<bool>>(false);  // a retained graph runs it again
    edge.function->add_pre_hook(std::make_unique<NodeReachedHook>([weak, forward, reached] {
      if (reached->exchange(true)) return;
      if (auto reducer = weak.lock()) reducer->output_reached(forward);
    }));
  }
}

void Reducer::output_reached(uint64_t forward) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (forward == forward_ && outputs_unreached_ > 0) --outputs_unreached_;
}

void Reducer::reset_for_backward_locked() {
  stats_.reset();
  stats_.backward_compute_start = now_ns();  // the forward's end, as torch's logger times it
  hooks_seen_ = false;
  backward_error_.clear();
  grads_requiring_grad_ = 0;
  expect_sync_ = true;
  invalidate_visitors_locked();  // what visitors took from an earlier backward is stale
  if (!gradient_as_bucket_view_) {
    for (size_t i = 0; i < params_.size(); ++i) unset_at_forward_[i] = !params_[i].grad().defined();
  }
  callback_queued_ = false;
  next_launch_ = 0;
  unused_pending_.clear();
  std::fill(ready_.begin(), ready_.end(), 0);
  std::fill(direct_.begin(), direct_.end(), 0);
  for (auto& b : buckets_) {
    b.direct = false;
    b.pending = static_cast<int64_t>(b.params.size());
    b.work.reset();
    b.hook_future.reset();
    b.squares_in_work = false;
    b.private_checked = false;
    b.deferred.clear();
  }
}

void Reducer::prepare_static_locked(const std::vector<at::Tensor>& outputs) {
  if (static_first_iteration_) {
    // Reentrant backward passes (torch.utils.checkpoint with use_reentrant=True) have graph
    // tasks of their own, so the reduction cannot be queued from a parameter hook: the outputs'
    // grad_fn run in the outermost backward, which ends only after every gradient arrived.
    std::fill(hooks_per_backward_.begin(), hooks_per_backward_.end(), 0);
    std::weak_ptr<Reducer> weak = weak_from_this();
    for (const auto& out : outputs) {
      if (!out.defined() || !out.requires_grad()) continue;
      const auto edge = torch::autograd::impl::gradient_edge(out);
      if (!edge.function) continue;
      edge.function->add_pre_hook(std::make_unique<NodeReachedHook>([weak] {
        if (auto reducer = weak.lock()) reducer->queue_finalize();
      }));
    }
    return;
  }
  // Later iterations: the first iteration told which parameters are unused and how many
  // times each of the others is reached.
  hooks_left_ = hooks_per_backward_;
  for (int64_t i = 0; i < static_cast<int64_t>(params_.size()); ++i)
    if (hooks_per_backward_[i] == 0) unused_pending_.push_back(i);
}

void Reducer::mark_pending_unused_locked() {
  if (unused_pending_.empty()) return;
  for (int64_t i : unused_pending_) mark_unused_locked(i);
  unused_pending_.clear();
  launch_ready_buckets_locked();
}

void Reducer::mark_unused_locked(int64_t index) {
  // As in torch DDP, a parameter this iteration does not reach still contributes whatever
  // .grad holds (e.g. gradients accumulated under no_sync(); zero or None otherwise).
  copy_grad_to_bucket_locked(index);
  ready_[index] = 1;
  --buckets_[param_bucket_[index]].pending;
  stats_.unused_parameter_bytes += params_[index].numel() * static_cast<int64_t>(params_[index].element_size());
}

}  // namespace fastddp::reducer
