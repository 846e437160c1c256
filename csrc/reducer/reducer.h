// The DDPWrapper reducer: gradients are written into flat per-bucket buffers by C++ hooks on
// the parameters' AccumulateGrad nodes, each full bucket is all-reduced asynchronously through
// a c10d ProcessGroup while backward continues, and an autograd-engine callback waits for the
// reductions at the end of backward.
#pragma once

#include "reducer/average.h"
#include "reducer/bucket_visitor.h"
#include "reducer/fingerprint.h"
#include "reducer/iteration_stats.h"
#include "reducer/options.h"
#include "reducer/shm_allreduce.h"

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>
#include <ATen/core/ivalue.h>
#include <ATen/ops/view_as_real.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>

#include <c10/core/Event.h>

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace fastddp::reducer {

struct Bucket {
  std::vector<int64_t> params;   // indices into the reducer's parameter list
  std::vector<int64_t> offsets;  // element offset of each parameter in `buffer`
  at::Tensor buffer;             // flat gradients, the parameters' dtype and device
  at::Tensor comm;               // flat buffer in the communication dtype (compression)
  // The last bucket on the process group (CPU, fp32/fp64, uncompressed) carries the fingerprints
  // in `header` elements after the gradients: `wire` is gradients + header, `buffer` its prefix.
  at::Tensor wire;
  int64_t header = 0;
  bool shm = false;              // reduced through shared memory (else through c10d)
  bool direct = false;           // this backward: some gradients are reduced in place in .grad (direct_)
  int64_t pending = 0;           // parameters not yet ready in this backward
  // Batched copies: parameters whose gradient waits in .grad to be copied into the bucket
  // with one multi-tensor copy when the bucket is full (instead of one copy each).
  std::vector<int64_t> deferred;
  c10::intrusive_ptr<c10d::Work> work;
  // With a communication hook: the hook's Future for this bucket (instead of `work`).
  c10::intrusive_ptr<c10::ivalue::Future> hook_future;
  // The shared-memory reduction also summed the squares of the result (a ShmWork), for the
  // visitors that want them, instead of another pass over the bucket.
  bool squares_in_work = false;
  // Lent views (gradient_as_bucket_view=False): TensorImpls that reference the buffer's storage
  // when nobody outside holds a part of it (the buffer, the wire, the views); checked once per
  // reduced backward before the bucket is written (`private_checked`).
  int64_t storage_refs = 0;
  bool private_checked = false;
  std::chrono::steady_clock::time_point launched;
  double last_allreduce_ms = -1;  // launch to completion seen by the waiting thread
};

// The flat real view of a complex bucket (twice the elements, the real dtype), which is what
// torch DDP compresses, hands to a communication hook and reduces; any other tensor itself.
inline at::Tensor real_view(const at::Tensor& flat) {
  return flat.is_complex() ? at::view_as_real(flat).view({-1}) : flat;
}

class Reducer : public std::enable_shared_from_this<Reducer> {
 public:
  // Plans the initial buckets from `options` (reverse registration order). With
  // options.shm_allreduce set this is a collective over the group (the shared-memory handshake).
  Reducer(std::vector<at::Tensor> params, std::vector<std::string> names,
          c10::intrusive_ptr<c10d::ProcessGroup> process_group, const ReducerOptions& options,
          std::unique_ptr<c10d::CommHookInterface> comm_hook = nullptr);

  // torch DDP's register_comm_hook contract: each full bucket, in index order, is handed to the
  // hook as a c10d::GradBucket holding the undivided local sum of gradients; the hook returns
  // a Future of the reduced flat tensor, which the end of backward waits for and copies into
  // the bucket. The hook runs in every reduced backward, also in a world of one.
  bool has_comm_hook() const { return comm_hook_ != nullptr; }

  // A world of one without comm_dtype has nothing to reduce: with single_rank_passthrough the
  // gradients stay where autograd put them (no copy into the buckets, no copy back), exactly
  // the bare model's; the hooks still check what torch DDP checks.
  bool passthrough() const { return passthrough_; }
  // Whether the buckets hold the gradients now: param.grad are views into bucket_buffers()
  // (gradient_as_bucket_view, or every view lent; not a world of one) since the last reduced backward, and no later
  // backward (no_sync(), a second backward) put a gradient anywhere else. The buffers can then
  // stand in for the gradients.
  bool grads_in_buckets() const { return buckets_hold_grads_; }
  const ReducerOptions& options() const { return options_; }
  bool batch_copies() const { return batch_copies_; }

  // "shm" when the buckets are reduced through shared memory (co-located CPU ranks), else
  // "c10d"; transport_note() says why shared memory is not used (empty when it is).
  std::string transport() const { return shm_ ? "shm" : "c10d"; }
  std::string transport_note() const { return transport_note_; }

  // With the shared-memory transport: copies group rank 0's `tensors` (module buffers) into
  // every rank's and returns true; false (nothing done) on the c10d transport, or when the
  // tensors are not strided CPU ones or no longer fit options().shm_broadcast_bytes.
  bool broadcast_buffers(const std::vector<at::Tensor>& tensors);

  // Installs the AccumulateGrad post hooks; called once right after construction, when
  // shared_from_this() is usable (the hooks hold only a weak reference to the reducer).
  void register_hooks();
  // torch DDP's _remove_autograd_hooks(): takes the hooks off the gradient accumulators, so
  // this reducer sees no later gradient (a new wrapper of the same module trains alone).
  void remove_hooks();

  // Called by every forward that builds a graph. sync=true (outside no_sync()): the next
  // backward reduces; with find_unused_parameters, `outputs` are searched for the parameters
  // this iteration reaches. sync=false (inside no_sync()) is only counted for the fingerprints:
  // like torch DDP, it leaves a reduction an earlier forward asked for in place.
  void prepare_for_backward(const std::vector<at::Tensor>& outputs, bool sync);
  // Another reducer hooking one of this one's parameters was armed for a backward (claims.h):
  // a reduction armed here whose backward has not started is dropped (its gradients are that
  // reducer's to reduce); static_graph's is kept.
  void yield_unstarted_reduction();
  ~Reducer();
  // Called at the start of every forward, before its collectives: a reduction left to an
  // outer backward that brought no more gradients (see finalize.cpp) is finished here, which
  // reports the parameters that got none (torch DDP reports them at the next forward too); one
  // whose backward raised (with static_graph: one that stopped short of the first iteration's
  // gradients) is finished for the other ranks' sake and refused, now and after.
  void finish_unfinished_reduction();
  // torch DDP's reducer._delay_all_reduce(): reduces static_graph's armed first iteration now,
  // with the gradients its backward brought (the rest count as unused from then on). Lightning
  // calls it after the first manual backward, which runs inside the module's forward and so
  // never reaches the outputs that would finalise it.
  void delay_all_reduce();

  std::vector<at::Tensor> bucket_buffers() const;
  // The buckets made to hold the gradients, for a consumer of the flat buffers
  // (DDPWrapper.bucket_buffers()): the gradients the last backward reduced in place in .grad
  // (shared memory, see reduces_in_place_locked) are copied into their slots, .grad lent from
  // there where nobody else holds it, and every later backward copies them into the buckets.
  void hold_grads_in_buckets();

  // Uneven inputs (DDPWrapper.join()): on a rank that ran out of data, issues the collectives
  // of one reduced backward (every bucket's all-reduce in index order, then the used-parameter
  // map with find_unused_parameters) with zero contributions (the used map: torch's, see
  // join.cpp), so the ranks still training are not left waiting. Bucket buffers receive the
  // others' result; .grad is not reassigned.
  void shadow_reduction();

  // join(divide_by_initial_world_size=False): the coming reduction averages the gradients over
  // `divisor` ranks (those still training) instead of the world size; once, then the world size
  // again (average.h).
  void set_reduction_divisor(int64_t divisor);

  // Order in which gradients became ready in the reduced backward the rebuild follows (torch
  // DDP's: the first one; with static_graph the second, each parameter at its last gradient);
  // empty before it, and always when the layout is never rebuilt (layout.h). Parameters that
  // were ready before backward, i.e. unused ones, are not in it.
  std::vector<int64_t> arrival_order() const;

  // Reduced backwards finished so far.
  int64_t reductions() const;

  // torch DDP's reducer._ddp_graph_static(): with find_unused_parameters (and no static_graph),
  // whether every reducing forward so far left the same parameters unused; true otherwise.
  bool graph_static() const;

  // The last reducing backward's phase times and bucket count (iteration_stats.h).
  IterationStats iteration_stats() const;

  // The last error this reducer raised of those torch DDP's logger keeps (its REDUCER_CHECKs:
  // a changed static graph, an unfinished reduction, parameters without a gradient); empty if none.
  std::string logged_error() const;

  // torch DDP's rebuild: re-plans the buckets in the order the gradients arrived (group rank
  // 0's order, broadcast over the group so every rank builds the same buckets; parameters that
  // never arrived follow in registration order).
  // A collective; every rank calls it in the same iteration. Existing gradients move into the
  // new buffers; not allowed while a backward is reducing. Returns whether the layout changed.
  bool rebuild_buckets_in_arrival_order();

  // Registers a visitor that sees every bucket of each reduced backward once its values are
  // final (see bucket_visitor.h), in bucket order, as the reductions complete.
  void add_bucket_visitor(std::shared_ptr<BucketVisitor> visitor);

  std::vector<std::vector<int64_t>> bucket_indices() const;
  std::vector<double> bucket_allreduce_ms() const;
  std::vector<bool> bucket_shm() const;  // per bucket: reduced through shared memory
  // Buckets moved to new memory because a lent gradient view was held across a backward
  // (gradient_as_bucket_view=False; 0 in a loop that keeps no .grad).
  int64_t relocations() const;

  // Whether reductions carry fingerprints (options().fingerprint, more than one rank, no hook).
  bool fingerprinting() const { return fingerprint_; }
  // Raises the error for a desynchronisation found by the fingerprints (message given); the
  // bindings install one that raises fastddp.DesyncError. Default: a c10::Error.
  void set_desync_handler(std::function<void(const std::string&)> handler);

 private:
  void install_buckets_locked(const std::vector<std::vector<int64_t>>& bucket_indices);
  // Group rank 0's bucket order (a broadcast), so every rank plans the same buckets and issues
  // the same collectives; a rank that receives something else raises DesyncError.
  std::vector<int64_t> rank0_order(const std::vector<int64_t>& order);
  void move_lent_grads_locked();  // a rebuild's lent .grad aliases that nobody else holds
  // gradient_as_bucket_view=False lends the views as .grad when nobody else can tell (see
  // lend_or_copy_locked) and moves a bucket to new memory before writing it when a lent view,
  // or any tensor into its memory, is still held elsewhere (torch's copies stay intact there).
  // `lent_counts`: whether a view .grad still holds counts as held (join()'s shadow reduction
  // leaves .grad as is, with gradient_as_bucket_view=True too).
  void ensure_private_locked(int64_t bucket_index, bool lent_counts = false);
  bool grad_shows_bucket_locked(int64_t bucket_index) const;  // some .grad views its memory
  void relocate_bucket_locked(int64_t bucket_index);
  // End of backward, gradient_as_bucket_view=False: parameter `index`'s .grad becomes its view
  // when that is indistinguishable from torch's copy (.grad undefined, or a tensor only the
  // parameter holds, of the view's layout, outside autograd); otherwise the result is copied
  // into .grad. Returns whether .grad is the view.
  bool lend_or_copy_locked(int64_t index);
  // Whether `grad` is a tensor only its parameter holds, laid out as `view`, outside autograd.
  static bool unshared_like(const at::Tensor& grad, const at::Tensor& view);
  // Whether an alias of `view` shows what `grad` shows: dtype, device, sizes, strides, no autograd.
  static bool plain_like(const at::Tensor& grad, const at::Tensor& view);
  void lend_locked(int64_t index);  // .grad = a new alias of the slot, tracked in lent_
  // The flat buffers of a bucket whose parameters are like `first`, `total` elements: shape
  // only (a passthrough world of one), with the fingerprint header (`last` c10d bucket), or
  // plain, plus the compressed wire copy with comm_dtype.
  void allocate_bucket_locked(Bucket& bucket, const at::Tensor& first, int64_t total, bool last);
  bool shm_sums_as_c10d(at::ScalarType dtype) const;  // shared memory gives the process group's bits
  void make_views_locked(int64_t bucket_index);  // its parameters' gradient views into it
  // Start of a backward (prepare_for_backward): static_graph's first reduction never finalised
  // (its backward did not pass through the forward's outputs) is refused.
  void refuse_incomplete_static_locked() const;
  // failed_backward_ is set: issue the rest of the reduction (the other ranks' fingerprint
  // check names what this rank lacks), then raise failed_backward_.
  void finish_failed_reduction_locked();
  void reset_for_backward_locked();  // a reducing forward: buckets pending, no collective in flight
  // static_graph: the first iteration hooks the outputs' grad_fn to finalize; later ones mark
  // the parameters the first found unused and count down each one's hooks.
  void prepare_static_locked(const std::vector<at::Tensor>& outputs);
  // Plain and find_unused_parameters modes: a pre-hook on each output's grad_fn counts the
  // outputs no backward has reached yet (see awaits_later_backward_locked).
  void watch_outputs_locked(const std::vector<at::Tensor>& outputs);
  void output_reached(uint64_t forward);
  int64_t wire_bytes() const;  // gradient bytes one backward reduces, in the wire dtype
  void mark_ready(int64_t index);
  void mark_ready_locked(int64_t index);  // mark_ready's work; its errors are kept in backward_error_
  std::string failed_backward_cause_locked() const;  // why a backward stopped: its error, if the reducer's
  // A gradient that arrived while no reduction is expected (no_sync(), or no forward before).
  void note_gradient_outside_reduction_locked(int64_t index);
  // A gradient that requires grad (backward(create_graph=True)): torch's warning, one per backward.
  void check_create_graph_locked(int64_t index);
  // static_graph: counts the arrival; whether it was the parameter's last in this backward.
  bool static_arrival_completes_locked(int64_t index);
  // Rethrows a failed collective's error as a DistBackendError that names this rank and the
  // collective, with the watchdog's report of what every rank was doing (when one runs).
  [[noreturn]] void fail_collective(const std::string& what, const std::exception& error) const;
  // Waits for bucket `index`'s collective, in the watchdog's all-reduce phase; a failure goes
  // through fail_collective.
  void wait_bucket_locked(c10d::Work& work, int64_t index) const;
  void mark_unused_locked(int64_t index);
  // The parameters the reducing forward did not reach (find_unused_parameters; static_graph after
  // its first iteration) are marked ready when the backward starts, at its first gradient, as
  // torch DDP's reducer does: each contributes the .grad it holds then (zero or None after a
  // zero_grad() between forward and backward), not the one it held at the forward.
  void mark_pending_unused_locked();
  // Moves the parameter's .grad into its bucket slot divided by the world size (zero if None),
  // or marks it to be reduced where it is (reduces_in_place_locked). grad_copy.cpp.
  void copy_grad_to_bucket_locked(int64_t index);
  // Whether parameter `index`'s gradient is divided by the world size as it enters its slot.
  bool divides_into_bucket_locked(int64_t index);
  // Copies .grad into `view` (its slot), divided when `divide`; then settle_copied_grad_locked.
  void copy_into_slot_locked(int64_t index, at::Tensor& view, bool divide);
  // After the copy into `view`: .grad becomes the slot (gradient_as_bucket_view, or lent when
  // autograd made it in this backward and nobody else holds it).
  void settle_copied_grad_locked(int64_t index, const at::Tensor& view);
  // Whether `grad` (parameter `index`'s) is reduced in place in its own memory instead of being
  // copied into its bucket slot first: a large dense gradient laid out as the slot, in a bucket
  // the shared-memory transport reduces uncompressed, with nothing that reads the flat buffers
  // (no communication hook, no visitor, no bucket_buffers() consumer), averaged by the sum
  // (over the world size: see wire_scaling_locked).
  bool reduces_in_place_locked(int64_t index, const at::Tensor& grad, const at::Tensor& view) const;
  // The memory of a bucket with gradients reduced in place: runs of the flat buffer between
  // them, and the gradients themselves; `holders` keep it alive.
  std::vector<ShmPiece> direct_pieces_locked(const Bucket& bucket, std::vector<at::Tensor>* holders) const;
  void launch_ready_buckets_locked();
  void flush_deferred_locked(Bucket& bucket);
  // How the shared-memory sum scales the bucket's values as it reads them (none: they were
  // averaged as they entered the bucket, or the wire is not shared memory).
  Scaling wire_scaling_locked(const Bucket& bucket) const;
  // Issues the bucket's all-reduce on its wire tensor (bucket.comm if compressed, else
  // bucket.buffer): shared memory or c10d, with the division the transport folds in.
  c10::intrusive_ptr<c10d::Work> allreduce_wire_locked(Bucket& bucket, bool squares,
                                                       const Fingerprint* fingerprint = nullptr);
  // Fingerprints (fingerprint.cpp). The fingerprint of the reduction whose last bucket launches
  // now; it counts the reduction.
  Fingerprint next_fingerprint_locked();
  // Issues the fingerprint beside the last bucket: in the shared-memory slot of that bucket's
  // collective, or as a small MAX all-reduce on the process group after it.
  c10::intrusive_ptr<c10d::Work> launch_last_bucket_locked(Bucket& bucket, bool squares, const Fingerprint& fp);
  // After the reduction's collectives were issued: whether the ranks' fingerprints differ (on
  // CUDA, those of the previous reduction: its result is read from pinned memory, no sync).
  bool fingerprint_mismatch_locked();
  // Gathers every rank's detail (a collective, on the error path only) and raises.
  [[noreturn]] void raise_desync_locked(const Fingerprint& mine);
  int64_t layout_hash_locked() const;
  // A reducing forward: the no_sync() micro-steps since the last reduction and its autocast state
  // go into the next fingerprint.
  void note_reducing_forward_locked();
  // find_unused_parameters: the parameters the reducing forward did not reach.
  void note_unused_locked(const std::vector<char>& reached);
  void note_graph_static_locked();
  // The error for parameters without a gradient at the end of backward (empty: none); notes
  // them for the fingerprint.
  std::string missing_gradients_locked(bool at_next_forward);
  // End of a reduction with fingerprints: on a mismatch, or with `missing_error`, completes
  // every collective of the reduction (all ranks issued them) and raises.
  void check_fingerprints_locked(const std::string& missing_error);
  // Elements of the fingerprint header the last bucket carries on the process group (0: none,
  // the fingerprints travel in their own MAX all-reduce).
  int64_t fingerprint_header_elems(const at::Tensor& first, bool compress) const;
  // Hands bucket `index` to the communication hook; returns the hook's Future.
  c10::intrusive_ptr<c10::ivalue::Future> run_comm_hook_locked(int64_t index);
  // Waits for the hook's Future of bucket `index` and copies its value into the bucket buffer.
  void take_comm_hook_result_locked(int64_t index);
  // Sums the per-parameter "has a gradient" flags over the ranks; int32 on the CPU.
  at::Tensor allreduce_used_locked(const std::vector<char>& used_here);
  // End of a reduced backward (finalize.cpp), in the order it runs them:
  void finalize_backward();
  // at_next_forward: no backward brought the missing gradients; the report starts with torch
  // DDP's sentence for that moment.
  // `write_grads`: false for a reduction a failed backward left (its collectives are issued for
  // the other ranks; .grad stays as the script left it, as torch DDP leaves it).
  void finalize_locked(bool at_next_forward = false, bool write_grads = true);
  // The callback ran at the end of a reentrant backward nested in an outer one that brings
  // the rest of this reduction's gradients (see finalize.cpp).
  bool continued_by_outer_backward_locked() const;
  // The backward ended with gradients missing while some output of the forward is still to be
  // backwarded through (several backward passes per forward, as torch DDP allows).
  bool awaits_later_backward_locked() const;
  // static_graph's first iteration: what the hooks saw becomes the graph (unused parameters
  // marked, the used ones' gradients moved into their buckets).
  void settle_static_first_locked();
  // Which parameters were used on any rank (an all-reduce with find_unused_parameters or in
  // static_graph's first iteration; static_graph's kept map after); undefined: all of them.
  at::Tensor global_used_locked(bool static_first);
  // Keeps an all-reduced used map as the map a joined rank sends (join.cpp).
  void remember_global_used_locked(const at::Tensor& global_used);
  // Waits for every bucket's reduction in index order and makes it final (a compressed
  // bucket widened, join's scale applied); visitors read each one as it completes.
  void finish_buckets_locked();
  // Puts the reduced values into .grad: the bucket views themselves (gradient_as_bucket_view),
  // else each lent or copied (lend_or_copy_locked); parameters unused on every rank keep theirs.
  void write_grads_locked(const at::Tensor& global_used);
  void queue_finalize();         // from the outputs' grad_fn pre-hook (static_graph, first iteration)
  void queue_finalize_locked();  // end-of-backward callback on the current graph task
  const at::Tensor& bucket_view(int64_t index) const { return views_[index]; }
  // Whether `grad` is parameter `index`'s slot itself: its memory, sizes and strides (a tensor
  // over another slot of the same bucket, e.g. one .grad assigned to two parameters, shares
  // the storage but is not the slot).
  bool is_slot(const at::Tensor& grad, int64_t index) const {
    const auto& view = views_[index];
    return grad.is_alias_of(view) && grad.storage_offset() == view.storage_offset() &&
           grad.sizes() == view.sizes() && grad.strides() == view.strides();
  }
  // gradient_as_bucket_view=True: the tensor handed out as parameter `index`'s .grad, a view of
  // the same bucket memory as bucket_view(index) but its own TensorImpl (made again when
  // `p.grad.data = t` moved it elsewhere), so a rebinding never moves the reducer's view.
  const at::Tensor& grad_view_locked(int64_t index);
  bool reduce_avg_locked();
  void invalidate_visitors_locked();
  bool visitors_want_squares_locked() const;

  using NodePtr = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  std::vector<Bucket> buckets_;
  std::vector<int64_t> param_bucket_;     // parameter -> bucket
  std::vector<int64_t> param_slot_;       // parameter -> position inside its bucket
  std::vector<NodePtr> grad_accumulators_;  // kept alive so our hooks stay installed
  std::vector<uintptr_t> hook_keys_;        // each accumulator's hook, for remove_hooks()
  c10::intrusive_ptr<c10d::ProcessGroup> process_group_;
  ReducerOptions options_;
  bool gradient_as_bucket_view_;
  bool passthrough_ = false;
  // One multi-tensor copy per bucket (at::_foreach_copy_) instead of a copy per gradient: on
  // a GPU each copy is a kernel launch of a few microseconds of host time.
  bool batch_copies_ = false;
  bool find_unused_;
  // static_graph: the first iteration counts how often each parameter's gradient arrives
  // (reentrant backward passes can reach one several times) and reduces at the end; later
  // iterations expect the same counts, so a parameter is ready at its last arrival.
  bool static_graph_;
  bool static_first_iteration_ = true;
  std::vector<int64_t> hooks_per_backward_;
  std::vector<int64_t> hooks_left_;
  at::Tensor static_global_used_;  // int32 per parameter, from the first iteration
  std::optional<at::ScalarType> comm_dtype_;
  Average average_;  // each rank's gradient scaled before the sum (average.h)
  // NCCL averages in the collective itself (ReduceOp::AVG): no division pass per parameter.
  // Decided at the first launch; never with comm_dtype (pre-division guards fp16 overflow).
  std::optional<bool> reduce_avg_;
  std::vector<at::Tensor> views_;  // parameter -> its view of the bucket buffer (cached)
  std::vector<at::Tensor> grad_views_;  // parameter -> its .grad handle (gradient_as_bucket_view)
  // Co-located CPU ranks: the wire buffers (bucket.comm if defined, else bucket.buffer) are
  // summed through this shared-memory transport instead of c10d.
  std::shared_ptr<ShmAllreduce> shm_;
  std::string transport_note_;
  std::unique_ptr<c10d::CommHookInterface> comm_hook_;

  mutable std::mutex mutex_;
  bool expect_sync_ = false;      // a forward asked for a reduction in the coming backward
  bool callback_queued_ = false;  // finalize_backward is queued on the autograd engine
  bool hooks_seen_ = false;       // a gradient arrived since the last prepare_for_backward
  uint64_t forward_ = 0;          // reducing forwards so far: a stale graph's output hook is ignored
  int64_t outputs_unreached_ = 0;  // the reducing forward's outputs (grad_fn) no backward reached yet
  std::string failed_backward_;   // set once a backward raised mid-reduction: every forward refuses
  int64_t next_launch_ = 0;       // buckets launch strictly in index order
  std::vector<char> ready_;
  std::vector<char> locally_used_;  // since the last reduction, no_sync() backwards included
  std::vector<char> last_global_used_;  // the last used-map all-reduce's result on this rank
  std::vector<int64_t> arrival_;
  bool record_arrival_ = false;  // layout.h's rebuilds_buckets(); until one reduced backward is recorded
  int64_t reductions_ = 0;       // reduced backwards finished (join()'s stand-ins not counted)
  IterationStats stats_;          // the current (or last) reducing backward's, see iteration_stats()
  int64_t grads_requiring_grad_ = 0;  // this backward's gradients made with create_graph=True
  std::string logged_error_;          // see logged_error()
  std::string backward_error_;        // the error this reducer raised in the current backward, if any
  [[noreturn]] void fail_logged_locked(const std::string& message);  // raise it, and keep it
  bool buckets_hold_grads_ = false;  // see grads_in_buckets()
  int64_t relocations_ = 0;          // buckets moved by ensure_private_locked
  // gradient_as_bucket_view=False: the tensor last lent to each parameter as .grad (an alias of
  // its view; the views themselves are never handed out), to tell whether anyone still holds it.
  std::vector<c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>> lent_;
  std::vector<const c10::StorageImpl*> lent_from_;  // the bucket memory each was lent from (compared only)
  // .grad was unset at the reducing forward: a gradient the hook finds was made by autograd in
  // this backward (a new tensor; its memory is shared at most with the engine's own buffer), so
  // the hook can lend the slot at once and free it, instead of holding it to the end.
  std::vector<char> unset_at_forward_;
  // This backward: the parameter's .grad is reduced in place (its bucket slot is not written).
  std::vector<char> direct_;
  bool views_but_direct_ = false;    // the last write_grads_locked: all_views over the others
  bool buckets_requested_ = false;   // hold_grads_in_buckets() ran: no gradient reduced in place
  std::vector<std::shared_ptr<BucketVisitor>> visitors_;

  // Fingerprints (see fingerprint.h and options.h).
  bool fingerprint_ = false;
  int64_t fp_reductions_ = 0;       // reductions taken part in (stand-ins for joined ranks too)
  int64_t fp_collectives_ = 0;      // bucket collectives issued
  int64_t fp_layout_ = 0;           // hash of the installed bucket layout
  // no_sync() micro-steps since the last reduction: forwards under no_sync() whose backward
  // ran (a forward alone, e.g. for logging, is not one); counted at that backward's first hook.
  int64_t nosync_steps_ = 0;
  bool nosync_forward_pending_ = false;  // a no_sync() forward whose backward has not run yet
  int64_t fp_nosync_ = 0;           // ... captured by the reducing forward
  int64_t fp_autocast_ = 0;         // the reducing forward's autocast state
  int64_t fp_unused_ = 0;           // hash of the parameters the reducing forward did not reach
  int64_t fp_missing_ = 0;          // hash of the parameters without a gradient (finalize)
  std::vector<char> unused_now_;    // find_unused_parameters: not reached by the reducing forward
  std::vector<int64_t> unused_pending_;  // ... and not yet marked ready (mark_pending_unused_locked)
  std::vector<char> first_unused_;  // the first reducing forward's unused_now_ (graph_static())
  bool graph_static_ = true;        // every search since found first_unused_ again
  std::vector<char> missing_now_;   // requiring grad, yet no gradient in this backward
  Fingerprint fp_sent_;             // this rank's fingerprint of the current reduction
  at::Tensor fp_wire_;              // process-group transport: [f, -f], all-reduced with MAX
  c10::intrusive_ptr<c10d::Work> fp_work_;
  c10::intrusive_ptr<c10d::Work> fp_shm_work_;  // shared memory: the last bucket's collective
  c10::intrusive_ptr<c10d::Work> fp_header_work_;  // process group, header in the last bucket
  // CUDA: the previous reduction's result, copied to pinned memory behind an event.
  at::Tensor fp_host_;
  std::optional<c10::Event> fp_event_;
  Fingerprint fp_host_sent_;
  Fingerprint fp_reported_;         // this rank's fingerprint of the mismatched reduction
  std::function<void(const std::string&)> desync_handler_;
};

}  // namespace fastddp::reducer
