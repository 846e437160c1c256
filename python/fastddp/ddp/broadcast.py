"""Broadcast of parameters and buffers from one rank of a group: one collective per (device,
dtype) over a flattened copy, as torch DDP's coalesced broadcast."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


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
