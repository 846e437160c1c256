"""``python -m fastddp.train``: the HAR training launcher (see ``--help``)."""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path
from typing import Any

from .cli import build_parser, parse_args
from .errors import UsageError
from .signals import Terminated
from .validate import launch_variable, validate

# What a collective raises on a surviving rank when a peer process dies or the link fails
# (gloo: the socket is reset/closed, or "Application timeout caused pair closure" when the
# link goes silent; NCCL/gloo: the --timeout expires). Matched case-insensitively.
_LOST_PEER = ("connection reset by peer", "connection closed by peer", "broken pipe",
              "timed out", "timeout", "nccl communicator was aborted", "connection refused",
              "pair closure")


def lost_peer_message(exc: BaseException, rank: int, world: int = 0) -> str | None:
    """One line for a collective that failed because another rank is gone, else None. In a
    world of two the lost rank is the other one and is named; otherwise torchrun's failure
    report names it."""
    import torch.distributed as dist

    backend_errors = tuple(getattr(dist, n) for n in ("DistBackendError", "DistNetworkError")
                           if hasattr(dist, n))
    text = str(exc)
    if not (isinstance(exc, backend_errors) or
            (isinstance(exc, RuntimeError) and any(k in text.lower() for k in _LOST_PEER))):
        return None
    first = re.sub(r"^\[[^\]]*\]\s*", "", text.strip().splitlines()[0] if text.strip() else "")
    first = textwrap.shorten(first.split(". This is typically")[0], 300, placeholder=" ...")
    peer = f"rank {1 - rank}" if world == 2 and rank in (0, 1) else "a peer process"
    return (f"fastddp.train: rank {rank}: lost contact with the other ranks during a collective "
            f"({first}); {peer} died, stopped responding, or the network failed - torchrun's failure report names "
            "the failed rank. Resume from the last checkpoint with --resume auto "
            "(or run under torchrun --max-restarts=N)")

__all__ = ["UsageError", "build_parser", "main", "parse_args"]


def _debug(argv: list[str] | None) -> bool:
    """``--debug`` on the command line or ``FASTDDP_DEBUG=1``: errors keep their traceback."""
    import os

    args = sys.argv[1:] if argv is None else argv
    return "--debug" in args or os.environ.get("FASTDDP_DEBUG", "") not in ("", "0")


def _prints_usage_error(exc: UsageError, started: bool, rank: int) -> bool:
    """Whether this rank prints ``exc``: each error once, and none left unprinted. The flags
    are checked (before ``started``) alike by the ranks of one machine, so its first rank
    prints their error (one line per machine); in the run, rank 0 prints an error every rank
    shares (:attr:`UsageError.shared`), and each rank its own."""
    if not started:
        return launch_variable("LOCAL_RANK") == 0
    return rank == 0 or not exc.shared


def _resume_hint(args: Any) -> str:
    """What to do after an interrupted run: resume, when it left a checkpoint to resume."""
    if args is not None and (Path(args.save_dir) / "last.pt").exists():
        return "Resume with --resume auto"
    return "No checkpoint was written yet: the next run starts from epoch 1"


def main(argv: list[str] | None = None) -> int:
    """Parse flags, validate them, train. Input the user can fix (a flag, a config file, a
    checkpoint, a full disk) ends with one line on stderr and exit status 2; ``--debug`` or
    ``FASTDDP_DEBUG=1`` adds the traceback."""
    import torch

    from .checkpoint import CheckpointWriteError

    rank = launch_variable("RANK")
    debug, started, args = _debug(argv), False, None
    try:
        args = parse_args(argv)
        debug = debug or args.debug  # --debug may come from the config file too
        validate(args, torch.cuda.device_count())
        from .loop import run

        started = True
        run(args)
    except UsageError as exc:
        if debug:
            raise
        if _prints_usage_error(exc, started, rank):
            who = "" if rank == 0 else f"rank {rank}: "
            print(f"fastddp.train: {who}error: {exc}", file=sys.stderr, flush=True)
        return 2
    except CheckpointWriteError as exc:
        if debug:
            raise
        print(f"fastddp.train: rank {rank}: error: {exc.strerror or exc}", file=sys.stderr,
              flush=True)
        return 2
    except FloatingPointError as exc:
        print(f"fastddp.train: rank {rank}: error: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print(f"fastddp.train: rank {rank}: interrupted (SIGINT, Ctrl-C) after finishing the "
              f"checkpoints in progress. {_resume_hint(args)}", file=sys.stderr, flush=True)
        return 130
    except Terminated:
        print(f"fastddp.train: rank {rank}: stopped by SIGTERM (torchrun stops the other ranks "
              "when one fails; a scheduler may have preempted the job) after finishing the "
              f"checkpoints in progress. {_resume_hint(args)}", file=sys.stderr, flush=True)
        return 128 + 15
    except Exception as exc:
        world = max(1, launch_variable("WORLD_SIZE"))
        line = lost_peer_message(exc, rank, world) if world > 1 and not debug else None
        if line is None:
            raise
        print(line, file=sys.stderr, flush=True)
        return 1
    return 0
