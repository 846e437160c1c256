"""DDPWrapper.join() against torch DDP's join(): ranks with different numbers of batches train
to the same parameters and buffers, over shared memory and over gloo, world sizes 2 and 3."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastddp

from .ddp_common import BranchNet, ThreeBranches, conv_bn, mlp
from .test_ddp_hooks import _mean_hook, torch_side_hook


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train_uneven(wrap, factory, steps: int, make_input, forward, accumulate: bool,
                  use_join_class: bool, eval_forward: bool = False,
                  divide: bool = True) -> dict[str, torch.Tensor]:
    torch.manual_seed(1234)
    model = factory()
    with torch.no_grad():  # ranks start apart: the wrappers broadcast rank 0's weights
        for p in model.parameters():
            p.add_(dist.get_rank() * 0.01)
    ddp = wrap(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    with (Join([ddp], divide_by_initial_world_size=divide) if use_join_class
          else ddp.join(divide_by_initial_world_size=divide)):
        for step in range(steps):
            x = make_input(g)
            if accumulate and step % 2 == 0:
                with ddp.no_sync():  # the next step reduces the sum of both
                    forward(ddp, x, step).float().pow(2).mean().backward()
                continue
            forward(ddp, x, step).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if eval_forward:  # answered by the joined ranks too (torch DDP's join cannot)
                with torch.no_grad():
                    ddp(x)
    return _state(ddp.module)


def _plain(model, x, step):
    return model(x)


CASES = {
    # name: (factory, make_input, forward, ddp kwargs, accumulate)
    "mlp": (mlp, lambda g: torch.randn(6, 8, generator=g), _plain, {"bucket_cap_mb": 0.001}, False),
    "mlp+no_sync": (mlp, lambda g: torch.randn(6, 8, generator=g), _plain, {}, True),
    # bf16 compression through torch's hook on both (the joined rank's zeros go through the
    # compressed wire buffers); bf16 keeps 8 mantissa bits
    "mlp+bf16": (mlp, lambda g: torch.randn(6, 8, generator=g), _plain,
                 {"hook": default_hooks.bf16_compress_hook}, False),
    # a Python hook: the joined ranks run it on zero buckets, as torch DDP's do
    "mlp+python-hook": (mlp, lambda g: torch.randn(6, 8, generator=g), _plain,
                        {"hook": _mean_hook, "bucket_cap_mb": 0.001}, False),
    # torch's allreduce_hook divides by the group size whatever join() is told (as every
    # registered hook does); DDPWrapper reduces it in C++ and must not rescale it either
    "mlp+allreduce-hook": (mlp, lambda g: torch.randn(6, 8, generator=g), _plain,
                           {"hook": default_hooks.allreduce_hook, "bucket_cap_mb": 0.001}, False),
    "conv+bn": (conv_bn, lambda g: torch.randn(4, 3, 6, 6, generator=g), _plain, {}, False),
    # `extra` is unused on ranks 0 and 2 every other step, `never` everywhere. Rank 1, the last
    # to finish, always uses `extra` (the joined ranks' used maps: test_used_parameters_while_...).
    "unused": (BranchNet, lambda g: torch.randn(6, 8, generator=g),
               lambda m, x, step: m(x, use_extra=step % 2 == 0 or dist.get_rank() == 1),
               {"find_unused_parameters": True}, False),
}


def _join_parity(rank: int, world_size: int, transport: str, case: str, steps: list[int],
                 divide: bool = True) -> str:
    os.environ["FASTDDP_SHM_ALLREDUCE"] = "1" if transport == "shm" else "0"
    factory, make_input, forward, kwargs, accumulate = CASES[case]
    kwargs = dict(kwargs)
    hook = kwargs.pop("hook", None)
    tol = {"rtol": 0, "atol": 0}  # bit for bit, at world sizes that are not a power of two too
    n = steps[rank]

    def hooked(ddp, torch_side: bool = False):
        if hook is default_hooks.bf16_compress_hook and torch_side:
            ddp.register_comm_hook(None, torch_side_hook("bf16"))
        elif hook is not None:
            ddp.register_comm_hook(None, hook)
        return ddp

    ref = _train_uneven(lambda m: hooked(TorchDDP(m, **kwargs), torch_side=True), factory, n, make_input, forward,
                        accumulate, use_join_class=False, divide=divide)
    ours_wrapper: list[fastddp.DDPWrapper] = []

    def wrap(m):
        ours_wrapper.append(hooked(fastddp.DDPWrapper(m, **kwargs)))
        return ours_wrapper[0]

    # An evaluation forward after each step changes nothing in a model without buffers.
    ours = _train_uneven(wrap, factory, n, make_input, forward, accumulate, use_join_class=True,
                         eval_forward=case == "mlp", divide=divide)
    python_hook = hook is not None and hook not in (default_hooks.bf16_compress_hook, default_hooks.allreduce_hook)
    assert ours_wrapper[0].transport == (transport if world_size > 1 and not python_hook else "c10d")
    for name, value in ref.items():
        torch.testing.assert_close(ours[name], value, msg=lambda m, name=name: f"{case} {name}: {m}", **tol)
    # every rank ends with the same model (the last joiner's)
    flat = torch.cat([v.float().flatten() for v in ours.values()])
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(gathered[0], t) for t in gathered)
    # the block leaves the join protocol off: a forward issues no extra collective
    assert not ours_wrapper[0]._join_config.enable
    return f"{case} rank {rank}: {n} steps"


@pytest.mark.parametrize("transport", ["shm", "c10d"])
@pytest.mark.parametrize("case", list(CASES))
def test_join_with_uneven_inputs_matches_torch_ddp(ranks, case: str, transport: str) -> None:
    # rank 1 has the most batches (it is the last joiner, and not rank 0)
    out = ranks.run(_join_parity, world_size=3, args=(transport, case, [2, 5, 3]))
    assert out == [f"{case} rank {r}: {n} steps" for r, n in enumerate([2, 5, 3])]


@pytest.mark.parametrize("transport", ["shm", "c10d"])
@pytest.mark.parametrize("case", ["mlp", "mlp+no_sync", "unused", "mlp+python-hook", "mlp+allreduce-hook",
                                  "mlp+bf16"])
def test_join_dividing_by_the_ranks_still_training(ranks, case: str, transport: str) -> None:
    """divide_by_initial_world_size=False: each step averages over the ranks that took part
    (a registered hook, torch's built-in ones included, divides as it sees fit, as under torch
    DDP)."""
    out = ranks.run(_join_parity, world_size=3, args=(transport, case, [2, 5, 3], False))
    assert out == [f"{case} rank {r}: {n} steps" for r, n in enumerate([2, 5, 3])]


def test_join_world_two_and_a_rank_without_data(ranks) -> None:
    out = ranks.run(_join_parity, world_size=2, args=("shm", "conv+bn", [0, 3]))
    assert out == ["conv+bn rank 0: 0 steps", "conv+bn rank 1: 3 steps"]


def test_join_world_one(ranks) -> None:
    assert ranks.run(_join_parity, world_size=1, args=("c10d", "mlp", [3])) == ["mlp rank 0: 3 steps"]


def _early_termination(rank: int, world_size: int) -> str:
    model = fastddp.DDPWrapper(mlp())
    try:
        with model.join(throw_on_early_termination=True):
            for _ in range(1 + 2 * rank):
                model(torch.randn(4, 8)).sum().backward()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_join_throw_on_early_termination(ranks) -> None:
    out = ranks.run(_early_termination, world_size=2)
    assert out[0] == "Rank 0 exhausted all inputs."
    assert "Detected at least one rank that exhausted inputs" in out[1]


def _unsupported(rank: int, world_size: int) -> str:
    model = fastddp.DDPWrapper(mlp(), static_graph=True)
    try:
        model.join()
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_join_with_static_graph_is_a_clear_error(ranks) -> None:
    msg = ranks.run(_unsupported, world_size=1)[0]
    assert "DDPWrapper.join() cannot be used with static_graph=True" in msg
    assert "find_unused_parameters=True" in msg


# Per rank, the branches each step's forward uses; a rank that ran out of steps has joined.
USE_PLANS = {
    "used-before-join": [["ab", "ab", "a", "a"], ["ab"]],
    "used-by-the-joiner": [["ab", "a", "a"], ["ac"]],
    "used-after-join": [["a", "a", "ab"], ["a"]],
    "three-ranks": [["ab", "a", "a", "a"], ["ac", "a"], ["a"]],
}


def _used_map_while_joined(rank: int, world_size: int, plan: str, set_to_none: bool) -> str:
    uses = USE_PLANS[plan][rank]
    got = []
    for cls in (TorchDDP, fastddp.DDPWrapper):
        model = cls(ThreeBranches(), find_unused_parameters=True)
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        grads = []
        with model.join():
            for step, use in enumerate(uses):
                model(torch.randn(2, 3, generator=torch.Generator().manual_seed(10 * rank + step)), use).sum().backward()
                grads.append({n: None if p.grad is None else p.grad.clone() for n, p in model.module.named_parameters()})
                opt.step()
                opt.zero_grad(set_to_none=set_to_none)
        got.append((grads, [p.detach().clone() for p in model.module.parameters()]))
    (ref_grads, ref_params), (grads, params) = got
    tol = {"rtol": 0, "atol": 0}  # bit for bit at every world size
    for step, (want, have) in enumerate(zip(ref_grads, grads)):
        for name in want:
            assert (want[name] is None) == (have[name] is None), (rank, step, name, want[name], have[name])
            if want[name] is not None:
                torch.testing.assert_close(have[name], want[name], **tol)
    for want, have in zip(ref_params, params):
        torch.testing.assert_close(have, want, **tol)
    return "".join("g" if g["b.weight"] is not None else "-" for g in grads)


@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zeroed"])
@pytest.mark.parametrize("plan", list(USE_PLANS))
def test_used_parameters_while_a_rank_is_joined_as_torch_ddp(ranks, plan: str, set_to_none: bool) -> None:
    """torch DDP's joined rank sends its reducer's used map as the last all-reduce left it: a
    parameter used on any rank then counts as used while that rank stays joined, so the ranks
    still training step it with a zero gradient instead of keeping its .grad (None here)."""
    out = ranks.run(_used_map_while_joined, world_size=len(USE_PLANS[plan]), args=(plan, set_to_none))
    if plan == "used-before-join" and set_to_none:
        assert out == ["gggg", "g"]  # b's zero gradients at steps 2 and 3


@pytest.mark.cuda
def test_nccl_world_one_join_and_compression_hook() -> None:
    """On NCCL the join protocol's collectives run on the GPU (join_device) and the bf16 hook
    rebuilds the reducer there; one rank, so the result equals torch DDP's under the same
    hook and join block."""
    from .ddp_common import nccl_world_one

    with nccl_world_one():
        torch.manual_seed(0)
        a, b = mlp().cuda(), mlp().cuda()
        b.load_state_dict(a.state_dict())
        ours = fastddp.DDPWrapper(a, device_ids=[0])
        ref = TorchDDP(b, device_ids=[0])
        for ddp in (ours, ref):
            ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
        assert ours.join_device == torch.device("cuda", 0) and ours.comm_dtype == torch.bfloat16
        for ddp in (ours, ref):
            opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
            g = torch.Generator(device="cuda").manual_seed(1)
            with ddp.join():
                for _ in range(3):
                    ddp(torch.randn(8, 8, device="cuda", generator=g)).pow(2).mean().backward()
                    opt.step()
                    opt.zero_grad()
        for p, q in zip(ours.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=2e-2, atol=2e-3)


def _with_zero(rank: int, world_size: int) -> list[float]:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    def train(wrap) -> list[torch.Tensor]:
        torch.manual_seed(0)
        ddp = wrap(mlp())
        opt = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.Adam, lr=0.01)
        g = torch.Generator().manual_seed(rank)
        with Join([ddp, opt]):  # torch's documented pattern: two Joinables, DDP first
            for _ in range(2 + 3 * rank):
                ddp(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
        return [p.detach().clone() for p in ddp.parameters()]

    ref, ours = train(TorchDDP), train(fastddp.DDPWrapper)
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p, q)
    return torch.cat([p.flatten() for p in ours]).tolist()


def test_join_together_with_zero_redundancy_optimizer(ranks) -> None:
    out = ranks.run(_with_zero, world_size=2)
    assert out[0] == out[1]  # and the ranks agree


def _joined_rank_keeps_its_grads(rank: int, world_size: int, transport: str, view: bool) -> str:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    os.environ["FASTDDP_SHM_ALLREDUCE"] = "1" if transport == "shm" else "0"

    def train(cls) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        torch.manual_seed(0)
        ddp = cls(mlp(), gradient_as_bucket_view=view)
        opt = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.SGD, lr=0.05)
        g = torch.Generator().manual_seed(70 + rank)
        with Join([ddp, opt]):
            for _ in range(2 + 2 * rank):
                opt.zero_grad()  # before the backward: the gradients outlive the step
                ddp(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
                opt.step()
        return [p.grad.clone() for p in ddp.parameters()], [p.detach().clone() for p in ddp.parameters()]

    (ref_grads, ref_params), (grads, params) = train(TorchDDP), train(fastddp.DDPWrapper)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads)), f"rank {rank}: .grad after join()"
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params)), f"rank {rank}: parameters"
    return "same"


@pytest.mark.parametrize("view", [False, True], ids=["lent", "bucket_view"])
@pytest.mark.parametrize("transport", ["shm", "c10d"])
def test_joined_rank_keeps_its_last_gradients_like_torch_ddp(ranks, transport: str, view: bool) -> None:
    """The rank that joined early stands in for the others' reductions with zeros without
    touching its .grad (torch DDP reduces separate zero tensors there): ZeRO's join hook then
    steps that rank's shard with its last gradients, as under torch DDP."""
    assert ranks.run(_joined_rank_keeps_its_grads, world_size=2, args=(transport, view)) == ["same", "same"]
