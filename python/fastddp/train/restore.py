"""Continuing a run from the checkpoint ``--resume`` names: its state loaded into the run, the
best model carried over, and a run that has nothing left to train."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from . import checkpoint
from .build import Run
from .errors import UsageError
from .graph import hold_lr
from .outputs import (
    FINAL_FILES,
    keep_aside,
    keep_earlier_files,
    keep_foreign_metrics,
    metrics_csv,
    summary_is_current,
)
from .resume import find_resume_state
from .setup import (
    log,
    schedule_change,
)
from .state import restore_rank_state
from .step import Partial
from .summary import finish, samples_trained


def restore(r: Run) -> tuple[Optional[Partial], bool]:
    """Load the checkpoint ``--resume`` names into ``r.state``. Returns the partial sums of an
    epoch continued in the middle (None: the next epoch starts from its beginning) and whether
    a checkpoint was loaded."""
    ctx, state = r.ctx, r.state
    loaded, path, note = find_resume_state(r.args, ctx, r.save_dir)
    if loaded is None:
        return None, False
    problem = state.check_compatible(loaded, str(path))
    if problem:
        raise UsageError(problem, shared=True)
    mid_epoch = state.load_state_dict(loaded)
    saved_world = loaded.get("world")
    if saved_world != ctx.world:
        saved_step = state.step
        state.reposition(r.steps_per_epoch)
        note_world_change(r, saved_world, saved_step)
    check_complete_elsewhere(r, path)
    if ctx.is_main and path.resolve().parent != r.save_dir.resolve():
        carry_best(r, path)
    elif ctx.is_main:
        check_best(r, training=state.start_epoch < r.args.epochs)
    hold_lr(state.optimizer, state.scheduler, ctx.device if r.graphed is not None else None)
    partial = restore_rank_state(state.ranks[ctx.rank], ctx.device) if mid_epoch else None
    if not mid_epoch and not state.epoch_done:
        log(ctx, f"note: the interrupted epoch {state.epoch + 1} restarts from its beginning (another "
                 "world size cannot continue its middle)")
    if state.start_epoch < r.args.epochs:
        log(ctx, f"resumed from {path} at epoch {state.start_epoch + 1}, step {state.step}{note}")
        if changed := schedule_change(r.args, loaded.get("epochs"), r.steps_per_epoch, r.lr, state):
            log(ctx, f"note: {changed}")
    kept = keep_foreign_metrics(r.save_dir, state.history) if ctx.is_main else None
    if kept is not None:
        log(ctx, f"note: {r.save_dir / 'metrics.csv'} did not hold the history of {path} (edited "
                 f"by hand, or written after a checkpoint that is gone): kept as {kept.name}; "
                 "metrics.csv is written again from the checkpoint")
    return partial, True


def note_world_change(r: Run, saved_world: Any, saved_step: int) -> None:
    """Resuming on another number of ranks: each step then takes another number of samples at
    the same --lr, and the steps are counted anew in this world's steps per epoch; said once."""
    args, world = r.args, r.ctx.world
    per_rank = args.batch_size * args.grad_accum_steps
    before = f"{per_rank * saved_world}" if isinstance(saved_world, int) else "an unrecorded number of"
    log(r.ctx, f"note: world size changed ({saved_world} -> {world}): a step takes {before} -> "
               f"{per_rank * world} samples at the same --lr, and the checkpoint's step {saved_step} is "
               f"step {r.state.step} here ({r.steps_per_epoch} steps an epoch)")


def _best_metrics(path: Path) -> Optional[dict[str, Any]]:
    """The metrics row a best.pt was saved with; None when it does not verify."""
    try:
        return checkpoint.verify(path).get("metrics")
    except (checkpoint.CheckpointError, OSError):
        return None


def carry_best(r: Run, path: Path) -> None:
    """``--resume PATH`` from another directory into a ``--save-dir`` without a best.pt: the
    best epoch so far is in PATH's run, so its best.pt is copied here (queued behind the
    writer's other files) when it is the best epoch of the history loaded; a later epoch that
    does better replaces it as usual. Otherwise the run says where the best weights are not."""
    source, target = path.resolve().parent / "best.pt", r.save_dir / "best.pt"
    if source.parent == r.save_dir.resolve() or not r.state.history:
        return
    top = max(r.state.history, key=lambda row: row["val_f1"])
    if target.exists():
        if _best_metrics(target) == top:
            return  # this history's best epoch already (the same command run again)
        kept = keep_aside(target)
        log(r.ctx, f"note: {target} is not the best epoch of {path}'s history: "
                   f"kept as {kept.name if kept else 'it was'}")
    best = _best_metrics(source)
    if best == top:
        r.saver.write(source.read_bytes(), target)
        log(r.ctx, f"note: copied {source} (the best epoch so far, {top['epoch']}) into {r.save_dir}")
        return
    log(r.ctx, f"note: {source} is missing, unreadable or not the best epoch of {path}'s "
               f"history (epoch {top['epoch']}); {r.save_dir} gets a best.pt from the first epoch "
               "this run trains that does better")


def check_best(r: Run, training: bool) -> None:
    """The run's own best.pt, resumed in its ``--save-dir``: one that does not verify (damaged
    on disk) is named, not passed over. The best epoch's weights are gone; the file is kept
    aside, and the first epoch this run trains that does better writes best.pt again."""
    target = r.save_dir / "best.pt"
    if not target.exists() or not r.state.history:
        return
    try:
        checkpoint.verify(target)
        return
    except (checkpoint.CheckpointError, OSError) as exc:
        problem = str(exc)
    top = max(r.state.history, key=lambda row: row["val_f1"])
    kept = keep_aside(target)
    log(r.ctx, f"warning: {target} does not verify ({problem}): the weights of the best epoch so far "
               f"(epoch {top['epoch']}, val F1 {top['val_f1']:.4f}) are lost; the file is kept as "
               f"{kept.name if kept else 'it was'}"
               + ("; the first epoch this run trains that does better writes best.pt again" if training
                  else "; the run is complete, so there is no best.pt (train further, or start over)"))


def check_complete_elsewhere(r: Run, path: Path) -> None:
    """Refuse ``--resume PATH`` of a finished run (no epoch left) from outside ``--save-dir``:
    there would be nothing to train, and ``--save-dir`` would get no checkpoint of it."""
    source, epochs = path.resolve().parent, r.args.epochs
    if r.state.start_epoch < epochs or source == r.save_dir.resolve():
        return
    raise UsageError(
        f"--resume {path}: that run is already complete ({len(r.state.history)} epochs, "
        f"--epochs {epochs}); its results are in {source}, and nothing is left to train into "
        f"--save-dir {r.save_dir.resolve()}. To train it further there, raise --epochs above "
        f"{r.state.start_epoch}; to train from scratch there, give --resume none", shared=True)


def already_complete(r: Run) -> dict[str, Any]:
    """A resumed run with no epoch left: say so, where its results are and how to start
    over. Nothing is written, unless the run was killed between its last checkpoint and the
    files after it: then metrics.csv, curves.png and summary.json are completed from it. A
    summary.json whose final epoch is not the checkpoint's last (another run's: one started
    over with --resume none and killed before its summary) is kept aside, with its curves.png,
    and written again."""
    state, save_dir = r.state, r.save_dir.resolve()
    best = max((row["val_f1"] for row in state.history), default=float("nan"))
    missing = [n for n in ("best.pt", "config.json") if not (r.save_dir / n).is_file()]
    log(r.ctx, f"fastddp.train: the run in {save_dir} is already complete ({len(state.history)} "
               f"epochs, --epochs {r.args.epochs}; best val F1 {best:.4f}). Its results are in "
               f"{save_dir} (metrics.csv, summary.json"
               + "".join(f", {n}" for n in ("best.pt", "config.json") if n not in missing) + ")"
               + (f"; {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not there (look for "
                  f"{missing[0]}.*.bak beside it)" if missing else "")
               + ". To train from scratch add --resume none (it keeps them aside as .bak) or choose "
               "another --save-dir; to train further raise --epochs")
    metrics_file, summary_file = r.save_dir / "metrics.csv", r.save_dir / "summary.json"
    stale = not metrics_file.exists() or metrics_file.read_bytes() != metrics_csv(state.history)
    current = summary_is_current(r.save_dir, state.history)
    if r.ctx.is_main and state.history and (stale or not current):
        kept = [] if current else list(keep_earlier_files(r.save_dir, FINAL_FILES).values())
        log(r.ctx, "note: writing metrics.csv, curves.png and summary.json from last.pt's "
                   "history (they were missing, behind it, or of another run"
                   + "".join(f"; kept {p.name}" for p in kept) + ")")
        r.saver.write(metrics_csv(state.history), metrics_file)
        last = state.history[-1]
        summary = finish(r, last["elapsed_s"], samples_trained(state.history), quiet=True)
        return {**summary, "already_complete": True}
    if summary_file.exists():
        return {**json.loads(summary_file.read_text()), "already_complete": True}
    return {"best_val_f1": state.best_f1, "save_dir": str(save_dir), "already_complete": True}
