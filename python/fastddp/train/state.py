"""What a checkpoint holds: :class:`TrainState`, saved and loaded as one object."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

from .settings import resume_conflict

# One rank's part of the state: its RNG streams and the running sums of an unfinished epoch.
RankState = dict[str, Any]


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside a DDPWrapper / DataParallel (or the module itself)."""
    return getattr(model, "module", model)


def model_signature(model: nn.Module) -> dict[str, list[int]]:
    """Parameter and buffer shapes: a checkpoint of another model is refused by comparing them."""
    return {k: list(v.shape) for k, v in unwrap(model).state_dict().items()}


@dataclass
class TrainState:
    """Everything a run needs to continue exactly where it stopped; :meth:`state_dict` is the
    checkpoint (``last.pt``), :meth:`load_state_dict` restores it.

    ``epoch`` is the 0-based epoch the state belongs to; ``epoch_done`` says whether it ended
    (a checkpoint written mid-epoch, every ``--save-interval`` steps, has it False, and the
    loader position and ``ranks`` to continue it). ``step`` counts optimizer steps."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: Any
    loader: Any
    mode: str
    world: int
    settings: dict[str, Any] = field(default_factory=dict)
    epochs: Optional[int] = None  # the run's --epochs, which its learning-rate schedule spans
    run_id: Optional[str] = None
    epoch: int = 0
    step: int = 0
    epoch_done: bool = False
    best_f1: float = -1.0
    history: list[dict[str, Any]] = field(default_factory=list)
    ranks: list[RankState] = field(default_factory=list)

    @property
    def start_epoch(self) -> int:
        """The epoch to run next."""
        return self.epoch + 1 if self.epoch_done else self.epoch

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": unwrap(self.model).state_dict(), "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
            "loader": self.loader.state_dict(), "epoch": self.epoch, "step": self.step,
            "epoch_done": self.epoch_done, "best_f1": self.best_f1, "history": self.history,
            "rng": self.ranks, "world": self.world, "mode": self.mode,
            "signature": model_signature(self.model), "settings": self.settings,
            "run_id": self.run_id, "epochs": self.epochs,
        }

    def check_compatible(self, state: dict[str, Any], source: str) -> Optional[str]:
        """Why ``state`` (from ``source``) cannot be loaded into this run, or None."""
        missing = [k for k in ("optimizer", "scheduler", "scaler", "loader", "epoch", "step",
                               "best_f1", "history") if k not in state]
        if missing:
            what = ("best.pt holds only the weights of the best epoch, for evaluation"
                    if "metrics" in state and "model" in state else
                    "it is not a training checkpoint of fastddp.train (a model's weights, or "
                    "another program's file)")
            return (f"{source} is not a checkpoint to resume from (it has no "
                    f"{', '.join(missing)}): {what}. Resume from last.pt (--resume auto does) "
                    "or start over with --resume none")
        if state.get("signature") != model_signature(self.model) or state.get("mode") != self.mode:
            return (f"{source} was written for model {state.get('mode')!r} with other parameter "
                    "shapes; use a different --save-dir or --resume none")
        # checkpoints written before settings were recorded are not compared
        return resume_conflict(state.get("settings", {}), self.settings, source)

    def load_state_dict(self, state: dict[str, Any]) -> bool:
        """Restore a checkpoint. Returns whether the run continues inside an unfinished epoch
        (same world size, so the loader position and each rank's RNG streams carry over);
        otherwise an interrupted epoch restarts from its beginning."""
        unwrap(self.model).load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.epoch, self.step = state["epoch"], state["step"]
        self.epoch_done = bool(state.get("epoch_done"))
        self.best_f1, self.history = state["best_f1"], state["history"]
        self.ranks = state.get("rng", [])
        if self.epoch_done or state.get("world") != self.world:
            return False
        self.loader.set_epoch(self.epoch)
        self.loader.load_state_dict(state["loader"])
        return True

    def reposition(self, steps_per_epoch: int) -> None:
        """After a world-size change: the step count, and the learning-rate schedule's position
        with it, at the start of the epoch to run next, counted in this world's steps per epoch
        (a step of another world size is another share of an epoch, so the old count would put
        the schedule elsewhere, at its end or before it)."""
        step = self.start_epoch * steps_per_epoch
        if step == self.step:
            return
        self.step = step
        self.scheduler.last_epoch = step - 1
        self.scheduler.step()  # sets every group's rate for `step`, as the schedule says


def rank_state(device: torch.device, partial: tuple) -> RankState:
    """This rank's RNG streams and an unfinished epoch's (loss sum, correct, seen, seconds
    trained) (:data:`~fastddp.train.step.Partial`)."""
    return {"cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
            "partial": partial}


def restore_rank_state(rank: RankState, device: torch.device) -> tuple:
    """Set this rank's RNG streams from a checkpoint; returns the epoch's partial sums."""
    torch.set_rng_state(rank["cpu"])
    if device.type == "cuda" and rank.get("cuda") is not None:
        torch.cuda.set_rng_state(rank["cuda"], device)
    return tuple(rank.get("partial", (0.0, 0, 0)))


__all__ = ["TrainState", "model_signature", "rank_state", "restore_rank_state", "unwrap"]
