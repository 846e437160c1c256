// The Reducer's bucket layout: planning (layout.h's rules), the flat buffers (with the
// fingerprint header of the last c10d bucket, or shape-only when nothing is copied) and the
// rebuild in gradient arrival order.
#include "reducer/layout.h"
#include "reducer/reducer.h"

#include "diag/status.h"

#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>
#include <ATen/ops/tensor.h>

#include <unordered_map>

namespace fastddp::reducer {

int64_t Reducer::wire_bytes() const {
  int64_t bytes = 0;
  for (const auto& p : params_) {
    const auto wire = comm_dtype_ ? *comm_dtype_ : p.scalar_type();
    bytes += p.numel() * static_cast<int64_t>(c10::elementSize(wire));
  }
  return bytes;
}

void Reducer::install_buckets_locked(const std::vector<std::vector<int64_t>>& bucket_indices) {
  const int64_t n = static_cast<int64_t>(params_.size());
  std::vector<int64_t> param_bucket(n, -1);
  std::vector<int64_t> param_slot(n, -1);
  std::vector<Bucket> buckets;
  for (const auto& indices : bucket_indices) {
    TORCH_CHECK(!indices.empty(), "DDPWrapper: empty bucket");
    Bucket bucket;
    int64_t total = 0;
    TORCH_CHECK(indices.front() >= 0 && indices.front() < n, "DDPWrapper: bucket names parameter ",
                indices.front(), " of ", n);
    const auto& first = params_[indices.front()];
    for (int64_t i : indices) {
      TORCH_CHECK(i >= 0 && i < n, "DDPWrapper: bucket names parameter ", i, " of ", n);
      TORCH_CHECK(param_bucket[i] == -1, "DDPWrapper: parameter ", names_[i], " is in two buckets");
      const auto& p = params_[i];
      TORCH_CHECK(p.device() == first.device() && p.scalar_type() == first.scalar_type(),
                  "DDPWrapper: bucket mixes ", first.device(), "/", first.scalar_type(), " with ", names_[i], " on ",
                  p.device(), "/", p.scalar_type());
      param_bucket[i] = static_cast<int64_t>(buckets.size());
      param_slot[i] = static_cast<int64_t>(bucket.params.size());
      bucket.params.push_back(i);
      bucket.offsets.push_back(total);
      total += p.numel();
    }
    allocate_bucket_locked(bucket, first, total, &indices == &bucket_indices.back());
    buckets.push_back(std::move(bucket));
  }
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(param_bucket[i] >= 0, "DDPWrapper: parameter ", names_[i], " is in no bucket");
  buckets_ = std::move(buckets);
  param_bucket_ = std::move(param_bucket);
  param_slot_ = std::move(param_slot);
  fp_layout_ = layout_hash_locked();
  views_.assign(n, at::Tensor());
  grad_views_.assign(n, at::Tensor());
  for (int64_t b = 0; b < static_cast<int64_t>(buckets_.size()); ++b) make_views_locked(b);
  if (gradient_as_bucket_view_ && !passthrough_) {
    // Existing gradients (possibly views of the previous buffers, which stay alive until
    // the copy is done) move into the new buckets, so backward accumulates into them. (Lent
    // views stay where they are: someone may hold them; the next backward copies them in.)
    for (int64_t i = 0; i < n; ++i) {
      auto& grad = params_[i].mutable_grad();
      if (grad.defined()) {
        views_[i].copy_(grad);
        grad = grad_view_locked(i);
      }
    }
  }
  for (auto& bucket : buckets_) bucket.storage_refs = bucket.buffer.storage().use_count();
  if (!gradient_as_bucket_view_ && !passthrough_) move_lent_grads_locked();  // not in storage_refs
}

void Reducer::move_lent_grads_locked() {
  // A lent .grad alias of the previous buffers stays its parameter's .grad (the same tensor, as
  // torch's .grad stays across steps), re-pointed at its slot in the new bucket with its values,
  // when nothing but such aliases refers to that memory (no slice of an old .grad, no alias let
  // go): then nobody can tell, and the gradients live in the buckets again. Otherwise the
  // tensors stay where they are, with their values, and each backward copies them in.
  const int64_t n = static_cast<int64_t>(params_.size());
  std::unordered_map<const c10::StorageImpl*, int64_t> attached;
  for (int64_t i = 0; i < n; ++i) {
    const auto& grad = params_[i].grad();
    if (grad.defined() && grad.unsafeGetTensorImpl() == lent_[i]._unsafe_get_target())
      ++attached[grad.storage().unsafeGetStorageImpl()];
  }
  for (int64_t i = 0; i < n; ++i) {
    const auto& grad = params_[i].grad();
    if (!grad.defined() || grad.unsafeGetTensorImpl() != lent_[i]._unsafe_get_target()) continue;
    const auto* memory = grad.storage().unsafeGetStorageImpl();
    if (static_cast<int64_t>(grad.storage().use_count()) != attached[memory] || !plain_like(grad, views_[i])) continue;
    const auto& view = views_[i];
    view.copy_(grad);
    --attached[memory];  // this alias lets go of the old memory now
    auto* impl = grad.unsafeGetTensorImpl();
    impl->set_storage_keep_dtype(view.storage());
    impl->set_sizes_and_strides(view.sizes(), view.strides(), view.storage_offset());
    lent_from_[i] = view.storage().unsafeGetStorageImpl();
  }
}

bool Reducer::shm_sums_as_c10d(at::ScalarType dtype) const {
  // Shared memory adds the ranks' values in gloo's order, rounding each sum to the bucket's dtype
  // as gloo does (shm_kernels.h, ring_order.h): torch DDP's bits for every dtype it reduces.
  return dtype == at::kFloat || dtype == at::kDouble || dtype == at::kBFloat16 || dtype == at::kHalf;
}

void Reducer::allocate_bucket_locked(Bucket& bucket, const at::Tensor& first, int64_t total, bool last) {
  const bool compress = comm_dtype_ && *comm_dtype_ != first.scalar_type();
  const auto dtype = first.scalar_type();
  bucket.shm = shm_ && (compress || shm_sums_as_c10d(dtype));
  const auto options = first.options().requires_grad(false);
  if (passthrough_ && !bucket.shm) {
    // Nothing is ever copied into it: a shape-only (meta) tensor keeps the layout for
    // bucket_report() without holding a second copy of every gradient.
    bucket.buffer = at::empty({total}, options.device(at::kMeta));
    return;
  }
  // Uninitialised, as torch's reducer allocates its buckets: each reducing backward writes every
  // slot (its gradient, or zero for a parameter without one) before the bucket's collective, so
  // the pages are faulted in by the backward that fills them, and a rebuild (new buckets while
  // the old ones live) does not hold two written copies of the gradients at once.
  // The last c10d bucket carries the fingerprint header after its gradients.
  const int64_t header = last && !bucket.shm ? fingerprint_header_elems(first, compress) : 0;
  if (header > 0) {
    bucket.wire = at::empty({total + header}, options);
    bucket.wire.narrow(0, total, header).zero_();
    bucket.buffer = bucket.wire.narrow(0, 0, total);
    bucket.header = header;
    return;
  }
  bucket.buffer = at::empty({total}, options);
  // a complex bucket goes on the wire as its real view (torch's compression hooks cast that)
  if (compress) bucket.comm = at::empty({real_view(bucket.buffer).numel()}, options.dtype(*comm_dtype_));
}

void Reducer::make_views_locked(int64_t bucket_index) {
  // Each parameter's view is made once per bucket layout, not per gradient. A dense parameter's
  // view takes the parameter's strides (a channels_last weight gets a channels_last gradient),
  // as autograd's gradient layout contract and torch DDP do; any other parameter gets a
  // row-major view, which is also what autograd gives it.
  const auto& bucket = buckets_[bucket_index];
  for (size_t slot = 0; slot < bucket.params.size(); ++slot) {
    const int64_t i = bucket.params[slot];
    const auto& p = params_[i];
    const int64_t offset = bucket.offsets[slot];
    views_[i] = p.is_non_overlapping_and_dense()
                    ? bucket.buffer.as_strided(p.sizes(), p.strides(), bucket.buffer.storage_offset() + offset)
                    : bucket.buffer.narrow(0, offset, p.numel()).view(p.sizes());
    grad_views_[i] = at::Tensor();
  }
}

const at::Tensor& Reducer::grad_view_locked(int64_t index) {
  auto& handle = grad_views_[index];
  const auto& view = views_[index];
  // Made once per layout; again only after `p.grad.data = t` (or `.set_()`) moved it: then it
  // no longer shows the bucket slot, and the reducer's own view never moved.
  if (!handle.defined() || handle.data_ptr() != view.data_ptr() || handle.sizes() != view.sizes() ||
      handle.strides() != view.strides() || handle.scalar_type() != view.scalar_type()) {
    // Made with gradients enabled (it may be made inside backward), as the views themselves
    // were: an ordinary view of the bucket, like torch DDP's, for in-place use of .grad.
    c10::AutoGradMode grad_mode(true);
    handle = view.alias();
  }
  return handle;
}

void Reducer::ensure_private_locked(int64_t bucket_index, bool lent_counts) {
  auto& bucket = buckets_[bucket_index];
  if (passthrough_) return;
  if (gradient_as_bucket_view_) {
    // .grad is the bucket by design; only join()'s shadow reduction must leave it as it is.
    if (lent_counts && grad_shows_bucket_locked(bucket_index)) relocate_bucket_locked(bucket_index);
    return;
  }
  // A check by the backward holds until the next forward; join()'s shadow reductions come
  // without forwards, so each checks again.
  if (bucket.private_checked && !lent_counts) return;
  bucket.private_checked = !lent_counts;
  // An alias lent from this memory, still alive but no longer its parameter's .grad, is held
  // by someone; a tensor into this memory that is neither ours nor a lent alias (a slice of an
  // old .grad, its storage) adds a reference to the storage. (A lent alias is never
  // dereferenced here: another thread may release it; only its liveness and address are read.)
  bool held = false;
  int64_t alive = 0;
  const auto* memory = bucket.buffer.storage().unsafeGetStorageImpl();
  for (const int64_t i : bucket.params) {
    const auto& grad = params_[i].grad();
    const bool expired = lent_[i].expired();
    const bool attached = !expired && grad.defined() && grad.unsafeGetTensorImpl() == lent_[i]._unsafe_get_target();
    // a .grad over this memory that is not its parameter's lent alias (another parameter's,
    // assigned to this one too): the result written into one would overwrite the other's slot
    held = held || (!attached && grad.defined() && grad.has_storage() &&
                    grad.storage().unsafeGetStorageImpl() == memory);
    if (expired) continue;
    alive += lent_from_[i] == memory;
    held = held || (lent_from_[i] == memory && (!attached || lent_counts));
  }
  held = held || static_cast<int64_t>(bucket.buffer.storage().use_count()) > bucket.storage_refs + alive;
  if (held) relocate_bucket_locked(bucket_index);
}

bool Reducer::grad_shows_bucket_locked(int64_t bucket_index) const {
  const auto& storage = buckets_[bucket_index].buffer.storage();
  for (const int64_t i : buckets_[bucket_index].params) {
    const auto& grad = params_[i].grad();
    if (grad.defined() && grad.has_storage() && grad.storage().is_alias_of(storage)) return true;
  }
  return false;
}

void Reducer::relocate_bucket_locked(int64_t bucket_index) {
  // New memory for the bucket; the old one stays with whoever holds it, with the values torch's
  // separate .grad tensors would have kept. Gradients accumulated in lent views (.grad still
  // the old view) are copied in by their hooks, as any gradient outside the bucket is.
  auto& bucket = buckets_[bucket_index];
  const auto& first = params_[bucket.params.front()];
  const bool last = bucket_index + 1 == static_cast<int64_t>(buckets_.size());
  const auto total = bucket.buffer.numel();
  bucket.wire = at::Tensor();
  bucket.comm = at::Tensor();
  bucket.header = 0;
  allocate_bucket_locked(bucket, first, total, last);
  make_views_locked(bucket_index);
  bucket.storage_refs = bucket.buffer.storage().use_count();
  ++relocations_;
}

namespace {

// Heads the bucket order on the wire, with the parameter count: a rank that receives another
// collective's data in its place (a forward run on some ranks only) says so instead of reading
// it as parameter indices.
constexpr int64_t kOrderTag = 0x6664647062756b74;  // "fddpbukt"

std::string out_of_step_message(int rank) {
  return "DDPWrapper: rank " + std::to_string(rank) + " expected rank 0's bucket order (the bucket rebuild "
         "at the first reducing forward after the first backward) and received the data of another "
         "collective: the ranks' forwards are out of step. Most often a forward of the wrapper ran on "
         "some ranks only, e.g. an evaluation on rank 0: each forward may broadcast rank 0's buffers "
         "(broadcast_buffers=True) and rebuild the buckets, so every rank must run the same forwards "
         "(torch DDP requires it too). For work on one rank alone, call the wrapped module itself "
         "(model.module(...)), or run the evaluation on every rank.";
}

}  // namespace

std::vector<int64_t> Reducer::rank0_order(const std::vector<int64_t>& order) {
  const int64_t n = static_cast<int64_t>(order.size());
  std::vector<int64_t> wire{kOrderTag, n};
  wire.insert(wire.end(), order.begin(), order.end());
  const auto device = params_[buckets_.at(0).params.at(0)].device();
  std::vector<at::Tensor> agreed{at::tensor(wire, at::TensorOptions().dtype(at::kLong)).to(device)};
  if (process_group_->getRank() != 0) agreed[0].fill_(-1);  // nothing of this rank's own survives a short message
  c10d::BroadcastOptions opts;
  opts.rootRank = 0;
  process_group_->broadcast(agreed, opts)->wait();
  const auto host = agreed[0].cpu();
  const int64_t* got = host.data_ptr<int64_t>();
  if (got[0] != kOrderTag || got[1] != n) {
    const std::string message = out_of_step_message(process_group_->getRank());
    if (desync_handler_) desync_handler_(message);
    TORCH_CHECK(false, message);
  }
  return std::vector<int64_t>(got + 2, got + 2 + n);
}

bool Reducer::rebuild_buckets_in_arrival_order() {
  diag::PhaseScope rebuilding(diag::Phase::kRebuild);
  const int64_t n = static_cast<int64_t>(params_.size());
  std::vector<int64_t> order = arrival_order();
  std::vector<char> seen(params_.size(), 0);
  for (int64_t i : order) seen[i] = 1;
  for (int64_t i = 0; i < n; ++i)
    if (!seen[i]) order.push_back(i);
  if (process_group_->getSize() > 1) order = rank0_order(order);
  auto planned = rebuilt_buckets(params_, order, options_);
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(!callback_queued_, "DDPWrapper: cannot rebuild buckets while a backward pass is reducing");
  bool same = planned.size() == buckets_.size();
  for (size_t b = 0; same && b < planned.size(); ++b) same = planned[b] == buckets_[b].params;
  if (same) return false;
  install_buckets_locked(planned);
  return true;
}

}  // namespace fastddp::reducer
