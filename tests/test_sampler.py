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
    ("kwargs", "message"),
    [
        ({"num_replicas": 0}, "num_replicas must be > 0, got 0"),
        ({"num_replicas": -2}, "num_replicas must be > 0, got -2"),
        ({"num_replicas": 2, "rank": 2}, r"invalid rank 2, rank should be in the interval \[0, 1\]"),
        ({"num_replicas": 2, "rank": -1}, "invalid rank -1"),
        ({"seed": 1.5}, "seed must be an integer, got 1.5"),
        ({"seed": "0"}, "seed must be an integer, got '0'"),
        ({"seed": 2**64}, r"seed must fit in 64 bits \(-2\*\*63 <= seed < 2\*\*63\), got 18446744073709551616"),
        ({"order": "random"}, "order must be one of"),
    ],
)
def test_bad_input(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
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


def test_defaults_without_process_group() -> None:
    s = fastddp.DistributedSampler(7)
    assert (s.num_replicas, s.rank) == (1, 0)
