"""This process's stall watchdog (csrc/diag/watchdog.h): started by the first DDPWrapper of a
job, on by default. It reads the status board the reducer and the wrapper keep, and reaches the
other ranks through the default group's c10d store.

Settings: ``DDPWrapper(stall_threshold_s=...)`` or ``FASTDDP_STALL_THRESHOLD_S`` (seconds a wait on
the other ranks may last before it is reported; default 30, or half the process-group timeout
when that is shorter); ``FASTDDP_WATCHDOG=0`` switches it off."""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import Any, Optional

import torch.distributed as dist

from .._ext import C
from .._pg_options import group_timeout_s
from .stacks import describe_exception, describe_thread

DEFAULT_THRESHOLD_S = 30.0
_STORE_PREFIX = "fastddp/diag/"


class _Running:
    """The process's one watchdog and the default group it watches."""

    watchdog: Any = None
    group: Any = None
    store: Any = None  # the watchdog's store, where this rank posts why it ended, for the others
    rank: Optional[int] = None
    pid: Optional[int] = None  # the process that started it (a forked child is not that rank)
    posted = False  # the reason this rank ended is posted (an uncaught exception comes first)
    hooked = False  # sys.excepthook posts the exception and prints the latest report
    thread: Optional[int] = None  # the thread that trains: the one that ran the last reducing forward


def note_training_thread() -> None:
    """The calling thread trains (a reducing forward starts in it): its stack goes into the
    reports. A script that builds the wrapper in one thread and trains in another is described
    where it trains."""
    _Running.thread = threading.get_ident()


def stall_threshold_s(given: Optional[float], timeout_s: float) -> float:
    """The threshold from the argument, else the environment, else the default; checked."""
    source = "stall_threshold_s"
    value: Any = given
    if value is None and os.environ.get("FASTDDP_STALL_THRESHOLD_S"):
        source, value = "FASTDDP_STALL_THRESHOLD_S", os.environ["FASTDDP_STALL_THRESHOLD_S"]
    if value is None:
        return min(DEFAULT_THRESHOLD_S, timeout_s / 2)
    try:
        threshold = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"DDPWrapper: {source} must be a number of seconds, got {value!r}") from None
    if not 0 < threshold < timeout_s:
        raise ValueError(f"DDPWrapper: {source}={threshold:g} s must be > 0 and below the process-group "
                         f"timeout ({timeout_s:g} s): a stall is reported before the group gives up. "
                         "Lower it, or pass a longer timeout to init_process_group.")
    return threshold


def enabled() -> bool:
    """False when ``FASTDDP_WATCHDOG=0`` switches the watchdog off."""
    return os.environ.get("FASTDDP_WATCHDOG", "1").strip().lower() not in ("0", "false", "no", "off")


def ensure_started(threshold_s: Optional[float] = None) -> Any:
    """Start the watchdog for the default process group unless it runs already (or is off, or
    the world has one rank). Returns the running ``C.Watchdog`` or None."""
    if not enabled() or not dist.is_initialized():
        return None
    world = dist.group.WORLD
    timeout = group_timeout_s(world)
    threshold = stall_threshold_s(threshold_s, timeout)  # checked even when one already runs
    if _Running.watchdog is not None and _Running.group is world:
        return _Running.watchdog
    stop()
    if dist.get_world_size() == 1:
        return None
    store = dist.PrefixStore(_STORE_PREFIX, dist.distributed_c10d._get_default_store())
    options = C.WatchdogOptions()
    options.rank, options.world = dist.get_rank(), dist.get_world_size()
    options.threshold_s, options.timeout_s = threshold, timeout
    # Every rank reads the store once a poll: a large world polls less often, so that the
    # store's host serves at most about 256 reads a second.
    options.poll_s = min(threshold / 4, max(0.5, options.world / 256))
    _Running.thread = threading.get_ident()  # until a reducing forward runs in another thread
    _Running.watchdog = C.Watchdog(store, options, lambda: describe_thread(_Running.thread))
    _Running.group, _Running.store, _Running.rank = world, store, options.rank
    _Running.pid = os.getpid()
    if not _Running.hooked:
        _report_after_uncaught_errors()
        _Running.hooked = True
    return _Running.watchdog


def _report_after_uncaught_errors() -> None:
    """An uncaught exception (a collective's timeout in the training script, say) ends with
    the latest stall report of the job, so every rank's log says who was stuck where."""
    previous = sys.excepthook

    def hook(kind: type, value: BaseException, tb: Any) -> None:
        _post_exit_reason("with an uncaught " + describe_exception(kind, value, tb))
        told = "What every rank was doing" in str(value) + "".join(getattr(value, "__notes__", []))
        failed = "" if told else _report_collective_failure(value)
        previous(kind, value, tb)
        report = last_report()
        if report and not told:
            print(f"fastddp: the latest stall report before this error:\n{report}", file=sys.stderr)
        elif failed:  # no stall report: the wait was the script's, not fastddp's
            print(f"fastddp: a collective of the script failed on this rank.\n{failed}", file=sys.stderr)

    sys.excepthook = hook
    previous_threading = threading.excepthook

    def thread_hook(args: Any) -> None:  # an uncaught error in a thread that trains
        if args.thread is not None and args.thread.ident == _Running.thread and args.exc_type is not SystemExit:
            hook(args.exc_type, args.exc_value, args.exc_traceback)
        else:
            previous_threading(args)

    threading.excepthook = thread_hook


def _report_collective_failure(error: BaseException) -> str:
    """For a collective of the script itself (a ``dist.barrier()`` or metric ``all_reduce``
    that timed out or lost its peer) that ends this rank uncaught: every rank's status, posted
    so that the other ranks end with it too (a rank stuck outside any collective would
    otherwise never learn that the job is over). '' for any other error."""
    from . import _REPORTED, _collective_failure

    if not _collective_failure(error) or _Running.pid != os.getpid():
        return ""
    return C.diag_collective_failed(_REPORTED)


def _post_exit_reason(line: str) -> None:
    """Tell the other ranks' reports why this rank is ending ("rank 1: ended with an uncaught
    ValueError: … at train.py:40 in step") instead of "no answer". Bounded: a store whose host
    is gone must not hold up the exit."""
    store, rank = _Running.store, _Running.rank
    if store is None or rank is None or _Running.posted or _Running.pid != os.getpid():
        return  # (a forked child that exits normally is not the rank ending)
    if _Running.watchdog is not None and _Running.watchdog.store_failed:
        return  # its host is gone (a killed torchrun agent): nobody is left to read it
    _Running.posted = True
    poster = threading.Thread(target=_set_quietly, args=(store, f"exit/{rank}", line), daemon=True)
    poster.start()
    poster.join(timeout=2.0)


def _post_script_end() -> None:
    """At the interpreter's exit without an uncaught exception: a rank that ran out of batches
    while the others train on (uneven inputs without join()) is reported as such."""
    if _Running.store is None:
        return
    started = C.diag_snapshot()[2]
    _post_exit_reason(f"without an error after {started} reducing step(s) (its script returned or called "
                      "exit; if the others still train, the ranks had uneven inputs: see DDPWrapper.join(); "
                      "or this rank ran a forward (gradients on) whose backward did not run, so each later "
                      "reduction paired its step with another rank's earlier one)")


def _set_quietly(store: Any, key: str, value: str) -> None:
    try:
        store.set(key, value)
    except Exception:  # the store may be gone; the exit goes on
        pass


def stop() -> None:
    """Stop the watchdog (at exit, or when the default group it watched is gone)."""
    if _Running.pid is not None and _Running.pid != os.getpid():
        return  # a forked child: the watchdog is the parent's (its thread is not here)
    if _Running.watchdog is not None:
        _Running.watchdog.stop()
    _Running.watchdog = _Running.group = None


def last_report() -> str:
    """The last stall report this process printed or received ('' when none)."""
    return _Running.watchdog.last_report if _Running.watchdog is not None else ""


atexit.register(stop)
atexit.register(_post_script_end)  # runs first (atexit is last in, first out)
