"""``PrefetchLoader(shuffle=True, seed=s)``: an order that depends on the epoch only."""

from __future__ import annotations

import operator
from collections.abc import Iterator
from typing import Any, Optional

import torch


class EpochShuffle:
    """The permutation of ``seed + epoch`` over the samples of ``data_source`` (its length
    read when a pass starts). ``set_epoch(e)`` picks the
    epoch of the next pass; a pass not preceded by ``set_epoch`` takes the epoch after the
    previous one. It draws nothing from any other generator."""

    def __init__(self, data_source: Any, seed: int) -> None:
        self.data_source, self.seed = data_source, int(seed)
        self.epoch = 0
        self._pinned = True  # the next pass keeps self.epoch

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)
        self._pinned = True

    @property
    def upcoming_epoch(self) -> int:
        """The epoch the next iterator uses."""
        return self.epoch if self._pinned else self.epoch + 1

    def __iter__(self) -> Iterator[int]:
        if not self._pinned:
            self.epoch += 1
        self._pinned = False
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(len(self.data_source), generator=g).tolist())

    def __len__(self) -> int:
        return len(self.data_source)


def epoch_targets(sampler: Any, batch_sampler: Any) -> list[Any]:
    """What a loader's ``set_epoch`` reaches: the sampler, and the batch sampler (or, when it
    has no ``set_epoch``, the sampler inside it), each once, those with a ``set_epoch``."""
    inner = getattr(batch_sampler, "sampler", None)
    bs = batch_sampler if hasattr(batch_sampler, "set_epoch") else inner
    return [s for s in {id(sampler): sampler, id(bs): bs}.values() if s is not None and hasattr(s, "set_epoch")]


def sampler_epoch(sampler: Any, batch_sampler: Any) -> Optional[int]:
    """The ``epoch`` of the first of :func:`epoch_targets` that has an integer one (torch's and
    fastddp's DistributedSampler, ``seed=``'s shuffle), else None."""
    for s in epoch_targets(sampler, batch_sampler):
        try:
            return operator.index(getattr(s, "epoch", None))
        except TypeError:
            continue
    return None


def sampler_states(sampler: Any, batch_sampler: Any) -> dict[str, Any]:
    """The samplers' states as a pass starting now finds them: a sampler that can say where
    its next iterator starts (``pending_state_dict``, fastddp's) says so; the delivered
    batches are counted by the loader, not by the sampler's position."""
    states = {}
    for name, obj in (("sampler", sampler), ("batch_sampler", batch_sampler)):
        get = getattr(obj, "pending_state_dict", None) or getattr(obj, "state_dict", None)
        if get is not None:
            states[name] = get()
    return states


def load_sampler_states(sampler: Any, batch_sampler: Any, state: dict[str, Any]) -> None:
    """Each sampler that has ``load_state_dict`` loads its entry of a loader's ``state``."""
    for name, obj in (("sampler", sampler), ("batch_sampler", batch_sampler)):
        if obj is not None and name in state and hasattr(obj, "load_state_dict"):
            obj.load_state_dict(state[name])
