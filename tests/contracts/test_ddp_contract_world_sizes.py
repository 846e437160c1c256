"""Contract: at three and four ranks, DDPWrapper's float32 and float64 gradients are torch DDP's
bit for bit, on the shared-memory transport too. torch DDP scales each gradient by 1/world in
its dtype and gloo's ring all-reduce adds the ranks' values in an order that depends on where
an element falls in the bucket (csrc/reducer/ring_order.h); the shared sum adds them in that
order, and on the c10d transport the fingerprint travels in an all-reduce of its own so that
the bucket keeps torch's length. torch's allreduce_hook divides each gradient by the world size
where the reducer multiplies it by the inverse: DDPWrapper does what was registered.
bf16/fp16: test_ddp_contract_half_buckets.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from .test_ddp_contract import bn_mlp, build_pair, differences


def wide() -> nn.Module:
    """Buckets of several MiB with sizes that do not divide evenly: gloo splits such a bucket
    into more than two segments per rank, with a short last chunk."""
    return nn.Sequential(nn.Linear(701, 1103), nn.Tanh(), nn.Linear(1103, 517), nn.Tanh(),
                         nn.Linear(517, 3))


MODELS = {"bn_mlp": (bn_mlp, 6), "wide": (wide, 701)}


def _train(rank: int, world_size: int, model: str, transport: str, dtype: torch.dtype,
           hook: bool = False, views: bool = False) -> Any:
    factory, width = MODELS[model]
    ours, ref = build_pair(lambda: factory().to(dtype), None, rank,
                           ours_kwargs={"shm_allreduce": transport == "shm"}, gradient_as_bucket_view=views)
    if hook:
        for m in (ours, ref):
            m.register_comm_hook(None, default_hooks.allreduce_hook)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ours, ref)]
    g = torch.Generator().manual_seed(100 + rank)
    found = []
    for step in range(3):
        x = (torch.randn(7, width, generator=g) + rank).to(dtype)
        rng = []
        for m in (ours, ref):  # each step from one global random state; neither may draw from it
            torch.manual_seed(step)
            m(x).pow(2).mean().backward()
            rng.append(torch.random.get_rng_state())
        found += [f"step {step}: {d}" for d in differences(ours, ref, grads=True)]
        found += [] if torch.equal(*rng) else [f"step {step}: global random state"]
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=not views)  # bucket views: the next backward adds into them
    return ours.transport, found


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("transport", ["shm", "c10d"])
@pytest.mark.parametrize("world", [3, 4])
def test_larger_worlds_reduce_as_torch_bit_for_bit(ranks, world: int, transport: str, model: str,
                                                   dtype: torch.dtype) -> None:
    results = ranks.run(_train, world_size=world, args=(model, transport, dtype))
    assert results == [(transport, [])] * world, results


@pytest.mark.parametrize("views", [False, True], ids=["copies", "bucket_views"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("transport", ["shm", "c10d"])
def test_allreduce_hook_divides_as_torch_at_three_ranks(ranks, transport: str, dtype: torch.dtype,
                                                        views: bool) -> None:
    """x / 3 and x * fl(1/3) differ in the last bit for about a third of float32 values. With
    bucket views the gradients of the later steps are summed into the buckets in place and
    divided there."""
    results = ranks.run(_train, world_size=3, args=("wide", transport, dtype, True, views))
    assert results == [(transport, [])] * 3, results
