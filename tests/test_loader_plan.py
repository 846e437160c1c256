"""The batch plan read a whole pass at once (plan.read_whole_pass) gives exactly the batches
BatchSampler yields and leaves every random state where BatchSampler leaves it; the native
pipeline's bulk submission (submit_split) and up-front slot allocation."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)
from torch.utils.data.distributed import DistributedSampler as TorchSampler

import fastddp
from fastddp._ext import C
from fastddp.loader.plan import (
    random_sampler_replay_matches,
    read_whole_pass,
    reads_ahead_unobserved,
)

ROWS = 50

SAMPLERS = {
    "random": lambda: RandomSampler(range(ROWS)),
    "random_more": lambda: RandomSampler(range(ROWS), num_samples=2 * ROWS + 7),
    "random_fewer": lambda: RandomSampler(range(ROWS), num_samples=13),
    "sequential": lambda: SequentialSampler(range(ROWS)),
    "subset_negative": lambda: SubsetRandomSampler([-1, -2, 3, 4, 5, 6, 7]),
    "subset_out_of_range": lambda: SubsetRandomSampler([1, 2, ROWS, 3]),
    "subset_bools": lambda: SubsetRandomSampler([True, 2, 3]),
    "weighted": lambda: WeightedRandomSampler([0.1] * ROWS, 30),
    "torch_distributed": lambda: TorchSampler(range(ROWS), num_replicas=3, rank=1, seed=4),
    "fastddp_distributed": lambda: fastddp.DistributedSampler(range(ROWS), num_replicas=3, rank=2, seed=4),
    "empty": lambda: SequentialSampler(range(0)),
}


def _as_lists(entries: list) -> list:
    return [e.indices.tolist() if e.indices is not None else e.raw for e in entries]


@pytest.mark.parametrize("name", sorted(SAMPLERS))
@pytest.mark.parametrize("batch_size, drop_last", [(1, False), (7, False), (7, True), (64, True)])
def test_whole_pass_is_batch_samplers_batches_and_draws(name: str, batch_size: int, drop_last: bool) -> None:
    ours, theirs = BatchSampler(SAMPLERS[name](), batch_size, drop_last), BatchSampler(SAMPLERS[name](), batch_size, drop_last)
    assert reads_ahead_unobserved(ours)
    torch.manual_seed(3)
    expected = [list(b) for b in theirs]
    expected_state = torch.random.get_rng_state()
    torch.manual_seed(3)
    idx, entries = read_whole_pass(ours, ROWS)
    assert torch.equal(torch.random.get_rng_state(), expected_state)
    normalised = [[i + ROWS if isinstance(i, int) and not isinstance(i, bool) and i < 0 else i for i in b]
                  for b in expected]
    if idx is not None:  # the batches are the consecutive batch_size slices of one tensor
        assert entries == []
        assert [t.tolist() for t in idx.split(batch_size)] == normalised if expected else idx.numel() == 0
    else:
        assert _as_lists(entries) == expected
        assert [e.number for e in entries] == list(range(len(expected)))


def test_whole_pass_of_a_resumed_fastddp_sampler_starts_at_the_offset() -> None:
    sampler = fastddp.DistributedSampler(range(ROWS), num_replicas=2, rank=0, seed=1)
    sampler.load_state_dict({**sampler.state_dict(), "position": 10})
    reference = fastddp.DistributedSampler(range(ROWS), num_replicas=2, rank=0, seed=1)
    reference.load_state_dict({**reference.state_dict(), "position": 10})
    idx, entries = read_whole_pass(BatchSampler(sampler, 4, False), ROWS)
    assert idx is not None and entries == []  # gathered natively, one submission
    assert [t.tolist() for t in idx.split(4)] == [list(b) for b in BatchSampler(reference, 4, False)]
    assert sampler.state_dict() == reference.state_dict()  # the whole epoch reported as yielded


def test_iter_indices_is_what_an_iterator_yields() -> None:
    a = fastddp.DistributedSampler(range(ROWS), num_replicas=3, rank=1, seed=9)
    b = fastddp.DistributedSampler(range(ROWS), num_replicas=3, rank=1, seed=9)
    for s in (a, b):
        s.set_epoch(2)
        s.load_state_dict({**s.state_dict(), "position": 5})
    assert a.iter_indices().tolist() == list(iter(b))
    assert a.state_dict() == b.state_dict()
    assert a.iter_indices().tolist() == list(iter(b))  # the offset went to the first iterator only


def test_random_sampler_replay_matches_the_installed_torch() -> None:
    """The tensor replay of RandomSampler's draws is in use (the loader falls back to reading
    the sampler item by item when it is not)."""
    assert random_sampler_replay_matches()


def _pipeline(batch_rows: int = 0, pool: Any = None) -> tuple:
    x = torch.arange(ROWS * 3, dtype=torch.float32).reshape(ROWS, 3)
    opts = C.PipelineOptions()
    opts.num_workers, opts.prefetch, opts.batch_rows, opts.pool = 2, 2, batch_rows, pool
    return x, C.PrefetchPipeline([x], opts)


def _pass(pipe: Any, idx: torch.Tensor, batch: int) -> tuple[torch.Tensor, set[int]]:
    """One pass: its batches concatenated, and the ring buffers its full batches were delivered
    in (a short batch is a copy of its own size, outside the ring)."""
    pipe.submit_split(idx, batch)
    pipe.finish()
    got, storages = [], set()
    while out := pipe.next():
        got.append(out[0].clone())
        if len(out[0]) == batch:
            storages.add(out[0].data_ptr())  # row 0 of the slot: its buffer
        else:
            assert out[0].untyped_storage().nbytes() == out[0].nbytes
    return torch.cat(got), storages


def test_a_slot_pool_carries_the_ring_to_the_next_pass() -> None:
    # A pass returns its ring to the pool, and the next pass gathers into those buffers
    # instead of fresh memory (which the kernel faults in page by page on first write).
    pool = C.SlotPool()
    x, pipe = _pipeline(7, pool)
    idx = torch.randperm(ROWS)
    got, ring = _pass(pipe, idx, 7)
    assert torch.equal(got, x[idx])
    del pipe
    assert pool.size == len(ring)
    _, pipe = _pipeline(7, pool)
    idx = torch.randperm(ROWS)
    got, again = _pass(pipe, idx, 7)
    assert torch.equal(got, x[idx])
    assert again == ring and pool.size == 0


def test_a_slot_pool_never_hands_out_a_kept_batch() -> None:
    pool = C.SlotPool()
    x, pipe = _pipeline(7, pool)
    pipe.submit_split(torch.arange(ROWS), 7)
    pipe.finish()
    kept = []
    while out := pipe.next():
        kept.append(out[0])
    del pipe  # the ring's buffers are all held by `kept`
    _, pipe = _pipeline(7, pool)
    idx = torch.randperm(ROWS)
    got, _ = _pass(pipe, idx, 7)
    assert torch.equal(got, x[idx])
    assert torch.equal(torch.cat(kept), x)


@pytest.mark.parametrize("batch_rows", [0, 7, ROWS])
def test_submit_split_delivers_consecutive_batches(batch_rows: int) -> None:
    x, pipe = _pipeline(batch_rows)
    idx = torch.randperm(ROWS)
    pipe.submit_split(idx, 7)
    pipe.finish()
    got = []
    while out := pipe.next():
        got.append(out[0].clone())
    pipe.close()
    assert [len(b) for b in got] == [7] * 7 + [1]
    assert torch.equal(torch.cat(got), x[idx])


def test_submit_split_checks_its_arguments() -> None:
    _, pipe = _pipeline()
    with pytest.raises(RuntimeError, match="batch_size must be >= 1, got 0"):
        pipe.submit_split(torch.arange(4), 0)
    with pytest.raises(RuntimeError, match=f"index {ROWS} is out of range for a dataset of {ROWS} samples"):
        pipe.submit_split(torch.tensor([0, ROWS]), 1)
    with pytest.raises(RuntimeError, match="1-D int64 CPU tensor"):
        pipe.submit_split(torch.arange(4, dtype=torch.int32), 2)
    pipe.close()
    opts = C.PipelineOptions()
    opts.batch_rows = -1
    with pytest.raises(RuntimeError, match="batch_rows must be >= 0, got -1"):
        C.PrefetchPipeline([torch.zeros(3, 2)], opts)
