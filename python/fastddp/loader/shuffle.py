"""``PrefetchLoader(shuffle=True, seed=s)``: an order that depends on the epoch only."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

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
