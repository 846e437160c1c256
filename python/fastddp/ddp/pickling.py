"""DDPWrapper's pickling: ``copy.deepcopy(model)`` and ``torch.save(model)`` work as with torch
DDP (default process group only). The copy keeps the module and the settings and rebuilds its
reducer without any collective, on the process group's transport, so that a copy made on one
rank (an EMA or evaluation model) cannot hang the others."""

from __future__ import annotations

from typing import Any, Callable

import torch.distributed as dist
from torch import nn

from .buckets import default_first_bucket_mb
from .logging_data import RunLog


class Pickling:
    """``__getstate__``/``__setstate__`` of the wrapper; it provides ``_build_reducer``."""

    process_group: Any
    _world_size: int
    _rank: int
    _build_reducer: Callable[[], None]
    _select_parameters: Callable[..., Any]

    def __getstate__(self) -> dict[str, Any]:
        """``copy.deepcopy(model)`` and ``torch.save(model)`` as with torch DDP: everything but
        the process group and the C++ reducer, which the copy rebuilds. Like torch, only for a
        wrapper on the default process group."""
        if not dist.is_initialized():  # torch DDP's type: its look-up of the default group raises
            raise ValueError("DDPWrapper: pickling or deep-copying needs the default process group, and none is "
                             "initialised (this wrapper was built on process_group=). Copy or save ddp.module "
                             "(or its state_dict()) instead.")
        if self.process_group is not dist.group.WORLD:
            raise RuntimeError("DDPWrapper: pickling or deep-copying is supported only for a wrapper on the "
                               "default process group (as with torch DDP); this one was built with "
                               "process_group= or device_mesh=. Copy or save ddp.module (or its state_dict()) "
                               "instead.")
        state = dict(self.__dict__)
        for name in ("process_group", "_reducer", "_sparse", "device_mesh", "_bucket_visitors", "_armed"):
            state.pop(name, None)
        # torch's copy builds a reducer without the communication hook (plain averaging, and
        # the copy may register one of its own): so does this one.
        state["_comm_hook"], state["_python_hook"] = None, None
        state["comm_dtype"] = state.get("_comm_dtype_arg")
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("DDPWrapper: unpickling a wrapper needs the default process group; call "
                               "torch.distributed.init_process_group(...) before torch.load / deepcopy.")
        if "forward_sync_buffers" not in state:  # pickled by a fastddp that stored the old name
            state["forward_sync_buffers"] = state.pop("broadcast_buffers", True)
        state.setdefault("_first_bucket_mb", default_first_bucket_mb())  # pickled before the setting existed
        if "_has_rebuilt_buckets" not in state:  # pickled by a fastddp that stored the old name
            state["_has_rebuilt_buckets"] = state.pop("_buckets_rebuilt", False)
        if "_before_rebuild" in state:  # pickled by a fastddp that kept the arrival order beside the sizes
            before = state.pop("_before_rebuild")
            state["_sizes_before_rebuild"] = None if before is None else before[0]
        state.setdefault("_sizes_before_rebuild", None)
        if "_comm_dtype_arg" not in state:  # pickled with its hook and without the constructor's comm_dtype
            state["_comm_dtype_arg"] = state["comm_dtype"] if state.get("_comm_hook") is None else None
            state["_comm_hook"], state["_python_hook"] = None, None
            state["comm_dtype"] = state["_comm_dtype_arg"]
        for name in ("rank", "world_size"):  # pickled by a fastddp that stored them public
            state.pop(name, None)
        nn.Module.__setstate__(self, state)
        self.process_group = dist.group.WORLD
        self._world_size = dist.get_world_size()
        self._rank = dist.get_rank()
        # A copy is often made on one rank only (an EMA or evaluation model): its reducer must
        # not negotiate shared memory, a collective the other ranks would never join.
        self._shm_requested = None
        self._is_copy = True
        self._bucket_visitors = []  # the copy's consumers register their own
        self._armed = (-1, [], False)  # no forward of the copy awaits its backward
        self._run_log = RunLog()  # torch's copy starts a new logger
        # The parameters as the module holds them now (torch's copy rebuilds its list too): one
        # frozen, unfrozen or replaced since the wrapper was built (load_state_dict(assign=True))
        self._select_parameters(self.module, self.device_ids, self.static_graph, self.comm_dtype)
        self._build_reducer()
