"""``fastddp.DistributedSampler``: torch's DistributedSampler order, computed in C++ on tensors."""

from __future__ import annotations

import numbers
from collections.abc import Iterator
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from ._ext import C

_ORDERS = {"torch": 0, "stateless": 1}
_CHUNK = 1 << 16  # indices converted to Python ints at a time while iterating


def _check_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"DistributedSampler: {name} must be an integer, got {value!r}")
    if not -(2**63) <= int(value) < 2**63:
        raise ValueError(f"DistributedSampler: {name} must fit in 64 bits "
                         f"(-2**63 <= {name} < 2**63), got {value}")
    return int(value)


class DistributedSampler(torch.utils.data.Sampler[int]):
    """Drop-in for :class:`torch.utils.data.distributed.DistributedSampler`.

    For every (length, num_replicas, rank, shuffle, seed, epoch, drop_last) it yields exactly
    the indices torch's sampler yields, but builds them in C++ as an int64 tensor: no Python
    list of the whole dataset is ever made, so lengths beyond 2**31 work.

    Args:
        dataset: anything with ``__len__``, or the length itself as an int.
        num_replicas: number of ranks (default: the process group's world size, else 1).
        rank: this rank (default: the process group's rank, else 0).
        shuffle: permute the indices each epoch (seeded with ``seed + epoch``).
        seed: base seed, identical on every rank.
        drop_last: drop the tail so every rank gets the same count, instead of padding by
            wrapping around.
        order: ``"torch"`` (default) reproduces torch's order; ``"stateless"`` uses a seeded
            bijection of which each rank computes only its own share, in O(N / replicas) time
            and memory — for huge datasets where even one full permutation is too costly.

    Beyond torch's API: :meth:`indices`, :meth:`batches`, :meth:`state_dict` and
    :meth:`load_state_dict` (resume mid-epoch).
    """

    def __init__(
        self,
        dataset: Union[int, Any],
        num_replicas: Optional[int] = None,
        rank: Optional[int] = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        order: str = "torch",
    ) -> None:
        if isinstance(dataset, numbers.Integral) and not isinstance(dataset, bool):
            length = int(dataset)
        elif hasattr(dataset, "__len__"):
            length = len(dataset)
        else:
            raise TypeError("DistributedSampler: dataset must have __len__ or be an int length, "
                            f"got {type(dataset).__name__}")
        if length < 0:
            raise ValueError(f"DistributedSampler: dataset length must be >= 0, got {length}")
        group = dist.is_available() and dist.is_initialized()
        if num_replicas is None:
            num_replicas = dist.get_world_size() if group else 1
        if rank is None:
            rank = dist.get_rank() if group else 0
        num_replicas = _check_int("num_replicas", num_replicas)
        rank = _check_int("rank", rank)
        if num_replicas <= 0:
            raise ValueError(f"DistributedSampler: num_replicas must be > 0, got {num_replicas}")
        if rank < 0 or rank >= num_replicas:
            raise ValueError(f"DistributedSampler: invalid rank {rank}, rank should be in the "
                             f"interval [0, {num_replicas - 1}]")
        seed = _check_int("seed", seed)
        if order not in _ORDERS:
            raise ValueError(f"DistributedSampler: order must be one of {sorted(_ORDERS)}, got {order!r}")
        self.dataset = dataset
        self.length = length
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = bool(shuffle)
        self.seed = seed
        self.drop_last = bool(drop_last)
        self.order = order
        self.epoch = 0
        self.num_samples = C.sampler_num_samples(length, num_replicas, self.drop_last)
        self.total_size = self.num_samples * num_replicas
        self._position = 0
        self._cache: Optional[tuple[int, torch.Tensor]] = None

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (the shuffle seed is ``seed + epoch``); restarts at its beginning
        unless the same epoch is already selected (so a resumed position survives)."""
        epoch = _check_int("epoch", epoch)
        if epoch != self.epoch:
            self._position = 0
        self.epoch = epoch

    def indices(self) -> torch.Tensor:
        """This rank's indices for the current epoch (all of them, ignoring the position), as
        an int64 CPU tensor. Cached per epoch; treat it as read-only."""
        if self._cache is None or self._cache[0] != self.epoch:
            t = C.sampler_epoch_indices(self.length, self.num_replicas, self.rank, self.shuffle,
                                        self.seed, self.epoch, self.drop_last, _ORDERS[self.order])
            self._cache = (self.epoch, t)
        return self._cache[1]

    def batches(self, batch_size: int, drop_last: bool = False) -> list[torch.Tensor]:
        """The epoch's indices split into consecutive batches (views of :meth:`indices`)."""
        batch_size = _check_int("batch_size", batch_size)
        if batch_size <= 0:
            raise ValueError(f"DistributedSampler.batches: batch_size must be > 0, got {batch_size}")
        idx = self.indices()
        end = (len(idx) // batch_size) * batch_size if drop_last else len(idx)
        return list(idx[:end].split(batch_size))

    def __iter__(self) -> Iterator[int]:
        idx = self.indices()
        start = self._position
        for chunk_start in range(start, len(idx), _CHUNK):
            for value in idx[chunk_start:chunk_start + _CHUNK].tolist():
                self._position += 1
                yield value
        self._position = 0  # a finished epoch starts over when iterated again

    def __len__(self) -> int:
        return self.num_samples

    def state_dict(self) -> dict[str, Any]:
        """Epoch, seed and position in the epoch (indices already yielded), for resuming."""
        return {"epoch": self.epoch, "seed": self.seed, "position": self._position,
                "num_replicas": self.num_replicas, "rank": self.rank, "shuffle": self.shuffle,
                "drop_last": self.drop_last, "order": self.order, "length": self.length}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; iteration resumes after the last yielded index."""
        for key in ("epoch", "seed", "position"):
            if key not in state:
                raise ValueError(f"DistributedSampler.load_state_dict: missing key {key!r}")
        if state.get("length", self.length) != self.length:
            raise ValueError(f"DistributedSampler.load_state_dict: state is for a dataset of "
                             f"{state['length']} items, this one has {self.length}")
        position = _check_int("position", state["position"])
        if not 0 <= position <= self.num_samples:
            raise ValueError(f"DistributedSampler.load_state_dict: position {position} outside "
                             f"[0, {self.num_samples}]")
        self.seed = _check_int("seed", state["seed"])
        self.epoch = _check_int("epoch", state["epoch"])
        self._cache = None
        self._position = position
