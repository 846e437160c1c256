"""Small networking helpers shared by the launcher pieces."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a local rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Works of each process's last collective, kept until the interpreter exits (see below).
_FINAL_WORKS: list = []


def finish_collectives(group=None) -> None:
    """The last collective of a process: a barrier (every rank is done) whose Work is kept
    until the interpreter exits. A gloo worker thread releases each collective's tensors when
    it is done with the Work, which needs the GIL; if that release is still pending while the
    interpreter shuts down (a rank that leaves right after its last all-gather), the thread
    cannot take the GIL and the process aborts ("terminate called without an active
    exception"). The barrier's Work also holds the collectives still in flight when it was
    queued, and as long as it is referenced here they are freed by the main thread, not by a
    worker."""
    import torch.distributed as dist

    work = dist.barrier(group=group, async_op=True)
    work.wait()
    _FINAL_WORKS.append(work)
