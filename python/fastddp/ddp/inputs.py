"""What DDPWrapper's forward does with the module's inputs and outputs, as torch DDP: moves
input tensors to ``device_ids``' device, finds the output tensors where the unused-parameter
search starts and passes them through one autograd node; torch DDP's input methods kept for
compatibility."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten


def find_tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors in a forward's output (nested lists, tuples, dicts and dataclasses, as torch
    DDP searches them), where find_unused_parameters starts its graph walk."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in find_tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in find_tensors(o)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [t for f in dataclasses.fields(obj) for t in find_tensors(getattr(obj, f.name))]
    return []


class _OutputSink(torch.autograd.Function):
    """torch DDP's ``_DDPSink``: one node in front of the forward's outputs (cloned, as torch
    clones them, unless ``_set_ddp_sink_clone(False)``). A backward from any of them runs this
    node, which sends undefined gradients down the graphs of the outputs the loss left out, so
    their parameters' hooks fire without a gradient (unused in this backward) instead of never
    firing."""

    @staticmethod
    def forward(ctx: Any, on_backward: Optional[Callable[[], None]], clone: bool,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)  # an output the loss left out gets None, not zeros
        ctx.on_backward = on_backward
        return tuple(t.clone() for t in tensors) if clone else tensors

    @staticmethod
    def backward(ctx: Any, *grads: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], ...]:
        if ctx.on_backward is not None:
            ctx.on_backward()
        return (None, None, *grads)


def through_sink(output: Any, on_backward: Optional[Callable[[], None]] = None, clone: bool = True) -> Any:
    """``output`` as torch DDP returns it through its ``_DDPSink`` (``find_unused_parameters=True``,
    and a ``static_graph`` wrapper until its first backward): rebuilt by ``torch.utils._pytree``
    (as torch rebuilds it), with every tensor that has a ``grad_fn`` replaced by its output of
    one :class:`_OutputSink` node (a clone unless ``clone`` is False); the other leaves as they
    are (tensors inside a type pytree does not know, such as a dataclass, included).
    ``on_backward`` runs when a backward reaches the node."""
    leaves, spec = tree_flatten(output)
    index = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    if index:
        for i, t in zip(index, _OutputSink.apply(on_backward, clone, *(leaves[i] for i in index))):
            leaves[i] = t
    return tree_unflatten(leaves, spec)


class OutputSink:
    """Which forward outputs go through :class:`_OutputSink`, as torch DDP decides: every one
    under ``find_unused_parameters=True``; under ``static_graph=True`` those of the forwards
    before a backward first reaches the node (torch's ``_static_graph_delay_allreduce_enqueued``)."""

    def __init__(self) -> None:
        self.static_reached = False
        self.clone = True  # torch DDP's _set_ddp_sink_clone()

    def __call__(self, output: Any, find_unused_parameters: bool, static_graph: bool,
                 reductions: Optional[Callable[[], int]]) -> Any:
        """``reductions``: for a reducing forward, the reducer's count of finished reductions;
        None for a forward that reduces nothing (no_sync, no grad)."""
        if static_graph:
            return output if self.static_reached else through_sink(output, self._reached, self.clone)
        if not find_unused_parameters:
            return output
        on_backward = None if reductions is None else _one_backward_per_forward(reductions)
        return through_sink(output, on_backward, self.clone)

    def _reached(self) -> None:
        self.static_reached = True


def _one_backward_per_forward(reductions: Callable[[], int]) -> Callable[[], None]:
    """find_unused_parameters=True: the first backward through a reducing forward's outputs
    that reaches the parameters finishes its reduction (every output is reached, through the
    sink), counting the parameters it brought no gradient as unused. A backward through them
    after that would leave its gradients unaveraged, the ranks apart without a word (torch DDP
    leaves them so): refused. A pass that finished no reduction (``torch.autograd.grad`` of the
    outputs for a gradient penalty, ``backward(inputs=[x])``) leaves the next one free, as in
    torch DDP."""
    before: Optional[int] = None  # finished reductions when the last pass through the sink began

    def on_backward() -> None:
        nonlocal before
        now = reductions()
        if before is not None and now != before:
            raise RuntimeError(
                "DDPWrapper: a second backward pass through the outputs of one forward, with "
                "find_unused_parameters=True. The first one finished this forward's reduction "
                "(counting the parameters it brought no gradient as unused), so this one's "
                "gradients would stay this rank's own. Backward the sum of the losses once "
                "((loss_a + loss_b).backward()); or, when each backward reaches its own "
                "parameters (one loss per network), pass find_unused_parameters=False, which "
                "reduces a forward's gradients over several backward passes as torch DDP does.")
        before = now

    return on_backward


def to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` with its tensors on ``device``, as torch DDP's forward moves the inputs of a
    module wrapped with ``device_ids``: tensors (and packed sequences) inside tuples, named
    tuples, lists and dicts; anything else as it is. Copies from pinned memory do not block."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.device == device else obj.to(device, non_blocking=True)
    if isinstance(obj, nn.utils.rnn.PackedSequence):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple keeps its type
        return type(obj)(*(to_device(o, device) for o in obj))
    if isinstance(obj, tuple):
        return tuple(to_device(o, device) for o in obj)
    if isinstance(obj, list):
        return [to_device(o, device) for o in obj]
    if isinstance(obj, dict):
        return type(obj)((k, to_device(v, device)) for k, v in obj.items())
    return obj


class TorchInputMethods:
    """torch DDP's (kept for compatibility) input and output methods; the wrapper provides
    ``device_type`` and ``dim``."""

    device_type: str
    dim: int

    def to_kwargs(self, inputs: tuple, kwargs: Optional[dict], device_id: int) -> tuple[tuple, tuple]:
        """``((inputs,), (kwargs,))`` with their tensors on device ``device_id`` of the
        parameters' device type."""
        device = torch.device(self.device_type, device_id)
        return (to_device(tuple(inputs), device),), (to_device(dict(kwargs or {}), device),)

    def scatter(self, inputs: tuple, kwargs: Optional[dict], device_ids: list[int]) -> tuple[tuple, tuple]:
        """Scatter of inputs over ``device_ids`` along ``dim``."""
        from torch.nn.parallel.scatter_gather import scatter_kwargs

        return scatter_kwargs(inputs, kwargs, device_ids, dim=self.dim)

    def gather(self, outputs: Any, output_device: int | torch.device) -> Any:
        """Gather of outputs on ``output_device`` along ``dim``."""
        from torch.nn.parallel.scatter_gather import gather

        return gather(outputs, output_device, dim=self.dim)
