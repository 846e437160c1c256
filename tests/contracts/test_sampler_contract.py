"""Contract: fastddp.DistributedSampler behaves as torch.utils.data.distributed.DistributedSampler.

Each test runs the same scenario against torch's class and ours in this process and compares
what a user can observe: the values, the exception (type and meaning) and the global RNG state
afterwards. Where ours refuses what torch accepts, the test says why.
"""

from __future__ import annotations

import copy
import itertools
import operator
import pickle
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler as TorchSampler

import fastddp

from ..distributed import run_distributed

CLASSES = {"torch": TorchSampler, "fastddp": fastddp.DistributedSampler}


def _outcome(fn: Callable[[type], Any], cls: type) -> tuple[str, Any, torch.Tensor]:
    """("ok", value) or ("raise", (type, message)), and the global RNG state afterwards, from
    the same starting state for both classes."""
    torch.manual_seed(1234)
    try:
        result: tuple[str, Any] = ("ok", fn(cls))
    except Exception as exc:  # the exception itself is what is compared
        result = ("raise", (type(exc), str(exc)))
    return result[0], result[1], torch.random.get_rng_state()


def _side_by_side(fn: Callable[[type], Any]) -> tuple[Any, Any]:
    """Run ``fn`` with both classes; assert the same outcome kind, value or exception type,
    and the same RNG state; return (torch's, ours) values or messages."""
    kind_t, val_t, rng_t = _outcome(fn, TorchSampler)
    kind_o, val_o, rng_o = _outcome(fn, fastddp.DistributedSampler)
    assert kind_o == kind_t, (val_t, val_o)
    assert torch.equal(rng_o, rng_t), "the global RNG state differs after the same calls"
    if kind_t == "ok":
        assert val_o == val_t
    else:
        assert val_o[0] is val_t[0], (val_t, val_o)
    return val_t, val_o


CASES = [(n, r, rank, shuffle, drop_last, seed, epoch)
         for n, r in itertools.product((0, 1, 5, 7, 16), (1, 2, 3, 8))
         for rank in sorted({0, r - 1})
         for shuffle, drop_last in itertools.product((True, False), (True, False))
         for seed, epoch in ((0, 0), (17, 3))]


@pytest.mark.parametrize(("n", "replicas", "rank", "shuffle", "drop_last", "seed", "epoch"), CASES)
def test_order_len_and_attributes(n, replicas, rank, shuffle, drop_last, seed, epoch) -> None:
    def run(cls):
        s = cls(range(n), num_replicas=replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
        s.set_epoch(epoch)
        return (list(s), len(s), s.num_samples, s.total_size, s.epoch, s.seed, s.shuffle,
                s.drop_last, s.num_replicas, s.rank)

    _side_by_side(run)


def test_every_iter_starts_the_epoch_over() -> None:
    def run(cls):
        s = cls(range(32), num_replicas=2, rank=1, seed=3)
        s.set_epoch(1)
        peek = next(iter(s))
        return peek, list(s), list(s)

    _side_by_side(run)


def test_interleaved_iterators_are_independent() -> None:
    def run(cls):
        s = cls(range(20), num_replicas=1, rank=0)
        a, b = iter(s), iter(s)
        return [next(a), next(a), next(b), *a, *b]

    _side_by_side(run)


def test_iterator_keeps_the_epoch_it_was_created_in() -> None:
    def run(cls):
        s = cls(range(20), num_replicas=2, rank=0, seed=5)
        it = iter(s)
        s.set_epoch(4)
        return list(it), list(s)

    _side_by_side(run)


@pytest.mark.parametrize(("attr", "value"), [("seed", 99), ("epoch", 7), ("shuffle", False),
                                             ("seed", 2.5), ("epoch", "x"), ("rank", 1.0), ("rank", 0.9),
                                             ("num_replicas", 3.0), ("rank", True), ("rank", 5), ("rank", -1)])
@pytest.mark.parametrize("shuffle", [True, False])
def test_attributes_set_directly_are_read_by_the_next_iter(attr, value, shuffle) -> None:
    # a float rank or num_replicas: torch's slicing TypeError at iter() (ours names it)
    def run(cls):
        s = cls(range(30), num_replicas=3, rank=2, shuffle=shuffle)
        before = list(s)
        setattr(s, attr, value)
        return before, list(s)

    want, got = _side_by_side(run)
    if isinstance(value, float) and attr in ("rank", "num_replicas"):
        assert want[0] is TypeError and got[1].startswith(want[1]) and f"{attr}={value!r}" in got[1]


@pytest.mark.parametrize(("replicas", "rank"), [(2, 2), (2, -1), (1, 5), (3, -3)])
def test_invalid_rank(replicas, rank) -> None:
    want, got = _side_by_side(lambda cls: cls(range(10), num_replicas=replicas, rank=rank))
    assert want[0] is ValueError
    assert got[1].startswith(want[1])  # torch's sentence, then ours


@pytest.mark.parametrize("replicas", [0, -2])
def test_num_replicas_not_positive(replicas) -> None:
    # torch reports it as an invalid rank (the interval [0, replicas - 1] is empty); ours names
    # num_replicas, the argument that is wrong.
    want, got = _side_by_side(lambda cls: cls(range(10), num_replicas=replicas, rank=0))
    assert want[0] is ValueError and "Invalid rank 0" in want[1]
    assert got[1].startswith(want[1]) and f"num_replicas must be > 0, got {replicas}" in got[1]


@pytest.mark.parametrize("kwargs", [{}, {"num_replicas": 2}, {"rank": 1}])
def test_no_process_group_without_explicit_values(kwargs) -> None:
    want, got = _side_by_side(lambda cls: cls(range(10), **kwargs))
    assert want[0] is ValueError
    assert got[1].startswith(want[1]) and "pass num_replicas= and rank=" in got[1]


def _per_rank_orders(rank: int, world_size: int) -> tuple[list, list, tuple, tuple]:
    ours, ref = fastddp.DistributedSampler(range(11)), TorchSampler(range(11))
    for s in (ours, ref):
        s.set_epoch(2)
    return list(ours), list(ref), (ours.num_replicas, ours.rank), (ref.num_replicas, ref.rank)


def test_defaults_from_the_process_group() -> None:
    for ours, ref, ours_world, ref_world in run_distributed(_per_rank_orders, world_size=2):
        assert ours == ref and ours_world == ref_world


@pytest.mark.parametrize(("seed", "epoch"), [(2**64 - 1, 0), (-1, 0), (-(2**63), 0), (2**63, 1),
                                             (2**64 - 1, 1), (2**64, 0), (-(2**63) - 1, 0)])
@pytest.mark.parametrize("shuffle", [True, False])
def test_seed_range(seed, epoch, shuffle) -> None:
    # torch accepts any seed when constructed; iter() seeds a generator with seed + epoch,
    # which accepts [-2**63, 2**64). Ours raises the same type there, naming seed + epoch.
    def run(cls):
        s = cls(range(12), num_replicas=2, rank=1, shuffle=shuffle, seed=seed)
        s.set_epoch(epoch)
        return list(s)

    want, got = _side_by_side(run)
    if isinstance(want, tuple):
        assert re.search(r"seed \+ epoch", got[1]) and want[1] in got[1]


@pytest.mark.parametrize("seed", [1.5, "1", None])
def test_non_integer_seed_refused_when_given(seed) -> None:
    # torch fails only in iter() (manual_seed of a float or str); ours refuses at once, naming seed.
    with pytest.raises(RuntimeError if seed == 1.5 else TypeError):
        list(TorchSampler(range(4), num_replicas=1, rank=0, seed=seed))
    with pytest.raises(TypeError, match="seed must be an integer"):
        fastddp.DistributedSampler(range(4), num_replicas=1, rank=0, seed=seed)


def test_in_a_dataloader() -> None:
    data = TensorDataset(torch.arange(50.0))

    def run(cls):
        s = cls(data, num_replicas=3, rank=1, seed=8)
        loader = DataLoader(data, batch_size=4, sampler=s)
        out = []
        for epoch in range(3):
            s.set_epoch(epoch)
            out.append(next(iter(loader))[0].tolist())  # a peek, then the whole epoch
            out.append([b[0].tolist() for b in loader])
        return out

    _side_by_side(run)


def test_global_rng_untouched() -> None:
    def run(cls):
        before = torch.random.get_rng_state()
        s = cls(range(100), num_replicas=2, rank=0)
        for epoch in range(3):
            s.set_epoch(epoch)
            list(s)
        return torch.equal(before, torch.random.get_rng_state())

    want, _ = _side_by_side(run)
    assert want is True


def test_pickle_and_deepcopy() -> None:
    def run(cls):
        s = cls(range(40), num_replicas=4, rank=3, seed=2)
        s.set_epoch(6)
        clones = (pickle.loads(pickle.dumps(s)), copy.deepcopy(s))
        return [list(c) for c in clones] + [[c.epoch, c.seed] for c in clones]

    _side_by_side(run)


@pytest.mark.parametrize("taken", [0, 2, 5])
def test_iterator_length_hint_pickle_and_copy(taken) -> None:
    # torch's iterator is iter(list): a length hint of what is left; pickled or copied, an
    # iterator over the same remaining indices (the original goes on independently)
    def run(cls):
        it = iter(cls(range(9), num_replicas=2, rank=1, seed=4))
        head = [next(it) for _ in range(taken)]
        hint = operator.length_hint(it)
        restored, copied = pickle.loads(pickle.dumps(it)), copy.copy(it)
        return head, hint, list(restored), list(copied), list(it), operator.length_hint(it)

    _side_by_side(run)


def test_iterator_position_survives_pickling_the_sampler() -> None:
    # beyond torch: state_dict reports what the latest iterator yielded; a pickled sampler
    # records that position, and the iterator keeps reporting to the original only
    s = fastddp.DistributedSampler(range(10), num_replicas=2, rank=0)
    it = iter(s)
    next(it), next(it)
    clone = pickle.loads(pickle.dumps(s))
    next(it)
    assert clone.state_dict()["position"] == 2
    assert s.state_dict()["position"] == 3
    assert len(list(it)) == 2 and s.state_dict()["position"] == 5


@pytest.mark.parametrize("kind", [np.int64, np.int32])
def test_numpy_integer_rank_and_replicas_kept(kind) -> None:
    # torch keeps rank and num_replicas as given (total_size is their product's type)
    def run(cls):
        s = cls(range(11), num_replicas=kind(3), rank=kind(2))
        return list(s), repr(s.rank), repr(s.num_replicas), repr(s.total_size), len(s)

    _side_by_side(run)


@pytest.mark.parametrize(("replicas", "rank", "seed", "epoch"),
                         [(2, True, 0, 0), (True, False, 0, 0), (2, 1, True, True), (3, torch.tensor(2), 5, 1),
                          (torch.tensor(3), 0, 0, 0)],
                         ids=["bool_rank", "bool_replicas", "bool_seed_epoch", "tensor_rank", "tensor_replicas"])
@pytest.mark.parametrize("shuffle", [True, False])
def test_bool_and_tensor_integers_taken_as_torch_takes_them(replicas, rank, seed, epoch, shuffle) -> None:
    # torch computes with anything that has __index__: the same indices, the values kept as given
    def run(cls):
        s = cls(range(11), num_replicas=replicas, rank=rank, shuffle=shuffle, seed=seed)
        s.set_epoch(epoch)
        return list(s), len(s), repr(s.rank), repr(s.num_replicas), repr(s.seed), repr(s.epoch)

    _side_by_side(run)


def test_is_a_torch_sampler() -> None:
    _side_by_side(lambda cls: isinstance(cls(range(3), num_replicas=1, rank=0), torch.utils.data.Sampler))


def test_is_torchs_distributed_sampler_to_code_that_asks() -> None:
    """Lightning and accelerate ask isinstance(sampler, DistributedSampler) to learn whether the
    data is split across ranks already; answered False, they split it a second time. And none
    of torch's methods runs on ours: each is defined by fastddp's class."""
    _side_by_side(lambda cls: isinstance(cls(range(3), num_replicas=1, rank=0), TorchSampler))
    torch_methods = {n for n, v in vars(TorchSampler).items() if callable(v) and not n.startswith("__class")}
    assert torch_methods and all(n in vars(fastddp.DistributedSampler) for n in torch_methods), torch_methods


@pytest.mark.parametrize(("shuffle", "drop_last"), [(1, 0), ("yes", None), (None, "no"), (0.0, 2)])
def test_flags_kept_as_given(shuffle, drop_last) -> None:
    # torch keeps shuffle and drop_last as passed and acts on their truth value
    def run(cls):
        s = cls(range(11), num_replicas=2, rank=1, shuffle=shuffle, drop_last=drop_last)
        return list(s), len(s), repr(s.shuffle), repr(s.drop_last)

    _side_by_side(run)


@pytest.mark.parametrize(("seed", "epoch"), [(np.int64(3), 0), (0, np.int64(2)), (np.int32(1), 1)])
@pytest.mark.parametrize("shuffle", [True, False])
def test_numpy_integer_seed_and_epoch(seed, epoch, shuffle) -> None:
    # torch passes seed + epoch to torch.Generator.manual_seed unconverted, which refuses a
    # numpy integer (TypeError) when shuffling and never sees it otherwise
    def run(cls):
        s = cls(range(11), num_replicas=2, rank=1, shuffle=shuffle, seed=seed)
        s.set_epoch(epoch)
        return list(s), repr(s.seed), repr(s.epoch)

    _side_by_side(run)


def _shrink(s, data) -> None:
    del data[-1]


SIZE_CHANGES = {  # (dataset length, num_replicas, drop_last, change)
    "dataset_shrinks_same_split": (10, 2, False, _shrink),  # 9 items still give 5 per rank
    "dataset_shrinks": (11, 2, False, _shrink),
    "dataset_grows": (10, 2, False, lambda s, data: data.append(0)),
    "dataset_grows_drop_last": (10, 3, True, lambda s, data: data.extend([0, 0])),
    "dataset_replaced": (11, 2, False, lambda s, data: setattr(s, "dataset", range(5))),
    "drop_last_set": (11, 2, False, lambda s, data: setattr(s, "drop_last", True)),
    "num_replicas_set": (11, 2, False, lambda s, data: setattr(s, "num_replicas", 3)),
    "num_samples_set": (11, 2, False, lambda s, data: setattr(s, "num_samples", 3)),
}


@pytest.mark.parametrize("case", sorted(SIZE_CHANGES))
def test_sizes_changed_after_construction(case) -> None:
    # torch reads len(dataset) at every iter() but keeps num_samples/total_size from its
    # construction: where they still agree the order is the new length's, otherwise torch's
    # iterator fails its size assertion or pads to the old size. Ours refuses those, saying so.
    n, replicas, drop_last, change = SIZE_CHANGES[case]

    def run(cls):
        data = list(range(n))
        s = cls(data, num_replicas=replicas, rank=0, seed=4, drop_last=drop_last)
        change(s, data)
        return list(s), len(s)

    if case.endswith("same_split"):
        _side_by_side(run)
        return
    with pytest.raises(RuntimeError, match=r"were fixed when the sampler was created .* create a "
                                           r"new DistributedSampler") as refused:
        run(fastddp.DistributedSampler)
    try:  # where torch's iterator fails, ours fails with an exception of the same type
        run(TorchSampler)
    except Exception as exc:
        assert isinstance(refused.value, type(exc)), (type(exc), refused.value)


def test_generic_as_torchs() -> None:
    """torch's DistributedSampler is ``Sampler[T_co]``: ``DistributedSampler[int]`` works."""
    assert [(t.__name__, t.__covariant__) for t in fastddp.DistributedSampler.__parameters__] == \
        [(t.__name__, t.__covariant__) for t in TorchSampler.__parameters__] == [("_T_co", True)]
    alias = fastddp.DistributedSampler[int]
    found = []
    for cls in (alias, TorchSampler[int]):
        torch.manual_seed(3)
        sampler = cls(range(10), num_replicas=2, rank=1, seed=4)
        found.append((list(sampler), torch.random.get_rng_state(), sampler.__orig_class__ is cls))
    (ours, our_rng, our_alias), (theirs, their_rng, their_alias) = found
    assert ours == theirs and torch.equal(our_rng, their_rng) and our_alias and their_alias
