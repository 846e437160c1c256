"""The launcher's error for input a user can fix."""

from __future__ import annotations

import re


class UsageError(ValueError):
    """A bad flag or input; the launcher prints it as one line and exits with status 2
    (with the traceback too under ``--debug`` or ``FASTDDP_DEBUG=1``).

    ``shared``: every rank raises the same error from the same verdict (rank 0's, broadcast,
    or the same checkpoint), so rank 0 alone prints it; any other error of a run is printed by
    each rank that raises it.

    ``flag``: the flag the error is about (``"--lr"``), so that an error about a value a
    ``--config`` file set can name the file's key. By default the flag the message starts
    with (the launcher's messages do: ``--lr must be ...``); a message that names its flag
    later passes it (``unknown --mode ...``, ``flag="--mode"``)."""

    def __init__(self, message: str, *, shared: bool = False, flag: str | None = None) -> None:
        super().__init__(message)
        self.shared = shared
        self.flag = flag if flag is not None else leading_flag(message)


def leading_flag(message: str) -> str | None:
    """The ``--flag`` a message starts with, or None."""
    match = re.match(r"--[a-z][a-z0-9-]*", message)
    return match.group(0) if match else None
