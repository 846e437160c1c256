"""Forked children that collect the parent's garbage (tests of fork safety)."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import time
from collections.abc import Callable, Iterator


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
    return _exit_code_within(pid, seconds)


def child_error_within(fn: Callable[[], object], seconds: float) -> str | None:
    """Fork a child that calls ``fn``: the message of the exception it raised ("" when it
    raised none), or None if it was still running after ``seconds`` (then killed)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        message = ""
        try:
            fn()
        except Exception as e:  # the child reports whatever it raised
            message = str(e) or type(e).__name__
        finally:
            os.write(write_end, message.encode()[:60000])
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        if _exit_code_within(pid, seconds) is None:
            return None
        return f.read().decode()


def _exit_code_within(pid: int, seconds: float) -> int | None:
    """The exit status of child ``pid``, None if it was still running after ``seconds`` (then
    killed)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None
