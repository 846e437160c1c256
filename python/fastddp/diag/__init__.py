"""Desync and hang diagnostics: the status board each process keeps (what fastddp is doing)
and the stall watchdog that reports, across ranks, who is stuck where (docs/debugging.md)."""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator

from .._ext import C
from .watchdog import ensure_started, last_report, stop


class Phase(enum.IntEnum):
    """What this process is doing in fastddp (csrc/diag/status.h)."""

    OUTSIDE = 0
    FORWARD = 1
    BACKWARD = 2
    ALLREDUCE = 3
    USED_MAP = 4
    BROADCAST = 5
    JOIN = 6
    SETUP = 7
    REBUILD = 8


def enter(phase: Phase, detail: int = -1) -> None:
    """Record that this process is now in ``phase``."""
    C.diag_enter(int(phase), detail)


@contextlib.contextmanager
def phase(waiting: Phase) -> Iterator[None]:
    """Inside the block this process is in ``waiting``; after it, in the phase it was in."""
    before, detail = C.diag_snapshot()[:2]
    enter(waiting)
    try:
        yield
    finally:
        C.diag_enter(before, detail)


__all__ = ["Phase", "ensure_started", "enter", "last_report", "phase", "stop"]
