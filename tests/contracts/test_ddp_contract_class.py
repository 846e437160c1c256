"""Contract: DDPWrapper is a torch.nn.parallel.DistributedDataParallel to code that asks
(``isinstance``), side by side with torch DDP in one gloo group: a script's unwrap idiom and
its ``no_sync()`` gradient accumulation take torch's branch, torch.distributed.checkpoint's
state_dict helpers strip the ``module.`` prefix, the ``broadcast_buffers`` /
``forward_sync_buffers`` pair mirror each other, and torch DDP's internal methods raise
``NotImplementedError`` naming themselves instead of running torch's code on a DDPWrapper."""

from __future__ import annotations

import contextlib
import copy
import io
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.join import Joinable
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastddp

from ..ddp_common import compare_models


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


def _pair(**kwargs: Any) -> tuple[nn.Module, nn.Module]:
    return TorchDDP(_model(), **kwargs), fastddp.DDPWrapper(_model(), **kwargs)


def _unwrap(model: nn.Module) -> nn.Module:
    """The unwrap idiom of training scripts (and of accelerate, Lightning, transformers)."""
    return model.module if isinstance(model, TorchDDP) else model


def _class_and_unwrap(rank: int, world_size: int) -> list[Any]:
    torch.manual_seed(1)
    TorchDDP(nn.Linear(3, 2))
    after_torch = torch.random.get_rng_state()
    torch.manual_seed(1)
    fastddp.DDPWrapper(nn.Linear(3, 2))
    assert torch.equal(torch.random.get_rng_state(), after_torch)  # the same global RNG draws
    ref, ours = _pair()
    found = [(isinstance(m, TorchDDP), isinstance(m, Joinable), list(_unwrap(m).state_dict()))
             for m in (ref, ours)]
    assert found[0] == found[1], found
    assert ref.train(False) is ref and ours.train(False) is ours  # torch DDP's train returns self
    assert not ours.training and not ours.module.training
    return list(found[1][:2])


def test_isinstance_and_the_unwrap_idiom_take_torchs_branch(ranks) -> None:
    assert ranks.run(_class_and_unwrap, world_size=1) == [[True, True]]


def _checkpoint_helpers(rank: int, world_size: int) -> list[str]:
    ref, ours = _pair()
    ref_sd, ours_sd = get_model_state_dict(ref), get_model_state_dict(ours)
    assert list(ref_sd) == list(ours_sd) and not any(k.startswith("module.") for k in ours_sd)
    assert all(torch.equal(ref_sd[k], ours_sd[k]) for k in ref_sd)
    with torch.no_grad():  # load a changed state through the helper into both
        changed = {k: v + 1 if v.is_floating_point() else v for k, v in ref_sd.items()}
    for m in (ref, ours):
        set_model_state_dict(m, dict(changed))  # the helper consumes the dict it is given
    compare_models(ours, ref, rtol=0, atol=0)
    return list(ours_sd)


def test_distributed_checkpoint_state_dict_helpers_strip_the_prefix(ranks) -> None:
    keys = ranks.run(_checkpoint_helpers, world_size=1)[0]
    assert keys[0] == "0.weight" and "1.running_mean" in keys


def _accumulate(rank: int, world_size: int) -> int:
    """Gradient accumulation written for torch DDP: no_sync() on every micro-batch but the
    last, chosen by isinstance. Both wrappers must take it (parameters bit for bit)."""
    ref, ours = _pair()
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, ours)]
    g = torch.Generator().manual_seed(rank)
    syncs = 0
    for _ in range(2):
        batches = [torch.randn(4, 3, generator=g) for _ in range(3)]
        for model, opt in zip((ref, ours), opts):
            opt.zero_grad()
            for i, x in enumerate(batches):
                last = i == len(batches) - 1
                skip = isinstance(model, TorchDDP) and not last
                with model.no_sync() if skip else contextlib.nullcontext():
                    model(x).square().mean().backward()
                syncs += model is ours and not skip
            opt.step()
        compare_models(ours, ref, rtol=0, atol=0)
    return syncs


def test_no_sync_accumulation_chosen_by_isinstance_matches_torch(ranks) -> None:
    assert ranks.run(_accumulate, world_size=2) == [2, 2]


def _buffer_flag_pair(rank: int, world_size: int) -> list[bool]:
    ref, ours = _pair()
    seen = []
    for m in (ref, ours):
        m.broadcast_buffers = False
        seen.append((m.forward_sync_buffers, m.broadcast_buffers))
        m.forward_sync_buffers = True
        seen.append((m.forward_sync_buffers, m.broadcast_buffers))
    assert seen[:2] == seen[2:], seen
    return [s[0] for s in seen[2:]]


def test_broadcast_buffers_and_forward_sync_buffers_mirror_each_other(ranks) -> None:
    if not hasattr(TorchDDP, "broadcast_buffers"):
        pytest.skip("this torch's DDP has no forward_sync_buffers (before 2.13)")
    assert ranks.run(_buffer_flag_pair, world_size=1) == [[False, True]]


INTERNALS = [n for n in ("_register_fused_optim", "_check_reducer_finalized", "_sync_buffers",
                          "_update_process_group")
             if n in vars(TorchDDP)]  # the ones this torch's DDP defines


def _internal_methods(rank: int, world_size: int) -> list[str]:
    ours = fastddp.DDPWrapper(_model())
    messages = []
    for name in INTERNALS:
        with pytest.raises(NotImplementedError) as info:
            getattr(ours, name)(1)
        assert f"{name}()" in str(info.value) and "DistributedDataParallel" in str(info.value)
        messages.append(name)
    return messages


def test_torch_ddp_internal_methods_raise_naming_themselves(ranks) -> None:
    assert ranks.run(_internal_methods, world_size=1) == [INTERNALS]


def _public_attributes(rank: int, world_size: int, kwargs: dict[str, Any]) -> list[str]:
    """Every public attribute torch DDP's constructor sets: the same value on a DDPWrapper
    (buffers compared by identity with each model's own), or, for the ones that belong to
    torch's C++ reducer and logger, an AttributeError that says so; and no other public attribute."""
    ref, ours = _pair(**kwargs)
    own = {"logger"}
    missing = []
    for name in sorted(n for n in vars(ref) if not n.startswith("_")):
        if name in own:
            assert not hasattr(ours, name)
            with pytest.raises(AttributeError, match=f"DDPWrapper has no '{name}': it belongs to torch"):
                getattr(ours, name)
            missing.append(name)
            continue
        theirs, mine = getattr(ref, name), getattr(ours, name)
        if name == "modules_buffers":
            assert [id(b) for b in theirs] == [id(b) for b in ref.module.buffers()]
            assert [id(b) for b in mine] == [id(b) for b in ours.module.buffers()]
        elif name == "named_module_buffers":
            assert {k: id(b) for k, b in theirs.items()} == {k: id(b) for k, b in ref.module.named_buffers()}
            assert {k: id(b) for k, b in mine.items()} == {k: id(b) for k, b in ours.module.named_buffers()}
        elif name not in ("module", "process_group", "buffer_hook", "ddp", "reducer"):  # each model's own
            assert theirs == mine, (name, theirs, mine)
    # and no public attribute torch's lacks (hasattr would tell them apart), but fastddp's own argument
    assert {n for n in vars(ours) if not n.startswith("_")} - set(vars(ref)) == {"comm_dtype"}
    with pytest.raises(AttributeError, match="'DDPWrapper' object has no attribute 'no_such_thing'"):
        ours.no_such_thing  # noqa: B018  # any other name: nn.Module's error
    return missing


@pytest.mark.parametrize("kwargs", [{}, {"bucket_cap_mb": 5}, {"bucket_cap_mb_list": [1, 3.5]},
                                    {"bucket_cap_mb": 0.5, "bucket_cap_mb_list": [2]}])
def test_torch_ddp_public_attributes(ranks, kwargs: dict[str, Any]) -> None:
    """The bucket caps among them: bucket_bytes_cap, bucket_bytes_cap_list (bucket_cap_mb_list
    in bytes) and bucket_bytes_cap_default (the smaller default first bucket)."""
    assert set(ranks.run(_public_attributes, world_size=1, args=(kwargs,))[0]) <= {"logger"}


def _profiled_forwards(rank: int, world_size: int) -> list[int]:
    """Each forward is torch DDP's ``DistributedDataParallel.forward`` range in a profile."""
    counts = []
    for cls in (TorchDDP, fastddp.DDPWrapper):
        model = cls(_model())
        with torch.profiler.profile() as prof:
            for _ in range(3):
                model(torch.randn(2, 3)).sum().backward()
        counts.append([e.name for e in prof.events()].count("DistributedDataParallel.forward"))
    return counts


def test_forward_is_torch_ddps_range_in_a_profile(ranks) -> None:
    assert ranks.run(_profiled_forwards, world_size=1) == [[3, 3]]


def _profiled_collectives(rank: int, world_size: int) -> dict[str, int]:
    """A profile of training steps shows the collectives, as torch DDP's show gloo's: on the
    shared-memory transport one all-reduce per bucket and backward, one buffer broadcast per
    forward (the BatchNorm's statistics)."""
    model = fastddp.DDPWrapper(_model(), bucket_cap_mb=0.00001)
    assert model.transport == "shm", model.bucket_report()["transport_note"]
    for _ in range(2):  # the buckets are rebuilt at the second forward
        model(torch.randn(2, 3)).sum().backward()
    buckets = len(model.bucket_report()["buckets"])
    with torch.profiler.profile() as prof:
        for _ in range(3):
            model(torch.randn(2, 3)).sum().backward()
    names = [e.name for e in prof.events()]
    assert buckets > 1
    return {"all_reduce": names.count("fastddp:shm_all_reduce") // buckets,
            "broadcast": names.count("fastddp:shm_broadcast")}


def test_shared_memory_collectives_are_events_in_a_profile(ranks) -> None:
    assert ranks.run(_profiled_collectives) == [{"all_reduce": 3, "broadcast": 3}] * 2


class _CountClones(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.clones = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        self.clones += func._overloadpacket == torch.ops.aten.clone
        return func(*args, **(kwargs or {}))


def _sink_clones(rank: int, world_size: int, kwargs: dict[str, Any], clone: Any) -> list[Any]:
    """Per class: the clones a forward and backward make, and the gradients."""
    found = []
    for cls in (TorchDDP, fastddp.DDPWrapper):
        model = cls(_model(), **kwargs)
        if clone is not None:
            model._set_ddp_sink_clone(clone)
        counter = _CountClones()
        torch.manual_seed(5)  # neither may draw from the global generator
        with counter:
            model(torch.randn(5, 3, generator=torch.Generator().manual_seed(rank))).sum().backward()
        found.append((counter.clones, [p.grad.clone() for p in model.parameters()], torch.random.get_rng_state()))
    (torch_clones, torch_grads, torch_rng), (our_clones, our_grads, our_rng) = found
    assert all(torch.equal(a, b) for a, b in zip(torch_grads, our_grads))
    assert torch.equal(torch_rng, our_rng)
    return [torch_clones, our_clones]


@pytest.mark.parametrize("clone", [None, True, False, 0])
@pytest.mark.parametrize("kwargs", [{"find_unused_parameters": True}, {"static_graph": True}, {}])
def test_set_ddp_sink_clone_as_torch(ranks, kwargs: dict[str, Any], clone: Any) -> None:
    """torch DDP's _set_ddp_sink_clone(False): the outputs that go through its sink node are the
    module's own tensors, not clones (the same number of clones on both sides, and the same
    gradients)."""
    torch_clones, our_clones = ranks.run(_sink_clones, world_size=1, args=(kwargs, clone))[0]
    assert our_clones == torch_clones
    sink = bool(kwargs) and clone in (None, True)
    assert (torch_clones > 0) == sink, torch_clones


class _FailsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("the backward failed")


class _Failing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(10, 10)
        self.fail = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(_FailsInBackward.apply(x) if self.fail else x)


def _rewrapped_after_a_failed_backward(rank: int, world_size: int, remove: bool) -> list[Any]:
    """torch's recovery idiom: a backward fails after the parameters' gradients arrived, the
    old wrapper's hooks are removed, and a new wrapper of the same module trains."""
    found = []
    for cls in (TorchDDP, fastddp.DDPWrapper):
        module = _Failing()
        x = torch.rand(10, 10, generator=torch.Generator().manual_seed(rank), requires_grad=True)
        first = cls(module)
        with pytest.raises(RuntimeError, match="the backward failed"):
            first(x).sum().backward()
        if remove:
            first._remove_autograd_hooks()
        module.fail = False
        module.zero_grad()
        try:
            cls(module)(x).sum().backward()
            found.append([p.grad.clone() for p in module.parameters()])
        except RuntimeError as e:
            found.append(type(e).__name__)
    return found


@pytest.mark.parametrize("remove", [True, False])
def test_remove_autograd_hooks_as_torch(ranks, remove: bool) -> None:
    """After ``_remove_autograd_hooks()`` the old wrapper sees no gradients: the new wrapper's
    backward averages them as torch DDP's does. Without it the old wrapper's hooks see the new
    backward's gradients, and both wrappers' backward raises."""
    for theirs, ours in ranks.run(_rewrapped_after_a_failed_backward, world_size=2, args=(remove,)):
        if not remove:
            assert theirs == ours == "RuntimeError", (theirs, ours)
            continue
        assert isinstance(theirs, list) and isinstance(ours, list), (theirs, ours)
        assert len(theirs) == len(ours) == 2 and all(torch.equal(a, b) for a, b in zip(theirs, ours))


def _copy_after_parameters_changed(rank: int, world_size: int, change: str, how: str) -> list[Any]:
    """A copy of the wrapper (deepcopy, or torch.save + torch.load) reduces the parameters the
    module holds when it is copied, as torch DDP's copy: a layer unfrozen or frozen since the
    wrapper was built, or parameters replaced by ``load_state_dict(assign=True)``."""
    found = []
    for cls in (TorchDDP, fastddp.DDPWrapper):
        torch.manual_seed(0)
        module = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        module[0].requires_grad_(change != "unfreeze")
        model = cls(module)
        if change == "assign":
            model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
        else:
            module[0].requires_grad_(change == "unfreeze")
        if how == "deepcopy":
            twin = copy.deepcopy(model)
        else:
            buffer = io.BytesIO()
            torch.save(model, buffer)
            buffer.seek(0)
            twin = torch.load(buffer, weights_only=False)
        twin(torch.randn(8, 4, generator=torch.Generator().manual_seed(rank))).sum().backward()
        found.append([None if p.grad is None else p.grad.clone() for p in twin.module.parameters()])
    return found


@pytest.mark.parametrize("how", ["deepcopy", "save_load"])
@pytest.mark.parametrize("change", ["unfreeze", "freeze", "assign"])
def test_a_copy_reduces_the_parameters_the_module_holds_then(ranks, change: str, how: str) -> None:
    results = ranks.run(_copy_after_parameters_changed, world_size=2, args=(change, how))
    for theirs, ours in results:
        assert [g is None for g in theirs] == [g is None for g in ours], (theirs, ours)
        assert all(a is None or torch.equal(a, b) for a, b in zip(theirs, ours)), (theirs, ours)
    (_, rank0), (_, rank1) = results
    assert all(a is None or torch.equal(a, b) for a, b in zip(rank0, rank1))  # averaged: equal on both ranks


def _traced_after_steps(rank: int, world_size: int) -> list[Any]:
    found = []
    for cls in (TorchDDP, fastddp.DDPWrapper):
        torch.manual_seed(0)
        model = cls(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
        x = torch.randn(8, 4)
        for _ in range(2):  # from the second forward on, a forward samples the one before it
            model(x).sum().backward()
        found.append(torch.jit.trace(model, (x,))(x).detach())
    return found


def test_jit_trace_after_training_steps_as_torch(ranks) -> None:
    (theirs, ours), = ranks.run(_traced_after_steps, world_size=1)
    assert torch.equal(theirs, ours)


def _two_wrappers_of_one_module(rank: int, world_size: int, how: str) -> list[Any]:
    """Two live wrappers hooking the same parameters: a wrapper around a wrapper, or a second
    wrapper built while the first one's forward (gradients on) awaits a backward. torch DDP's
    two reducers both average the same local gradients; DDPWrapper's gradients must be that
    average too, bit for bit (its reducers reduce in place, and must not race)."""
    found = []
    for cls in (TorchDDP, fastddp.DDPWrapper):
        torch.manual_seed(0)
        module = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 4))  # 128 KiB: reduced in place
        g = torch.Generator().manual_seed(rank)
        if how == "nested":
            model = cls(cls(module))
        else:
            first = cls(module)
            first(torch.randn(8, 128, generator=g))  # armed, never backwarded
            model = cls(module)
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
        grads = []
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(8, 128, generator=g)).pow(2).sum().backward()
            grads.append([p.grad.clone() for p in module.parameters()])
            opt.step()
        found.append(grads)
    return found


@pytest.mark.parametrize("how", ["nested", "rewrapped_with_a_forward_pending"])
def test_two_live_wrappers_of_one_module_average_as_torch(ranks, how: str) -> None:
    for theirs, ours in ranks.run(_two_wrappers_of_one_module, world_size=2, args=(how,)):
        for step, (a, b) in enumerate(zip(theirs, ours)):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), step
