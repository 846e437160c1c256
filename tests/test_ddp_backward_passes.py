"""A forward whose gradients come from several backward passes (each network's loss
backwarded on its own, as actor-critic scripts do), reduced as torch DDP reduces them, and the
gradients a backward leaves out: reported at the end of that backward once every output of the
forward was backwarded through (or when a parameter was frozen after wrapping), else at the
next forward, where torch DDP reports them. One case per test, on a pool of gloo ranks."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from .ddp_common import compare_models, make_pair


class _ActorCritic(nn.Module):
    """Two networks that share no parameter: the forward returns both heads' outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.actor = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        self.critic = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x):
        return self.actor(x), self.critic(x)


def _two_backwards(rank: int, world_size: int, kwargs: dict, transport: str) -> None:
    os.environ["FASTDDP_SHM_ALLREDUCE"] = "1" if transport == "shm" else "0"
    ours, ref = make_pair(_ActorCritic, kwargs)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ours, ref)]
    g = torch.Generator().manual_seed(10 + rank)
    for _ in range(4):
        x = torch.randn(6, 8, generator=g)
        for model, opt in zip((ours, ref), opts):
            opt.zero_grad()
            logits, value = model(x)
            logits.logsumexp(1).mean().backward()  # the actor's loss first
            value.pow(2).mean().backward()  # then the critic's, in a backward of its own
        compare_models(ours, ref, grads=True, rtol=0, atol=0)
        for opt in opts:
            opt.step()
        compare_models(ours, ref, grads=False, rtol=0, atol=0)


@pytest.mark.parametrize("transport", ["shm", "c10d"])
@pytest.mark.parametrize("kwargs", [{}, {"gradient_as_bucket_view": True}, {"bucket_cap_mb": 0.0005}],
                         ids=["default", "gradient_as_bucket_view", "small_buckets"])
def test_gradients_of_one_forward_from_two_backward_passes_match_torch_ddp(ranks, kwargs: dict,
                                                                           transport: str) -> None:
    ranks.run(_two_backwards, world_size=2, args=(kwargs, transport))


def _find_unused_second_backward(rank: int, world_size: int, under_no_sync: bool) -> str:
    """find_unused_parameters=True: the first backward reaches every output (through torch
    DDP's sink node) and finishes the reduction, counting the critic unused; torch DDP leaves
    the critic's gradients from the second backward unaveraged. DDPWrapper refuses that second
    backward, naming the fix; under no_sync() both backward passes accumulate, as they may."""
    ours, ref = make_pair(_ActorCritic, {"find_unused_parameters": True})
    x = torch.randn(6, 8) + rank
    logits, value = ref(x)
    logits.logsumexp(1).mean().backward(retain_graph=True)
    value.pow(2).mean().backward()
    grad = ref.module.critic[2].bias.grad
    both = [torch.zeros_like(grad) for _ in range(world_size)]
    torch.distributed.all_gather(both, grad)
    assert not torch.equal(both[0], both[1])  # torch DDP: the ranks' own gradients
    if under_no_sync:
        with ours.no_sync():
            logits, value = ours(x)
            logits.logsumexp(1).mean().backward(retain_graph=True)
            value.pow(2).mean().backward()
        return "accumulated"
    logits, value = ours(x)
    logits.logsumexp(1).mean().backward(retain_graph=True)
    with pytest.raises(RuntimeError) as info:
        value.pow(2).mean().backward()
    return str(info.value)


@pytest.mark.parametrize("under_no_sync", [False, True], ids=["reducing", "no_sync"])
def test_second_backward_through_one_forward_with_find_unused_parameters_is_refused(ranks,
                                                                                   under_no_sync: bool) -> None:
    for message in ranks.run(_find_unused_second_backward, world_size=2, args=(under_no_sync,)):
        if under_no_sync:
            assert message == "accumulated"
        else:
            assert "a second backward pass through the outputs of one forward" in message, message
            assert "find_unused_parameters=False" in message, message


def _penalty_pass_then_backward(rank: int, world_size: int, first_pass: str) -> None:
    """find_unused_parameters=True: a pass through the outputs that reaches no parameter (a
    gradient penalty's ``torch.autograd.grad`` of the input, ``backward(inputs=[x])``) finishes
    no reduction, so the loss's backward after it reduces as under torch DDP."""
    ours, ref = make_pair(_ActorCritic, {"find_unused_parameters": True})
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, ref)]
    g = torch.Generator().manual_seed(20 + rank)
    for _ in range(3):
        x = torch.randn(6, 8, generator=g)
        for model, opt in zip((ours, ref), opts):
            opt.zero_grad()
            inputs = x.clone().requires_grad_(True)
            logits, value = model(inputs)
            if first_pass == "autograd_grad":
                gx, = torch.autograd.grad(logits.sum(), inputs, create_graph=True)
                penalty = gx.pow(2).sum()
            else:
                logits.sum().backward(inputs=[inputs], retain_graph=True)
                penalty = inputs.grad.pow(2).sum()
            (logits.logsumexp(1).mean() + value.pow(2).mean() + penalty).backward()
        compare_models(ours, ref, grads=True, rtol=0, atol=0)
        for opt in opts:
            opt.step()


@pytest.mark.parametrize("first_pass", ["autograd_grad", "backward_inputs"])
def test_a_pass_that_reaches_no_parameter_leaves_the_backward_after_it_reducing(ranks, first_pass: str) -> None:
    ranks.run(_penalty_pass_then_backward, world_size=2, args=(first_pass,))


def _critic_left_out(rank: int, world_size: int) -> list[str]:
    """The critic's output never backwarded through: torch DDP's backward ends without an
    error and its next forward raises; DDPWrapper's too, with torch's sentence first."""
    ours, ref = make_pair(_ActorCritic, {})
    x = torch.randn(6, 8)
    messages = []
    for model in (ref, ours):
        logits, _ = model(x)
        logits.logsumexp(1).mean().backward()  # no error here: a later backward could bring them
        with pytest.raises(RuntimeError) as info:
            model(x)
        messages.append(str(info.value))
    return messages


def test_output_never_backwarded_is_reported_at_the_next_forward_like_torch_ddp(ranks) -> None:
    for torch_message, message in ranks.run(_critic_left_out, world_size=2):
        sentence = "Expected to have finished reduction in the prior iteration before starting a new one."
        assert sentence in torch_message, torch_message
        assert message.startswith(sentence), message
        assert "critic.0.weight, critic.0.bias, critic.2.weight, critic.2.bias" in message, message


class _WithSpare(_ActorCritic):
    """A parameter the forward never uses."""

    def __init__(self) -> None:
        super().__init__()
        self.spare = nn.Linear(8, 2)


def _every_output_reached(rank: int, world_size: int, freeze: bool) -> str:
    """Every output backwarded through (one loss of both heads) and a parameter still without a
    gradient: reported at the end of that backward, before an optimizer step. So is a parameter
    frozen after wrapping, which no later backward can bring, with an output still pending."""
    ours, _ = make_pair(_WithSpare, {})
    logits, value = ours(torch.randn(6, 8))
    if freeze:
        ours.module.spare.requires_grad_(False)
        loss = logits.logsumexp(1).mean()  # the critic's output is still to come
    else:
        loss = logits.logsumexp(1).mean() + value.pow(2).mean()
    with pytest.raises(RuntimeError) as info:
        loss.backward()
    return str(info.value)


@pytest.mark.parametrize("freeze", [False, True], ids=["unused", "frozen"])
def test_missing_gradients_are_reported_at_the_end_of_backward_when_none_can_come(ranks, freeze: bool) -> None:
    for message in ranks.run(_every_output_reached, world_size=2, args=(freeze,)):
        if freeze:
            assert "now have requires_grad=False" in message and "spare.weight, spare.bias" in message, message
            assert "critic" not in message, message  # the critic's backward is still to come
        else:
            assert "received no gradient in the last backward pass: spare.weight, spare.bias" in message, message


class _SharedTrunk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(8, 16)
        self.a = nn.Linear(16, 4)
        self.b = nn.Linear(16, 1)

    def forward(self, x):
        h = torch.tanh(self.trunk(x))
        return self.a(h), self.b(h)


def _shared_trunk(rank: int, world_size: int) -> list[str]:
    """Both backward passes reach the trunk: torch DDP and DDPWrapper refuse the second one with
    torch's sentence; DDPWrapper's names the parameter and the fix (one backward of the sum)."""
    ours, ref = make_pair(_SharedTrunk, {})
    x = torch.randn(6, 8)
    messages = []
    for model in (ref, ours):
        logits, value = model(x)
        logits.logsumexp(1).mean().backward(retain_graph=True)
        with pytest.raises(RuntimeError) as info:
            value.pow(2).mean().backward()
        messages.append(str(info.value))
    return messages


def test_shared_trunk_reached_by_two_backward_passes_is_refused_like_torch_ddp(ranks) -> None:
    for torch_message, message in ranks.run(_shared_trunk, world_size=2):
        sentence = "Expected to mark a variable ready only once."
        assert torch_message.startswith(sentence) and message.startswith(sentence), (torch_message, message)
        assert "parameter 'trunk." in message and "sum the losses" in message, message
