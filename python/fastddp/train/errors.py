"""The launcher's error for input a user can fix."""

from __future__ import annotations


class UsageError(ValueError):
    """A bad flag or input; the launcher prints it as one line and exits with status 2
    (with the traceback too under ``--debug`` or ``FASTDDP_DEBUG=1``).

    ``shared``: every rank raises the same error from the same verdict (rank 0's, broadcast,
    or the same checkpoint), so rank 0 alone prints it; any other error of a run is printed by
    each rank that raises it."""

    def __init__(self, message: str, *, shared: bool = False) -> None:
        super().__init__(message)
        self.shared = shared
