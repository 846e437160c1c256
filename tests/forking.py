"""Forked children that collect the parent's garbage (tests of fork safety)."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import time
from collections.abc import Iterator


@contextlib.contextmanager
def garbage_kept_until_forked() -> Iterator[None]:
    """Inside the block the cyclic garbage collector is off, so an object left in a reference
    cycle is still there at a fork (Python collects it in the child, as a DataLoader worker's
    first allocations do); on leaving, the parent collects it."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect()


def child_collects_within(seconds: float) -> int | None:
    """Fork a child (``os.fork``, as DataLoader's workers are made; also from a daemonic
    process) that runs the collector and exits: its exit status, None if it was still running
    after ``seconds`` (then killed)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            gc.collect()
            code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None
