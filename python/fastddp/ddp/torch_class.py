"""DDPWrapper's place under torch's ``DistributedDataParallel`` class.

``DDPWrapper`` subclasses ``torch.nn.parallel.DistributedDataParallel`` so that code which
branches on ``isinstance(model, DistributedDataParallel)`` takes the branch it takes for torch
DDP: a training script's ``model.module if isinstance(model, DDP) else model`` unwrap,
``torch.distributed.checkpoint.state_dict``'s handling of the ``module.`` prefix, pipelining's
``no_sync()`` per micro-batch. torch DDP's own code does not run on it: torch's constructor is
not called, and every method torch's class defines that neither ``DDPWrapper`` nor
``nn.Module`` provides (torch DDP's internals, which work on torch's C++ reducer and logger)
raises ``NotImplementedError`` naming it, instead of failing somewhere inside torch on an
attribute that a ``DDPWrapper`` does not have. What stays torch's: its ``train()`` override
(``nn.Module.train``, returning the module), its properties and its class and static methods.
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Callable, NoReturn, Optional

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

# torch DDP's attributes that belong to its own C++ reducer and logger: no DDPWrapper has them
TORCH_ONLY_ATTRIBUTES = ("logger",)
_MIB = 1024 * 1024


class TorchReducerCalls:
    """``ddp.reducer``: the calls training libraries make on torch DDP's C++ reducer, made on
    DDPWrapper's. Lightning's manual optimization (its ``prepare_for_backward``, before a
    backward that runs inside the module's forward) and accelerate's
    ``trigger_sync_in_backward`` (after forwards under ``no_sync()``) call
    ``prepare_for_backward(outputs)``, which arms the next backward to be reduced, and
    ``_rebuild_buckets()``, which rebuilds the buckets when torch's rule says they are due
    (True when it did); Lightning's manual optimization with ``static_graph=True`` calls
    ``_delay_all_reduce()`` after the first backward; ``_ddp_graph_static()`` says whether the
    unused parameters were the same in every iteration. Every other method of torch's reducer
    raises ``NotImplementedError`` naming it."""

    def __init__(self, prepare: Callable[[Any], None], rebuild_if_due: Callable[[], bool],
                 reduce_static_first_now: Callable[[], None], graph_static: Callable[[], bool]) -> None:
        self._prepare = prepare
        self._rebuild_if_due = rebuild_if_due
        self._reduce_static_first_now = reduce_static_first_now
        self._graph_static = graph_static

    def prepare_for_backward(self, outputs: Any) -> None:
        """Arm the next backward to be reduced; with ``find_unused_parameters``, the parameters
        the graph behind ``outputs`` does not reach count as unused (torch's)."""
        self._prepare(outputs)

    def _rebuild_buckets(self) -> bool:
        """Rebuild the buckets in gradient arrival order if torch's rule says they are due."""
        return self._rebuild_if_due()

    def _delay_all_reduce(self) -> None:
        """Reduce the first iteration of a ``static_graph=True`` wrapper now, after its backward
        (Lightning's manual optimization calls it after the first manual backward, which runs
        inside the module's forward and so never reaches the outputs that would reduce it)."""
        self._reduce_static_first_now()

    def _ddp_graph_static(self) -> bool:
        """Whether every reducing forward so far left the same parameters unused (with
        ``find_unused_parameters=True``; always True without it, and with ``static_graph``)."""
        return self._graph_static()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # copy, pickle and friends probe for these
            raise AttributeError(name)
        raise NotImplementedError(
            f"DDPWrapper.reducer.{name}: DDPWrapper's reducer answers only the calls training libraries "
            "make on torch DistributedDataParallel's C++ reducer (prepare_for_backward, _rebuild_buckets, "
            "_delay_all_reduce, _ddp_graph_static). "
            "Use torch.nn.parallel.DistributedDataParallel for code that needs the rest of it.")


class TorchAttributes:
    """torch DDP's public attributes that code written for it reads, with torch's values and
    meaning; the ones that belong to torch's own reducer and logger are an AttributeError that
    says so (``hasattr`` is False for them, as for any missing attribute)."""

    broadcast_bucket_size = 250 * 1024 * 1024  # torch DDP's constant (its init broadcast's bucket)
    skip_all_reduce_unused_params = False  # True is refused at construction
    forward_sync_buffers: bool
    module: nn.Module
    parameters_to_ignore: Any
    _module_buffers: list[torch.Tensor]
    _reduced_params: list[nn.Parameter]

    # Dynamo's DDPOptimizer asks torch's class which DDP module runs a forward
    # (DistributedDataParallel._get_active_ddp_module()); torch DDP's own context manager sets
    # it, so a compiled module inside a DDPWrapper is split into buckets as inside torch DDP.
    _inside_ddp_forward = DistributedDataParallel._inside_ddp_forward

    def _describe_as_torch_ddp(self, bucket_cap_mb: float, first_bucket_mb: float,
                               caps_mb: Optional[list[float]]) -> None:
        """Set the descriptive attributes torch DDP's constructor sets (the bucket caps as
        torch's _BucketCapacityConfig gives them: the cap, the per-bucket caps given with
        ``bucket_cap_mb_list``, and whether the first bucket is the smaller default one)."""
        self.bucket_bytes_cap = int(bucket_cap_mb * _MIB)
        self.bucket_bytes_cap_list = [int(cap * _MIB) for cap in caps_mb or ()]
        self.bucket_bytes_cap_default = int(first_bucket_mb * _MIB) < self.bucket_bytes_cap
        self.is_multi_device_module = len({p.device for p in self._reduced_params}) > 1
        self.device_type = self._reduced_params[0].device.type
        self.device = self._reduced_params[0].device
        self.mixed_precision = None
        self.use_side_stream_for_tensor_copies = os.environ.get("PYTORCH_DDP_USE_SIDE_STREAM", "1") == "1"

    @property
    def broadcast_buffers(self) -> bool:
        """Whether buffers are broadcast from rank 0 before a forward: torch DDP's older name of
        ``forward_sync_buffers`` (a property over it from torch 2.13 on, an attribute before;
        defined here, it is the same on every torch version)."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value  # as given, as torch DDP's setter keeps it

    @property
    def reducer(self) -> TorchReducerCalls:
        """torch DDP's ``reducer``, for the calls libraries make on it (see TorchReducerCalls)."""
        return TorchReducerCalls(prepare=lambda outputs: self._prepare_reduction(outputs, True),
                                 rebuild_if_due=self._rebuild_if_due,
                                 reduce_static_first_now=self._reduce_static_first_now,
                                 graph_static=self._graph_static)

    @property
    def modules_buffers(self) -> list[torch.Tensor]:
        """The module's buffers that are synced from rank 0 (all but the ignored), as torch's list."""
        return list(self._module_buffers)

    @property
    def named_module_buffers(self) -> dict[str, torch.Tensor]:
        """``modules_buffers`` by name."""
        return {n: b for n, b in self.module.named_buffers() if n not in self.parameters_to_ignore}

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)  # type: ignore[misc]  # nn.Module's: parameters, buffers, submodules
        except AttributeError:
            if name in TORCH_ONLY_ATTRIBUTES:
                raise AttributeError(
                    f"DDPWrapper has no {name!r}: it belongs to torch DistributedDataParallel's own C++ "
                    "reducer and logger, which DDPWrapper replaces (see DDPWrapper.bucket_report() for its "
                    "buckets). Use torch.nn.parallel.DistributedDataParallel for code that needs it.") from None
            raise


def _refusal(name: str) -> Callable[..., NoReturn]:
    def refuse(self: Any, *args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(
            f"DDPWrapper does not implement torch DistributedDataParallel's internal method "
            f"{name}(): it works on torch DDP's own C++ reducer and logger, which DDPWrapper "
            "replaces. Use torch.nn.parallel.DistributedDataParallel for code that calls it.")

    refuse.__name__ = refuse.__qualname__ = name
    refuse.__doc__ = f"torch DDP's internal ``{name}``: not implemented by DDPWrapper (raises)."
    return refuse


def _defined_above(cls: type, name: str) -> bool:
    """Whether a class between ``cls`` and torch's DDP in the MRO defines ``name``."""
    for klass in cls.__mro__:
        if klass is DistributedDataParallel:
            return False
        if name in vars(klass):
            return True
    raise TypeError(f"{cls.__name__} does not derive from torch's DistributedDataParallel")


def refuse_torch_internals(cls: type) -> type:
    """Class decorator: torch DDP's methods that ``cls`` does not define raise (see the module
    docstring). ``nn.Module``'s own methods that torch DDP overrides (``train``) stay torch's:
    they only call ``nn.Module``'s."""
    for name, value in vars(DistributedDataParallel).items():
        if name.startswith("__") or not inspect.isfunction(value):
            continue  # dunders, properties, class and static methods: torch's, harmless
        if hasattr(nn.Module, name) or _defined_above(cls, name):
            continue
        setattr(cls, name, _refusal(name))
    return cls
