"""Which values of a ``TensorDataset`` a native pass must deliver, and whether the tensors it
gathers from still hold them.

DataLoader without workers indexes the dataset at every ``next()``: a tensor changed in place
(or ``dataset.tensors`` replaced) during a pass is read from the next batch on. Its worker
processes hold the dataset as it was when they started (at ``iter()``; with
``persistent_workers``, at the first pass) and never see a later change. PrefetchLoader's C++
threads read the tensors themselves, ahead of ``next()``, so a pass checks at each batch
whether what they read is still what DataLoader would deliver (:class:`TensorsWatch`)."""

from __future__ import annotations

from typing import Any, Optional

import torch


def _version(t: torch.Tensor) -> Optional[int]:
    """The tensor's version counter; None for an inference tensor, which has none (it can
    change only inside ``torch.inference_mode()``, unseen)."""
    return None if t.is_inference() else t._version


class TensorsWatch:
    """The ``tensors`` of a dataset (a ``TensorDataset``, or PrefetchLoader's columns) as a pass
    found them: the tuple object, its tensors and their version counters. Writes the counter
    does not see (through numpy, through ``.data``) are not detected."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self.held = dataset.tensors
        self.tensors = tuple(self.held)
        self.versions = [_version(t) for t in self.tensors]

    def replaced(self) -> bool:
        """Whether the dataset's ``tensors`` are other objects now (the same tuple object,
        which cannot change, answers at once)."""
        now = self.dataset.tensors
        if now is self.held and isinstance(now, tuple):
            return False
        return len(now) != len(self.tensors) or any(a is not b for a, b in zip(now, self.tensors))

    def changed(self) -> Optional[int]:
        """The position of the first of the held tensors written in place since, else None."""
        for i, (t, v) in enumerate(zip(self.tensors, self.versions)):
            if v is not None and t._version != v:
                return i
        return None


def stale_copy_error(position: int, workers: int, persistent: bool) -> RuntimeError:
    """The refusal for a tensor written in place while DataLoader's workers would hold a copy
    of it as it was at ``iter()`` (with ``persistent_workers``, at the first pass)."""
    since = "the first pass" if persistent else "iter()"
    fix = ("persistent_workers=False, so that each pass reads the values as they are at its iter()"
           if persistent else "change it between passes")
    return RuntimeError(
        f"PrefetchLoader: tensor {position} of the dataset was changed in place after {since}, with "
        f"num_workers={workers}{' and persistent_workers=True' if persistent else ''}. DataLoader's "
        f"worker processes hold a copy of the dataset taken at {since} and would go on delivering "
        "the old values; PrefetchLoader's threads read the tensor itself and cannot. To read the "
        f"new values, use num_workers=0 (each batch is read at its next()) or {fix}; to keep the "
        "old ones, assign the changed values to a copy (dataset.tensors = (...)): a pass keeps "
        "reading the tensors it started with.")
