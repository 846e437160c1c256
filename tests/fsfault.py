"""Crash injection for the checkpoint writer: stop a process after its k-th file-system call.

Every change :mod:`fastddp.train.checkpoint` makes to the disk goes through ``os.open``,
``os.write``, ``os.fsync``, ``os.close``, ``os.link``, ``os.replace`` and ``os.unlink`` called
from that module. :func:`install` wraps these; calls made from the checkpoint module (on any
thread) are numbered and logged as ``index op file``, and after call number ``exit_after`` the
process ends on the spot with ``os._exit(137)``, as a SIGKILL would end it (no ``finally``, no
flush of anything the kernel does not already hold).

Run as a script it wraps ``python -m fastddp.train``, e.g. under torchrun::

    python tests/fsfault.py --exit-after 7 --log ops.txt -- --epochs 3 ...
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import threading
from collections.abc import Callable
from typing import Any, Optional

OPS = ("open", "write", "fsync", "close", "link", "replace", "unlink")
MODULE = "fastddp.train.checkpoint"


class Crash(BaseException):
    """Raised instead of exiting (``exit_after`` with ``action="raise"``): an in-process crash.
    After it, every further call from the module fails the same way, except ``close`` (a dead
    process's descriptors are closed by the kernel: no change on disk)."""


def install(exit_after: int, log: Optional[str] = None, action: str = "exit") -> dict[str, Any]:
    """Wrap the os calls; returns the counter (``{"n": calls so far, "crashed": bool}``).
    ``exit_after=0`` only counts and logs."""
    state: dict[str, Any] = {"n": 0, "crashed": False}
    lock = threading.Lock()
    log_file = open(log, "a", buffering=1) if log else None

    def wrap(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if sys._getframe(1).f_globals.get("__name__") != MODULE:
                return real(*args, **kwargs)
            with lock:
                if state["crashed"]:
                    if name == "close":
                        return real(*args, **kwargs)
                    raise Crash(f"{name} after the crash")
                result = real(*args, **kwargs)
                state["n"] += 1
                if log_file is not None:
                    target = args[-1] if name in ("link", "replace") else args[0]
                    target = os.path.basename(str(target)) if not isinstance(target, int) else "fd"
                    log_file.write(f"{state['n']} {name} {target}\n")
                if state["n"] == exit_after:
                    if action == "exit":
                        os._exit(137)
                    state["crashed"] = True
                    raise Crash(f"crashed after call {state['n']} ({name})")
                return result

        call.__wrapped__ = real  # type: ignore[attr-defined]
        return call

    for name in OPS:
        setattr(os, name, wrap(name, getattr(os, name)))
    return state


def uninstall() -> None:
    for name in OPS:
        fn = getattr(os, name)
        setattr(os, name, getattr(fn, "__wrapped__", fn))


def run_trainer(argv: list[str], out: str, exit_after: int = 0, log: Optional[str] = None,
                env: Optional[dict[str, str]] = None, path: Optional[str] = None) -> None:
    """``fastddp.train`` in this process (a forkserver child: torch is imported already),
    with the calls counted and the process ended after call ``exit_after``; stdout and stderr
    go to the file ``out``; the exit status is ``main``'s."""
    import torch

    os.environ.update(env or {})
    if path:
        sys.path.insert(0, path)
    torch.set_num_threads(1)
    sys.stdout = sys.stderr = open(out, "a", buffering=1)
    # a hang shows where each thread waits, then ends the process (the test's join fails)
    faulthandler.dump_traceback_later(90, exit=True, file=sys.stderr)
    install(exit_after, log)
    from fastddp.train import main as train_main

    code = train_main(argv)
    sys.stdout.flush()
    os._exit(code)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--exit-after", type=int, default=0)
    p.add_argument("--log", default=None)
    p.add_argument("train_args", nargs=argparse.REMAINDER)
    args = p.parse_args()
    install(args.exit_after, args.log)
    from fastddp.train import main as train_main

    rest = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    return train_main(rest)


if __name__ == "__main__":
    sys.exit(main())
