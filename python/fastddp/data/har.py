"""Human Activity Recognition data: the real UCI HAR layout, and an embedded synthetic stand-in.

Both give windows of 9 inertial channels × 128 time steps (50 Hz, 2.56 s) in the UCI HAR
channel order ``body_acc_{x,y,z}, body_gyro_{x,y,z}, total_acc_{x,y,z}`` and labels 0–5:
walking, walking upstairs, walking downstairs, sitting, standing, laying.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

ACTIVITIES = ("walking", "upstairs", "downstairs", "sitting", "standing", "laying")
SIGNALS = ("body_acc_x", "body_acc_y", "body_acc_z", "body_gyro_x", "body_gyro_y", "body_gyro_z",
           "total_acc_x", "total_acc_y", "total_acc_z")
WINDOW = 128
RATE_HZ = 50.0


@dataclass
class HARData:
    """Train and test splits: ``x`` float32 N×9×128, ``y`` int64 labels 0–5, subject ids."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    s_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    s_test: torch.Tensor


# Per activity: step frequency (Hz), body-acceleration amplitude (g), gyro amplitude (rad/s),
# and the gravity direction in the phone's frame (x up the body when standing).
_DYNAMIC = {0: (1.80, 0.30, 0.55), 1: (1.35, 0.20, 0.40), 2: (2.40, 0.48, 0.80)}
_GRAVITY = {
    0: (0.97, -0.15, 0.10), 1: (0.90, -0.35, 0.15), 2: (0.98, 0.05, -0.10),
    3: (0.75, 0.50, 0.30),   # sitting: tilted; close to standing, told apart by orientation
    4: (0.95, 0.20, 0.15),   # standing
    5: (0.10, 0.35, 0.93),   # laying: gravity along z
}


def _split(n: int, subjects: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Synthesize ``n`` windows for subjects drawn from ``subjects``; returns x, y, s."""
    y = torch.randint(0, 6, (n,), generator=gen)
    s = subjects[torch.randint(0, len(subjects), (n,), generator=gen)]
    # Per-subject traits (fixed by subject id, so the test subjects are genuinely unseen).
    sub_gen = torch.Generator().manual_seed(4242)
    traits = torch.randn(31, 6, generator=sub_gen)  # subject ids 1..30
    tr = traits[s]
    t = torch.arange(WINDOW, dtype=torch.float32) / RATE_HZ

    dyn = y <= 2
    freq = torch.tensor([_DYNAMIC.get(int(c), (0.0, 0.0, 0.0))[0] for c in range(6)])[y]
    acc_amp = torch.tensor([_DYNAMIC.get(int(c), (0.0, 0.0, 0.0))[1] for c in range(6)])[y]
    gyro_amp = torch.tensor([_DYNAMIC.get(int(c), (0.0, 0.0, 0.0))[2] for c in range(6)])[y]
    freq = freq * (1 + 0.07 * tr[:, 0]) * (1 + 0.05 * torch.randn(n, generator=gen))
    acc_amp = acc_amp * (1 + 0.15 * tr[:, 1]).clamp_min(0.3) * (1 + 0.1 * torch.randn(n, generator=gen))
    gyro_amp = gyro_amp * (1 + 0.15 * tr[:, 2]).clamp_min(0.3)
    phase = 2 * math.pi * torch.rand(n, 1, generator=gen)
    w = 2 * math.pi * freq.view(-1, 1) * t.view(1, -1) + phase            # n × T
    axis_mix = torch.tensor([1.0, 0.45, 0.3]).view(1, 3, 1)
    body = acc_amp.view(-1, 1, 1) * axis_mix * (
        torch.sin(w).unsqueeze(1) + 0.35 * torch.sin(2 * w + 0.7).unsqueeze(1))
    gyro = gyro_amp.view(-1, 1, 1) * torch.tensor([0.6, 1.0, 0.5]).view(1, 3, 1) * torch.cos(
        w + 0.4).unsqueeze(1)
    body = body * dyn.view(-1, 1, 1)
    gyro = gyro * dyn.view(-1, 1, 1)
    # Static postures still move a little (breathing, fidgeting).
    still = (~dyn).view(-1, 1, 1).float()
    body = body + still * 0.02 * torch.randn(n, 3, 1, generator=gen) * torch.sin(
        2 * math.pi * 0.3 * t).view(1, 1, -1)

    gravity = torch.tensor([_GRAVITY[c] for c in range(6)])[y]            # n × 3
    gravity = gravity + 0.09 * tr[:, 3:6] + 0.07 * torch.randn(n, 3, generator=gen)
    gravity = gravity / gravity.norm(dim=1, keepdim=True)
    total = gravity.unsqueeze(-1) + body

    x = torch.cat([body, gyro, total], dim=1)
    x = x + 0.15 * torch.randn(x.shape, generator=gen)                    # sensor noise
    return x.float().contiguous(), y.to(torch.int64), s.to(torch.int64)


def synthetic_har(n_train: int = 7352, n_test: int = 2947, seed: int = 0) -> HARData:
    """The embedded default data set: deterministic HAR-like windows at the real shapes.

    Six activities with distinct step frequency, amplitude, gravity orientation and noise;
    per-subject variation (21 training subjects, 9 unseen test subjects, as in UCI HAR).
    Walking vs upstairs vs downstairs differ in rhythm and intensity, sitting vs standing
    mainly in how gravity falls on the sensor, so the classes overlap but a small MLP
    over the flattened window learns them to over 90 % test accuracy in a few epochs.
    """
    if n_train <= 0 or n_test <= 0:
        raise ValueError(f"synthetic_har: n_train and n_test must be > 0, got {n_train}, {n_test}")
    gen = torch.Generator().manual_seed(seed)
    train_subjects = torch.tensor([1, 3, 5, 6, 7, 8, 11, 14, 15, 16, 17, 19, 21, 22, 23, 25, 26,
                                   27, 28, 29, 30])
    test_subjects = torch.tensor([2, 4, 9, 10, 12, 13, 18, 20, 24])
    x_tr, y_tr, s_tr = _split(n_train, train_subjects, gen)
    x_te, y_te, s_te = _split(n_test, test_subjects, gen)
    return HARData(x_tr, y_tr, s_tr, x_te, y_te, s_te)


# ----------------------------------------------------------------------------- UCI HAR
def _read_matrix(path: Path, columns: int | None) -> np.ndarray:
    if not path.is_file():
        raise FileNotFoundError(f"UCI HAR file missing: {path}")
    rows = []
    linenos = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            parts = line.split()
            if not parts:
                continue
            try:
                values = [float(v) for v in parts]
            except ValueError:
                raise ValueError(f"{path}:{lineno}: not a row of numbers: {line.strip()[:60]!r}") from None
            if columns is not None and len(values) != columns:
                raise ValueError(f"{path}:{lineno}: expected {columns} values, found {len(values)}")
            rows.append(values)
            linenos.append(lineno)
    if not rows:
        raise ValueError(f"{path}: file is empty")
    array = np.asarray(rows, dtype=np.float64)
    # float() takes "nan" and "inf", and float32 turns 1e40 into inf: a window with one of
    # them would train on NaN losses, so they are refused like any other malformed value.
    bad = ~(np.abs(array) <= np.finfo(np.float32).max)
    if bad.any():
        row = int(np.nonzero(bad.any(axis=1))[0][0])
        value = array[row][bad[row]][0]
        what = "not a finite value" if not np.isfinite(value) else "outside the float32 range"
        raise ValueError(f"{path}:{linenos[row]}: {value:g} is {what}")
    return array.astype(np.float32)


def _load_split(root: Path, split: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    base = root / split
    signals = [_read_matrix(base / "Inertial Signals" / f"{name}_{split}.txt", WINDOW)
               for name in SIGNALS]
    n = len(signals[0])
    for name, sig in zip(SIGNALS, signals):
        if len(sig) != n:
            raise ValueError(f"{base / 'Inertial Signals' / f'{name}_{split}.txt'}: {len(sig)} "
                             f"windows, but {SIGNALS[0]}_{split}.txt has {n}")
    x = np.stack(signals, axis=1)
    y = _read_matrix(base / f"y_{split}.txt", 1)[:, 0]
    s = _read_matrix(base / f"subject_{split}.txt", 1)[:, 0]
    for arr, name in ((y, f"y_{split}.txt"), (s, f"subject_{split}.txt")):
        if len(arr) != n:
            raise ValueError(f"{base / name}: {len(arr)} rows, but the signals have {n} windows")
    bad = np.nonzero((y < 1) | (y > 6) | (y != np.round(y)))[0]
    if len(bad):
        raise ValueError(f"{base / f'y_{split}.txt'}:{bad[0] + 1}: label {y[bad[0]]:g} is not 1-6")
    bad = np.nonzero((s < 1) | (s != np.round(s)))[0]
    if len(bad):
        raise ValueError(f"{base / f'subject_{split}.txt'}:{bad[0] + 1}: subject {s[bad[0]]:g} is "
                         "not a positive integer")
    return x, (y - 1).astype(np.int64), s.astype(np.int64)


def _source_files(root: Path) -> list[Path]:
    """The files of the UCI HAR layout under ``root`` that :func:`load_uci_har` reads."""
    files = []
    for split in ("train", "test"):
        files += [root / split / "Inertial Signals" / f"{name}_{split}.txt" for name in SIGNALS]
        files += [root / split / f"{kind}_{split}.txt" for kind in ("y", "subject")]
    return files


# Bumped when the parsing or the checks change, so caches written by another rule are rebuilt.
_CACHE_FORMAT = 2
_CACHE_NAMES = [f"{k}_{split}" for split in ("train", "test") for k in ("x", "y", "s")]


def _fingerprint(root: Path) -> dict | None:
    """Size and modification time of every source file (None when one is missing): a cache
    is used only while they are unchanged."""
    stamp: dict = {"format": _CACHE_FORMAT}
    for file in _source_files(root):
        try:
            st = file.stat()
        except OSError:
            return None
        stamp[str(file.relative_to(root))] = [st.st_size, st.st_mtime_ns]
    return stamp


def _read_cache(cache_dir: Path, stamp: dict) -> dict[str, np.ndarray] | None:
    """The cached arrays, memory-mapped, when the cache was completed for sources with this
    ``stamp``; None otherwise (no cache, stale sources, a damaged file)."""
    try:
        if json.loads((cache_dir / "sources.json").read_text()) != stamp:
            return None
        return {n: np.load(cache_dir / f"{n}.npy", mmap_mode="r") for n in _CACHE_NAMES}
    except (OSError, ValueError, EOFError):
        return None


def _write_atomic(path: Path, write) -> None:
    """``write(file)`` into a temporary beside ``path`` (one per process: ranks that cache at
    once do not share it), fsync'd, then renamed over ``path``."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _write_cache(cache_dir: Path, arrays: dict[str, np.ndarray], stamp: dict) -> None:
    """Cache ``arrays`` for sources with ``stamp``. The stamp is removed first and written
    last, so an interrupted write leaves a cache that :func:`_read_cache` does not use."""
    try:
        cache_dir.mkdir(exist_ok=True)
        (cache_dir / "sources.json").unlink(missing_ok=True)
        for n, arr in arrays.items():
            _write_atomic(cache_dir / f"{n}.npy", lambda f, arr=arr: np.save(f, arr))
        _write_atomic(cache_dir / "sources.json", lambda f: f.write(json.dumps(stamp).encode()))
    except OSError:
        pass  # a read-only data directory just means no cache


def load_uci_har(root: str | Path, cache: bool = True) -> HARData:
    """Read the official UCI HAR layout under ``root``.

    ``root/{train,test}/Inertial Signals/{body_acc,body_gyro,total_acc}_{x,y,z}_{split}.txt``
    become float32 N×9×128, ``y_{split}.txt`` labels 1–6 become 0–5, ``subject_{split}.txt``
    the subject ids. Parsed arrays are cached as ``.npy`` files in ``root/.fastddp_cache`` and
    memory-mapped on later loads while the text files keep their size and modification time;
    a cache that is stale, damaged or was not finished is parsed again. Missing or malformed
    files raise an error naming the file (and line).
    """
    root = Path(root)
    if (root / "UCI HAR Dataset").is_dir():
        root = root / "UCI HAR Dataset"
    cache_dir = root / ".fastddp_cache"
    stamp = _fingerprint(root) if cache else None
    arrays = _read_cache(cache_dir, stamp) if stamp is not None else None
    if arrays is None:
        arrays = {}
        for split in ("train", "test"):
            x, y, s = _load_split(root, split)
            arrays.update({f"x_{split}": x, f"y_{split}": y, f"s_{split}": s})
        if stamp is not None:
            _write_cache(cache_dir, arrays, stamp)
    import warnings

    with warnings.catch_warnings():
        # Cached arrays are read-only memory maps: the loader only ever reads them.
        warnings.simplefilter("ignore", UserWarning)
        t = {n: torch.from_numpy(np.ascontiguousarray(a)) for n, a in arrays.items()}
    return HARData(t["x_train"], t["y_train"], t["s_train"], t["x_test"], t["y_test"], t["s_test"])
