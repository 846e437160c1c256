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
    # as torch DDP: one bucket, registration order, until the rebuild
    assert before == [["c.weight", "c.bias", "b.weight", "b.bias", "a.weight", "a.bias"]], before
    assert after[0][0].startswith("c."), after  # the last layer's gradients arrive first
    return after[0]


def test_buckets_rebuilt_in_arrival_order_keep_parity(ranks) -> None:
    first = ranks.run(_rebuild, world_size=2)
    assert first[0] == first[1]  # every rank rebuilt the same buckets


def _static_checkpointed(rank: int, world_size: int, as_view: bool, set_to_none: bool) -> None:
    ours, ref = make_pair(SharedCheckpointed, {"static_graph": True, "bucket_cap_mb": 0.0003},
                      {"gradient_as_bucket_view": as_view})
    train_both(ours, ref, rand_vec, steps=4, set_to_none=set_to_none)
    assert ours.module.never.weight.grad is None
    assert len(ours.bucket_report()["buckets"]) >= 3  # rebuilt before the third step, as torch DDP


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
    """static_graph whose graph changes after the first iteration: torch DDP's RuntimeError and
    sentence; ours names the parameter."""
    for cls in (TorchDDP, fastddp.DDPWrapper):
        torch.manual_seed(0)
        branch = cls(BranchNet(), static_graph=True)
        branch(torch.randn(2, 8), use_extra=False).sum().backward()
        with pytest.raises(RuntimeError, match=r"^Your training graph has changed in this iteration") as info:
            branch(torch.randn(2, 8), use_extra=True).sum().backward()
    assert "'extra." in str(info.value) and "more gradients" in str(info.value), info.value


def _static_dropped_parameter_error(rank: int, world_size: int) -> None:
    """... and one that stops using a parameter: the next forward raises torch's sentence, and
    ours names the parameter."""
    for cls in (TorchDDP, fastddp.DDPWrapper):
        torch.manual_seed(0)
        branch = cls(BranchNet(), static_graph=True)
        branch(torch.randn(2, 8), use_extra=True).sum().backward()
        branch(torch.randn(2, 8), use_extra=False).sum().backward()
        with pytest.raises(RuntimeError, match=r"^Expected to have finished reduction in the prior iteration before "
                           r"starting a new one\. This error indicates that your training graph has changed") as info:
            branch(torch.randn(2, 8), use_extra=True)
    assert "extra.weight" in str(info.value) and "fewer gradients" in str(info.value), info.value


def _penalized(model: nn.Module, x: torch.Tensor, step: int) -> torch.Tensor:
    """A gradient penalty (WGAN-GP): the gradient of the output with respect to the input, by
    torch.autograd.grad, before the loss's backward."""
    x = x.clone().requires_grad_()
    out = model(x)
    (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    return out.mean(dim=1) + 0.1 * g.pow(2).sum(dim=1)


def _static_gradient_penalty(rank: int, world_size: int) -> None:
    """static_graph with a gradient penalty: the first iteration is settled by loss.backward(),
    not by the torch.autograd.grad before it, and every step averages as torch DDP without
    static_graph does (torch DDP with static_graph keeps rank-local gradients here)."""
    ours, ref = make_pair(mlp, {}, {"static_graph": True})
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Grad strides do not match bucket view strides")  # both warn
        train_both(ours, ref, rand_vec, steps=3, forward=_penalized)


STATIC_CASES = {
    **{f"checkpointed-view={v}-set_to_none={s}": (_static_checkpointed, (v, s))
       for v in (True, False) for s in (True, False)},
    "no_sync": (_static_no_sync, ()),
    "twice_error": (_static_twice_error, ()),
    "changed_graph_error": (_static_changed_graph_error, ()),
    "dropped_parameter_error": (_static_dropped_parameter_error, ()),
    "gradient_penalty": (_static_gradient_penalty, ()),
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
    assert dist.get_world_size(ours.process_group) == 2
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


class _LastLayersCheckpointed(nn.Module):
    """The last two layers recomputed by a reentrant checkpoint: their gradients arrive in a
    backward nested in the outer one, which ends before the first layer's gradient arrives."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(lambda t: self.c(torch.relu(self.b(t))), torch.relu(self.a(x)), use_reentrant=True)


def _reentrant_last(rank: int, world_size: int, kwargs: dict, transport: str) -> None:
    os.environ["FASTDDP_SHM_ALLREDUCE"] = "1" if transport == "shm" else "0"
    ours, ref = make_pair(_LastLayersCheckpointed, kwargs)
    if not kwargs.get("find_unused_parameters"):
        train_both(ours, ref, rand_vec)
        return
    # The graph search cannot see into a reentrant checkpoint, so its parameters are marked
    # unused and then get a gradient: torch DDP raises RuntimeError, and so does DDPWrapper.
    for m in (ref, ours):
        with pytest.raises(RuntimeError, match=r"Expected to mark a variable ready only once"):
            m(torch.randn(4, 8)).sum().backward()


@pytest.mark.parametrize("transport", ["shm", "c10d"])
@pytest.mark.parametrize("kwargs", [{}, {"gradient_as_bucket_view": True}, {"find_unused_parameters": True}],
                         ids=["default", "gradient_as_bucket_view", "find_unused_parameters"])
def test_reentrant_checkpointing_around_the_last_layers_matches_torch_ddp(ranks, kwargs: dict,
                                                                          transport: str) -> None:
    ranks.run(_reentrant_last, world_size=2, args=(kwargs, transport))


def _reentrant_missing(rank: int, world_size: int, missing_on: tuple[int, ...]) -> str:
    """A parameter left out of a backward whose last gradients came from a reentrant checkpoint
    (the outer backward brings none after it), on the ranks `missing_on`: reported when the
    next forward starts (torch DDP reports an unfinished reduction at the next forward too), on
    every rank, naming the parameters; a rank whose backward was whole is told which rank's was
    not instead of waiting for it."""
    torch.manual_seed(0)
    model = _LastLayersCheckpointed()
    ours = fastddp.DDPWrapper(model)
    x = torch.randn(4, 8)
    out = ours(x)
    if rank in missing_on:  # a backward through the checkpointed layers only
        h = torch.relu(model.a(x)).detach().requires_grad_()
        from torch.utils.checkpoint import checkpoint

        checkpoint(lambda t: model.c(torch.relu(model.b(t))), h, use_reentrant=True).sum().backward()
        with pytest.raises(RuntimeError) as info:
            ours(x)
    else:
        with pytest.raises(RuntimeError) as info:
            out.sum().backward()
    return str(info.value)


@pytest.mark.parametrize("missing_on", [(0, 1), (1,)], ids=["every_rank", "rank_1"])
def test_gradient_missing_after_a_reentrant_backward_is_reported_at_the_next_forward(
        ranks, missing_on: tuple[int, ...]) -> None:
    messages = ranks.run(_reentrant_missing, world_size=2, args=(missing_on,))
    want = ("rank 1 produced no gradient for a.weight, a.bias" if missing_on == (1,)
            else "received no gradient in the last backward pass: a.weight, a.bias")
    for message in messages:
        assert want in message, message


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


class _OneScale(nn.Module):
    """One parameter: torch DDP reduces a backward(create_graph=True) gradient for it."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.p * x).pow(2).sum()


def _create_graph(rank: int, world_size: int, transport: str) -> list[str]:
    """backward(create_graph=True): one parameter's gradient requiring grad is averaged as torch
    DDP averages it (the values; .grad keeps requiring grad); a second one in the same backward
    is torch DDP's RuntimeError, and DDPWrapper's names the parameter and the way a gradient
    penalty is written; DDPWrapper trains on afterwards (torch DDP's reducer does not)."""
    os.environ["FASTDDP_SHM_ALLREDUCE"] = "1" if transport == "shm" else "0"
    x = torch.full((3,), float(rank + 1))
    grads = []
    for cls in (TorchDDP, fastddp.DDPWrapper):
        m = cls(_OneScale())
        for _ in range(3):
            m(x).backward(create_graph=True)
        assert m.module.p.grad.requires_grad
        grads.append(m.module.p.grad.detach().clone())
    assert torch.equal(grads[0], grads[1]), grads
    ours, ref = make_pair(mlp, {})
    x = torch.randn(4, 8)
    messages = []
    for m in (ref, ours):
        with pytest.raises(RuntimeError) as info:
            m(x).pow(2).mean().backward(create_graph=True)
        messages.append(str(info.value))
    assert "in-place operation" in messages[0]
    assert "requires grad (backward(create_graph=True))" in messages[1] and "torch.autograd.grad" in messages[1]
    for m in (ref, ours):  # the reduction stopped halfway: both refuse to go on
        with pytest.raises(RuntimeError):
            m(x)
    return [messages[1].splitlines()[0]]


@pytest.mark.parametrize("transport", ["shm", "c10d"])
def test_backward_with_create_graph_as_torch_ddp(ranks, transport: str) -> None:
    ranks.run(_create_graph, world_size=2, args=(transport,))


def _grad_data_rebound(rank: int, world_size: int, transport: str) -> None:
    """gradient_as_bucket_view=True and `p.grad.data = t` between steps (a script that resets
    gradients by hand): every later backward is still reduced. .grad is its own view of the
    bucket, so the rebinding moves that handle, never the reducer's view. torch DDP reduces the
    first rebinding's gradient too (compared below); from the second on its .grad holds stale
    bucket values, so the later steps are compared with the gradient averaged by hand."""
    os.environ["FASTDDP_SHM_ALLREDUCE"] = "1" if transport == "shm" else "0"
    ours, ref = make_pair(mlp, {"gradient_as_bucket_view": True})
    plain = mlp()
    plain.load_state_dict(ours.module.state_dict())
    g = torch.Generator().manual_seed(rank)
    for step in range(4):
        x = rand_vec(g)
        for m in (ours, ref, plain):
            m(x).pow(2).mean().backward()
        for p, q in zip(plain.parameters(), ours.module.parameters()):
            dist.all_reduce(p.grad)
            torch.testing.assert_close(q.grad, p.grad / world_size, rtol=1e-6, atol=1e-7)
        if step <= 1:
            compare_models(ours, ref, rtol=0, atol=0)
        with pytest.raises(RuntimeError, match="Can't detach views in-place"):
            next(ours.module.parameters()).grad.detach_()  # still a view of the bucket, as in torch
        for m in (ours.module, ref.module, plain):
            for p in m.parameters():
                p.grad.data = torch.zeros_like(p)


@pytest.mark.parametrize("transport", ["shm", "c10d"])
def test_grad_data_rebound_with_bucket_views_is_still_reduced(ranks, transport: str) -> None:
    ranks.run(_grad_data_rebound, world_size=2, args=(transport,))


class _FailingBackward(torch.autograd.Function):
    """Identity whose backward raises while `fail` is set (an out-of-memory error inside backward)."""

    fail = False

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        if _FailingBackward.fail:
            raise RuntimeError("simulated out of memory in backward")
        return g


class _FailsMidway(nn.Module):
    """Three layers in separate buckets; backward can fail between the last two and the first."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 64), nn.Linear(64, 64), nn.Linear(64, 4)

    def forward(self, x):
        return self.c(torch.tanh(self.b(_FailingBackward.apply(torch.tanh(self.a(x))))))


def _failed_backward(rank: int, world_size: int, transport: str, fail_on: tuple[int, ...],
                     static_graph: bool = False) -> list[str]:
    """A backward that raises after some buckets were launched, caught by the script (the "skip
    the batch on out-of-memory" idiom): torch DDP raises RuntimeError at every later forward.
    DDPWrapper does the same (training on would mix the next step's gradients with the failed
    step's launched buckets), and a rank whose own backward succeeded is told which rank's did not.
    With static_graph the failure comes in the third iteration (after the rebuild)."""
    os.environ["FASTDDP_SHM_ALLREDUCE"] = "1" if transport == "shm" else "0"
    outcome = []
    # torch DDP's healthy rank would wait in its backward for the failed one until the timeout
    for name in ("torch", "ours") if len(fail_on) == world_size and not static_graph else ("ours",):
        torch.manual_seed(1)
        cls = TorchDDP if name == "torch" else fastddp.DDPWrapper
        model = cls(_FailsMidway(), bucket_cap_mb=0.01, static_graph=static_graph)
        x = torch.randn(6, 8)
        for _ in range(2 if static_graph else 1):
            model(x).sum().backward()
        _FailingBackward.fail = rank in fail_on
        try:
            model(x).sum().backward()
        except RuntimeError as e:
            outcome.append(f"{name} backward: {str(e).splitlines()[0][:200]}")
        finally:
            _FailingBackward.fail = False
        if rank not in fail_on:
            continue  # told in its backward; the failed rank refuses to go on
        for attempt in range(2):
            with pytest.raises(RuntimeError) as info:
                model(x)
            # the line that says what happened (ours follows torch's sentence with it)
            said = [ln for ln in str(info.value).splitlines() if ln.startswith("DDPWrapper")] or [str(info.value)]
            outcome.append(f"{name} forward {attempt}: {said[0][:90]}")
    return outcome


_REFUSED = "DDPWrapper: a backward pass raised before its gradients were reduced"


@pytest.mark.parametrize("transport", ["shm", "c10d"])
def test_training_on_after_a_failed_backward_is_refused_like_torch_ddp(ranks, transport: str) -> None:
    for outcome in ranks.run(_failed_backward, world_size=2, args=(transport, (0, 1))):
        torch_part, ours = outcome[:3], outcome[3:]
        assert [line.split(":")[0] for line in torch_part] == ["torch backward", "torch forward 0", "torch forward 1"]
        assert "Expected to have finished reduction" in torch_part[1]
        assert ours[0] == "ours backward: simulated out of memory in backward"
        assert all(_REFUSED in line for line in ours[1:]) and len(ours) == 3, ours


@pytest.mark.parametrize("transport", ["shm", "c10d"])
def test_a_backward_failed_on_one_rank_is_reported_on_every_rank(ranks, transport: str) -> None:
    healthy, failed = ranks.run(_failed_backward, world_size=2, args=(transport, (1,)))
    assert len(healthy) == 1 and "rank 1 produced no gradient for a.weight, a.bias" in healthy[0], healthy
    assert failed[0] == "ours backward: simulated out of memory in backward"
    assert all(_REFUSED in line for line in failed[1:]) and len(failed) == 3, failed


def _hook_failing_at_second_call(state, bucket):
    state["calls"] += 1
    if state["calls"] == 2:
        raise AssertionError("the hook failed")
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _grads_after_refused_forward(rank: int, world_size: int) -> list[list[str]]:
    """A communication hook that raises in the second backward (caught by the script), which
    then clears the gradients (``zero_grad(set_to_none=True)``) and tries the next forward:
    refused by both, and the refusal leaves .grad as the script left it (torch's forward raises
    before touching it; a refusal that wrote the failed step's buckets back into .grad would
    let a script that catches it step on them)."""
    seen = []
    for cls in (TorchDDP, fastddp.DDPWrapper):
        torch.manual_seed(0)
        model = cls(nn.Linear(4, 2))
        model.register_comm_hook({"calls": 0}, _hook_failing_at_second_call)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.ones(3, 4) * (rank + 1)
        said = []
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            try:
                model(x).sum().backward()
                said.append("ok")
            except Exception as e:
                said.append(type(e).__name__)
            said.append(str([p.grad is None for p in model.parameters()]))
        seen.append(said)
    return seen


def test_a_refused_forward_after_a_failed_backward_leaves_grad_as_the_script_left_it(ranks) -> None:
    for torch_seen, ours in ranks.run(_grads_after_refused_forward, world_size=2):
        assert torch_seen[2:] == ["AssertionError", "[False, False]", "RuntimeError", "[True, True]"], torch_seen
        assert ours == torch_seen, (torch_seen, ours)


class _SharedTrunk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2), nn.Linear(8, 3)

    def forward(self, x):
        h = self.trunk(x)
        return self.a(h), self.b(h)


def _own_error_in_backward(rank: int, world_size: int) -> list[str]:
    """One loss per head over a shared trunk, backwarded one by one: the second backward
    reaches the trunk again and raises (torch DDP too); the next forward is refused (torch DDP
    fails an internal assert there) with torch's sentence for an unfinished reduction first,
    naming the error that stopped the backward."""
    said = []
    for cls in (TorchDDP, fastddp.DDPWrapper):
        torch.manual_seed(0)
        model = cls(_SharedTrunk())
        out_a, out_b = model(torch.randn(4, 8))
        out_a.sum().backward(retain_graph=True)
        with pytest.raises(RuntimeError, match=r"^Expected to mark a variable ready only once"):
            out_b.sum().backward()
        with pytest.raises(RuntimeError) as info:
            model(torch.randn(4, 8))
        said.append(str(info.value))
    return said


def test_the_next_forward_names_the_wrappers_own_error_that_stopped_a_backward(ranks) -> None:
    for torch_said, ours in ranks.run(_own_error_in_backward, world_size=2):
        sentence = "Expected to have finished reduction in the prior iteration before starting a new one."
        assert "INTERNAL ASSERT FAILED" in torch_said and ours.startswith(sentence), (torch_said, ours)
        assert "\nDDPWrapper: a backward pass raised before its gradients were reduced (with DDPWrapper's " \
               "error: \"Expected to mark a variable ready only once. DDPWrapper: parameter 'trunk." in ours, ours


_REFUSED_STATIC = "DDPWrapper: the previous backward pass did not reduce all gradients (static_graph=True)"


@pytest.mark.parametrize("fail_on", [(1,), (0, 1)], ids=["one_rank", "both_ranks"])
def test_a_static_graph_backward_that_failed_is_reported_and_refused(ranks, fail_on) -> None:
    """static_graph: the reduction waits for every gradient the first iteration brought, so a
    backward that raised midway leaves it open; the next forward issues the rest (the healthy
    rank is told instead of waiting) and this and every later forward are refused."""
    outcomes = ranks.run(_failed_backward, world_size=2, args=("shm", fail_on, True))
    for rank, outcome in enumerate(outcomes):
        if rank not in fail_on:
            assert len(outcome) == 1 and "rank 1 produced no gradient for a.weight, a.bias" in outcome[0], outcome
            continue
        assert outcome[0] == "ours backward: simulated out of memory in backward"
        assert all(_REFUSED_STATIC in line for line in outcome[1:]) and len(outcome) == 3, outcome


class _Scaled(nn.Module):
    """d(loss)/dw = c: each rank's gradient is exactly the values it is given."""

    def __init__(self, n: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(n, dtype=dtype))

    def forward(self, c):
        return (self.w * c).sum()


def _extreme_values(rank: int, world_size: int, transport: str, dtype: torch.dtype) -> None:
    """Gradients whose sum overflows, and subnormals whose halves round: torch DDP divides each
    rank's gradient by the world size before its all-reduce, and both transports do too."""
    os.environ["FASTDDP_SHM_ALLREDUCE"] = "1" if transport == "shm" else "0"
    info = torch.finfo(dtype)
    tiny = torch.nextafter(torch.zeros((), dtype=dtype), torch.ones((), dtype=dtype))
    big = torch.tensor(info.max, dtype=dtype) * 0.9
    c = torch.stack([tiny, 3 * tiny, 5 * tiny, big, -big, torch.tensor(0.1, dtype=dtype), tiny * (rank + 2)])
    ours, ref = (cls(_Scaled(len(c), dtype)) for cls in (fastddp.DDPWrapper, TorchDDP))
    for m in (ours, ref):
        m(c).backward()
    assert torch.equal(ours.module.w.grad, ref.module.w.grad), (ours.module.w.grad, ref.module.w.grad)
    assert torch.isfinite(ours.module.w.grad).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("transport", ["shm", "c10d"])
def test_sums_that_overflow_and_subnormals_reduce_like_torch_ddp(ranks, transport: str, dtype) -> None:
    ranks.run(_extreme_values, world_size=2, args=(transport, dtype))
