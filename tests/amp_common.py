"""Models and optimizers shared by the GradScaler tests."""

from __future__ import annotations

import torch
from torch import nn


def _model(device: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 4)).to(device)


class _Image(nn.Module):
    def forward(self, x):
        return x.view(-1, 1, 4, 4).contiguous(memory_format=torch.channels_last)


class _Pool(nn.Module):
    def forward(self, x):
        return torch.relu(x).mean((2, 3))


def _transposed_linear(i: int, o: int) -> nn.Linear:
    lin = nn.Linear(i, o)
    lin.weight = nn.Parameter(lin.weight.detach().t().contiguous().t())  # dense, strides (1, o)
    return lin


def _layout_model(device: str, seed: int = 0) -> nn.Module:
    """Gradients in dense but not row-major layouts: channels_last conv weights (``[2]``, where
    the inf/NaN injection lands) and a transposed matrix."""
    torch.manual_seed(seed)
    m = nn.Sequential(_Image(), nn.Conv2d(1, 8, 3, padding=1), nn.Conv2d(8, 4, 3, padding=1), _Pool(),
                      _transposed_linear(4, 32), nn.ReLU(), nn.Linear(32, 4))
    return m.to(device=device, memory_format=torch.channels_last)


def _optim(kind: str, params, device: str):
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=False)
    if kind == "adamw_fused":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)
