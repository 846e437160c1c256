"""DDPWrapper.register_comm_hook against torch DDP with the same hook: torch's default hooks
(run in C++), PowerSGD and custom Python hooks (run per bucket), and the errors for misuse."""

from __future__ import annotations

import copy
import inspect
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import (
    default_hooks,
    post_localSGD_hook,
    powerSGD_hook,
)
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastddp

from .ddp_common import mlp, rand_vec, train_both

HOOKS = {"fp16": (default_hooks.fp16_compress_hook, torch.float16),
         "bf16": (default_hooks.bf16_compress_hook, torch.bfloat16),
         "allreduce": (default_hooks.allreduce_hook, None)}

# torch's compression hooks cast to the wire dtype and divide by the world size there, and so
# does DDPWrapper: fp16 and bf16 come out bit for bit torch's (at three ranks and more too:
# tests/contracts/test_ddp_contract_half_buckets.py).
EXACT = {"rtol": 0, "atol": 0}
PARITY = {"fp16": (EXACT, 3), "bf16": (EXACT, 3), "allreduce": (EXACT, 3)}


def _bf16_compress_hook(state, bucket):
    """torch's bf16_compress_hook body (the same casts in the same order), for the torch
    builds whose DDP refuses to register bf16_compress_hook itself without CUDA/NCCL."""
    return default_hooks._compress_hook(torch.bfloat16, state, bucket)


def torch_side_hook(hook: str):
    """The hook to give torch DDP for ``hook``: torch's own, or, where this torch's DDP refuses
    it on a CPU gloo group (CPU-only builds check bf16 support through CUDA/NCCL and raise
    TypeError), the same arithmetic as a plain Python hook."""
    probe = TorchDDP(mlp())
    try:
        probe.register_comm_hook(None, HOOKS[hook][0])
    except TypeError:
        if hook != "bf16":
            raise
        return _bf16_compress_hook
    return HOOKS[hook][0]


def _models(hook: str, comm_dtype_instead: bool = False):
    torch.manual_seed(1234)
    a, b = mlp(), mlp()
    b.load_state_dict(a.state_dict())
    ours = fastddp.DDPWrapper(a, comm_dtype=HOOKS[hook][1] if comm_dtype_instead else None)
    if not comm_dtype_instead:
        ours.register_comm_hook(None, HOOKS[hook][0])
    ref = TorchDDP(b)
    ref.register_comm_hook(None, torch_side_hook(hook))
    return ours, ref


def _hook_parity(rank: int, world_size: int, transport: str, hook: str) -> None:
    """The hook's arithmetic (cast to the wire dtype, divide by the world size there, sum,
    cast back) is done the same way in the same order: the results are bit for bit torch's."""
    os.environ["FASTDDP_SHM_ALLREDUCE"] = "1" if transport == "shm" else "0"
    ours, ref = _models(hook)
    assert ours.comm_dtype == HOOKS[hook][1]
    assert ours.transport == transport
    tol, steps = PARITY[hook]
    train_both(ours, ref, rand_vec, steps=steps, tol=tol)


def _comm_dtype_is_the_hook(rank: int, world_size: int, transport: str, hook: str) -> None:
    """comm_dtype=... in the constructor trains exactly as registering torch's hook does."""
    os.environ["FASTDDP_SHM_ALLREDUCE"] = "1" if transport == "shm" else "0"
    ours, ref = _models(hook)
    again, ref2 = _models(hook, comm_dtype_instead=True)
    tol, steps = PARITY[hook]
    train_both(ours, ref, rand_vec, steps=steps, tol=tol)
    train_both(again, ref2, rand_vec, steps=steps, tol=tol)
    for p, q in zip(ours.parameters(), again.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("transport", ["shm", "c10d"])
@pytest.mark.parametrize("hook", list(HOOKS))
def test_default_hooks_match_torch_ddp(ranks, hook: str, transport: str) -> None:
    ranks.run(_hook_parity, world_size=2, args=(transport, hook))


def _hook_on_another_group(rank: int, world_size: int) -> None:
    """A built-in hook whose state is another process group (here one of the same ranks) reduces
    over that group, as torch DDP's does: bit for bit torch's training."""
    group = dist.new_group(list(range(world_size)))
    torch.manual_seed(1234)
    a, b = mlp(), mlp()
    b.load_state_dict(a.state_dict())
    ours, ref = fastddp.DDPWrapper(a), TorchDDP(b)
    ours.register_comm_hook(group, default_hooks.allreduce_hook)
    ref.register_comm_hook(group, default_hooks.allreduce_hook)
    train_both(ours, ref, rand_vec, steps=3, tol=EXACT)


def test_builtin_hook_with_another_group_as_state_trains_as_torch(ranks) -> None:
    ranks.run(_hook_on_another_group, world_size=2)


@pytest.mark.parametrize("transport", ["shm", "c10d"])
@pytest.mark.parametrize("hook", ["fp16", "bf16"])
def test_comm_dtype_trains_as_the_compression_hook(ranks, hook: str, transport: str) -> None:
    ranks.run(_comm_dtype_is_the_hook, world_size=2, args=(transport, hook))


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
    a, b = mlp(), mlp()
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
    train_both(ours, ref, rand_vec, steps=6)
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
    # the same buckets as torch DDP's in every step (test_bucket_layout_is_torch_ddps)
    assert calls_ours == calls_ref, (calls_ours, calls_ref)
    return len(calls_ours)


@pytest.mark.parametrize(("hook", "world_size", "bucket_cap_mb"),
                         [("mean", 2, 25), ("mean", 3, 0.001), ("halve", 1, 25), ("halve", 2, 0.001),
                          ("powersgd", 2, 25), ("powersgd", 3, 25), ("fp16_powersgd", 2, 25),
                          ("post_localsgd", 2, 0.001), ("post_localsgd", 3, 25)])
def test_python_hooks_match_torch_ddp(ranks, hook: str, world_size: int, bucket_cap_mb: float) -> None:
    calls = ranks.run(_python_hook_parity, world_size=world_size, args=(hook, bucket_cap_mb), timeout=240)
    assert len(set(calls)) == 1 and calls[0] >= 6


class _LateHead(torch.nn.Module):
    """``head`` is registered first and used last, so gradients arrive in an order other than
    reverse registration; optional float64 and never-used parameters."""

    def __init__(self, mixed: bool = False, unused: bool = False) -> None:
        super().__init__()
        self.head = torch.nn.Linear(256, 8)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(256, 256) for _ in range(6)])
        self.last = torch.nn.Linear(256, 256, bias=False)
        self.scale = torch.nn.Parameter(torch.ones(256, dtype=torch.float64)) if mixed else None
        self.never = torch.nn.Linear(4, 4) if unused else None

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        x = self.last(x)
        if self.scale is not None:
            x = x * self.scale.float()
        return self.head(x)


def _layout_recorder(calls: list, names: dict):
    """A mean hook that records, per call, what a hook can see of its bucket: index, is_last,
    the parameters in buffer order, the buffer's length; ``None`` marks a step's end."""

    def hook(state, bucket):
        calls.append((bucket.index(), bucket.is_last(), [names[id(p)] for p in bucket.parameters()],
                      bucket.buffer().numel()))
        return _mean_hook(state, bucket)

    return hook


def _checkpointed(**_) -> torch.nn.Module:
    from .ddp_common import SharedCheckpointed

    return SharedCheckpointed()


LAYOUTS = {  # model, its arguments, wrapper arguments (1 MiB = 4 of _LateHead's 256x256 layers)
    "default": (_LateHead, {}, {}),
    "cap": (_LateHead, {}, {"bucket_cap_mb": 0.3}),
    "find_unused": (_LateHead, {}, {"find_unused_parameters": True}),
    "find_unused_cap": (_LateHead, {}, {"find_unused_parameters": True, "bucket_cap_mb": 0.3}),
    "static_graph_unused": (_LateHead, {"unused": True}, {"static_graph": True, "bucket_cap_mb": 0.3}),
    # a parameter whose gradient arrives twice: the rebuild takes its last arrival, as torch
    "static_graph_checkpointed": (_checkpointed, {}, {"static_graph": True, "bucket_cap_mb": 0.0003}),
    "mixed_dtypes": (_LateHead, {"mixed": True}, {}),
    "mixed_dtypes_cap": (_LateHead, {"mixed": True}, {"bucket_cap_mb": 0.3}),
    "cap_list": (_LateHead, {}, {"bucket_cap_mb_list": [0.2, 0.5, 1]}),
}


def _bucket_layouts(rank: int, world_size: int, case: str) -> str:
    factory, model_kwargs, ddp_kwargs = LAYOUTS[case]
    if "bucket_cap_mb_list" in ddp_kwargs and "bucket_cap_mb_list" not in inspect.signature(TorchDDP).parameters:
        return "skipped"  # this torch's DDP has no bucket_cap_mb_list
    seen = {}
    for cls in (TorchDDP, fastddp.DDPWrapper):
        torch.manual_seed(0)
        model = factory(**model_kwargs)
        width = next(model.parameters()).shape[-1]
        names = {id(p): n for n, p in model.named_parameters()}
        ddp = cls(model, **ddp_kwargs)
        calls: list = []
        ddp.register_comm_hook(None, _layout_recorder(calls, names))
        g = torch.Generator().manual_seed(rank)
        for _ in range(3):  # before the rebuild, after it (static_graph: a step later)
            ddp(torch.randn(4, width, generator=g)).sum().backward()
            calls.append(None)
        seen[cls] = calls
    assert seen[fastddp.DDPWrapper] == seen[TorchDDP], seen
    return "ok"


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_bucket_layout_is_torch_ddps(ranks, case: str) -> None:
    """A hook sees torch DDP's buckets in every step: the single bucket before the rebuild,
    the capped ones of find_unused_parameters, the rebuild in arrival order (with static_graph
    after the second step), dtypes apart, bucket_cap_mb_list, and the order inside each."""
    results = ranks.run(_bucket_layouts, world_size=2, args=(case,))
    if results[0] == "skipped":
        pytest.skip("this torch's DistributedDataParallel has no bucket_cap_mb_list")
    assert results == ["ok", "ok"]


def _python_hook_unused(rank: int, world_size: int) -> str:
    """A Python hook with find_unused_parameters (a branch used on some ranks and steps, a
    layer never used) and no_sync accumulation: the same as torch DDP with the same hook."""
    from .ddp_common import BranchNet, make_pair

    os.environ["FASTDDP_SHM_ALLREDUCE"] = "1"
    ours, ref = make_pair(BranchNet, {"find_unused_parameters": True, "bucket_cap_mb": 0.001})
    for m in (ours, ref):
        m.register_comm_hook(None, _mean_hook)
    train_both(ours, ref, rand_vec, steps=4, forward=lambda m, x, step: m(x, use_extra=(step + rank) % 2 == 0))
    assert ours.module.never.weight.grad is None
    g = torch.Generator().manual_seed(rank)
    for micro in range(3):  # two micro-batches under no_sync, the third reduces the sum
        x = rand_vec(g)
        for m in (ours, ref):
            with m.no_sync() if micro < 2 else torch.enable_grad():
                m(x, use_extra=micro == 0).pow(2).mean().backward()
    for p, q in zip(ours.parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None)
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad)
    return "ok"


def test_python_hook_with_unused_parameters_and_no_sync(ranks) -> None:
    assert ranks.run(_python_hook_unused, world_size=2) == ["ok", "ok"]


def _python_hook_static(rank: int, world_size: int) -> str:
    """static_graph with reentrant checkpointing (the first iteration hands every bucket to
    the hook at the end of backward, later ones as the buckets fill): torch DDP's results."""
    from .ddp_common import SharedCheckpointed, make_pair

    os.environ["FASTDDP_SHM_ALLREDUCE"] = "1"
    ours, ref = make_pair(SharedCheckpointed, {"static_graph": True, "bucket_cap_mb": 0.0005})
    for m in (ours, ref):
        m.register_comm_hook(None, _mean_hook)
    train_both(ours, ref, rand_vec, steps=4)
    assert ours.module.never.weight.grad is None
    return "ok"


def test_python_hook_with_static_graph(ranks) -> None:
    assert ranks.run(_python_hook_static, world_size=2) == ["ok", "ok"]


def _grad_touching_hook(state, bucket):
    """Records the .grad of every parameter of the model as the hook sees it, zeroes the
    bucket's parameters' .grad, then all-reduces the bucket's buffer (averaged)."""
    seen, params = state
    seen.append([p.grad.clone() for p in params])
    for p in bucket.parameters():
        p.grad.zero_()
    buffer = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda fut: fut.value()[0])


def _python_hook_touching_grads(rank: int, world_size: int) -> str:
    """A Python hook sees .grad as torch's does during backward, the local gradient apart from
    the bucket: what it reads is local, and zeroing it neither changes the bucket nor the
    averaged result written into .grad at the end of backward."""
    os.environ["FASTDDP_SHM_ALLREDUCE"] = "1"
    results = []
    for cls in (fastddp.DDPWrapper, TorchDDP):
        torch.manual_seed(0)
        model = cls(mlp(), bucket_cap_mb=0.0001)
        seen: list = []
        model.register_comm_hook((seen, list(model.parameters())), _grad_touching_hook)
        g = torch.Generator().manual_seed(rank)
        for _ in range(2):
            model.zero_grad(set_to_none=False)
            model(rand_vec(g)).pow(2).mean().backward()
        results.append((seen, [p.grad.clone() for p in model.parameters()], torch.random.get_rng_state()))
    (seen_o, grads_o, rng_o), (seen_r, grads_r, rng_r) = results
    assert torch.equal(rng_o, rng_r), "the global random state differs after the same steps"
    for a, b in zip(grads_o + [t for ts in seen_o for t in ts], grads_r + [t for ts in seen_r for t in ts]):
        assert torch.equal(a, b)
    return "ok"


def test_python_hook_that_reads_and_zeroes_grad(ranks) -> None:
    assert ranks.run(_python_hook_touching_grads, world_size=2) == ["ok", "ok"]


def _tripled_sum_hook(state, bucket):
    """All-reduce (sum) and triple: a hook whose effect shows in every gradient."""
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0] * 3)


def _hook_between_forward_and_backward(rank: int, world_size: int, hook_name: str) -> None:
    """A hook registered after a forward and before its backward reduces that backward, as
    under torch DDP (the wrapper's new reducer is armed as the forward armed the old one)."""
    hook = {"allreduce": default_hooks.allreduce_hook, "python": _tripled_sum_hook}[hook_name]
    torch.manual_seed(1234)
    a, b = mlp(), mlp()
    b.load_state_dict(a.state_dict())
    grads = []
    for model in (fastddp.DDPWrapper(a), TorchDDP(b)):
        x = torch.full((2, 8), float(rank + 1))
        out = model(x)
        model.register_comm_hook(None, hook)
        out.sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for ours, theirs in zip(*grads):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("hook", ["allreduce", "python"])
def test_hook_registered_between_forward_and_backward_reduces_that_backward(ranks, hook: str) -> None:
    ranks.run(_hook_between_forward_and_backward, world_size=2, args=(hook,))


def _allreduce_in_python(state, bucket):
    return default_hooks.allreduce_hook(state, bucket)


def _complex_parameters_under_hooks(rank: int, world_size: int, hook_name: str) -> None:
    """Complex parameters with compression or a Python hook, as torch DDP: the bucket goes on
    the wire, and to the hook, as its real view (twice the elements, gradients with a trailing
    2), so the imaginary parts are reduced too."""
    torch.manual_seed(7)
    a = nn.Linear(3, 2, bias=True, dtype=torch.complex64)
    b = copy.deepcopy(a)
    x = torch.randn(4, 3, dtype=torch.complex64) * (rank + 1)
    seen = []
    for module, cls in ((a, fastddp.DDPWrapper), (b, TorchDDP)):
        model = cls(module)
        hook = {"fp16": default_hooks.fp16_compress_hook, "python": _allreduce_in_python}[hook_name]
        shapes = []

        def recording(state, bucket, hook=hook, shapes=shapes):
            shapes.append((bucket.buffer().dtype, bucket.buffer().numel(),
                           [tuple(g.shape) for g in bucket.gradients()]))
            return hook(state, bucket)

        model.register_comm_hook(None, recording)
        for _ in range(2):
            model.zero_grad()
            model(x).abs().sum().backward()
        seen.append(([p.grad.clone() for p in model.parameters()], shapes))
    (ours, our_shapes), (theirs, their_shapes) = seen
    assert our_shapes == their_shapes, (our_shapes, their_shapes)
    for g, h in zip(ours, theirs):
        assert torch.equal(g, h), (g, h)
        assert h.imag.abs().sum() > 0


@pytest.mark.parametrize("hook", ["fp16", "python"])
def test_complex_parameters_under_hooks_as_torch(ranks, hook: str) -> None:
    ranks.run(_complex_parameters_under_hooks, world_size=2, args=(hook,))


def _bad_size_hook(state, bucket):
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer()[:1].clone())
    return fut


def _raising_hook(state, bucket):
    raise ValueError("boom from the hook")


# The misuses whose exception type is not torch DDP's contract: any of these, with the message.
_ERRORS = (NotImplementedError, RuntimeError, ValueError, TypeError)


def _hooked(hook, **kwargs) -> fastddp.DDPWrapper:
    model = fastddp.DDPWrapper(mlp(), **kwargs)
    model.register_comm_hook(None, hook)
    return model


def _misuse_powersgd_runs(rank: int, world_size: int) -> None:
    """PowerSGD runs through the Python hook path (not a misuse: no error)."""
    model = fastddp.DDPWrapper(mlp())
    model.register_comm_hook(powerSGD_hook.PowerSGDState(process_group=None), powerSGD_hook.powerSGD_hook)
    model(torch.randn(2, 8)).sum().backward()


def _misuse_twice(rank: int, world_size: int) -> None:
    model = _hooked(default_hooks.fp16_compress_hook)
    with pytest.raises(RuntimeError, match=r"^register_comm_hook or register_builtin_comm_hook can only be called once\. "
                       r"\(DDPWrapper: fp16_compress_hook is registered already\.\)"):
        model.register_comm_hook(None, default_hooks.allreduce_hook)


def _misuse_after_backward(rank: int, world_size: int) -> None:
    late = fastddp.DDPWrapper(mlp())
    late(torch.randn(2, 8)).sum().backward()
    with pytest.raises(_ERRORS, match="before the first backward"):
        late.register_comm_hook(None, default_hooks.fp16_compress_hook)


def _misuse_conflicting_comm_dtype(rank: int, world_size: int) -> None:
    both = fastddp.DDPWrapper(mlp(), comm_dtype=torch.bfloat16)
    with pytest.raises(_ERRORS, match=r"conflicts with comm_dtype=torch\.bfloat16"):
        both.register_comm_hook(None, default_hooks.fp16_compress_hook)


def _misuse_foreign_state(rank: int, world_size: int) -> None:
    """A built-in hook given a state that is not a process group: registered, and its backward
    fails as torch's does (the hook runs as it is, with its state)."""
    failures = []
    for cls in (TorchDDP, fastddp.DDPWrapper):
        torch.manual_seed(0)
        model = cls(mlp())
        model.register_comm_hook(object(), default_hooks.allreduce_hook)
        with pytest.raises(Exception) as info:
            model(torch.randn(2, 8)).sum().backward()
        failures.append(type(info.value))
    assert failures[0] is failures[1] is AttributeError, failures


def _misuse_not_callable(rank: int, world_size: int) -> None:
    with pytest.raises(TypeError, match=r"^Communication hook must be callable\. \(DDPWrapper\.register_comm_hook: "
                       r"got str"):
        fastddp.DDPWrapper(mlp()).register_comm_hook(None, "not a hook")


def _misuse_wrong_arity(rank: int, world_size: int) -> None:
    with pytest.raises(TypeError, match=r"^DDPWrapper\.register_comm_hook: .*<lambda> must take two "
                       r"arguments, \(state, bucket\)"):
        fastddp.DDPWrapper(mlp()).register_comm_hook(None, lambda bucket: bucket)


def _misuse_python_hook_with_comm_dtype(rank: int, world_size: int) -> None:
    model = fastddp.DDPWrapper(mlp(), comm_dtype=torch.bfloat16)
    with pytest.raises(_ERRORS, match=r"cannot be combined with comm_dtype=torch\.bfloat16"):
        model.register_comm_hook(None, _mean_hook)


def _misuse_wrong_size_future(rank: int, world_size: int) -> None:
    """A hook whose Future holds the wrong size: named in backward."""
    model = _hooked(_bad_size_hook)
    with pytest.raises(_ERRORS, match="communication hook's Future for bucket 0 holds 1 elements"):
        model(torch.randn(2, 8)).sum().backward()


def _misuse_raising_hook(rank: int, world_size: int) -> None:
    model = _hooked(_raising_hook)
    with pytest.raises(_ERRORS, match="boom from the hook"):
        model(torch.randn(2, 8)).sum().backward()


def _misuse_builtin_hook_arguments(rank: int, world_size: int) -> None:
    """_register_builtin_comm_hook as torch's: anything but a BuiltinCommHookType is its
    binding's TypeError; a second registration through it is its RuntimeError sentence."""
    for cls in (TorchDDP, fastddp.DDPWrapper):
        for wrong in ("ALLREDUCE", 1, None):
            with pytest.raises(TypeError, match=r"^_register_builtin_comm_hook\(\): incompatible function arguments"):
                cls(mlp())._register_builtin_comm_hook(wrong)
        model = cls(mlp())
        model._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
        with pytest.raises(RuntimeError, match=r"^register_builtin_comm_hook or register_comm_hook can only be "
                           r"called once\."):
            model._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)


@pytest.mark.parametrize("case", [
    _misuse_powersgd_runs, _misuse_builtin_hook_arguments, _misuse_twice, _misuse_after_backward, _misuse_conflicting_comm_dtype,
    _misuse_foreign_state, _misuse_not_callable, _misuse_wrong_arity, _misuse_python_hook_with_comm_dtype,
    _misuse_wrong_size_future, _misuse_raising_hook], ids=lambda f: f.__name__[len("_misuse_"):])
def test_misused_hooks_are_clear_errors(ranks, case) -> None:
    ranks.run(case, world_size=1)


@pytest.mark.cuda
def test_nccl_world_one_python_hook() -> None:
    """A Python hook on CUDA buckets (NCCL, one rank): its Future is a CUDA future that the
    end of backward waits on; same results as torch DDP with the same hook."""
    from .ddp_common import nccl_world_one

    with nccl_world_one():
        torch.manual_seed(0)
        a, b = mlp().cuda(), mlp().cuda()
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
