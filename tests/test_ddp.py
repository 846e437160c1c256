"""DDPWrapper against torch's DistributedDataParallel: same gradients and parameters after
every step, on gloo ranks (world sizes 1, 2, 3), one case per test."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastddp
from fastddp.ddp import assign_buckets

from .ddp_common import (
    BranchNet,
    NoGradNet,
    TiedNet,
    compare_models,
    conv_bn,
    frozen_mlp,
    make_pair,
    mixed_mlp,
    mlp,
    nccl_world_one,
    rand_vec,
    train_both,
)


def _use_transport(transport: str, world_size: int) -> bool:
    """Selects ``transport`` for the wrappers built next: "shm" or "c10d", "+batched" for one
    multi-tensor copy per bucket, or "buckets" (a world of one through the buckets instead of
    passing gradients through). Returns whether gradients pass through (no buckets)."""
    os.environ["FASTDDP_SHM_ALLREDUCE"] = "1" if transport.startswith("shm") else "0"
    os.environ["FASTDDP_BATCH_GRAD_COPIES"] = "1" if transport.endswith("+batched") else "0"
    os.environ["FASTDDP_WORLD1_PASSTHROUGH"] = "0" if transport == "buckets" else "1"
    return world_size == 1 and transport != "buckets"


def _mlp_buckets(rank: int, world_size: int, transport: str, set_to_none: bool, as_view: bool) -> None:
    """MLP, many tiny buckets, either zero_grad style, either gradient layout."""
    passthrough = _use_transport(transport, world_size)
    ours, ref = make_pair(mlp, {"bucket_cap_mb": 0.0001}, {"gradient_as_bucket_view": as_view})
    report = ours.bucket_report()
    assert (report["passthrough"], report["batch_copies"]) == (passthrough, transport.endswith("+batched"))
    train_both(ours, ref, rand_vec, set_to_none=set_to_none)
    report = ours.bucket_report()
    assert len(report["buckets"]) >= 4
    # the report names the real device, also for a world of one (which holds no bucket memory)
    assert {b["device"] for b in report["buckets"]} == {"cpu"}
    if passthrough:  # bucket_buffers() then hands out the gradients themselves
        assert [b.data_ptr() for b in ours.bucket_buffers()] == [p.grad.data_ptr() for p in ours.parameters()]
        return
    # .grad lives in the buckets either way: bucket views with gradient_as_bucket_view, lent
    # aliases without (no copy out of the buckets), and no bucket moved (nothing held .grad)
    storages = {b.untyped_storage().data_ptr() for b in ours.bucket_buffers()}
    for name, p in ours.module.named_parameters():
        assert p.grad.untyped_storage().data_ptr() in storages, name
    assert report["relocations"] == 0


def _conv_bn_case(rank: int, world_size: int, transport: str) -> None:
    """Conv net with BatchNorm (buffers broadcast from rank 0 before each forward)."""
    _use_transport(transport, world_size)
    ours, ref = make_pair(conv_bn, {})
    train_both(ours, ref, lambda g: torch.randn(4, 3, 6, 6, generator=g), opt="adamw")


def _tied(rank: int, world_size: int, transport: str) -> None:
    _use_transport(transport, world_size)
    ours, ref = make_pair(TiedNet, {})
    train_both(ours, ref, rand_vec)
    assert len(ours.bucket_report()["param_to_bucket"]) == 3  # the tied weight once


def _frozen_case(rank: int, world_size: int, transport: str) -> None:
    _use_transport(transport, world_size)
    ours, ref = make_pair(frozen_mlp, {})
    train_both(ours, ref, rand_vec)
    assert all(p.grad is None for p in ours.module[0].parameters())


def _find_unused(rank: int, world_size: int, transport: str) -> None:
    """A branch used on some steps and ranks only; a layer never used anywhere."""
    _use_transport(transport, world_size)
    ours, ref = make_pair(BranchNet, {"find_unused_parameters": True})
    train_both(ours, ref, rand_vec, steps=4, forward=lambda m, x, step: m(x, use_extra=(step + rank) % 2 == 0))
    assert ours.module.never.weight.grad is None


def _hook_without_gradient(rank: int, world_size: int, transport: str, as_view: bool) -> None:
    """A gradient hook that fires without a gradient does not count as a use."""
    _use_transport(transport, world_size)
    ours, ref = make_pair(NoGradNet, {"find_unused_parameters": True}, {"gradient_as_bucket_view": as_view})
    train_both(ours, ref, rand_vec)
    assert ours.module.skipped.grad is None


def _mixed_dtypes(rank: int, world_size: int, transport: str) -> None:
    """Mixed fp32 / bf16 parameters: separate buckets per dtype."""
    _use_transport(transport, world_size)
    ours, ref = make_pair(mixed_mlp, {})
    train_both(ours, ref, rand_vec)
    assert {b["dtype"] for b in ours.bucket_report()["buckets"]} == {"torch.float32", "torch.bfloat16"}
    # shared memory takes the bf16 buckets too: its sum has gloo's bits at every world size
    # (test_ddp_contract_half_buckets.py)
    for b in ours.bucket_report()["buckets"]:
        assert b["transport"] == ours.transport, b


def _accumulate(ours, ref, rank: int, use_extra=None) -> None:
    """Two optimizer steps of 4 micro-batches each: 3 under no_sync, the 4th reduces the sum.
    ``use_extra(micro)``: BranchNet's branch switch per micro-batch."""
    opt_a = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
    opt_b = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        for o in (opt_a, opt_b):
            o.zero_grad()
        for micro in range(4):
            x = rand_vec(g)
            for model in (ours, ref):
                with model.no_sync() if micro < 3 else torch.enable_grad():
                    out = model(x) if use_extra is None else model(x, use_extra=use_extra(micro))
                    out.pow(2).mean().backward()
        compare_models(ours, ref)
        opt_a.step()
        opt_b.step()
    compare_models(ours, ref)


def _no_sync(rank: int, world_size: int, transport: str) -> None:
    _use_transport(transport, world_size)
    ours, ref = make_pair(mlp, {"bucket_cap_mb": 0.001})
    _accumulate(ours, ref, rank)


def _no_sync_find_unused(rank: int, world_size: int, transport: str, as_view: bool) -> None:
    """`extra` is used only in the micro-batches inside no_sync (on every rank in micro-batch
    0, on rank 0 also in micro-batch 1), never in the reducing one. Its locally accumulated
    gradient must still be averaged across ranks, as torch does."""
    _use_transport(transport, world_size)
    ours, ref = make_pair(BranchNet, {"find_unused_parameters": True}, {"gradient_as_bucket_view": as_view})
    _accumulate(ours, ref, rank, use_extra=lambda micro: micro == 0 or (micro == 1 and rank == 0))
    assert ours.module.never.weight.grad is None


def _state_dict(rank: int, world_size: int, transport: str) -> None:
    """state_dict keys equal torch DDP's, and each loads into the other."""
    _use_transport(transport, world_size)
    ours, ref = make_pair(BranchNet, {"find_unused_parameters": True})
    train_both(ours, ref, rand_vec, steps=1, forward=lambda m, x, step: m(x, use_extra=True))
    assert list(ours.state_dict()) == list(ref.state_dict())
    ref.load_state_dict(ours.state_dict())
    ours.load_state_dict(ref.state_dict())
    compare_models(ours, ref, grads=False)


def _comm_dtype(rank: int, world_size: int, transport: str, dtype: torch.dtype) -> None:
    """comm_dtype against torch DDP reducing in fp32: within the rounding of one cast.
    bf16 keeps 8 mantissa bits (2**-8 = 0.0039 per value), fp16 11 (2**-11 = 4.9e-4). The
    bit-exact comparison with torch's own compression hooks is in test_ddp_hooks.py."""
    _use_transport(transport, world_size)
    ours, ref = make_pair(mlp, {}, {"comm_dtype": dtype})
    tol = {"rtol": 2e-2, "atol": 2e-3} if dtype == torch.bfloat16 else {"rtol": 5e-3, "atol": 5e-4}
    train_both(ours, ref, rand_vec, steps=2, tol=tol)


def _autocast(rank: int, world_size: int, transport: str) -> None:
    """Under CPU autocast (bf16 matmuls, fp32 parameters and gradients)."""
    _use_transport(transport, world_size)
    ours, ref = make_pair(conv_bn, {"bucket_cap_mb": 0.001})

    def autocast_forward(model, x, step):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x)

    train_both(ours, ref, lambda g: torch.randn(4, 3, 6, 6, generator=g), forward=autocast_forward)


PARITY_CASES = {
    **{f"mlp-set_to_none={s}-view={v}": (_mlp_buckets, (s, v)) for s in (True, False) for v in (True, False)},
    "conv+bn": (_conv_bn_case, ()),
    "tied": (_tied, ()),
    "frozen": (_frozen_case, ()),
    "find_unused": (_find_unused, ()),
    **{f"hook_without_gradient-view={v}": (_hook_without_gradient, (v,)) for v in (True, False)},
    "mixed_dtypes": (_mixed_dtypes, ()),
    "no_sync": (_no_sync, ()),
    **{f"no_sync+find_unused-view={v}": (_no_sync_find_unused, (v,)) for v in (True, False)},
    "state_dict": (_state_dict, ()),
    "comm_bf16": (_comm_dtype, (torch.bfloat16,)),
    "comm_fp16": (_comm_dtype, (torch.float16,)),
    "autocast": (_autocast, ()),
}


def _parity_case(rank: int, world_size: int, transport: str, case: str) -> None:
    fn, extra = PARITY_CASES[case]
    fn(rank, world_size, transport, *extra)


@pytest.mark.parametrize("case", list(PARITY_CASES))
@pytest.mark.parametrize(("world_size", "transport"),
                         [(1, "c10d"), (1, "buckets"), (2, "shm"), (2, "c10d"), (2, "c10d+batched"),
                          (3, "shm"), (3, "c10d"), (3, "shm+batched")])
def test_parity_with_torch_ddp(ranks, world_size: int, transport: str, case: str) -> None:
    ranks.run(_parity_case, world_size=world_size, args=(transport, case))


def _error_unused(rank: int, world_size: int) -> None:
    """A parameter that gets no gradient without find_unused_parameters: named in the error."""
    torch.manual_seed(0)
    model = fastddp.DDPWrapper(BranchNet())
    with pytest.raises(RuntimeError, match=r"extra\.weight(.|\n)*find_unused_parameters=True"):
        model(torch.randn(2, 8), use_extra=False).sum().backward()


def _error_mismatch(rank: int, world_size: int) -> None:
    """Ranks with different models: the first mismatch and the ranks are named."""
    torch.manual_seed(0)
    width = 8 if rank == 0 else 9
    with pytest.raises(RuntimeError) as info:
        fastddp.DDPWrapper(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, width)))
    assert "parameter 2 ('1.weight') differs between ranks" in str(info.value), info.value
    assert "rank 1 has shape (9, 4)" in str(info.value), info.value


def _error_count(rank: int, world_size: int) -> None:
    with pytest.raises(RuntimeError, match=r"different numbers of parameters \(rank 0: 2, rank 1: 4\); parameters "
                       r"that require grad on rank 1 only: 1.bias, 1.weight"):
        fastddp.DDPWrapper(nn.Sequential(*[nn.Linear(2, 2) for _ in range(rank + 1)]))


def _error_device(rank: int, world_size: int) -> None:
    """device_ids that do not match the module."""
    with pytest.raises(ValueError) as info:
        fastddp.DDPWrapper(mlp(), device_ids=[0])
    assert "but got device_ids [0]" in str(info.value) and "module.to('cuda:0')" in str(info.value), info.value


def _error_sparse_grad(rank: int, world_size: int) -> None:
    """A sparse gradient for a parameter outside nn.Embedding/EmbeddingBag(sparse=True) (which
    torch DDP does not expect either): named in backward."""
    model = fastddp.DDPWrapper(_SparseLookup())
    with pytest.raises(RuntimeError, match="parameter 'table' got a gradient of layout Sparse"):
        model(torch.tensor([[1, 2]])).sum().backward()


def _error_frozen_after_wrapping(rank: int, world_size: int) -> None:
    """A parameter frozen after wrapping: named as such, with both ways out."""
    model = fastddp.DDPWrapper(mlp())
    model.module[0].weight.requires_grad_(False)
    with pytest.raises(RuntimeError) as info:
        model(torch.randn(2, 8)).sum().backward()
    msg = str(info.value)
    assert "now have requires_grad=False but required grad when the wrapper was built: 0.weight" in msg, msg
    assert "Freeze parameters before wrapping" in msg and "find_unused_parameters=True" in msg, msg


def _error_skipped_with_find_unused(rank: int, world_size: int) -> None:
    """find_unused_parameters=True already on, and a backward that skips a parameter the forward
    reached (a gradient penalty alone): the message says so instead of suggesting the flag; the
    wrapper is usable after the error."""
    model = fastddp.DDPWrapper(mlp(), find_unused_parameters=True)
    out = model(torch.randn(2, 8)).sum()
    grads = torch.autograd.grad(out, list(model.parameters()), create_graph=True)
    with pytest.raises(RuntimeError) as info:
        sum(g.pow(2).sum() for g in grads).backward()  # the last bias's gradient is constant
    msg = str(info.value)
    assert "received no gradient in the last backward pass: 4.bias" in msg, msg
    assert "find_unused_parameters=True is on" in msg and "gradient penalty" in msg, msg
    for p in model.parameters():
        p.grad = None
    model(torch.randn(2, 8)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


class _SparseLookup(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(10, 4))

    def forward(self, idx):
        return nn.functional.embedding(idx, self.table, sparse=True)


@pytest.mark.parametrize("case", [_error_unused, _error_mismatch, _error_count, _error_device,
                                  _error_sparse_grad, _error_frozen_after_wrapping,
                                  _error_skipped_with_find_unused], ids=lambda f: f.__name__[len("_error_"):])
def test_errors_are_clear(ranks, case) -> None:
    ranks.run(case, world_size=2)


def test_needs_process_group() -> None:
    with pytest.raises(ValueError, match="init_process_group"):  # torch DDP's type
        fastddp.DDPWrapper(mlp())


def test_bucket_assignment_order_and_caps() -> None:
    params = [torch.zeros(2**18) for _ in range(8)]  # 1 MiB each (fp32)
    assert assign_buckets(params, 2.5) == [list(range(8))]
    assert assign_buckets(params, 2.5, find_unused_parameters=True) == [[6, 7], [3, 4, 5], [0, 1, 2]]
    backward = list(reversed(range(8)))
    assert assign_buckets(params, 2.5, order=backward) == [[7, 6, 5], [4, 3, 2], [1, 0]]
    assert assign_buckets(params, order=backward) == [[7], [6, 5, 4, 3, 2, 1, 0]]
    mixed = [torch.zeros(4), torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4)]
    assert assign_buckets(mixed, 25) == [[1], [0, 2]]


@pytest.mark.cuda
@pytest.mark.parametrize("passthrough", ["1", "0"])
def test_nccl_world_one_parity_under_autocast(monkeypatch, passthrough: str) -> None:
    """World of one on NCCL, gradients passed through (the default) or through the buckets
    (FASTDDP_WORLD1_PASSTHROUGH=0: on a GPU each bucket's gradients are copied in with one
    multi-tensor copy)."""
    monkeypatch.setenv("FASTDDP_WORLD1_PASSTHROUGH", passthrough)
    with nccl_world_one():
        torch.manual_seed(0)
        a, b = mlp().cuda(), mlp().cuda()
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
    with nccl_world_one():
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


def test_env_settings_are_checked(monkeypatch) -> None:
    from fastddp.ddp.checks import env_flag

    for value, expected in (("1", True), ("off", False), ("auto", None), ("", None)):
        monkeypatch.setenv("FASTDDP_BATCH_GRAD_COPIES", value)
        assert env_flag("FASTDDP_BATCH_GRAD_COPIES") is expected
    monkeypatch.setenv("FASTDDP_WORLD1_PASSTHROUGH", "maybe")
    with pytest.raises(ValueError, match=r"FASTDDP_WORLD1_PASSTHROUGH='maybe' is not understood; set it to 1, 0"):
        env_flag("FASTDDP_WORLD1_PASSTHROUGH")
