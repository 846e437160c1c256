"""DDPWrapper.register_comm_hook with torch's default hooks, against torch DDP with the same
hook, and the errors for hooks the C++ reducer does not run."""

from __future__ import annotations

import os

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
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


def _errors(rank: int, world_size: int) -> list[str]:
    msgs = []

    def attempt(fn) -> None:
        try:
            fn()
        except (NotImplementedError, RuntimeError, ValueError) as exc:
            msgs.append(f"{type(exc).__name__}: {exc}")
        else:
            msgs.append("no error")

    model = fastddp.DDPWrapper(_mlp())
    state = powerSGD_hook.PowerSGDState(process_group=None)
    attempt(lambda: model.register_comm_hook(state, powerSGD_hook.powerSGD_hook))
    attempt(lambda: model.register_comm_hook(None, default_hooks.fp16_compress_hook))
    attempt(lambda: model.register_comm_hook(None, default_hooks.bf16_compress_hook))  # twice
    late = fastddp.DDPWrapper(_mlp())
    late(torch.randn(2, 8)).sum().backward()
    attempt(lambda: late.register_comm_hook(None, default_hooks.fp16_compress_hook))
    both = fastddp.DDPWrapper(_mlp(), comm_dtype=torch.bfloat16)
    attempt(lambda: both.register_comm_hook(None, default_hooks.fp16_compress_hook))
    other = fastddp.DDPWrapper(_mlp())
    attempt(lambda: other.register_comm_hook(object(),
                                             default_hooks.allreduce_hook))
    return msgs


def test_unsupported_or_misused_hooks_are_clear_errors() -> None:
    msgs = run_distributed(_errors, world_size=1)[0]
    assert msgs[0].startswith("NotImplementedError: DDPWrapper.register_comm_hook: powerSGD_hook is not "
                              "supported") and "comm_dtype=torch.bfloat16" in msgs[0], msgs[0]
    assert msgs[1] == "no error"
    assert msgs[2].startswith("RuntimeError: DDPWrapper.register_comm_hook can only be called once"), msgs[2]
    assert "before the first backward" in msgs[3], msgs[3]
    assert "conflicts with comm_dtype=torch.bfloat16" in msgs[4], msgs[4]
    assert "state must be None or this wrapper's process group" in msgs[5], msgs[5]
