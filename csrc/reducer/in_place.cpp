// Gradients reduced where autograd left them (the shared-memory transport, large gradients):
// which qualify, the pieces a bucket's collective then runs over, and bringing them back into
// the buckets when something asks for the flat buffers.
#include "reducer/reducer.h"

namespace fastddp::reducer {

bool Reducer::reduces_in_place_locked(int64_t index, const at::Tensor& grad, const at::Tensor& view) const {
  // Below this a gradient's copy costs less than the piece it would add to the collective.
  // The shared-memory sum averages what it reads in place (over the world size only: see
  // wire_scaling_locked).
  constexpr int64_t kMinBytes = 64 * 1024;
  const auto& bucket = buckets_[param_bucket_[index]];
  return bucket.shm && !bucket.comm.defined() && !gradient_as_bucket_view_ && !passthrough_ && !comm_hook_ &&
         visitors_.empty() && !buckets_requested_ && average_.over_world() &&
         grad.numel() * static_cast<int64_t>(grad.element_size()) >= kMinBytes && plain_like(grad, view) &&
         grad.is_non_overlapping_and_dense() && !grad.is_alias_of(view);
}

std::vector<ShmPiece> Reducer::direct_pieces_locked(const Bucket& bucket, std::vector<at::Tensor>* holders) const {
  std::vector<ShmPiece> pieces;
  const int64_t elem = static_cast<int64_t>(bucket.buffer.element_size());
  char* base = static_cast<char*>(bucket.buffer.data_ptr());
  int64_t run = 0;  // start of the flat-buffer run not yet emitted
  holders->push_back(bucket.buffer);
  for (size_t slot = 0; slot < bucket.params.size(); ++slot) {
    const int64_t i = bucket.params[slot];
    if (!direct_[i]) continue;
    const int64_t offset = bucket.offsets[slot];
    if (offset > run) pieces.push_back({base + run * elem, offset - run});
    const auto& grad = params_[i].grad();
    // A dense gradient with the slot's strides: from its first element on, its memory holds
    // the slot's elements in the slot's order.
    pieces.push_back({static_cast<char*>(grad.data_ptr()), grad.numel()});
    holders->push_back(grad);
    run = offset + grad.numel();
  }
  if (bucket.buffer.numel() > run) pieces.push_back({base + run * elem, bucket.buffer.numel() - run});
  return pieces;
}

void Reducer::hold_grads_in_buckets() {
  std::lock_guard<std::mutex> lock(mutex_);
  buckets_requested_ = true;
  bool all_views = views_but_direct_;
  for (int64_t i = 0; i < static_cast<int64_t>(params_.size()); ++i) {
    if (!direct_[i]) continue;
    direct_[i] = 0;
    auto& grad = params_[i].mutable_grad();
    if (!grad.defined()) continue;  // set to None since (zero_grad): nothing to bring in
    const auto& view = bucket_view(i);
    if (!plain_like(grad, view)) {  // replaced since by a tensor of another layout
      all_views = false;
      continue;
    }
    view.copy_(grad);
    if (unshared_like(grad, view)) {
      lend_locked(i);
    } else {
      all_views = false;
    }
  }
  buckets_hold_grads_ = all_views;
}

}  // namespace fastddp::reducer
