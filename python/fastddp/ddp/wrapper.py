"""``fastddp.DDPWrapper``: the Module face of the drop-in for
``torch.nn.parallel.DistributedDataParallel`` (constructor, forward, ``no_sync``, pickling). Its
parts live beside it: argument checks (checks.py), the reducer and its buckets (buckets.py),
communication hooks (comm_hooks.py), uneven inputs (join.py) and the broadcast of parameters
and buffers (broadcast.py)."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable
from torch.nn.parallel import DistributedDataParallel

from .. import diag
from . import checks, rank_check, sparse
from .broadcast import ModuleStateSync
from .buckets import Buckets, bucket_limits_mb
from .comm_hooks import CommHooks
from .inputs import OutputSink, TorchInputMethods, find_tensors, to_device
from .join import UnevenInputs
from .logging_data import RunLog
from .pickling import Pickling
from .torch_class import TorchAttributes, refuse_torch_internals


@refuse_torch_internals
class DDPWrapper(Buckets, CommHooks, UnevenInputs, ModuleStateSync, Pickling, TorchInputMethods,
                 TorchAttributes, DistributedDataParallel):
    """Distributed data parallelism with the constructor and behaviour of
    :class:`torch.nn.parallel.DistributedDataParallel`.

    Replace ``DistributedDataParallel(model, device_ids=[rank])`` with
    ``DDPWrapper(model, device_ids=[rank])``. ``.module``, ``.no_sync()``, ``forward`` and the
    ``state_dict`` keys (``module.``-prefixed) are the same, so checkpoints move between the two.
    It is a subclass of torch's class, so ``isinstance(model, DistributedDataParallel)`` holds
    and code that branches on it takes torch DDP's branch; torch DDP's constructor does not run,
    and its internal methods raise ``NotImplementedError`` (see ``torch_class.py``).

    Extras: ``shm_allreduce`` (default None = auto): when every rank of the group runs on this
    host with CPU parameters, the buckets are reduced through one shared-memory mapping (each
    rank sums its slice of every chunk from the others' staging slots) instead of being sent
    through gloo's TCP loopback (fp32/fp64 buckets, compressed ones, and bf16/fp16 ones at two
    ranks, where the sum has gloo's bits; at more ranks those stay on the process group so
    their rounding is torch DDP's), and the
    per-forward buffer broadcast copies rank 0's buffers through the same mapping. Set
    ``FASTDDP_SHM_ALLREDUCE=0`` or pass False to use the process group's backend, True to
    require shared memory. :attr:`transport` says which one is in use.
    ``comm_dtype=torch.bfloat16|torch.float16`` all-reduces the gradients in that dtype
    (they are divided by the world size before the cast, so the sum cannot overflow, and are
    copied back into the parameters' dtype); :meth:`bucket_report`; :meth:`bucket_buffers`
    (the flat gradient buffers, for :class:`fastddp.GradScaler`'s ``grads=``).
    :meth:`register_comm_hook` takes any torch DDP communication hook (PowerSGD, custom Python
    hooks: called per bucket through torch's own hook adapter); torch's ``allreduce_hook``,
    ``fp16_compress_hook`` and ``bf16_compress_hook`` run in C++ (mapped onto ``comm_dtype``).

    ``gradient_as_bucket_view`` defaults to False, with torch's meaning: each ``.grad`` behaves
    as a tensor of its own (a kept gradient keeps its values; an assigned one stays ``.grad``).
    Where nobody else holds it, ``.grad`` is an alias of its bucket all the same; a bucket
    moves to new memory before a backward would overwrite a kept gradient
    (``bucket_report()["relocations"]``). With True, ``.grad`` is the bucket view itself. New
    gradients are copied into their buckets; on a GPU with one multi-tensor copy per full
    bucket (``FASTDDP_BATCH_GRAD_COPIES=0|1`` forces one copy per gradient / batched copies).
    On the shared-memory transport a gradient of 64 KiB or more is reduced in place in
    ``.grad`` instead (its own memory, as under torch DDP), unless something reads the flat
    buffers (a communication hook, compression, a bucket visitor, :meth:`bucket_buffers`).

    ``process_group`` may be any ``ProcessGroup`` (a ``dist.new_group`` subgroup, or one built on
    a store without a default group): every collective goes to it, with its own ranks.
    Parameters of ``nn.Embedding``/``nn.EmbeddingBag(sparse=True)`` get sparse gradients, which
    stay out of the buckets and are all-reduced as torch DDP does (see sparse.py).

    In a world of one (and no ``comm_dtype``) there is nothing to reduce: the gradients stay
    where autograd put them, as without the wrapper, and no bucket memory is allocated (the
    checks of unused or twice-ready parameters still apply). ``FASTDDP_WORLD1_PASSTHROUGH=0`` keeps
    the bucketed path there too (e.g. to measure it).

    Desync detection (on by default, more than one rank, no Python communication hook): every
    reduction carries a fingerprint (reducing step, bucket layout, which parameters require grad
    and got a gradient, ``no_sync`` steps since the last reduction, the forward's autocast state)
    that the ranks compare inside the reduction itself; when they differ, ``backward`` raises
    :class:`fastddp.DesyncError` on every rank, naming the ranks and what differs (on GPUs the
    check reads the result one reduction later, to add no host synchronisation).
    ``FASTDDP_FINGERPRINT=0`` (or ``ReducerOptions.fingerprint = False``) turns it off;
    ``FASTDDP_FINGERPRINT=strict`` (``ReducerOptions.fingerprint_unused``) also requires the same
    used parameters on every rank under ``find_unused_parameters=True``, which torch DDP allows to
    differ.

    After the first reduced backward the buckets are rebuilt once in the order gradients
    arrived (rank 0's order, broadcast), as torch DDP does.

    Uneven inputs: ``with model.join():`` (or ``torch.distributed.algorithms.Join([model,
    ...])``) as with torch DDP. A rank that runs out of data stands in for the others'
    collectives (buffer broadcasts, bucket all-reduces with zero gradients, the unused-parameter
    map) until every rank is done; the gradients are divided by the initial world size (or
    by the ranks still training, ``divide_by_initial_world_size=False``), and at the end every
    rank gets the parameters and buffers of the last rank to finish. Inside the block each
    forward issues two small extra collectives (torch DDP's protocol does the same) and
    buffers are broadcast from the highest rank still training.

    With ``device_ids``, forward moves input tensors (inside tuples, lists, dicts and named
    tuples) to that device, as torch DDP does; ``device_ids`` or ``output_device`` given for a
    CPU module is torch DDP's ``ValueError``. ``output_device``, ``dim`` and ``check_reduction``
    are accepted for compatibility and have no effect (one device per process, as torch DDP
    recommends); ``check_reduction=True`` and an explicit ``broadcast_buffers`` give torch's
    ``FutureWarning``. torch DDP's newer options work as there: ``init_sync=False`` (no
    verification or broadcast at construction), ``forward_sync_buffers`` (2.13+'s name for
    ``broadcast_buffers``; given, buffers are still synced at construction;
    ``broadcast_buffers=False`` skips that too), ``device_mesh`` (1-D, instead of
    ``process_group``), ``bucket_cap_mb_list`` (the k-th bucket of each dtype holds at most the
    k-th size, in the order the buckets are reduced) and ``batched_grad_copy`` (forces the
    batched copies described below). ``delay_all_reduce_named_params``, ``param_to_hook_all_reduce``,
    ``mixed_precision`` and ``skip_all_reduce_unused_params`` are refused with a message.
    ``comm_dtype`` and ``shm_allreduce`` are keyword-only. Parameters and buffers named by torch
    DDP's ``_set_params_and_buffers_to_ignore_for_model`` stay rank-local (neither reduced nor
    broadcast; the root module's own parameters are still reduced, by torch's rule, see
    ``checks.reducer_parameters``); ``_set_static_graph()``, ``_register_builtin_comm_hook`` and
    ``will_sync_module_buffers()`` behave as torch DDP's.
    ``torch.distributed.checkpoint.state_dict.get_state_dict`` drops the ``module.`` prefix as
    for torch DDP.
    ``copy.deepcopy(model)`` and ``torch.save(model)`` work as with torch DDP (default process
    group only); the copy rebuilds its reducer without any collective, on the process group's
    transport, so a copy made on one rank (an EMA model) cannot hang the others.

    Buffers (``broadcast_buffers=True``) are broadcast from rank 0 before a forward exactly when
    torch DDP does it: when the forward before it was a reducing one (grad enabled, outside
    ``no_sync``), and before the first. So evaluation forwards after the first one, the first
    training forward after them and ``no_sync`` micro-steps after the first use each rank's own
    statistics, as under torch DDP (:attr:`require_forward_param_sync`).

    ``static_graph=True`` behaves as in torch DDP: the first iteration reduces everything at the
    end of backward and records which parameters are used and how many times each one's
    gradient arrives (reentrant backward passes, e.g. ``torch.utils.checkpoint`` with
    ``use_reentrant=True`` on shared layers, reach a parameter several times); later iterations
    reduce each bucket as soon as its parameters got that many gradients, without searching the
    graph for unused parameters. Every iteration must use the same parameters the same number
    of times. Without it, a parameter reached twice in one backward is reported as an error.
    ``find_unused_parameters=True`` returns clones of the outputs from one node, as torch DDP's
    ``_DDPSink``: a loss from some outputs leaves the others' parameters unused (inputs.py).
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Optional[list[int | torch.device]] = None,
        output_device: Optional[int | torch.device] = None,
        dim: int = 0,
        broadcast_buffers: Optional[bool] = None,
        init_sync: bool = True,
        process_group: Optional[dist.ProcessGroup] = None,
        bucket_cap_mb: Optional[float] = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        delay_all_reduce_named_params: Optional[list[tuple[str, nn.Parameter]]] = None,
        param_to_hook_all_reduce: Optional[nn.Parameter] = None,
        mixed_precision: Optional[Any] = None,
        device_mesh: Optional[Any] = None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: Optional[list[float]] = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: Optional[bool] = None,
        *,
        comm_dtype: Optional[torch.dtype] = None,
        shm_allreduce: Optional[bool] = None,
        stall_threshold_s: Optional[float] = None,
    ) -> None:
        nn.Module.__init__(self)  # not torch DDP's constructor: it would build torch's reducer
        Joinable.__init__(self)
        if not dist.is_available():
            raise RuntimeError("DDPWrapper: this torch build has no torch.distributed support.")
        # every collective goes to this group, with its own ranks (see checks.resolve_group)
        self.process_group = checks.resolve_group(process_group, device_mesh)
        checks.flags(find_unused_parameters=find_unused_parameters, static_graph=static_graph,
                     gradient_as_bucket_view=gradient_as_bucket_view,
                     skip_all_reduce_unused_params=skip_all_reduce_unused_params,
                     batched_grad_copy=batched_grad_copy)
        checks.refuse_unsupported(delay_all_reduce_named_params, param_to_hook_all_reduce, mixed_precision,
                                  skip_all_reduce_unused_params)
        self.skip_all_reduce_unused_params = skip_all_reduce_unused_params  # as given, as torch DDP keeps it
        checks.check_comm_dtype(comm_dtype)
        caps = checks.bucket_caps(bucket_cap_mb_list)
        explicit_cap = None if caps or bucket_cap_mb is None else checks.bucket_cap(bucket_cap_mb)
        bucket_cap_mb, first_bucket_mb = bucket_limits_mb(explicit_cap, caps)
        self.module = module
        self.dim = dim
        self.forward_sync_buffers, init_sync_buffers = checks.buffer_sync(broadcast_buffers, forward_sync_buffers)
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = bool(static_graph)  # torch DDP sets True through _set_static_graph()
        self._output_sink = OutputSink()
        self.comm_dtype = comm_dtype
        self._comm_dtype_arg = comm_dtype  # a built-in hook may change comm_dtype; a copy drops the hook
        if device_mesh is not None:  # torch DDP sets the attribute only for a mesh
            self.device_mesh = device_mesh
        self.batched_grad_copy = batched_grad_copy
        self.require_backward_grad_sync = True
        # torch DDP's rule for the per-forward buffer sync: a forward syncs the buffers only when
        # the forward before it was a reducing one (grad enabled, outside no_sync); the first does
        self.require_forward_param_sync = True
        self._world_size = self.process_group.size()
        self._rank = self.process_group.rank()
        diag.ensure_started(stall_threshold_s)  # before the first collective, so its hangs are reported
        checks.check_lazy(module)
        self.output_device = output_device  # normalised by _select_parameters
        named = self._select_parameters(module, device_ids, static_graph, comm_dtype)
        checks.deprecated_arguments(broadcast_buffers, forward_sync_buffers, check_reduction)
        # group rank 0's once checked: alike buckets on every rank
        self._bucket_cap_mb, self._first_bucket_mb = bucket_cap_mb, first_bucket_mb
        if init_sync:
            self._verify_and_sync(named, caps, init_sync_buffers)
        # after the construction's collectives, as torch DDP refuses it (rank 0's state already copied)
        checks.refuse_cpu_sync_batchnorm(module, named[0][1].device.type)
        self._module_buffers = self._synced_buffers()  # broadcast from rank 0 before forwards
        self._run_log = RunLog()  # what torch DDP's logger records as it runs (logging_data.py)
        self._describe_as_torch_ddp(bucket_cap_mb, first_bucket_mb, caps)
        self._init_bucket_state(caps, shm_allreduce)
        self._init_hook_state()
        self._init_join_state()
        self._is_copy = False  # made by deepcopy / unpickling (see __setstate__)
        self._armed: tuple[int, list[weakref.ref], bool] = (-1, [], False)  # see _prepare_reduction
        with diag.phase(diag.Phase.SETUP):  # the shared-memory handshake is a collective
            self._build_reducer()
        if self.static_graph:
            self._warn_static_graph_finds_unused(at_construction=True)

    def _verify_and_sync(self, named: list[tuple[str, nn.Parameter]], caps: list[float],
                         init_sync_buffers: bool) -> None:
        """Construction's collectives: every rank built the same model with the same settings
        (group rank 0's bucket caps taken), then rank 0's parameters and buffers copied out."""
        shared = rank_check.SharedSettings.of(self.find_unused_parameters, self.static_graph, self.comm_dtype,
                                              init_sync_buffers, self.forward_sync_buffers, caps)
        with diag.phase(diag.Phase.SETUP):
            self._bucket_cap_mb, self._first_bucket_mb = rank_check.verify_across_ranks(
                named, self.process_group, self._world_size, shared, (self._bucket_cap_mb, self._first_bucket_mb))
            self._sync_module_states(init_sync_buffers)

    def _select_parameters(self, module: nn.Module, device_ids: Any, static_graph: bool,
                           comm_dtype: Optional[torch.dtype]) -> list[tuple[str, nn.Parameter]]:
        """The parameters this wrapper reduces, by name; those with sparse gradients stay out of
        the C++ reducer (see sparse.py)."""
        # torch DDP's hook for parameters and buffers that stay rank-local (set with
        # DistributedDataParallel._set_params_and_buffers_to_ignore_for_model or by hand)
        self.parameters_to_ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        named = checks.reducer_parameters(module, self.parameters_to_ignore)
        if not named:
            raise RuntimeError("DistributedDataParallel is not needed when a module doesn't have any parameter "
                               "that requires a gradient. (DDPWrapper: every parameter has requires_grad=False "
                               "or is in the parameters to ignore; wrap a module with trainable parameters)")
        checks.refuse_meta(named)
        # forward moves the inputs there; the attributes hold device indices, as torch DDP's
        self._input_device = checks.input_device(named, device_ids, self.output_device)
        if self._input_device is None:
            self.device_ids = self.output_device = None
        else:
            index = self._input_device.index
            self.device_ids = [torch.cuda.current_device() if index is None else index]
            out = device_ids[0] if self.output_device is None else self.output_device
            self.output_device = out if isinstance(out, int) else torch.device(out).index
        sparse_names = sparse.sparse_parameter_names(module, [n for n, _ in named])
        self._sparse_names = [n for n, _ in named if n in sparse_names]
        sparse.refuse(self._sparse_names, "static_graph=True" if static_graph else
                      f"comm_dtype={comm_dtype}" if comm_dtype is not None else "")
        self._param_names = [n for n, _ in named if n not in sparse_names]  # the C++ reducer's
        self._params = [p for n, p in named if n not in sparse_names]
        self._sparse_params = [p for n, p in named if n in sparse_names]
        self._reduced_params = [p for _, p in named]
        return named

    # ------------------------------------------------------------------ forward / no_sync
    @torch.compiler.disable(recursive=False)
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """The module's forward, with the collectives torch DDP runs around it. Under
        ``torch.compile`` (of the wrapper, or of the module inside it) only the module is
        compiled, as with torch DDP: the wrapper's own steps run eagerly, and the module runs
        inside torch DDP's ``_inside_ddp_forward()``, so Dynamo's DDPOptimizer splits its graph
        at ``bucket_bytes_cap`` and buckets are reduced while the compiled backward runs. A
        profile shows it as torch DDP's ``DistributedDataParallel.forward`` range."""
        if torch.autograd.profiler._is_profiler_enabled:  # the range costs an op call: only when profiled
            with torch.autograd.profiler.record_function("DistributedDataParallel.forward"):
                return self._module_forward(inputs, kwargs)
        return self._module_forward(inputs, kwargs)

    @torch.compiler.disable(recursive=False)
    def _module_forward(self, inputs: tuple, kwargs: dict) -> Any:
        inputs, kwargs, grad_enabled = self._before_module(inputs, kwargs)
        with self._inside_ddp_forward():
            output = self.module(*inputs, **kwargs)
        return self._after_module(output, grad_enabled)

    @torch.compiler.disable
    def _before_module(self, inputs: tuple, kwargs: dict) -> tuple[tuple, dict, bool]:
        """Inputs to the device; the last reduction finished; the bucket rebuild, join()'s
        agreement and the buffer sync, in torch DDP's order."""
        if self._input_device is not None:
            inputs, kwargs = to_device(inputs, self._input_device), to_device(kwargs, self._input_device)
        self._reducer.finish_unfinished_reduction()  # before this forward's collectives
        grad_enabled = torch.is_grad_enabled()
        if grad_enabled and self.require_backward_grad_sync:
            diag.step_started()
            self._run_log.forward_starting(self._reducer, self._rebuilt_layout)
        rebuild = grad_enabled and self.require_backward_grad_sync and self._rebuild_due()
        buffers_from = 0
        sync_buffers = self._syncs_buffers() and self.require_forward_param_sync
        if self._join_config.enable:
            # Inside join(): tell the joined ranks what to stand in for this iteration.
            work = Join.notify_join_context(self)
            sync = grad_enabled and self.require_backward_grad_sync
            _, rebuild, n_active, buffers_from, sync_buffers = self._join_agree(
                sync, rebuild, active=True, sync_buffers=sync_buffers)
            if work is not None:
                work.wait()
            if sync:
                self._average_over(n_active)
        if rebuild:
            self._rebuild_buckets()
        if sync_buffers:
            self._sync_buffers_before_forward(buffers_from)
        diag.enter(diag.Phase.FORWARD, -1 if grad_enabled else diag.FORWARD_WITHOUT_GRADIENTS)
        return inputs, kwargs, grad_enabled

    @torch.compiler.disable
    def _after_module(self, output: Any, grad_enabled: bool) -> Any:
        """Arm the reducer for this forward's backward; the outputs as torch DDP returns them."""
        self.require_forward_param_sync = grad_enabled and self.require_backward_grad_sync
        if grad_enabled:
            self._prepare_reduction(output, self.require_backward_grad_sync)
        diag.enter(diag.Phase.OUTSIDE)
        reducing = grad_enabled and self.require_backward_grad_sync
        return self._output_sink(output, self.find_unused_parameters, self.static_graph,
                                 reductions=self._finished_reductions if reducing else None)

    def _finished_reductions(self) -> int:
        return self._reducer.reductions

    def _set_ddp_sink_clone(self, val: bool) -> None:
        """torch DDP's switch: whether the outputs that go through its sink node
        (``find_unused_parameters=True``, ``static_graph``'s first iteration) are clones (the
        default; an in-place change of one then does not fail the backward) or the module's
        own tensors (no copy)."""
        self._output_sink.clone = val

    def _remove_autograd_hooks(self) -> None:
        """torch DDP's recovery step after a failed backward: the reducer's hooks leave the
        parameters' gradient accumulators, so this wrapper reduces no later backward and a new
        wrapper of the same module trains on its own."""
        self._reducer.remove_hooks()

    def _prepare_reduction(self, output: Any, sync: bool) -> None:
        """Arm the reducer for the next backward (``sync``: reduce it). The reducer hooks the
        tensors in ``output``: a backward that misses gradients while some output is still to be
        backwarded through leaves the reduction to that backward; find_unused_parameters walks
        the graph from them; static_graph's first iteration reduces at the end of the outermost
        backward through them."""
        tensors = find_tensors(output) if sync else []
        self._arm(tensors, sync)
        # what a reducer replaced before this forward's backward arms again (_replace_reducer);
        # weak references: the outputs live as long as the script holds them, not longer
        self._armed = (self._reducer.reductions, [weakref.ref(t) for t in tensors], sync)

    def _arm(self, tensors: list[torch.Tensor], sync: bool) -> None:
        self._reducer.prepare_for_backward(tensors, sync)
        if sync:
            self._sparse.prepare_for_backward()

    def _replace_reducer(self) -> None:
        """A new reducer for changed settings (hook, comm_dtype, static_graph), before the first
        backward, so on the initial buckets. Every rank makes the same call, so the set-up
        collective of a new reducer matches. A forward that awaits its backward arms the new
        reducer as it armed the old one: the hook registered in between reduces that backward,
        as under torch DDP."""
        reductions, refs, sync = self._armed
        tensors = [t for t in (ref() for ref in refs) if t is not None]
        pending = reductions == self._reducer.reductions and len(tensors) == len(refs)
        self._build_reducer()
        if pending and (tensors or not sync):
            self._arm(tensors, sync)

    def _reduce_static_first_now(self) -> None:
        """static_graph's armed first iteration reduced at once (torch's
        ``reducer._delay_all_reduce()``, see torch_class.TorchReducerCalls)."""
        self._reducer.delay_all_reduce()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the first backward after the block reduces the sum."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous
