"""The HAR models of the classic ``main_multi_gpu.py``: one per ``--mode``.

Inputs are windows of shape ``(batch, 9, 128)`` (9 inertial channels, 128 time steps).
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

from .errors import UsageError

MODES = ("flatten", "conv1d", "lstm")


class FlattenMLP(nn.Module):
    """MLP over the flattened 9×128 window."""

    def __init__(self, channels: int = 9, length: int = 128, classes: int = 6, hidden: int = 512,
                 dropout: float = 0.2) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(channels * length, hidden),
            nn.BatchNorm1d(hidden),
            nn.ReLU(inplace=True),
            nn.Dropout(dropout),
            nn.Linear(hidden, hidden // 2),
            nn.BatchNorm1d(hidden // 2),
            nn.ReLU(inplace=True),
            nn.Dropout(dropout),
            nn.Linear(hidden // 2, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Conv1dNet(nn.Module):
    """Three Conv1d/BatchNorm/ReLU blocks over the sequence, global average pool, linear head."""

    def __init__(self, channels: int = 9, classes: int = 6, width: int = 64,
                 dropout: float = 0.2) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        c_in = channels
        for c_out in (width, width * 2, width * 2):
            layers += [nn.Conv1d(c_in, c_out, kernel_size=5, padding=2, bias=False),
                       nn.BatchNorm1d(c_out), nn.ReLU(inplace=True), nn.MaxPool1d(2)]
            c_in = c_out
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.Dropout(dropout), nn.Linear(c_in, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=-1))


class LSTMNet(nn.Module):
    """Two-layer LSTM over the time axis; the last hidden state feeds a linear head."""

    def __init__(self, channels: int = 9, classes: int = 6, hidden: int = 64,
                 dropout: float = 0.2) -> None:
        super().__init__()
        self.lstm = nn.LSTM(channels, hidden, num_layers=2, batch_first=True, dropout=dropout)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x.transpose(1, 2))  # (B, C, T) -> (B, T, C)
        return self.head(out[:, -1])


def build_model(mode: str, factory: str | None = None) -> nn.Module:
    """The model for ``--mode``, or the user's own from ``--model pkg.mod:factory``."""
    if factory:
        model = load_factory(factory, "--model")()
        if not isinstance(model, nn.Module):
            raise UsageError(f"--model {factory!r} returned a {type(model).__name__}, not a "
                             "torch.nn.Module; the factory must build and return the model")
        return model
    if mode == "flatten":
        return FlattenMLP()
    if mode == "conv1d":
        return Conv1dNet()
    if mode == "lstm":
        return LSTMNet()
    raise ValueError(f"unknown --mode {mode!r}: choose one of {', '.join(MODES)}")


def load_factory(spec: str, flag: str):
    """Resolve ``pkg.module:callable`` (for ``--model`` / ``--dataset``)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{flag} must look like 'pkg.module:factory', got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{flag} {spec!r}: cannot import {module_name!r} ({exc})") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"{flag} {spec!r}: module {module_name!r} has no attribute {attr!r}") from None
