"""The run's ``--save-dir``: checked before epoch 1, locked while the run writes there, and
removed again when the run created it and ends before writing anything into it."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

from .errors import UsageError

# The files a run writes in --save-dir, and the temporaries and previous versions written
# beside them (fastddp.train.checkpoint's ".tmp", ".prev", ".prev.tmp").
RUN_FILES = ("last.pt", "best.pt", "metrics.csv", "summary.json", "curves.png", "config.json")
RUN_FILE_SUFFIXES = ("", ".tmp", ".prev", ".prev.tmp")
LOCK_NAME = ".fastddp.lock"


def check_save_dir(save_dir: Path, subdirs: tuple[str, ...] = ()) -> Optional[Path]:
    """Refuse a --save-dir the run cannot write its files in (before epoch 1): a file, an
    unwritable or full directory, or one holding a directory where a file of the run goes (the
    lock file too) or a file where a directory of the run goes (``subdirs``: ``tensorboard``).
    Creates it if missing and returns the outermost directory it created (``save_dir`` or one
    of its parents), None when ``save_dir`` existed."""
    if save_dir.exists() and not save_dir.is_dir():
        raise UsageError(f"--save-dir {save_dir}: is a file, not a directory; choose a directory "
                         "(it is created if missing)")
    created = _first_missing(save_dir)
    probe = save_dir / ".write-test"
    try:
        save_dir.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"0" * 4096)
        probe.unlink()
    except OSError as exc:
        with contextlib.suppress(OSError):
            probe.unlink()
        fix = ("free space there or choose another directory" if exc.errno == errno.ENOSPC
               else "choose a writable directory")
        raise UsageError(f"--save-dir {save_dir}: cannot write there ({exc.strerror or exc}); {fix}") from None
    in_the_way = [save_dir / f"{name}{suffix}" for name in RUN_FILES
                  for suffix in RUN_FILE_SUFFIXES if (save_dir / f"{name}{suffix}").is_dir()]
    in_the_way += [save_dir / LOCK_NAME] if (save_dir / LOCK_NAME).is_dir() else []
    files = [save_dir / name for name in subdirs if (save_dir / name).exists() and not (save_dir / name).is_dir()]
    if files:
        raise UsageError(f"--save-dir {save_dir}: {', '.join(map(str, files))} is a file where the run writes "
                         "a directory of that name; move it away, or choose another --save-dir")
    if in_the_way:
        raise UsageError(f"--save-dir {save_dir}: {', '.join(map(str, in_the_way))} "
                         f"{'is a directory' if len(in_the_way) == 1 else 'are directories'} "
                         "where the run writes a file of that name; move it away, or choose "
                         "another --save-dir")
    return created


def _first_missing(path: Path) -> Optional[Path]:
    """The outermost of ``path`` and its parents that does not exist, None if ``path`` does."""
    missing = None
    for candidate in (path, *path.absolute().parents):
        if candidate.exists():
            return missing
        missing = candidate
    return missing


@contextlib.contextmanager
def save_dir_lock(save_dir: Path, created: Optional[Path] = None) -> Iterator[None]:
    """Hold an exclusive lock on ``save_dir/.fastddp.lock`` (an empty file) while the run
    writes there: a second run started into the same directory (two jobs with the default
    runs/har) would interleave its checkpoints and metrics with this one's. A POSIX record
    lock (lockf), not flock: it belongs to this process alone, so forked data-loader workers
    that outlive a SIGKILLed run for a few seconds do not keep it from being restarted; the
    kernel drops it when the process ends. Where the file system has no locks the run goes on
    without one.

    ``created`` (from :func:`check_save_dir`): a run that ends before writing anything there (a batch larger than the data, a model that fails to build) takes the
    directories it created away again, so no empty run directory is left behind."""
    try:
        import fcntl
    except ImportError:  # not a POSIX system
        yield
        return
    fd = os.open(save_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except (BlockingIOError, PermissionError):
            created = None  # the directory is the other run's
            raise UsageError(f"--save-dir {save_dir}: another fastddp.train run is writing "
                             "there; wait for it to end, or choose another --save-dir") from None
        except OSError:
            pass  # no locks on this file system
        yield
    finally:
        if created is not None:
            _remove_unused(save_dir, created)  # while the lock is still held
        os.close(fd)


def _remove_unused(save_dir: Path, created: Path) -> None:
    """Remove ``save_dir`` and its parents up to ``created`` where they hold nothing but the
    lock file (a run that wrote nothing); anything else in them keeps them."""
    save_dir, created = save_dir.absolute(), created.absolute()
    try:
        if [p.name for p in save_dir.iterdir()] != [LOCK_NAME]:
            return
        (save_dir / LOCK_NAME).unlink()
        for directory in (save_dir, *save_dir.parents):
            directory.rmdir()  # OSError when not empty: a file of someone else's
            if directory == created:
                return
    except OSError:
        return
