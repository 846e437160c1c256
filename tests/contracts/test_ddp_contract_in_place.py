"""Contract: gradients reduced in place, side by side with torch DDP in the same two gloo ranks.

On the shared-memory transport DDPWrapper reduces a large gradient (64 KiB and more) where
autograd (or the script) put it, in ``.grad`` itself, instead of copying it into its bucket slot
first; small ones still go through the bucket. What a script sees must stay torch DDP's: the
gradients and parameters bit for bit, ``.grad`` a tensor with its own memory (as torch's are),
gradients kept from earlier steps holding their values, accumulation under ``no_sync()``, and
``bucket_buffers()`` holding the gradients once asked for.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastddp

from ..ddp_common import compare_models

EXACT = {"rtol": 0, "atol": 0}


def _net() -> nn.Module:
    # 128 x 160 fp32 weights (80 KiB) are reduced in place; the biases and the 160 x 4 head go
    # through the buckets, which mix both kinds at a 0.2 MiB cap
    return nn.Sequential(nn.Linear(128, 160), nn.ReLU(), nn.Linear(160, 128), nn.ReLU(), nn.Linear(128, 160),
                         nn.ReLU(), nn.Linear(160, 4))


def _pair(**kwargs: Any) -> tuple[nn.Module, nn.Module]:
    os.environ["FASTDDP_SHM_ALLREDUCE"] = "1"
    torch.manual_seed(3)
    a, b = _net(), _net()
    b.load_state_dict(a.state_dict())
    ours, ref = (fastddp.DDPWrapper(a, bucket_cap_mb=0.2, **kwargs),
                 TorchDDP(b, bucket_cap_mb=0.2, **kwargs))
    assert ours.transport == "shm"
    return ours, ref


def _batch(g: torch.Generator) -> torch.Tensor:
    return torch.randn(6, 128, generator=g)


def _step(models: tuple, opts: tuple, x: torch.Tensor, set_to_none: bool, sync: bool = True) -> None:
    for model, opt in zip(models, opts):
        if sync:
            opt.zero_grad(set_to_none=set_to_none)
        with model.no_sync() if not sync else torch.enable_grad():
            model(x).pow(2).mean().backward()


def _trains_as_torch(rank: int, world_size: int, set_to_none: bool, accumulate: bool) -> int:
    """Gradients and parameters after every step, with zero_grad(set_to_none=...) and with a
    no_sync() micro-step before each reduced one; returns how many gradients were reduced in place
    (the large gradients whose memory is not their bucket's)."""
    ours, ref = _pair()
    opts = tuple(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ours, ref))
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(3):
        if accumulate:
            _step((ours, ref), opts, _batch(g), set_to_none, sync=False)
        _step((ours, ref), opts, _batch(g), set_to_none)
        compare_models(ours, ref, grads=True, **EXACT)
        for opt in opts:
            opt.step()
        compare_models(ours, ref, grads=False, **EXACT)
    buckets = {b.untyped_storage().data_ptr() for b in ours._reducer.bucket_buffers()}
    large = [p for p in ours.module.parameters() if p.numel() * p.element_size() >= 64 * 1024]
    return sum(p.grad.untyped_storage().data_ptr() not in buckets for p in large)


@pytest.mark.parametrize("accumulate", [False, True], ids=["step", "no_sync-then-step"])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_gradients_reduced_in_place_train_as_torch(ranks, set_to_none: bool, accumulate: bool) -> None:
    in_place = ranks.run(_trains_as_torch, world_size=2, args=(set_to_none, accumulate))
    assert in_place == [3, 3]  # the three large weights


def _kept_from_each_step(rank: int, world_size: int) -> None:
    """A .grad kept from every step (zero_grad(set_to_none=True) makes a new one each step)
    holds that step's reduced values at the end, as under torch DDP."""
    ours, ref = _pair()
    opts = tuple(torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, ref))
    g = torch.Generator().manual_seed(7 + rank)
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []
    for _ in range(3):
        _step((ours, ref), opts, _batch(g), set_to_none=True)
        kept.append((ours.module[0].weight.grad, ref.module[0].weight.grad))
        for opt in opts:
            opt.step()
    for a, b in kept:
        assert torch.equal(a, b)
    assert len({a.data_ptr() for a, _ in kept}) == 3


def test_gradients_kept_from_each_step_hold_torchs_values(ranks) -> None:
    ranks.run(_kept_from_each_step, world_size=2)


def _bucket_buffers_asked_for(rank: int, world_size: int) -> None:
    """bucket_buffers() after a backward: the buffers hold the reduced gradients (the ones
    reduced in place are brought in, .grad becomes an alias of its slot) and keep holding them
    in later steps; training stays torch's."""
    ours, ref = _pair()
    opts = tuple(torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, ref))
    g = torch.Generator().manual_seed(11 + rank)
    for step in range(3):
        _step((ours, ref), opts, _batch(g), set_to_none=True)
        if step == 0:
            assert not ours._reducer.grads_in_buckets  # the large ones were reduced in place
        buffers = ours.bucket_buffers()
        assert ours._reducer.grads_in_buckets
        flat = torch.cat([b for b in buffers])
        grads = torch.cat([p.grad.reshape(-1) for p in ours.module.parameters()])
        assert torch.equal(flat.sort().values, grads.sort().values)
        compare_models(ours, ref, grads=True, **EXACT)
        for opt in opts:
            opt.step()


def test_bucket_buffers_hold_the_gradients_once_asked_for(ranks) -> None:
    ranks.run(_bucket_buffers_asked_for, world_size=2)


def _bucket_buffers_after_zero_grad(rank: int, world_size: int) -> None:
    """bucket_buffers() asked for after zero_grad(set_to_none=True) let the reduced gradients
    go: nothing to bring in, and the next steps train as torch's with the buckets holding them."""
    ours, ref = _pair()
    opts = tuple(torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, ref))
    g = torch.Generator().manual_seed(13 + rank)
    _step((ours, ref), opts, _batch(g), set_to_none=True)
    for opt in opts:
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert len(ours.bucket_buffers()) == len(ours._reducer.bucket_buffers())
    assert all(p.grad is None for p in ours.module.parameters())
    for _ in range(2):
        _step((ours, ref), opts, _batch(g), set_to_none=True)
        assert ours._reducer.grads_in_buckets
        compare_models(ours, ref, grads=True, **EXACT)
        for opt in opts:
            opt.step()


def test_bucket_buffers_after_the_gradients_were_let_go(ranks) -> None:
    ranks.run(_bucket_buffers_after_zero_grad, world_size=2)


def _gradient_assigned_by_the_script(rank: int, world_size: int) -> None:
    """A tensor assigned to .grad stays .grad and receives the reduced result (torch copies it
    in; here the reduction writes it in place)."""
    ours, ref = _pair()
    x = _batch(torch.Generator().manual_seed(5 + rank))
    mine = torch.zeros(160, 128)
    ours.module[0].weight.grad = mine
    ref.module[0].weight.grad = torch.zeros(160, 128)
    for model in (ours, ref):
        model(x).pow(2).mean().backward()
    assert ours.module[0].weight.grad is mine
    compare_models(ours, ref, grads=True, **EXACT)


def test_gradient_assigned_by_the_script_receives_the_result(ranks) -> None:
    ranks.run(_gradient_assigned_by_the_script, world_size=2)
