"""Reduction fingerprints: a rank out of step with the others (no_sync, requires_grad, an unused
parameter, autocast on one rank only) makes every rank raise fastddp.DesyncError within seconds,
naming the ranks and what differs; correct runs (join() with uneven inputs, no_sync on every
rank, the same or, as torch DDP allows, different unused parameters) raise nothing. Two gloo
ranks, through shared memory and through the process group."""

from __future__ import annotations

import os
import time

import pytest
import torch
from torch import nn

import fastddp

from .ddp_common import BranchNet, mlp

TRANSPORTS = ["shm", "c10d"]
RAISE_WITHIN_S = 10.0  # both ranks raise this soon after the faulty backward started
CASE_TIMEOUT_S = 90.0  # a hang fails the case instead of blocking the suite


class SkipNet(nn.Module):
    """`c` is used only when the input asks for it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, use_c: bool = True) -> torch.Tensor:
        h = torch.relu(self.a(x))
        return self.c(h) if use_c else h


def _setup(transport: str, fingerprint: str = "1") -> None:
    os.environ["FASTDDP_SHM_ALLREDUCE"] = "1" if transport == "shm" else "0"
    os.environ["FASTDDP_FINGERPRINT"] = fingerprint


def _expect_desync(backward) -> tuple[str, float]:
    """Runs the faulty step; returns the DesyncError's message and how long it took to raise."""
    start = time.monotonic()
    with pytest.raises(fastddp.DesyncError) as info:
        backward()
    return str(info.value), time.monotonic() - start


def _check_raised(results: list[tuple[str, float]], *needles: str) -> str:
    messages = [m for m, _ in results]
    assert messages[0] == messages[1], messages  # one message, the same on every rank
    for needle in needles:
        assert needle in messages[0], (needle, messages[0])
    assert all(t < RAISE_WITHIN_S for _, t in results), results
    return messages[0]


# ------------------------------------------------------------------ faults


def _no_sync_one_rank(rank: int, world_size: int, transport: str) -> tuple[str, float]:
    _setup(transport)
    torch.manual_seed(0)
    model = fastddp.DDPWrapper(mlp())
    assert model._reducer.fingerprinting
    x = torch.randn(2, 8)
    if rank == 0:
        with model.no_sync():
            model(x).sum().backward()
    return _expect_desync(lambda: model(x).sum().backward())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_no_sync_on_one_rank(ranks, transport: str) -> None:
    results = ranks.run(_no_sync_one_rank, world_size=2, args=(transport,), timeout=CASE_TIMEOUT_S)
    _check_raised(results, "(reducing step 1)", "rank 0 ran 1 step, rank 1 ran none under no_sync()")


def _requires_grad_one_rank(rank: int, world_size: int, transport: str) -> tuple[str, float]:
    _setup(transport)
    torch.manual_seed(0)
    model = fastddp.DDPWrapper(mlp())
    x = torch.randn(2, 8)
    model(x).sum().backward()  # one good step first (the buckets are rebuilt after it)
    if rank == 1:
        model.module[4].bias.requires_grad_(False)
    return _expect_desync(lambda: model(x).sum().backward())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_requires_grad_toggled_on_one_rank(ranks, transport: str) -> None:
    results = ranks.run(_requires_grad_one_rank, world_size=2, args=(transport,), timeout=CASE_TIMEOUT_S)
    _check_raised(results, "(reducing step 2)", "requires_grad differs: rank 0 reduces 6 parameters, rank 1 reduces 5 parameters",
                  "4.bias requires grad on rank 0 only")


def _unused_one_rank(rank: int, world_size: int, transport: str, find_unused: bool) -> tuple[str, float]:
    _setup(transport, "strict" if find_unused else "1")
    torch.manual_seed(0)
    model = fastddp.DDPWrapper(SkipNet(), find_unused_parameters=find_unused)
    x = torch.randn(2, 8)
    return _expect_desync(lambda: model(x, use_c=rank == 0).sum().backward())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_parameter_unused_on_one_rank(ranks, transport: str) -> None:
    """Without find_unused_parameters: the rank that skipped `c` and the parameters are named
    (before, only that rank raised and the other waited in the all-reduce)."""
    results = ranks.run(_unused_one_rank, world_size=2, args=(transport, False), timeout=CASE_TIMEOUT_S)
    _check_raised(results, "rank 1 produced no gradient for c.weight, c.bias (unused on rank 1 only",
                  "pass find_unused_parameters=True")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_parameter_unused_on_one_rank_strict(ranks, transport: str) -> None:
    """find_unused_parameters=True with FASTDDP_FINGERPRINT=strict compares the used sets."""
    results = ranks.run(_unused_one_rank, world_size=2, args=(transport, True), timeout=CASE_TIMEOUT_S)
    _check_raised(results, "the forward used different parameters", "c.weight, c.bias unused on rank 1 only")


def _autocast_one_rank(rank: int, world_size: int, transport: str) -> tuple[str, float]:
    _setup(transport)
    torch.manual_seed(0)
    model = fastddp.DDPWrapper(mlp())
    x = torch.randn(2, 8)

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=rank == 0):
            out = model(x)
        out.float().sum().backward()

    return _expect_desync(step)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_autocast_on_one_rank(ranks, transport: str) -> None:
    results = ranks.run(_autocast_one_rank, world_size=2, args=(transport,), timeout=CASE_TIMEOUT_S)
    _check_raised(results, "rank 0 runs autocast(bfloat16), rank 1 runs no autocast")


def _step_apart(rank: int, world_size: int) -> tuple[str, float]:
    """Rank 1 reduces one step of a second wrapper while rank 0 reduces the first one (the same
    model, so only the step count tells): their next reductions are a step apart."""
    _setup("c10d")
    torch.manual_seed(0)
    first, second = fastddp.DDPWrapper(mlp()), fastddp.DDPWrapper(mlp())
    x = torch.randn(2, 8)
    for model in (first, second, first, second):  # the buckets are rebuilt in each one's 2nd step
        model(x).sum().backward()
    (first if rank == 0 else second)(x).sum().backward()
    return _expect_desync(lambda: first(x).sum().backward())


def test_ranks_a_step_apart(ranks) -> None:
    """(The process-group transport: wrappers that share memory each have their own mapping.)"""
    results = ranks.run(_step_apart, world_size=2, timeout=CASE_TIMEOUT_S)
    _check_raised(results, "rank 0 is at reducing step 4, rank 1 is at reducing step 3")


def _desync_while_joined(rank: int, world_size: int, transport: str) -> tuple[str, float]:
    """Rank 0 runs out of data and stands in (join()); ranks 1 and 2 then disagree on autocast.
    The stand-in's wildcard fingerprint matches anything, yet it sees the mismatch and raises
    the same error from the join() block."""
    _setup(transport)
    torch.manual_seed(0)
    model = fastddp.DDPWrapper(mlp())
    x = torch.randn(2, 8)

    def loop() -> None:
        with model.join():
            for step in range(1 if rank == 0 else 3):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=rank == 2 and step == 2):
                    out = model(x)
                out.float().sum().backward()

    return _expect_desync(loop)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_desync_while_a_rank_is_joined(ranks, transport: str) -> None:
    results = ranks.run(_desync_while_joined, world_size=3, args=(transport,), timeout=CASE_TIMEOUT_S)
    messages = {m for m, _ in results}
    assert len(messages) == 1, messages
    msg = messages.pop()
    assert "rank 1 runs no autocast, rank 2 runs autocast(bfloat16)" in msg, msg
    assert "; rank 0 has joined (uneven inputs) and stands in" in msg, msg
    assert all(t < RAISE_WITHIN_S for _, t in results), results


# ------------------------------------------------------------------ correct runs


def _correct_runs(rank: int, world_size: int, transport: str) -> list[bool]:
    _setup(transport)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(rank)
    # join() with uneven inputs (rank 0 has 2 batches, rank 1 has 5), then even steps again:
    # the joined rank's stand-in reductions count, so the steps stay in line afterwards.
    model = fastddp.DDPWrapper(mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with model.join():
        for _ in range(2 + 3 * rank):
            opt.zero_grad()
            model(torch.randn(2, 8, generator=g)).sum().backward()
            opt.step()
    for _ in range(2):
        model(torch.randn(2, 8, generator=g)).sum().backward()
    # no_sync accumulation on every rank, under autocast on every rank
    for _ in range(2):
        for micro in range(3):
            with model.no_sync() if micro < 2 else torch.enable_grad():
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = model(torch.randn(2, 8, generator=g))
                out.float().sum().backward()
    # forwards without a backward on rank 0 only (a logging forward, gradients on), inside
    # no_sync() and between the micro-steps and the reducing step: torch DDP runs this
    for _ in range(2):
        with model.no_sync():
            model(torch.randn(2, 8, generator=g)).sum().backward()
            if rank == 0:
                model(torch.randn(2, 8, generator=g))
        if rank == 0:
            model(torch.randn(2, 8, generator=g))
        model(torch.randn(2, 8, generator=g)).sum().backward()
    # find_unused_parameters: the same unused set, then (as torch DDP allows) different ones
    branch = fastddp.DDPWrapper(BranchNet(), find_unused_parameters=True)
    for step in range(4):
        branch(torch.randn(2, 8, generator=g), use_extra=step % 2 == 0).sum().backward()
    for step in range(4):
        branch(torch.randn(2, 8, generator=g), use_extra=(step + rank) % 2 == 0).sum().backward()
    return [model._reducer.fingerprinting, branch._reducer.fingerprinting]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_correct_runs_raise_nothing(ranks, transport: str) -> None:
    assert ranks.run(_correct_runs, world_size=2, args=(transport,), timeout=CASE_TIMEOUT_S) == [[True, True]] * 2


def _switched_off(rank: int, world_size: int, transport: str) -> bool:
    """FASTDDP_FINGERPRINT=0: no fingerprint, so no_sync on one rank goes unnoticed."""
    _setup(transport, "0")
    model = fastddp.DDPWrapper(mlp())
    x = torch.randn(2, 8)
    if rank == 0:
        with model.no_sync():
            model(x).sum().backward()
    model(x).sum().backward()
    return model._reducer.fingerprinting


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_switched_off_by_environment(ranks, transport: str) -> None:
    assert ranks.run(_switched_off, world_size=2, args=(transport,), timeout=CASE_TIMEOUT_S) == [False, False]


def _bad_setting(rank: int, world_size: int) -> str:
    os.environ["FASTDDP_FINGERPRINT"] = "maybe"
    with pytest.raises(ValueError) as info:
        fastddp.DDPWrapper(mlp())
    return str(info.value)


def test_bad_environment_value_is_named(ranks) -> None:
    msg = ranks.run(_bad_setting, world_size=2)[0]
    assert "FASTDDP_FINGERPRINT='maybe'" in msg and "strict" in msg, msg


def _world_of_one(rank: int, world_size: int) -> list[bool]:
    os.environ.pop("FASTDDP_FINGERPRINT", None)
    passthrough = fastddp.DDPWrapper(mlp())
    os.environ["FASTDDP_WORLD1_PASSTHROUGH"] = "0"
    bucketed = fastddp.DDPWrapper(mlp())
    bucketed(torch.randn(2, 8)).sum().backward()
    return [fastddp._C.ReducerOptions().fingerprint, passthrough._reducer.fingerprinting,
            bucketed._reducer.fingerprinting]


def test_world_of_one_has_nothing_to_compare(ranks) -> None:
    """On by default in the options, skipped where a single rank has no one to compare with."""
    assert ranks.run(_world_of_one, world_size=1) == [[True, False, False]]


def _forward_on_rank0_before_rebuild(rank: int, world_size: int, transport: str) -> str:
    """Rank 0 alone runs an evaluation forward between the first two steps of a model with
    buffers: it broadcasts the buffers where the other rank's next forward first agrees on the
    rebuilt bucket order. torch DDP's collectives mismatch there (gloo aborts); on the
    process-group transport the other rank names the fault, on shared memory (where the
    buffers do not go through the process group) both ranks train on."""
    import datetime

    import torch.distributed as dist

    _setup(transport)
    group = dist.new_group(timeout=datetime.timedelta(seconds=20))  # a group this case may break
    torch.manual_seed(0)
    model = fastddp.DDPWrapper(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)),
                               process_group=group)
    model(torch.randn(8, 4)).sum().backward()
    try:
        if rank == 0:
            model.eval()
            with torch.no_grad():
                model(torch.randn(2, 4))
            model.train()
        for _ in range(2):
            model(torch.randn(8, 4)).sum().backward()
        outcome = "trained"
    except fastddp.DesyncError as exc:
        outcome = str(exc)
    except RuntimeError as exc:  # rank 0, once rank 1 left the group
        outcome = f"peer gone: {type(exc).__name__}"
    if outcome != "trained":
        dist.destroy_process_group(group)  # ends the other rank's wait at once
    return outcome


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_forward_on_one_rank_before_the_bucket_rebuild(ranks, transport: str) -> None:
    results = ranks.run(_forward_on_rank0_before_rebuild, world_size=2, args=(transport,), timeout=CASE_TIMEOUT_S)
    if transport == "shm":
        assert results == ["trained", "trained"]
        return
    assert results[0].startswith("peer gone"), results
    assert results[1].startswith("DDPWrapper: rank 1 expected rank 0's bucket order"), results
    assert "model.module(...)" in results[1]
