"""The batch plan: which indices each batch reads, drawn from the loader's index sampler at the
moments DataLoader's iterator draws them, so that every random draw (the global generator's or
a given one's) happens in DataLoader's order; plus the pieces a resumed pass needs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Optional

import numpy as np
import torch
from torch.utils.data import (
    BatchSampler,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)
from torch.utils.data.distributed import DistributedSampler as TorchDistributedSampler


def draw_base_seed(generator: Optional[torch.Generator]) -> int:
    """The draw DataLoader's iterator makes when it is created (its workers' base seed)."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


def reads_ahead_unobserved(index_sampler: Any) -> bool:
    """True when reading ``index_sampler`` ahead of the consumer is invisible: every draw its
    iteration makes from a generator the caller can see happens at its first item (torch's
    samplers and fastddp's), so only the first read must wait for DataLoader's moment."""
    from ..sampler import DistributedSampler as FastSampler
    from .shuffle import EpochShuffle

    if type(index_sampler) is not BatchSampler:
        return False
    inner = index_sampler.sampler
    if type(inner) is RandomSampler:
        return inner.generator is None  # else later permutations are drawn from that generator
    return type(inner) in (SequentialSampler, SubsetRandomSampler, WeightedRandomSampler,
                           TorchDistributedSampler, FastSampler, EpochShuffle, range, list, tuple)


_BOOLS = frozenset((bool, np.bool_))  # neither type can be subclassed: a type test suffices


class PlanEntry:
    """One batch of the plan: ``indices`` as an int64 tensor of rows in range (gathered
    natively), or ``raw`` (the sampler's own output, read through the dataset in Python: an
    index DataLoader would refuse raises there, at this batch)."""

    __slots__ = ("indices", "number", "raw")

    def __init__(self, number: int, indices: Optional[torch.Tensor], raw: Any) -> None:
        self.number, self.indices, self.raw = number, indices, raw


def to_entry(number: int, batch: Any, rows: int) -> PlanEntry:
    """Classify the sampler's ``batch``: integer indices in ``[-rows, rows)`` are gathered
    natively (negative ones count from the end, as indexing does); anything else is read in
    Python, so that it fails or succeeds exactly as DataLoader's indexing does."""
    if isinstance(batch, (list, tuple)) and not _BOOLS.isdisjoint(map(type, batch)):
        return PlanEntry(number, None, batch)  # as_tensor would read True as 1; indexing does not
    try:
        idx = torch.as_tensor(batch)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        return PlanEntry(number, None, batch)
    if (idx.dim() != 1 or idx.numel() == 0 or idx.dtype == torch.bool
            or idx.is_floating_point() or idx.is_complex()):
        return PlanEntry(number, None, batch)
    idx = idx.to(torch.int64)
    # The range check costs a few microseconds per batch: on a list (the usual BatchSampler
    # output, integers once as_tensor says so) Python's min/max beat tensor reductions.
    lo, hi = (min(batch), max(batch)) if isinstance(batch, list) else (int(idx.min()), int(idx.max()))
    if lo < -rows or hi >= rows:
        return PlanEntry(number, None, batch)
    return PlanEntry(number, torch.where(idx < 0, idx + rows, idx) if lo < 0 else idx, batch)


class SkippingSampler:
    """An index sampler whose next iterator first drops ``skip`` items (the batches a resumed
    pass has already delivered), reading them from the wrapped sampler so its draws happen."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.skip = 0
        self.current: Optional[SkippingIterator] = None

    def __iter__(self) -> SkippingIterator:
        self.current = SkippingIterator(iter(self.inner), self.skip)
        self.skip = 0
        return self.current

    def __len__(self) -> int:
        return len(self.inner)


class SkippingIterator:
    def __init__(self, inner: Iterator[Any], skip: int) -> None:
        self.inner, self.skip = inner, skip

    def prime(self) -> None:
        """Read and drop the skipped items now (idempotent)."""
        while self.skip:
            self.skip -= 1
            next(self.inner, None)

    def __iter__(self) -> SkippingIterator:
        return self

    def __next__(self) -> Any:
        self.prime()
        return next(self.inner)


@contextlib.contextmanager
def replaying(rng_state: Optional[torch.Tensor], generator: Optional[torch.Generator],
              generator_state: Optional[torch.Tensor]) -> Iterator[None]:
    """Around the start of a resumed pass: the draws it makes come from the state the saved
    pass started from, so it redraws that pass's order. A given generator is left where that
    pass left it; the global generator is left untouched (the caller restores it with the rest
    of its training state)."""
    if generator is not None and generator_state is not None:
        generator.set_state(generator_state)
    if rng_state is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.random.set_rng_state(rng_state)
        yield
