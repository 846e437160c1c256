"""The stall watchdog's fault matrix: two gloo ranks, rank 1 misbehaves, and within the stall
threshold plus a small margin rank 0 prints a report naming rank 1 and where it is; at the
process-group timeout both ranks end with that report and a non-zero status (no process is
left behind). One fault per test; each starts its own two processes."""

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
TIMEOUT_S = 15.0
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


def run_fault(tmp_path: Path, fault: str, shm: bool = True) -> tuple[Rank, Rank]:
    env = {**os.environ, "FASTDDP_STALL_THRESHOLD_S": str(THRESHOLD_S), "PYTHONUNBUFFERED": "1"}
    init = tmp_path / "init"
    ranks = [Rank([fault, str(r), "2", str(init), str(TIMEOUT_S), "1" if shm else "0"], env) for r in range(2)]
    deadline = time.monotonic() + TIMEOUT_S + 40
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
        assert not left, f"rank(s) still running at the deadline:\n{ranks[0].output}\n---\n{ranks[1].output}"
    return ranks[0], ranks[1]


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
    for r in (waiting, bad):
        assert r.proc.returncode != 0, r.output
        assert "exits with status 1 (stalled past the process-group timeout)" in r.output, r.output
    assert "fastddp stall report" in bad.output  # the rank that hung ends with the same report


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "gloo"])
def test_rank_stuck_in_forward(tmp_path: Path, shm: bool) -> None:
    waiting, bad = run_fault(tmp_path, "stuck_forward", shm)
    check_reported(waiting, bad, "rank 1: forward for")
    assert "hang_worker.py" in waiting.output and "in forward" in waiting.output


def test_rank_stuck_in_data_loading(tmp_path: Path) -> None:
    waiting, bad = run_fault(tmp_path, "stuck_data")
    check_reported(waiting, bad, "loading data (")


def test_rank_in_a_different_collective(tmp_path: Path) -> None:
    """Rank 0 takes one more step than rank 1, which has gone on to a barrier."""
    waiting, bad = run_fault(tmp_path, "extra_step")
    check_reported(waiting, bad, "in torch.distributed.barrier called at")
    assert "rank 0: all-reduce of bucket" in waiting.output


def test_rank_with_fewer_batches_and_no_join(tmp_path: Path) -> None:
    waiting, bad = run_fault(tmp_path, "fewer_batches", shm=False)
    check_reported(waiting, bad, "in torch.distributed.all_gather called at")


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "gloo"])
def test_rank_killed_during_the_all_reduce(tmp_path: Path, shm: bool) -> None:
    waiting, bad = run_fault(tmp_path, "killed", shm)
    assert bad.proc.returncode == -9
    assert waiting.proc.returncode != 0
    assert "rank 1" in waiting.output or "Connection closed by peer" in waiting.output, waiting.output
