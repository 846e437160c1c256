"""A pass over tensors whose rows C++ threads gather (:class:`NativePass`), read as DataLoader
reads its sampler and dataset."""

from __future__ import annotations

import collections
import itertools
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .._ext import C
from .passes import Replay, add_note, pin, raise_as_worker_error, to_device
from .plan import PlanEntry, draw_base_seed, read_whole_pass, replaying, to_entry
from .sources import Sources
from .watch import TensorsWatch, stale_copy_error


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
    workers: int = 0                       # DataLoader worker processes stood in for
    persistent: bool = False               # ... kept from pass to pass (persistent_workers)


class Cuts:
    """Where a pass read whole is cut into batches: runs of equal batches over its ``n``
    indices, each ``(first batch, first index, batch size)`` with the last batch of a run
    shorter; one run unless ``batch_sampler.batch_size`` was set during the pass."""

    def __init__(self, n: int, size: int) -> None:
        self.n = n
        self.runs = [(0, 0, size)]

    def __len__(self) -> int:
        first, pos, size = self.runs[-1]
        return first + (-(-(self.n - pos) // size) if size else 0)

    def __getitem__(self, k: int) -> tuple[int, int]:
        """Batch ``k``'s slice of the indices."""
        first, pos, size = next(run for run in reversed(self.runs) if run[0] <= k)
        start = pos + (k - first) * size
        return start, min(start + size, self.n)

    def recut(self, k: int, size: int) -> None:
        """Batches from ``k`` on have ``size`` (0: there are none)."""
        pos = self[k][0] if k < len(self) else self.n
        self.runs = [run for run in self.runs if run[0] < k] + [(k, pos, size)]


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
        self.bounds = Cuts(0, 1)  # each batch's slice of them
        self.uniform_next = 0
        self.planned: tuple[Any, Any] = (None, None)  # batch_size and drop_last the pass was read with
        self.python_reads = False  # the dataset changed during the pass: read in Python from then on
        self.watch: Optional[TensorsWatch] = None  # the tensors DataLoader would read from
        self.owner = os.getpid()  # the process whose threads gather this pass

    def start(self, generator: Optional[torch.Generator], draw_seed: bool, replay: Replay) -> None:
        self.close()
        self.entries.clear()
        self.read, self.exhausted, self.started = 0, False, False
        self.uniform, self.bounds, self.uniform_next = None, Cuts(0, 1), 0
        self.planned, self.python_reads = (None, None), False
        self.owner = os.getpid()
        if self.s.workers == 0 or self.watch is None:  # workers keep what they found at their start
            self.watch = TensorsWatch(self.sources.dataset)
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
        natively they are consecutive slices of one index tensor (``self.uniform``, cut at
        ``self.bounds``), submitted to the pipeline in one call; else one entry a batch."""
        # The sampler is read once: should it raise, its iterator is over, as a generator that
        # raised is, and the next next() ends the pass as DataLoader's does.
        self.it = iter(())
        self.exhausted = True
        idx, entries = read_whole_pass(self.index_sampler, self.rows)
        self.planned = (self.index_sampler.batch_size, self.index_sampler.drop_last)
        if idx is not None:
            size = self.index_sampler.batch_size
            self.uniform = idx[skip * size:]
            self.bounds = Cuts(len(self.uniform), size)
            self.read = len(self.bounds)
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
        self._follow_batch_size(k)
        if k == len(self.bounds):
            self.close()
            raise StopIteration
        self._check_held()
        self.uniform_next = k + 1
        start, stop = self.bounds[k]
        if self.python_reads:
            return self._fetch(k, self.uniform[start:stop].tolist())
        if self.s.resident:
            idx = self.uniform[start:stop].to(self.s.device, non_blocking=True)
            return self.sources.wrap([t.index_select(0, idx) for t in self.s.tensors])
        return self.sources.wrap(self.pipe.next())

    def _follow_batch_size(self, k: int) -> None:
        """``batch_sampler.batch_size`` assigned during a pass read whole: torch's BatchSampler
        (without ``drop_last``, which fixes its batches at ``iter()``) reads it for every batch it
        makes, and DataLoader asks for batch ``k + ahead`` at the ``next()`` of batch ``k``: the
        batches from there on are cut again at the new size, as DataLoader's would be."""
        size, drop_last = self.index_sampler.batch_size, self.planned[1]
        if size == self.planned[0] or drop_last:
            return
        itertools.islice((), size)  # a size BatchSampler's islice refuses: its ValueError, here
        self.planned = (size, drop_last)
        self.bounds.recut(min(k + self.s.start_reads, len(self.bounds)), size)  # after those DataLoader read
        if self.pipe is not None:  # gathered ahead at the old size: gather again from batch k
            self.close()
            self._build_pipeline()
            for j in range(k, len(self.bounds)):
                start, stop = self.bounds[j]
                self.pipe.submit(self.uniform[start:stop])
            self.pipe.finish()

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
        if self.pipe is not None and os.getpid() != self.owner:
            # A forked child going on with its parent's pass: the gathering threads are the
            # parent's, so the rest is read in Python, as DataLoader without workers reads it.
            self.python_reads = True
            self.close()
        if self.s.workers == 0 and not self.python_reads and self._dataset_changed():
            # DataLoader without workers indexes the dataset at each batch, so from here on the
            # batches hold the new values; what the pipeline gathered ahead is stale
            self.python_reads = True
            self.close()
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
        if self.planned[0] is not None and self.index_sampler.batch_size != self.planned[0] \
                and not self.planned[1]:
            raise ValueError(f"PrefetchLoader: batch_sampler.batch_size was set to "
                             f"{self.index_sampler.batch_size!r} during a pass read whole at batch size "
                             f"{self.planned[0]!r} with indices that are read in Python; set it between passes")
        self._check_held()
        entry = self.entries.popleft()
        if entry.indices is None or self.python_reads:
            return self._fetch(entry.number, entry.raw)
        if self.s.resident:
            idx = entry.indices.to(self.s.device, non_blocking=True)
            return self.sources.wrap([t.index_select(0, idx) for t in self.s.tensors])
        return self.sources.wrap(self.pipe.next())

    def _fetch(self, number: int, raw: Any) -> Any:
        """Batch ``number`` read through the dataset in Python, as DataLoader's fetcher reads it."""
        try:
            batch = self.sources.fetch(raw)
        except Exception as exc:
            note = f"PrefetchLoader: raised reading batch {number} (indices {raw!r})"
            if self.s.workers > 0:  # DataLoader would have read it in a worker process
                raise_as_worker_error(exc, number, self.s.workers, note)
            add_note(exc, note)
            raise
        return to_device(pin(batch) if self.s.pin and self.s.device.type == "cpu" else batch, self.s.device)

    def _dataset_changed(self) -> bool:
        """Without workers: whether the dataset's ``tensors`` were replaced or written in place
        since the pass started."""
        return self.watch.replaced() or self.watch.changed() is not None

    def _check_held(self) -> None:
        """With workers, before a batch is delivered: DataLoader's workers would read it from
        their copy of the dataset, so a tensor written in place since they took it is refused."""
        if self.s.workers > 0 and (position := self.watch.changed()) is not None:
            raise stale_copy_error(position, self.s.workers, self.s.persistent)

    def close(self) -> None:
        if self.pipe is not None:
            self.pipe.close()
            self.pipe = None
