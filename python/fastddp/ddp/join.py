"""Uneven inputs on DDPWrapper (torch DDP's ``join()``): a rank that runs out of data stands in
for the collectives of the ranks still training until every rank is done."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, JoinHook, _JoinConfig

from .. import diag
from . import sparse
from .logging_data import RunLog


class UnevenInputs:
    """DDPWrapper's side of :class:`~torch.distributed.algorithms.Join` (a part of the wrapper:
    it runs the wrapper's collectives on its process group)."""

    _run_log: RunLog

    def _init_join_state(self) -> None:
        self._divide_by_initial_world_size = True  # join()'s setting

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
        sparse.refuse(self._sparse_names, "join()")
        self._divide_by_initial_world_size = bool(kwargs.get("divide_by_initial_world_size", True))
        self._run_log.joined = True  # torch's logger records join() (enabled or not)
        return _DDPJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        """Device of the join protocol's small collectives (the parameters')."""
        return self._reduced_params[0].device

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
        flags = torch.zeros(3 + self._world_size, dtype=torch.int64)
        if active:
            flags[0], flags[1], flags[2], flags[3 + self._rank] = int(sync), int(rebuild), int(sync_buffers), 1
        flags = flags.to(self.join_device)
        with diag.phase(diag.Phase.JOIN):
            dist.all_reduce(flags, group=self.process_group)
        values = flags.tolist()
        ranks = [r for r, v in enumerate(values[3:]) if v]
        return values[0] > 0, values[1] > 0, len(ranks), max(ranks, default=-1), values[2] > 0

    def _shadow_iteration(self) -> None:
        """On a joined rank: answer one iteration of the ranks still training (the bucket
        rebuild, the buffer broadcast and one reduced backward's collectives, as they agreed)."""
        sync, rebuild, n_active, buffers_from, sync_buffers = self._join_agree(False, False, active=False)
        if rebuild:
            self._rebuild_buckets()
        if sync_buffers:
            self._sync_buffers_before_forward(buffers_from)
        if sync:
            self._average_over(n_active)
            with diag.phase(diag.Phase.JOIN):
                self._reducer.shadow_reduction()

    def _average_over(self, n_active: int) -> None:
        """The coming reduction's divisor, on every rank alike (the shared-memory sum scales
        each rank's slice where it is summed): the ranks still training with
        ``divide_by_initial_world_size=False``, else the world size. A registered hook, torch's
        built-in ones too, divides by the group size itself, as under torch DDP."""
        over_active = not self._divide_by_initial_world_size and self._comm_hook is None
        self._reducer.set_reduction_divisor(n_active if over_active else self._world_size)

    def _sync_final_model(self, is_last_joiner: bool) -> None:
        """After join(): every rank takes the parameters and buffers of the highest-ranked
        last joiner (the ranks that joined early skipped optimizer steps)."""
        flags = torch.tensor([self._rank if is_last_joiner else -1], dtype=torch.int64,
                             device=self.join_device)
        with diag.phase(diag.Phase.JOIN):
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.process_group)
        with torch.no_grad():
            tensors = self._synced_params()
            if self.forward_sync_buffers:
                tensors += self._synced_buffers()
            self._broadcast_coalesced(tensors, src=int(flags.item()))
        # The protocol's extra collectives stop with the block, on every rank alike.
        self._join_config = _JoinConfig.construct_disabled_join_config()


class _DDPJoinHook(JoinHook):
    """On a rank that ran out of inputs, answers each iteration of the ranks still training
    (UnevenInputs._shadow_iteration), then takes the final model (_sync_final_model)."""

    def __init__(self, ddp: Any) -> None:
        self.ddp = ddp

    def main_hook(self) -> None:
        self.ddp._shadow_iteration()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.ddp._sync_final_model(is_last_joiner)
