"""Contract: fastddp.DDPWrapper behaves as torch.nn.parallel.DistributedDataParallel on any
process group.

Each test runs torch DDP and DDPWrapper side by side in the same gloo ranks, on the same group,
from the same (rank-dependent) initial weights and inputs, and compares what a user observes:
gradients and parameters bit for bit after every step, buffers, and the exception type where both refuse.
Sparse gradients: tests/contracts/test_ddp_contract_sparse.py.
"""

from __future__ import annotations

import copy
import datetime
import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastddp


def bn_mlp() -> nn.Module:
    """Parameters and a buffer that each rank updates differently (the per-forward broadcast
    from the group's first rank decides what every rank holds)."""
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def build_pair(factory: Callable[[], nn.Module], group: Optional[dist.ProcessGroup], rank: int,
               ours_kwargs: Optional[dict] = None, **kwargs: Any) -> tuple[nn.Module, nn.Module]:
    """(DDPWrapper, torch DDP) over equal copies of ``factory()``, each rank starting from
    different weights so that the construction-time broadcast matters."""
    torch.manual_seed(1234)
    a = factory()
    b = factory()
    b.load_state_dict(a.state_dict())
    with torch.no_grad():
        for p in [*a.parameters(), *b.parameters()]:
            p.add_(rank * 0.01)
    ours = fastddp.DDPWrapper(a, process_group=group, **kwargs, **(ours_kwargs or {}))
    ref = TorchDDP(b, process_group=group, **kwargs)
    return ours, ref


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (NaN where the other has NaN: an fp16 step that overflowed)."""
    if torch.equal(a, b):
        return True
    if not a.is_floating_point() or not torch.equal(a.isnan(), b.isnan()):
        return False
    return torch.equal(a.masked_fill(a.isnan(), 0), b.masked_fill(b.isnan(), 0))


def differences(ours: nn.Module, ref: nn.Module, grads: bool) -> list[str]:
    """Names of the gradients, parameters and buffers that are not torch DDP's bit for bit."""
    bad = []
    for (name, p), q in zip(ours.module.named_parameters(), ref.module.parameters()):
        if grads and (p.grad is None) != (q.grad is None):
            bad.append(f"{name}.grad presence")
        elif grads and p.grad is not None and not _same(p.grad, q.grad):
            bad.append(f"{name}.grad")
        if not _same(p, q):
            bad.append(name)
    for (name, x), y in zip(ours.module.named_buffers(), ref.module.buffers()):
        if not _same(x, y):
            bad.append(f"buffer {name}")
    return bad


def train_side_by_side(ours: nn.Module, ref: nn.Module, rank: int, steps: int = 3,
                       accumulate: bool = False) -> list[str]:
    """SGD steps on both wrappers with rank-dependent inputs; every difference seen, by step.
    With ``accumulate`` every other step runs under no_sync() and the next one reduces both."""
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ours, ref)]
    g = torch.Generator().manual_seed(100 + rank)
    found = []
    for step in range(steps):
        x = torch.randn(5, 6, generator=g) + rank
        for model in (ours, ref):
            if accumulate and step % 2 == 0:
                with model.no_sync():
                    model(x).pow(2).mean().backward()
                continue
            model(x).pow(2).mean().backward()
        if accumulate and step % 2 == 0:
            continue
        found += [f"step {step}: {d}" for d in differences(ours, ref, grads=True)]
        for opt in opts:
            opt.step()
            opt.zero_grad()
        found += [f"step {step} after the update: {d}" for d in differences(ours, ref, grads=False)]
    return found


def store_group(path: str, rank: int, world_size: int, timeout_s: float = 77.0) -> dist.ProcessGroup:
    """A gloo ProcessGroup built on a FileStore, unknown to any default group."""
    store = dist.FileStore(path, world_size)
    group = dist.ProcessGroup(store, rank, world_size)
    backend = dist.ProcessGroupGloo(store, rank, world_size, datetime.timedelta(seconds=timeout_s))
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    return group


def outcome(make: Callable[[], Any]) -> str:
    """"ok" or the exception type's name."""
    try:
        make()
    except Exception as exc:  # the type is what is compared
        return type(exc).__name__
    return "ok"


# ------------------------------------------------------------------ a group built on a store

def _store_group_training(rank: int, world_size: int, path: str, transport: str) -> dict[str, Any]:
    group = store_group(path, rank, world_size)
    ours, ref = build_pair(bn_mlp, group, group.rank(), ours_kwargs={"shm_allreduce": transport == "shm"})
    return {"transport": ours.transport, "timeout_s": ours._timeout_s(),
            "differences": train_side_by_side(ours, ref, group.rank(), accumulate=True)}


@pytest.mark.parametrize("transport", ["c10d", "shm"])
def test_store_group_trains_as_torch(ranks, tmp_path, transport: str) -> None:
    """A ProcessGroup built on a FileStore (not registered with the default group): the same
    gradients, parameters and buffers as torch DDP on it, bit for bit on both transports (the
    shared memory's handshake and reduction run on that group); the shared memory's wait uses
    the group's own timeout."""
    results = ranks.run(_store_group_training, world_size=2, args=(str(tmp_path / "store"), transport))
    assert [r["transport"] for r in results] == [transport, transport]
    assert [r["timeout_s"] for r in results] == [77.0, 77.0]
    assert [r["differences"] for r in results] == [[], []]


# ------------------------------------------------------------------ no default process group

def _fresh_worker(fn: Callable[..., Any], rank: int, world_size: int, args: tuple, results: Any) -> None:
    try:
        torch.set_num_threads(1)
        assert not dist.is_initialized()
        results.put((rank, True, fn(rank, world_size, *args)))
    except BaseException:  # every failure goes back to the test
        results.put((rank, False, traceback.format_exc()))


def run_without_default_group(fn: Callable[..., Any], world_size: int, args: tuple = (),
                              timeout: float = 120.0) -> list[Any]:
    """``fn(rank, world_size, *args)`` in fresh spawned processes that never call
    init_process_group (the pool's ranks all have a default group)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_fresh_worker, args=(fn, r, world_size, args, results), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    collected: dict[int, Any] = {}
    try:
        while len(collected) < world_size:
            rank, ok, value = results.get(timeout=timeout)
            assert ok, f"rank {rank} failed:\n{value}"
            collected[rank] = value
    except queue.Empty:
        pytest.fail(f"ranks {sorted(set(range(world_size)) - set(collected))} did not finish in {timeout} s")
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return [collected[r] for r in range(world_size)]


def _without_default_group(rank: int, world_size: int, path: str) -> dict[str, Any]:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    no_group = {"ours": outcome(lambda: fastddp.DDPWrapper(nn.Linear(2, 2))),
                "torch": outcome(lambda: TorchDDP(nn.Linear(2, 2)))}
    group = store_group(path, rank, world_size)
    ours, ref = build_pair(bn_mlp, group, rank, ours_kwargs={"shm_allreduce": False})
    copies = {"ours": outcome(lambda: copy.deepcopy(ours)), "torch": outcome(lambda: copy.deepcopy(ref))}
    return {"no group": no_group, "deepcopy": copies, "differences": train_side_by_side(ours, ref, rank)}


def test_group_without_default_group(tmp_path) -> None:
    """In processes that never called init_process_group: a store-built group trains as torch
    DDP on it, bit for bit; no group at all, and deepcopy (which needs the default group), raise
    torch's exception type."""
    results = run_without_default_group(_without_default_group, 2, (str(tmp_path / "store"),))
    assert [r["no group"] for r in results] == [{"ours": "ValueError", "torch": "ValueError"}] * 2
    assert [r["deepcopy"] for r in results] == [{"ours": "ValueError", "torch": "ValueError"}] * 2
    assert [r["differences"] for r in results] == [[], []]


def _bare_backend(rank: int, world_size: int, path: str) -> dict[str, str]:
    store = dist.FileStore(path, world_size)
    backend = dist.ProcessGroupGloo(store, rank, world_size)
    found = {"ours": outcome(lambda: fastddp.DDPWrapper(nn.Linear(2, 2), process_group=backend)),
             "torch": outcome(lambda: TorchDDP(nn.Linear(2, 2), process_group=backend))}
    # Every rank keeps its backend until all ranks are done with theirs: a backend destroyed
    # while a peer still connects its mesh closes the connection under the peer.
    store.add("done", 1)
    deadline = time.monotonic() + 60  # a peer that failed before this point never arrives
    while store.add("done", 0) < world_size and time.monotonic() < deadline:
        time.sleep(0.01)
    return found


def test_bare_backend_is_refused_as_torch_refuses_it(ranks, tmp_path) -> None:
    """A c10d backend (dist.ProcessGroupGloo) is not a ProcessGroup: both raise TypeError."""
    results = ranks.run(_bare_backend, world_size=2, args=(str(tmp_path / "store"),))
    assert results == [{"ours": "TypeError", "torch": "TypeError"}] * 2


# ------------------------------------------------------------------ dist.new_group subgroups

def _subgroup_training(rank: int, world_size: int, transport: str) -> Any:
    sub = dist.new_group([1, 2])  # group rank 0 is global rank 1: broadcasts come from there
    if rank == 0:
        refused = {"ours": outcome(lambda: fastddp.DDPWrapper(nn.Linear(2, 2), process_group=sub)),
                   "torch": outcome(lambda: TorchDDP(nn.Linear(2, 2), process_group=sub))}
        dist.barrier()
        return refused
    ours, ref = build_pair(bn_mlp, sub, rank, ours_kwargs={"shm_allreduce": transport == "shm"})
    found = train_side_by_side(ours, ref, rank, accumulate=True)
    copies = (outcome(lambda: copy.deepcopy(ours)), outcome(lambda: copy.deepcopy(ref)))
    dist.barrier()  # the rank outside the group takes part in nothing until here
    return ours.transport, found, copies


@pytest.mark.parametrize("transport", ["c10d", "shm"])
def test_subgroup_trains_as_torch(ranks, transport: str) -> None:
    """A dist.new_group([1, 2]) subgroup of three ranks: broadcasts from its first rank (global
    rank 1), the reduction over its two ranks, bit for bit as torch DDP on gloo (the shared
    memory maps that group's ranks). On the rank outside the group both refuse with one type."""
    results = ranks.run(_subgroup_training, world_size=3, args=(transport,))
    assert results[1:] == [(transport, [], ("RuntimeError", "RuntimeError"))] * 2  # deepcopy: default group only
    assert results[0]["ours"] == results[0]["torch"], results[0]


def _subgroup_join(rank: int, world_size: int) -> Any:
    sub = dist.new_group([1, 2])
    if rank == 0:
        return None
    ours, ref = build_pair(bn_mlp, sub, rank, ours_kwargs={"shm_allreduce": False})
    states = []
    for model in (ours, ref):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(rank)
        with Join([model]):
            for _ in range(2 + rank):  # global rank 2 trains one step more
                model(torch.randn(5, 6, generator=g)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
        states.append(model.module.state_dict())
    return [k for k in states[0] if not torch.equal(states[0][k], states[1][k])]


def test_subgroup_join_matches_torch(ranks) -> None:
    """join() with uneven inputs on a subgroup: its collectives go to that group (global rank 0
    takes no part) and the final model is torch DDP's."""
    results = ranks.run(_subgroup_join, world_size=3)
    assert results == [None, [], []]


# ------------------------------------------------------------------ communication hooks

def _hook_named_grads(state: object, grads: Any) -> Any:
    return None


def _hook_argument_name(rank: int, world_size: int) -> dict[str, str]:
    return {"ours": outcome(lambda: fastddp.DDPWrapper(nn.Linear(2, 2)).register_comm_hook(None, _hook_named_grads)),
            "torch": outcome(lambda: TorchDDP(nn.Linear(2, 2)).register_comm_hook(None, _hook_named_grads))}


def test_hook_without_bucket_argument_raises_keyerror(ranks) -> None:
    """A hook whose second argument is not named ``bucket``: torch's KeyError."""
    assert ranks.run(_hook_argument_name, world_size=2) == [{"ours": "KeyError", "torch": "KeyError"}] * 2


def _hook_on_subgroup(rank: int, world_size: int) -> Any:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    sub = dist.new_group([1, 2])
    if rank == 0:
        return None
    ours, ref = build_pair(bn_mlp, sub, rank)
    for model in (ours, ref):
        model.register_comm_hook(sub, default_hooks.allreduce_hook)
    ours2, ref2 = build_pair(bn_mlp, sub, rank)

    def python_allreduce(state, bucket):  # unannotated, as torch checks annotations; collectives on `state`
        return default_hooks.allreduce_hook(state, bucket)

    for model in (ours2, ref2):
        model.register_comm_hook(sub, python_allreduce)
    return train_side_by_side(ours, ref, rank) + train_side_by_side(ours2, ref2, rank)


def test_comm_hooks_on_a_subgroup(ranks) -> None:
    """torch's allreduce_hook (run in C++) and a Python hook, both given the subgroup as state:
    bit for bit torch DDP's."""
    assert ranks.run(_hook_on_subgroup, world_size=3) == [None, [], []]
