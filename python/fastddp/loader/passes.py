"""One pass over the data through torch's own DataLoader machinery (:class:`TorchPass`: any
dataset, collation or worker set-up the native pipeline does not take, see native.py), and what
both kinds of pass share: where a resumed pass starts, and batches delivered on the loader's
device, with DataLoader's errors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NoReturn, Optional

import torch
from torch.utils._pytree import tree_map_only
from torch.utils.data import DataLoader

from .plan import SkippingSampler, replaying


def to_device(batch: Any, device: torch.device) -> Any:
    """Every tensor of a (nested) batch on ``device``, copied asynchronously."""
    if device.type == "cpu":
        return batch
    return tree_map_only(torch.Tensor, lambda t: t.to(device, non_blocking=True), batch)


def pin(batch: Any) -> Any:
    return tree_map_only(torch.Tensor, lambda t: t.pin_memory(), batch)


def add_note(exc: BaseException, note: str) -> None:
    """Attach ``note`` to the exception's report (Python >= 3.11; a no-op before), replacing
    the note an earlier raise of the same instance got (a dataset may raise one it keeps)."""
    if not hasattr(exc, "add_note"):
        return
    notes = getattr(exc, "__notes__", None)
    if notes:
        notes[:] = [n for n in notes if not n.startswith("PrefetchLoader: raised reading batch")]
    exc.add_note(note)


def raise_as_worker_error(exc: Exception, batch: int, workers: int, note: str) -> NoReturn:
    """Raise ``exc`` of batch ``batch`` (of the pass) as DataLoader with ``workers`` worker
    processes raises it: wrapped by torch's ``ExceptionWrapper`` ("Caught IndexError in
    DataLoader worker process 1. Original Traceback …", the same type; a type that takes no
    message becomes a RuntimeError), from the worker DataLoader hands that batch to (batches go
    round-robin over the workers), with ``note`` added."""
    from torch._utils import ExceptionWrapper

    wrapper = ExceptionWrapper((type(exc), exc, exc.__traceback__),
                               where=f"in DataLoader worker process {batch % workers}")
    try:
        wrapper.reraise()
    except Exception as wrapped:
        add_note(wrapped, note)
        raise wrapped from None  # DataLoader's re-raise chains nothing
    raise AssertionError("ExceptionWrapper.reraise() returned")  # it always raises


@dataclass
class Replay:
    """Where a resumed pass starts: batches already delivered, and the random state its pass
    started from (see :func:`plan.replaying`)."""

    skip: int = 0
    rng_state: Optional[torch.Tensor] = None
    generator_state: Optional[torch.Tensor] = None
    epoch: Optional[int] = None  # the saved pass's epoch: a pass of another epoch starts fresh

    @property
    def resumes(self) -> bool:
        """Whether the next pass continues a saved one (batches to skip, or its random state)."""
        return bool(self.skip) or self.rng_state is not None or self.generator_state is not None


class TorchPass:
    """A pass of torch's own DataLoader built with the loader's arguments: the dataset's
    samples, collation, worker processes, seeds and ``get_worker_info()`` are DataLoader's."""

    def __init__(self, runner: DataLoader, skipper: Optional[SkippingSampler], device: torch.device) -> None:
        self.runner, self.skipper, self.device = runner, skipper, device
        self.it: Any = None
        self.delivered = 0
        self.direct: Optional[bool] = None

    def start(self, generator: Optional[torch.Generator], draw_seed: bool, replay: Replay) -> None:
        del draw_seed  # the runner draws its own, as DataLoader does
        if self.skipper is not None:
            self.skipper.skip = replay.skip
        with replaying(replay.rng_state, generator, replay.generator_state):
            self.it = iter(self.runner)
            if self.skipper is not None and self.skipper.current is not None:
                self.skipper.current.prime()
        self.delivered = 0
        if self.skipper is None:  # a stream: the delivered batches are read again and dropped
            for _ in range(replay.skip):
                if next(self.it, None) is None:
                    break

    def next(self) -> Any:
        try:
            batch = next(self.it)
        except StopIteration:
            raise
        except Exception as exc:
            add_note(exc, f"PrefetchLoader: raised reading batch {self.delivered}")
            self.delivered += 1
            raise
        self.delivered += 1
        return to_device(batch, self.device)

    def close(self) -> None:
        self.it = None


def build_runner(loader: Any, dataset: Any, iterable: bool) -> tuple[DataLoader, Optional[SkippingSampler]]:
    """torch's DataLoader over ``dataset`` with the loader's current arguments; its index
    sampler wrapped so that a resumed pass skips the delivered batches without reading them."""
    workers = loader.num_workers
    # collate_fn None stands for the default only when given to the constructor; assigned later,
    # DataLoader calls it. timeout is checked by the constructor only; assigned later, a
    # negative one reaches DataLoader's iterator (assigned below, after construction).
    collate_fn = _call_none if loader.collate_fn is None else loader.collate_fn
    kwargs: dict[str, Any] = dict(
        num_workers=workers, collate_fn=collate_fn, pin_memory=loader.pin_memory,
        timeout=0, worker_init_fn=loader.worker_init_fn, generator=loader.generator,
        pin_memory_device=loader.pin_memory_device, in_order=loader.in_order)
    if workers > 0:  # DataLoader refuses these without workers, and ignores them once set
        kwargs.update(prefetch_factor=loader.prefetch_factor, persistent_workers=loader.persistent_workers,
                      multiprocessing_context=loader.multiprocessing_context)
    runner, skipper = _make_runner(loader, dataset, iterable, kwargs)
    runner.timeout = loader.timeout
    return runner, skipper


class _Runner(DataLoader):
    """torch's DataLoader, whose constructor skips the worker-count warning: the loader's own
    constructor gave it, and the runner is made at every pass. Its iterators still check, as
    DataLoader's do at every pass. (Not ``warnings.catch_warnings``: entering it resets every
    module's record of the warnings already shown, so "once" warnings would come again.)"""

    _built = False

    def check_worker_number_rationality(self) -> None:
        if self._built:
            super().check_worker_number_rationality()


def _make_runner(loader: Any, dataset: Any, iterable: bool,
                 kwargs: dict[str, Any]) -> tuple[DataLoader, Optional[SkippingSampler]]:
    skipper: Optional[SkippingSampler] = None
    if iterable:
        runner = _Runner(dataset, batch_size=loader.batch_size, drop_last=loader.drop_last, **kwargs)
    elif loader.batch_sampler is not None:
        skipper = SkippingSampler(loader.batch_sampler)
        runner = _Runner(dataset, batch_sampler=skipper, **kwargs)
    else:
        skipper = SkippingSampler(loader.sampler)
        runner = _Runner(dataset, batch_size=None, sampler=skipper, **kwargs)
    runner._built = True
    return runner, skipper


def _call_none(batch: Any) -> Any:
    """``collate_fn = None`` assigned after construction: DataLoader calls None for every
    batch (in its workers too); this module-level stand-in fails the same way and pickles."""
    raise TypeError("'NoneType' object is not callable")


def with_random_state(state: dict[str, Any], rng_state: Optional[torch.Tensor],
                      generator_state: Optional[torch.Tensor]) -> dict[str, Any]:
    """A loader ``state`` with the random state its pass starts from (the generator's, or the
    global one)."""
    if generator_state is not None:
        state["generator_state"] = generator_state.clone()
    elif rng_state is not None:
        state["rng_state"] = rng_state.clone()
    return state
