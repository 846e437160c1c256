"""uint8 video clips in a memory-mapped ``.npy`` file, read batch by batch as a training
script with a clip dataset on disk would (the read is part of the step, for every contender),
and the pieces the video loader benchmark shares with the zoo: the labels file, a map-style
clip Dataset for torch's DataLoader, and the normalise step a training step runs on the device."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
import torch
from torch.utils.data import Dataset

# Per-channel statistics used to normalise clips on the device.
MEAN = torch.tensor([0.45, 0.45, 0.45]).view(1, 3, 1, 1, 1)
STD = torch.tensor([0.225, 0.225, 0.225]).view(1, 3, 1, 1, 1)


def write_clips(path: Path, n: int, frames: int, size: int, seed: int = 0) -> Path:
    """Write ``n`` random clips of shape ``(frames, size, size, 3)`` (uint8) to ``path``."""
    rng = np.random.default_rng(seed)
    clips = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8,
                                      shape=(n, frames, size, size, 3))
    for start in range(0, n, 64):  # a chunk at a time: the file may exceed what fits in memory
        part = clips[start:start + 64]
        part[:] = rng.integers(0, 256, size=part.shape, dtype=np.uint8)
    clips.flush()
    return path


def write_labels(path: Path, n: int, classes: int = 10, seed: int = 0) -> Path:
    """Write ``n`` int64 class labels to ``path`` (the clips' companion column)."""
    np.save(path, np.random.default_rng(seed).integers(0, classes, size=n, dtype=np.int64))
    return path


def normalise(raw: torch.Tensor, device: Optional[torch.device] = None,
              out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """uint8 clips ``(B, T, H, W, 3)`` as float ``(B, 3, T, H, W)`` in the model's input
    statistics, computed on ``device`` (the batch's own by default) in one pass:
    ``x * 1/(255 std) - mean/std`` (= ``(x / 255 - mean) / std``) over the permuted view.
    ``out`` (float, ``(B, 3, T, H, W)``) receives the result when given: a reused buffer, as a
    device's caching allocator hands a step the same block again."""
    device = raw.device if device is None else device
    x = raw.to(device, non_blocking=True).permute(0, 4, 1, 2, 3)
    scale, shift = (1 / (255 * STD)).to(device), (-MEAN / STD).to(device)
    if out is None:
        return torch.addcmul(shift, x, scale)
    return torch.addcmul(shift, x, scale, out=out)


class Normaliser:
    """:func:`normalise` into one reused output buffer per batch shape (a step's consumer)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._out: Optional[torch.Tensor] = None

    def __call__(self, raw: torch.Tensor) -> torch.Tensor:
        b, t, h, w, c = raw.shape
        if self._out is None or self._out.shape != (b, c, t, h, w):
            self._out = torch.empty((b, c, t, h, w), device=self.device)
        return normalise(raw, self.device, self._out)


class ClipDataset(Dataset):
    """Map-style Dataset over the clips and labels files, as a user writes one for torch's
    DataLoader: sample ``i`` is ``(clip i as a uint8 tensor, label i)``; each process opens the
    memory maps itself (DataLoader's workers are forked or spawned after construction)."""

    def __init__(self, clips: Path, labels: Path) -> None:
        self.paths = (clips, labels)
        self.n = len(np.load(labels, mmap_mode="r"))
        self._maps: Optional[tuple[np.ndarray, np.ndarray]] = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._maps is None:
            self._maps = (np.load(self.paths[0], mmap_mode="r"), np.load(self.paths[1], mmap_mode="r"))
        clips, labels = self._maps
        return torch.from_numpy(np.array(clips[i])), torch.tensor(int(labels[i]))


class ClipReader:
    """Batches of clips from the memory-mapped file: rows ``[i*b, (i+1)*b)`` cycling."""

    def __init__(self, path: Path, batch: int) -> None:
        self.clips = np.load(path, mmap_mode="r")
        if len(self.clips) < batch:
            raise ValueError(f"{path} holds {len(self.clips)} clips, fewer than a batch of {batch}")
        self.batch = batch
        self._next = 0

    def read(self, device: torch.device) -> torch.Tensor:
        """The next batch as float ``(B, 3, T, H, W)`` on ``device``, decoded and normalised there."""
        start = self._next * self.batch
        if start + self.batch > len(self.clips):
            self._next, start = 0, 0
        self._next += 1
        raw = torch.from_numpy(np.array(self.clips[start:start + self.batch]))  # reads the file
        return normalise(raw, device)
