"""Contract: what ``param.grad`` is after a DDPWrapper backward, side by side with torch DDP in
the same two gloo ranks.

torch DDP's default (``gradient_as_bucket_view=False``) copies the reduced gradients into
``.grad`` tensors of their own: a gradient kept from one step (a reference, a slice) keeps its
values when ``zero_grad(set_to_none=True)`` lets the next backward make a new one, and a
tensor assigned to ``.grad`` keeps its identity and receives the result. DDPWrapper lends
aliases of its buckets as ``.grad`` where nobody can tell them apart, and moves a bucket to new
memory when a lent gradient is held across a backward; these tests compare what a script
sees, and that a loop that keeps no gradient never pays for a move.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastddp


def _pair(kwargs: dict[str, Any]) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(7)
    a = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 3))
    b = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 3))
    b.load_state_dict(a.state_dict())
    return fastddp.DDPWrapper(a, bucket_cap_mb=0.0001, **kwargs), TorchDDP(b, bucket_cap_mb=0.0001, **kwargs)


def _keep(grad: torch.Tensor, how: str) -> Any:
    return {"reference": lambda: grad, "slice": lambda: grad[1:3], "list": lambda: [grad]}[how]()


def _kept_gradients(rank: int, world_size: int, how: str, set_to_none: bool) -> list[list[float]]:
    """Train both three steps, keeping the first layer's .grad of every step as ``how`` says;
    the kept values at the end, which must be torch's."""
    ours, ref = _pair({})
    out = []
    for model in (ours, ref):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        kept = []
        for step in range(3):
            opt.zero_grad(set_to_none=set_to_none)
            x = torch.randn(4, 5, generator=torch.Generator().manual_seed(10 * step + rank))
            model(x).square().sum().backward()
            kept.append(_keep(model.module[0].weight.grad, how))
            opt.step()
        flat = [k[0] if isinstance(k, list) else k for k in kept]
        out.append([float(t.sum()) for t in flat])
    assert out[0] == out[1], out
    return out[0]


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("how", ["reference", "slice", "list"])
def test_a_kept_gradient_holds_what_torch_ddps_holds(ranks, how, set_to_none) -> None:
    kept = ranks.run(_kept_gradients, args=(how, set_to_none))
    # with set_to_none each step's gradient is its own; without, torch's .grad is one tensor
    assert len(set(kept[0])) == (3 if set_to_none else 1)


def _assigned_gradient(rank: int, world_size: int) -> list[bool]:
    """A tensor the script assigns to .grad before backward: torch accumulates into it and
    copies the reduced result into it, so it stays .grad and holds the result."""
    results = []
    for model in _pair({}):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        mine = torch.zeros_like(model.module[0].weight)
        model.module[0].weight.grad = mine
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(rank))
        model(x).square().sum().backward()
        results.append((model.module[0].weight.grad is mine, mine.clone()))
        opt.step()
    (same_o, val_o), (same_r, val_r) = results
    assert same_o == same_r and torch.equal(val_o, val_r), (same_o, same_r)
    return [same_o]


def test_an_assigned_gradient_keeps_its_identity_and_the_result(ranks) -> None:
    assert ranks.run(_assigned_gradient) == [[True], [True]]


def _plain_loop(rank: int, world_size: int, set_to_none: bool, scaler: bool) -> tuple[int, bool, bool]:
    """A loop that keeps no gradient: the gradients are lent bucket aliases (no copy out of
    the buckets) and no bucket ever moves."""
    ours, ref = _pair({})
    assert ours.gradient_as_bucket_view is ref.gradient_as_bucket_view is False
    opt = torch.optim.AdamW(ours.parameters(), lr=0.01)
    amp = fastddp.GradScaler("cpu") if scaler else None
    for step in range(5):
        opt.zero_grad(set_to_none=set_to_none)
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(10 * step + rank))
        loss = ours(x).square().sum()
        if amp is None:
            loss.backward()
            opt.step()
        else:
            amp.scale(loss).backward()
            amp.fused_step(opt, ddp=ours, max_grad_norm=1.0)
            amp.update()
        _ = [p.grad.sum() for p in ours.parameters()]  # a script reading its gradients
    buffers = {b.untyped_storage().data_ptr() for b in ours.bucket_buffers()}
    in_buckets = all(p.grad.untyped_storage().data_ptr() in buffers for p in ours.parameters())
    return ours.bucket_report()["relocations"], in_buckets, ours.bucket_report()["transport"] == "shm"


@pytest.mark.parametrize("scaler", [False, True])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_loop_that_keeps_no_gradient_never_moves_a_bucket(ranks, set_to_none, scaler) -> None:
    assert ranks.run(_plain_loop, args=(set_to_none, scaler)) == [(0, True, True)] * 2


class _Branch(nn.Module):
    """``b`` (a 64 KiB weight: the shared-memory transport reduces it in place) is used on the
    ranks that ask for it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 128), nn.Linear(128, 128), nn.Linear(128, 2)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = self.a(x)
        return self.c(self.b(h) if use_b else h)


def _grad_changed_after_forward(rank: int, world_size: int, kwargs: dict[str, Any], change: str) -> None:
    """A parameter the forward left unused on this rank contributes the .grad it holds when the
    backward starts (torch DDP marks such parameters ready at the backward's first gradient):
    a zero_grad() or an assignment between forward and backward counts, the .grad the forward
    saw does not."""
    results, states = [], []
    for cls in (fastddp.DDPWrapper, TorchDDP):
        torch.manual_seed(3)
        model = cls(_Branch(), **kwargs)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        grads = []
        for step in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
            out = model(x, use_b=rank == 0)
            if change == "zero_grad":
                opt.zero_grad()
            else:
                model.module.b.weight.grad = torch.full_like(model.module.b.weight, 100.0 * (rank + 1))
            out.square().sum().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
            opt.step()
        results.append(grads)
        states.append(torch.random.get_rng_state())
    assert torch.equal(*states), "the global random state differs after the same steps"
    for step, (ours, ref) in enumerate(zip(*results)):
        for (name, _), o, r in zip(model.module.named_parameters(), ours, ref):
            assert torch.equal(o, r), (step, name, o.sum().item(), r.sum().item())


@pytest.mark.parametrize("change", ["zero_grad", "assign"])
@pytest.mark.parametrize("kwargs", [{"find_unused_parameters": True}, {"static_graph": True}],
                         ids=["find_unused", "static_graph"])
def test_an_unused_parameter_contributes_its_grad_as_backward_starts(ranks, kwargs, change) -> None:
    ranks.run(_grad_changed_after_forward, args=(kwargs, change))


def _one_grad_for_two_parameters(rank: int, world_size: int, kwargs: dict[str, Any]) -> None:
    """One .grad tensor assigned to two parameters between steps (``b.grad = a.grad``), then a
    backward that accumulates into it: torch DDP copies each reduced slot into it in bucket
    order (the last copy stays); DDPWrapper's lent alias of one slot must not stand in for the
    other's slot, nor be overwritten by it halfway."""
    results = []
    for cls in (fastddp.DDPWrapper, TorchDDP):
        torch.manual_seed(5)
        model = cls(nn.Sequential(nn.Linear(3, 3, bias=False), nn.Linear(3, 3, bias=False)),
                    **(kwargs if cls is fastddp.DDPWrapper else {}))
        first, second = model.module[0].weight, model.module[1].weight
        x = torch.randn(2, 3, generator=torch.Generator().manual_seed(rank))
        model(x).sum().backward()
        second.grad = first.grad
        model(x).sum().backward()
        results.append((first.grad.clone(), second.grad is first.grad, torch.random.get_rng_state()))
    (ours, same_o, rng_o), (ref, same_r, rng_r) = results
    assert torch.equal(rng_o, rng_r), "the global random state differs after the same steps"
    assert same_o and same_r
    assert torch.equal(ours, ref), (ours, ref)


@pytest.mark.parametrize("kwargs", [{}, {"shm_allreduce": False}], ids=["default", "gloo"])
def test_one_grad_tensor_for_two_parameters(ranks, kwargs) -> None:
    ranks.run(_one_grad_for_two_parameters, args=(kwargs,))
