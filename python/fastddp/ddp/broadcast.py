"""Broadcast of parameters and buffers from one rank of a group: one collective per (device,
dtype) over a flattened copy, as torch DDP's coalesced broadcast; and DDPWrapper's use of it,
at construction and before forwards (``ModuleStateSync``)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .. import diag


def broadcast_coalesced(tensors: list[torch.Tensor], group: dist.ProcessGroup, src: int) -> None:
    """Copy group rank ``src``'s ``tensors`` into every rank's (in place)."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    for same in groups.values():
        flat = _flatten_dense_tensors(same)
        dist.broadcast(flat, group=group, group_src=src)
        for t, synced in zip(same, _unflatten_dense_tensors(flat, same)):
            t.copy_(synced)


class ModuleStateSync:
    """DDPWrapper's parameter and buffer sync: rank 0's parameters (and buffers) at
    construction, its buffers before forwards by torch DDP's rule. Reads the wrapper's
    ``module``, ``parameters_to_ignore``, ``forward_sync_buffers``, ``process_group`` and reducer."""

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
        return list(self.named_module_buffers.values())

    def will_sync_module_buffers(self) -> bool:
        """Whether the next forward syncs the module's buffers (torch DDP's rule: buffer sync
        on, buffers to sync, and the last forward a reducing one; a world of one then has
        nothing to send)."""
        return self.require_forward_param_sync and self.forward_sync_buffers and bool(self._module_buffers)

    @torch.no_grad()
    def _sync_module_states(self, buffers: bool = True) -> None:
        """Broadcast parameters (and buffers) from rank 0 (one collective per dtype/device)."""
        if self._world_size == 1:
            return
        tensors = self._synced_params() + (self._synced_buffers() if buffers else [])
        self._broadcast_coalesced(tensors)

    def _broadcast_coalesced(self, tensors: list[torch.Tensor], src: int = 0) -> None:
        """Broadcast ``tensors`` from group rank ``src``, one collective per (device, dtype)."""
        with diag.phase(diag.Phase.BROADCAST):
            broadcast_coalesced(tensors, self.process_group, src)

    @torch.no_grad()
    def _sync_buffers_before_forward(self, src: int) -> None:
        """Group rank ``src``'s buffers into every rank's (``src`` is 0 but inside join(), where
        rank 0 may have joined with stale buffers): co-located CPU ranks copy them through
        shared memory (while they fit the room reserved at construction), others over c10d.
        As in torch DDP, the copy keeps each buffer's autograd version counter, so a graph that
        saved a buffer (a mask, BatchNorm's statistics) in an earlier forward still backwards."""
        buffers = self._current_buffers()
        with torch.autograd._unsafe_preserve_version_counter(tuple(buffers)):
            if not self._join_config.enable and self._reducer.broadcast_buffers(buffers):
                return  # the reducer's broadcast marks its own diag phase
            self._broadcast_coalesced(buffers, src=src)

    def _syncs_buffers(self) -> bool:
        return self.forward_sync_buffers and self._world_size > 1 and bool(self._module_buffers)
