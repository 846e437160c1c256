"""PrefetchLoader against DataLoader, side by side: torch's extension points patched by a script
(``default_collate_fn_map``, ``TensorDataset.__getitem__``), what a script does to the batches
it gets (``detach_()``, in-place changes, ``_version``), and what libraries read of a loader
(``_dataset_kind``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset
from torch.utils.data._utils import collate as torch_collate

import fastddp
from tests.contracts.loader_harness import N, outcomes, same


def _half(batch: Any, *, collate_fn_map: Any = None) -> torch.Tensor:
    return torch_collate.collate_tensor_fn(batch, collate_fn_map=collate_fn_map).half()


def _rows(batch: list, *, collate_fn_map: Any = None) -> dict:
    return {"rows": torch.stack([sample[0] for sample in batch]), "count": len(batch)}


@pytest.mark.parametrize("entry", ["tensor", "tuple"])
def test_patched_default_collate_fn_map_is_used(monkeypatch, entry: str) -> None:
    """torch documents ``default_collate_fn_map`` as the way to extend default_collate: a
    TensorDataset's batches then come from the script's function, as from DataLoader's."""
    if entry == "tensor":
        monkeypatch.setitem(torch_collate.default_collate_fn_map, torch.Tensor, _half)
    else:
        monkeypatch.setitem(torch_collate.default_collate_fn_map, tuple, _rows)
    data = TensorDataset(torch.randn(N, 3), torch.arange(N))
    same(outcomes(DataLoader(data, batch_size=4)), outcomes(fastddp.PrefetchLoader(data, batch_size=4)))


def test_patched_tensor_dataset_getitem_is_used(monkeypatch) -> None:
    stock = TensorDataset.__getitem__
    monkeypatch.setattr(TensorDataset, "__getitem__",
                        lambda self, i: tuple(t * 10 for t in stock(self, i)))
    data = TensorDataset(torch.arange(N))
    same(outcomes(DataLoader(data, batch_size=4)), outcomes(fastddp.PrefetchLoader(data, batch_size=4)))


@pytest.mark.parametrize("workers", [0, 2])
def test_batches_are_tensors_of_their_own(workers: int) -> None:
    """A batch is no view (``detach_()`` works, ``_base`` is None), and an in-place change to
    one batch does not show in the next batches' version counters (DataLoader's batches are
    made anew; the native gather's share ring slots)."""
    seen = []
    for cls in (DataLoader, fastddp.PrefetchLoader):
        out = []
        for x, _ in cls(TensorDataset(torch.randn(N, 3), torch.arange(N)), batch_size=4):
            out.append((x._is_view(), x._base is None, x._version))
            x.detach_()
            x.sub_(1).div_(2)
        seen.append(out)
    assert seen[0] == seen[1], seen


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(6))

    def __len__(self) -> int:
        return 6


def test_private_dataset_kind_as_dataloader() -> None:
    """pytorch-ignite's DeterministicEngine reads ``_dataset_kind`` to decide whether it may
    rebuild the loader with a batch sampler of its own."""
    for make in (lambda: TensorDataset(torch.arange(N)), _Stream):
        ref, ours = DataLoader(make(), batch_size=2), fastddp.PrefetchLoader(make(), batch_size=2)
        assert ref._dataset_kind == ours._dataset_kind
        assert ref._IterableDataset_len_called == ours._IterableDataset_len_called
        assert len(ref) == len(ours)
        assert ref._IterableDataset_len_called == ours._IterableDataset_len_called


class _GetItemOnly:
    """A dataset with ``__getitem__`` and no ``__len__``: DataLoader reads it through a sampler."""

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(i)


@pytest.mark.parametrize("kwargs", [{"sampler": [0, 3, 1, 2]}, {}], ids=["sampler", "no sampler"])
def test_dataset_without_len(kwargs: dict) -> None:
    results = []
    for cls in (DataLoader, fastddp.PrefetchLoader):
        loader = cls(_GetItemOnly(), batch_size=2, **kwargs)
        try:
            results.append(("len", len(loader)))
        except TypeError as exc:
            results.append(("len", type(exc)))
        results.append(outcomes(loader) if kwargs else None)
    assert results[0] == results[2]
    if kwargs:
        same(results[1], results[3])


def test_dict_of_columns_indexed_by_its_keys_is_refused_naming_the_fix() -> None:
    """A dict of tensors under string keys is PrefetchLoader's columns; a sampler of its keys
    meant DataLoader's ``dataset[key]``: refused at that batch, naming the fix."""
    feats = {f"img{i}": torch.full((3,), float(i)) for i in range(6)}
    assert len(outcomes(DataLoader(feats, batch_size=2, sampler=list(feats)))) == 3
    with pytest.raises(TypeError, match=r"the sampler gave the index 'img0', but a dict of tensors under "
                                        r"string keys is read as columns .* pass a Dataset whose "
                                        r"__getitem__\(key\) returns the dict's tensor"):
        next(iter(fastddp.PrefetchLoader(feats, batch_size=2, sampler=list(feats))))
