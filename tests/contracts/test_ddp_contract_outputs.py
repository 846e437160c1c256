"""Contract: what DDPWrapper's forward returns and what a backward from part of it does, side
by side with torch.nn.parallel.DistributedDataParallel in the same two gloo ranks.

With ``find_unused_parameters=True`` torch DDP passes every output that has a ``grad_fn``
through one autograd node (``_DDPSink``, cloning them): a backward from some of the outputs
then also runs the graphs of the others with undefined gradients, so the parameters behind
an output the loss left out count as unused in that backward and keep their ``.grad``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastddp


class TwoHeads(nn.Module):
    """A body and two heads; the loss uses one head on some steps and both on others."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 8)
        self.head_a = nn.Linear(8, 3)
        self.head_b = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.body(x))
        return torch.sigmoid(self.head_a(h)), self.head_b(h)


def _pair(**kwargs) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(11)
    a, b = TwoHeads(), TwoHeads()
    b.load_state_dict(a.state_dict())
    return fastddp.DDPWrapper(a, **kwargs), TorchDDP(b, **kwargs)


def _grads(model: nn.Module) -> list:
    return [None if p.grad is None else p.grad.clone() for p in model.module.parameters()]


def _same(ours: list, ref: list) -> bool:
    return all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
               for x, y in zip(ours, ref))


# which heads the loss uses at each step, per rank: head_b on no rank, on both, on rank 0 only
USES_B = [lambda rank: False, lambda rank: True, lambda rank: rank == 0]


def _loss_from_some_outputs(rank: int, world_size: int) -> list[list[bool]]:
    """SGD steps whose loss leaves head_b out on some steps (on every rank, or on one): each
    step's gradients are torch DDP's, bit for bit, including which ones are None."""
    ours, ref = _pair(find_unused_parameters=True)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, ref)]
    none_per_step = []
    for step, uses_b in enumerate(USES_B):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        for model, opt in zip((ours, ref), opts):
            opt.zero_grad(set_to_none=True)
            a, b = model(x)
            (a.sum() + b.square().sum() if uses_b(rank) else a.sum()).backward()
        assert _same(_grads(ours), _grads(ref)), step
        none_per_step.append([g is None for g in _grads(ref)])
        for opt in opts:
            opt.step()
    return none_per_step


def _static_graph_loss_from_one_output(rank: int, world_size: int) -> list:
    """static_graph=True with a loss that always leaves head_b out. torch DDP's first forward
    goes through its sink, so head_b's hooks fire (without a gradient) in the first backward
    and the graph looks changed from the second: its gradients are left unreduced, and the
    third forward raises. The same outcome at every step: gradients bit for bit (None
    included), then a RuntimeError at the same forward."""
    ours, ref = _pair(static_graph=True)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, ref)]
    seen = []
    for step in range(3):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        outcome = []
        for model, opt in zip((ours, ref), opts):
            opt.zero_grad(set_to_none=True)
            try:
                a, _ = model(x)
            except RuntimeError:
                outcome.append("RuntimeError at forward")
                continue
            a.sum().backward()
            outcome.append(_grads(model))
            opt.step()
        if isinstance(outcome[1], list):
            assert _same(outcome[0], outcome[1]), step
            seen.append("same gradients")
        else:
            assert outcome[0] == outcome[1], (step, outcome)
            seen.append(outcome[1])
    return seen


def test_static_graph_loss_from_one_output_as_torch(ranks) -> None:
    expected = ["same gradients", "same gradients", "RuntimeError at forward"]
    assert ranks.run(_static_graph_loss_from_one_output) == [expected, expected]


def test_a_loss_from_some_outputs_leaves_the_other_heads_unused(ranks) -> None:
    # body, head_a, head_b (weight and bias each): head_b has no gradient on the first step
    expected = [[False] * 4 + [True] * 2, [False] * 6, [False] * 6]
    assert ranks.run(_loss_from_some_outputs) == [expected, expected]


def _output_changed_in_place(rank: int, world_size: int) -> bool:
    """An output changed in place before the loss (head_a's sigmoid, which its backward
    reads): torch DDP hands out clones under find_unused_parameters=True, so the backward
    works and gives torch's gradients."""
    ours, ref = _pair(find_unused_parameters=True)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    for model in (ours, ref):
        a, b = model(x)
        a.mul_(2.0)
        (a.sum() + b.sum()).backward()
    return _same(_grads(ours), _grads(ref))


def test_an_output_changed_in_place_is_a_clone(ranks) -> None:
    assert ranks.run(_output_changed_in_place) == [True, True]


def _outputs_kept_as_torch(rank: int, world_size: int, kwargs: dict) -> list[tuple]:
    """Each output leaf: its type, whether it requires grad, and whether it is the tensor the
    module returned; the containers' types. Every entry equal to torch DDP's."""

    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(6, 3)

        def forward(self, x: torch.Tensor) -> dict:
            y = self.lin(x)
            self.returned = [y, y.detach(), x]
            return {"y": y, "detached": y.detach(), "input": x, "none": None, "list": [y.argmax(1), 3]}

    found = []
    for cls in (fastddp.DDPWrapper, TorchDDP):
        torch.manual_seed(0)
        model = cls(Mixed(), **kwargs)
        x = torch.randn(4, 6)
        seen = []
        for _ in range(3):  # static_graph: torch clones until a backward reaches its sink
            out = model(x)
            seen.append([(k, type(v).__name__, getattr(v, "requires_grad", None),
                          any(v is t for t in model.module.returned)) for k, v in out.items()]
                        + [type(out).__name__, type(out["list"]).__name__])
            out["y"].sum().backward()
        found.append(seen)
    assert found[0] == found[1], found
    return found[0]


@pytest.mark.parametrize("kwargs", [{}, {"find_unused_parameters": True}, {"static_graph": True}],
                         ids=["default", "find_unused", "static_graph"])
def test_outputs_are_returned_as_torch_returns_them(ranks, kwargs) -> None:
    ranks.run(_outputs_kept_as_torch, args=(kwargs,))
