"""``fastddp.DDPWrapper``: drop-in for ``torch.nn.parallel.DistributedDataParallel`` on a C++
reducer (bucketed all-reduce through c10d, overlapped with backward)."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import numbers
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.algorithms.join import Join, Joinable, JoinHook, _JoinConfig

from ._ext import C

FIRST_BUCKET_MB = 1.0  # a small first bucket so communication starts early in backward


def _find_tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors in a forward's output (nested lists, tuples, dicts and dataclasses, as torch
    DDP searches them), where find_unused_parameters starts its graph walk."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _find_tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _find_tensors(o)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [t for f in dataclasses.fields(obj) for t in _find_tensors(getattr(obj, f.name))]
    return []


def assign_buckets(params: list[torch.Tensor], bucket_cap_mb: float,
                   first_bucket_mb: float = FIRST_BUCKET_MB,
                   order: Optional[list[int]] = None,
                   caps_mb: Optional[list[float]] = None) -> list[list[int]]:
    """Bucket indices, filled in ``order`` (default: reverse registration order, as gradients
    of the last layers arrive first), grouped by (device, dtype), at most ``bucket_cap_mb``
    each, the first one smaller. With ``caps_mb`` (torch DDP's ``bucket_cap_mb_list``) the
    k-th bucket of each (device, dtype) holds at most ``caps_mb[k]`` MiB (the last entry
    for the rest) and there is no smaller first bucket."""
    buckets: list[list[int]] = []
    open_buckets: dict[tuple, tuple[list[int], int]] = {}
    opened: dict[tuple, int] = {}  # buckets opened so far per (device, dtype)
    cap_first = int(min(first_bucket_mb, bucket_cap_mb) * 2**20)
    cap = int(bucket_cap_mb * 2**20)

    def limit_of(key: tuple, current: list[int]) -> int:
        if caps_mb:
            return int(caps_mb[min(opened[key] - 1, len(caps_mb) - 1)] * 2**20)
        return cap_first if current is buckets[0] else cap

    for i in (reversed(range(len(params))) if order is None else order):
        p = params[i]
        key = (p.device, p.dtype)
        size = p.numel() * p.element_size()
        current, used = open_buckets.get(key, (None, 0))
        if current is not None and used + size > limit_of(key, current):
            current = None
        if current is None:
            current, used = [], 0
            buckets.append(current)
            opened[key] = opened.get(key, 0) + 1
        current.append(i)
        open_buckets[key] = (current, used + size)
    return buckets


def _to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` with its tensors on ``device``, as torch DDP's forward moves the inputs of a
    module wrapped with ``device_ids``: tensors (and packed sequences) inside tuples, named
    tuples, lists and dicts; anything else as it is. Copies from pinned memory do not block."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.device == device else obj.to(device, non_blocking=True)
    if isinstance(obj, nn.utils.rnn.PackedSequence):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple keeps its type
        return type(obj)(*(_to_device(o, device) for o in obj))
    if isinstance(obj, tuple):
        return tuple(_to_device(o, device) for o in obj)
    if isinstance(obj, list):
        return [_to_device(o, device) for o in obj]
    if isinstance(obj, dict):
        return type(obj)((k, _to_device(v, device)) for k, v in obj.items())
    return obj


def _hook_name(hook: Any) -> str:
    """How messages and bucket_report() name a communication hook."""
    return getattr(hook, "__qualname__", repr(hook))


def _refuse_unsupported(delay_all_reduce_named_params: Any, param_to_hook_all_reduce: Any,
                        mixed_precision: Any, skip_all_reduce_unused_params: bool) -> None:
    """torch DDP constructor options the C++ reducer does not implement: one clear error each,
    before anything is communicated, instead of a silently different training."""
    if delay_all_reduce_named_params is not None or param_to_hook_all_reduce is not None:
        raise NotImplementedError(
            "DDPWrapper: delay_all_reduce_named_params / param_to_hook_all_reduce are not supported "
            "(every parameter that requires a gradient is bucketed and reduced during backward). "
            "Leave them unset, or use torch's DistributedDataParallel for delayed all-reduces.")
    if mixed_precision is not None:
        raise NotImplementedError(
            "DDPWrapper: mixed_precision (torch DDP's private _MixedPrecision) is not supported. Train "
            "under torch.autocast with fastddp.GradScaler, and pass comm_dtype=torch.bfloat16 (or "
            "torch.float16) to all-reduce the gradients in low precision.")
    if skip_all_reduce_unused_params:
        raise NotImplementedError(
            "DDPWrapper: skip_all_reduce_unused_params=True is not supported; unused parameters are "
            "reduced as zero contributions (find_unused_parameters=True), or, with a fixed set of used "
            "parameters, static_graph=True skips the per-iteration search for them.")


def _bucket_cap(bucket_cap_mb: Any) -> float:
    """``bucket_cap_mb`` as torch DDP takes it: a real number of MiB, 0 giving each parameter
    a bucket of its own. A string is refused with torch's exception type (``ValueError``; torch
    fails converting ``"25" * 2**20`` to int). A negative cap, which torch takes as 0, is refused
    as the mistake it is."""
    if isinstance(bucket_cap_mb, (str, bytes)) or not isinstance(bucket_cap_mb, numbers.Real):
        raise ValueError(f"DDPWrapper: bucket_cap_mb must be a number of MiB (e.g. 25), got "
                         f"{type(bucket_cap_mb).__name__} {bucket_cap_mb!r}")
    if not bucket_cap_mb >= 0 or bucket_cap_mb == float("inf"):
        raise ValueError(f"DDPWrapper: bucket_cap_mb must be a finite number >= 0 (0: one parameter per "
                         f"bucket), got {bucket_cap_mb}")
    return float(bucket_cap_mb)


def _resolve_group(process_group: Optional[dist.ProcessGroup], device_mesh: Any) -> dist.ProcessGroup:
    """torch DDP's rule: the given process group, or the group of a 1-D ``device_mesh``, or
    the default group; not both."""
    if device_mesh is None:
        return process_group if process_group is not None else dist.group.WORLD
    if process_group is not None:
        raise ValueError("DDPWrapper: cannot specify both process_group and device_mesh; pass one of them.")
    if device_mesh.ndim != 1:
        raise ValueError(f"DDPWrapper: only a 1-D device_mesh is supported, got {device_mesh} "
                         f"({device_mesh.ndim} dimensions); slice the data-parallel dimension, e.g. "
                         "mesh['dp'].")
    return device_mesh.get_group(mesh_dim=0)


class DDPWrapper(nn.Module, Joinable):
    """Distributed data parallelism with the constructor and behaviour of
    :class:`torch.nn.parallel.DistributedDataParallel`.

    Replace ``DistributedDataParallel(model, device_ids=[rank])`` with
    ``DDPWrapper(model, device_ids=[rank])``. ``.module``, ``.no_sync()``, ``forward`` and the
    ``state_dict`` keys (``module.``-prefixed) are the same, so checkpoints move between the two.

    Extras: ``shm_allreduce`` (default None = auto): when every rank of the group runs on this
    host with CPU parameters, the gradient buckets live in one shared-memory mapping and each
    rank sums its slice of every bucket straight from the others' memory instead of sending it
    through gloo's TCP loopback (fp32/fp64 buckets and compressed ones; an uncompressed
    bf16/fp16 bucket stays on the process group so its rounding is torch DDP's), and the
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

    ``gradient_as_bucket_view`` defaults to True: ``param.grad`` is a view into its bucket, so
    gradients are never copied when they accumulate in place (``zero_grad(set_to_none=False)``).
    After ``zero_grad(set_to_none=True)`` each new gradient is copied into its bucket; on a GPU
    the copies of a bucket are made with one multi-tensor copy once the bucket is full
    (``FASTDDP_BATCH_GRAD_COPIES=0|1`` forces one copy per gradient / batched copies).

    In a world of one (and no ``comm_dtype``) there is nothing to reduce: the gradients stay
    where autograd put them, as without the wrapper, and no bucket memory is allocated (the
    checks of unused or twice-ready parameters still apply). ``FASTDDP_WORLD1_PASSTHROUGH=0`` keeps
    the bucketed path there too (e.g. to measure it).

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
    tuples) to that device, as torch DDP does. ``output_device``, ``dim`` and
    ``check_reduction`` are accepted for compatibility and have no effect (one device per
    process, as torch DDP recommends). torch DDP's newer options work
    as there: ``init_sync=False`` (no verification or broadcast at construction),
    ``forward_sync_buffers`` (2.13+'s name for ``broadcast_buffers``; given, buffers are still
    synced at construction; ``broadcast_buffers=False`` skips that too), ``device_mesh`` (1-D,
    instead of ``process_group``), ``bucket_cap_mb_list`` (the k-th bucket of each dtype holds at
    most the k-th size, in the order the buckets are reduced) and ``batched_grad_copy`` (forces
    the batched copies described below). ``delay_all_reduce_named_params``,
    ``param_to_hook_all_reduce``, ``mixed_precision`` and ``skip_all_reduce_unused_params`` are
    refused with a message. ``comm_dtype`` and ``shm_allreduce`` are keyword-only.
    Parameters and buffers named by torch DDP's ``_set_params_and_buffers_to_ignore_for_model``
    stay rank-local (neither reduced nor broadcast); ``_set_static_graph()``,
    ``_register_builtin_comm_hook`` and ``will_sync_module_buffers()`` behave as torch DDP's.
    ``torch.distributed.checkpoint.state_dict.get_state_dict`` drops torch DDP's ``module.``
    prefix by the wrapper's type: pass ``model.module`` to get the same keys as torch DDP.
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
        gradient_as_bucket_view: bool = True,
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
    ) -> None:
        super().__init__()
        Joinable.__init__(self)
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("DDPWrapper: the default process group is not initialised. Call "
                               "torch.distributed.init_process_group(...) first (torchrun sets "
                               "up the environment for it).")
        _refuse_unsupported(delay_all_reduce_named_params, param_to_hook_all_reduce, mixed_precision,
                            skip_all_reduce_unused_params)
        if comm_dtype not in (None, torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"DDPWrapper: comm_dtype must be torch.bfloat16, torch.float16 or None, got {comm_dtype}")
        bucket_cap_mb = 25.0 if bucket_cap_mb is None else _bucket_cap(bucket_cap_mb)
        caps = [float(c) for c in bucket_cap_mb_list] if bucket_cap_mb_list else None
        if caps is not None:
            if min(caps) <= 0:
                raise ValueError(f"DDPWrapper: every bucket_cap_mb_list entry must be > 0, got {bucket_cap_mb_list}")
            bucket_cap_mb = max(caps)  # as torch DDP: the list replaces bucket_cap_mb
        self.module = module
        self.device_ids = device_ids
        self.output_device = output_device
        self.dim = dim
        # torch DDP (2.13+): forward_sync_buffers replaces broadcast_buffers; given, it decides
        # only the per-forward sync and the buffers are synced at construction anyway; else
        # broadcast_buffers (default True) decides both.
        if forward_sync_buffers is not None:
            self.broadcast_buffers = bool(forward_sync_buffers)
            init_sync_buffers = True
        else:
            self.broadcast_buffers = True if broadcast_buffers is None else bool(broadcast_buffers)
            init_sync_buffers = self.broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.comm_dtype = comm_dtype
        self.process_group = _resolve_group(process_group, device_mesh)
        self.device_mesh = device_mesh
        self.batched_grad_copy = batched_grad_copy
        self.require_backward_grad_sync = True
        # torch DDP's rule for the per-forward buffer sync: a forward syncs the buffers only when
        # the forward before it was a reducing one (grad enabled, outside no_sync); the first does
        self.require_forward_param_sync = True
        self.world_size = dist.get_world_size(self.process_group)
        self.rank = dist.get_rank(self.process_group)

        lazy = [n for n, p in module.named_parameters() if isinstance(p, nn.parameter.UninitializedParameter)]
        if lazy:
            raise RuntimeError(f"DDPWrapper: parameter {lazy[0]!r} is not initialised yet (a lazy module such as "
                               "nn.LazyLinear); run one forward pass with a sample batch before wrapping the model.")
        # torch DDP's hook for parameters and buffers that stay rank-local (set with
        # DistributedDataParallel._set_params_and_buffers_to_ignore_for_model or by hand)
        self.parameters_to_ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        named = [(n, p) for n, p in module.named_parameters()
                 if p.requires_grad and n not in self.parameters_to_ignore]
        self._input_device: Optional[torch.device] = None  # set from device_ids
        if not named:
            raise RuntimeError("DDPWrapper: the module has no parameter that requires a gradient")
        self._check_devices(named, device_ids)
        self._check_dense(module)
        if init_sync:
            self._verify_across_ranks(named)
            self._sync_module_states(init_sync_buffers)
        self._param_names = [n for n, _ in named]
        params = [p for _, p in named]
        self._params = params
        self._module_buffers = self._synced_buffers()  # broadcast from rank 0 before forwards
        self._buckets_rebuilt = False
        self._bucket_caps_mb = caps
        self._buckets = assign_buckets(params, bucket_cap_mb, caps_mb=caps)
        self._bucket_cap_mb = bucket_cap_mb
        # torch DDP's descriptive attributes, which code written for it reads
        self.bucket_bytes_cap = int(bucket_cap_mb * 1024 * 1024)
        self.is_multi_device_module = len({p.device for p in params}) > 1
        self.device_type = params[0].device.type
        self.device = params[0].device
        self.mixed_precision = None
        self._shm_requested = shm_allreduce
        self._comm_hook: Optional[Callable] = None
        self._python_hook: Optional[tuple[object, Callable]] = None  # (state, hook) run per bucket
        self._is_copy = False  # made by deepcopy / unpickling (see __setstate__)
        self._divide_by_initial_world_size = True  # join()'s setting
        self._build_reducer()

    def _build_reducer(self) -> None:
        """(Re)creates the C++ reducer from this wrapper's settings (a collective when the
        ranks negotiate shared memory)."""
        shm_allreduce = self._shm_requested
        python_hook = self._python_hook is not None
        self._reducer = C.Reducer(self._params, self._param_names, self._buckets, self.process_group,
                                  self.gradient_as_bucket_view, self.find_unused_parameters,
                                  self.static_graph, self.comm_dtype,
                                  # a Python hook reduces through its own collectives; a copy
                                  # (deepcopy / unpickled) does no set-up collective
                                  None if python_hook or self._is_copy
                                  else self._shm_wish(self._params, shm_allreduce),
                                  self._timeout_s(), self._buffer_bytes(),
                                  batch_copies=True if self.batched_grad_copy
                                  else _env_flag("FASTDDP_BATCH_GRAD_COPIES"),
                                  single_rank_passthrough=_env_flag("FASTDDP_WORLD1_PASSTHROUGH") is not False,
                                  comm_hook_state=self._python_hook[0] if python_hook else None,
                                  comm_hook=self._python_hook[1] if python_hook else None)
        note = self._reducer.transport_note
        own_failure = note.startswith(("shm_open", "reserving", "segment", "mmap", "cannot"))
        if shm_allreduce is None and self._reducer.transport != "shm" and (
                own_failure or (self.rank == 0 and note.startswith("rank "))):
            # Wanted and possible in principle, but the mapping failed: the failing rank (and
            # rank 0) say so.
            warnings.warn(f"DDPWrapper: all-reducing through the process group, not shared memory: {note}",
                          RuntimeWarning, stacklevel=3)
        self._shm_buffer_room = self._buffer_bytes()
        self._shm_buffers = self._reducer.transport == "shm" and self._shm_buffer_room > 0
        if shm_allreduce and self._reducer.transport != "shm":
            raise RuntimeError(f"DDPWrapper: shm_allreduce=True but the ranks cannot all-reduce through shared "
                               f"memory: {self._reducer.transport_note}. Pass shm_allreduce=None to fall "
                               "back to the process group's backend.")

    def _replace_reducer(self) -> None:
        """A new reducer for changed settings (hook, comm_dtype, static_graph), before the first
        backward, on the current buckets. Every rank makes the same call, so the set-up
        collective of a new reducer matches."""
        self._buckets = [list(b) for b in self._reducer.bucket_indices()]
        self._build_reducer()

    def _shm_wish(self, params: list[torch.Tensor], requested: Optional[bool]) -> Optional[bool]:
        """None: no shared-memory handshake (one process, or not a CPU model). Otherwise this
        rank's wish, agreed with the other ranks' in the handshake."""
        if self.world_size == 1 or any(p.device.type != "cpu" for p in params):
            if requested:
                raise ValueError("DDPWrapper: shm_allreduce=True needs CPU parameters and more than one "
                                 f"process (world size {self.world_size}, devices "
                                 f"{sorted({str(p.device) for p in params})})")
            return None
        if requested is not None:
            return bool(requested)
        return os.environ.get("FASTDDP_SHM_ALLREDUCE", "1").strip().lower() not in ("0", "false", "no", "off")

    def _buffer_bytes(self) -> int:
        """Room for the per-forward buffer broadcast in the shared-memory arena (CPU buffers;
        each packed at a 64-byte boundary)."""
        if not self.broadcast_buffers or any(b.device.type != "cpu" for b in self._module_buffers):
            return 0
        return sum((b.numel() * b.element_size() + 63) // 64 * 64 for b in self._module_buffers)

    def _current_buffers(self) -> list[torch.Tensor]:
        """The module's buffers now: a forward may have replaced one (``self.avg = self.avg *
        0.9 + ...`` rebinds the name to a new tensor), and the broadcast must reach the tensor
        the module uses, as torch DDP re-reads them before each broadcast."""
        self._module_buffers = self._synced_buffers()
        return self._module_buffers

    def _synced_params(self) -> list[torch.Tensor]:
        """The module's parameters that are kept equal across ranks (all but the ignored)."""
        return [p.data for n, p in self.module.named_parameters() if n not in self.parameters_to_ignore]

    def _synced_buffers(self) -> list[torch.Tensor]:
        """The module's buffers that are broadcast from rank 0 (all but the ignored)."""
        return [b for n, b in self.module.named_buffers() if n not in self.parameters_to_ignore]

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module: nn.Module, params_and_buffers_to_ignore: Any) -> None:
        """torch DDP's (private, widely used) switch: the named parameters and buffers of
        ``module`` (fully qualified names) are neither reduced nor broadcast; call it before
        wrapping. Works for both wrappers, as both read the same attribute."""
        module._ddp_params_and_buffers_to_ignore = params_and_buffers_to_ignore

    def to_kwargs(self, inputs: tuple, kwargs: Optional[dict], device_id: int) -> tuple[tuple, tuple]:
        """torch DDP's (kept for compatibility) input move: ``((inputs,), (kwargs,))`` with their
        tensors on device ``device_id`` of the parameters' device type."""
        device = torch.device(self._params[0].device.type, device_id)
        return (_to_device(tuple(inputs), device),), (_to_device(dict(kwargs or {}), device),)

    def scatter(self, inputs: tuple, kwargs: Optional[dict], device_ids: list[int]) -> tuple[tuple, tuple]:
        """torch DDP's (kept for compatibility) scatter of inputs over ``device_ids`` along ``dim``."""
        from torch.nn.parallel.scatter_gather import scatter_kwargs

        return scatter_kwargs(inputs, kwargs, device_ids, dim=self.dim)

    def gather(self, outputs: Any, output_device: int | torch.device) -> Any:
        """torch DDP's (kept for compatibility) gather of outputs on ``output_device`` along ``dim``."""
        from torch.nn.parallel.scatter_gather import gather

        return gather(outputs, output_device, dim=self.dim)

    def will_sync_module_buffers(self) -> bool:
        """Whether the next forward syncs the module's buffers (torch DDP's rule: buffer sync
        on, buffers to sync, and the last forward a reducing one; a world of one then has
        nothing to send)."""
        return self.require_forward_param_sync and self.broadcast_buffers and bool(self._module_buffers)

    def _timeout_s(self) -> float:
        """The process group's timeout (a shared-memory wait for a live peer gives up after it)."""
        try:
            return self.process_group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
        except (AttributeError, RuntimeError):
            return 1800.0

    # ------------------------------------------------------------------ construction checks
    def _check_devices(self, named: list[tuple[str, nn.Parameter]], device_ids) -> None:
        devices = {p.device for _, p in named}
        if device_ids:
            if len(device_ids) != 1:
                raise ValueError(f"DDPWrapper: device_ids must name one device per process, got {device_ids}")
            want = torch.device("cuda", device_ids[0]) if isinstance(device_ids[0], int) else torch.device(device_ids[0])
            wrong = [n for n, p in named if p.device != want]
            if wrong:
                raise ValueError(f"DDPWrapper: device_ids={device_ids} but parameter {wrong[0]!r} is on "
                                 f"{dict(named)[wrong[0]].device}; move the module with "
                                 f"module.to({str(want)!r}) before wrapping it")
            self._input_device = want  # forward moves the inputs there, as torch DDP's does
        elif len(devices) > 1 and any(d.type == "cuda" for d in devices):
            raise ValueError(f"DDPWrapper: module spans devices {sorted(map(str, devices))}; "
                             "multi-device modules need device_ids=None and are not supported")

    def _check_dense(self, module: nn.Module) -> None:
        """Sparse gradients cannot go into the flat buckets: say so before training starts
        (a world of one reduces nothing, so it does not mind)."""
        if self.world_size == 1:
            return
        for name, sub in module.named_modules():
            if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse and sub.weight.requires_grad:
                raise ValueError(f"DDPWrapper: {name or 'the module'} is {type(sub).__name__}(sparse=True), whose "
                                 "sparse gradients the reducer cannot all-reduce (it reduces dense flat "
                                 "buckets). Use sparse=False for that layer, or torch's "
                                 "DistributedDataParallel for sparse gradients.")

    def _verify_across_ranks(self, named: list[tuple[str, nn.Parameter]]) -> None:
        """torch DDP's check that every rank built the same model: the same number of
        parameters and, for each, the same full shape, dtype and requires_grad (two all-gathers:
        the count and widest rank, then one row per parameter)."""
        if self.world_size == 1:
            return
        device = named[0][1].device if dist.get_backend(self.process_group) == "nccl" else torch.device("cpu")
        header = torch.tensor([len(named), max(p.dim() for _, p in named)], dtype=torch.int64, device=device)
        headers = [torch.zeros_like(header) for _ in range(self.world_size)]
        dist.all_gather(headers, header, group=self.process_group)
        counts = [int(h[0]) for h in headers]
        if len(set(counts)) > 1:
            raise RuntimeError("DDPWrapper: ranks have different numbers of parameters: "
                               + ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts)))
        width = _META_FIELDS + max(int(h[1]) for h in headers)
        local = torch.tensor([v for _, p in named for v in _param_meta(p, width)], dtype=torch.int64,
                             device=device)
        gathered = [torch.zeros_like(local) for _ in range(self.world_size)]
        dist.all_gather(gathered, local, group=self.process_group)
        rows = [g.view(-1, width).cpu() for g in gathered]
        for i, (name, _param) in enumerate(named):
            for r in range(self.world_size):
                if not torch.equal(rows[r][i], rows[0][i]):
                    raise RuntimeError(
                        f"DDPWrapper: parameter {i} ({name!r}) differs between ranks: rank 0 has "
                        f"{_describe(rows[0][i])}, rank {r} has {_describe(rows[r][i])}. Every rank "
                        "must build the same model.")

    @torch.no_grad()
    def _sync_module_states(self, buffers: bool = True) -> None:
        """Broadcast parameters (and buffers) from rank 0 (one collective per dtype/device)."""
        if self.world_size == 1:
            return
        tensors = self._synced_params() + (self._synced_buffers() if buffers else [])
        self._broadcast_coalesced(tensors)

    def _broadcast_coalesced(self, tensors: list[torch.Tensor], src: int = 0) -> None:
        """Broadcast ``tensors`` from group rank ``src``, one collective per (device, dtype)."""
        groups: dict[tuple, list[torch.Tensor]] = {}
        for t in tensors:
            groups.setdefault((t.device, t.dtype), []).append(t)
        for group in groups.values():
            flat = _flatten_dense_tensors(group)
            dist.broadcast(flat, src=dist.get_global_rank(self.process_group, src)
                           if self.process_group is not dist.group.WORLD else src,
                           group=self.process_group)
            for t, synced in zip(group, _unflatten_dense_tensors(flat, group)):
                t.copy_(synced)

    # ------------------------------------------------------------------ pickling / deepcopy
    def __getstate__(self) -> dict[str, Any]:
        """``copy.deepcopy(model)`` and ``torch.save(model)`` as with torch DDP: everything but
        the process group and the C++ reducer, which the copy rebuilds. Like torch, only for a
        wrapper on the default process group."""
        if not dist.is_initialized() or self.process_group is not dist.group.WORLD:
            raise RuntimeError("DDPWrapper: pickling or deep-copying is supported only for a wrapper on the "
                               "default process group (as with torch DDP); this one was built with "
                               "process_group= or device_mesh=. Copy or save ddp.module (or its state_dict()) "
                               "instead.")
        state = dict(self.__dict__)
        for name in ("process_group", "_reducer", "device_mesh"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("DDPWrapper: unpickling a wrapper needs the default process group; call "
                               "torch.distributed.init_process_group(...) before torch.load / deepcopy.")
        super().__setstate__(state)
        self.process_group = dist.group.WORLD
        self.device_mesh = None
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        # A copy is often made on one rank only (an EMA or evaluation model): its reducer must
        # not negotiate shared memory, a collective the other ranks would never join.
        self._shm_requested = None
        self._is_copy = True
        self._build_reducer()

    # ------------------------------------------------------------------ forward / no_sync
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self._input_device is not None:
            inputs, kwargs = _to_device(inputs, self._input_device), _to_device(kwargs, self._input_device)
        grad_enabled = torch.is_grad_enabled()
        order: list[int] = []
        if grad_enabled and not self._buckets_rebuilt and self.require_backward_grad_sync \
                and not self._reducer.passthrough:
            order = self._reducer.arrival_order()  # non-empty after the first backward
        rebuild, buffers_from = bool(order), 0
        sync_buffers = self._syncs_buffers() and self.require_forward_param_sync
        if self._join_config.enable:
            # Inside join(): tell the joined ranks what to stand in for this iteration.
            work = Join.notify_join_context(self)
            sync = grad_enabled and self.require_backward_grad_sync
            _, rebuild, n_active, buffers_from, sync_buffers = self._join_agree(
                sync, rebuild, active=True, sync_buffers=sync_buffers)
            if work is not None:
                work.wait()
            if sync and not self._divide_by_initial_world_size and n_active < self.world_size \
                    and self._python_hook is None:
                # average over the ranks still training instead of the initial world size (a
                # Python hook does its own division, as under torch DDP)
                self._reducer.set_reduction_scale(self.world_size / n_active)
        if rebuild:
            self._rebuild_buckets(order or self._reducer.arrival_order())
        if sync_buffers:
            buffers = self._current_buffers()
            with torch.no_grad():
                if self._join_config.enable:  # rank 0 may have joined with stale buffers
                    self._broadcast_coalesced(buffers, src=buffers_from)
                # co-located CPU ranks copy rank 0's buffers through shared memory (while they
                # fit the room reserved at construction); else c10d
                elif not (self._shm_buffers and self._buffer_bytes() <= self._shm_buffer_room
                          and self._reducer.broadcast_buffers(buffers)):
                    self._broadcast_coalesced(buffers)
        output = self.module(*inputs, **kwargs)
        self.require_forward_param_sync = grad_enabled and self.require_backward_grad_sync
        if grad_enabled:
            sync = self.require_backward_grad_sync
            # find_unused_parameters walks the graph from the outputs; static_graph hooks them
            # in its first iteration to reduce at the end of the outermost backward.
            wants_outputs = sync and (self.find_unused_parameters or self.static_graph)
            self._reducer.prepare_for_backward(_find_tensors(output) if wants_outputs else [], sync)
        return output

    def _rebuild_buckets(self, arrival: list[int]) -> None:
        """Once, after the first reduced backward: re-bucket in the order gradients actually
        arrived, so each bucket fills (and launches) as early as possible. Rank 0's order is
        broadcast so every rank builds the same buckets and issues the same collectives."""
        self._buckets_rebuilt = True
        seen = set(arrival)
        full = list(arrival) + [i for i in reversed(range(len(self._params))) if i not in seen]
        device = self._reducer.bucket_buffers()[0].device
        agreed = torch.tensor(full, dtype=torch.int64, device=device)
        if self.world_size > 1:
            src = (dist.get_global_rank(self.process_group, 0)
                   if self.process_group is not dist.group.WORLD else 0)
            dist.broadcast(agreed, src=src, group=self.process_group)
        buckets = assign_buckets(self._params, self._bucket_cap_mb, order=agreed.tolist(),
                                 caps_mb=self._bucket_caps_mb)
        if buckets != [list(b) for b in self._reducer.bucket_indices()]:
            self._reducer.rebuild_buckets(buckets)

    def _syncs_buffers(self) -> bool:
        return self.broadcast_buffers and self.world_size > 1 and bool(self._module_buffers)

    # ------------------------------------------------------------------ communication hooks
    def register_comm_hook(self, state: object, hook: Callable) -> None:
        """torch DDP's communication hook: ``hook(state, bucket) -> torch.futures.Future`` is
        called for each full gradient bucket (a :class:`torch.distributed.GradBucket` holding
        the local, undivided sum of the gradients) and the Future's value, the reduced flat
        tensor, replaces the bucket: PowerSGD, custom compression, or any other hook written
        for torch DDP. Like torch, only once and before the first backward; the hook runs in
        every reduced backward, in a world of one too, and replaces the shared-memory transport.

        torch's ``default_hooks.allreduce_hook`` (what the reducer does anyway),
        ``fp16_compress_hook`` and ``bf16_compress_hook`` (the same as ``comm_dtype=
        torch.float16`` / ``torch.bfloat16``) run in C++ instead of Python, with the
        shared-memory transport kept."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        known: dict[Callable, Optional[torch.dtype]] = {
            default_hooks.allreduce_hook: None,
            default_hooks.fp16_compress_hook: torch.float16,
            default_hooks.bf16_compress_hook: torch.bfloat16,
        }
        name = _hook_name(hook)
        if self._comm_hook is not None:
            raise RuntimeError("DDPWrapper.register_comm_hook can only be called once (as in torch DDP); "
                               f"{_hook_name(self._comm_hook)} is registered already.")
        if self._reducer.arrival_order():
            raise RuntimeError("DDPWrapper.register_comm_hook must be called before the first backward "
                               "pass (as in torch DDP); register it right after wrapping the model.")
        if not any(hook is k for k in known):
            self._register_python_hook(state, hook, name)
            return
        if state is not None and state is not self.process_group:
            raise ValueError("DDPWrapper.register_comm_hook: state must be None or this wrapper's process "
                             f"group for {name} (the built-in hooks reduce over the wrapper's group), got "
                             f"{type(state).__name__}.")
        dtype = known[hook]
        if dtype is not None and self.comm_dtype not in (None, dtype):
            raise ValueError(f"DDPWrapper.register_comm_hook: {name} conflicts with comm_dtype={self.comm_dtype} "
                             "given to the constructor; use one of the two.")
        self._comm_hook = hook
        if dtype is not None and dtype != self.comm_dtype:
            self.comm_dtype = dtype
            self._replace_reducer()

    def _register_builtin_comm_hook(self, comm_hook_type: Any) -> None:
        """torch DDP's C++ built-in hooks (``dist.BuiltinCommHookType``): ``ALLREDUCE`` is what
        the reducer does anyway, ``FP16_COMPRESS`` is ``comm_dtype=torch.float16``."""
        kind = getattr(comm_hook_type, "name", str(comm_hook_type))
        hooks = {"ALLREDUCE": "allreduce_hook", "FP16_COMPRESS": "fp16_compress_hook"}
        if kind not in hooks:
            raise ValueError(f"DDPWrapper._register_builtin_comm_hook: unknown hook type {comm_hook_type!r}; "
                             "expected dist.BuiltinCommHookType.ALLREDUCE or FP16_COMPRESS.")
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        self.register_comm_hook(None, getattr(default_hooks, hooks[kind]))

    def _set_static_graph(self) -> None:
        """torch DDP's late switch to ``static_graph=True`` (prefer the constructor argument):
        after construction, before the first backward, on every rank."""
        if self.static_graph:
            warnings.warn("DDPWrapper._set_static_graph: static_graph is True already; nothing to do.",
                          stacklevel=2)
            return
        if self._reducer.arrival_order():
            raise RuntimeError("DDPWrapper._set_static_graph() must be called before the first backward pass "
                               "(as in torch DDP); better, pass static_graph=True to the constructor.")
        self.static_graph = True
        self._replace_reducer()

    def _register_python_hook(self, state: object, hook: Callable, name: str) -> None:
        """A hook the reducer calls per bucket through torch's Python hook adapter."""
        if not callable(hook):
            raise TypeError(f"DDPWrapper.register_comm_hook: the hook must be callable as hook(state, bucket), "
                            f"got {type(hook).__name__}.")
        try:
            inspect.signature(hook).bind(state, None)
        except TypeError as exc:
            raise TypeError(f"DDPWrapper.register_comm_hook: {name} must take two arguments, (state, bucket), "
                            f"as torch DDP calls it: {exc}") from None
        except ValueError:  # no signature to inspect (a builtin): let the call decide
            pass
        if self.comm_dtype is not None:
            raise ValueError(f"DDPWrapper.register_comm_hook: {name} does its own reduction and cannot be "
                             f"combined with comm_dtype={self.comm_dtype} given to the constructor; compress "
                             "inside the hook (e.g. fp16_compress_wrapper) or drop comm_dtype.")
        if self._shm_requested:
            raise ValueError(f"DDPWrapper.register_comm_hook: {name} does its own reduction and cannot run on "
                             "the shared-memory transport requested with shm_allreduce=True; pass "
                             "shm_allreduce=None (the default).")
        self._comm_hook = hook
        self._python_hook = (state, hook)
        self._replace_reducer()

    # ------------------------------------------------------------------ uneven inputs
    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """Context manager for ranks with different numbers of batches, as
        :meth:`torch.nn.parallel.DistributedDataParallel.join`: wrap the training loop in it
        and a rank that finishes early keeps answering the others' collectives until all are
        done. ``throw_on_early_termination=True`` instead raises on every rank as soon as one
        runs out. ``divide_by_initial_world_size=False`` averages each step's gradients over
        the ranks still training instead of the initial world size."""
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The :class:`~torch.distributed.algorithms.JoinHook` that shadows this wrapper's
        collectives on a joined rank (used by :class:`~torch.distributed.algorithms.Join`)."""
        if self.static_graph:
            raise ValueError("DDPWrapper.join() cannot be used with static_graph=True (a joined rank "
                             "would break the fixed per-iteration pattern); construct the wrapper with "
                             "static_graph=False, with find_unused_parameters=True if needed.")
        self._divide_by_initial_world_size = bool(kwargs.get("divide_by_initial_world_size", True))
        return _DDPJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        """Device of the join protocol's small collectives (the parameters')."""
        return self._params[0].device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        """Process group of the join protocol (this wrapper's)."""
        return self.process_group

    def _join_agree(self, sync: bool, rebuild: bool, active: bool,
                    sync_buffers: bool = False) -> tuple[bool, bool, int, int, bool]:
        """One all-reduce (SUM) per iteration inside join(): whether the active ranks reduce
        gradients, rebuild the buckets and sync the buffers in this iteration, how many ranks
        are active, and the highest active rank (the source of the buffers). A joined rank
        adds zeros."""
        flags = torch.zeros(3 + self.world_size, dtype=torch.int64)
        if active:
            flags[0], flags[1], flags[2], flags[3 + self.rank] = int(sync), int(rebuild), int(sync_buffers), 1
        flags = flags.to(self.join_device)
        dist.all_reduce(flags, group=self.process_group)
        values = flags.tolist()
        ranks = [r for r, v in enumerate(values[3:]) if v]
        return values[0] > 0, values[1] > 0, len(ranks), max(ranks, default=-1), values[2] > 0

    def _sync_final_model(self, is_last_joiner: bool) -> None:
        """After join(): every rank takes the parameters and buffers of the highest-ranked
        last joiner (the ranks that joined early skipped optimizer steps)."""
        flags = torch.tensor([self.rank if is_last_joiner else -1], dtype=torch.int64,
                             device=self.join_device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.process_group)
        with torch.no_grad():
            tensors = self._synced_params()
            if self.broadcast_buffers:
                tensors += self._synced_buffers()
            self._broadcast_coalesced(tensors, src=int(flags.item()))
        # The protocol's extra collectives stop with the block, on every rank alike.
        self._join_config = _JoinConfig.construct_disabled_join_config()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the first backward after the block reduces the sum."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    # ------------------------------------------------------------------ extras
    @property
    def forward_sync_buffers(self) -> bool:
        """Whether buffers are broadcast from rank 0 before a forward (torch DDP 2.13+'s
        name for ``broadcast_buffers``)."""
        return self.broadcast_buffers

    @forward_sync_buffers.setter
    def forward_sync_buffers(self, value: bool) -> None:
        self.broadcast_buffers = bool(value)

    @property
    def transport(self) -> str:
        """``"shm"`` when the buckets are reduced through shared memory, else ``"c10d"``."""
        return self._reducer.transport

    def bucket_buffers(self) -> list[torch.Tensor]:
        """The tensors that hold the averaged gradients after backward, e.g. for
        :class:`fastddp.GradScaler`'s ``grads=``: the flat bucket buffers (``param.grad`` are
        views into them with ``gradient_as_bucket_view=True``), or, in a world of one where
        nothing is bucketed (see the class documentation), the parameters' ``.grad`` tensors
        themselves (those that exist)."""
        if self._reducer.passthrough:
            return [p.grad for p in self._params if p.grad is not None]
        return self._reducer.bucket_buffers()

    def bucket_report(self) -> dict[str, Any]:
        """Bucket sizes, which parameter sits in which bucket, and the last measured
        all-reduce time of each bucket (launch to completion, ms; None before any; 0 in a
        world of one, where no collective is issued)."""
        buffers = self._reducer.bucket_buffers()
        times = self._reducer.bucket_allreduce_ms()
        shm = self._reducer.bucket_shm()
        buckets = []
        for b, (indices, buf) in enumerate(zip(self._reducer.bucket_indices(), buffers)):
            buckets.append({
                "index": b, "bytes": buf.numel() * buf.element_size(), "numel": buf.numel(),
                "dtype": str(buf.dtype), "device": str(self._params[indices[0]].device),
                "params": [self._param_names[i] for i in indices],
                "allreduce_ms": times[b] if times[b] >= 0 else None,
                "transport": "shm" if shm[b] else "c10d",
            })
        return {"world_size": self.world_size, "bucket_cap_mb": self._bucket_cap_mb,
                "transport": self._reducer.transport, "transport_note": self._reducer.transport_note,
                "first_bucket_mb": FIRST_BUCKET_MB, "comm_dtype": str(self.comm_dtype),
                "passthrough": self._reducer.passthrough, "batch_copies": self._reducer.batch_copies,
                "comm_hook": None if self._comm_hook is None else _hook_name(self._comm_hook),
                "buckets": buckets,
                "param_to_bucket": {self._param_names[i]: b for b, idx in
                                    enumerate(self._reducer.bucket_indices()) for i in idx}}


class _DDPJoinHook(JoinHook):
    """On a rank that ran out of inputs, answers each iteration of the ranks still training:
    the bucket rebuild, the buffer broadcast and one reduced backward's collectives."""

    def __init__(self, ddp: DDPWrapper) -> None:
        self.ddp = ddp

    def main_hook(self) -> None:
        ddp = self.ddp
        sync, rebuild, _, buffers_from, sync_buffers = ddp._join_agree(False, False, active=False)
        if rebuild:
            ddp._rebuild_buckets(ddp._reducer.arrival_order())
        if sync_buffers:
            with torch.no_grad():
                ddp._broadcast_coalesced(ddp._current_buffers(), src=buffers_from)
        if sync:
            ddp._reducer.shadow_reduction()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.ddp._sync_final_model(is_last_joiner)


def _env_flag(name: str) -> Optional[bool]:
    """An on/off environment setting: None when unset or ``auto``."""
    value = os.environ.get(name, "").strip().lower()
    if value in ("", "auto"):
        return None
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={os.environ[name]!r} is not understood; set it to 1, 0 or auto (or unset it)")


_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.uint8, torch.int8, torch.bool, torch.complex64]


def _dtype_code(dtype: torch.dtype) -> int:
    return _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES)


_META_FIELDS = 4  # numel, ndim, requires_grad, dtype code; the full shape follows


def _param_meta(p: torch.Tensor, width: int) -> list[int]:
    """One parameter's row of the cross-rank model check, zero-padded to ``width``."""
    row = [p.numel(), p.dim(), int(p.requires_grad), _dtype_code(p.dtype), *p.shape]
    return row + [0] * (width - len(row))


def _describe(row: torch.Tensor) -> str:
    """A row of :func:`_param_meta` as the mismatch message shows it."""
    numel, ndim, _requires_grad, code = (int(v) for v in row[:_META_FIELDS])
    shape = tuple(int(v) for v in row[_META_FIELDS:_META_FIELDS + ndim])
    dtype = _DTYPES[code] if code < len(_DTYPES) else "other"
    return f"shape {shape} ({numel} elements), dtype {dtype}"


__all__ = ["DDPWrapper", "assign_buckets"]
