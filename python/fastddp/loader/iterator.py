"""``iter(PrefetchLoader)``: an iterator object like DataLoader's: after an exception at one
batch the next ``next()`` continues with the following batch, ``len()`` is the loader's, and
an IterableDataset that yields more batches than ``len()`` reported is warned about."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional


class Progress:
    """Batches delivered in the loader's current pass: owned by the loader (set when a pass
    starts, read by its ``state_dict``), counted up by the iterator as it delivers them."""

    __slots__ = ("delivered",)

    def __init__(self) -> None:
        self.delivered = 0


@dataclass
class LoaderHooks:
    """What the iterator asks of its loader."""

    restart: Callable[[Any, bool], None]          # (pass, draw_seed): start the pass anew
    progress: Progress                            # counted up per delivered batch
    len_reported: Callable[[], Optional[int]]     # len() last reported for an IterableDataset
    length: Callable[[], int]                     # the iterator's len(), as DataLoader's
    num_workers: Callable[[], int]
    dataset: Any


class LoaderIterator:
    """Wraps one pass (:class:`native.NativePass` or :class:`passes.TorchPass`)."""

    def __init__(self, pass_: Any, hooks: LoaderHooks) -> None:
        self._pass, self._hooks, self._progress = pass_, hooks, hooks.progress
        self._yielded = 0
        self._reported = hooks.len_reported()  # as DataLoader: what len() said before this pass

    def reset(self) -> None:
        """A new pass on the same workers (``persistent_workers``): no new base seed is drawn,
        as DataLoader's ``_reset`` draws none."""
        self._hooks.restart(self._pass, False)
        self._yielded = 0
        self._reported = self._hooks.len_reported()

    def _reset(self, loader: Any = None) -> None:
        """DataLoader's name for :meth:`reset`."""
        self.reset()

    def __iter__(self) -> LoaderIterator:
        return self

    def __next__(self) -> Any:
        batch = self._pass.next()
        self._yielded += 1
        self._progress.delivered += 1
        reported = self._reported
        if reported is not None and self._yielded > reported:
            message = (f"Length of IterableDataset {self._hooks.dataset} was reported to be {reported}"
                       f"(when accessing len(dataloader)), but {self._yielded} samples have been fetched. ")
            if self._hooks.num_workers() > 0:
                message += ("For multiprocessing data-loading, this could be caused by not properly "
                            "configuring the IterableDataset replica at each worker. Please see "
                            "https://pytorch.org/docs/stable/data.html#torch.utils.data.IterableDataset "
                            "for examples.")
            warnings.warn(message, stacklevel=2)
        return batch

    def __len__(self) -> int:
        return self._hooks.length()

    def __getstate__(self) -> Any:
        # DataLoader's iterators refuse with NotImplementedError too
        raise NotImplementedError(f"{type(self).__name__} cannot be pickled, as DataLoader's iterators cannot; "
                                  "save PrefetchLoader.state_dict() to resume a pass")
