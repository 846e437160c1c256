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

:class:`RankPool` keeps the ranks alive between cases (tests use it through the ``ranks``
fixture of tests/conftest.py): ``ranks.run(fn, world_size=2, args=(3.0,))`` runs one case.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import queue
import shutil
import signal
import subprocess
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


# --------------------------------------------------------------------------------------------
# A pool of ranks kept across test cases: the tests/conftest.py fixture ``ranks`` starts one
# per world size per test module, so splitting a suite into one case per test function does
# not pay the start-up (spawn, import torch, rendezvous) once per case.


def _stack_file(init_file: str, rank: int) -> str:
    return os.path.join(os.path.dirname(init_file), f"stacks-rank{rank}.txt")


def _stacks_of_stuck_rank(pid: int, stack_file: str) -> str:
    """What a rank that did not finish is doing: its Python threads (faulthandler, on
    SIGUSR1) and, where gdb is installed, every thread's native stack (C++ waits)."""
    parts = []
    try:
        os.kill(pid, signal.SIGUSR1)
        time.sleep(1.0)
        with open(stack_file) as f:
            parts.append("Python threads:\n" + f.read())
    except OSError as e:
        parts.append(f"Python threads: unavailable ({e})")
    if shutil.which("gdb"):
        try:
            out = subprocess.run(["gdb", "-p", str(pid), "-batch", "-nx", "-ex", "thread apply all bt 30"],
                                 capture_output=True, text=True, timeout=60).stdout
            parts.append("native threads:\n" + "\n".join(
                line[:240] for line in out.splitlines() if line.startswith(("Thread ", "#"))))
        except (OSError, subprocess.TimeoutExpired) as e:
            parts.append(f"native threads: unavailable ({e})")
    return "\n".join(parts)


def _pool_worker(rank: int, world_size: int, init_file: str, backend: str, tasks: Any,
                 results: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # A case that does not finish gets this rank's stacks in its failure (RankPool._collect).
    stack_file = open(_stack_file(init_file, rank), "w")  # open for the process's life
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    import gc
    import random

    import torch

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size
        )
    except BaseException:
        results.put((None, rank, False, traceback.format_exc()))
        return
    # What one case may change and the next must not see: environment variables (cases pick a
    # transport through FASTDDP_* variables) and the global RNGs, restored to the state of a
    # freshly started rank before every case.
    environ = dict(os.environ)
    torch_rng = torch.get_rng_state()
    py_rng = random.getstate()
    while True:
        task = tasks.get()
        if task is None:
            break
        case_id, fn, args = task
        torch.set_rng_state(torch_rng)
        random.setstate(py_rng)
        try:
            outcome = (case_id, rank, True, fn(rank, world_size, *args))
        except BaseException:  # report every failure, including SystemExit
            outcome = (case_id, rank, False, traceback.format_exc())
        finally:
            os.environ.clear()
            os.environ.update(environ)
            gc.collect()  # wrappers of this case release their threads and segments now
        try:  # the queue pickles in a feeder thread, where an error would be lost
            pickle.dumps(outcome)
        except Exception:
            outcome = (case_id, rank, False, "the case's return value cannot be pickled:\n"
                       + traceback.format_exc())
        results.put(outcome)
    dist.destroy_process_group()


class RankPool:
    """``world_size`` spawned gloo ranks that run one case after another.

    ``run(fn, args)`` runs ``fn(rank, world_size, *args)`` on every rank and returns the
    results in rank order. A case that fails on any rank, dies or times out raises
    :class:`RankFailure` naming the case and the rank, and the pool is restarted before the
    next case, so a rank left waiting in a collective cannot poison it.
    """

    def __init__(self, world_size: int, backend: str = "gloo") -> None:
        self.world_size = world_size
        self.backend = backend
        self._procs: list = []
        self._tasks: list = []
        self._results: Any = None
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._init_file = ""  # the rendezvous file of the running ranks (their stack files beside it)
        self._next_case = 0

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._tmp = tempfile.TemporaryDirectory(prefix="fastddp-pool-")
        init_file = self._init_file = os.path.join(self._tmp.name, "rendezvous")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            ctx.Process(
                target=_pool_worker,
                args=(rank, self.world_size, init_file, self.backend, self._tasks[rank],
                      self._results),
                daemon=True,
            )
            for rank in range(self.world_size)
        ]
        for p in self._procs:
            p.start()

    def close(self, graceful: bool = True) -> None:
        """Stop the ranks (asking them to leave first when ``graceful``)."""
        if graceful:
            for q in self._tasks:
                q.put(None)
        for p in self._procs:
            p.join(timeout=10 if graceful else 0)
            if p.is_alive():
                p.kill()
                p.join()
        for q in [*self._tasks, self._results]:
            if q is not None:
                q.cancel_join_thread()
                q.close()
        if self._tmp is not None:
            self._tmp.cleanup()
        self._procs, self._tasks, self._results, self._tmp = [], [], None, None

    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), timeout: float = 180.0,
            name: str | None = None) -> list[Any]:
        """Run one case on every rank; see the class docstring."""
        name = name or getattr(fn, "__qualname__", repr(fn))
        if not self._procs:
            self._start()
        self._next_case += 1
        case_id = self._next_case
        healthy = False
        try:
            for q in self._tasks:
                q.put((case_id, fn, tuple(args)))
            values = self._collect(case_id, name, timeout)
            healthy = True
            return values
        finally:
            if not healthy:  # a failure, a timeout or an interrupt: the next case starts afresh
                self.close(graceful=False)

    def _collect(self, case_id: int, name: str, timeout: float) -> list[Any]:
        collected: dict[int, Any] = {}
        failures: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        grace: float | None = None  # once something went wrong: how long the others may report
        while len(collected) + len(failures) < self.world_size:
            now = time.monotonic()
            if grace is not None and now > grace:
                break
            if now > deadline:
                failures.update({r: f"did not finish within {timeout:.0f} s; where it was:\n"
                                    + _stacks_of_stuck_rank(self._procs[r].pid, self._stack_file(r))
                                 for r in self._missing(collected, failures)})
                break
            try:
                got, rank, ok, value = self._results.get(timeout=0.5)
            except queue.Empty:
                if grace is None and any(self._procs[r].exitcode is not None
                                         for r in self._missing(collected, failures)):
                    grace = time.monotonic() + 2.0  # a dead rank's traceback may still arrive
                continue
            if got is not None and got != case_id:
                continue  # a late answer to an earlier case (cannot happen after a restart)
            if got is not None and ok:
                collected[rank] = value
                continue
            failures[rank] = value  # got is None: the rank could not join the process group
            if grace is None:
                # the first failure may be a peer's lost connection: wait briefly for the root
                # cause among the others
                grace = time.monotonic() + 5.0
        for r in self._missing(collected, failures):
            code = self._procs[r].exitcode
            if code is not None:
                failures[r] = f"died (exit code {code}) without a result"
        if failures:
            raise RankFailure("\n".join(f"case {name}: rank {r} of {self.world_size} failed:\n{tb}"
                                        for r, tb in sorted(failures.items())))
        return [collected[r] for r in range(self.world_size)]

    def _stack_file(self, rank: int) -> str:
        return _stack_file(self._init_file, rank)

    def _missing(self, collected: dict, failures: dict) -> list[int]:
        return [r for r in range(self.world_size) if r not in collected and r not in failures]
