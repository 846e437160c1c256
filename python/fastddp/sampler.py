"""``fastddp.DistributedSampler``: torch's DistributedSampler order, computed in C++ on tensors."""

from __future__ import annotations

import numbers
import operator
from collections.abc import Iterator
from typing import Any, Optional, TypeVar, Union

import torch
import torch.distributed as dist
from torch.utils.data.distributed import DistributedSampler as TorchDistributedSampler

from ._ext import C

_ORDERS = {"torch": 0, "stateless": 1}
_STATE_KEYS = ("epoch", "seed", "position")
# Recorded in a state and compared on load: each selects another order or split of the epoch.
# (``rank`` is recorded but not compared: a position means the same on every rank of a world,
# so one rank's state restores every rank's position, as a shared checkpoint does.)
_MATCHED_KEYS = ("num_replicas", "shuffle", "drop_last", "order", "length")


def _check_int(name: str, value: Any) -> int:
    """``value`` as an int where torch's sampler computes with it as one: anything with
    ``__index__`` (a bool, a numpy integer, a 0-d integer tensor) works there; a float fails
    there later (slicing, ``range``), so it is refused here, naming the argument."""
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"DistributedSampler: {name} must be an integer, got {value!r}") from None


def _as_int64(value: int) -> int:
    """``value`` modulo 2**64 as a signed 64-bit integer (the bits the C++ core receives)."""
    value %= 2**64
    return value - 2**64 if value >= 2**63 else value


def _world(what: str) -> int:
    """The default process group's world size or rank, exactly as torch's sampler reads it."""
    if not dist.is_available():
        raise RuntimeError("Requires distributed package to be available")
    try:
        return dist.get_world_size() if what == "num_replicas" else dist.get_rank()
    except ValueError as exc:  # no default process group: torch's ValueError, plus the fix
        raise ValueError(f"{exc} DistributedSampler: without a process group, pass "
                         f"num_replicas= and rank= explicitly ({what} was not given).") from exc


class StaleSizesError(AssertionError, RuntimeError):
    """The sizes a DistributedSampler fixed at construction no longer fit its dataset or
    settings. An AssertionError, as torch's iterator raises where it fails on them (its size
    assertions), and a RuntimeError."""


_T_co = TypeVar("_T_co", covariant=True)


class DistributedSampler(TorchDistributedSampler[_T_co]):
    """Drop-in for :class:`torch.utils.data.distributed.DistributedSampler`, and a subclass of
    it: code that branches on ``isinstance(sampler, DistributedSampler)`` (Lightning's and
    accelerate's "is the data already split across ranks?") takes torch's branch. Every method
    of torch's class is defined here (torch's constructor does not run).

    For every (length, num_replicas, rank, shuffle, seed, epoch, drop_last) it yields exactly
    the indices torch's sampler yields, but builds them in C++ as an int64 tensor: no Python
    list of the whole dataset is ever made, so lengths beyond 2**31 work, and the iterator
    (``fastddp._C.IndexIterator``) behaves as torch's list iterator over it (length hint,
    pickles as ``iter(list)`` of what is left). As torch's, each
    ``iter()`` starts the selected epoch from its beginning, and the indices of an iterator are
    fixed when it is created (a later :meth:`set_epoch` does not change them).

    Args:
        dataset: anything with ``__len__``, or the length itself as an int.
        num_replicas: number of ranks (default: the default process group's world size; as
            torch, raises when no process group is initialized).
        rank: this rank (default: the default process group's rank; same rule).
        shuffle: permute the indices each epoch (``torch.randperm`` seeded with
            ``seed + epoch``, which must be a valid ``torch.Generator.manual_seed`` value).
        seed: base seed, identical on every rank.
        drop_last: drop the tail so every rank gets the same count, instead of padding by
            wrapping around.
        order: ``"torch"`` (default) reproduces torch's order; ``"stateless"`` uses a seeded
            bijection of which each rank computes only its own share, in O(N / replicas) time
            and memory — for huge datasets where even one full permutation is too costly.

    Beyond torch's API: :meth:`indices`, :meth:`batches`, :meth:`iter_indices` (an iterator's
    indices as one tensor), :meth:`state_dict` and :meth:`load_state_dict` (resume mid-epoch:
    the next iterator, and only it, starts after the indices already yielded).
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
        # kept as given (a numpy integer stays one, as in torch's sampler); checked as ints
        given_replicas = _world("num_replicas") if num_replicas is None else num_replicas
        given_rank = _world("rank") if rank is None else rank
        num_replicas = _check_int("num_replicas", given_replicas)
        rank = _check_int("rank", given_rank)
        # torch's sentence first (its tests match "Invalid rank"), then what is wrong
        invalid = f"Invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}]"
        if num_replicas <= 0:
            raise ValueError(f"{invalid}: DistributedSampler num_replicas must be > 0, got {num_replicas}")
        if rank < 0 or rank >= num_replicas:
            raise ValueError(f"{invalid}: DistributedSampler got rank={rank} with "
                             f"num_replicas={num_replicas}")
        if not -(2**63) <= num_replicas < 2**63:
            raise ValueError(f"DistributedSampler: num_replicas must be < 2**63, got {num_replicas}")
        _check_int("seed", seed)
        if order not in _ORDERS:
            raise ValueError(f"DistributedSampler: order must be one of {sorted(_ORDERS)}, got {order!r}")
        self.dataset = dataset
        self.length = length
        self.num_replicas = given_replicas
        self.rank = given_rank
        # shuffle, drop_last, seed and epoch are kept as given, as torch's sampler keeps them:
        # shuffle/drop_last act by truth value, seed + epoch reaches torch.Generator.manual_seed
        # unconverted (which refuses a numpy integer as it does for torch's sampler)
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.order = order
        self.epoch = 0
        self.num_samples = C.sampler_num_samples(length, num_replicas, bool(drop_last))
        self.total_size = self.num_samples * given_replicas  # torch's product, of torch's type
        self._resume = 0  # offset the next iterator starts at (set by load_state_dict)
        self._position = 0  # indices yielded in this epoch, while no iterator reports it
        self._latest: Optional[Any] = None  # the latest iterator (a C.IndexIterator): its position
        self._cache: Optional[tuple[tuple, torch.Tensor]] = None

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (the shuffle seed is ``seed + epoch``). Selecting another epoch
        drops a pending resume offset; selecting the same one keeps it."""
        _check_int("epoch", epoch)
        if epoch != self.epoch:
            self._resume = 0
            self._settle(0)
        self.epoch = epoch

    def _settle(self, position: int) -> None:
        """Record ``position`` as the epoch's yielded count; no earlier iterator reports it."""
        self._latest = None
        self._position = position

    def _yielded(self) -> int:
        """Indices of this epoch yielded by the latest iterator (or recorded without one)."""
        return self._position if self._latest is None else self._latest.position

    def _seeds(self) -> tuple[int, int]:
        """(seed, epoch) as the C++ core takes them. For torch's order ``seed + epoch`` goes
        through ``torch.Generator.manual_seed`` first, so what torch refuses is refused."""
        if not self.shuffle:
            return 0, 0  # the order does not depend on them (torch never reads them then)
        if self.order == "torch":
            try:
                torch.Generator().manual_seed(self.seed + self.epoch)
            except ValueError as exc:  # out of range; a non-integer keeps torch's own error
                raise ValueError(f"DistributedSampler: seed + epoch = {self.seed} + {self.epoch} is "
                                 "not a valid torch.Generator seed (it must lie in [-2**63, 2**64)); "
                                 f"choose a smaller seed ({exc})") from exc
        return _as_int64(int(self.seed)), _as_int64(int(self.epoch))

    def _check_sizes(self) -> None:
        """torch's sampler reads ``len(dataset)`` at every ``iter()`` but keeps ``num_samples``
        and ``total_size`` from its construction. Where the dataset (or ``num_replicas``,
        ``drop_last``, ``num_samples`` set directly) changed so that they no longer agree,
        torch's iterator fails its size assertion (AssertionError) or pads to the old size; ours
        refuses with a StaleSizesError, an AssertionError too."""
        length = self.length if isinstance(self.dataset, numbers.Integral) else len(self.dataset)
        expected = C.sampler_num_samples(length, int(self.num_replicas), bool(self.drop_last))
        if expected != self.num_samples or expected * self.num_replicas != self.total_size:
            raise StaleSizesError(
                f"DistributedSampler: len(dataset)={length}, num_replicas={self.num_replicas} and "
                f"drop_last={self.drop_last} give {expected} samples per rank, but num_samples="
                f"{self.num_samples} and total_size={self.total_size} were fixed when the sampler "
                "was created (for a dataset of "
                f"{self.length}); create a new DistributedSampler after changing the dataset")
        self.length = length  # a length with the same split gives torch's order for it

    def _check_slicing(self) -> None:
        """torch's iterator slices the epoch's indices with ``rank`` and ``num_replicas``
        (``indices[rank:total_size:num_replicas]``): one assigned after construction that is
        not an integer (a float) fails there with a ``TypeError``; ours raises the same type,
        naming the attribute (``int()`` would silently truncate it)."""
        for name in ("rank", "num_replicas"):
            value = getattr(self, name)
            try:
                operator.index(value)
            except TypeError:
                raise TypeError(f"slice indices must be integers or None or have an __index__ method "
                                f"(DistributedSampler: {name}={value!r} is not an integer; assign an "
                                "int)") from None
        if not 0 <= operator.index(self.rank) < operator.index(self.num_replicas):
            # torch's slice then holds fewer than num_samples indices: its size assertion fails
            raise AssertionError(f"DistributedSampler: rank={self.rank} assigned after construction is outside "
                                 f"[0, {self.num_replicas - 1}] for num_replicas={self.num_replicas}; assign this "
                                 "process's rank")

    def indices(self) -> torch.Tensor:
        """This rank's indices for the current epoch (all of them, ignoring any resume
        offset), as an int64 CPU tensor. Cached; treat it as read-only."""
        self._check_slicing()
        self._check_sizes()
        key = (self.length, self.num_replicas, self.rank, bool(self.shuffle), self.seed, self.epoch,
               bool(self.drop_last), self.order)
        if self._cache is None or self._cache[0] != key:
            seed, epoch = self._seeds()
            t = C.sampler_epoch_indices(self.length, int(self.num_replicas), int(self.rank), bool(self.shuffle),
                                        seed, epoch, bool(self.drop_last), _ORDERS[self.order])
            self._cache = (key, t)
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
        # As torch's list iterator: the indices and the start are fixed when iter() is called,
        # one C-level next() per index, a length hint, and pickling (as iter(list) of what is
        # left). A resume offset goes to this iterator only.
        idx = self.indices()
        start, self._resume = self._resume, 0
        self._latest = C.index_iterator(idx, start)
        return self._latest

    def iter_indices(self) -> torch.Tensor:
        """What a new iterator yields, all at once, as an int64 CPU tensor (read-only): it
        starts an iterator as ``iter()`` does (a pending resume offset goes to it) and reads it
        to the end, so :meth:`state_dict` then reports the whole epoch as yielded."""
        idx = self.indices()
        start, self._resume = self._resume, 0
        self._settle(len(idx))
        return idx[start:]

    def __len__(self) -> int:
        return self.num_samples

    def __getstate__(self) -> dict[str, Any]:
        # a copy records the latest iterator's position; the iterator stays with the original
        state = dict(self.__dict__)
        state["_position"], state["_latest"] = self._yielded(), None
        return state

    def state_dict(self) -> dict[str, Any]:
        """Epoch, seed and position in the epoch (indices yielded by the latest iterator,
        or the pending resume offset before one is created), for resuming."""
        return {"epoch": self.epoch, "seed": self.seed, "position": self._yielded(),
                "num_replicas": int(self.num_replicas), "rank": int(self.rank), "shuffle": self.shuffle,
                "drop_last": self.drop_last, "order": self.order, "length": self.length}

    def pending_state_dict(self) -> dict[str, Any]:
        """:meth:`state_dict` as the next iterator will start: its position is the pending
        resume offset, not the latest iterator's. A loader that counts delivered batches itself
        saves this at the start of a pass (it reads the sampler ahead of delivery)."""
        return {**self.state_dict(), "position": self._resume}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`: the next iterator resumes after the last yielded index.
        Everything is checked before anything changes, so a refused state leaves the sampler
        as it was."""
        if not isinstance(state, dict):
            raise TypeError(f"DistributedSampler.load_state_dict: state must be a dict, got "
                            f"{type(state).__name__}")
        for key in _STATE_KEYS:
            if key not in state:
                raise ValueError(f"DistributedSampler.load_state_dict: missing key {key!r}")
        self._check_same_split(state)
        epoch = _check_int("epoch", state["epoch"])
        seed = _check_int("seed", state["seed"])
        position = _check_int("position", state["position"])
        if not 0 <= position <= self.num_samples:
            raise ValueError(f"DistributedSampler.load_state_dict: position {position} outside "
                             f"[0, {self.num_samples}]")
        self.seed, self.epoch = seed, epoch
        self._resume = position
        self._settle(position)

    def _check_same_split(self, state: dict[str, Any]) -> None:
        """Refuse a state recorded by a sampler that orders or splits the epoch otherwise (its
        position would resume another sequence); keys a state does not record are not compared."""
        mine = {"num_replicas": int(self.num_replicas), "shuffle": bool(self.shuffle),
                "drop_last": bool(self.drop_last), "order": self.order, "length": self.length}
        saved = {key: state[key] for key in _MATCHED_KEYS if key in state}
        for key in ("shuffle", "drop_last"):  # kept as given; they act by truth value
            if key in saved:
                saved[key] = bool(saved[key])
        differ = [key for key in saved if saved[key] != mine[key]]
        if differ:
            pairs = ", ".join(f"{key}: state {saved[key]!r}, this sampler {mine[key]!r}" for key in differ)
            raise ValueError(f"DistributedSampler.load_state_dict: the state was saved by a sampler with "
                             f"other settings ({pairs}); its position would resume another order. "
                             "Create this sampler with the saved settings, or start the epoch from its "
                             "beginning without load_state_dict")
