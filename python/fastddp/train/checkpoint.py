"""Checkpoints that survive a crash mid-write and detect corruption.

``save`` serialises to memory, writes ``<name>.tmp``, fsyncs and renames it over ``<name>``
(rename is atomic on POSIX), after keeping the previous file as ``<name>.prev``. A SHA-256 of
the bytes is stored beside it (``<name>.sha256``). ``load`` verifies the checksum and falls
back to ``.prev`` with a warning when the newest file is truncated or corrupted.
"""

from __future__ import annotations

import hashlib
import io
import os
import warnings
from pathlib import Path
from typing import Any

import torch


class CheckpointError(RuntimeError):
    """No usable checkpoint (corrupt, or written by a different model)."""


def _fsync_write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def save(state: dict[str, Any], path: str | os.PathLike) -> None:
    """Atomically write ``state`` to ``path`` with a checksum; keeps the previous as ``.prev``."""
    path = Path(path)
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    digest = hashlib.sha256(data).hexdigest()
    tmp = path.with_name(path.name + ".tmp")
    _fsync_write(tmp, data)
    _fsync_write(path.with_name(path.name + ".sha256.tmp"), digest.encode())
    if path.exists():
        os.replace(path, path.with_name(path.name + ".prev"))
        old_sum = path.with_name(path.name + ".sha256")
        if old_sum.exists():
            os.replace(old_sum, path.with_name(path.name + ".prev.sha256"))
    # Checksum first: a crash between the two renames leaves a checkpoint whose checksum
    # does not match, which load() detects and answers with the .prev fallback.
    os.replace(path.with_name(path.name + ".sha256.tmp"), path.with_name(path.name + ".sha256"))
    os.replace(tmp, path)


def _verified(path: Path) -> dict[str, Any]:
    data = path.read_bytes()
    sum_file = path.with_name(path.name + ".sha256")
    if sum_file.exists():
        expected = sum_file.read_text().strip()
        actual = hashlib.sha256(data).hexdigest()
        if actual != expected:
            raise CheckpointError(f"{path}: checksum mismatch (file is truncated or corrupted)")
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
    except Exception as exc:
        raise CheckpointError(f"{path}: cannot be read as a checkpoint ({exc})") from exc


def load(path: str | os.PathLike) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save`, verifying its checksum.

    Falls back to ``<path>.prev`` (with a warning) when ``path`` is corrupt; raises
    :class:`CheckpointError` naming both files when neither is usable.
    """
    path = Path(path)
    try:
        return _verified(path)
    except (CheckpointError, OSError) as first:
        prev = path.with_name(path.name + ".prev")
        if prev.exists():
            try:
                state = _verified(prev)
            except (CheckpointError, OSError) as second:
                raise CheckpointError(f"no usable checkpoint: {first}; {second}") from None
            warnings.warn(f"{first}; resuming from the previous checkpoint {prev}", stacklevel=2)
            return state
        raise CheckpointError(f"{first}; no previous checkpoint to fall back to. Delete it or "
                              "start fresh with --resume none") from None
