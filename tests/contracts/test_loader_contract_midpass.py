"""PrefetchLoader against DataLoader when a script changes the batching or the data during a
pass: ``batch_sampler.batch_size`` assigned between two ``next()`` calls, and a
``TensorDataset``'s ``tensors`` replaced by new tensors. The batches must be DataLoader's."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import fastddp


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
