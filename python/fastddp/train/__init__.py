"""``python -m fastddp.train``: the HAR training launcher (see ``--help``)."""

from __future__ import annotations

import sys

from .cli import UsageError, build_parser, parse_args, validate

__all__ = ["UsageError", "build_parser", "main", "parse_args"]


def main(argv: list[str] | None = None) -> int:
    """Parse flags, validate them, train; bad input -> one line on stderr and exit status 2."""
    import os

    import torch

    rank = int(os.environ.get("RANK", "0"))
    try:
        args = parse_args(argv)
        validate(args, torch.cuda.device_count())
        from .loop import run

        run(args)
    except UsageError as exc:
        if rank == 0:
            print(f"fastddp.train: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except FloatingPointError as exc:
        print(f"fastddp.train: rank {rank}: error: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print(f"fastddp.train: rank {rank}: interrupted", file=sys.stderr, flush=True)
        return 130
    return 0
