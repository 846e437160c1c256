"""``fastddp.PrefetchLoader``: DataLoader's behaviour, with whole batches of tensor datasets
gathered by C++ threads into pinned rings and delivered on the device."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Optional, TypeVar, Union

import torch
from torch.utils.data import DataLoader, default_collate
from torch.utils.data.dataloader import _DatasetKind

from .._ext import C
from .iterator import LoaderHooks, LoaderIterator, Progress
from .native import NativePass, NativeSettings
from .passes import Replay, TorchPass, build_runner, with_random_state
from .plan import reads_ahead_unobserved
from .settings import (
    DATALOADER_ATTRS,
    NATIVE_DEVICE_TYPES,
    READ_ONLY_ATTRIBUTES,
    PreparedTensors,
    check_extras,
    check_integer,
    check_own_form,
    check_resident,
    check_seed,
    check_worker_iterator,
    check_workers,
    largest_batch,
    make_spec,
    prepare_tensors,
    start_warnings,
)
from .shuffle import EpochShuffle, epoch_targets, load_sampler_states, sampler_epoch, sampler_states
from .sources import classify

_T_co = TypeVar("_T_co", covariant=True)  # DataLoader's type parameter


class PrefetchLoader(DataLoader[_T_co]):
    """Drop-in for :class:`torch.utils.data.DataLoader`, and a subclass of it (code that asks
    ``isinstance(loader, DataLoader)`` takes DataLoader's branch: Lightning injects its
    DistributedSampler and probes nothing); ``device=`` delivers batches there.

    Every DataLoader argument means what it means to DataLoader, with the same defaults, the
    same errors and the same draws from the global (or the given) generator: each iterator
    draws DataLoader's base seed, ``shuffle=True`` is DataLoader's ``RandomSampler``, and the
    sampler is read at the moments DataLoader reads it. Batches, their types, ``len()``, the
    exceptions a bad sample or index raises (at its batch; the next ``next()`` continues) are
    DataLoader's.

    How batches are made:

    * a :class:`~torch.utils.data.TensorDataset` (or PrefetchLoader's own forms, read as its
      columns: a tuple of tensors or of ``.npy`` paths, memory-mapped, or a dict of tensors
      under string keys; see docs/compatibility.md) with torch's default collation as torch
      ships it: C++ threads gather each batch's rows into a ring of (pinned) slots and, for a CUDA
      ``device``, copy them there on a side stream. ``num_workers`` threads (two when it is 0:
      no Python runs in them, so nothing of DataLoader's main-process loading changes).
    * anything else (a Python ``Dataset``, an ``IterableDataset``, a ``collate_fn``,
      ``worker_init_fn``, ``timeout``, ``multiprocessing_context``, ``batch_size=None``):
      torch's own DataLoader machinery with these arguments, so samples, collation, worker
      processes, their seeds and ``get_worker_info()`` are DataLoader's; batches are then moved
      to ``device``.

    PrefetchLoader's own arguments (keyword-only):
        device: where batches are delivered (``"cuda:0"``; None keeps them on the host).
        prefetch: ring slots of the native gather (default ``prefetch_factor * num_workers``
            with workers, else 4).
        device_resident: keep the tensors on ``device`` and gather each batch there;
            ``"auto"`` does so when they fit in ``resident_max_bytes``.
        pin_dataset: copy the tensors once into page-locked memory (CUDA ``device``): the GPU
            then gathers rows straight from host memory (the *direct* transfer).
        seed: with ``shuffle=True``, the order of a pass is the permutation of
            ``seed + epoch`` (``set_epoch``; a pass without one takes the next epoch) and draws
            nothing from the global generator for it; None (default) is DataLoader's shuffle.

    ``set_epoch`` reaches the sampler (or the batch sampler, or its sampler);
    ``state_dict``/``load_state_dict`` resume mid-epoch: the resumed pass redraws the saved
    pass's order from the random state that pass started from and skips the delivered batches.
    Batches of the native gather live in ring slots refilled ``prefetch`` batches later unless
    you still hold them (they then stay yours), so keeping a batch is always safe. The ring's
    host slots pass from one pass to the next (the loader holds them until it is deleted), so a
    new pass does not fault fresh memory in.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: Optional[int] = 1,
        shuffle: Optional[bool] = None,
        sampler: Any = None,
        batch_sampler: Any = None,
        num_workers: int = 0,
        collate_fn: Optional[Callable[[list[Any]], Any]] = None,
        pin_memory: bool = False,
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
        seed: Optional[int] = None,
    ) -> None:
        src = classify(dataset)
        if src.own_form:
            check_own_form(batch_size=batch_size, collate_fn=collate_fn, worker_init_fn=worker_init_fn,
                           timeout=timeout, multiprocessing_context=multiprocessing_context)
        if seed is not None:
            seed = check_seed(seed, shuffle, sampler, batch_sampler, src.kind == "iterable")
            sampler, shuffle = EpochShuffle(src.dataset, seed), None
        spec = make_spec(src.dataset, batch_size, shuffle, sampler, batch_sampler, num_workers, collate_fn,
                         pin_memory, drop_last, timeout, worker_init_fn, multiprocessing_context, generator,
                         prefetch_factor=prefetch_factor, persistent_workers=persistent_workers,
                         pin_memory_device=pin_memory_device, in_order=in_order)
        for name in DATALOADER_ATTRS:
            setattr(self, name, getattr(spec, name))
        self.dataset = dataset
        self._src = src
        self.device, self.prefetch = check_extras(device, prefetch, prefetch_factor, num_workers, generator)
        if src.own_form and self.device.type not in NATIVE_DEVICE_TYPES:
            raise ValueError(f"PrefetchLoader: device {self.device}: tensors and .npy paths are gathered "
                             "by C++ threads, which deliver to CPU or CUDA devices; wrap them in a "
                             f"TensorDataset to have each batch moved to {self.device.type} with .to(), "
                             "or use device=None")
        # public, as DataLoader's arguments are: code that rebuilds a loader from its attributes
        # (Lightning's sampler injection) keeps them
        self.device_resident, self.resident_max_bytes, self.pin_dataset = device_resident, resident_max_bytes, pin_dataset
        self._tensors: Optional[PreparedTensors] = None
        if pin_dataset or device_resident:
            self._check_tensor_options()
            self._prepared()
        self._dataset_kind = _DatasetKind.Iterable if src.kind == "iterable" else _DatasetKind.Map
        self._IterableDataset_len_called: Optional[int] = None  # DataLoader's, read by ignite
        self._init_pass_state()
        self._DataLoader__initialized = True  # DataLoader's lock flag: subclasses of it clear it

    def _init_pass_state(self) -> None:
        """No pass yet: epoch 0, nothing delivered, nothing to replay, no ring allocated."""
        self._epoch = 0
        self._pass_epoch: Optional[int] = None  # the epoch the current pass uses
        self._progress = Progress()  # batches delivered in the current pass
        self._replay = Replay()
        self._pass_state: tuple[Optional[torch.Tensor], Optional[torch.Tensor]] = (None, None)
        self._sampler_states: Optional[dict[str, Any]] = None
        self._iterator: Optional[LoaderIterator] = None
        self._direct: Optional[bool] = None
        self._slot_pool: Any = None  # C.SlotPool, made by the first native pass

    def __setattr__(self, name: str, value: Any) -> None:
        if name in READ_ONLY_ATTRIBUTES and self.__dict__.get("_DataLoader__initialized"):
            raise AttributeError(READ_ONLY_ATTRIBUTES[name])
        super().__setattr__(name, value)  # DataLoader's lock of the attributes that shape batches

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_slot_pool"] = None  # staging memory, not state: a copy allocates its own
        return state

    # Inherited from DataLoader, whose constructor does not run (__init__ sets what these read):
    # multiprocessing_context, check_worker_number_rationality, _auto_collation, _index_sampler.
    # ------------------------------------------------------------------ what a pass does
    def _native(self) -> bool:
        """Whether a pass gathers natively (else torch's DataLoader machinery reads it)."""
        if self.device.type not in NATIVE_DEVICE_TYPES:
            return False  # batches are moved there with .to(device)
        # DataLoader without workers never calls worker_init_fn (Lightning sets one on every loader)
        native = (self._src.gatherable and self.batch_sampler is not None and self.collate_fn is default_collate
                  and (self.worker_init_fn is None or self.num_workers == 0) and self.timeout == 0
                  and (self.multiprocessing_context is None or self.num_workers == 0))
        if not native and self._src.own_form:
            raise ValueError("PrefetchLoader: tensors and .npy paths are batched by gathering rows, with "
                             "the default collation and no worker set-up; wrap them in a TensorDataset "
                             "to use collate_fn, worker_init_fn, timeout or multiprocessing_context")
        return native

    def _check_tensor_options(self) -> None:
        """pin_dataset and device_resident (given, or assigned later: checked again at iter())
        need tensors to copy; pin_dataset a CUDA device to gather from pinned memory."""
        check_resident(self.device_resident)
        if not (self.pin_dataset or self.device_resident):
            return
        if not self._src.gatherable or (self.pin_dataset and self.device.type != "cuda"):
            raise ValueError("PrefetchLoader: pin_dataset needs tensors or .npy arrays and a CUDA "
                             f"device (got a {self._src.kind} dataset, device {self.device})" if self.pin_dataset
                             else "PrefetchLoader: device_resident needs tensors or .npy arrays")

    def _prepared(self) -> tuple[list[torch.Tensor], bool]:
        """The tensors rows are gathered from, and whether they are on the device. A copy made
        only to make a source contiguous is made again every pass: a write the version counter
        does not see (through numpy, or ``.data =``) would leave it stale, where DataLoader reads
        the current values. The copies ``device_resident`` and ``pin_dataset`` ask for are kept
        while each source is the same tensor object at the same version."""
        current = self._src.tensors()
        options = (self.device_resident, self.resident_max_bytes, self.pin_dataset)
        cached = self._tensors
        if cached is not None and cached.serves(current, options):
            return cached.tensors, cached.on_device
        tensors, on_device = prepare_tensors(current, self.device, *options)
        copied = [c for c, p in zip(current, tensors) if p is not c]
        # an inference tensor has no version counter (it changes only inside inference mode)
        keep = bool(on_device or self.pin_dataset) and not any(c.is_inference() for c in copied)
        self._tensors = PreparedTensors.of(current, options, tensors, on_device) if keep else None
        return tensors, on_device

    def _native_settings(self) -> NativeSettings:
        tensors, resident = self._prepared()
        workers = check_workers(self.num_workers)
        if workers > 0:  # DataLoader's workers are handed prefetch_factor batches each at once
            factor = 2 if self.prefetch_factor is None else self.prefetch_factor  # DataLoader's default
            start, first = factor * workers, 0
        else:  # DataLoader reads one batch per next(); reading ahead is safe for known samplers
            start, first = 0, (self.prefetch - 1 if reads_ahead_unobserved(self.batch_sampler) else 0)
        pin = (self.pin_memory and torch.accelerator.is_available()) or self.device.type == "cuda"
        if self._slot_pool is None:
            self._slot_pool = C.SlotPool()
        return NativeSettings(tensors=tensors, resident=resident, threads=workers or 2, ring=self.prefetch,
                              pin=pin, device=self.device, start_reads=start, first_next_reads=first,
                              whole_pass=reads_ahead_unobserved(self.batch_sampler),
                              batch_rows=largest_batch(self.batch_sampler, len(tensors[0])), pool=self._slot_pool,
                              workers=workers, persistent=bool(self.persistent_workers))

    def _start(self, pass_: Any, draw_seed: bool) -> None:
        replay, self._replay = self._replay, Replay()
        self._pass_epoch = self._upcoming_epoch()
        if replay.epoch is not None and replay.epoch != self._pass_epoch:
            replay = Replay()  # the saved pass's epoch was left (e.g. sampler.set_epoch)
        if replay.resumes:
            self._pass_state = (replay.rng_state, replay.generator_state)
        else:
            # a generator that is not a torch.Generator fails the seed draw below as DataLoader's
            generator = self.generator if isinstance(self.generator, torch.Generator) else None
            self._pass_state = (torch.random.get_rng_state() if self.generator is None else None,
                                generator.get_state() if generator is not None else None)
        self._progress.delivered = replay.skip
        # The samplers' states as the pass found them: the pass reads them ahead of delivery,
        # and a resumed pass skips the delivered batches itself.
        self._sampler_states = sampler_states(self.sampler, self.batch_sampler)
        pass_.start(self.generator, draw_seed, replay)
        if pass_.direct is not None:
            self._direct = pass_.direct

    def _get_iterator(self) -> LoaderIterator:
        """A new iterator (DataLoader's name: its ``__iter__`` and code built on it call this)."""
        self._check_tensor_options()
        native = self._native()
        # num_workers and prefetch_factor as assigned since construction, as DataLoader's
        # iterator meets them (the DataLoader a generic pass builds would take them anew)
        check_worker_iterator(self.num_workers, self.prefetch_factor, self.generator)
        if not native:
            pass_: Any = TorchPass(*build_runner(self, self._src.dataset, self._src.kind == "iterable"), self.device)
            self._start(pass_, True)
        else:
            if self.num_workers != 0:  # DataLoader checks it whenever it makes a worker iterator
                self.check_worker_number_rationality()
            start_warnings(self.pin_memory, self.pin_memory_device, self.num_workers)
            pass_ = NativePass(self.batch_sampler, self._src, self._native_settings())
            try:  # a non-integer prefetch_factor fails the first reads, after the seed draw (NativePass._read)
                self._start(pass_, True)
            except (AssertionError, TypeError):
                pass_.close()
                raise
        hooks = LoaderHooks(restart=self._start, progress=self._progress,
                            len_reported=lambda: self._IterableDataset_len_called, length=self._iterator_len,
                            num_workers=lambda: self.num_workers, dataset=self.dataset)
        return LoaderIterator(pass_, hooks)

    def __iter__(self) -> Iterator[Any]:
        if self.persistent_workers and self.num_workers > 0:  # one iterator, reset per pass
            if self._iterator is None:
                self._iterator = self._get_iterator()
            else:
                self._iterator.reset()
            return self._iterator
        return self._get_iterator()

    def __len__(self) -> int:
        if self._src.kind == "iterable":  # DataLoader's rule: the stream's len(), in batches
            length = self._IterableDataset_len_called = len(self.dataset)
            if self.batch_size is not None:
                length = length // self.batch_size if self.drop_last else -(-length // self.batch_size)
            return length
        return len(self._index_sampler)

    def _iterator_len(self) -> int:
        """len() of an iterator, as DataLoader's (an IterableDataset's has none)."""
        if self._src.kind == "iterable":
            raise TypeError("object of type '_InfiniteConstantSampler' has no len()")
        return len(self)

    @property
    def transfer(self) -> str:
        """How batches are made: ``"resident"`` (gathered on the device from a copy there),
        ``"direct"`` (the GPU gathers from page-locked host memory), ``"staged"`` (C++ threads
        gather into pinned slots, then a side-stream copy), ``"host"`` (C++ threads, CPU
        batches), ``"generic"`` (torch's DataLoader machinery over a map-style dataset) or
        ``"iterable"`` (the same over an IterableDataset)."""
        if self._src.kind == "iterable":
            return "iterable"
        if not self._native():
            return "generic"
        tensors, resident = self._prepared()
        if resident:
            return "resident"
        if self.device.type != "cuda":
            return "host"
        if self._direct is not None:  # the C++ pipeline's own decision, once one was built
            return "direct" if self._direct else "staged"
        return "direct" if all(t.is_pinned() for t in tensors) else "staged"

    # ------------------------------------------------------------------ epochs and resuming
    @property
    def epoch(self) -> int:
        """The epoch the next pass uses: the sampler's, when it carries one (so
        ``sampler.set_epoch(e)`` is seen as ``loader.set_epoch(e)`` is), else the loader's own
        (set by :meth:`set_epoch`)."""
        epoch = sampler_epoch(self.sampler, self.batch_sampler)
        return self._epoch if epoch is None else epoch

    def _upcoming_epoch(self) -> int:
        """The epoch a pass starting now uses (``seed=``'s shuffle steps to the next one when
        no ``set_epoch`` pinned it)."""
        if isinstance(self.sampler, EpochShuffle):
            return self.sampler.upcoming_epoch
        return self.epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch; forwarded to the sampler's ``set_epoch`` (or the batch sampler's,
        or the ``set_epoch`` of the sampler inside a batch sampler)."""
        epoch = check_integer("PrefetchLoader.set_epoch", "epoch", epoch)
        if epoch != self.epoch:
            self._replay = Replay()
        self._epoch = epoch
        for s in epoch_targets(self.sampler, self.batch_sampler):
            s.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """The epoch of the current pass (the sampler's when it carries one: see :attr:`epoch`),
        batches delivered in it, the random state it started from (the global generator's, or
        the given generator's), and the samplers' states as it found them. Between
        :meth:`load_state_dict` and the pass it resumes, the state loaded (a checkpoint written
        then keeps the position)."""
        if self._replay.resumes:
            return self._pending_state()
        epoch = self.epoch if self._pass_epoch is None else self._pass_epoch
        state: dict[str, Any] = {"epoch": epoch, "batches_done": self._progress.delivered}
        state.update(self._sampler_states if self._sampler_states is not None else sampler_states(self.sampler, self.batch_sampler))
        return with_random_state(state, *self._pass_state)

    def _pending_state(self) -> dict[str, Any]:
        """The state of a loaded pass that has not started: where it will resume."""
        replay = self._replay
        state: dict[str, Any] = {"epoch": self.epoch if replay.epoch is None else replay.epoch,
                                 "batches_done": replay.skip}
        state.update(sampler_states(self.sampler, self.batch_sampler))
        return with_random_state(state, replay.rng_state, replay.generator_state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next pass redraws the saved pass's order and starts after the last batch
        delivered before ``state_dict``."""
        done, epoch = int(state["batches_done"]), int(state["epoch"])
        unbounded = self._src.kind == "iterable" and not hasattr(self.dataset, "__len__")
        upper = None if unbounded else len(self)
        if done < 0 or (upper is not None and done > upper):
            raise ValueError(f"PrefetchLoader.load_state_dict: batches_done {done} outside "
                             f"[0, {'unbounded' if upper is None else upper}]")
        if "generator_state" in state and self.generator is None:
            raise ValueError("PrefetchLoader.load_state_dict: the state was saved from a loader with a "
                             "generator; pass generator=torch.Generator() to this one too")
        load_sampler_states(self.sampler, self.batch_sampler, state)
        self.set_epoch(epoch)
        # a state taken after iter() holds the random state its pass started from (even before
        # the first batch): the resumed pass redraws that pass's order from it
        self._replay = Replay(skip=done, rng_state=state.get("rng_state"),
                              generator_state=state.get("generator_state"), epoch=epoch)


__all__ = ["PrefetchLoader"]
