"""The training step as one CUDA graph (``fastddp.train --cuda-graph``).

A small model at a large batch is limited by the host, not the GPU: every step launches
~100 tiny kernels from Python and autograd. fastddp's step has no host synchronisation
(the fused GradScaler skips inf/NaN steps on the device, the fused AdamW reads the learning
rate from a device tensor), so the whole step — forward, loss, scaled backward, unscale +
inf/NaN check + clipping, AdamW, loss-scale update and the epoch's running loss/accuracy sums —
can be captured once and replayed per batch with a single launch.

The first ``warmup`` batches run eagerly on a side stream (real training steps, as PyTorch's
whole-network capture recipe asks: lazy optimizer state, cuBLAS workspaces), the next one is
captured and replayed, every later one only replays. Inputs are copied into static buffers.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Optional

import torch
from torch import nn


class GraphedStep:
    """Forward + backward + ``scaler.step`` + ``scaler.update`` + metric sums, replayed as one
    CUDA graph. Call it with each batch; read :attr:`loss` (this step's loss) and the running
    sums :attr:`loss_sum` (float64, loss × samples) and :attr:`correct` (int64)."""

    def __init__(self, model: nn.Module, loss_fn: nn.Module, optimizer: torch.optim.Optimizer,
                 scaler: torch.amp.GradScaler, amp_ctx: Callable[[], AbstractContextManager],
                 max_grad_norm: Optional[float], device: torch.device, warmup: int = 3) -> None:
        if device.type != "cuda":
            raise ValueError(f"GraphedStep needs a CUDA device, got {device}")
        self.model, self.loss_fn, self.optimizer, self.scaler = model, loss_fn, optimizer, scaler
        self.amp_ctx, self.max_grad_norm, self.device = amp_ctx, max_grad_norm, device
        self.warmup = warmup
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.correct = torch.zeros((), dtype=torch.int64, device=device)
        self.loss = torch.zeros((), device=device)
        self.steps = 0
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self._x: Optional[torch.Tensor] = None
        self._y: Optional[torch.Tensor] = None
        self._side = torch.cuda.Stream(device)

    def _body(self, x: torch.Tensor, y: torch.Tensor) -> None:
        with self.amp_ctx():
            out = self.model(x)
            loss = self.loss_fn(out.float(), y)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer, max_grad_norm=self.max_grad_norm)
        self.scaler.update()
        self.loss_sum += loss.detach().double() * y.shape[0]
        self.correct += (out.detach().argmax(1) == y).sum()
        self.loss.copy_(loss.detach())

    def reset_sums(self, loss_sum: float = 0.0, correct: int = 0) -> None:
        """Start an epoch's running sums (from a resumed epoch's partial sums if given)."""
        self.loss_sum.fill_(loss_sum)
        self.correct.fill_(correct)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if self.graph is not None and (x.shape != self._x.shape or y.shape != self._y.shape):
            raise ValueError(f"--cuda-graph: batch of shape {tuple(x.shape)} after capturing "
                             f"{tuple(self._x.shape)}; graphs need equal batches (drop_last)")
        current = torch.cuda.current_stream(self.device)
        if self.steps < self.warmup:
            self._side.wait_stream(current)
            with torch.cuda.stream(self._side), warnings.catch_warnings():
                # capturable=True is meant for the capture that follows these steps
                warnings.filterwarnings("ignore", message=".*capturable=True.*")
                self.optimizer.zero_grad(set_to_none=True)
                self._body(x, y)
            current.wait_stream(self._side)
        else:
            if self.graph is None:
                self._capture(x, y)
            self._x.copy_(x)
            self._y.copy_(y)
            self.graph.replay()
        self.steps += 1

    def _capture(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self._x = torch.empty_like(x)
        self._y = torch.empty_like(y)
        torch.cuda.current_stream(self.device).synchronize()
        # Gradients are allocated inside the graph's pool and rewritten (not accumulated) by
        # every replay's backward.
        self.optimizer.zero_grad(set_to_none=True)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._body(self._x, self._y)


def hold_lr(optimizer: torch.optim.Optimizer, scheduler: Optional[object],
            device: Optional[torch.device]) -> None:
    """Keep each group's learning rate in a device tensor (``device`` given: the fused kernel
    reads it at every replay and the LR scheduler updates it in place, instead of a float baked
    into the graph) or a float (``device=None``). The scheduler's base rates become floats, so
    it never computes on tensors. Called after construction and after loading a checkpoint
    written by either kind of run."""
    for group in optimizer.param_groups:
        for key in ("lr", "initial_lr"):
            if key not in group:
                continue
            v = group[key]
            value = float(v.item()) if isinstance(v, torch.Tensor) else float(v)
            group[key] = value if device is None or key == "initial_lr" else torch.tensor(
                value, dtype=torch.float32, device=device)
    if scheduler is not None and hasattr(scheduler, "base_lrs"):
        scheduler.base_lrs = [float(b.item()) if isinstance(b, torch.Tensor) else float(b)
                              for b in scheduler.base_lrs]


__all__ = ["GraphedStep", "hold_lr"]
