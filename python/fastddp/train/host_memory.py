"""How a training process's C allocator treats freed memory (``--host-memory``).

glibc returns freed memory to the system eagerly: a block of 128 KiB or more gets a mapping of
its own, unmapped when freed, and the top of the heap is trimmed once enough of it is free
(both thresholds move with what was freed before). A training step frees what the next one
makes again (gradients freed by ``zero_grad(set_to_none=True)``, the optimizer's temporaries,
activations), so under those defaults a CPU step page-faults its large tensors in again, and how
many depends on the order of earlier frees: the same script steps at one speed in one process
and up to 40 % slower in the next. ``keep`` makes glibc keep freed memory for the next step, as
jemalloc and tcmalloc do: no allocation gets a mapping of its own and the heap is trimmed only
past 1 GiB free at its top. A process then holds its peak (its steady step's working set)."""

from __future__ import annotations

import ctypes
import platform

# <malloc.h>
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4
KEEP_TRIM_BYTES = 1 << 30


def glibc() -> bool:
    """Whether this process runs on glibc (whose mallopt this module calls)."""
    return platform.libc_ver()[0] == "glibc"


def mallopt(param: int, value: int) -> None:
    """glibc's ``mallopt(param, value)``; OSError when it is refused or the C library is not
    glibc."""
    if not glibc():
        raise OSError(f"mallopt needs glibc; this process runs on "
                      f"{platform.libc_ver()[0] or 'another C library'}")
    if ctypes.CDLL(None).mallopt(param, value) != 1:  # the C library this process already uses
        raise OSError(f"glibc's mallopt({param}, {value}) failed")


def keep_freed_memory() -> None:
    """Make glibc keep freed memory for the process's next allocations (see the module's
    docstring)."""
    mallopt(M_MMAP_MAX, 0)
    mallopt(M_TRIM_THRESHOLD, KEEP_TRIM_BYTES)
