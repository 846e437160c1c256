"""PrefetchLoader's warnings side by side with DataLoader's, in a fresh interpreter each (the
record of warnings already shown is per process): the same text, from the same module and
line, as many times, and the script's own "once per place" warnings left alone."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

_SCRIPT = """
import sys, warnings
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset
import fastddp

class Numbers(Dataset):
    def __len__(self):
        return 8
    def __getitem__(self, i):
        return torch.tensor([float(i)])

cls = {"torch": DataLoader, "fastddp": fastddp.PrefetchLoader}[sys.argv[1]]
data = TensorDataset(torch.arange(8.0)) if sys.argv[2] == "tensors" else Numbers()
loader = cls(data, batch_size=4, pin_memory=True, num_workers=int(sys.argv[3]))
for epoch in range(3):
    for batch in loader:
        warnings.warn("the script's own warning")
print("done")
"""


def _stderr(cls: str, data: str, workers: int) -> str:
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, cls, data, str(workers)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "done", proc.stderr
    return proc.stderr


@pytest.mark.skipif(torch.accelerator.is_available(), reason="the pin_memory warning needs no accelerator")
@pytest.mark.parametrize(("data", "workers"), [("tensors", 0), ("tensors", 2), ("dataset", 0)],
                         ids=["native path", "native path, workers", "torch path"])
def test_warnings_come_once_from_where_dataloader_gives_them(data: str, workers: int) -> None:
    """Three passes with pin_memory=True and no accelerator: DataLoader's pin_memory warning
    once, named at its iterator's line in torch/utils/data/dataloader.py, and the script's own
    warning once; the same lines from PrefetchLoader (on its native path, and over a Dataset,
    where it runs DataLoader's machinery at every pass)."""
    ours, torch_ = _stderr("fastddp", data, workers), _stderr("torch", data, workers)
    assert ours == torch_
    assert torch_.count("UserWarning") == 2 and "dataloader.py:" in torch_, torch_
