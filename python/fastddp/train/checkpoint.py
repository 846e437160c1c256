"""Checkpoints that are consistent at every instant of a crash and detect corruption.

A checkpoint is one file: ``torch.save``'s zip archive whose zip comment holds the SHA-256 of
the archive (``fastddp-sha256:<hex>``). ``torch.load`` and any zip reader read it as usual;
the digest travels with the bytes, so no rename can separate a file from its checksum.

:func:`save` writes ``<name>`` in these steps (``<name>.prev`` keeps the previous one):

1. write ``<name>.tmp`` (payload and digest) and fsync it;
2. hard-link the current ``<name>`` as ``<name>.prev.tmp`` (a copy where links are not
   supported) and rename that over ``<name>.prev``;
3. rename ``<name>.tmp`` over ``<name>`` (atomic on POSIX), then fsync the directory.

``<name>`` is never moved away: at every instant it is either the previous or the new
checkpoint, complete. A crash after step 1 also leaves a complete ``<name>.tmp``.
:func:`latest` picks the most recently written of these files that verifies and says which
it took.

Files of the sidecar-digest layout (a plain ``torch.save`` file with its SHA-256 in
``<name>.sha256`` beside it) are verified through that file and load too.

:class:`CheckpointWriter` does the same with the write on a background thread: the state is
serialised at once (a snapshot: training may go on changing it) and the hashing, writing,
fsyncing and renaming, tens of milliseconds that every other rank would otherwise spend
waiting for rank 0, overlap the next steps.
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import queue
import struct
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch


class CheckpointError(RuntimeError):
    """No usable checkpoint (corrupt, or written by a different model)."""


class CheckpointWriteError(OSError):
    """A file of the run could not be written (disk full, permissions); the message names the
    file, says the previous one is intact and what to check."""


_EOCD = b"PK\x05\x06"  # zip end-of-central-directory record: 22 bytes + comment
_TAG = b"fastddp-sha256:"
_COMMENT_LEN = len(_TAG) + 64


def _with_digest(data: bytes) -> bytes:
    """``data`` (a zip archive without comment) with its SHA-256 as the zip comment."""
    if len(data) < 22 or data[-22:-18] != _EOCD or data[-2:] != b"\0\0":
        raise ValueError("torch.save did not produce a zip archive ending in its directory record")
    comment = _TAG + hashlib.sha256(data).hexdigest().encode()
    return data[:-2] + struct.pack("<H", len(comment)) + comment


def _embedded_digest(data: bytes) -> Optional[tuple[bytes, str]]:
    """``(archive as hashed, hex digest)`` for a file written by :func:`_with_digest`."""
    n = _COMMENT_LEN
    if len(data) < 22 + n or data[-n - 22:-n - 18] != _EOCD:
        return None
    if data[-n - 2:-n] != struct.pack("<H", n) or data[-n:-64] != _TAG:
        return None
    return data[:-n - 2] + b"\0\0", data[-64:].decode("ascii", "replace")


def _serialize(state: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return _with_digest(buf.getvalue())


def _sibling(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


# Every change to the file system below goes through os-level calls (open, write, fsync,
# close, link, replace, unlink) made from this module: the crash-injection tests enumerate
# them and stop the process after each one.
def _write_file(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # a platform without directory handles: the renames are still atomic
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def _unlink_if_present(path: Path) -> None:
    if os.path.lexists(path):
        os.unlink(path)


def _keep_previous(path: Path) -> None:
    """``path.prev`` becomes the current ``path`` (hard link, else copy); ``path`` stays."""
    prev, prev_tmp = _sibling(path, ".prev"), _sibling(path, ".prev.tmp")
    _unlink_if_present(prev_tmp)
    try:
        os.link(path, prev_tmp)
    except OSError:  # no hard links here (some network and FAT file systems)
        _write_file(prev_tmp, path.read_bytes())
    os.replace(prev_tmp, prev)
    legacy_sum = _sibling(path, ".sha256")
    if legacy_sum.exists():  # an earlier-layout file: its checksum goes with it
        _write_file(_sibling(prev, ".sha256.tmp"), legacy_sum.read_bytes())
        os.replace(_sibling(prev, ".sha256.tmp"), _sibling(prev, ".sha256"))
    else:
        _unlink_if_present(_sibling(prev, ".sha256"))


def write_atomic(data: bytes, path: str | os.PathLike, keep_previous: bool = False) -> None:
    """Write ``data`` to ``path`` through a fsync'd temporary and one atomic rename (the
    directory fsync'd after); ``keep_previous`` keeps the file it replaces as ``path.prev``."""
    path = Path(path)
    tmp = _sibling(path, ".tmp")
    _write_file(tmp, data)
    if keep_previous and path.exists():
        _keep_previous(path)
    os.replace(tmp, path)
    _unlink_if_present(_sibling(path, ".sha256"))  # a sidecar-digest layout's, stale once this file is written
    _fsync_dir(path.parent)


def complete_cut_off_save(path: str | os.PathLike) -> Path:
    """Finish the save of ``path`` that a stop cut off after its temporary was complete (steps
    2 and 3 of :func:`save`), before a run resumes from that temporary: the run's next save
    truncates ``path.tmp`` first, and a stop during it would otherwise lose the state it
    resumed from. Returns ``path``."""
    path = Path(path)
    if path.exists():
        _keep_previous(path)
    os.replace(_sibling(path, ".tmp"), path)
    _fsync_dir(path.parent)
    return path


def save(state: dict[str, Any], path: str | os.PathLike) -> None:
    """Write ``state`` to ``path`` with its checksum inside, crash-consistently; keeps the
    previous checkpoint as ``path.prev``."""
    write_atomic(_serialize(state), path, keep_previous=True)


_IDLE_CHECK_S = 0.2  # how often an idle writer thread looks whether the main thread has ended


class CheckpointWriter:
    """Writes checkpoints like :func:`save`, in the order given, on one background thread.

    :meth:`save` serialises ``state`` before it returns, so tensors changed afterwards do not
    leak into the file; the rest happens behind the caller's back. A file is on disk once
    :meth:`flush` or :meth:`close` returned; a crash before that leaves the previous checkpoint
    in place (the write is atomic either way). A write error is raised by the next
    :meth:`save`, :meth:`write`, :meth:`check`, :meth:`flush` or :meth:`close`.
    ``asynchronous=False`` writes in :meth:`save` itself.
    """

    def __init__(self, asynchronous: bool = True) -> None:
        self.asynchronous = asynchronous
        self._queue: queue.Queue[Optional[tuple[bytes, Path, bool]]] = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None

    def save(self, state: dict[str, Any], path: str | os.PathLike) -> None:
        """Snapshot ``state`` now and write it to ``path`` (atomic, checksummed)."""
        self._raise_pending()
        self.write(_serialize(state), path, keep_previous=True)

    def write(self, data: bytes, path: str | os.PathLike, keep_previous: bool = False) -> None:
        """Queue ``data`` for :func:`write_atomic` to ``path``, after the writes queued before
        (so a file written after a checkpoint never reaches the disk before it)."""
        self._raise_pending()
        if not self.asynchronous:
            write_file(data, path, keep_previous)
            return
        if self._thread is None:
            # Not a daemon: an interpreter that exits still finishes the queued writes.
            self._thread = threading.Thread(target=self._run, name="fastddp-checkpoint-writer")
            self._thread.start()
        self._queue.put((data, Path(path), keep_previous))

    def check(self) -> None:
        """Raise a failed write's error now, without waiting for the writes still queued (the
        training loop calls it every step, so a full disk stops the run within a step of the
        failed write instead of at the next checkpoint)."""
        self._raise_pending()

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
            try:
                item = self._queue.get(timeout=_IDLE_CHECK_S)
            except queue.Empty:
                # Every queued write is done: once the main thread has ended (its script
                # returned, or an interrupt cut close() short), nothing is left to wait for,
                # and a thread that stayed would keep the interpreter from exiting.
                if not threading.main_thread().is_alive():
                    return
                continue
            try:
                if item is None:
                    return
                if self._error is None:  # after a failure, queued writes are dropped
                    write_file(*item)
            except BaseException as exc:  # handed to the training thread by the next call
                self._error = exc
            finally:
                self._queue.task_done()

    def _raise_pending(self) -> None:
        if self._error is not None:
            exc, self._error = self._error, None
            raise exc


def write_file(data: bytes, path: str | os.PathLike, keep_previous: bool = False) -> None:
    """:func:`write_atomic`, raising :class:`CheckpointWriteError` (naming the file and what
    to check) for an OSError."""
    path = Path(path)
    try:
        write_atomic(data, path, keep_previous)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        msg = (f"{path} could not be written ({reason}); any previous one is intact. Free space "
               f"in {path.parent} or check its permissions, or choose another --save-dir, then "
               "resume with --resume auto")
        error = CheckpointWriteError(msg) if exc.errno is None else CheckpointWriteError(exc.errno, msg)
        raise error from exc


def verify(path: str | os.PathLike) -> dict[str, Any]:
    """Load one checkpoint file after checking its digest (embedded, or a sidecar-digest layout's
    ``.sha256`` beside it); :class:`CheckpointError` says what is wrong with it."""
    path = Path(path)
    data = path.read_bytes()
    embedded = _embedded_digest(data)
    if embedded is not None:
        archive, expected = embedded
        if hashlib.sha256(archive).hexdigest() != expected:
            raise CheckpointError(f"{path}: checksum mismatch (file is truncated or corrupted)")
    else:
        sum_file = _sibling(path, ".sha256")
        if sum_file.exists() and hashlib.sha256(data).hexdigest() != sum_file.read_text().strip():
            raise CheckpointError(f"{path}: checksum mismatch (file is truncated or corrupted)")
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
    except Exception as exc:
        why = str(exc).split(". ")[0]
        if embedded is None and not _sibling(path, ".sha256").exists():
            raise CheckpointError(f"{path}: no checksum and unreadable (file is truncated or "
                                  f"corrupted, or not a checkpoint: {why})") from None
        raise CheckpointError(f"{path}: cannot be read as a checkpoint ({why})") from None
    if not isinstance(state, dict):
        # torch.save(model) or of a tensor: every caller looks keys up in a checkpoint
        raise CheckpointError(f"{path}: holds a {type(state).__name__}, not a checkpoint (a "
                              "dict written by fastddp.train, such as its last.pt)")
    return state


def load(path: str | os.PathLike) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save`, verifying its checksum.

    Falls back to ``<path>.prev`` (with a warning) when ``path`` is corrupt; raises
    :class:`CheckpointError` naming both files when neither is usable.
    """
    path = Path(path)
    try:
        return verify(path)
    except (CheckpointError, OSError) as first:
        prev = _sibling(path, ".prev")
        if prev.exists():
            try:
                state = verify(prev)
            except (CheckpointError, OSError) as second:
                raise CheckpointError(f"no usable checkpoint: {first}; {second}") from None
            warnings.warn(f"{first}; resuming from the previous checkpoint {prev}", stacklevel=2)
            return state
        raise CheckpointError(f"{first}; no previous checkpoint ({prev.name}) to fall back "
                              "to. Give a checkpoint fastddp.train wrote (its last.pt), or "
                              "start fresh with --resume none") from None


@dataclass
class Found:
    """The checkpoint :func:`latest` chose: its state, its file, and why others were passed."""

    state: dict[str, Any]
    path: Path
    skipped: list[str] = field(default_factory=list)


def candidates(path: str | os.PathLike) -> list[Path]:
    """The files that may hold the newest state of ``path``, the most recently written first:
    ``path.tmp`` (complete only when a crash cut off its rename: every save truncates it
    first and renames it away at the end), ``path``, ``path.prev.tmp`` (a link to ``path``
    cut off before its own rename) and ``path.prev``."""
    path = Path(path)
    return [_sibling(path, ".tmp"), path, _sibling(path, ".prev.tmp"), _sibling(path, ".prev")]


def latest(path: str | os.PathLike,
           accept: Optional[Callable[[dict[str, Any]], bool]] = None) -> Optional[Found]:
    """The most recently written checkpoint among :func:`candidates` that verifies (and that
    ``accept`` takes, when given).

    Write order, not the step a file holds: after a run that started over (``--resume
    none``) or resumed an older checkpoint, ``path.prev`` still holds the previous run's
    further state for one save, and continuing it would overwrite the new run's history.

    ``None`` when there is none and nothing but an unfinished temporary (a crash during the
    first write) or checkpoints ``accept`` refused were there. Raises
    :class:`CheckpointError` when checkpoint files exist but none of them verifies: starting
    over would overwrite a run's history.
    """
    skipped: list[str] = []
    refused = False
    for file in candidates(path):
        if not file.exists():
            continue
        if file.name.endswith(".tmp") and _embedded_digest(_read_tail(file)) is None:
            skipped.append(f"{file}: an unfinished write (no checksum yet)")
            continue
        try:
            state = verify(file)
        except (CheckpointError, OSError) as exc:
            skipped.append(str(exc))
            continue
        if accept is not None and not accept(state):
            refused = True
            continue
        return Found(state, file, skipped)
    finished = [f for f in candidates(path) if f.exists() and not f.name.endswith(".tmp")]
    if finished and not refused:
        raise CheckpointError("; ".join(skipped) + "; no checkpoint in "
                              f"{Path(path).parent} verifies. Move the files away or start "
                              "fresh with --resume none (which keeps them as .bak)")
    return None


def _read_tail(path: Path) -> bytes:
    """The last bytes of ``path``: enough to find an embedded digest."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - 22 - _COMMENT_LEN))
        return f.read(22 + _COMMENT_LEN)
