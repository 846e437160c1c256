// A parameter's gradient into its bucket slot, as it arrives in backward: divided by the world
// size where the collective sums, copied now, copied with the rest of its bucket once the bucket
// is full, or left where autograd made it to be reduced in place; afterwards .grad shows the
// slot when nobody can tell it from torch's own tensor.
#include "reducer/reducer.h"

#include <ATen/ops/_foreach_copy.h>
#include <ATen/ops/mul.h>

#include <cstring>

namespace fastddp::reducer {

namespace {

// torch DDP's warning, word for word (a parameter's layout changed after wrapping, e.g.
// .to(memory_format=torch.channels_last)); the copy still lays the values out right.
void warn_if_strides_differ(const at::Tensor& grad, const at::Tensor& view) {
  if (!grad.defined() || grad.strides() == view.strides()) return;
  TORCH_WARN_ONCE("Grad strides do not match bucket view strides. This may indicate grad was not created "
                  "according to the gradient layout contract, or that the param's strides changed since DDP "
                  "was constructed.  This is not an error, but may impair performance.\ngrad.sizes() = ",
                  grad.sizes(), ", strides() = ", grad.strides(), "\n", "bucket_view.sizes() = ", view.sizes(),
                  ", strides() = ", view.strides());
}

// Whether `grad` holds the same bytes in the same order as `view` would (dense CPU tensors of
// one dtype, sizes and strides): then a memcpy copies it at a fraction of copy_'s dispatch.
bool copies_as_bytes(const at::Tensor& grad, const at::Tensor& view) {
  return grad.device().is_cpu() && grad.layout() == at::kStrided && grad.is_non_overlapping_and_dense() &&
         grad.scalar_type() == view.scalar_type() && grad.sizes() == view.sizes() &&
         grad.strides() == view.strides() && view.is_non_overlapping_and_dense();
}

// Whether `grad` can join its bucket's one batched copy (flush_deferred_locked).
bool batchable(const at::Tensor& grad, const at::Tensor& view) {
  return grad.layout() == at::kStrided && grad.scalar_type() == view.scalar_type() &&
         grad.device() == view.device() && grad.sizes() == view.sizes();
}

}  // namespace

bool Reducer::divides_into_bucket_locked(int64_t index) {
  // Average before the reduction (SUM), unless the collective averages (NCCL AVG; the
  // shared-memory sum scales in its reduction pass: see wire_scaling_locked), the bucket is
  // compressed (divided after the cast, as torch's compression hooks do: see
  // launch_ready_buckets_locked) or there is nothing to divide (a world of one).
  const auto& target = buckets_[param_bucket_[index]];
  return !average_.identity() && !comm_hook_ && !reduce_avg_locked() && !target.comm.defined() &&
         wire_scaling_locked(target).identity();
}

void Reducer::copy_grad_to_bucket_locked(int64_t index) {
  if (passthrough_) return;  // nothing to reduce: .grad stays autograd's
  ensure_private_locked(param_bucket_[index]);  // before this backward writes the bucket
  const auto& grad = params_[index].grad();
  auto view = bucket_view(index);
  const bool divide = divides_into_bucket_locked(index);
  warn_if_strides_differ(grad, view);
  if (!grad.defined()) {
    view.zero_();
  } else if (grad.requires_grad()) {
    // backward(create_graph=True) (see mark_ready): the values are averaged (the result is
    // copied into .grad in place at the end of backward, where autograd records the copy); the
    // higher-order graph is not reduced.
    at::NoGradGuard no_grad;
    if (divide) {
      average_.into(view, grad.detach());
    } else {
      view.copy_(grad.detach());
    }
  } else if (reduces_in_place_locked(index, grad, view)) {
    direct_[index] = 1;  // .grad stays autograd's (or the script's) tensor and receives the result
    buckets_[param_bucket_[index]].direct = true;
  } else if (is_slot(grad, index)) {
    if (divide) average_.into(view, view);  // accumulated in place (bucket view): average there
  } else if (batch_copies_ && !divide && batchable(grad, view)) {
    buckets_[param_bucket_[index]].deferred.push_back(index);  // copied when the bucket is full
  } else {
    copy_into_slot_locked(index, view, divide);
  }
}

void Reducer::copy_into_slot_locked(int64_t index, at::Tensor& view, bool divide) {
  const auto& grad = params_[index].grad();
  if (divide) {
    average_.into(view, grad);  // the copy and the averaging in one pass
  } else if (grad.numel() == 0) {
    // Nothing to copy (and an empty tensor's data pointer may be null, which memcpy rejects).
  } else if (copies_as_bytes(grad, view)) {
    std::memcpy(view.data_ptr(), grad.data_ptr(), static_cast<size_t>(grad.numel()) * grad.element_size());
  } else {
    view.copy_(grad);
  }
  settle_copied_grad_locked(index, view);
}

void Reducer::settle_copied_grad_locked(int64_t index, const at::Tensor& view) {
  // Autograd's new gradient is in the bucket now: .grad becomes the bucket slot (a lent alias
  // without gradient_as_bucket_view, when nobody else holds it), freeing it now.
  auto& grad = params_[index].mutable_grad();
  if (gradient_as_bucket_view_) {
    grad = grad_view_locked(index);
  } else if (unset_at_forward_[index] && !comm_hook_ && grad.use_count() == 1 && plain_like(grad, view)) {
    // autograd made it in this backward and only the parameter holds it. Not while a Python
    // communication hook may read or write .grad during the backward (torch's .grad is then
    // the local gradient, apart from the bucket): the end of the backward lends it.
    lend_locked(index);
  }
}

void Reducer::flush_deferred_locked(Bucket& bucket) {
  if (bucket.deferred.empty()) return;
  std::vector<at::Tensor> views;
  std::vector<at::Tensor> grads;
  views.reserve(bucket.deferred.size());
  grads.reserve(bucket.deferred.size());
  for (int64_t i : bucket.deferred) {
    views.push_back(bucket_view(i));
    grads.push_back(params_[i].grad());
  }
  at::_foreach_copy_(views, grads);
  grads.clear();  // so that .grad is the only holder of each gradient again
  for (size_t k = 0; k < bucket.deferred.size(); ++k) settle_copied_grad_locked(bucket.deferred[k], views[k]);
  bucket.deferred.clear();
}

}  // namespace fastddp::reducer
