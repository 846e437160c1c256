"""Desync and hang diagnostics: the status board each process keeps (what fastddp is doing)
and the stall watchdog that reports, across ranks, who is stuck where (docs/debugging.md)."""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator

import torch.distributed as dist

from .._ext import C
from .watchdog import ensure_started, last_report, note_training_thread, stop


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


FORWARD_WITHOUT_GRADIENTS = 1  # detail of a FORWARD with gradients off (csrc/diag/status.h)


def enter(phase: Phase, detail: int = -1) -> None:
    """Record that this process is now in ``phase``."""
    C.diag_enter(int(phase), detail)


def step_started() -> None:
    """Count a reducing step on the board: a forward with gradients on, outside ``no_sync()``,
    starts. Counted before the forward's own collectives (buffer broadcast), so a rank that ran a
    forward more than its peers shows a step more while it waits there."""
    C.diag_step_started()
    note_training_thread()


_REPORTED = "What every rank was doing when it failed:"


def _collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective's failure (a timeout, a lost peer), not a user error."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    return type(exc) is RuntimeError and any(k in text for k in ("gloo", "NCCL", "Timed out", "timed out"))


@contextlib.contextmanager
def phase(waiting: Phase) -> Iterator[None]:
    """Inside the block this process is in ``waiting``; after it, in the phase it was in. A
    collective that fails inside the block gets the watchdog's report of every rank added to
    its error, and the other ranks end with it (see csrc/diag/watchdog.h)."""
    before, detail = C.diag_snapshot()[:2]
    enter(waiting)
    try:
        yield
    except Exception as exc:
        notes = getattr(exc, "__notes__", [])
        if _collective_failure(exc) and not any(_REPORTED in n for n in notes):
            report = C.diag_collective_failed(_REPORTED)
            if report and hasattr(exc, "add_note"):
                exc.add_note(f"fastddp: {waiting.name.lower()} failed on this rank.\n{report}")
        raise
    finally:
        C.diag_enter(before, detail)


__all__ = ["Phase", "ensure_started", "enter", "last_report", "phase", "step_started", "stop"]
