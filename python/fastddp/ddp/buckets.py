"""DDPWrapper's gradient buckets. The C++ reducer owns the layout (torch DDP's bucket
assignment, 64-byte alignment in shared memory, the rebuild in arrival order); this module
configures it with a :class:`fastddp._C.ReducerOptions` and reports on it."""

from __future__ import annotations

import atexit
import os
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from .. import diag
from .._ext import C
from .._pg_options import group_timeout_s
from .checks import env_flag
from .comm_hooks import hook_name
from .fingerprint import fingerprint_setting
from .logging_data import bucket_bytes, logging_data
from .sparse import SparseGradients

_MIB = 1024 * 1024

# At interpreter exit: a shared-memory peer still waiting for this rank is told that this
# rank's process ended, not that it destroyed its wrapper (the wrapper goes with the process)
atexit.register(C.shm_process_exiting)


def default_first_bucket_mb() -> float:
    """torch DDP's first bucket with the default cap: ``dist._DEFAULT_FIRST_BUCKET_BYTES``
    (1 MiB), read when a wrapper is built, as torch reads it (users may set it to tune)."""
    return dist._DEFAULT_FIRST_BUCKET_BYTES / _MIB


def bucket_limits_mb(bucket_cap_mb: Optional[float], caps_mb: Optional[list[float]]) -> tuple[float, float]:
    """torch DDP's bucket cap and first-bucket cap, in MiB: ``bucket_cap_mb_list`` replaces
    ``bucket_cap_mb`` (its largest entry); the default (None) is 25 MiB with a first bucket of
    ``dist._DEFAULT_FIRST_BUCKET_BYTES``; an explicit cap is the first bucket's too."""
    if caps_mb:
        return max(caps_mb), max(caps_mb)
    if bucket_cap_mb is None:
        return 25.0, default_first_bucket_mb()
    return float(bucket_cap_mb), float(bucket_cap_mb)


def _bucket_options(bucket_cap_mb: float, first_bucket_mb: float, caps_mb: Optional[list[float]]) -> Any:
    options = C.ReducerOptions()
    options.bucket_cap_mb = float(bucket_cap_mb)
    options.first_bucket_mb = float(first_bucket_mb)
    options.bucket_caps_mb = [float(c) for c in caps_mb or ()]
    return options


def assign_buckets(params: list[torch.Tensor], bucket_cap_mb: Optional[float] = None, *,
                   order: Optional[list[int]] = None, caps_mb: Optional[list[float]] = None,
                   find_unused_parameters: bool = False, static_graph: bool = False) -> list[list[int]]:
    """torch DDP's bucket layout for ``params`` (parameter indices per bucket, in the order
    each bucket lays them out), as DDPWrapper builds it: at construction, or, with ``order``
    (gradient arrival order), after the rebuild. ``bucket_cap_mb`` None is torch's default
    (25 MiB, the rebuilt layout's first bucket ``dist._DEFAULT_FIRST_BUCKET_BYTES``);
    ``caps_mb`` is torch's ``bucket_cap_mb_list``."""
    caps = [float(c) for c in caps_mb or ()]
    options = _bucket_options(*bucket_limits_mb(bucket_cap_mb, caps), caps)
    options.find_unused_parameters = bool(find_unused_parameters)
    options.static_graph = static_graph
    if order is None:
        return C.initial_buckets(list(params), options)
    return C.rebuilt_buckets(list(params), list(order), options)


class Buckets:
    """DDPWrapper's reducer construction and bucket reports (a part of the wrapper: it reads
    the wrapper's settings and owns ``_reducer``)."""

    def _init_bucket_state(self, caps_mb: list[float], shm_allreduce: Optional[bool]) -> None:
        """The bucket settings and state this part owns, set before the reducer is built."""
        self._has_rebuilt_buckets = False  # torch DDP's name (ddp_zero_hook reads it)
        self._sizes_before_rebuild: Optional[list[int]] = None  # see _rebuild_buckets
        self._bucket_caps_mb = caps_mb
        self._shm_requested = shm_allreduce
        self._bucket_visitors: list[Any] = []  # see register_bucket_visitor

    def _reducer_options(self) -> Any:
        options = _bucket_options(self._bucket_cap_mb, self._first_bucket_mb, self._bucket_caps_mb)
        options.gradient_as_bucket_view = bool(self.gradient_as_bucket_view)
        options.find_unused_parameters = bool(self.find_unused_parameters)
        options.static_graph = self.static_graph
        options.comm_dtype = self.comm_dtype
        # torch's allreduce_hook divides each gradient by the world size, its reducer multiplies
        options.divide_gradients = self._comm_hook is default_hooks.allreduce_hook
        # a Python hook reduces through its own collectives; a copy (deepcopy / unpickled)
        # does no set-up collective
        options.shm_allreduce = (None if self._python_hook is not None or self._is_copy
                                 else self._shm_wish(self._params, self._shm_requested))
        options.shm_timeout_s = self._timeout_s()
        options.shm_broadcast_bytes = self._buffer_bytes()
        options.batch_copies = True if self.batched_grad_copy else env_flag("FASTDDP_BATCH_GRAD_COPIES")
        options.single_rank_passthrough = env_flag("FASTDDP_WORLD1_PASSTHROUGH") is not False
        options.fingerprint, options.fingerprint_unused = fingerprint_setting()
        return options

    def _build_reducer(self) -> None:
        """(Re)creates the C++ reducer from this wrapper's settings (a collective when the
        ranks negotiate shared memory)."""
        state, hook = self._python_hook if self._python_hook is not None else (None, None)
        self._reducer = C.Reducer(self._params, self._param_names, self.process_group, self._reducer_options(),
                                  comm_hook_state=state, comm_hook=hook)
        previous = getattr(self, "_sparse", None)
        if previous is not None:  # its hooks would queue a second reduction
            previous.close()
        self._sparse = SparseGradients(self._sparse_names, self._sparse_params, self._reduced_params,
                                       self.process_group, bool(self.find_unused_parameters))
        for visitor in self._bucket_visitors:  # a replaced reducer keeps them
            self._reducer.add_bucket_visitor(visitor)
        requested = self._shm_requested
        note = self._reducer.transport_note
        own_failure = note.startswith(("shm_open", "reserving", "segment", "mmap", "cannot"))
        if requested is None and self._reducer.transport != "shm" and (
                own_failure or (self._rank == 0 and note.startswith("rank "))):
            # Wanted and possible in principle, but the mapping failed: the failing rank (and
            # rank 0) say so.
            warnings.warn(f"DDPWrapper: all-reducing through the process group, not shared memory: {note}",
                          RuntimeWarning, stacklevel=3)
        if requested and self._reducer.transport != "shm":
            raise RuntimeError(f"DDPWrapper: shm_allreduce=True but the ranks cannot all-reduce through shared "
                               f"memory: {note}. Pass shm_allreduce=None to fall back to the process "
                               "group's backend.")

    def _shm_wish(self, params: list[torch.Tensor], requested: Optional[bool]) -> Optional[bool]:
        """None: no shared-memory handshake (one process, or not a CPU model). Otherwise this
        rank's wish, agreed with the other ranks' in the handshake."""
        if self._world_size == 1 or not params or any(p.device.type != "cpu" for p in params):
            if requested:
                raise ValueError("DDPWrapper: shm_allreduce=True needs CPU parameters and more than one "
                                 f"process (world size {self._world_size}, devices "
                                 f"{sorted({str(p.device) for p in params})})")
            return None
        if requested is not None:
            return bool(requested)
        return os.environ.get("FASTDDP_SHM_ALLREDUCE", "1").strip().lower() not in ("0", "false", "no", "off")

    def _buffer_bytes(self) -> int:
        """Room for the per-forward buffer broadcast in the shared-memory mapping (CPU buffers,
        packed by the reducer's alignment rule)."""
        if not self.forward_sync_buffers or any(b.device.type != "cpu" for b in self._module_buffers):
            return 0
        return C.Reducer.packed_bytes(self._module_buffers)

    def _timeout_s(self) -> float:
        """The process group's timeout (a shared-memory wait for a live peer gives up after it):
        its CPU backend's, else torch's default for process groups."""
        return group_timeout_s(self.process_group)

    def _rebuild_due(self) -> bool:
        """torch DDP's rule: the buckets are rebuilt once, before the first reducing forward after
        a reduced backward (with static_graph after the second; never under
        find_unused_parameters alone: the reducer then records no arrival order)."""
        return not self._has_rebuilt_buckets and bool(self._reducer.arrival_order())

    def _rebuild_if_due(self) -> bool:
        """Rebuild the buckets if torch's rule says they are due; True when it did."""
        if not self._rebuild_due():
            return False
        self._rebuild_buckets()
        return True

    def _graph_static(self) -> bool:
        return self._reducer.graph_static

    def _rebuild_buckets(self) -> None:
        """Once, after the reduced backward whose arrival order the reducer kept (torch DDP's
        rule, layout.h): the reducer re-buckets in that order (group rank 0's, so every rank
        issues the same collectives)."""
        self._has_rebuilt_buckets = True
        # torch DDP's logger keeps the sizes before the rebuild
        self._sizes_before_rebuild = bucket_bytes(self._params, self._reducer.bucket_indices())
        with diag.phase(diag.Phase.REBUILD):
            self._reducer.rebuild_buckets_in_arrival_order()

    def _get_ddp_logging_data(self) -> dict[str, Any]:
        """torch DDP's dict of its configuration and bucket layout (see logging_data.py)."""
        self._run_log.note_reducer_error(self._reducer.logged_error)
        return logging_data(self, self._params, self._reducer.bucket_indices(), self._sizes_before_rebuild,
                            self._run_log)

    def _rebuilt_layout(self) -> Optional[tuple[list[int], list[list[int]]]]:
        """The buckets' sizes and parameter indices once they were rebuilt (None before)."""
        if not self._has_rebuilt_buckets:
            return None
        layout = self._reducer.bucket_indices()
        return bucket_bytes(self._params, layout), layout

    def _set_ddp_runtime_logging_sample_rate(self, sample_rate: int) -> None:
        """torch DDP's: after the first 10 iterations, sample the runtime statistics of
        ``_get_ddp_logging_data()`` every ``sample_rate`` iterations (default 100)."""
        self._run_log.set_sample_rate(sample_rate, self._reducer.logged_error)

    @property
    def transport(self) -> str:
        """``"shm"`` when the buckets are reduced through shared memory, else ``"c10d"``."""
        return self._reducer.transport

    def bucket_buffers(self) -> list[torch.Tensor]:
        """The tensors that hold the averaged gradients after backward, e.g. for
        :class:`fastddp.GradScaler`'s ``grads=``: the flat bucket buffers (``param.grad`` are
        views into them with ``gradient_as_bucket_view=True``, lent aliases of them where nobody
        else holds a gradient without it), or, in a world of one where
        nothing is bucketed (see the class documentation), the parameters' ``.grad`` tensors
        themselves (those that exist). Sparse gradients (``nn.Embedding(sparse=True)``) are never
        among them: for a model with such layers, use the parameters' ``.grad``.

        On the shared-memory transport large gradients are reduced in place in ``.grad``, their
        bucket slots left unwritten; the first call brings them into the buckets (``.grad``
        becomes an alias of its slot, as above) and keeps every later backward's gradients
        there."""
        if self._reducer.passthrough:
            return [p.grad for p in self._params if p.grad is not None]
        self._reducer.hold_grads_in_buckets()
        return self._reducer.bucket_buffers()

    def reduced_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters whose gradients this wrapper reduces (those that require a gradient
        and are not ignored, sparse ones included), in registration order."""
        return list(self._reduced_params)

    def reduced_gradients(self) -> Optional[list[torch.Tensor]]:
        """The flat bucket buffers when they hold the reduced gradients now (``param.grad`` are
        views or lent aliases of them, not a world of one, and no backward since the last
        reduced one put a gradient elsewhere), so that a consumer such as
        :class:`fastddp.GradScaler` can work on a few flat tensors; else None (use the
        parameters' ``.grad``): never with sparse gradients, which are not in the buckets."""
        if self._sparse_names or not self._reducer.grads_in_buckets:
            return None
        return self._reducer.bucket_buffers()

    def register_bucket_visitor(self, visitor: Any) -> None:
        """Registers a post-reduction visitor (a ``fastddp._C.BucketVisitor``, e.g. the one
        :class:`fastddp.GradScaler` makes for its inf/NaN check and norm): in every reduced
        backward it sees each flat bucket as soon as that bucket's reduced values are final,
        while the later buckets are still being reduced. It stays registered for the
        wrapper's life."""
        if not isinstance(visitor, C.BucketVisitor):
            raise TypeError(f"DDPWrapper.register_bucket_visitor: expected a fastddp._C.BucketVisitor (e.g. "
                            f"fastddp._C.amp_bucket_stats()), got {type(visitor).__name__}")
        self._reducer.add_bucket_visitor(visitor)
        self._bucket_visitors.append(visitor)

    def bucket_report(self) -> dict[str, Any]:
        """Bucket sizes, which parameter sits in which bucket, and the last measured
        all-reduce time of each bucket (launch to completion, ms; None before any; 0 in a
        world of one, where no collective is issued)."""
        indices = self._reducer.bucket_indices()
        times = self._reducer.bucket_allreduce_ms()
        shm = self._reducer.bucket_shm()
        buckets = []
        for b, (idx, buf) in enumerate(zip(indices, self._reducer.bucket_buffers())):
            buckets.append({
                "index": b, "bytes": buf.numel() * buf.element_size(), "numel": buf.numel(),
                "dtype": str(buf.dtype), "device": str(self._params[idx[0]].device),
                "params": [self._param_names[i] for i in idx],
                "allreduce_ms": times[b] if times[b] >= 0 else None,
                "transport": "shm" if shm[b] else "c10d",
            })
        return {"world_size": self._world_size, "bucket_cap_mb": self._bucket_cap_mb,
                "transport": self._reducer.transport, "transport_note": self._reducer.transport_note,
                "first_bucket_mb": self._first_bucket_mb, "comm_dtype": str(self.comm_dtype),
                "passthrough": self._reducer.passthrough, "batch_copies": self._reducer.batch_copies,
                "relocations": self._reducer.relocations,
                "comm_hook": None if self._comm_hook is None else hook_name(self._comm_hook),
                "buckets": buckets,
                "param_to_bucket": {self._param_names[i]: b for b, idx in enumerate(indices) for i in idx}}
