"""Data, samplers and checks shared by the PrefetchLoader tests."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

N = 1000


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(N, 9, 16, generator=g), torch.randint(0, 6, (N,), generator=g)


class _IndexSampler:
    def __init__(self, idx: torch.Tensor) -> None:
        self.idx = idx

    def indices(self) -> torch.Tensor:
        return self.idx

    def __iter__(self):
        return iter(self.idx.tolist())

    def __len__(self) -> int:
        return len(self.idx)


class _MapDataset(Dataset):
    def __init__(self, x: torch.Tensor, y: torch.Tensor, fail_at: int | None = None) -> None:
        self.x, self.y, self.fail_at = x, y, fail_at

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        if i == self.fail_at:
            raise KeyError(f"sample {i} is broken")
        return self.x[i], self.y[i]


def _expected(idx: torch.Tensor, batch: int, drop_last: bool) -> list[torch.Tensor]:
    end = (len(idx) // batch) * batch if drop_last else len(idx)
    return list(idx[:end].split(batch))


def _check(loader, x, y, idx, batch, drop_last) -> None:
    want = _expected(idx, batch, drop_last)
    got = list(loader)
    assert len(got) == len(want) == len(loader)
    for (bx, by), widx in zip(got, want):
        assert torch.equal(bx, x[widx]) and torch.equal(by, y[widx])

