"""What a dataset is to PrefetchLoader: tensors whose rows C++ threads can gather (a
``TensorDataset``, or PrefetchLoader's own forms: a tuple of tensors or of ``.npy`` paths, a
dict of tensors under string keys), or a Python dataset that torch's DataLoader machinery
reads (a list is always one)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, TensorDataset, default_collate
from torch.utils.data._utils import collate as torch_collate

# TensorDataset's own sample reading, as torch defines it (a script may patch the class)
_TENSOR_DATASET_GETITEM = TensorDataset.__getitem__


class Columns(Dataset):
    """PrefetchLoader's own dataset forms seen as a map-style Dataset: sample ``i`` is the
    tuple of row ``i`` of every tensor (what ``TensorDataset`` gives)."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.tensors = tuple(tensors)

    def __getitem__(self, index: Any) -> tuple[torch.Tensor, ...]:
        return tuple(t[index] for t in self.tensors)

    def __len__(self) -> int:
        return len(self.tensors[0])


@dataclass
class Sources:
    """``kind``: ``"tensors"``/``"npy"`` (PrefetchLoader's forms: a tensor, a tuple or dict of
    tensors, ``.npy`` paths; always gathered natively),
    ``"dataset"`` (a map-style Dataset; ``gatherable`` when it is a plain TensorDataset) or
    ``"iterable"``. ``dataset`` is what the DataLoader machinery indexes."""

    kind: str
    dataset: Any
    keys: Optional[list[str]] = None
    single: bool = False  # one tensor given bare, yielded bare

    @property
    def own_form(self) -> bool:
        return self.kind in ("tensors", "npy")

    @property
    def gatherable(self) -> bool:
        """Rows can be gathered natively with the result DataLoader's default collation gives."""
        return self.own_form or (is_plain_tensor_dataset(self.dataset) and stock_tensor_collation())

    def tensors(self) -> list[torch.Tensor]:
        """The tensors rows are gathered from, read now (a TensorDataset's may be replaced)."""
        return list(self.dataset.tensors)

    def wrap(self, columns: Sequence[torch.Tensor]) -> Any:
        """One batch from its per-tensor columns, in the form DataLoader (or, for our own
        forms, PrefetchLoader) yields: a list for a TensorDataset, as ``default_collate`` makes
        of tuple samples; the input's form otherwise."""
        if not self.own_form:
            return list(columns)
        if self.keys is not None:
            return dict(zip(self.keys, columns))
        return columns[0] if self.single else tuple(columns)

    def fetch(self, indices: list[Any]) -> Any:
        """One batch read sample by sample, exactly as DataLoader's fetcher reads it (so an
        index DataLoader refuses raises what indexing the dataset raises)."""
        if self.keys is not None:
            check_row_indices(indices, self.keys)
        samples = [self.dataset[i] for i in indices]
        batch = default_collate(samples)
        return self.wrap(batch) if self.own_form else batch


def check_row_indices(indices: list[Any], keys: list[str]) -> None:
    """A dict of tensors under string keys is read as columns; a sampler that gives one of its
    keys meant DataLoader's reading of it (``dataset[key]``): refused, naming the fix."""
    for i in indices:
        if isinstance(i, str):
            raise TypeError(f"PrefetchLoader: the sampler gave the index {i!r}, but a dict of tensors "
                            "under string keys is read as columns (batch rows taken by integer index "
                            f"from every tensor, keys {', '.join(map(repr, keys[:3]))}{', ...' if len(keys) > 3 else ''}), "
                            "not looked up by key as DataLoader looks it up. To read dataset[key], "
                            "pass a Dataset whose __getitem__(key) returns the dict's tensor")


def _plain_data(t: torch.Tensor) -> Optional[str]:
    """None when gathering ``t``'s rows gives what ``torch.stack`` of them gives (a dense
    tensor outside autograd, of no subclass); else what it is instead."""
    if t.layout != torch.strided:
        return f"a {t.layout} tensor"
    if t.is_nested:
        return "a nested tensor (its rows may differ in shape; torch.stack decides)"
    if t.is_quantized:
        return "a quantized tensor (its rows carry the quantizer, kept by torch.stack)"
    if t.device.type == "meta":
        return "a meta tensor (it has no data to gather)"
    if t.requires_grad:
        return "a tensor that requires grad (its batches carry autograd history)"
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        return f"a {type(t).__name__} (a tensor subclass, kept by torch.stack)"
    return None


def is_plain_tensor_dataset(dataset: Any) -> bool:
    """A TensorDataset whose samples are TensorDataset's own rows (a subclass that overrides
    how samples are read goes through Python, as with DataLoader) of tensors that are plain
    data (others, e.g. ones that require grad, are collated by torch as DataLoader does), all
    of one length (tensors replaced after construction may differ: DataLoader then reads rows
    until an index is past the shortest, and so does the Python path)."""
    cls = type(dataset)
    if not (isinstance(dataset, TensorDataset) and cls.__getitem__ is _TENSOR_DATASET_GETITEM
            and getattr(cls.__getitem__, "__module__", None) == "torch.utils.data.dataset"
            and getattr(cls, "__getitems__", None) is None and len(dataset.tensors) > 0):
        return False
    tensors = dataset.tensors
    return (all(isinstance(t, torch.Tensor) and _plain_data(t) is None for t in tensors)
            and all(t.dim() > 0 and len(t) == len(tensors[0]) for t in tensors))


def stock_tensor_collation() -> bool:
    """``default_collate`` collates a TensorDataset's samples (tuples of tensors) as torch ships
    it: ``default_collate_fn_map`` (which torch documents as the way to extend it) still has
    torch's function for tensors and no entry that takes tuples."""
    fn_map = torch_collate.default_collate_fn_map
    return (fn_map.get(torch.Tensor) is torch_collate.collate_tensor_fn
            and getattr(fn_map.get(torch.Tensor), "__module__", None) == torch_collate.__name__
            and not any(issubclass(tuple, key) for key in fn_map))


def _load_npy(paths: list[Any]) -> list[torch.Tensor]:
    arrays = []
    for p in paths:
        if not str(p).endswith(".npy"):
            raise ValueError(f"PrefetchLoader: {p} is not a .npy file; pass tensors, .npy "
                             "paths or a torch Dataset")
        # Memory-mapped: rows are read straight into the gather. Copy-on-write ("c"): writable
        # (a write stays in this process), so torch.from_numpy has no read-only warning to give.
        arr = np.load(p, mmap_mode="c")
        if not arr.flags.c_contiguous:
            raise ValueError(f"PrefetchLoader: {p} is not C-contiguous (Fortran order); "
                             "re-save it with np.save(path, np.ascontiguousarray(a))")
        arrays.append(torch.from_numpy(arr))
    return arrays


def _check_rows(tensors: list[torch.Tensor]) -> None:
    for i, s in enumerate(tensors):
        what = _plain_data(s)
        if what is not None:
            raise ValueError(f"PrefetchLoader: tensor {i} is {what}; tensors given as columns are "
                             "gathered as plain data. Wrap them in a TensorDataset to have them "
                             "collated as DataLoader does")
    n = len(tensors[0]) if tensors[0].dim() else 0
    for i, s in enumerate(tensors):
        if s.dim() == 0 or len(s) != n:
            raise ValueError(f"PrefetchLoader: tensor {i} has shape {tuple(s.shape)}; every "
                             f"tensor needs the same first dimension ({n})")


def _npy_paths(dataset: Any) -> bool:
    """A tuple of ``.npy`` paths: PrefetchLoader's memory-mapped columns. Any other tuple or
    list of strings is a sequence of samples, as DataLoader reads it."""
    return (isinstance(dataset, tuple) and bool(dataset)
            and all(isinstance(v, (str, os.PathLike)) and str(v).endswith(".npy")
                    for v in dataset))


def classify(dataset: Any) -> Sources:
    """The :class:`Sources` of ``dataset``; a TypeError names what can be loaded."""
    if isinstance(dataset, IterableDataset):
        return Sources("iterable", dataset)
    if isinstance(dataset, Dataset):
        return Sources("dataset", dataset)
    if isinstance(dataset, torch.Tensor):
        _check_rows([dataset])
        return Sources("tensors", Columns([dataset]), single=True)
    # A dict of tensors under string keys is columns (DataLoader cannot index it); under other
    # keys it is what DataLoader reads: a map-style dataset of its values.
    if (isinstance(dataset, Mapping) and dataset and all(isinstance(k, str) for k in dataset)
            and all(isinstance(v, torch.Tensor) for v in dataset.values())):
        _check_rows(list(dataset.values()))
        return Sources("tensors", Columns(list(dataset.values())), keys=list(dataset.keys()))
    # A tuple of tensors, or of .npy paths, is columns (TensorDataset(*t)); a list stays what
    # DataLoader reads it as: a sequence of samples (tensors, strings, file names).
    if isinstance(dataset, tuple) and dataset and all(isinstance(v, torch.Tensor) for v in dataset):
        _check_rows(list(dataset))
        return Sources("tensors", Columns(list(dataset)), single=len(dataset) == 1)
    if isinstance(dataset, (str, os.PathLike)) or _npy_paths(dataset):
        paths = [dataset] if isinstance(dataset, (str, os.PathLike)) else list(dataset)
        arrays = _load_npy(paths)
        _check_rows(arrays)
        return Sources("npy", Columns(arrays), single=isinstance(dataset, (str, os.PathLike)))
    if hasattr(dataset, "__getitem__"):  # without __len__, DataLoader reads it through a sampler
        return Sources("dataset", dataset)
    raise TypeError(f"PrefetchLoader: cannot load from {type(dataset).__name__}; pass a "
                    "TensorDataset, a tuple/dict of tensors, .npy paths, a map-style Dataset or "
                    "an IterableDataset")
