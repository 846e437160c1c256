"""The training step: one function for the eager loop and the CUDA graph (:mod:`.graph`)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn


class EpochSums:
    """An epoch's running loss sum (float64, loss × samples) and correct count (int64) on the
    device, plus the samples seen (host). The tensors stay the same objects for the whole run,
    so a captured CUDA graph keeps adding into them."""

    def __init__(self, device: torch.device) -> None:
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.correct = torch.zeros((), dtype=torch.int64, device=device)
        self.seen = 0

    def reset(self, partial: tuple[float, int, int] = (0.0, 0, 0)) -> None:
        """Start an epoch (from a resumed epoch's partial sums if given)."""
        self.loss_sum.fill_(partial[0])
        self.correct.fill_(partial[1])
        self.seen = partial[2]

    def add(self, out: torch.Tensor, loss: torch.Tensor, y: torch.Tensor) -> None:
        self.loss_sum += loss.detach().double() * y.shape[0]
        self.correct += (out.detach().argmax(1) == y).sum()

    def partial(self) -> tuple[float, int, int]:
        return float(self.loss_sum), int(self.correct), self.seen


@dataclass
class TrainStep:
    """Forward, loss, scaled backward and — on the last micro-batch of a step — the fused
    ``scaler.step`` (unscale, inf/NaN check, clipping, optimizer) and ``scaler.update``.

    ``check_finite`` (AMP off or bf16: no scaler skips non-finite steps) checks each loss on the host
    and skips the step, failing after ``max_nan_steps`` in a row; it synchronises, so a CUDA
    graph captures steps with it off."""

    model: nn.Module
    loss_fn: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: Any
    amp_ctx: Callable[[], AbstractContextManager]
    max_grad_norm: Optional[float]
    ddp: Optional[nn.Module] = None  # the DDPWrapper whose reduced buckets the scaler reads
    check_finite: bool = False
    max_nan_steps: int = 5
    rank: int = 0
    nan_streak: int = 0

    def __call__(self, x: torch.Tensor, y: torch.Tensor, sums: EpochSums, accum: int = 1,
                 last: bool = True, step_index: int = 0) -> Optional[torch.Tensor]:
        """One micro-batch; the optimizer steps when ``last``. Returns the loss, or None when
        a non-finite loss was skipped (the gradients are zeroed then)."""
        sync = contextlib.nullcontext()
        if not last and self.ddp is not None:
            sync = self.ddp.no_sync()
        with sync:
            with self.amp_ctx():
                out = self.model(x)
                loss = self.loss_fn(out.float(), y)
            if self.check_finite and not self._finite(loss, step_index):
                return None
            self.scaler.scale(loss / accum if accum > 1 else loss).backward()
        sums.add(out, loss, y)
        sums.seen += y.shape[0]
        if last:
            self.nan_streak = 0
            self.scaler.step(self.optimizer, max_grad_norm=self.max_grad_norm, ddp=self.ddp)
            self.scaler.update()
        return loss

    def _finite(self, loss: torch.Tensor, step_index: int) -> bool:
        if bool(torch.isfinite(loss)):
            return True
        self.nan_streak += 1
        warnings.warn(f"rank {self.rank}: non-finite loss at step {step_index}; skipping this "
                      "step", stacklevel=3)
        if self.nan_streak >= self.max_nan_steps:
            raise FloatingPointError(
                f"loss was non-finite for {self.nan_streak} steps in a row; lower --lr, "
                "enable --clip-grad, or check the data")
        self.optimizer.zero_grad(set_to_none=True)
        return False


__all__ = ["EpochSums", "TrainStep"]
