"""``fastddp.PrefetchLoader``: whole batches gathered by C++ threads into pinned rings and
copied to the device on a side stream."""

from __future__ import annotations

import concurrent.futures
import os
import queue
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Optional, Union

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, TensorDataset, default_collate

from ._ext import C

_FAST_KINDS = ("tensors", "npy")


def _check_dataloader_only(**given: Any) -> None:
    """DataLoader arguments that have no meaning for C++ gather threads in this process: only
    their DataLoader defaults are accepted, anything else is one clear error."""
    defaults = {"worker_init_fn": None, "multiprocessing_context": None, "timeout": 0}
    why = {"worker_init_fn": "the workers are threads of this process, not worker processes to set up",
           "multiprocessing_context": "no worker processes are started",
           "timeout": "batches are waited for without a timeout"}
    for name, value in given.items():
        if value is not defaults[name] and value != defaults[name]:
            raise ValueError(f"PrefetchLoader: DataLoader's {name}={value!r} is not supported ({why[name]})")


def _as_sources(dataset: Any) -> tuple[str, list[torch.Tensor], Optional[list[str]]]:
    """Classify ``dataset``: ('tensors'|'npy', sources, dict keys or None) or ('generic', [], None)."""
    if isinstance(dataset, IterableDataset):
        return "iterable", [], None
    if isinstance(dataset, TensorDataset):
        return "tensors", list(dataset.tensors), None
    if isinstance(dataset, Mapping) and dataset and all(isinstance(v, torch.Tensor) for v in dataset.values()):
        return "tensors", list(dataset.values()), list(dataset.keys())
    if isinstance(dataset, (tuple, list)) and dataset and all(isinstance(v, torch.Tensor) for v in dataset):
        return "tensors", list(dataset), None
    if isinstance(dataset, (str, os.PathLike)) or (
            isinstance(dataset, (tuple, list)) and dataset
            and all(isinstance(v, (str, os.PathLike)) for v in dataset)):
        paths = [dataset] if isinstance(dataset, (str, os.PathLike)) else list(dataset)
        arrays = []
        for p in paths:
            if not str(p).endswith(".npy"):
                raise ValueError(f"PrefetchLoader: {p} is not a .npy file; pass tensors, .npy "
                                 "paths or a torch Dataset")
            arr = np.load(p, mmap_mode="r")  # memory-mapped: rows are read straight into the gather
            if not arr.flags.c_contiguous:
                raise ValueError(f"PrefetchLoader: {p} is not C-contiguous (Fortran order); "
                                 "re-save it with np.save(path, np.ascontiguousarray(a))")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # read-only mmap: we never write
                arrays.append(torch.from_numpy(arr))
        return "npy", arrays, None
    if isinstance(dataset, Dataset) or (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        return "generic", [], None
    raise TypeError(f"PrefetchLoader: cannot load from {type(dataset).__name__}; pass a "
                    "TensorDataset, a tuple/dict of tensors, .npy paths, a map-style Dataset or "
                    "an IterableDataset")


class _ListSampler:
    """Sampler of a fixed index order (used for ``shuffle`` and in-order loading)."""

    def __init__(self, indices: torch.Tensor) -> None:
        self._indices = indices

    def indices(self) -> torch.Tensor:
        return self._indices

    def __len__(self) -> int:
        return len(self._indices)


class PrefetchLoader:
    """Replaces ``DataLoader(dataset, batch_size, sampler=..., pin_memory=True)``.

    ``for x, y in loader`` yields batches already on ``device`` (ready on the current CUDA
    stream), or pinned CPU tensors when ``device`` is CPU/None, in exactly the sampler's order.

    Datasets: a :class:`~torch.utils.data.TensorDataset` or a tuple/list/dict of tensors with a
    common first dimension (fast path: C++ worker threads copy the selected rows into pinned
    ring slots, no per-sample Python); ``.npy`` paths (memory-mapped, same fast path); any
    map-style ``Dataset`` (fallback: ``__getitems__``/``__getitem__`` from Python threads and
    torch's ``default_collate`` — slower, measured in the benchmarks); an ``IterableDataset``
    (one background thread reads the stream once, as ``DataLoader(num_workers=0)`` does, and
    collates ``batch_size`` samples at a time ahead of the consumer; no sampler or shuffle).

    Args:
        dataset: see above.
        batch_size: samples per batch.
        shuffle: without a sampler, a new order every pass, as DataLoader: the permutation of
            seed ``seed + epoch``, where ``set_epoch(e)`` picks the epoch and a pass not preceded
            by ``set_epoch`` takes the next one; with ``generator``, DataLoader's own draws
            from that generator (the same batches as ``DataLoader(..., shuffle=True,
            generator=g)`` given an equal generator).
        sampler: e.g. :class:`fastddp.DistributedSampler`; its ``indices()`` are used when it
            has them, else its iteration order.
        batch_sampler: as DataLoader's: yields each batch's indices (batches may differ in
            size, e.g. grouped by length); exclusive with ``batch_size``, ``shuffle``,
            ``sampler`` and ``drop_last``. ``set_epoch`` is forwarded to it, or to its
            ``sampler`` (``BatchSampler(DistributedSampler(...), ...)``).
        num_workers: gather threads (at least 1).
        device: where batches are delivered (``"cuda:0"``; None or "cpu" keeps them on the host).
        drop_last: drop the last incomplete batch.
        prefetch: ring slots (batches in flight; default 4).
        pin_memory: page-locked staging; default: when CUDA is available.
        device_resident: keep the whole data set on ``device`` and gather each batch there
            (no host work per batch); ``"auto"`` does so when it fits in
            ``resident_max_bytes``. Tensor datasets only.
        pin_dataset: copy the tensors/arrays once into page-locked host memory (CUDA
            ``device`` only). With every source page-locked — pinned here, or passed already
            pinned — the GPU gathers each batch's rows straight from host memory on the side
            stream (the *direct* path: no CPU copy, no staging buffer), which moves data at
            close to the link's copy bandwidth. Costs host memory the size of the data set.
        seed: base seed for ``shuffle``.
        collate_fn: as DataLoader's, for a map-style ``Dataset`` (a ``TensorDataset`` with a
            ``collate_fn`` goes through the generic path so that the function sees its samples).
        persistent_workers, prefetch_factor: DataLoader's, accepted so a DataLoader call keeps
            working: the gather threads need no persisting, and ``prefetch_factor`` sets
            ``prefetch`` to ``prefetch_factor * num_workers`` batches in flight, as DataLoader.
            DataLoader's ``worker_init_fn``, ``multiprocessing_context`` and ``timeout`` are
            accepted at their defaults only (a message says why otherwise).
        in_order, pin_memory_device: DataLoader's; batches always come in order (which
            ``in_order=False`` allows too), pinned for CUDA ("" or a CUDA device).
        generator: as DataLoader's: each pass draws from it what DataLoader's iterator draws
            (its base seed, and with ``shuffle`` the permutation); ``state_dict`` keeps the
            generator's state at the start of the pass, so a mid-epoch resume redraws that order.

    The positional parameters are DataLoader's, in its order; the rest are keyword-only.

    Batches yielded on the fast path live in ring slots that are refilled ``prefetch`` batches
    later, unless you still hold them then (they are then left to you and the slot gets new
    buffers), so keeping a batch is always safe.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int = 1,
        shuffle: Optional[bool] = None,
        sampler: Any = None,
        batch_sampler: Any = None,
        num_workers: int = 2,
        collate_fn: Optional[Callable[[list[Any]], Any]] = None,
        pin_memory: Optional[bool] = None,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Optional[Callable[[int], None]] = None,
        multiprocessing_context: Any = None,
        generator: Optional[torch.Generator] = None,
        *,
        prefetch_factor: Optional[int] = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        device: Union[str, torch.device, None] = None,
        prefetch: Optional[int] = None,
        device_resident: Union[bool, str] = False,
        resident_max_bytes: int = 2 << 30,
        pin_dataset: bool = False,
        seed: int = 0,
    ) -> None:
        _check_dataloader_only(worker_init_fn=worker_init_fn, multiprocessing_context=multiprocessing_context,
                               timeout=timeout)
        if pin_memory_device and torch.device(pin_memory_device).type != "cuda":
            raise ValueError(f"PrefetchLoader: pin_memory_device={pin_memory_device!r} is not supported: "
                             "batches are pinned for CUDA; leave it empty (DataLoader deprecates it)")
        if batch_sampler is not None:
            if batch_size != 1 or shuffle or sampler is not None or drop_last:
                raise ValueError("PrefetchLoader: batch_sampler option is mutually exclusive with "
                                 "batch_size, shuffle, sampler, and drop_last (as in DataLoader: the "
                                 "batch_sampler decides them); pass only batch_sampler=")
            if not hasattr(batch_sampler, "__iter__"):
                raise TypeError("PrefetchLoader: batch_sampler must be iterable (yielding lists of "
                                f"indices), got {type(batch_sampler).__name__}")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"PrefetchLoader: generator must be a torch.Generator, got {type(generator).__name__}")
        if prefetch_factor is not None:
            if not isinstance(prefetch_factor, int) or prefetch_factor < 1:
                raise ValueError(f"PrefetchLoader: prefetch_factor must be >= 1, got {prefetch_factor!r}")
            if prefetch is not None:
                raise ValueError("PrefetchLoader: pass prefetch (batches in flight) or DataLoader's "
                                 "prefetch_factor (batches per worker), not both")
            prefetch = prefetch_factor * max(1, num_workers)  # DataLoader's batches in flight
        prefetch = 4 if prefetch is None else prefetch
        if batch_size is None and batch_sampler is None:
            raise ValueError("PrefetchLoader: batch_size=None (DataLoader's unbatched mode, one sample "
                             "at a time) is not supported: it yields whole batches; pass batch_size=N "
                             "or a batch_sampler")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"PrefetchLoader: batch_size must be a positive integer, got {batch_size!r}")
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"PrefetchLoader: num_workers must be >= 0, got {num_workers!r}")
        if not isinstance(prefetch, int) or prefetch < 1:
            raise ValueError(f"PrefetchLoader: prefetch must be >= 1, got {prefetch!r}")
        if sampler is not None and shuffle:
            raise ValueError("PrefetchLoader: sampler option is mutually exclusive with shuffle "
                             "(shuffle through the sampler, e.g. DistributedSampler(shuffle=True))")
        self.kind, self._sources, self._keys = _as_sources(dataset)
        if self.kind == "iterable":
            # DataLoader's rules for an IterableDataset: the stream decides the order.
            for name, value, given in (("shuffle", shuffle, shuffle not in (None, False)),
                                       ("sampler", sampler, sampler is not None),
                                       ("batch_sampler", batch_sampler, batch_sampler is not None)):
                if given:
                    raise ValueError(f"PrefetchLoader with IterableDataset: expected unspecified {name} "
                                     f"option, but got {name}={value!r} (the stream decides the order)")
        self.collate_fn = collate_fn
        self.persistent_workers = bool(persistent_workers)  # threads: nothing to keep alive
        if collate_fn is not None and self.kind in _FAST_KINDS:
            if not isinstance(dataset, Dataset):
                raise ValueError("PrefetchLoader: collate_fn needs a map-style Dataset whose samples it "
                                 "collates; tensors and .npy paths are batched by gathering rows. Wrap "
                                 "them in a TensorDataset to use collate_fn, or drop it")
            # The user's collation runs on each batch's samples (the generic path).
            self.kind, self._sources, self._keys = "generic", [], None
        self.dataset = dataset
        self.batch_sampler = batch_sampler
        # DataLoader's attributes, for code that reads them (only their defaults get this far)
        self.timeout, self.worker_init_fn, self.multiprocessing_context = timeout, worker_init_fn, None
        self.prefetch_factor, self.in_order = prefetch_factor, bool(in_order)
        self.pin_memory_device = pin_memory_device
        # As DataLoader: with a batch_sampler the loader itself has no batch size.
        self.batch_size: Optional[int] = None if batch_sampler is not None else batch_size
        self.shuffle = bool(shuffle)
        self.sampler = sampler
        self.num_workers = max(1, num_workers)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"PrefetchLoader: device {self.device} requested but CUDA is not "
                             "available; use device=None for CPU batches")
        self.drop_last = bool(drop_last)
        self.prefetch = prefetch
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        if self.pin_memory and not torch.cuda.is_available():
            # As DataLoader: nothing to pin for, so warn and deliver pageable batches (pinning
            # would fail with "Found no NVIDIA driver" on the first batch).
            warnings.warn("PrefetchLoader: pin_memory=True but CUDA is not available; batches are "
                          "not pinned", stacklevel=2)
            self.pin_memory = False
        self.seed = int(seed)
        self.generator = generator
        self._generator_state: Optional[torch.Tensor] = None  # at the start of the current pass
        self.epoch = 0
        # shuffle=True without a sampler or generator: a pass with no set_epoch() before it
        # takes the next epoch's order, so every pass is shuffled anew, as with DataLoader.
        self._epoch_pinned = True
        self._skip = 0  # batches to skip at the start of the next pass (resume)
        self._position = 0
        if self._sources:
            self._length: Optional[int] = len(self._sources[0])
        elif self.kind == "iterable":
            self._length = len(dataset) if hasattr(dataset, "__len__") else None
        else:
            self._length = len(dataset)
        if self.kind in _FAST_KINDS:
            for i, s in enumerate(self._sources):
                if s.dim() == 0 or len(s) != self._length:
                    raise ValueError(f"PrefetchLoader: tensor {i} has shape {tuple(s.shape)}; every "
                                     f"tensor needs the same first dimension ({self._length})")
        if pin_dataset:
            if self.kind not in _FAST_KINDS or self.device.type != "cuda":
                raise ValueError("PrefetchLoader: pin_dataset needs tensors or .npy arrays and a "
                                 f"CUDA device (got a {self.kind} dataset, device {self.device})")
            self._sources = [s if s.is_pinned() else s.contiguous().pin_memory()
                             for s in self._sources]
        self._resident: Optional[list[torch.Tensor]] = None
        if device_resident:
            if self.kind not in _FAST_KINDS:
                raise ValueError("PrefetchLoader: device_resident needs tensors or .npy arrays")
            size = sum(s.numel() * s.element_size() for s in self._sources)
            if device_resident is True or (device_resident == "auto" and size <= resident_max_bytes):
                self._resident = [s.to(self.device) for s in self._sources]
        self._pipelines: weakref.WeakSet = weakref.WeakSet()
        self._direct: Optional[bool] = None

    @property
    def transfer(self) -> str:
        """How batches reach ``device``: ``"resident"`` (gathered on the device from a copy of
        the data set there), ``"direct"`` (the GPU gathers from page-locked host memory),
        ``"staged"`` (C++ threads gather into pinned slots, then a side-stream copy), ``"host"``
        (CPU batches), ``"generic"`` (a map-style Dataset through Python threads) or
        ``"iterable"`` (an IterableDataset read by one Python thread)."""
        if self._resident is not None:
            return "resident"
        if self.kind == "iterable":
            return "iterable"
        if self.kind not in _FAST_KINDS:
            return "generic"
        if self.device.type != "cuda":
            return "host"
        if self._direct is not None:  # the C++ pipeline's own decision, once one was built
            return "direct" if self._direct else "staged"
        return "direct" if all(s.is_pinned() for s in self._sources) else "staged"

    # ------------------------------------------------------------------ order
    def _epoch_indices(self) -> torch.Tensor:
        if self.sampler is not None:
            if hasattr(self.sampler, "indices"):
                idx = self.sampler.indices()
            else:
                idx = torch.as_tensor(list(iter(self.sampler)), dtype=torch.int64)
            return idx.to(torch.int64)
        if self.shuffle and self.generator is not None:
            # DataLoader's RandomSampler with this generator: one randperm per pass, plus the
            # one it draws (and takes nothing from) when the pass ends.
            perm = torch.randperm(self._length, generator=self.generator)
            torch.randperm(self._length, generator=self.generator)
            return perm
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            return torch.randperm(self._length, generator=g)
        return torch.arange(self._length, dtype=torch.int64)

    def _start_pass(self) -> None:
        """What DataLoader's iterator does to its random state when a pass begins."""
        if self.shuffle and self.sampler is None and self.generator is None:
            if not self._epoch_pinned:
                self.epoch += 1
            self._epoch_pinned = False
        if self.generator is not None:
            self._generator_state = self.generator.get_state()
            # DataLoader draws its workers' base seed from the generator first
            torch.empty((), dtype=torch.int64).random_(generator=self.generator)

    def _batches(self) -> list[torch.Tensor]:
        if self.batch_sampler is not None:
            return [self._batch_indices(k, b) for k, b in enumerate(self.batch_sampler)]
        assert self.batch_size is not None
        idx = self._epoch_indices()
        n = len(idx)
        end = (n // self.batch_size) * self.batch_size if self.drop_last else n
        return list(idx[:end].split(self.batch_size)) if end else []

    @staticmethod
    def _batch_indices(k: int, batch: Any) -> torch.Tensor:
        try:
            idx = torch.as_tensor(batch if isinstance(batch, torch.Tensor) else list(batch))
        except (TypeError, ValueError, RuntimeError) as exc:
            raise TypeError(f"PrefetchLoader: batch_sampler's batch {k} is not a list of integer "
                            f"indices ({exc})") from None
        if idx.dim() != 1 or idx.numel() == 0 or idx.is_floating_point() or idx.is_complex() \
                or idx.dtype == torch.bool:
            raise ValueError(f"PrefetchLoader: batch_sampler's batch {k} must be a non-empty list of "
                             f"integer indices, got {idx.numel()} value(s) of {idx.dtype} in shape "
                             f"{tuple(idx.shape)}")
        return idx.to(torch.int64)

    def __len__(self) -> int:
        if self.batch_sampler is not None:
            return len(self.batch_sampler)
        assert self.batch_size is not None
        if self.kind == "iterable" and self._length is None:
            raise TypeError(f"PrefetchLoader over {type(self.dataset).__name__} has no len(): the "
                            "IterableDataset defines no __len__")
        n = len(self.sampler) if self.sampler is not None else self._length
        assert n is not None
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch; forwarded to the sampler's ``set_epoch`` when it has one."""
        if epoch != self.epoch:
            self._skip = 0
        self.epoch = int(epoch)
        self._epoch_pinned = True
        # a batch sampler without set_epoch may wrap a sampler with one:
        # BatchSampler(DistributedSampler(...), ...)
        inner = getattr(self.batch_sampler, "sampler", None)
        bs = self.batch_sampler if hasattr(self.batch_sampler, "set_epoch") else inner
        for s in (self.sampler, bs):
            if s is not None and hasattr(s, "set_epoch"):
                s.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """Epoch and batches already yielded in it (plus the sampler's state), for resuming."""
        state: dict[str, Any] = {"epoch": self.epoch, "batches_done": self._position}
        if self.sampler is not None and hasattr(self.sampler, "state_dict"):
            state["sampler"] = self.sampler.state_dict()
        if self.batch_sampler is not None and hasattr(self.batch_sampler, "state_dict"):
            state["batch_sampler"] = self.batch_sampler.state_dict()
        if self._generator_state is not None:  # the generator as this pass found it
            state["generator_state"] = self._generator_state.clone()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next pass starts after the last batch yielded before ``state_dict``."""
        if self.sampler is not None and "sampler" in state and hasattr(self.sampler, "load_state_dict"):
            self.sampler.load_state_dict(state["sampler"])
        if (self.batch_sampler is not None and "batch_sampler" in state
                and hasattr(self.batch_sampler, "load_state_dict")):
            self.batch_sampler.load_state_dict(state["batch_sampler"])
        done = int(state["batches_done"])
        unbounded = self.kind == "iterable" and self._length is None and self.batch_sampler is None
        upper = None if unbounded else len(self)
        if done < 0 or (upper is not None and done > upper):
            raise ValueError(f"PrefetchLoader.load_state_dict: batches_done {done} outside "
                             f"[0, {'unbounded' if upper is None else upper}]")
        if "generator_state" in state:
            if self.generator is None:
                raise ValueError("PrefetchLoader.load_state_dict: the state was saved from a loader with a "
                                 "generator; pass generator=torch.Generator() to this one too")
            self.generator.set_state(state["generator_state"])  # the next pass redraws that order
        self.set_epoch(int(state["epoch"]))
        self._skip = done

    # ------------------------------------------------------------------ iteration
    def _wrap(self, tensors: Sequence[torch.Tensor]) -> Any:
        if self._keys is not None:
            return dict(zip(self._keys, tensors))
        return tuple(tensors) if len(tensors) > 1 else tensors[0]

    def __iter__(self) -> Iterator[Any]:
        self._start_pass()
        skip, self._skip = self._skip, 0
        self._position = skip
        if self.kind == "iterable":  # a stream: the skipped batches are read, not indexed
            yield from self._iter_iterable(skip)
            return
        batches = self._batches()[skip:]
        if self._resident is not None:
            yield from self._iter_resident(batches)
        elif self.kind in _FAST_KINDS:
            yield from self._iter_fast(batches)
        else:
            yield from self._iter_generic(batches)

    def _iter_resident(self, batches: list[torch.Tensor]) -> Iterator[Any]:
        for idx in batches:
            idx_dev = idx.to(self.device, non_blocking=True)
            self._position += 1
            yield self._wrap([s.index_select(0, idx_dev) for s in self._resident])

    def _iter_fast(self, batches: list[torch.Tensor]) -> Iterator[Any]:
        pipe = C.PrefetchPipeline([s.contiguous() for s in self._sources], batches,
                                  self.num_workers, self.prefetch,
                                  self.pin_memory and torch.cuda.is_available(), str(self.device))
        self._pipelines.add(pipe)
        self._direct = bool(pipe.direct)
        try:
            while True:
                out = pipe.next()
                if not out:
                    return
                self._position += 1
                yield self._wrap(out)
        finally:
            pipe.close()  # on exhaustion, break, exception or garbage collection of the generator

    def _fetch(self, idx: torch.Tensor) -> Any:
        ids = idx.tolist()
        if hasattr(self.dataset, "__getitems__"):
            samples = self.dataset.__getitems__(ids)
        else:
            samples = [self.dataset[i] for i in ids]
        return self._collate(samples)

    def _collate(self, samples: list[Any]) -> Any:
        """One batch of the Python paths: the user's (or torch's default) collation, pinned."""
        batch = (self.collate_fn or default_collate)(samples)
        return _pin(batch) if self.pin_memory else batch

    def _iter_generic(self, batches: list[torch.Tensor]) -> Iterator[Any]:
        with concurrent.futures.ThreadPoolExecutor(self.num_workers,
                                                   thread_name_prefix="fastddp-loader") as pool:
            pending: list[concurrent.futures.Future] = []
            it = iter(batches)
            try:
                for idx in it:
                    pending.append(pool.submit(self._fetch, idx))
                    if len(pending) >= self.prefetch:
                        break
                while pending:
                    fut = pending.pop(0)
                    nxt = next(it, None)
                    if nxt is not None:
                        pending.append(pool.submit(self._fetch, nxt))
                    batch = fut.result()  # a worker's exception is raised here, with its traceback
                    self._position += 1
                    yield _to_device(batch, self.device)
            finally:
                for fut in pending:
                    fut.cancel()

    def _iter_iterable(self, skip: int) -> Iterator[Any]:
        """One thread reads the stream, collates (and pins) whole batches up to ``prefetch``
        ahead; the first ``skip`` batches (a resumed pass) are read and dropped there."""
        assert self.batch_size is not None
        batch_size, drop_last = self.batch_size, self.drop_last
        ready: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()
        end = object()

        def put(item: Any) -> bool:
            while not stop.is_set():
                try:
                    ready.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def produce() -> None:
            try:
                samples: list[Any] = []
                made = 0
                for sample in self.dataset:
                    if stop.is_set():  # the consumer left (break, exception, garbage collection)
                        return
                    samples.append(sample)
                    if len(samples) < batch_size:
                        continue
                    if made >= skip and not put(self._collate(samples)):
                        return
                    made += 1
                    samples = []
                if samples and not drop_last and made >= skip and not put(self._collate(samples)):
                    return
                put(end)
            except BaseException as exc:  # handed to the consumer, raised there with its traceback
                put(exc)

        thread = threading.Thread(target=produce, name="fastddp-loader-iterable", daemon=True)
        thread.start()
        try:
            while True:
                item = ready.get()
                if item is end:
                    return
                if isinstance(item, BaseException):
                    raise item
                self._position += 1
                yield _to_device(item, self.device)
        finally:
            stop.set()
            # It ends at its next sample; a stream that blocks longer is not waited for here.
            thread.join(timeout=5.0)


def _pin(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.pin_memory()
    if isinstance(batch, Mapping):
        return {k: _pin(v) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_pin(v) for v in batch)
    return batch


def _to_device(batch: Any, device: torch.device) -> Any:
    if device.type == "cpu":
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch


__all__ = ["PrefetchLoader"]
