"""DDPWrapper against torch DDP under the ways training scripts drive a model: bucket
rebuilds, static_graph and activation checkpointing, process subgroups, torch.compile,
dataclass outputs, buffers replaced in forward, non-row-major gradient layouts, and random
sequences of training operations; one case per test, on a pool of gloo ranks."""

from __future__ import annotations

import dataclasses
import os
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastddp

from .ddp_common import (
    BranchNet,
    SharedCheckpointed,
    compare_models,
    conv_bn,
    make_pair,
    mlp,
    rand_vec,
    train_both,
)


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
    ours, ref = make_pair(_ReversedRegistration, {"bucket_cap_mb": 0.0003})
    before = [b["params"] for b in ours.bucket_report()["buckets"]]
    train_both(ours, ref, rand_vec, steps=3)
    after = [b["params"] for b in ours.bucket_report()["buckets"]]
    assert before[0][0] == "a.bias", before  # reverse registration order
    assert after[0][0].startswith("c."), after  # the last layer's gradients arrive first
    return after[0]


def test_buckets_rebuilt_in_arrival_order_keep_parity(ranks) -> None:
    first = ranks.run(_rebuild, world_size=2)
    assert first[0] == first[1]  # every rank rebuilt the same buckets


def _static_checkpointed(rank: int, world_size: int, as_view: bool, set_to_none: bool) -> None:
    ours, ref = make_pair(SharedCheckpointed, {"static_graph": True, "bucket_cap_mb": 0.0005},
                      {"gradient_as_bucket_view": as_view})
    train_both(ours, ref, rand_vec, steps=4, set_to_none=set_to_none)
    assert ours.module.never.weight.grad is None
    assert len(ours.bucket_report()["buckets"]) >= 3


def _static_no_sync(rank: int, world_size: int) -> None:
    """static_graph with no_sync accumulation (after the first iteration: torch DDP trips an
    internal assert when its static first iteration runs under no_sync)."""
    ours, ref = make_pair(mlp, {"static_graph": True, "bucket_cap_mb": 0.001})
    opt_a = torch.optim.SGD(ours.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for step in range(3):
        for o in (opt_a, opt_b):
            o.zero_grad()
        micro_batches = 1 if step == 0 else 3
        for micro in range(micro_batches):
            x = rand_vec(g)
            for model in (ours, ref):
                with model.no_sync() if micro < micro_batches - 1 else torch.enable_grad():
                    model(x).pow(2).mean().backward()
        compare_models(ours, ref)
        opt_a.step()
        opt_b.step()


def _static_twice_error(rank: int, world_size: int) -> None:
    """Without static_graph, the twice-reached parameter is an error that names the fix."""
    torch.manual_seed(0)
    plain = fastddp.DDPWrapper(SharedCheckpointed())
    with pytest.raises(RuntimeError, match=r"shared\.(.|\n)*static_graph=True"):
        plain(torch.randn(2, 8)).sum().backward()


def _static_changed_graph_error(rank: int, world_size: int) -> None:
    """static_graph whose graph changes after the first iteration: a clear error."""
    torch.manual_seed(0)
    branch = fastddp.DDPWrapper(BranchNet(), static_graph=True)
    branch(torch.randn(2, 8), use_extra=False).sum().backward()
    with pytest.raises(RuntimeError, match=r"'extra\.(.|\n)*more gradients"):
        branch(torch.randn(2, 8), use_extra=True).sum().backward()


def _static_dropped_parameter_error(rank: int, world_size: int) -> None:
    """... and one that stops using a parameter: the next forward names it."""
    torch.manual_seed(0)
    branch = fastddp.DDPWrapper(BranchNet(), static_graph=True)
    branch(torch.randn(2, 8), use_extra=True).sum().backward()
    branch(torch.randn(2, 8), use_extra=False).sum().backward()
    with pytest.raises(RuntimeError) as info:
        branch(torch.randn(2, 8), use_extra=True)
    assert "extra.weight" in str(info.value) and "fewer gradients" in str(info.value), info.value


STATIC_CASES = {
    **{f"checkpointed-view={v}-set_to_none={s}": (_static_checkpointed, (v, s))
       for v in (True, False) for s in (True, False)},
    "no_sync": (_static_no_sync, ()),
    "twice_error": (_static_twice_error, ()),
    "changed_graph_error": (_static_changed_graph_error, ()),
    "dropped_parameter_error": (_static_dropped_parameter_error, ()),
}


@pytest.mark.parametrize("case", list(STATIC_CASES))
def test_static_graph_with_reentrant_checkpointing(ranks, case: str) -> None:
    fn, args = STATIC_CASES[case]
    ranks.run(fn, world_size=2, args=args)


def _subgroup(rank: int, world_size: int) -> str:
    # Every rank creates the group; only ranks 1 and 2 train in it, so its rank 0 (whose
    # weights are broadcast) is global rank 1.
    group = dist.new_group([1, 2])
    if rank == 0:
        return "outside"
    ours, ref = make_pair(conv_bn, {"process_group": group, "bucket_cap_mb": 0.001})
    train_both(ours, ref, lambda g: torch.randn(4, 3, 6, 6, generator=g))
    assert ours.world_size == 2
    return "trained"


def test_parity_in_a_process_subgroup(ranks) -> None:
    assert ranks.run(_subgroup, world_size=3) == ["outside", "trained", "trained"]


def _compiled(rank: int, world_size: int, where: str) -> None:
    """DDP(torch.compile(m)) ("inside") or torch.compile(DDP(m)) ("outside")."""
    torch.manual_seed(0)
    a, b = mlp(), mlp()
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
        compare_models(ours, ref)
        opt_a.step()
        opt_b.step()


@pytest.mark.parametrize("where", ["inside", "outside"])
def test_parity_under_torch_compile(ranks, where: str) -> None:
    """The C++ hooks sit on the parameters' AccumulateGrad nodes, which compiled graphs keep:
    torch.compile inside or outside the wrapper trains exactly like torch DDP."""
    ranks.run(_compiled, world_size=2, args=(where,), timeout=500)


class _CheckpointedNet(nn.Module):
    """Two layers recomputed in backward by non-reentrant activation checkpointing."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(lambda t: torch.relu(self.b(torch.relu(self.a(t)))), x, use_reentrant=False)
        return self.c(h)


def _non_reentrant(rank: int, world_size: int, kwargs: dict) -> None:
    ours, ref = make_pair(_CheckpointedNet, kwargs)
    train_both(ours, ref, rand_vec)


@pytest.mark.parametrize("kwargs", [{}, {"find_unused_parameters": True}, {"static_graph": True}],
                         ids=["default", "find_unused_parameters", "static_graph"])
def test_non_reentrant_checkpointing_matches_torch_ddp(ranks, kwargs: dict) -> None:
    ranks.run(_non_reentrant, world_size=2, args=(kwargs,))


@dataclasses.dataclass
class _Output:
    logits: torch.Tensor
    extra: dict


class _DataclassNet(BranchNet):
    """BranchNet returning a dataclass: find_unused_parameters must search inside it."""

    def forward(self, x, use_extra: bool):
        return _Output(logits=super().forward(x, use_extra), extra={"aux": None})


def _dataclass_output(rank: int, world_size: int) -> str:
    ours, ref = make_pair(_DataclassNet, {"find_unused_parameters": True})
    train_both(ours, ref, rand_vec, forward=lambda m, x, step: m(x, use_extra=(step + rank) % 2 == 0).logits)
    return "ok"


def test_dataclass_outputs_with_find_unused_parameters(ranks) -> None:
    assert ranks.run(_dataclass_output, world_size=2) == ["ok", "ok"]


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
    ours, ref = make_pair(_ReassignedBuffer, {})
    train_both(ours, ref, rand_vec)  # compare_models checks the buffers on every rank
    return transport


@pytest.mark.parametrize("transport", ["shm", "c10d"])
def test_buffers_replaced_in_forward_are_broadcast(ranks, transport: str) -> None:
    """Rank 0's current buffers reach the tensors the module uses now, as with torch DDP
    (the wrapper used to broadcast into the tensors it saw at construction)."""
    assert ranks.run(_reassigned, world_size=2, args=(transport,)) == [transport] * 2


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


def _layouts(rank: int, world_size: int, transport: str, as_view: bool, set_to_none: bool) -> None:
    os.environ["FASTDDP_SHM_ALLREDUCE"] = "1" if transport == "shm" else "0"
    image = lambda g: torch.randn(2, 3, 6, 6, generator=g).to(memory_format=torch.channels_last)  # noqa: E731
    ours, ref = make_pair(_Layouts, {"bucket_cap_mb": 0.001}, {"gradient_as_bucket_view": as_view})
    assert ours.module.conv.weight.stride() != ours.module.conv.weight.contiguous().stride()
    train_both(ours, ref, image, set_to_none=set_to_none)
    for (name, p), q in zip(ours.module.named_parameters(), ref.module.parameters()):
        # autograd's layout contract, as torch DDP keeps it: .grad strides follow the parameter's
        assert p.grad.stride() == q.grad.stride() == p.stride(), (name, p.grad.stride(), q.grad.stride())


@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zeroed"])
@pytest.mark.parametrize("as_view", [True, False], ids=["view", "copy"])
@pytest.mark.parametrize("transport", ["shm", "c10d"])
def test_gradient_layout_follows_the_parameter_like_torch_ddp(ranks, transport: str, as_view: bool,
                                                             set_to_none: bool) -> None:
    """channels_last and transposed parameters get gradients with their own strides (the bucket
    views take them), equal to torch DDP's in value and layout, with either gradient layout."""
    ranks.run(_layouts, world_size=2, args=(transport, as_view, set_to_none))


def _layout_changed_after_wrapping(rank: int, world_size: int) -> None:
    """``.to(memory_format=torch.channels_last)`` after wrapping: torch DDP warns that the
    gradients' strides differ from its bucket views'; DDPWrapper gives the same warning (its
    gradients are the exact average; torch's first step's are not, so values are not compared)."""
    os.environ["FASTDDP_SHM_ALLREDUCE"] = "1"
    ours, ref = make_pair(conv_bn, {})
    said = []
    torch.set_warn_always(True)  # TORCH_WARN_ONCE warns every time (the pool's processes are reused)
    try:
        for m in (ref, ours):
            m.module.to(memory_format=torch.channels_last)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                m(torch.randn(2, 3, 6, 6).to(memory_format=torch.channels_last)).sum().backward()
            said.append({str(w.message).split("\n")[0] for w in caught if "Grad strides" in str(w.message)})
    finally:
        torch.set_warn_always(False)
    assert len(said[0]) == 1 and said[0] == said[1], said


def test_layout_changed_after_wrapping_warns_like_torch_ddp(ranks) -> None:
    ranks.run(_layout_changed_after_wrapping, world_size=2)


_FUZZ_OPS = ("train", "train", "no_grad", "inference", "no_sync", "eval_toggle", "zero_none", "zero_keep", "step",
             "forward_only", "two_forwards", "sync_then_no_sync")


def _fuzz(rank: int, world_size: int, transport: str, seed: int) -> None:
    """A random sequence of what training scripts do — forward/backward, evaluation forwards
    under no_grad or inference_mode, no_sync micro-steps, train/eval switches, both zero_grad
    styles, optimizer steps, a forward whose loss is skipped, two forwards into one backward
    (a GAN's discriminator; in eval mode BatchNorm saves its buffers for backward, which the
    buffer broadcast before the second forward must leave usable), a reducing forward and a
    no_sync() one into one backward — on a conv+BatchNorm model with each rank's own data:
    after every operation the outputs, gradients, parameters and buffers equal torch DDP's."""
    import random

    os.environ["FASTDDP_SHM_ALLREDUCE"] = "1" if transport == "shm" else "0"
    ops = random.Random(seed)  # the same sequence on every rank
    ours, ref = make_pair(conv_bn, {"find_unused_parameters": seed % 2 == 1})
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ours, ref)]
    g = torch.Generator().manual_seed(100 + rank)
    for i in range(40):
        op = ops.choice(_FUZZ_OPS)
        x = torch.randn(4, 3, 6, 6, generator=g)
        outs = [_fuzz_op(m, o, op, x) for m, o in zip((ours, ref), opts)]
        if outs[0] is not None:
            torch.testing.assert_close(outs[0].detach(), outs[1].detach(),
                                       msg=lambda m, i=i, op=op: f"seed {seed}, op {i} ({op}): {m}")
        compare_models(ours, ref)


def _fuzz_op(m, o, op: str, x):
    out = None
    if op == "train":
        out = m(x)
        out.pow(2).mean().backward()
    elif op == "forward_only":  # a skipped loss: the next backward, even under no_sync, reduces
        out = m(x)
    elif op == "two_forwards":
        out = m(x)
        (out.pow(2).mean() + m(x.flip(0)).pow(2).mean()).backward()
    elif op == "sync_then_no_sync":  # the reducing forward's reduction stays pending
        out = m(x)
        with m.no_sync():
            other = m(x.flip(0))
        (out.pow(2).mean() + other.pow(2).mean()).backward()
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
    return out


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("transport", ["shm", "c10d"])
def test_random_training_sequences_match_torch_ddp(ranks, transport: str, seed: int) -> None:
    ranks.run(_fuzz, world_size=2, args=(transport, seed))


def _create_graph(rank: int, world_size: int, transport: str) -> list[str]:
    """backward(create_graph=True): torch DDP raises RuntimeError in that backward; so does
    DDPWrapper, naming the parameter and the way a gradient penalty is written, and it trains
    on afterwards (torch DDP's reducer does not)."""
    os.environ["FASTDDP_SHM_ALLREDUCE"] = "1" if transport == "shm" else "0"
    ours, ref = make_pair(mlp, {})
    x = torch.randn(4, 8)
    messages = []
    for m in (ref, ours):
        with pytest.raises(RuntimeError) as info:
            m(x).pow(2).mean().backward(create_graph=True)
        messages.append(str(info.value))
    assert "in-place operation" in messages[0]
    assert "requires grad (backward(create_graph=True))" in messages[1] and "torch.autograd.grad" in messages[1]
    ours.zero_grad(set_to_none=True)
    ours(x).pow(2).mean().backward()
    grads = torch.cat([p.grad.flatten() for p in ours.parameters()])
    gathered = [torch.empty_like(grads) for _ in range(world_size)]
    dist.all_gather(gathered, grads)
    assert torch.equal(gathered[0], gathered[1])
    return [messages[1].splitlines()[0]]


@pytest.mark.parametrize("transport", ["shm", "c10d"])
def test_backward_with_create_graph_is_refused_like_torch_ddp(ranks, transport: str) -> None:
    ranks.run(_create_graph, world_size=2, args=(transport,))
