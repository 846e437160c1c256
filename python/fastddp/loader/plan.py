"""The batch plan: which indices each batch reads, drawn from the loader's index sampler at the
moments DataLoader's iterator draws them, so that every random draw (the global generator's or
a given one's) happens in DataLoader's order; plus the pieces a resumed pass needs."""

from __future__ import annotations

import array
import contextlib
import functools
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
    samplers and fastddp's), so only the first read must wait for DataLoader's moment. A list
    is not: a loop may change what is left of it during the pass, and DataLoader's batch
    sampler reads it item by item (a tuple or range cannot change)."""
    from ..sampler import DistributedSampler as FastSampler
    from .shuffle import EpochShuffle

    if type(index_sampler) is not BatchSampler:
        return False
    inner = index_sampler.sampler
    if type(inner) is RandomSampler:
        return inner.generator is None  # else later permutations are drawn from that generator
    return type(inner) in (SequentialSampler, SubsetRandomSampler, WeightedRandomSampler,
                           TorchDistributedSampler, FastSampler, EpochShuffle, range, tuple)


_BOOLS = frozenset((bool, np.bool_))  # neither type can be subclassed: a type test suffices
# Index dtypes that indexing a tensor reads as a mask (uint8: torch's legacy mask), not as rows
_MASKS = (torch.bool, torch.uint8)


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
    if isinstance(batch, (list, tuple)):
        types = set(map(type, batch))
        if not _BOOLS.isdisjoint(types):
            return PlanEntry(number, None, batch)  # as_tensor would read True as 1; indexing does not
        if any(issubclass(t, (torch.Tensor, np.ndarray)) for t in types) and any(
                isinstance(i, np.ndarray) or (isinstance(i, torch.Tensor) and i.dim() != 0) for i in batch):
            # as_tensor flattens tensor([i]) where indexing keeps its dimension, and warns about
            # (or refuses) lists of arrays: indexing decides what they mean
            return PlanEntry(number, None, batch)
    try:
        idx = torch.as_tensor(batch)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        return PlanEntry(number, None, batch)
    if (idx.dim() != 1 or idx.numel() == 0 or idx.dtype in _MASKS
            or idx.is_floating_point() or idx.is_complex()):
        return PlanEntry(number, None, batch)
    idx = idx.to(torch.int64)
    # The range check costs a few microseconds per batch: on a list (the usual BatchSampler
    # output, integers once as_tensor says so) Python's min/max beat tensor reductions.
    lo, hi = (min(batch), max(batch)) if isinstance(batch, list) else (int(idx.min()), int(idx.max()))
    if lo < -rows or hi >= rows:
        return PlanEntry(number, None, batch)
    return PlanEntry(number, torch.where(idx < 0, idx + rows, idx) if lo < 0 else idx, batch)


def read_whole_pass(index_sampler: BatchSampler, rows: int) -> tuple[Optional[torch.Tensor], list[PlanEntry]]:
    """Every batch one iterator of ``index_sampler`` yields, read at once (for samplers whose
    reads ahead are unobserved, see :func:`reads_ahead_unobserved`). When every index is an
    integer in range, the batches are the consecutive ``batch_size`` slices of the returned
    tensor (the caller submits it in one call) and no entry is made; otherwise each batch is the
    list BatchSampler yields, classified by :func:`to_entry`."""
    from ..sampler import DistributedSampler as FastSampler

    inner, size = index_sampler.sampler, index_sampler.batch_size
    items: Any
    if type(inner) is FastSampler:
        items = inner.iter_indices()
    elif type(inner) is SequentialSampler:
        items = torch.arange(len(inner.data_source), dtype=torch.int64)
    elif type(inner) is RandomSampler and inner.generator is None and not inner.replacement \
            and random_sampler_replay_matches():
        items = replay_random_sampler(inner)
    else:
        items = list(iter(inner))
    end = len(items) - len(items) % size if index_sampler.drop_last else len(items)
    if end < len(items):
        items = items[:end]
    idx = _in_range(items, rows)
    if idx is not None:
        return idx, []
    if isinstance(items, torch.Tensor):
        items = items.tolist()
    return None, [to_entry(k, items[start:start + size], rows) for k, start in enumerate(range(0, end, size))]


def replay_random_sampler(sampler: RandomSampler) -> torch.Tensor:
    """What one iterator of ``sampler`` (no generator, no replacement) yields, computed as a
    tensor with the same draws: a seed from the global generator, then one ``randperm`` per full
    pass over the data and one for the remainder. Used only while
    :func:`random_sampler_replay_matches` says the installed torch draws this way."""
    n, total = len(sampler.data_source), sampler.num_samples
    seed = int(torch.empty((), dtype=torch.int64).random_().item())
    generator = torch.Generator().manual_seed(seed)
    parts = [torch.randperm(n, generator=generator) for _ in range(total // n)]
    if total % n:  # (torch also draws this permutation when it takes none of it: from a
        parts.append(torch.randperm(n, generator=generator)[: total % n])  # private generator)
    return torch.cat(parts) if len(parts) > 1 else parts[0]


@functools.cache
def random_sampler_replay_matches() -> bool:
    """True when :func:`replay_random_sampler` gives what torch's RandomSampler gives, values
    and global random state alike (checked once per process, on a small case)."""
    with torch.random.fork_rng(devices=[]):
        sampler = RandomSampler(range(7), num_samples=17)
        torch.manual_seed(20261125)
        expected = list(iter(sampler))
        expected_state = torch.random.get_rng_state()
        torch.manual_seed(20261125)
        got = replay_random_sampler(sampler).tolist()
        return got == expected and torch.equal(torch.random.get_rng_state(), expected_state)


def _in_range(items: Any, rows: int) -> Optional[torch.Tensor]:
    """``items`` as an int64 tensor of rows (negative ones counted from the end), or None when
    any item is not an integer index in ``[-rows, rows)``."""
    if isinstance(items, torch.Tensor):
        idx = items
    elif not items or set(map(type, items)) != {int}:
        return None  # bools, floats, tensors, strings...: classified batch by batch
    else:
        try:
            idx = torch.frombuffer(array.array("q", items), dtype=torch.int64)  # 4x torch.tensor's speed
        except OverflowError:
            return None
    if idx.numel() == 0:
        return None
    lo, hi = int(idx.min()), int(idx.max())
    if lo < -rows or hi >= rows:
        return None
    return torch.where(idx < 0, idx + rows, idx) if lo < 0 else idx


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
