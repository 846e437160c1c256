"""Models and helpers shared by the DDP test files: pairs of DDPWrapper and torch DDP built
from the same weights, trained side by side and compared after every step."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastddp
from fastddp._net import free_port


class TiedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8, bias=False)
        self.mid = nn.Linear(8, 8)
        self.out = nn.Linear(8, 8, bias=False)
        self.out.weight = self.embed.weight  # tied: counted once

    def forward(self, x):
        return self.out(torch.relu(self.mid(self.embed(x))))


class _DropGrad(torch.autograd.Function):
    """Uses `w` in forward but returns no gradient for it, so its AccumulateGrad hook fires
    with an undefined gradient."""

    @staticmethod
    def forward(ctx, x, w):
        return x + w.detach().sum() * 0

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class NoGradNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.skipped = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return _DropGrad.apply(self.body(x), self.skipped)


class BranchNet(nn.Module):
    """`extra` is used only when the input asks for it; `never` is never used."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.extra = nn.Linear(8, 8)
        self.never = nn.Linear(8, 8)

    def forward(self, x, use_extra: bool):
        h = torch.relu(self.body(x))
        return self.extra(h) if use_extra else h


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def conv_bn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.Flatten(),
                         nn.Linear(4 * 6 * 6, 5))


def frozen_mlp() -> nn.Module:
    m = mlp()
    for p in m[0].parameters():
        p.requires_grad_(False)
    return m


def mixed_mlp() -> nn.Module:
    m = mlp()
    m[2].to(torch.bfloat16)
    return CastIn(m)


class CastIn(nn.Module):
    def __init__(self, m: nn.Module) -> None:
        super().__init__()
        self.m = m

    def forward(self, x):
        h = torch.relu(self.m[0](x))
        h = torch.relu(self.m[2](h.bfloat16())).float()
        return self.m[4](h)


def make_pair(factory, ddp_kwargs: dict, ours_kwargs: dict | None = None):
    torch.manual_seed(1234)
    a = factory()
    b = factory()
    b.load_state_dict(a.state_dict())
    # Ranks start from different weights: both wrappers must broadcast rank 0's.
    with torch.no_grad():
        for p in list(a.parameters()) + list(b.parameters()):
            p.add_(dist.get_rank() * 0.01)
    ours = fastddp.DDPWrapper(a, **{**ddp_kwargs, **(ours_kwargs or {})})
    ref = TorchDDP(b, **ddp_kwargs)
    # The transport the test asked for (FASTDDP_SHM_ALLREDUCE) is the one in use.
    want = "shm" if dist.get_world_size(ours.process_group) > 1 and \
        os.environ.get("FASTDDP_SHM_ALLREDUCE", "1") == "1" else "c10d"
    assert ours.transport == want, (ours.transport, ours.bucket_report()["transport_note"])
    return ours, ref


def compare_models(ours, ref, grads: bool = True, **tol) -> None:
    """Gradients, parameters and buffers of the two wrapped modules: bit for bit, or within
    ``tol`` (rtol/atol) where the two reduce in different precisions."""
    tol = tol or {"rtol": 0, "atol": 0}
    for (name, p), q in zip(ours.module.named_parameters(), ref.module.parameters()):
        if grads:
            if q.grad is None:
                assert p.grad is None, name
            else:
                torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"{name}.grad: {m}", **tol)
        torch.testing.assert_close(p, q, msg=lambda m, name=name: f"{name}: {m}", **tol)
    for (name, x), y in zip(ours.module.named_buffers(), ref.module.buffers()):
        torch.testing.assert_close(x, y, msg=lambda m, name=name: f"buffer {name}: {m}", **tol)


def train_both(ours, ref, make_input, steps=3, opt="sgd", set_to_none=True, forward=None, tol=None) -> None:
    mk = (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)) if opt == "sgd" else (
        lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    opt_a, opt_b = mk(ours.parameters()), mk(ref.parameters())
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    for step in range(steps):
        x = make_input(g)
        for model, o in ((ours, opt_a), (ref, opt_b)):
            o.zero_grad(set_to_none=set_to_none)
            out = forward(model, x, step) if forward else model(x)
            out.float().pow(2).mean().backward()
        compare_models(ours, ref, grads=True, **(tol or {}))
        opt_a.step()
        opt_b.step()
        compare_models(ours, ref, grads=False, **(tol or {}))


def rand_vec(g, n=6):
    return torch.randn(n, 8, generator=g)


@contextlib.contextmanager
def nccl_world_one() -> Iterator[None]:
    """A one-rank NCCL process group for the GPU tests (torch.distributed's default group)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class SharedCheckpointed(nn.Module):
    """`shared` runs in two reentrant checkpoints, so its gradient arrives twice per backward
    from two nested backward passes; `never` is unused."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.shared = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)
        self.never = nn.Linear(8, 8)

    def _block(self, h):
        return torch.tanh(self.shared(h))

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = self.pre(x)
        h = checkpoint(self._block, h, use_reentrant=True)
        h = checkpoint(self._block, h, use_reentrant=True)
        return self.head(h)


class ThreeBranches(nn.Module):
    """`a` in every forward; `b` and `c` where `use` names them (the parameters a forward
    leaves unused)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, use: str) -> torch.Tensor:
        return self.a(x) + sum((getattr(self, k)(x) for k in "bc" if k in use), torch.zeros(()))
