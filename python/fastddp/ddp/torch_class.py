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
from typing import Any, Callable, NoReturn

from torch import nn
from torch.nn.parallel import DistributedDataParallel


class BufferSyncName:
    """``broadcast_buffers``, torch DDP's older name of ``forward_sync_buffers``. torch's class
    makes it a property over ``forward_sync_buffers`` from 2.13 on and an attribute before;
    defined here, it is the same on every torch version."""

    forward_sync_buffers: bool

    @property
    def broadcast_buffers(self) -> bool:
        """Whether buffers are broadcast from rank 0 before a forward."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = bool(value)


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
