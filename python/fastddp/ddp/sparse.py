"""Sparse gradients on DDPWrapper: the parameters of ``nn.Embedding(sparse=True)`` and
``nn.EmbeddingBag(sparse=True)`` stay out of the C++ reducer's flat buckets and are reduced here
as torch DDP reduces them: each gradient on its own, divided by the world size in place, then
summed by the process group's sparse all-reduce (gloo), which leaves it coalesced."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from .. import diag


def sparse_parameter_names(module: nn.Module, reduced: list[str]) -> set[str]:
    """The reduced parameters that get sparse gradients, by torch DDP's rule: owned (first, in
    ``named_modules`` order) by an Embedding or EmbeddingBag built with ``sparse=True``."""
    wanted = set(reduced)
    owner: dict[int, nn.Module] = {}
    names: dict[int, str] = {}
    for module_name, sub in module.named_modules():
        for param_name, p in sub.named_parameters(recurse=False):
            full = f"{module_name}.{param_name}" if module_name else param_name
            if full in wanted and id(p) not in owner:
                owner[id(p)], names[id(p)] = sub, full
    return {names[k] for k, sub in owner.items()
            if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse}


def refuse(names: list[str], what: str) -> None:
    """Combinations torch DDP allows with sparse gradients that DDPWrapper does not implement
    (``what`` empty: nothing to refuse)."""
    if names and what:
        raise NotImplementedError(
            f"DDPWrapper: {what} is not supported together with sparse gradients (parameter "
            f"{names[0]!r}, from nn.Embedding/EmbeddingBag(sparse=True)). Use sparse=False for that layer, "
            "drop the option, or use torch's DistributedDataParallel for this model.")


class SparseGradients:
    """All-reduces the sparse gradients of one wrapper once per reduced backward.

    Every collective a backward issues must come in the same order on every rank. The C++
    reducer launches its dense buckets during backward and finishes them (and, with
    find_unused_parameters, the map of used parameters) in an autograd-engine callback queued
    at its first gradient. The sparse all-reduces run after that callback, in parameter order:
    the first gradient of the backward (a Python hook on every reduced parameter) queues a
    callback, which queues the reduction behind every callback queued during backward.
    """

    def __init__(self, names: list[str], params: list[torch.Tensor], hooked: list[torch.Tensor],
                 group: dist.ProcessGroup, find_unused_parameters: bool) -> None:
        self.names = names
        self.params = params
        self._group = group
        self._world_size = group.size()
        self._find_unused = find_unused_parameters
        self._sync = False      # the backward after the last forward reduces
        self._queued = False    # its callback is queued
        self._arrived = [False] * len(params)
        sparse_ids = {id(p): i for i, p in enumerate(params)}
        self._handles = [p.register_post_accumulate_grad_hook(self._hook(sparse_ids.get(id(p))))
                         for p in hooked] if params else []

    def close(self) -> None:
        """Removes the hooks (the wrapper built a new reducer, or is being copied)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def prepare_for_backward(self) -> None:
        """Called by every reducing forward (gradients on, outside no_sync()): the next backward
        reduces. A forward under no_sync() does not call it, so it leaves a pending reduction
        in place, as torch DDP's reducer does."""
        self._sync = bool(self.params)
        self._queued = False
        self._arrived = [False] * len(self.params)

    def _hook(self, index: Optional[int]) -> Any:
        def on_gradient(_param: torch.Tensor) -> None:
            if not self._sync:
                return
            if index is not None:
                self._arrived[index] = True
            if not self._queued:
                self._queued = True
                engine = torch.autograd.Variable._execution_engine
                engine.queue_callback(lambda: engine.queue_callback(self._reduce))
        return on_gradient

    @torch.no_grad()
    def _reduce(self) -> None:
        if not self._sync:
            return
        self._sync = False  # a second backward through the same graph reduces nothing more
        for name, p, arrived in zip(self.names, self.params, self._arrived):
            grad = p.grad
            if not arrived and (grad is None or not self._find_unused):
                raise RuntimeError(
                    f"DDPWrapper: parameter {name!r} (sparse gradients) got no gradient in this backward pass"
                    + (" and has none accumulated; torch DDP cannot reduce it either ('Expected sparse gradient "
                       "to be defined'). Use it in every iteration on every rank."
                       if self._find_unused else
                       ". Pass find_unused_parameters=True if the model does not use it in every iteration."))
            if grad.layout != torch.sparse_coo:
                raise RuntimeError(f"DDPWrapper: parameter {name!r} is in an nn.Embedding/EmbeddingBag with "
                                   f"sparse=True but got a gradient of layout {grad.layout}; torch DDP expects a "
                                   "sparse gradient there too (a weight tied to a dense layer makes it dense).")
            grad.div_(self._world_size)
            with diag.phase(diag.Phase.ALLREDUCE):
                dist.all_reduce(grad, group=self._group)
