"""The training step: one function for the eager loop and the CUDA graph (:mod:`.graph`)."""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

# An unfinished epoch's part of a checkpoint: (loss sum, correct, samples seen, seconds trained).
# A checkpoint without the seconds (3 items) restarts the epoch's clock at the resume.
Partial = tuple


class EpochSums:
    """An epoch's running loss sum (float64, loss × samples) and correct count (int64) on the
    device, plus the samples seen and the seconds trained (host). The tensors stay the same
    objects for the whole run, so a captured CUDA graph keeps adding into them.

    An epoch continued from a mid-epoch checkpoint counts the samples and the seconds of its
    part before the checkpoint too: its ``epoch_time_s`` and ``samples_per_s`` in metrics.csv
    cover the whole epoch's samples over the time spent training them (the time between that
    checkpoint and the interruption, whose steps are trained again, is not counted)."""

    def __init__(self, device: torch.device) -> None:
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.correct = torch.zeros((), dtype=torch.int64, device=device)
        self.seen = 0
        self._clock = time.perf_counter()  # the epoch's start, less the seconds carried over

    def reset(self, partial: Partial = (0.0, 0, 0, 0.0)) -> None:
        """Start an epoch (from a resumed epoch's partial sums if given)."""
        self.loss_sum.fill_(partial[0])
        self.correct.fill_(partial[1])
        self.seen = partial[2]
        carried = float(partial[3]) if len(partial) > 3 else 0.0
        self._clock = time.perf_counter() - carried

    def add(self, out: torch.Tensor, loss: torch.Tensor, y: torch.Tensor) -> None:
        self.loss_sum += loss.detach().double() * y.shape[0]
        self.correct += (out.detach().argmax(1) == y).sum()

    def elapsed(self) -> float:
        """Seconds spent training this epoch, the part before a resume included."""
        return time.perf_counter() - self._clock

    def partial(self) -> Partial:
        return float(self.loss_sum), int(self.correct), self.seen, self.elapsed()


@dataclass
class TrainStep:
    """Forward, loss, scaled backward and — on the last micro-batch of a step — the fused
    ``scaler.step`` (unscale, inf/NaN check, clipping, optimizer) and ``scaler.update``.

    ``check_finite`` (AMP off or bf16: no scaler skips non-finite steps) checks each loss and
    skips the step, failing after ``max_nan_steps`` in a row; it synchronises, so a CUDA graph
    captures steps with it off. With ``world`` > 1 the ranks combine their verdicts in one
    all-reduce of a flag per rank, started before the backward and read after it (so it runs
    beside the backward instead of in front of it): every rank runs the backward, then every
    rank skips the same steps (a rank that skipped its backward alone would wait in other
    collectives than the rest) and names the same ranks."""

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
    world: int = 1
    nan_streak: int = 0
    nan_ranks: set[int] = field(default_factory=set)  # ranks with a non-finite loss in the streak

    def __call__(self, x: torch.Tensor, y: torch.Tensor, sums: EpochSums, accum: int = 1,
                 last: bool = True, step_index: int = 0) -> Optional[torch.Tensor]:
        """One micro-batch; the optimizer steps when ``last``. Returns the loss, or None when
        a non-finite loss was skipped (the gradients are zeroed then)."""
        sync = contextlib.nullcontext()
        if not last and self.ddp is not None:
            sync = self.ddp.no_sync()
        with sync:
            # a skipped step also undoes what its forward changed in the buffers (BatchNorm's
            # running statistics would hold the NaN and every evaluation after it)
            before = self._buffers_copy() if self.check_finite else None
            with self.amp_ctx():
                out = self.model(x)
                loss = self.loss_fn(out.float(), y)
            verdict = self._share_verdict(loss) if before is not None else None
            self.scaler.scale(loss / accum if accum > 1 else loss).backward()
        if verdict is not None and not self._finite(verdict, step_index):
            self._restore_buffers(before)
            return None
        sums.add(out, loss, y)
        sums.seen += y.shape[0]
        if last:
            self.nan_streak = 0
            self.nan_ranks.clear()
            self.scaler.fused_step(self.optimizer, max_grad_norm=self.max_grad_norm, ddp=self.ddp)
            self.scaler.update()
        return loss

    def _buffers_copy(self) -> list[torch.Tensor]:
        return [b.detach().clone() for b in self.model.buffers()]

    def _restore_buffers(self, saved: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for buffer, value in zip(self.model.buffers(), saved):
                buffer.copy_(value)

    def _share_verdict(self, loss: torch.Tensor) -> tuple[torch.Tensor, Optional[dist.Work]]:
        """A flag per rank, set where the loss is not finite, and the all-reduce (started now,
        on the device, without a host sync) that gives every rank every flag."""
        flags = torch.zeros(self.world, dtype=torch.int32, device=loss.device)
        flags[self.rank] = (~torch.isfinite(loss.detach())).to(torch.int32).reshape(())
        work = dist.all_reduce(flags, async_op=True) if self.world > 1 else None
        return flags, work

    def _finite(self, verdict: tuple[torch.Tensor, Optional[dist.Work]], step_index: int) -> bool:
        flags, work = verdict
        if work is not None:
            work.wait()
        bad = [int(r) for r in flags.nonzero().flatten().tolist()]  # the same list on every rank
        if not bad:
            return True
        self.nan_streak += 1
        self.nan_ranks.update(bad)
        names = ", ".join(map(str, bad))
        skipped = "every rank skips this step" if self.world > 1 else "the step is skipped"
        warnings.warn(f"rank {self.rank}: non-finite loss on rank(s) {names} at step "
                      f"{step_index}; {skipped}", stacklevel=3)
        if self.nan_streak >= self.max_nan_steps:
            ranks = ", ".join(map(str, sorted(self.nan_ranks)))
            clip = ("lower --clip-grad" if self.max_grad_norm else "enable --clip-grad")
            raise FloatingPointError(
                f"loss was non-finite for {self.nan_streak} steps in a row (on rank(s) {ranks}); "
                f"lower --lr, {clip}, or check the data")
        self.optimizer.zero_grad(set_to_none=True)
        return False

__all__ = ["EpochSums", "Partial", "TrainStep"]
