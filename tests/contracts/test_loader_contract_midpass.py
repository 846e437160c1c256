"""PrefetchLoader against DataLoader when something happens during a pass:
``batch_sampler.batch_size`` assigned between two ``next()`` calls, a ``TensorDataset``'s
``tensors`` replaced by new tensors, a sampler that raises, the process forked. The batches,
the errors and the end of the pass must be DataLoader's."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset, WeightedRandomSampler
from torch.utils.data.distributed import DistributedSampler

import fastddp
from tests import forking


def _pass_with(change: Callable[[Any], None], at: int, **kwargs: Any) -> list[list[list[int]]]:
    """Each loader's batches (as lists) over one pass, ``change(loader)`` applied after batch
    ``at``, from the same global random state, which must be the same after the pass."""
    got, states = [], []
    for cls in (DataLoader, fastddp.PrefetchLoader):
        torch.manual_seed(3)
        loader = cls(TensorDataset(torch.arange(40)), **kwargs)
        batches = []
        for k, (x,) in enumerate(loader):
            batches.append(x.tolist())
            if k == at:
                change(loader)
        got.append(batches)
        states.append(torch.random.get_rng_state())
    assert torch.equal(*states), "the global random state differs after the pass"
    return got


def _set_batch_size(size: int) -> Callable[[Any], None]:
    def change(loader: Any) -> None:
        loader.batch_sampler.batch_size = size
    return change


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kwargs", [{}, {"shuffle": True}, {"drop_last": True}],
                         ids=["sequential", "shuffle", "drop_last"])
@pytest.mark.parametrize("size", [5, 1])
def test_batch_size_set_during_a_pass_cuts_the_later_batches_as_dataloader(workers: int, kwargs: dict,
                                                                          size: int) -> None:
    """BatchSampler reads batch_size for each batch it makes (with drop_last its batches are
    fixed at iter()); DataLoader asks for it as the batch is read: at its next() without workers,
    prefetch_factor * num_workers batches ahead with them."""
    torch_batches, ours = _pass_with(_set_batch_size(size), at=1, batch_size=3, num_workers=workers, **kwargs)
    assert ours == torch_batches


def _replace_tensors(longer: bool) -> Callable[[Any], None]:
    def change(loader: Any) -> None:
        n = 60 if longer else 40
        loader.dataset.tensors = (torch.arange(n) + 1000,)
    return change


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kwargs", [{"batch_size": 4}, {"batch_size": 4, "drop_last": True},
                                    {"batch_size": 4, "shuffle": True}],
                         ids=["sequential", "drop_last", "shuffle"])
def test_tensors_replaced_during_a_pass_are_read_as_dataloader_reads_them(workers: int, kwargs: dict) -> None:
    """Without workers DataLoader indexes the dataset at each batch, so the batches after the
    replacement are the new tensors' rows; its workers hold the dataset as the pass found it."""
    torch_batches, ours = _pass_with(_replace_tensors(False), at=2, num_workers=workers, **kwargs)
    assert ours == torch_batches
    assert any(v >= 1000 for b in ours for v in b) == (workers == 0)


@pytest.mark.parametrize("kwargs", [{"batch_size": 4}, {"batch_size": 4, "drop_last": True}],
                         ids=["sequential", "drop_last"])
def test_longer_tensors_replaced_during_a_pass(kwargs: dict) -> None:
    """A sequential pass keeps the length it started with (its sampler read it at iter())."""
    torch_batches, ours = _pass_with(_replace_tensors(True), at=2, **kwargs)
    assert ours == torch_batches


def _write_in_place(loader: Any) -> None:
    loader.dataset.tensors[0].add_(1000)


@pytest.mark.parametrize("kwargs", [{"batch_size": 4}, {"batch_size": 4, "drop_last": True},
                                    {"batch_size": 4, "shuffle": True}, {"batch_size": 4, "prefetch": 6},
                                    {"batch_size": 4, "device_resident": True}],
                         ids=["sequential", "drop_last", "shuffle", "prefetch", "device_resident"])
def test_tensor_written_in_place_during_a_pass_without_workers(kwargs: dict) -> None:
    """DataLoader without workers reads each batch at its next(): the batches after the write hold
    the new values, though the threads had gathered some of them ahead."""
    def run(cls: Any) -> tuple[list[list[int]], torch.Tensor]:
        torch.manual_seed(3)
        own = ("prefetch", "device_resident")  # PrefetchLoader's options
        args = {k: v for k, v in kwargs.items() if cls is fastddp.PrefetchLoader or k not in own}
        loader = cls(TensorDataset(torch.arange(40)), **args)
        batches = []
        for k, (x,) in enumerate(loader):
            batches.append(x.tolist())
            if k == 1:
                _write_in_place(loader)
        return batches, torch.random.get_rng_state()
    (torch_batches, torch_rng), (ours, rng) = run(DataLoader), run(fastddp.PrefetchLoader)
    assert ours == torch_batches
    assert torch.equal(rng, torch_rng)
    assert any(v >= 1000 for v in ours[2])


@pytest.mark.parametrize("kwargs", [{}, {"shuffle": True}], ids=["sequential", "shuffle"])
def test_tensor_written_in_place_during_a_pass_with_workers_is_refused(kwargs: dict) -> None:
    """DataLoader's workers read their copy of the dataset (taken at iter()) and deliver the old
    values; the threads cannot, so the first batch after the write is refused, naming the fix,
    and every batch delivered before it is DataLoader's."""
    torch.manual_seed(3)
    ref = DataLoader(TensorDataset(torch.arange(40)), batch_size=4, num_workers=2, **kwargs)
    torch_batches = []
    for k, (x,) in enumerate(ref):
        torch_batches.append(x.tolist())
        if k == 1:
            _write_in_place(ref)
    assert all(v < 1000 for b in torch_batches for v in b)
    torch.manual_seed(3)
    loader = fastddp.PrefetchLoader(TensorDataset(torch.arange(40)), batch_size=4, num_workers=2, **kwargs)
    it = iter(loader)
    ours = [next(it)[0].tolist() for _ in range(2)]
    _write_in_place(loader)
    with pytest.raises(RuntimeError, match=r"tensor 0 of the dataset was changed in place after iter\(\), "
                                           r"with num_workers=2.*use num_workers=0"):
        next(it)
    assert ours == torch_batches[:2]


def test_tensor_written_after_the_last_batch_with_workers_ends_the_pass() -> None:
    loader = fastddp.PrefetchLoader(TensorDataset(torch.arange(8)), batch_size=4, num_workers=2)
    it = iter(loader)
    got = [next(it)[0].tolist() for _ in range(2)]
    _write_in_place(loader)
    with pytest.raises(StopIteration):
        next(it)
    assert got == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert next(iter(loader))[0].tolist() == [1000, 1001, 1002, 1003]  # a new pass, new workers


@pytest.mark.parametrize("change", ["replaced", "in place"])
def test_persistent_workers_keep_the_first_pass_dataset(change: str) -> None:
    """Persistent workers hold the dataset as the first pass found it: tensors replaced later
    are not read (by either loader), and one written in place is refused at the next batch."""
    passes = []
    for cls in (DataLoader, fastddp.PrefetchLoader):
        loader = cls(TensorDataset(torch.arange(12)), batch_size=4, num_workers=1, persistent_workers=True)
        first = [x.tolist() for (x,) in loader]
        if change == "replaced":
            loader.dataset.tensors = (torch.arange(12) + 1000,)
        else:
            _write_in_place(loader)
        if cls is fastddp.PrefetchLoader and change == "in place":
            with pytest.raises(RuntimeError, match=r"after the first pass, with num_workers=1 and "
                                                   r"persistent_workers=True.*persistent_workers=False"):
                next(iter(loader))
            continue
        passes.append((first, [x.tolist() for (x,) in loader]))
    assert all(p == passes[0] for p in passes)
    assert passes[0][1][0] == [0, 1, 2, 3]


def _negative_weight(data: TensorDataset) -> Any:
    return WeightedRandomSampler([1.0, -1.0] * 5, 5)  # torch.multinomial refuses it at the first read


def _grown_dataset(data: TensorDataset) -> Any:
    sampler = DistributedSampler(data, num_replicas=2, rank=0)
    data.tensors = (torch.arange(14.0),)  # its assertion: indices no longer match total_size
    return sampler


@pytest.mark.parametrize("make_sampler", [_negative_weight, _grown_dataset], ids=["negative_weight", "grown"])
def test_a_sampler_that_raises_ends_the_pass_as_dataloaders(make_sampler: Callable) -> None:
    # DataLoader's sampler iterator is a generator: once it raised, the pass is over
    seen, states = [], []
    for cls in (DataLoader, fastddp.PrefetchLoader):
        torch.manual_seed(0)
        data = TensorDataset(torch.arange(10.0))
        it = iter(cls(data, batch_size=3, sampler=make_sampler(data)))
        outcomes = []
        for _ in range(3):
            try:
                outcomes.append(next(it)[0].tolist())
            except StopIteration:
                outcomes.append("StopIteration")
            except Exception as exc:  # the error itself is compared
                outcomes.append((type(exc), str(exc).split("\n")[0]))
        seen.append(outcomes)
        states.append(torch.random.get_rng_state())
    assert seen[0] == seen[1] and seen[0][1:] == ["StopIteration"] * 2, seen
    assert torch.equal(*states)


def _rest_read_in_a_forked_child(cls: type) -> str | None:
    torch.manual_seed(5)
    expected = [x.tolist() for (x,) in DataLoader(TensorDataset(torch.arange(40)), batch_size=3, shuffle=True)]
    torch.manual_seed(5)
    it = iter(cls(TensorDataset(torch.arange(40)), batch_size=3, shuffle=True))
    first = next(it)[0].tolist()

    def rest() -> None:
        got = [first] + [x.tolist() for (x,) in it]
        if got != expected:
            raise AssertionError(f"the child read {got}, DataLoader's pass is {expected}")

    return forking.child_error_within(rest, 30)


@pytest.mark.parametrize("cls", [DataLoader, fastddp.PrefetchLoader])
def test_a_pass_goes_on_in_a_forked_child(cls: type) -> None:
    # the child has none of the parent's threads: it reads the rest of the pass (and does not hang)
    assert _rest_read_in_a_forked_child(cls) == ""
