"""uint8 video clips in a memory-mapped ``.npy`` file, read batch by batch as a training
script with a clip dataset on disk would (the read is part of the step, for every contender)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

# Per-channel statistics used to normalise clips on the device.
MEAN = torch.tensor([0.45, 0.45, 0.45]).view(1, 3, 1, 1, 1)
STD = torch.tensor([0.225, 0.225, 0.225]).view(1, 3, 1, 1, 1)


def write_clips(path: Path, n: int, frames: int, size: int, seed: int = 0) -> Path:
    """Write ``n`` random clips of shape ``(frames, size, size, 3)`` (uint8) to ``path``."""
    rng = np.random.default_rng(seed)
    clips = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8,
                                      shape=(n, frames, size, size, 3))
    clips[:] = rng.integers(0, 256, size=clips.shape, dtype=np.uint8)
    clips.flush()
    return path


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
        x = raw.to(device, non_blocking=True).permute(0, 4, 1, 2, 3).float().div_(255)
        return (x - MEAN.to(device)) / STD.to(device)
