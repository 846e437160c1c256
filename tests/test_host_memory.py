"""fastddp.train's --host-memory: glibc keeps freed memory for the next step (no mapping of its
own for a large block, no trimming), checked through glibc's own accounting (mallinfo2)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fastddp.train import host_memory
from fastddp.train.cli import UsageError, parse_args, validate

pytestmark = pytest.mark.skipif(not host_memory.glibc(), reason="glibc's allocator only")

_PROBE = """
import ctypes, sys
import torch
from fastddp.train import host_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "keep":
    host_memory.keep_freed_memory()
mapped, heap = [], []
for _ in range(3):  # a step's gradient, freed and made again
    before = libc.mallinfo2().hblkhd  # blocks mapped before (e.g. by imports)
    t = torch.empty(16 << 20, dtype=torch.float32).fill_(1.0)  # 64 MiB
    mapped.append(libc.mallinfo2().hblkhd - before)
    del t
    heap.append(libc.mallinfo2().arena)
print(min(mapped) >> 20, min(heap) >> 20)
"""


def _probe(mode: str) -> tuple[int, int]:
    """MiB more in blocks with a mapping of their own while a 64 MiB tensor lives, and MiB of heap
    after it is freed (the least of three allocations)."""
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    mapped, heap = out.stdout.split()
    return int(mapped), int(heap)


def test_keep_serves_a_large_tensor_from_the_heap_and_keeps_it_after_free() -> None:
    mapped, heap = _probe("keep")
    assert mapped == 0 and heap >= 64


def test_release_maps_a_large_tensor_of_its_own() -> None:
    mapped, _ = _probe("release")
    assert mapped >= 64


def test_keep_without_glibc_is_one_clear_error(monkeypatch) -> None:
    monkeypatch.setattr(host_memory, "glibc", lambda: False)
    with pytest.raises(UsageError, match=r"--host-memory keep needs glibc"):
        validate(parse_args(["--host-memory", "keep"]), 0)
    validate(parse_args(["--host-memory", "auto"]), 0)  # auto leaves the allocator as it is
