"""The launcher's error for input a user can fix."""

from __future__ import annotations


class UsageError(ValueError):
    """A bad flag or input; the launcher prints it as one line and exits with status 2
    (with the traceback too under ``--debug`` or ``FASTDDP_DEBUG=1``)."""
