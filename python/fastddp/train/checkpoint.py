"""Checkpoints that survive a crash mid-write and detect corruption.

``save`` serialises to memory, writes ``<name>.tmp``, fsyncs and renames it over ``<name>``
(rename is atomic on POSIX), after keeping the previous file as ``<name>.prev``. A SHA-256 of
the bytes is stored beside it (``<name>.sha256``). ``load`` verifies the checksum and falls
back to ``.prev`` with a warning when the newest file is truncated or corrupted.

:class:`CheckpointWriter` does the same with the write on a background thread: the state is
serialised at once (a snapshot: training may go on changing it) and the hashing, writing,
fsyncing and renaming, tens of milliseconds that every other rank would otherwise spend
waiting for rank 0, overlap the next steps.
"""

from __future__ import annotations

import hashlib
import io
import os
import queue
import threading
import warnings
from pathlib import Path
from typing import Any, Optional

import torch


class CheckpointError(RuntimeError):
    """No usable checkpoint (corrupt, or written by a different model)."""


def _fsync_write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _serialize(state: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def save(state: dict[str, Any], path: str | os.PathLike) -> None:
    """Atomically write ``state`` to ``path`` with a checksum; keeps the previous as ``.prev``."""
    _write(_serialize(state), Path(path))


def _write(data: bytes, path: Path) -> None:
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


class CheckpointWriter:
    """Writes checkpoints like :func:`save`, in the order given, on one background thread.

    :meth:`save` serialises ``state`` before it returns, so tensors changed afterwards do not
    leak into the file; the rest happens behind the caller's back. A file is on disk once
    :meth:`flush` or :meth:`close` returned; a crash before that leaves the previous checkpoint
    in place (the write is atomic either way). A write error is raised by the next
    :meth:`save`, :meth:`flush` or :meth:`close`. ``asynchronous=False`` writes in
    :meth:`save` itself.
    """

    def __init__(self, asynchronous: bool = True) -> None:
        self.asynchronous = asynchronous
        self._queue: queue.Queue[Optional[tuple[bytes, Path]]] = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None

    def save(self, state: dict[str, Any], path: str | os.PathLike) -> None:
        """Snapshot ``state`` now and write it to ``path`` (atomic, checksummed)."""
        self._raise_pending()
        data = _serialize(state)
        if not self.asynchronous:
            _write_explained(data, Path(path))
            return
        if self._thread is None:
            # Not a daemon: an interpreter that exits still finishes the queued writes.
            self._thread = threading.Thread(target=self._run, name="fastddp-checkpoint-writer")
            self._thread.start()
        self._queue.put((data, Path(path)))

    def flush(self) -> None:
        """Wait until every checkpoint given so far is on disk; raise a failed write's error."""
        if self._thread is not None:
            self._queue.join()
        self._raise_pending()

    def close(self) -> None:
        """Flush and stop the writer thread (a later :meth:`save` starts a new one)."""
        try:
            self.flush()
        finally:
            if self._thread is not None:
                self._queue.put(None)
                self._thread.join()
                self._thread = None

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if self._error is None:  # after a failure, queued writes are dropped
                    _write_explained(*item)
            except BaseException as exc:  # handed to the training thread by the next call
                self._error = exc
            finally:
                self._queue.task_done()

    def _raise_pending(self) -> None:
        if self._error is not None:
            exc, self._error = self._error, None
            raise exc


def _write_explained(data: bytes, path: Path) -> None:
    """:func:`_write`, with an OSError that names the file and what to check."""
    try:
        _write(data, path)
    except OSError as exc:
        msg = (f"checkpoint {path} could not be written ({exc}); the previous one is intact. "
               f"Check the free space and permissions of {path.parent}")
        raise (OSError(exc.errno, msg) if exc.errno is not None else OSError(msg)) from exc


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
