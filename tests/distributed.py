"""Launch N ranks on CPU (gloo) for a test, so each distributed test is a few lines.

    def _check(rank, world_size, scale):        # module-level: it is pickled for spawn
        t = torch.ones(1) * scale
        dist.all_reduce(t)
        return t.item()

    def test_all_reduce():
        assert run_distributed(_check, world_size=2, args=(3.0,)) == [6.0, 6.0]

Each rank runs in a spawned process with the default process group initialised (file://
rendezvous in a fresh temp dir), its return value comes back (it must be picklable). If a
rank raises, the test fails with that rank's traceback; if a rank hangs or dies, the others
are killed after ``timeout`` seconds and the test fails naming the rank.
"""

from __future__ import annotations

import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


class RankFailure(AssertionError):
    """A rank raised, died or timed out."""


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    init_file: str,
    backend: str,
    args: Sequence[Any],
    results: Any,
) -> None:
    try:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        import torch

        torch.set_num_threads(1)
        dist.init_process_group(
            backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size
        )
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException:  # report every failure, including SystemExit
        results.put((rank, False, traceback.format_exc()))


def _failure_report(rank: int, tb: str, world_size: int, results: Any, procs: list) -> str:
    """All failing ranks' tracebacks: the first to arrive may only be a peer's lost
    connection, so wait briefly for the others (the root cause among them)."""
    failures = {rank: tb}
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and len(failures) < world_size:
        try:
            r, ok, value = results.get(timeout=0.5)
        except queue.Empty:
            if all(p.exitcode is not None for p in procs):
                break
            continue
        if not ok:
            failures[r] = value
    return "\n".join(f"rank {r} of {world_size} failed:\n{failures[r]}" for r in sorted(failures))


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    backend: str = "gloo",
    timeout: float = 180.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; return their results
    in rank order, or raise :class:`RankFailure` with the failing rank's traceback."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="fastddp-rdzv-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(
                target=_worker,
                args=(fn, rank, world_size, init_file, backend, tuple(args), results),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        collected: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(collected) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted(set(range(world_size)) - set(collected))
                    raise RankFailure(f"ranks {missing} did not finish within {timeout:.0f} s")
                try:
                    rank, ok, value = results.get(timeout=min(remaining, 1.0))
                except queue.Empty:
                    dead = [
                        r for r, p in enumerate(procs)
                        if r not in collected and p.exitcode not in (None, 0)
                    ]
                    if dead:
                        # Give a crashed rank's queued traceback a moment to arrive first.
                        try:
                            rank, ok, value = results.get(timeout=2.0)
                        except queue.Empty:
                            codes = {r: procs[r].exitcode for r in dead}
                            raise RankFailure(f"ranks died without a result: {codes}") from None
                    else:
                        continue
                if not ok:
                    raise RankFailure(_failure_report(rank, value, world_size, results, procs))
                collected[rank] = value
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join()
    return [collected[r] for r in range(world_size)]
