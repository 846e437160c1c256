"""Small networking helpers shared by the launcher pieces."""

from __future__ import annotations

import random
import socket

# Rendezvous ports are drawn from [_FIRST_PORT, the start of the kernel's ephemeral range).
_FIRST_PORT = 20000
_EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
_TORCH_DEFAULTS = (29400, 29500)  # torchrun's and torch.distributed's default ports: left to them


def _ephemeral_start() -> int:
    """The first port of the range the kernel hands to bind(port 0) and to outgoing sockets."""
    try:
        with open(_EPHEMERAL_RANGE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a local rendezvous server).

    Drawn below the kernel's ephemeral range: a port from that range can be given to any other
    process's socket between this check and the server's bind (gloo's pair listeners take theirs
    from it), and the rendezvous clients would then connect to that socket, breaking another
    job's connections instead of failing here. Two callers that draw the same port meet as one
    server's bind failing, loudly. The draw uses a generator of its own: the global ``random``
    state is the script's. Falls back to a port the kernel picks when the range leaves no room."""
    start = _ephemeral_start()
    if start - _FIRST_PORT >= 1024:
        draw = random.Random()
        for _ in range(64):
            port = draw.randrange(_FIRST_PORT, start)
            if port not in _TORCH_DEFAULTS and _bindable(port):
                return port
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
