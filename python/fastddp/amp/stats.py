"""The gradients' statistics (inf/NaN flag and sum of squares, one float64): computed in one
read pass, or taken from a DDPWrapper's reduction, which sums the squares of each bucket as its
all-reduce completes."""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch

from .._ext import C

# One statistics visitor per DDPWrapper, shared by every scaler that steps it (the reduction
# computes the statistics once; the first consumer of a backward takes them).
_BUCKET_STATS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def bucket_stats(ddp: Any) -> Any:
    """The statistics visitor on ``ddp``'s reduction, registered on first use: it sums the
    squares of each reduced bucket while the later buckets are still on the wire."""
    visitor = _BUCKET_STATS.get(ddp)
    if visitor is None:
        devices = {b.device for b in ddp.bucket_buffers()}
        if len(devices) > 1:
            raise ValueError("GradScaler.fused_step(ddp=...): the wrapper's gradient buckets are on several devices "
                             f"({', '.join(sorted(map(str, devices)))}); pass grads=... instead")
        visitor = C.amp_bucket_stats()
        ddp.register_bucket_visitor(visitor)
        _BUCKET_STATS[ddp] = visitor
    return visitor


def take_reduced_stats(ddp: Any) -> Optional[torch.Tensor]:
    """The float64[1] sum of squares of ``ddp``'s last reduced backward, once; None when no
    fresh one exists (nothing reduced since, or the gradients changed after it)."""
    visitor = _BUCKET_STATS.get(ddp)
    return None if visitor is None else C.amp_take_bucket_stats(visitor)


def grad_stats(grads: list[torch.Tensor], device: torch.device, ddp: Any = None) -> torch.Tensor:
    """The statistics of ``grads`` as a float64[1] tensor on ``device``: ``ddp``'s reduced
    ones when fresh, else one pass over the gradients (NaN for an inf/NaN element)."""
    if ddp is not None:
        stats = take_reduced_stats(ddp)
        if stats is not None:
            return stats
    stats = torch.zeros(1, dtype=torch.float64, device=device)
    if grads:
        C.amp_accumulate_stats_(grads, stats)
    return stats
