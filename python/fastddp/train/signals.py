"""SIGTERM as an exception, so that a stopped training process still finishes its checkpoints.

torchrun stops the surviving ranks with SIGTERM when one rank fails (and SIGKILLs them 30 s
later); schedulers preempt jobs the same way. Python's default answer to SIGTERM ends the
process at once, which would drop a checkpoint the background writer
(:class:`~fastddp.train.checkpoint.CheckpointWriter`) has not finished. :class:`SigtermGuard`
turns the first SIGTERM into :class:`Terminated`, raised in the main thread, so that ``finally``
blocks run and the writer is flushed; inside :meth:`SigtermGuard.shielded` (the clean-up
itself) the signal is only recorded: the process is ending anyway.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any, Optional


class Terminated(BaseException):
    """The process received SIGTERM. A ``BaseException`` (like ``KeyboardInterrupt``) so that
    ``except Exception`` clauses in training code do not swallow it."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(f"received {signal.Signals(signum).name}")
        self.signum = signum


class SigtermGuard:
    """Context manager: while active (in the main thread), SIGTERM raises :class:`Terminated`
    once; a second SIGTERM, or one that arrives inside :meth:`shielded`, does not interrupt
    the clean-up. Outside the main thread it does nothing (signals only reach the main thread).
    """

    def __init__(self) -> None:
        self.received = False
        self._raised = False
        self._shield_depth = 0
        self._previous: Any = None
        self._installed = False

    def __enter__(self) -> SigtermGuard:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
            self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)
            self._installed = False

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        self.received = True
        if self._shield_depth == 0 and not self._raised:
            self._raised = True
            raise Terminated(signum)

    @contextlib.contextmanager
    def shielded(self) -> Iterator[None]:
        """Run a clean-up that SIGTERM must not cut short; a SIGTERM meanwhile is only recorded
        in :attr:`received` (the process is on its way out already)."""
        self._shield_depth += 1
        try:
            yield
        finally:
            self._shield_depth -= 1
