"""The stall watchdog's fault matrix: two gloo ranks, rank 1 misbehaves, and within the stall
threshold plus a small margin rank 0 prints a report naming rank 1 and where it is; at the
process-group timeout rank 0's collective fails with every rank's status in its error and rank 1
ends with the report, both with a non-zero status (no process is left behind). One fault per
test; each starts its own two processes."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

WORKER = Path(__file__).parent / "faults" / "hang_worker.py"
THRESHOLD_S = 1.5
TIMEOUT_S = 8.0
MARGIN_S = 4.0  # start-up of the report: the peers' answers and their Python stacks


class Rank:
    """One worker process, its output lines with their arrival times."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([sys.executable, str(WORKER), *args], env=env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.lines: list[tuple[float, str]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def first(self, text: str) -> float | None:
        return next((t for t, line in self.lines if text in line), None)

    @property
    def output(self) -> str:
        return "\n".join(line for _, line in self.lines)


def run_fault(tmp_path: Path, fault: str, shm: bool = True, timeout_s: float = TIMEOUT_S) -> tuple[Rank, Rank]:
    waiting, bad = run_ranks(tmp_path, fault, 2, shm, timeout_s)
    return waiting, bad


def run_ranks(tmp_path: Path, fault: str, world: int, shm: bool = True,
              timeout_s: float = TIMEOUT_S) -> list[Rank]:
    env = {**os.environ, "FASTDDP_STALL_THRESHOLD_S": str(THRESHOLD_S), "PYTHONUNBUFFERED": "1"}
    init = tmp_path / "init"
    ranks = [Rank([fault, str(r), str(world), str(init), str(timeout_s), "1" if shm else "0"], env)
             for r in range(world)]
    deadline = time.monotonic() + timeout_s + 40
    try:
        for r in ranks:
            r.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        left = [r for r in ranks if r.proc.poll() is None]
        for r in left:
            r.proc.kill()
        for r in ranks:
            r.proc.wait()
            r.reader.join(timeout=5)
        assert not left, "rank(s) still running at the deadline:\n" + "\n---\n".join(r.output for r in ranks)
    return ranks


def check_reported(waiting: Rank, bad: Rank, place: str) -> None:
    """The waiting rank reported in time, naming rank 1 and ``place``; both ranks then ended."""
    out = waiting.output
    started = bad.first("FAULT-START")
    reported = waiting.first("fastddp stall report")
    assert started is not None, bad.output
    assert reported is not None, out
    assert reported - started <= THRESHOLD_S + MARGIN_S, (reported - started, out)
    assert "lagging: rank 1" in out, out
    assert place in out, out
    # at the timeout the waiting rank's collective fails with every rank's status in its error
    assert waiting.proc.returncode != 0 and "What every rank was doing when it failed:" in out, out
    # and the rank that hung ends too, with the report (the abort posted through the store, or
    # after its own collective's timeout error, the latest stall report)
    assert bad.proc.returncode != 0, bad.output
    assert "lagging: rank 1" in bad.output, bad.output


# The gloo path's case runs with --run-slow (CI time): the shared-memory one stays in every run.
@pytest.mark.parametrize("shm", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["shm", "gloo"])
def test_rank_stuck_in_forward(tmp_path: Path, shm: bool) -> None:
    waiting, bad = run_fault(tmp_path, "stuck_forward", shm)
    check_reported(waiting, bad, "rank 1: forward for")
    assert "hang_worker.py" in waiting.output and "in forward" in waiting.output


def test_a_training_loop_in_another_thread_is_described_where_it_trains(tmp_path: Path) -> None:
    """The wrapper built in the main thread, the loop run in a thread of its own: the report
    shows each rank's training thread (rank 1 in its forward), not the main thread's join()."""
    waiting, bad = run_fault(tmp_path, "stuck_forward_in_thread")
    check_reported(waiting, bad, "rank 1: forward for")
    assert "in forward" in waiting.output and "in join" not in waiting.output, waiting.output


def test_rank_stuck_in_data_loading(tmp_path: Path) -> None:
    waiting, bad = run_fault(tmp_path, "stuck_data")
    check_reported(waiting, bad, "loading data (")


def test_ranks_reporting_at_the_same_moment_each_get_every_answer(tmp_path: Path) -> None:
    """Three ranks, rank 1 stuck in its forward: ranks 0 and 2 wait on it and start their reports
    together. Each names rank 1 and where it is, and neither says a live rank did not answer
    (a rank answered only the newest request, and none while it collected its own)."""
    ranks = run_ranks(tmp_path, "stuck_forward", world=3)
    for waiting in (ranks[0], ranks[2]):
        lines = waiting.output.splitlines()
        start = next(i for i, line in enumerate(lines) if line.startswith("fastddp stall report"))
        end = next(i for i in range(start, len(lines)) if lines[i].lstrip().startswith("lagging:"))
        report = "\n".join(lines[start:end + 1])  # the first report, before the timeout's errors
        assert "lagging: rank 1" in report and "rank 1: forward for" in report, report
        assert "no answer" not in report and "did not answer" not in report, report


def test_a_timed_out_collective_of_the_script_ends_every_rank_with_a_report(tmp_path: Path) -> None:
    """The script's own dist.barrier() after each step; rank 1 is stuck before it, outside any
    collective. Rank 0's barrier times out uncaught: it ends with every rank's status (rank 1
    named where it is), and rank 1 ends too instead of sleeping on forever."""
    waiting, bad = run_fault(tmp_path, "sleeps_before_barrier")
    out = waiting.output
    assert waiting.proc.returncode != 0 and "What every rank was doing when it failed:" in out, out
    assert "fastddp: a collective of the script failed on this rank." in out, out
    assert "rank 1: outside fastddp" in out and "hang_worker.py" in out, out
    assert bad.proc.returncode != 0, bad.output
    assert "What every rank was doing when it failed:" in bad.output, bad.output


def test_rank_in_a_different_collective(tmp_path: Path) -> None:
    """Rank 0 takes one more step than rank 1, which has gone on to a barrier."""
    waiting, bad = run_fault(tmp_path, "extra_step")
    check_reported(waiting, bad, "in torch.distributed.barrier called at")
    assert "rank 0: all-reduce of bucket" in waiting.output


def test_rank_with_fewer_batches_and_no_join(tmp_path: Path) -> None:
    waiting, bad = run_fault(tmp_path, "fewer_batches", shm=False)
    check_reported(waiting, bad, "in torch.distributed.all_gather called at")


# The gloo path's case runs with --run-slow (CI time): the shared-memory one stays in every run.
@pytest.mark.parametrize("shm", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["shm", "gloo"])
def test_rank_killed_during_the_all_reduce(tmp_path: Path, shm: bool) -> None:
    waiting, bad = run_fault(tmp_path, "killed", shm)
    assert bad.proc.returncode == -9
    assert waiting.proc.returncode != 0
    out = waiting.output
    assert "DDPWrapper: the all-reduce of bucket 0 failed on rank 0" in out, out
    if shm:  # the shared-memory wait watches its peers' processes
        assert "rank 1 (pid" in out and "exited during collective" in out, out
    assert "rank 1: no answer (the process is gone" in out, out  # the report of every rank
    assert "rank 0: all-reduce of bucket 0" in out, out


# The gloo path's case runs with --run-slow (CI time): the shared-memory one stays in every run.
@pytest.mark.parametrize("shm", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["shm", "gloo"])
def test_rank_ended_by_an_uncaught_exception_is_named_with_it(tmp_path: Path, shm: bool) -> None:
    """Rank 1's script raises: its exception hook posts the exception and its line through the
    store, so rank 0's error says why rank 1 is gone (not "no answer") and where."""
    waiting, bad = run_fault(tmp_path, "raises", shm)
    assert bad.proc.returncode == 1 and "ValueError: bad batch (simulated)" in bad.output, bad.output
    out = waiting.output
    assert waiting.proc.returncode != 0, out
    assert "rank 1: ended with an uncaught ValueError: bad batch (simulated) at " in out, out
    assert "hang_worker.py:" in out.split("rank 1: ended with an uncaught ValueError")[1].splitlines()[0], out
    assert "lagging: rank(s) 1 ended (see above)." in out, out


def test_rank_whose_process_ended_with_an_error_is_not_said_to_have_destroyed_its_wrapper(tmp_path: Path) -> None:
    """Rank 1 raises after a reduced backward; rank 0 waits in the next step's shared-memory
    all-reduce. Its error says that rank 1's process ended (the wrapper went with it), not that
    rank 1 destroyed its DDPWrapper and rank 0 ran a forward more, and the report names the
    exception."""
    waiting, bad = run_fault(tmp_path, "raises_after_backward")
    assert bad.proc.returncode == 1 and "optimizer step failed (simulated)" in bad.output, bad.output
    out = waiting.output
    assert waiting.proc.returncode != 0, out
    assert "rank 1's process ended (its script returned, exited or raised" in out, out
    assert "destroyed its DDPWrapper" not in out, out
    assert "rank 1: ended with an uncaught RuntimeError: optimizer step failed (simulated)" in out, out


def test_rank_that_skipped_a_backward_is_named(tmp_path: Path) -> None:
    """Rank 1 skips the backward of one step (after its forward): its next forward's buffer
    broadcast meets rank 0's bucket all-reduce on the shared-memory path, and both ranks raise
    at once, naming the rank that ran the forward more and why that happens."""
    waiting, bad = run_fault(tmp_path, "skips_backward")
    for rank in (waiting, bad):
        assert rank.proc.returncode != 0, rank.output
        assert "the ranks issued different collectives" in rank.output, rank.output
        assert ("Rank 1 is in a forward where rank 0 reduces a backward: rank 1 ran a forward (gradients on) whose "
                "backward did not run, or one forward more.") in rank.output, rank.output
        assert "fastddp stall report" not in rank.output, rank.output  # raised before the threshold


def test_rank_that_skipped_a_backward_is_named_in_the_stall_report_on_gloo(tmp_path: Path) -> None:
    """The same fault over gloo, which cannot tell the two collectives apart: the stall report
    counts the reducing steps each rank started (a forward with gradients on counts before its
    buffer broadcast) and names rank 1 as the rank a forward ahead."""
    for attempt in ("first", "again"):
        (tmp_path / attempt).mkdir()
        waiting, bad = run_fault(tmp_path / attempt, "skips_backward", shm=False)
        if "rank 1: no answer" not in waiting.output:
            break  # else rank 1's watchdog starved past the report's deadline (a loaded machine)
    out = waiting.output
    assert waiting.first("fastddp stall report") is not None, out
    assert "rank 1: buffer broadcast for" in out and "rank 0: all-reduce of bucket 0" in out, out
    assert ("rank 1 started 3 reducing steps, rank 0 2: a forward (gradients on, outside no_sync()) whose "
            "backward did not run, or a forward more, on rank 1") in out, out
    assert waiting.proc.returncode != 0 and bad.proc.returncode != 0, bad.output


# The gloo path's case runs with --run-slow (CI time): the shared-memory one stays in every run.
@pytest.mark.parametrize("shm", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["shm", "gloo"])
def test_rank_whose_script_ended_early_is_named_with_its_steps(tmp_path: Path, shm: bool) -> None:
    """Rank 1 runs out of batches and its script ends normally (uneven inputs without join()):
    rank 0's error says that rank 1 ended without an error after 3 reducing steps."""
    waiting, bad = run_fault(tmp_path, "ends_early", shm)
    assert bad.proc.returncode == 0 and "DONE" in bad.output, bad.output
    out = waiting.output
    assert waiting.proc.returncode != 0, out
    assert ("rank 1: ended without an error after 3 reducing step(s) (its script returned or called exit; "
            "if the others still train, the ranks had uneven inputs: see DDPWrapper.join(); or this rank ran a "
            "forward (gradients on) whose backward did not run, so each later reduction paired its step with "
            "another rank's earlier one)") in out, out


def test_rank_evaluating_alone_is_named_as_evaluating_and_training_goes_on(tmp_path: Path) -> None:
    """Rank 1 evaluates on its own (forwards without gradients through the wrapper, as scripts
    do on rank 0) for longer than the stall threshold, while rank 0 waits in its next
    reduction: the report names the evaluation and says the wait is expected if it is on
    purpose; then both ranks finish training."""
    waiting, bad = run_fault(tmp_path, "evaluates_alone", timeout_s=30.0)
    out = waiting.output
    assert waiting.proc.returncode == 0 and bad.proc.returncode == 0, (out, bad.output)
    assert "DONE" in out and "DONE" in bad.output
    assert "rank 1: forward without gradients for" in out, out
    assert "lagging: rank 1 (forward, " in out, out
    assert "It runs forwards without gradients (an evaluation): if it evaluates alone on purpose" in out, out
