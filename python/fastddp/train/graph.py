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
from typing import Optional

import torch

from .step import EpochSums, TrainStep


class GraphedStep:
    """A :class:`~fastddp.train.step.TrainStep` (forward + backward + ``scaler.step`` +
    ``scaler.update`` + the epoch's sums), replayed as one CUDA graph. Call it with each batch;
    :attr:`loss` holds this step's loss. The running sums are ``sums``' tensors, which the
    graph adds into (reset them with ``sums.reset``, never replace them)."""

    def __init__(self, step: TrainStep, sums: EpochSums, device: torch.device,
                 warmup: int = 3) -> None:
        if device.type != "cuda":
            raise ValueError(f"GraphedStep needs a CUDA device, got {device}")
        if step.check_finite:
            raise ValueError("GraphedStep: a step that checks losses on the host cannot be "
                             "captured (use fp16 AMP, whose scaler skips non-finite steps)")
        self.step, self.sums, self.device, self.warmup = step, sums, device, warmup
        self.loss = torch.zeros((), device=device)
        self.steps = 0
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self._x: Optional[torch.Tensor] = None
        self._y: Optional[torch.Tensor] = None
        self._side = torch.cuda.Stream(device)

    def _body(self, x: torch.Tensor, y: torch.Tensor) -> None:
        seen = self.sums.seen  # counted on the host by the caller, not baked into the graph
        loss = self.step(x, y, self.sums)
        self.sums.seen = seen
        self.loss.copy_(loss.detach())

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
                self.step.optimizer.zero_grad(set_to_none=True)
                self._body(x, y)
            current.wait_stream(self._side)
        else:
            if self.graph is None:
                self._capture(x, y)
            self._x.copy_(x)
            self._y.copy_(y)
            self.graph.replay()
        self.sums.seen += y.shape[0]
        self.steps += 1

    def _capture(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self._x = torch.empty_like(x)
        self._y = torch.empty_like(y)
        torch.cuda.current_stream(self.device).synchronize()
        # Gradients are allocated inside the graph's pool and rewritten (not accumulated) by
        # every replay's backward.
        self.step.optimizer.zero_grad(set_to_none=True)
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
