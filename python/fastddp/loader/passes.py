"""One pass over the data: the iterator ``iter(PrefetchLoader)`` returns, over either the native
pipeline (C++ threads gathering rows of tensors) or torch's own DataLoader machinery (any other
dataset, collation or worker set-up), delivering batches on the loader's device."""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, NoReturn, Optional

import torch
from torch.utils._pytree import tree_map_only
from torch.utils.data import DataLoader

from .._ext import C
from .plan import PlanEntry, SkippingSampler, draw_base_seed, read_whole_pass, replaying, to_entry
from .sources import Sources


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


@dataclass
class NativeSettings:
    """How a native pass runs (the loader decides, see ``PrefetchLoader._native_settings``)."""

    tensors: list[torch.Tensor]            # gathered from (pinned or device copies as configured)
    resident: bool                         # tensors live on the device: gather there
    threads: int
    ring: int                              # ring slots of the C++ pipeline
    pin: bool                              # page-locked staging
    device: torch.device
    start_reads: int                       # batches read from the plan when the pass starts
    first_next_reads: int                  # batches read at the first next()
    whole_pass: bool                       # the first read reads every batch (reads_ahead_unobserved)
    batch_rows: int                        # rows of the largest batch, 0 when unknown
    pool: Any = None                       # C.SlotPool: host slots kept from pass to pass
    workers: int = 0                       # DataLoader worker processes stood in for (errors)


class NativePass:
    """Reads the plan as DataLoader would (see plan.py) and has C++ threads gather each batch's
    rows; a batch the gather cannot take (an index DataLoader would refuse) is read through the
    dataset in Python when its turn comes, so it fails, at that batch, as DataLoader fails."""

    def __init__(self, index_sampler: Any, sources: Sources, settings: NativeSettings) -> None:
        self.index_sampler, self.sources, self.s = index_sampler, sources, settings
        self.rows = len(settings.tensors[0])
        self.pipe: Any = None
        self.entries: collections.deque[PlanEntry] = collections.deque()
        self.it: Any = None
        self.read = 0
        self.exhausted = False
        self.started = False
        self.direct: Optional[bool] = None
        self.uniform: Optional[torch.Tensor] = None  # the pass's indices, when submitted whole
        self.uniform_count = self.uniform_next = 0

    def start(self, generator: Optional[torch.Generator], draw_seed: bool, replay: Replay) -> None:
        self.close()
        self.entries.clear()
        self.read, self.exhausted, self.started = 0, False, False
        self.uniform, self.uniform_count, self.uniform_next = None, 0, 0
        if not self.s.resident:  # (its threads start with the first batch submitted)
            self._build_pipeline()
        with replaying(replay.rng_state, generator, replay.generator_state):
            self.it = iter(self.index_sampler)  # DataLoader's order: the sampler, then the seed
            if draw_seed:
                draw_base_seed(generator)
                if self.s.workers > 0:
                    # DataLoader's worker iterator then resets itself (_reset(first_iter=True)),
                    # which asks the sampler for a new iterator and reads that one: a batch
                    # sampler that draws from the generator in its __iter__ draws again
                    self.it = iter(self.index_sampler)
            if replay.skip and self.s.whole_pass:
                self._read_whole_pass(replay.skip)
            for _ in range(replay.skip):
                if next(self.it, None) is None:
                    break
            self._read(self.s.start_reads)

    def _build_pipeline(self) -> None:
        opts = C.PipelineOptions()
        opts.num_workers, opts.prefetch = self.s.threads, self.s.ring
        opts.pin_memory, opts.device = self.s.pin, str(self.s.device)
        opts.batch_rows = self.s.batch_rows
        opts.pool = self.s.pool
        self.pipe = C.PrefetchPipeline([t.contiguous() for t in self.s.tensors], opts)
        self.direct = bool(self.pipe.direct)

    def _read_whole_pass(self, skip: int) -> None:
        """Reads every batch of the pass (dropping the first ``skip``). When all are gathered
        natively they are the consecutive slices of one index tensor (``self.uniform``),
        submitted to the pipeline in one call; else one entry a batch."""
        idx, entries = read_whole_pass(self.index_sampler, self.rows)
        self.it = iter(())
        self.exhausted = True
        if idx is not None:
            size = self.index_sampler.batch_size
            self.uniform = idx[skip * size:]
            self.uniform_count = -(-len(self.uniform) // size)
            self.read = self.uniform_count
            if self.pipe is not None:
                self.pipe.submit_split(self.uniform, size)
                self.pipe.finish()
            return
        self.read = len(entries) - skip
        for number, entry in enumerate(entries[skip:]):
            entry.number = number
            self.entries.append(entry)
        if self.pipe is None:
            return
        for entry in self.entries:
            if entry.indices is not None:
                self.pipe.submit(entry.indices)
        self.pipe.finish()

    def _next_uniform(self) -> Any:
        """The next batch of a pass submitted as one index tensor."""
        k = self.uniform_next
        if k == self.uniform_count:
            self.close()
            raise StopIteration
        self.uniform_next = k + 1
        if self.s.resident:
            size = self.index_sampler.batch_size
            idx = self.uniform[k * size:(k + 1) * size].to(self.s.device, non_blocking=True)
            return self.sources.wrap([t.index_select(0, idx) for t in self.s.tensors])
        return self.sources.wrap(self.pipe.next())

    def _read(self, count: int) -> None:
        try:  # before any read, as DataLoader's worker iterator asks range(prefetch_factor * workers)
            reads = range(count)
        except TypeError as exc:
            raise TypeError(f"{exc} (PrefetchLoader: prefetch_factor * num_workers is {count!r}; give "
                            "prefetch_factor as a positive int, or None for 2 batches a worker)") from None
        if reads and self.s.whole_pass and not self.exhausted:
            self._read_whole_pass(0)
            return
        for _ in reads:
            if self.exhausted:
                return
            try:
                batch = next(self.it)
            except StopIteration:
                self.exhausted = True
                if self.pipe is not None:
                    self.pipe.finish()
                return
            entry = to_entry(self.read, batch, self.rows)
            self.read += 1
            self.entries.append(entry)
            if entry.indices is not None and self.pipe is not None:
                self.pipe.submit(entry.indices)

    def next(self) -> Any:
        if self.uniform is not None:  # submitted whole: every batch is the next slice
            return self._next_uniform()
        if not self.started:
            self.started = True
            self._read(self.s.first_next_reads)
        if self.uniform is None:
            self._read(1)
        if self.uniform is not None:
            return self._next_uniform()
        if not self.entries:
            self.close()
            raise StopIteration
        entry = self.entries.popleft()
        if entry.indices is None:
            try:
                batch = self.sources.fetch(entry.raw)
            except Exception as exc:
                note = f"PrefetchLoader: raised reading batch {entry.number} (indices {entry.raw!r})"
                if self.s.workers > 0:  # DataLoader would have read it in a worker process
                    raise_as_worker_error(exc, entry.number, self.s.workers, note)
                add_note(exc, note)
                raise
            return to_device(pin(batch) if self.s.pin and self.s.device.type == "cpu" else batch,
                             self.s.device)
        if self.s.resident:
            idx = entry.indices.to(self.s.device, non_blocking=True)
            return self.sources.wrap([t.index_select(0, idx) for t in self.s.tensors])
        return self.sources.wrap(self.pipe.next())

    def close(self) -> None:
        if self.pipe is not None:
            self.pipe.close()
            self.pipe = None


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
