"""Contract: the calls training libraries make on torch DDP's C++ reducer (``ddp.reducer``),
side by side with torch DDP in the same two gloo ranks.

- accelerate's ``Accelerator.trigger_sync_in_backward``: forwards under ``no_sync()``, then
  ``require_backward_grad_sync = True`` and ``ddp.reducer.prepare_for_backward([])`` so that
  the next backward is reduced.
- Lightning's manual optimization: the module's forward (its ``training_step``) runs the
  backward itself, so Lightning arms the reducer before it with
  ``ddp.reducer._rebuild_buckets()`` and ``ddp.reducer.prepare_for_backward(outputs)``
  (``lightning.pytorch.overrides.distributed.prepare_for_backward``), and turns
  ``require_backward_grad_sync`` off between the module's forward and DDP's post-forward. With
  ``static_graph=True`` its ``DDPStrategy.post_backward`` calls ``ddp.reducer._delay_all_reduce()``
  after the first manual backward: that backward never reaches the outputs whose backward would
  reduce static_graph's first iteration.
- ``ddp.reducer._ddp_graph_static()``: whether the unused parameters were the same in every
  iteration (torch's hint that ``static_graph=True`` would do).

Losses, gradients and parameters must be torch DDP's bit for bit.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.nn.parallel.distributed import _find_tensors

import fastddp

from ..ddp_common import ThreeBranches, compare_models


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))


def _trigger_sync_in_backward(rank: int, world_size: int) -> int:
    """accelerate's documented idiom: two losses from forwards under no_sync(); the first
    backward accumulates locally, the second, inside trigger_sync_in_backward, is reduced."""
    models = [cls(_net(), bucket_cap_mb=0.001) for cls in (fastddp.DDPWrapper, TorchDDP)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    torch.manual_seed(1 + rank)
    for step in range(4):
        x1, x2 = torch.randn(4, 6), torch.randn(4, 6)
        for m in models:
            if step == 3:  # a plain reduced step after the idiom
                m(x1).square().mean().backward()
            else:
                with m.no_sync():
                    l1, l2 = m(x1).square().mean(), m(x2).square().mean()
                    l1.backward()
                old = m.require_backward_grad_sync, m.require_forward_param_sync
                m.require_backward_grad_sync = m.require_forward_param_sync = True
                m.reducer.prepare_for_backward([])
                try:
                    l2.backward()
                finally:
                    m.require_backward_grad_sync, m.require_forward_param_sync = old
        compare_models(models[0], models[1], rtol=0, atol=0)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    compare_models(models[0], models[1], grads=False, rtol=0, atol=0)
    return step


def test_accelerate_trigger_sync_in_backward(ranks) -> None:
    assert ranks.run(_trigger_sync_in_backward) == [3, 3]


class _ManualStep(nn.Module):
    """A Lightning ``training_step`` under manual optimization: the backward and the optimizer
    step run inside the module's forward, so inside DDP's forward."""

    def __init__(self, with_unused: bool) -> None:
        super().__init__()
        self.net = _net()
        self.ddp: list[Any] = []  # the wrapper around this module (not a submodule)
        self.delay_done = False  # Lightning's DDPStrategy._pl_static_graph_delay_done
        if with_unused:
            self.unused = nn.Linear(2, 2)  # never in the loss (find_unused_parameters finds it)

    def forward(self, x: torch.Tensor, opt: torch.optim.Optimizer) -> torch.Tensor:
        loss = self.net(x).square().mean()
        ddp = self.ddp[0]
        # lightning.pytorch.overrides.distributed.prepare_for_backward, as Lightning calls it
        if torch.is_grad_enabled() and ddp.require_backward_grad_sync:
            ddp.require_forward_param_sync = True
            args = list(_find_tensors(loss)) if ddp.find_unused_parameters and not ddp.static_graph else []
            ddp.reducer._rebuild_buckets()
            ddp.reducer.prepare_for_backward(args)
        else:
            ddp.require_forward_param_sync = False
        loss.backward()
        if ddp.static_graph and not self.delay_done:  # Lightning's DDPStrategy.post_backward
            ddp.reducer._delay_all_reduce()
            self.delay_done = True
        opt.step()
        opt.zero_grad()
        # Lightning's _DDPForwardRedirection.on_after_inner_forward: DDP's own post-forward must
        # not arm a reduction (the backward ran already); on_after_outer_forward sets it back
        ddp.require_backward_grad_sync = False
        return loss.detach()


def _lightning_manual_optimization(rank: int, world_size: int, mode: str) -> list[float]:
    models = []
    find_unused = mode == "find_unused_parameters"
    for cls in (fastddp.DDPWrapper, TorchDDP):
        inner = _ManualStep(with_unused=mode != "default")  # static_graph: unused in every iteration
        ddp = cls(inner, bucket_cap_mb=0.001, find_unused_parameters=find_unused,
                  static_graph=mode == "static_graph")
        inner.ddp.append(ddp)
        models.append((ddp, torch.optim.SGD(ddp.parameters(), lr=0.1)))
    torch.manual_seed(1 + rank)
    losses = []
    for _ in range(4):
        x = torch.randn(4, 6)
        step, rng_after = [], []
        before = torch.random.get_rng_state()
        for ddp, opt in models:
            torch.random.set_rng_state(before)  # each wrapper's step from the same global state
            step.append(ddp(x, opt))
            ddp.require_backward_grad_sync = True  # on_after_outer_forward
            rng_after.append(torch.random.get_rng_state())
        assert torch.equal(step[0], step[1])
        assert torch.equal(rng_after[0], rng_after[1])
        losses.append(step[0].item())
        compare_models(models[0][0], models[1][0], grads=False, rtol=0, atol=0)
    return losses


@pytest.mark.parametrize("mode", ["default", "find_unused_parameters", "static_graph"])
def test_lightning_manual_optimization(ranks, mode: str) -> None:
    losses = ranks.run(_lightning_manual_optimization, args=(mode,))
    assert len(losses[0]) == 4 and losses[0] != losses[1]  # each rank its own data


def _delay_all_reduce_out_of_place(rank: int, world_size: int) -> list[str]:
    """_delay_all_reduce() where torch's reducer fails an internal assert: without static_graph,
    with nothing armed, and a second time."""
    messages = []
    plain, static = fastddp.DDPWrapper(_net()), fastddp.DDPWrapper(_net(), static_graph=True)
    for ddp, arm in ((plain, True), (static, False), (static, True), (static, False)):
        if arm and ddp is plain:
            ddp(torch.randn(2, 6)).sum().backward()
        elif arm:
            _static_backward(ddp)
        with pytest.raises(RuntimeError) as refused:
            ddp.reducer._delay_all_reduce()
        messages.append(str(refused.value))
    return messages


def _static_backward(ddp: Any) -> None:
    """static_graph's first backward run as Lightning's manual optimization runs it, then reduced."""
    loss = ddp.module(torch.randn(2, 6)).sum()
    ddp.reducer.prepare_for_backward([])
    loss.backward()
    ddp.reducer._delay_all_reduce()


def test_delay_all_reduce_out_of_place_is_refused_naming_why(ranks) -> None:
    messages = ranks.run(_delay_all_reduce_out_of_place, world_size=1)[0]
    assert "without static_graph=True" in messages[0], messages[0]
    assert "no reduction is armed" in messages[1], messages[1]
    assert "reduced already" in messages[2] and "reduced already" in messages[3], messages[2:]


def _other_reducer_calls(rank: int, world_size: int) -> str:
    ddp = fastddp.DDPWrapper(_net())
    with pytest.raises(NotImplementedError) as refused:
        ddp.reducer._set_static_graph()
    return str(refused.value)


def test_other_reducer_calls_are_refused_naming_them(ranks) -> None:
    message = ranks.run(_other_reducer_calls, world_size=1)[0]
    assert "reducer._set_static_graph" in message and "prepare_for_backward" in message, message


# per iteration, the branches each forward uses
_USE_PLANS = {"same": ["ab"] * 5, "changes": ["ab", "ab", "ac", "ab", "ab"], "all": ["abc"] * 3,
              "later": ["ab", "ab", "ab", "a"]}


def _graph_static(rank: int, world_size: int, kwargs: dict[str, Any], plan: str) -> list[Any]:
    seen = []
    for cls in (TorchDDP, fastddp.DDPWrapper):
        ddp = cls(ThreeBranches(), **kwargs)
        after = []
        torch.manual_seed(5)  # the same inputs for both, drawn from the global generator
        for use in _USE_PLANS[plan]:
            ddp(torch.randn(2, 3), use).sum().backward()
            after.append(ddp.reducer._ddp_graph_static())
        seen.append((after, torch.random.get_rng_state().tolist()))
    return seen


@pytest.mark.parametrize(("kwargs", "plan"), [
    *(({"find_unused_parameters": True}, plan) for plan in _USE_PLANS),
    ({}, "all"),  # (without find_unused_parameters a changing graph fails the reduction)
    *(({"find_unused_parameters": True, "static_graph": True}, plan) for plan in ("same", "all")),
])
def test_ddp_graph_static_as_torch(ranks, kwargs: dict[str, Any], plan: str) -> None:
    torch_side, ours = ranks.run(_graph_static, world_size=1, args=(kwargs, plan))[0]
    assert ours == torch_side  # the answers after each step, and the global random state
    assert torch_side[0][-1] == (plan not in ("changes", "later"))
