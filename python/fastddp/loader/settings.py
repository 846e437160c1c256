"""Argument checking for PrefetchLoader: DataLoader's arguments are checked by DataLoader itself
(the same exception types and messages, prefixed with PrefetchLoader); PrefetchLoader's own are
checked here."""

from __future__ import annotations

import operator
import weakref
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from torch.utils.data import BatchSampler, DataLoader

from .._torch_warnings import source_line, warn_at
from .plan import draw_base_seed


def make_spec(dataset: Any, *args: Any, **kwargs: Any) -> DataLoader:
    """A DataLoader made with the caller's arguments: it checks them, resolves the defaults
    (sampler, batch sampler, collation) and is the reference for the loader's attributes."""
    try:
        return DataLoader(dataset, *args, **kwargs)
    except (ValueError, TypeError) as exc:
        raise type(exc)(f"PrefetchLoader: {exc}") from None  # DataLoader's words, as its tests match them


def check_own_form(**given: Any) -> None:
    """Tensors and .npy paths (PrefetchLoader's own forms, not Datasets) are gathered by rows:
    the arguments that need samples read through Python are refused, naming the fix."""
    defaults = {"collate_fn": None, "worker_init_fn": None, "timeout": 0, "multiprocessing_context": None}
    if given.pop("batch_size") is None:
        raise ValueError("PrefetchLoader: batch_size=None (DataLoader's unbatched mode) needs a Dataset; "
                         "wrap the tensors in a TensorDataset, or pass batch_size=N")
    for name, value in given.items():
        if value is not defaults[name] and value != defaults[name]:
            raise ValueError(f"PrefetchLoader: {name}={value!r} needs a map-style Dataset whose samples "
                             "Python reads; tensors and .npy paths are batched by gathering rows. Wrap "
                             f"them in a TensorDataset to use {name}, or drop it")


# DataLoader's attributes, mirrored by PrefetchLoader so that code reading them keeps working.
DATALOADER_ATTRS = ("num_workers", "prefetch_factor", "pin_memory", "pin_memory_device", "timeout",
                    "worker_init_fn", "multiprocessing_context", "in_order", "batch_size", "drop_last",
                    "sampler", "batch_sampler", "generator", "collate_fn", "persistent_workers")

# Where the C++ gather delivers batches; the loader moves them to any other device with .to().
NATIVE_DEVICE_TYPES = ("cpu", "cuda")

# PrefetchLoader's own attributes that cannot be assigned once it is built (DataLoader has none
# of these names, so a script may assign them as its own): what the assignment raises.
READ_ONLY_ATTRIBUTES = {
    "device": "PrefetchLoader.device is where the batches are delivered, fixed at construction; build a "
              "new PrefetchLoader(..., device=...) for another device, and keep a value of your own under "
              "another name",
    "epoch": "PrefetchLoader.epoch is the epoch the next pass uses (the sampler's, when it has one); select "
             "it with loader.set_epoch(epoch), and keep a counter of your own under another name",
    "transfer": "PrefetchLoader.transfer says how the batches are made (see its docstring); it follows from "
                "the device, pin_dataset and device_resident arguments and cannot be assigned",
}


def check_extras(device: Union[str, torch.device, None], prefetch: Optional[int],
                 prefetch_factor: Optional[int], num_workers: int,
                 generator: Optional[torch.Generator]) -> tuple[torch.device, int]:
    """PrefetchLoader's own arguments: the device (usable here) and the ring size."""
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"PrefetchLoader: generator must be a torch.Generator, got {type(generator).__name__}")
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"PrefetchLoader: device {dev} requested but CUDA is not available; use "
                         "device=None for CPU batches")
    if dev.type not in NATIVE_DEVICE_TYPES:
        try:  # another backend (meta, xpu, mps): batches are moved there with .to(device)
            torch.empty(0, device=dev)
        except (RuntimeError, AssertionError) as exc:
            raise ValueError(f"PrefetchLoader: device {dev} is not usable in this torch ({exc}); use "
                             "device=None for CPU batches") from None
    if prefetch is None:
        # DataLoader's default (2 batches a worker); a num_workers or prefetch_factor that is
        # not an integer fails at iter(), as DataLoader's iterator fails on it
        workers, factor = _index_or(num_workers, 0), _index_or(prefetch_factor, 2)
        return dev, max(1, factor * workers) if workers > 0 else 4
    if isinstance(prefetch, bool) or not 1 <= _index_or(prefetch, 0) <= _MAX_RING:
        raise ValueError(f"PrefetchLoader: prefetch must be an integer in [1, {_MAX_RING}] (ring slots, each "
                         f"holding a batch), got {prefetch!r}")
    return dev, operator.index(prefetch)


_MAX_RING = 2**31 - 1  # the native ring's slot count is a C int


def check_integer(owner: str, name: str, value: Any) -> int:
    """``value`` as an integer argument of fastddp's own (``seed``, an epoch): an int, a numpy
    or 0-d tensor integer; a float (silently truncated by ``int()``), a bool or a string is a
    TypeError naming it."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise TypeError(f"{owner}: {name} must be an integer, got {type(value).__name__} {value!r}")


def check_seed(seed: Any, shuffle: Any, sampler: Any, batch_sampler: Any, iterable: bool) -> int:
    """``seed=``: an integer, and only where it orders the pass (``shuffle=True`` over a
    map-style dataset without a sampler)."""
    seed = check_integer("PrefetchLoader", "seed", seed)
    if not shuffle or sampler is not None or batch_sampler is not None or iterable:
        given = ("an IterableDataset" if iterable else
                 f"sampler={type(sampler).__name__}" if sampler is not None else
                 f"batch_sampler={type(batch_sampler).__name__}" if batch_sampler is not None else
                 f"shuffle={shuffle!r}")
        raise ValueError(f"PrefetchLoader: seed={seed!r} orders shuffle=True over a map-style dataset "
                         f"without a sampler, but got {given}. Drop seed= where a sampler orders the "
                         "data (a DistributedSampler, also the one Lightning's use_distributed_sampler "
                         "injects: its own seed applies), or pass shuffle=True without a sampler")
    return seed


def check_resident(value: Any) -> Union[bool, str]:
    """``device_resident``: True, False or ``"auto"``."""
    if isinstance(value, bool) or value == "auto":
        return value
    raise ValueError(f"PrefetchLoader: device_resident must be True, False or \"auto\", got {value!r}")


def _index_or(value: Any, default: int) -> int:
    """``value`` as ``operator.index`` reads it (a numpy integer is an integer), else ``default``."""
    try:
        return operator.index(value)
    except TypeError:
        return default


def change_count(tensor: torch.Tensor) -> Optional[int]:
    """The tensor's version counter (in-place changes count it up; views share their base's),
    or None for an inference tensor, which has none (it can change only inside
    ``torch.inference_mode()``)."""
    return None if tensor.is_inference() else tensor._version


def check_workers(num_workers: Any) -> int:
    """``num_workers`` as a native pass reads it when an iterator starts (an integer as
    ``operator.index`` reads it: a numpy integer is one, as for DataLoader). DataLoader checks
    it only at construction; one assigned later reaches its iterator unchecked, where a
    negative count fails an assertion and a non-integer a comparison. The same exception
    types, naming the attribute and the fix."""
    if isinstance(num_workers, float) and num_workers == 0:
        return 0  # DataLoader's test is `num_workers > 0`: 0.0 is single-process there too
    try:
        count = operator.index(num_workers)
    except TypeError:
        raise TypeError(f"PrefetchLoader: num_workers must be an integer, got {num_workers!r} "
                        "(DataLoader's worker iterator fails on it); use 0 or a positive int") from None
    if count < 0:
        raise AssertionError("num_workers must be greater than 0 for MultiProcessingDataLoaderIter "
                             f"(PrefetchLoader: num_workers={num_workers} assigned after construction; "
                             "assign 0 or a positive int)")
    return count


@dataclass(frozen=True)
class PreparedTensors:
    """Copies of a TensorDataset's tensors (on the device, or pinned) and what they were made
    from: weak references to the sources (a replaced tensor whose memory, and ``id()``, a new
    one reuses does not pass for it) and their version counters."""

    sources: tuple[weakref.ref, ...]
    versions: tuple[Optional[int], ...]
    options: tuple[Any, ...]
    tensors: list[torch.Tensor]
    on_device: bool

    @staticmethod
    def of(sources: list[torch.Tensor], options: tuple[Any, ...], tensors: list[torch.Tensor],
           on_device: bool) -> PreparedTensors:
        return PreparedTensors(tuple(weakref.ref(t) for t in sources), tuple(change_count(t) for t in sources),
                               options, tensors, on_device)

    def serves(self, sources: list[torch.Tensor], options: tuple[Any, ...]) -> bool:
        """Whether these copies are still those of ``sources`` under ``options``."""
        return (options == self.options and len(sources) == len(self.sources) and
                all(ref() is t and version == change_count(t)
                    for ref, version, t in zip(self.sources, self.versions, sources)))


def prepare_tensors(tensors: list[torch.Tensor], device: torch.device, resident: Union[bool, str],
                    max_bytes: int, pin_dataset: bool) -> tuple[list[torch.Tensor], bool]:
    """The tensors a native pass gathers from: copies on ``device`` (``resident``, when they fit
    for ``"auto"``), page-locked copies (``pin_dataset``), or the tensors themselves.
    A conjugate or negative view is resolved first: the gather reads memory, not view bits."""
    tensors = [t.resolve_conj().resolve_neg() for t in tensors]
    if resident:
        size = sum(t.numel() * t.element_size() for t in tensors)
        if resident is True or (resident == "auto" and size <= max_bytes):
            return [t.to(device) for t in tensors], True
    if pin_dataset:
        return [t if t.is_pinned() else t.contiguous().pin_memory() for t in tensors], False
    return [t.contiguous() for t in tensors], False


def start_warnings(pin_memory: bool, pin_memory_device: str, num_workers: Any) -> None:
    """The warnings DataLoader's iterator gives when it is created (native passes), from where
    DataLoader gives them (its iterator's module and line): a filter on that module matches
    them, and they are shown once per place as DataLoader's are."""
    if pin_memory and pin_memory_device:
        _warn_as_dataloader("pin_memory_device is deprecated, the current accelerator will be used as the "
                            f"device,ignore pin_memory_device='{pin_memory_device}'.", num_workers)
    if pin_memory and not torch.accelerator.is_available():
        _warn_as_dataloader("'pin_memory' argument is set as true but no accelerator is found, then device "
                            "pinned memory won't be used.", num_workers)


def _warn_as_dataloader(message: str, num_workers: Any) -> None:
    """A UserWarning as DataLoader's iterator base class gives it (``stacklevel=2``: the line of
    the single- or multi-process iterator that creates it), with that module's registry."""
    module = torch.utils.data.dataloader
    # DataLoader's own test for the iterator kind
    cls = module._MultiProcessingDataLoaderIter if num_workers != 0 else module._SingleProcessDataLoaderIter
    warn_at(module, source_line(cls.__init__, "super().__init__("), message, stacklevel=4)


def check_prefetch_factor(num_workers: int, prefetch_factor: Any) -> None:
    """DataLoader accepts ``prefetch_factor=0`` with workers at construction (and takes any
    value assigned later); its worker iterator then fails an assertion, after drawing the
    pass's seed. The same assertion, at the same point of a native pass; and, for None assigned
    with workers (or workers assigned to a loader made without, whose prefetch_factor stays
    None), its comparison's TypeError."""
    if num_workers > 0 and prefetch_factor is None:
        raise TypeError("'<=' not supported between instances of 'NoneType' and 'int' (PrefetchLoader: "
                        f"prefetch_factor is None with num_workers={num_workers}, which DataLoader's worker "
                        "iterator fails on; assign a positive int, e.g. loader.prefetch_factor = 2, "
                        "DataLoader's default, or give num_workers to the constructor)")
    if num_workers > 0 and prefetch_factor <= 0:
        raise AssertionError("prefetch_factor must be greater than 0 for MultiProcessingDataLoaderIter "
                             f"(PrefetchLoader: prefetch_factor={prefetch_factor!r} with num_workers="
                             f"{num_workers}; leave it None for 2 batches a worker, or give a positive int)")


def check_worker_iterator(num_workers: Any, prefetch_factor: Any, generator: Optional[torch.Generator]) -> None:
    """``num_workers`` and ``prefetch_factor`` as DataLoader's worker iterator meets them when a
    pass starts: it draws the pass's seed from ``generator`` (the global one when None), then
    fails on either (before it reads the sampler), so a refusal here makes that draw first."""
    try:
        check_prefetch_factor(check_workers(num_workers), prefetch_factor)
    except (AssertionError, TypeError):
        draw_base_seed(generator)
        raise


def largest_batch(batch_sampler: Any, rows: int) -> int:
    """Rows of the largest batch ``batch_sampler`` yields from ``rows`` rows (0 when it does not
    say: only torch's BatchSampler does)."""
    if type(batch_sampler) is not BatchSampler:
        return 0
    return min(batch_sampler.batch_size, rows)
