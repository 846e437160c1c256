"""DDPWrapper.register_comm_hook against torch DDP with the same hook: torch's default hooks
(run in C++), PowerSGD and custom Python hooks (run per bucket), and the errors for misuse."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import (
    default_hooks,
    post_localSGD_hook,
    powerSGD_hook,
)
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastddp

from .distributed import run_distributed
from .test_ddp import _mlp, _train, _vec

# Relative rounding of one value: 2**-8 in bf16, 2**-11 in fp16 (as in test_ddp's comm_dtype cases).
HOOKS = {"fp16": (default_hooks.fp16_compress_hook, torch.float16, {"rtol": 5e-3, "atol": 5e-4}),
         "bf16": (default_hooks.bf16_compress_hook, torch.bfloat16, {"rtol": 2e-2, "atol": 2e-3}),
         "allreduce": (default_hooks.allreduce_hook, None, {})}


def _models(hook, comm_dtype_instead: bool = False):
    torch.manual_seed(1234)
    a, b = _mlp(), _mlp()
    b.load_state_dict(a.state_dict())
    ours = fastddp.DDPWrapper(a, comm_dtype=HOOKS[hook][1] if comm_dtype_instead else None)
    if not comm_dtype_instead:
        ours.register_comm_hook(None, HOOKS[hook][0])
    ref = TorchDDP(b)
    ref.register_comm_hook(None, HOOKS[hook][0])
    return ours, ref


def _hook_parity(rank: int, world_size: int, transport: str, hook: str) -> str:
    os.environ["FASTDDP_SHM_ALLREDUCE"] = "1" if transport == "shm" else "0"
    ours, ref = _models(hook)
    assert ours.comm_dtype == HOOKS[hook][1]
    assert ours.transport == transport
    _train(ours, ref, _vec, steps=3, tol=HOOKS[hook][2])
    # the hook is exactly the constructor's comm_dtype
    again, ref2 = _models(hook, comm_dtype_instead=True)
    _train(again, ref2, _vec, steps=3, tol=HOOKS[hook][2])
    for p, q in zip(ours.parameters(), again.parameters()):
        assert torch.equal(p, q)
    return hook


@pytest.mark.parametrize("transport", ["shm", "c10d"])
@pytest.mark.parametrize("hook", list(HOOKS))
def test_default_hooks_match_torch_ddp(hook: str, transport: str) -> None:
    assert run_distributed(_hook_parity, world_size=2, args=(transport, hook)) == [hook, hook]


def _mean_hook(state, bucket):  # unannotated: torch checks annotations by identity
    """A custom hook as users write them: divide, all-reduce asynchronously, unpack the list."""
    tensor = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(tensor, async_op=True).get_future().then(lambda fut: fut.value()[0])


def _halve_hook(state, bucket):
    """No communication at all: a Future completed right away with half the bucket."""
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer() * 0.5)
    return fut


def _recording(inner, calls: list[tuple]):
    """``inner`` wrapped to record what each call saw: bucket index, is_last, parameter shapes
    (a function, not a callable object: torch DDP reads the hook's ``__name__``)."""

    def hook(state, bucket):
        grads = bucket.gradients()
        assert [g.shape for g in grads] == [p.shape for p in bucket.parameters()]
        assert sum(g.numel() for g in grads) == bucket.buffer().numel()
        calls.append((bucket.index(), bucket.is_last(), tuple(tuple(p.shape) for p in bucket.parameters())))
        return inner(state, bucket)

    return hook


PYTHON_HOOKS = {
    "mean": (lambda: None, _mean_hook),
    "halve": (lambda: None, _halve_hook),
    # compresses from step 2 on (steps 0 and 1 all-reduce plainly, as PowerSGD requires
    # around DDP's bucket rebuild after the first step)
    # One bucket only: with several, PowerSGD issues collectives from Future callbacks and
    # torch DDP on gloo hangs (checked with torch 2.14, world 3, bucket_cap_mb=0.001).
    "powersgd": (lambda: powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                                     start_powerSGD_iter=2), powerSGD_hook.powerSGD_hook),
    # torch's wrapper around another hook (fp16 on the wire); batched_powerSGD_hook is left out:
    # in torch 2.14 it fails its own shape assertion under torch DDP too
    "fp16_powersgd": (lambda: powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                                          start_powerSGD_iter=2),
                      default_hooks.fp16_compress_wrapper(powerSGD_hook.powerSGD_hook)),
    # local SGD from step 2 on: each rank then averages within a subgroup of one, i.e. not at
    # all, so the ranks' models part ways exactly as under torch DDP (the hook counts steps by
    # bucket.is_last())
    "post_localsgd": (lambda: post_localSGD_hook.PostLocalSGDState(
        process_group=None, subgroup=dist.new_subgroups(group_size=1)[0], start_localSGD_iter=2),
        post_localSGD_hook.post_localSGD_hook),
}


def _python_hook_parity(rank: int, world_size: int, hook: str, bucket_cap_mb: float) -> int:
    make_state, fn = PYTHON_HOOKS[hook]
    torch.manual_seed(1234)
    a, b = _mlp(), _mlp()
    b.load_state_dict(a.state_dict())
    ours = fastddp.DDPWrapper(a, bucket_cap_mb=bucket_cap_mb)
    ref = TorchDDP(b, bucket_cap_mb=bucket_cap_mb)
    calls_ours: list[tuple] = []
    calls_ref: list[tuple] = []
    ours.register_comm_hook(make_state(), _recording(fn, calls_ours))
    ref.register_comm_hook(make_state(), _recording(fn, calls_ref))
    # a hook replaces the shared-memory transport; a world of one still runs it
    assert ours.transport == "c10d" and ours.bucket_report()["comm_hook"] == "_recording.<locals>.hook"
    assert not ours.bucket_report()["passthrough"]
    _train(ours, ref, _vec, steps=6)
    # Every step hands each bucket over once, in index order, is_last on the last one, and
    # every parameter's gradient once.
    shapes = sorted(tuple(p.shape) for p in a.parameters())
    steps, current = [], []
    for call in calls_ours:
        current.append(call)
        if call[1]:
            steps.append(current)
            current = []
    assert len(steps) == 6 and not current
    for step in steps:
        assert [c[0] for c in step] == list(range(len(step)))
        assert sorted(s for c in step for s in c[2]) == shapes
    if bucket_cap_mb >= 1:
        # One bucket in both (torch starts with one bucket anyway): from the second step on,
        # after both rebuilt it in gradient-arrival order, each call sees what torch's does.
        assert calls_ours[1:] == calls_ref[1:], (calls_ours, calls_ref)
    return len(calls_ours)


@pytest.mark.parametrize(("hook", "world_size", "bucket_cap_mb"),
                         [("mean", 2, 25), ("mean", 3, 0.001), ("halve", 1, 25), ("halve", 2, 0.001),
                          ("powersgd", 2, 25), ("powersgd", 3, 25), ("fp16_powersgd", 2, 25),
                          ("post_localsgd", 2, 0.001), ("post_localsgd", 3, 25)])
def test_python_hooks_match_torch_ddp(hook: str, world_size: int, bucket_cap_mb: float) -> None:
    calls = run_distributed(_python_hook_parity, world_size=world_size, args=(hook, bucket_cap_mb), timeout=240)
    assert len(set(calls)) == 1 and calls[0] >= 6


def _python_hook_unused(rank: int, world_size: int) -> str:
    """A Python hook with find_unused_parameters (a branch used on some ranks and steps, a
    layer never used) and no_sync accumulation: the same as torch DDP with the same hook."""
    from .test_ddp import BranchNet, _pair

    os.environ["FASTDDP_SHM_ALLREDUCE"] = "1"
    ours, ref = _pair(BranchNet, {"find_unused_parameters": True, "bucket_cap_mb": 0.001})
    for m in (ours, ref):
        m.register_comm_hook(None, _mean_hook)
    _train(ours, ref, _vec, steps=4, forward=lambda m, x, step: m(x, use_extra=(step + rank) % 2 == 0))
    assert ours.module.never.weight.grad is None
    g = torch.Generator().manual_seed(rank)
    for micro in range(3):  # two micro-batches under no_sync, the third reduces the sum
        x = _vec(g)
        for m in (ours, ref):
            with m.no_sync() if micro < 2 else torch.enable_grad():
                m(x, use_extra=micro == 0).pow(2).mean().backward()
    for p, q in zip(ours.parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None)
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad)
    return "ok"


def test_python_hook_with_unused_parameters_and_no_sync() -> None:
    assert run_distributed(_python_hook_unused, world_size=2) == ["ok", "ok"]


def _python_hook_static(rank: int, world_size: int) -> str:
    """static_graph with reentrant checkpointing (the first iteration hands every bucket to
    the hook at the end of backward, later ones as the buckets fill): torch DDP's results."""
    from .test_ddp import _pair, _SharedCheckpointed

    os.environ["FASTDDP_SHM_ALLREDUCE"] = "1"
    ours, ref = _pair(_SharedCheckpointed, {"static_graph": True, "bucket_cap_mb": 0.0005})
    for m in (ours, ref):
        m.register_comm_hook(None, _mean_hook)
    _train(ours, ref, _vec, steps=4)
    assert ours.module.never.weight.grad is None
    return "ok"


def test_python_hook_with_static_graph() -> None:
    assert run_distributed(_python_hook_static, world_size=2) == ["ok", "ok"]


def _bad_size_hook(state, bucket):
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer()[:1].clone())
    return fut


def _raising_hook(state, bucket):
    raise ValueError("boom from the hook")


def _errors(rank: int, world_size: int) -> list[str]:
    msgs = []

    def attempt(fn) -> None:
        try:
            fn()
        except (NotImplementedError, RuntimeError, ValueError, TypeError) as exc:
            msgs.append(f"{type(exc).__name__}: {exc}")
        else:
            msgs.append("no error")

    model = fastddp.DDPWrapper(_mlp())
    state = powerSGD_hook.PowerSGDState(process_group=None)
    attempt(lambda: model.register_comm_hook(state, powerSGD_hook.powerSGD_hook))
    attempt(lambda: model.register_comm_hook(None, default_hooks.bf16_compress_hook))  # twice
    late = fastddp.DDPWrapper(_mlp())
    late(torch.randn(2, 8)).sum().backward()
    attempt(lambda: late.register_comm_hook(None, default_hooks.fp16_compress_hook))
    both = fastddp.DDPWrapper(_mlp(), comm_dtype=torch.bfloat16)
    attempt(lambda: both.register_comm_hook(None, default_hooks.fp16_compress_hook))
    other = fastddp.DDPWrapper(_mlp())
    attempt(lambda: other.register_comm_hook(object(),
                                             default_hooks.allreduce_hook))
    attempt(lambda: fastddp.DDPWrapper(_mlp()).register_comm_hook(None, "not a hook"))
    attempt(lambda: fastddp.DDPWrapper(_mlp()).register_comm_hook(None, lambda bucket: bucket))
    attempt(lambda: fastddp.DDPWrapper(_mlp(), comm_dtype=torch.bfloat16).register_comm_hook(None, _mean_hook))
    # a hook whose Future holds the wrong size, and a hook that raises: named in backward
    for bad in (_bad_size_hook, _raising_hook):
        m = fastddp.DDPWrapper(_mlp())
        m.register_comm_hook(None, bad)
        attempt(lambda m=m: m(torch.randn(2, 8)).sum().backward())
    return msgs


def test_misused_hooks_are_clear_errors() -> None:
    msgs = run_distributed(_errors, world_size=1)[0]
    assert msgs[0] == "no error"  # PowerSGD runs through the Python hook path
    assert msgs[1].startswith("RuntimeError: DDPWrapper.register_comm_hook can only be called once"), msgs[1]
    assert "before the first backward" in msgs[2], msgs[2]
    assert "conflicts with comm_dtype=torch.bfloat16" in msgs[3], msgs[3]
    assert "state must be None or this wrapper's process group" in msgs[4], msgs[4]
    assert msgs[5].startswith("TypeError: DDPWrapper.register_comm_hook: the hook must be callable"), msgs[5]
    assert msgs[6].startswith("TypeError: DDPWrapper.register_comm_hook: ") and \
        "<lambda> must take two arguments, (state, bucket)" in msgs[6], msgs[6]
    assert "cannot be combined with comm_dtype=torch.bfloat16" in msgs[7], msgs[7]
    assert "communication hook's Future for bucket 0 holds 1 elements" in msgs[8], msgs[8]
    assert "boom from the hook" in msgs[9], msgs[9]


@pytest.mark.cuda
def test_nccl_world_one_python_hook() -> None:
    """A Python hook on CUDA buckets (NCCL, one rank): its Future is a CUDA future that the
    end of backward waits on; same results as torch DDP with the same hook."""
    from .test_ddp import _nccl_world_one

    with _nccl_world_one():
        torch.manual_seed(0)
        a, b = _mlp().cuda(), _mlp().cuda()
        b.load_state_dict(a.state_dict())
        ours = fastddp.DDPWrapper(a, device_ids=[0], bucket_cap_mb=0.001)
        ref = TorchDDP(b, device_ids=[0], bucket_cap_mb=0.001)
        calls: list[tuple] = []
        ours.register_comm_hook(None, _recording(_halve_hook, calls))
        ref.register_comm_hook(None, _halve_hook)
        for ddp in (ours, ref):
            opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
            g = torch.Generator(device="cuda").manual_seed(1)
            for _ in range(3):
                ddp(torch.randn(8, 8, device="cuda", generator=g)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
        assert len([c for c in calls if c[1]]) == 3
        for p, q in zip(ours.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q)
