"""DDPWrapper against torch's DistributedDataParallel: same gradients and parameters after
every step, on gloo ranks (world sizes 1, 2, 3)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastddp
from fastddp._net import free_port
from fastddp.ddp import assign_buckets

from .distributed import run_distributed


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


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def _conv_bn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.Flatten(),
                         nn.Linear(4 * 6 * 6, 5))


def _frozen() -> nn.Module:
    m = _mlp()
    for p in m[0].parameters():
        p.requires_grad_(False)
    return m


def _mixed() -> nn.Module:
    m = _mlp()
    m[2].to(torch.bfloat16)
    return _CastIn(m)


class _CastIn(nn.Module):
    def __init__(self, m: nn.Module) -> None:
        super().__init__()
        self.m = m

    def forward(self, x):
        h = torch.relu(self.m[0](x))
        h = torch.relu(self.m[2](h.bfloat16())).float()
        return self.m[4](h)


def _pair(factory, ddp_kwargs: dict, ours_kwargs: dict | None = None):
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


def _compare(ours, ref, grads: bool = True, **tol) -> None:
    for (name, p), q in zip(ours.module.named_parameters(), ref.module.parameters()):
        if grads:
            if q.grad is None:
                assert p.grad is None, name
            else:
                torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"{name}.grad: {m}", **tol)
        torch.testing.assert_close(p, q, msg=lambda m, name=name: f"{name}: {m}", **tol)
    for (name, x), y in zip(ours.module.named_buffers(), ref.module.buffers()):
        torch.testing.assert_close(x, y, msg=lambda m, name=name: f"buffer {name}: {m}", **tol)


def _train(ours, ref, make_input, steps=3, opt="sgd", set_to_none=True, forward=None, tol=None) -> None:
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
        _compare(ours, ref, grads=True, **(tol or {}))
        opt_a.step()
        opt_b.step()
        _compare(ours, ref, grads=False, **(tol or {}))


def _vec(g, n=6):
    return torch.randn(n, 8, generator=g)


def _parity_suite(rank: int, world_size: int, transport: str = "shm") -> list[str]:
    """``transport``: "shm" or "c10d", "+batched" for one multi-tensor copy per bucket, or
    "buckets" (a world of one through the buckets instead of passing gradients through)."""
    os.environ["FASTDDP_SHM_ALLREDUCE"] = "1" if transport.startswith("shm") else "0"
    os.environ["FASTDDP_BATCH_GRAD_COPIES"] = "1" if transport.endswith("+batched") else "0"
    os.environ["FASTDDP_WORLD1_PASSTHROUGH"] = "0" if transport == "buckets" else "1"
    passthrough = world_size == 1 and transport != "buckets"
    done = []
    # MLP, many tiny buckets, both zero_grad styles, both gradient layouts
    for set_to_none in (True, False):
        for as_view in (True, False):
            ours, ref = _pair(_mlp, {"bucket_cap_mb": 0.001},
                              {"gradient_as_bucket_view": as_view})
            report = ours.bucket_report()
            assert (report["passthrough"], report["batch_copies"]) == (passthrough, transport.endswith("+batched"))
            _train(ours, ref, _vec, set_to_none=set_to_none)
            assert len(ours.bucket_report()["buckets"]) >= 4
            # .grad lives in the buckets exactly when they are used and the layout asks for it
            storages = {b.untyped_storage().data_ptr() for b in ours._reducer.bucket_buffers()}
            for name, p in ours.module.named_parameters():
                in_bucket = p.grad.untyped_storage().data_ptr() in storages
                assert in_bucket == (as_view and not passthrough), (name, in_bucket)
            # a world of one holds no bucket memory; the report still names the real device
            assert all(b.is_meta for b in ours._reducer.bucket_buffers()) == passthrough
            assert {b["device"] for b in ours.bucket_report()["buckets"]} == {"cpu"}
            if passthrough:  # bucket_buffers() then hands out the gradients themselves
                assert [b.data_ptr() for b in ours.bucket_buffers()] == [p.grad.data_ptr() for p in ours.parameters()]
            done.append(f"mlp set_to_none={set_to_none} view={as_view}")
    # conv net with BatchNorm (buffers broadcast from rank 0 before each forward)
    ours, ref = _pair(_conv_bn, {})
    _train(ours, ref, lambda g: torch.randn(4, 3, 6, 6, generator=g), opt="adamw")
    done.append("conv+bn")
    # tied weights
    ours, ref = _pair(TiedNet, {})
    _train(ours, ref, _vec)
    assert len(ours.bucket_report()["param_to_bucket"]) == 3  # the tied weight once
    done.append("tied")
    # frozen layers
    ours, ref = _pair(_frozen, {})
    _train(ours, ref, _vec)
    assert all(p.grad is None for p in ours.module[0].parameters())
    done.append("frozen")
    # a branch used on some steps and ranks only; a layer never used anywhere
    ours, ref = _pair(BranchNet, {"find_unused_parameters": True})
    _train(ours, ref, _vec, steps=4,
           forward=lambda m, x, step: m(x, use_extra=(step + rank) % 2 == 0))
    assert ours.module.never.weight.grad is None
    # a gradient hook that fires without a gradient does not count as a use
    for as_view in (True, False):
        ours, ref = _pair(NoGradNet, {"find_unused_parameters": True}, {"gradient_as_bucket_view": as_view})
        _train(ours, ref, _vec)
        assert ours.module.skipped.grad is None
    done.append("find_unused")
    # mixed fp32 / bf16 parameters: separate buckets per dtype
    ours, ref = _pair(_mixed, {})
    _train(ours, ref, _vec)
    dtypes = {b["dtype"] for b in ours.bucket_report()["buckets"]}
    assert dtypes == {"torch.float32", "torch.bfloat16"}
    # shared memory takes the fp32 buckets; bf16 stays on gloo (torch DDP's rounding)
    for b in ours.bucket_report()["buckets"]:
        assert b["transport"] == ("shm" if ours.transport == "shm" and b["dtype"] == "torch.float32" else "c10d"), b
    done.append("mixed dtypes")
    # no_sync: 4 micro-batches accumulate locally, the 4th reduces the sum
    ours, ref = _pair(_mlp, {"bucket_cap_mb": 0.001})
    opt_a = torch.optim.SGD(ours.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        for o in (opt_a, opt_b):
            o.zero_grad()
        for micro in range(4):
            x = _vec(g)
            for model in (ours, ref):
                ctx = model.no_sync() if micro < 3 else torch.enable_grad()
                with ctx:
                    model(x).pow(2).mean().backward()
        _compare(ours, ref)
        opt_a.step()
        opt_b.step()
    _compare(ours, ref)
    done.append("no_sync")
    # no_sync + find_unused_parameters: `extra` is used only in the micro-batches inside no_sync
    # (on every rank in micro-batch 0, on rank 0 also in micro-batch 1), never in the reducing
    # one. Its locally accumulated gradient must still be averaged across ranks, as torch does.
    for as_view in (True, False):
        ours, ref = _pair(BranchNet, {"find_unused_parameters": True},
                          {"gradient_as_bucket_view": as_view})
        opt_a = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
        opt_b = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        g = torch.Generator().manual_seed(rank)
        for _ in range(2):
            for o in (opt_a, opt_b):
                o.zero_grad()
            for micro in range(4):
                x = _vec(g)
                use_extra = micro == 0 or (micro == 1 and rank == 0)
                for model in (ours, ref):
                    ctx = model.no_sync() if micro < 3 else torch.enable_grad()
                    with ctx:
                        model(x, use_extra=use_extra).pow(2).mean().backward()
            _compare(ours, ref)
            opt_a.step()
            opt_b.step()
        _compare(ours, ref)
        assert ours.module.never.weight.grad is None
    done.append("no_sync+find_unused")
    # state_dict keys equal torch DDP's and load both ways
    assert list(ours.state_dict()) == list(ref.state_dict())
    ref.load_state_dict(ours.state_dict())
    ours.load_state_dict(ref.state_dict())
    done.append("state_dict")
    # bf16 gradient compression: close to fp32 reduction within bf16 rounding
    ours, ref = _pair(_mlp, {}, {"comm_dtype": torch.bfloat16})
    # tolerance: bf16 keeps 8 mantissa bits (relative rounding 2**-8 = 0.0039 per value)
    _train(ours, ref, _vec, steps=2, tol={"rtol": 2e-2, "atol": 2e-3})
    done.append("comm bf16")
    # fp16 keeps 11 mantissa bits: relative rounding 2**-11 = 4.9e-4 per value
    ours, ref = _pair(_mlp, {}, {"comm_dtype": torch.float16})
    _train(ours, ref, _vec, steps=2, tol={"rtol": 5e-3, "atol": 5e-4})
    done.append("comm fp16")
    # under CPU autocast (bf16 matmuls, fp32 parameters and gradients)
    ours, ref = _pair(_conv_bn, {"bucket_cap_mb": 0.001})

    def autocast_forward(model, x, step):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x)

    _train(ours, ref, lambda g: torch.randn(4, 3, 6, 6, generator=g), forward=autocast_forward)
    done.append("autocast")
    return done


@pytest.mark.parametrize(("world_size", "transport"),
                         [(1, "c10d"), (1, "buckets"), (2, "shm"), (2, "c10d"), (2, "c10d+batched"),
                          (3, "shm"), (3, "c10d"), (3, "shm+batched")])
def test_parity_with_torch_ddp(world_size: int, transport: str) -> None:
    results = run_distributed(_parity_suite, world_size=world_size, args=(transport,), timeout=300)
    assert all(len(r) == 15 for r in results), results


def _errors(rank: int, world_size: int) -> list[str]:
    seen = []
    # a parameter that gets no gradient without find_unused_parameters: named in the error
    torch.manual_seed(0)
    model = fastddp.DDPWrapper(BranchNet())
    try:
        model(torch.randn(2, 8), use_extra=False).sum().backward()
    except RuntimeError as exc:
        assert "extra.weight" in str(exc) and "find_unused_parameters=True" in str(exc), exc
        seen.append("unused")
    # ranks with different models: the first mismatch and the ranks are named
    torch.manual_seed(0)
    width = 8 if rank == 0 else 9
    try:
        fastddp.DDPWrapper(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, width)))
    except RuntimeError as exc:
        assert "parameter 2 ('1.weight') differs between ranks" in str(exc), exc
        assert "rank 1 has shape (9, 4)" in str(exc), exc
        seen.append("mismatch")
    try:
        fastddp.DDPWrapper(nn.Sequential(*[nn.Linear(2, 2) for _ in range(rank + 1)]))
    except RuntimeError as exc:
        assert "different numbers of parameters: rank 0: 2, rank 1: 4" in str(exc), exc
        seen.append("count")
    # device_ids that do not match the module
    try:
        fastddp.DDPWrapper(_mlp(), device_ids=[0])
    except ValueError as exc:
        assert "device_ids=[0]" in str(exc) and "module.to('cuda:0')" in str(exc), exc
        seen.append("device")
    # sparse gradients: refused at construction for nn.Embedding(sparse=True) ...
    try:
        fastddp.DDPWrapper(nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Flatten(), nn.Linear(8, 2)))
    except ValueError as exc:
        assert "0 is Embedding(sparse=True)" in str(exc) and "Use sparse=False" in str(exc), exc
        seen.append("sparse module")
    # ... and named in backward when one arrives from elsewhere
    model = fastddp.DDPWrapper(_SparseLookup())
    try:
        model(torch.tensor([[1, 2]])).sum().backward()
    except RuntimeError as exc:
        assert "parameter 'table' got a gradient of layout Sparse" in str(exc), exc
        seen.append("sparse grad")
    # a parameter frozen after wrapping: named as such, with both ways out
    model = fastddp.DDPWrapper(_mlp())
    model.module[0].weight.requires_grad_(False)
    try:
        model(torch.randn(2, 8)).sum().backward()
    except RuntimeError as exc:
        assert "now have requires_grad=False but required grad when the wrapper was built: 0.weight" in str(exc), exc
        assert "Freeze parameters before wrapping" in str(exc) and "find_unused_parameters=True" in str(exc), exc
        seen.append("frozen after wrapping")
    # find_unused_parameters=True already on, and a backward that skips a parameter the forward
    # reached (a gradient penalty alone): the message says so instead of suggesting the flag
    model = fastddp.DDPWrapper(_mlp(), find_unused_parameters=True)
    out = model(torch.randn(2, 8)).sum()
    grads = torch.autograd.grad(out, list(model.parameters()), create_graph=True)
    try:
        sum(g.pow(2).sum() for g in grads).backward()  # the last bias's gradient is constant
    except RuntimeError as exc:
        assert "received no gradient in this backward pass: 4.bias" in str(exc), exc
        assert "find_unused_parameters=True is on" in str(exc) and "gradient penalty" in str(exc), exc
        seen.append("skipped with find_unused")
    # the wrapper is usable after each of those errors
    for p in model.parameters():
        p.grad = None
    model(torch.randn(2, 8)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    return seen


class _SparseLookup(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(10, 4))

    def forward(self, idx):
        return nn.functional.embedding(idx, self.table, sparse=True)


def test_errors_are_clear() -> None:
    assert run_distributed(_errors, world_size=2) == [
        ["unused", "mismatch", "count", "device", "sparse module", "sparse grad", "frozen after wrapping",
         "skipped with find_unused"]] * 2


def test_needs_process_group() -> None:
    with pytest.raises(RuntimeError, match="init_process_group"):
        fastddp.DDPWrapper(_mlp())


def test_bucket_assignment_order_and_caps() -> None:
    params = [torch.zeros(2**18) for _ in range(8)]  # 1 MiB each (fp32)
    buckets = assign_buckets(params, bucket_cap_mb=2.5)
    assert buckets == [[7], [6, 5], [4, 3], [2, 1], [0]]
    mixed = [torch.zeros(4), torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4)]
    assert sorted(map(sorted, assign_buckets(mixed, 25))) == [[0, 2], [1]]


@contextlib.contextmanager
def _nccl_world_one() -> Iterator[None]:
    """A one-rank NCCL process group for the GPU tests (torch.distributed's default group)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.cuda
@pytest.mark.parametrize("passthrough", ["1", "0"])
def test_nccl_world_one_parity_under_autocast(monkeypatch, passthrough: str) -> None:
    """World of one on NCCL, gradients passed through (the default) or through the buckets
    (FASTDDP_WORLD1_PASSTHROUGH=0: on a GPU each bucket's gradients are copied in with one
    multi-tensor copy)."""
    monkeypatch.setenv("FASTDDP_WORLD1_PASSTHROUGH", passthrough)
    with _nccl_world_one():
        torch.manual_seed(0)
        a, b = _mlp().cuda(), _mlp().cuda()
        b.load_state_dict(a.state_dict())
        ours = fastddp.DDPWrapper(a, device_ids=[0], bucket_cap_mb=0.001)
        report = ours.bucket_report()
        assert report["passthrough"] == (passthrough == "1") and report["batch_copies"], report
        assert len(report["buckets"]) >= 3
        ref = TorchDDP(b, device_ids=[0])
        opt_a = torch.optim.AdamW(ours.parameters(), lr=1e-3, fused=True)
        opt_b = torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True)
        for _ in range(3):
            x = torch.randn(16, 8, device="cuda")
            for m, o in ((ours, opt_a), (ref, opt_b)):
                o.zero_grad()
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = m(x).float().pow(2).mean()
                loss.backward()
            for p, q in zip(ours.parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, q.grad)
            opt_a.step()
            opt_b.step()
            for p, q in zip(ours.parameters(), ref.parameters()):
                torch.testing.assert_close(p, q)


@pytest.mark.cuda
def test_nccl_world_one_sync_batchnorm_parity() -> None:
    """A model converted with nn.SyncBatchNorm.convert_sync_batchnorm trains under DDPWrapper
    exactly as under torch DDP: parameters and BatchNorm running statistics equal."""
    with _nccl_world_one():
        torch.manual_seed(0)

        def make() -> nn.Module:
            return nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(
                nn.Conv1d(4, 8, 3, padding=1), nn.BatchNorm1d(8), nn.ReLU(),
                nn.Flatten(), nn.Linear(8 * 16, 3))).cuda()

        a, b = make(), make()
        b.load_state_dict(a.state_dict())
        assert any(isinstance(m, nn.SyncBatchNorm) for m in a.modules())
        ours = fastddp.DDPWrapper(a, device_ids=[0])
        ref = TorchDDP(b, device_ids=[0])
        opt_a = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
        opt_b = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        for _ in range(4):
            x = torch.randn(12, 4, 16, device="cuda")
            for m, o in ((ours, opt_a), (ref, opt_b)):
                o.zero_grad()
                m(x).pow(2).mean().backward()
                o.step()
            for (name, p), q in zip(ours.module.state_dict().items(), ref.module.state_dict().values()):
                torch.testing.assert_close(p, q, msg=name)


class _ReversedRegistration(nn.Module):
    """Registered c, b, a but used a -> b -> c: reverse registration order (a first) is the
    opposite of the order gradients arrive in (c first)."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Linear(8, 4)
        self.b = nn.Linear(8, 8)
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def _rebuild(rank: int, world_size: int) -> list[str]:
    ours, ref = _pair(_ReversedRegistration, {"bucket_cap_mb": 0.0003})
    before = [b["params"] for b in ours.bucket_report()["buckets"]]
    _train(ours, ref, _vec, steps=3)
    after = [b["params"] for b in ours.bucket_report()["buckets"]]
    assert before[0][0] == "a.bias", before  # reverse registration order
    assert after[0][0].startswith("c."), after  # the last layer's gradients arrive first
    return after[0]


def test_buckets_rebuilt_in_arrival_order_keep_parity() -> None:
    first = run_distributed(_rebuild, world_size=2)
    assert first[0] == first[1]  # every rank rebuilt the same buckets


class _SharedCheckpointed(nn.Module):
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


def _static_graph(rank: int, world_size: int) -> list[str]:
    done = []
    for as_view in (True, False):
        for set_to_none in (True, False):
            ours, ref = _pair(_SharedCheckpointed, {"static_graph": True, "bucket_cap_mb": 0.0005},
                              {"gradient_as_bucket_view": as_view})
            _train(ours, ref, _vec, steps=4, set_to_none=set_to_none)
            assert ours.module.never.weight.grad is None
            assert len(ours.bucket_report()["buckets"]) >= 3
            done.append(f"checkpointed view={as_view} set_to_none={set_to_none}")
    # static_graph with no_sync accumulation (after the first iteration: torch DDP trips an
    # internal assert when its static first iteration runs under no_sync)
    ours, ref = _pair(_mlp, {"static_graph": True, "bucket_cap_mb": 0.001})
    opt_a = torch.optim.SGD(ours.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for step in range(3):
        for o in (opt_a, opt_b):
            o.zero_grad()
        micro_batches = 1 if step == 0 else 3
        for micro in range(micro_batches):
            x = _vec(g)
            for model in (ours, ref):
                with model.no_sync() if micro < micro_batches - 1 else torch.enable_grad():
                    model(x).pow(2).mean().backward()
        _compare(ours, ref)
        opt_a.step()
        opt_b.step()
    done.append("static no_sync")
    # without static_graph, the twice-reached parameter is an error that names the fix
    torch.manual_seed(0)
    plain = fastddp.DDPWrapper(_SharedCheckpointed())
    try:
        plain(torch.randn(2, 8)).sum().backward()
    except RuntimeError as exc:
        assert "shared." in str(exc) and "static_graph=True" in str(exc), exc
        done.append("twice error")
    # static_graph whose graph changes after the first iteration: a clear error
    torch.manual_seed(0)
    branch = fastddp.DDPWrapper(BranchNet(), static_graph=True)
    branch(torch.randn(2, 8), use_extra=False).sum().backward()
    try:
        branch(torch.randn(2, 8), use_extra=True).sum().backward()
    except RuntimeError as exc:
        assert "'extra." in str(exc) and "more gradients" in str(exc), exc
        done.append("changed graph error")
    # ... and one that stops using a parameter: the next forward names it
    torch.manual_seed(0)
    branch = fastddp.DDPWrapper(BranchNet(), static_graph=True)
    branch(torch.randn(2, 8), use_extra=True).sum().backward()
    branch(torch.randn(2, 8), use_extra=False).sum().backward()
    try:
        branch(torch.randn(2, 8), use_extra=True)
    except RuntimeError as exc:
        assert "extra.weight" in str(exc) and "fewer gradients" in str(exc), exc
        done.append("dropped parameter error")
    return done


def test_static_graph_with_reentrant_checkpointing() -> None:
    results = run_distributed(_static_graph, world_size=2, timeout=300)
    assert all(len(r) == 8 for r in results), results


def _subgroup(rank: int, world_size: int) -> str:
    # Every rank creates the group; only ranks 1 and 2 train in it, so its rank 0 (whose
    # weights are broadcast) is global rank 1.
    group = dist.new_group([1, 2])
    if rank == 0:
        return "outside"
    ours, ref = _pair(_conv_bn, {"process_group": group, "bucket_cap_mb": 0.001})
    _train(ours, ref, lambda g: torch.randn(4, 3, 6, 6, generator=g))
    assert ours.world_size == 2
    return "trained"


def test_parity_in_a_process_subgroup() -> None:
    assert run_distributed(_subgroup, world_size=3) == ["outside", "trained", "trained"]


def test_env_settings_are_checked(monkeypatch) -> None:
    from fastddp.ddp import _env_flag

    for value, expected in (("1", True), ("off", False), ("auto", None), ("", None)):
        monkeypatch.setenv("FASTDDP_BATCH_GRAD_COPIES", value)
        assert _env_flag("FASTDDP_BATCH_GRAD_COPIES") is expected
    monkeypatch.setenv("FASTDDP_WORLD1_PASSTHROUGH", "maybe")
    with pytest.raises(ValueError, match=r"FASTDDP_WORLD1_PASSTHROUGH='maybe' is not understood; set it to 1, 0"):
        _env_flag("FASTDDP_WORLD1_PASSTHROUGH")


def _compiled(rank: int, world_size: int) -> list[str]:
    done = []
    for where in ("inside", "outside"):  # DDP(torch.compile(m)) and torch.compile(DDP(m))
        torch.manual_seed(0)
        a, b = _mlp(), _mlp()
        b.load_state_dict(a.state_dict())
        if where == "inside":
            ours, ref = fastddp.DDPWrapper(torch.compile(a)), TorchDDP(torch.compile(b))
            run_ours, run_ref = ours, ref
        else:
            ours, ref = fastddp.DDPWrapper(a), TorchDDP(b)
            run_ours, run_ref = torch.compile(ours), torch.compile(ref)
        opt_a = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
        opt_b = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        g = torch.Generator().manual_seed(rank)
        for _ in range(3):
            x = torch.randn(6, 8, generator=g)
            for run, opt in ((run_ours, opt_a), (run_ref, opt_b)):
                opt.zero_grad()
                run(x).pow(2).mean().backward()
            _compare(ours, ref)
            opt_a.step()
            opt_b.step()
        done.append(where)
    return done


def test_parity_under_torch_compile() -> None:
    """The C++ hooks sit on the parameters' AccumulateGrad nodes, which compiled graphs keep:
    torch.compile inside or outside the wrapper trains exactly like torch DDP."""
    assert run_distributed(_compiled, world_size=2, timeout=600) == [["inside", "outside"]] * 2


class _CheckpointedNet(nn.Module):
    """Two layers recomputed in backward by non-reentrant activation checkpointing."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(lambda t: torch.relu(self.b(torch.relu(self.a(t)))), x, use_reentrant=False)
        return self.c(h)


def _non_reentrant(rank: int, world_size: int) -> list[str]:
    done = []
    for kwargs in ({}, {"find_unused_parameters": True}, {"static_graph": True}):
        ours, ref = _pair(_CheckpointedNet, kwargs)
        _train(ours, ref, _vec)
        done.append(",".join(kwargs) or "default")
    return done


def test_non_reentrant_checkpointing_matches_torch_ddp() -> None:
    assert run_distributed(_non_reentrant, world_size=2) == [
        ["default", "find_unused_parameters", "static_graph"]] * 2


@dataclasses.dataclass
class _Output:
    logits: torch.Tensor
    extra: dict


class _DataclassNet(BranchNet):
    """BranchNet returning a dataclass: find_unused_parameters must search inside it."""

    def forward(self, x, use_extra: bool):
        return _Output(logits=super().forward(x, use_extra), extra={"aux": None})


def _dataclass_output(rank: int, world_size: int) -> str:
    ours, ref = _pair(_DataclassNet, {"find_unused_parameters": True})
    _train(ours, ref, _vec, forward=lambda m, x, step: m(x, use_extra=(step + rank) % 2 == 0).logits)
    return "ok"


def test_dataclass_outputs_with_find_unused_parameters() -> None:
    assert run_distributed(_dataclass_output, world_size=2) == ["ok", "ok"]


class _ReassignedBuffer(nn.Module):
    """Replaces its buffer in forward (rebinding the name, not writing in place)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("avg", torch.zeros(8))

    def forward(self, x):
        self.avg = self.avg * 0.5 + x.detach().mean(0)
        return self.lin(x) + self.avg


def _reassigned(rank: int, world_size: int, transport: str) -> str:
    os.environ["FASTDDP_SHM_ALLREDUCE"] = "1" if transport == "shm" else "0"
    ours, ref = _pair(_ReassignedBuffer, {})
    _train(ours, ref, _vec)  # _compare checks the buffers on every rank
    return transport


@pytest.mark.parametrize("transport", ["shm", "c10d"])
def test_buffers_replaced_in_forward_are_broadcast(transport: str) -> None:
    """Rank 0's current buffers reach the tensors the module uses now, as with torch DDP
    (the wrapper used to broadcast into the tensors it saw at construction)."""
    assert run_distributed(_reassigned, world_size=2, args=(transport,)) == [transport] * 2


class _Layouts(nn.Module):
    """Parameters whose gradients autograd lays out other than row-major: channels_last conv
    weights and a transposed (dense, non-contiguous) matrix; plus an empty parameter and an
    empty buffer (no copy may touch their null data pointers)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 4, 3)
        self.t = nn.Parameter(torch.randn(4, 8).t())
        self.empty = nn.Parameter(torch.zeros(0))
        self.register_buffer("empty_buffer", torch.zeros(0))  # broadcast before each forward
        self.head = nn.Linear(4, 3)
        self.to(memory_format=torch.channels_last)

    def forward(self, x):
        h = self.conv2(torch.relu(self.conv(x))).mean((2, 3))  # (n, 4)
        return self.head(h @ self.t.t() @ self.t) + self.empty.sum()


def _layouts(rank: int, world_size: int, transport: str) -> list[str]:
    os.environ["FASTDDP_SHM_ALLREDUCE"] = "1" if transport == "shm" else "0"
    done = []
    image = lambda g: torch.randn(2, 3, 6, 6, generator=g).to(memory_format=torch.channels_last)  # noqa: E731
    for as_view in (True, False):
        for set_to_none in (True, False):
            ours, ref = _pair(_Layouts, {"bucket_cap_mb": 0.001}, {"gradient_as_bucket_view": as_view})
            assert ours.module.conv.weight.stride() != ours.module.conv.weight.contiguous().stride()
            _train(ours, ref, image, set_to_none=set_to_none)
            for (name, p), q in zip(ours.module.named_parameters(), ref.module.parameters()):
                # autograd's layout contract, as torch DDP keeps it: .grad strides follow the parameter's
                assert p.grad.stride() == q.grad.stride() == p.stride(), (name, p.grad.stride(), q.grad.stride())
            done.append(f"view={as_view} set_to_none={set_to_none}")
    return done


@pytest.mark.parametrize("transport", ["shm", "c10d"])
def test_gradient_layout_follows_the_parameter_like_torch_ddp(transport: str) -> None:
    """channels_last and transposed parameters get gradients with their own strides (the bucket
    views take them), equal to torch DDP's in value and layout, with either gradient layout."""
    assert run_distributed(_layouts, world_size=2, args=(transport,)) == [
        [f"view={v} set_to_none={s}" for v in (True, False) for s in (True, False)]] * 2


_FUZZ_OPS = ("train", "train", "no_grad", "inference", "no_sync", "eval_toggle", "zero_none", "zero_keep", "step")


def _fuzz(rank: int, world_size: int, transport: str) -> list[str]:
    """Random sequences of what training scripts do — forward/backward, evaluation forwards
    under no_grad or inference_mode, no_sync micro-steps, train/eval switches, both zero_grad
    styles, optimizer steps — on a conv+BatchNorm model with each rank's own data: after every
    operation the outputs, gradients, parameters and buffers equal torch DDP's."""
    import random

    os.environ["FASTDDP_SHM_ALLREDUCE"] = "1" if transport == "shm" else "0"
    done = []
    for seed, find_unused in ((0, False), (1, True), (2, False), (3, True)):
        ops = random.Random(seed)  # the same sequence on every rank
        ours, ref = _pair(_conv_bn, {"find_unused_parameters": find_unused})
        opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ours, ref)]
        g = torch.Generator().manual_seed(100 + rank)
        for i in range(40):
            op = ops.choice(_FUZZ_OPS)
            x = torch.randn(4, 3, 6, 6, generator=g)
            outs = []
            for m, o in zip((ours, ref), opts):
                out = None
                if op == "train":
                    out = m(x)
                    out.pow(2).mean().backward()
                elif op == "no_sync":
                    with m.no_sync():
                        out = m(x)
                        out.pow(2).mean().backward()
                elif op in ("no_grad", "inference"):
                    with torch.no_grad() if op == "no_grad" else torch.inference_mode():
                        out = m(x)
                elif op == "eval_toggle":
                    m.train(not m.training)
                elif op == "step":
                    o.step()
                else:
                    o.zero_grad(set_to_none=op == "zero_none")
                outs.append(out)
            if outs[0] is not None:
                torch.testing.assert_close(outs[0].detach(), outs[1].detach(),
                                           msg=lambda m, i=i, op=op, s=seed: f"seed {s}, op {i} ({op}): {m}")
            _compare(ours, ref)
        done.append(f"seed {seed}")
    return done


@pytest.mark.parametrize("transport", ["shm", "c10d"])
def test_random_training_sequences_match_torch_ddp(transport: str) -> None:
    assert run_distributed(_fuzz, world_size=2, args=(transport,)) == [[f"seed {s}" for s in range(4)]] * 2
