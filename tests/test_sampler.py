"""fastddp.DistributedSampler yields exactly torch's DistributedSampler order."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch.utils.data.distributed import DistributedSampler as TorchSampler

import fastddp

from .distributed import run_distributed


def _torch_order(n, replicas, rank, shuffle, seed, epoch, drop_last) -> list[int]:
    s = TorchSampler(range(n), num_replicas=replicas, rank=rank, shuffle=shuffle, seed=seed,
                     drop_last=drop_last)
    s.set_epoch(epoch)
    return list(s)


def _ours(n, replicas, rank, shuffle, seed, epoch, drop_last, order="torch"):
    s = fastddp.DistributedSampler(range(n), num_replicas=replicas, rank=rank, shuffle=shuffle,
                                   seed=seed, drop_last=drop_last, order=order)
    s.set_epoch(epoch)
    return s


def test_identical_order_exhaustive_small() -> None:
    # Includes length < replicas (padding longer than the dataset) and length 0.
    for n, replicas in itertools.product(range(0, 13), range(1, 6)):
        for rank, shuffle, drop_last, epoch in itertools.product(
                range(replicas), (True, False), (True, False), (0, 1)):
            ours = _ours(n, replicas, rank, shuffle, 5, epoch, drop_last)
            want = _torch_order(n, replicas, rank, shuffle, 5, epoch, drop_last)
            assert list(ours) == want, (n, replicas, rank, shuffle, drop_last, epoch)
            assert ours.indices().tolist() == want
            assert len(ours) == len(want)
            assert ours.indices().dtype == torch.int64


def test_identical_order_random_large() -> None:
    rng = random.Random(1234)
    for _ in range(12):
        n = rng.randint(1, 300_000)
        replicas = rng.randint(1, 16)
        rank = rng.randrange(replicas)
        seed, epoch = rng.randint(0, 2**31), rng.randint(0, 100)
        shuffle, drop_last = rng.random() < 0.8, rng.random() < 0.5
        ours = _ours(n, replicas, rank, shuffle, seed, epoch, drop_last).indices()
        want = torch.tensor(_torch_order(n, replicas, rank, shuffle, seed, epoch, drop_last),
                            dtype=torch.int64)
        assert torch.equal(ours, want), (n, replicas, rank, seed, epoch, shuffle, drop_last)


def test_epoch_changes_order_and_batches() -> None:
    s = fastddp.DistributedSampler(1000, num_replicas=2, rank=1, seed=3)
    first = s.indices().clone()
    s.set_epoch(1)
    assert not torch.equal(first, s.indices())
    batches = s.batches(64)
    assert torch.equal(torch.cat(batches), s.indices())
    assert [len(b) for b in s.batches(64, drop_last=True)] == [64] * (500 // 64)


def test_state_dict_resumes_mid_epoch() -> None:
    s = fastddp.DistributedSampler(100, num_replicas=3, rank=2, seed=11)
    s.set_epoch(4)
    full = s.indices().tolist()
    it = iter(s)
    head = [next(it) for _ in range(10)]
    state = s.state_dict()
    assert state["epoch"] == 4 and state["position"] == 10 and state["seed"] == 11
    resumed = fastddp.DistributedSampler(100, num_replicas=3, rank=2, seed=0)
    resumed.load_state_dict(state)
    resumed.set_epoch(4)  # the same epoch keeps the position, as a training loop would call it
    assert head + list(resumed) == full
    assert list(resumed) == full  # the next pass starts over


@pytest.mark.parametrize(
    ("kwargs", "exc", "message"),
    [
        ({"num_replicas": 0}, ValueError, "num_replicas must be > 0, got 0"),
        ({"num_replicas": -2}, ValueError, "num_replicas must be > 0, got -2"),
        ({"num_replicas": 2, "rank": 2}, ValueError, r"^Invalid rank 2, rank should be in the interval \[0, 1\]: DistributedSampler got rank=2"),
        ({"num_replicas": 2, "rank": -1}, ValueError, "^Invalid rank -1"),
        ({"num_replicas": "2"}, TypeError, "num_replicas must be an integer, got '2'"),
        ({"seed": 1.5}, TypeError, "seed must be an integer, got 1.5"),
        ({"seed": "0"}, TypeError, "seed must be an integer, got '0'"),
        ({"order": "random"}, ValueError, "order must be one of"),
    ],
)
def test_bad_input(kwargs, exc, message) -> None:
    with pytest.raises(exc, match=message):
        fastddp.DistributedSampler(10, **{"num_replicas": 1, "rank": 0, **kwargs})


def test_negative_length() -> None:
    with pytest.raises(ValueError, match="length must be >= 0, got -3"):
        fastddp.DistributedSampler(-3, num_replicas=1, rank=0)


def test_stateless_order_is_a_partition_with_torch_padding() -> None:
    for n, replicas, drop_last in [(1000, 8, False), (1003, 8, False), (1003, 8, True),
                                   (5, 8, False), (65_537, 3, False)]:
        per_rank = [_ours(n, replicas, r, True, 9, 2, drop_last, order="stateless").indices()
                    for r in range(replicas)]
        ref = [torch.tensor(_torch_order(n, replicas, r, False, 0, 0, drop_last)) for r in range(replicas)]
        assert [len(t) for t in per_rank] == [len(t) for t in ref]
        got = torch.cat(per_rank)
        if drop_last:
            assert got.unique().numel() == got.numel()  # no duplicates, tail dropped
        else:
            # every index appears, padding repeats exactly as many as torch pads
            assert set(got.tolist()) == set(range(n))
            counts = torch.bincount(got, minlength=n)
            ref_counts = torch.bincount(torch.cat(ref), minlength=n)
            assert sorted(counts.tolist()) == sorted(ref_counts.tolist())
        assert got.min() >= 0 and got.max() < n


def test_stateless_order_deterministic_and_keyed() -> None:
    a = _ours(10_000, 4, 1, True, 1, 0, False, "stateless").indices()
    assert torch.equal(a, _ours(10_000, 4, 1, True, 1, 0, False, "stateless").indices())
    assert not torch.equal(a, _ours(10_000, 4, 1, True, 2, 0, False, "stateless").indices())
    assert not torch.equal(a, _ours(10_000, 4, 1, True, 1, 1, False, "stateless").indices())
    # not the identity nor torch's order
    assert not torch.equal(a, _ours(10_000, 4, 1, False, 1, 0, False, "stateless").indices())


def test_huge_length_without_lists() -> None:
    n = 2**31 + 10  # beyond int32: only this rank's share is materialised
    s = fastddp.DistributedSampler(n, num_replicas=2**20, rank=5, order="stateless")
    idx = s.indices()
    assert len(idx) == len(s) == -(-n // 2**20)
    assert int(idx.max()) < n and idx.unique().numel() == len(idx)
    plain = fastddp.DistributedSampler(n, num_replicas=2**20, rank=5, shuffle=False)
    assert plain.indices()[:3].tolist() == [5, 5 + 2**20, 5 + 2 * 2**20]


def _defaults_from_group(rank: int, world_size: int) -> tuple[int, int, list[int]]:
    s = fastddp.DistributedSampler(10)
    return s.num_replicas, s.rank, list(s)


def test_defaults_from_process_group() -> None:
    out = run_distributed(_defaults_from_group, world_size=2)
    assert [(o[0], o[1]) for o in out] == [(2, 0), (2, 1)]
    assert out[0][2] == _torch_order(10, 2, 0, True, 0, 0, False)
    assert out[1][2] == _torch_order(10, 2, 1, True, 0, 0, False)


@pytest.mark.parametrize("kwargs", [{}, {"num_replicas": 2}, {"rank": 0}])
def test_defaults_without_process_group_raise_as_torch(kwargs) -> None:
    # torch reads the missing value from the default process group, which raises; assuming
    # one replica would train every rank on the whole dataset without a word.
    with pytest.raises(ValueError) as want:
        TorchSampler(range(7), **kwargs)
    with pytest.raises(ValueError, match="pass num_replicas= and rank= explicitly") as got:
        fastddp.DistributedSampler(7, **kwargs)
    assert str(got.value).startswith(str(want.value))


def test_every_iter_starts_the_epoch_over() -> None:
    s = fastddp.DistributedSampler(32, num_replicas=1, rank=0, seed=4)
    s.set_epoch(2)
    full = s.indices().tolist()
    peek = next(iter(s))  # a look at one index before the loop, as scripts do
    assert peek == full[0]
    assert list(s) == full and list(s) == full
    a, b = iter(s), iter(s)
    assert [next(a) for _ in range(3)] == full[:3]
    assert list(b) == full and list(a) == full[3:]


def test_iterator_indices_fixed_at_creation() -> None:
    ours = fastddp.DistributedSampler(20, num_replicas=2, rank=1, seed=1)
    ref = TorchSampler(range(20), num_replicas=2, rank=1, seed=1)
    it_ours, it_ref = iter(ours), iter(ref)
    ours.set_epoch(5)
    ref.set_epoch(5)
    assert list(it_ours) == list(it_ref)
    assert list(ours) == list(ref)


def test_resume_offset_goes_to_exactly_one_iterator() -> None:
    s = fastddp.DistributedSampler(40, num_replicas=2, rank=0, seed=3)
    s.set_epoch(1)
    full = s.indices().tolist()
    s.load_state_dict({"epoch": 1, "seed": 3, "position": 7})
    s.set_epoch(1)  # same epoch: the offset stays pending
    first, second = iter(s), iter(s)
    assert list(first) == full[7:]
    assert list(second) == full
    assert list(s) == full
    s.load_state_dict({"epoch": 1, "seed": 3, "position": 7})
    s.set_epoch(2)  # another epoch: the offset is dropped
    assert len(list(s)) == len(s)


def test_position_follows_the_latest_iterator() -> None:
    s = fastddp.DistributedSampler(40, num_replicas=1, rank=0)
    old = iter(s)
    next(old)
    new = iter(s)
    assert s.state_dict()["position"] == 0
    next(old)
    next(new), next(new)
    assert s.state_dict()["position"] == 2


@pytest.mark.parametrize(
    "bad",
    [{"epoch": "x", "seed": 123, "position": 0}, {"epoch": 1, "seed": 123, "position": 99},
     {"epoch": 1, "seed": 1.5, "position": 0}, {"epoch": 1, "seed": 123, "position": "0"},
     {"epoch": 1, "seed": 123}, {"epoch": 1, "seed": 123, "position": 0, "length": 5},
     {"epoch": 1, "seed": 123, "position": 0, "num_replicas": 4},
     {"epoch": 1, "seed": 123, "position": 0, "shuffle": False},
     {"epoch": 1, "seed": 123, "position": 0, "drop_last": True},
     {"epoch": 1, "seed": 123, "position": 0, "order": "stateless"}],
)
def test_refused_state_changes_nothing(bad) -> None:
    s = fastddp.DistributedSampler(40, num_replicas=2, rank=0, seed=9)
    s.set_epoch(3)
    it = iter(s)
    next(it)
    before = s.state_dict()
    with pytest.raises((TypeError, ValueError)):
        s.load_state_dict(bad)
    assert s.state_dict() == before
    assert list(it) == s.indices().tolist()[1:]


def test_state_of_other_settings_is_refused_naming_them() -> None:
    src = fastddp.DistributedSampler(100, num_replicas=2, rank=0, seed=1)
    it = iter(src)
    [next(it) for _ in range(5)]
    dst = fastddp.DistributedSampler(100, num_replicas=4, rank=3, seed=1, shuffle=False)
    with pytest.raises(ValueError, match=r"num_replicas: state 2, this sampler 4, shuffle: state True, "
                                         r"this sampler False\).*Create this sampler with the saved settings"):
        dst.load_state_dict(src.state_dict())
    assert dst.pending_state_dict()["position"] == 0


def test_state_of_another_rank_resumes_this_ranks_indices() -> None:
    # one rank's checkpoint restores every rank (a position means the same on each rank)
    src = fastddp.DistributedSampler(100, num_replicas=2, rank=0, seed=1)
    it = iter(src)
    [next(it) for _ in range(5)]
    dst = fastddp.DistributedSampler(100, num_replicas=2, rank=1, seed=1)
    dst.load_state_dict(src.state_dict())
    assert list(dst) == fastddp.DistributedSampler(100, num_replicas=2, rank=1, seed=1).indices().tolist()[5:]


@pytest.mark.parametrize(("seed", "epoch"), [(2**64 - 1, 0), (-1, 1), (-(2**63), 0), (2**63 - 1, 1)])
def test_any_seed_torch_accepts(seed, epoch) -> None:
    ours = _ours(50, 3, 1, True, seed, epoch, False)
    assert list(ours) == _torch_order(50, 3, 1, True, seed, epoch, False)


@pytest.mark.parametrize(("seed", "epoch"), [(2**64 - 1, 1), (2**64, 0), (-(2**63), -1)])
def test_seed_torch_refuses(seed, epoch) -> None:
    # torch accepts any seed when constructed and fails in iter() when seed + epoch is not a
    # valid generator seed; without shuffling the seed is never used.
    with pytest.raises(ValueError) as want:
        _torch_order(50, 3, 1, True, seed, epoch, False)
    with pytest.raises(ValueError, match=r"seed \+ epoch .* is not a valid torch.Generator seed") as got:
        list(_ours(50, 3, 1, True, seed, epoch, False))
    assert str(want.value) in str(got.value)
    assert list(_ours(50, 3, 1, False, seed, epoch, False)) == _torch_order(50, 3, 1, False, seed, epoch, False)


def test_pending_state_dict_is_where_the_next_iterator_starts() -> None:
    s = fastddp.DistributedSampler(10, num_replicas=2, rank=0, shuffle=False)
    assert list(s) == [0, 2, 4, 6, 8]
    assert s.state_dict()["position"] == 5  # the finished iterator's position
    assert s.pending_state_dict()["position"] == 0  # a new iterator starts the epoch over
    s.load_state_dict({**s.state_dict(), "position": 2})
    assert s.pending_state_dict()["position"] == 2
    assert list(s) == [4, 6, 8] and s.pending_state_dict()["position"] == 0
