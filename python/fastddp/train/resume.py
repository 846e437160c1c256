"""Which checkpoint ``--resume`` continues from."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from . import checkpoint
from .errors import UsageError
from .setup import Context, log


def newness(state: dict[str, Any]) -> tuple[int, bool]:
    """Orders a run's checkpoints: by optimizer step, an epoch's end after its mid-epoch save."""
    return int(state.get("step", -1)), bool(state.get("epoch_done"))


def find_resume_state(args: argparse.Namespace, ctx: Context, save_dir: Path,
                      accept: Callable[[dict[str, Any]], bool] | None = None, announce: bool = True,
                      ) -> tuple[dict[str, Any] | None, Path | None, str]:
    """The checkpoint ``--resume`` asks for: ``(state, file, note for the log)``, or ``None``s.

    With ``auto`` rank 0 picks the most recently written checkpoint in ``save_dir`` that
    verifies (and that ``accept`` takes) and every rank loads that file; checkpoint files of
    which none verifies stop the run (UsageError) instead of starting over. ``none`` starts
    over, except in a restarted torchrun job (:func:`own_checkpoint`); a path:
    :func:`given_checkpoint`. ``announce``: log that nothing was found and the run starts
    over (False where the caller decides what happens then)."""
    if args.resume == "none":
        if not restarted_job():
            return None, None, ""
        return own_checkpoint(args, ctx, save_dir)
    if args.resume != "auto":
        return given_checkpoint(args, ctx, save_dir)
    choice: list[Any] = [None, None, ""]  # path, error, note
    if ctx.is_main:
        try:
            found = checkpoint.latest(save_dir / "last.pt", accept=accept)
        except checkpoint.CheckpointError as exc:
            choice[1] = str(exc)
        else:
            if found is not None:
                choice[0] = str(found.path)
                if found.skipped or found.path.name != "last.pt":
                    choice[2] = (" (the newest checkpoint that verifies"
                                 + "".join(f"; passed over {s}" for s in found.skipped) + ")")
                if found.path.name == "last.pt.tmp":  # its save was cut off: finish it first
                    choice[0] = str(checkpoint.complete_cut_off_save(save_dir / "last.pt"))
                    choice[2] += f" (the save a stop cut off is completed: {found.path.name} is now last.pt)"
            else:
                choice[1], choice[2] = nothing_to_resume(save_dir)
    if ctx.distributed:
        dist.broadcast_object_list(choice, src=0)
    path, error, note = choice
    if error is not None:
        raise UsageError(error, shared=True)
    if path is None:
        if note and announce:
            log(ctx, f"note: {note}; starting from epoch 1")
        return None, None, ""
    try:
        state = found.state if ctx.is_main else checkpoint.verify(path)
    except checkpoint.CheckpointError as exc:
        raise UsageError(str(exc)) from None
    return state, Path(path), note




def given_checkpoint(args: argparse.Namespace, ctx: Context,
                     save_dir: Path) -> tuple[dict[str, Any] | None, Path | None, str]:
    """``--resume PATH``. When PATH lies outside ``save_dir`` and ``save_dir`` holds a
    checkpoint that continues PATH's run (PATH's history, then more: what this command wrote
    before it was stopped), that one is taken, so the same command run again continues
    instead of starting over from PATH. A ``save_dir`` that holds another run is refused:
    continuing PATH there would overwrite it."""
    path = Path(args.resume)
    try:
        given = checkpoint.load(path)
    except checkpoint.CheckpointError as exc:
        raise UsageError(str(exc)) from None
    if path.resolve().parent == save_dir.resolve():
        return given, path, ""
    auto = argparse.Namespace(**{**vars(args), "resume": "auto"})
    own, own_path, note = find_resume_state(auto, ctx, save_dir, announce=False)
    if own is None:
        return given, path, ""
    if continues(own, given):
        return own, own_path, f"{note} (it continues --resume {path})"
    raise UsageError(f"--save-dir {save_dir} holds the checkpoint of another run ({own_path}: "
                     f"{len(own.get('history', []))} epoch(s), step {own.get('step')}); "
                     f"continuing {path} there would overwrite it. Choose another --save-dir, "
                     "or continue that run with --resume auto", shared=True)


def continues(later: dict[str, Any], earlier: dict[str, Any]) -> bool:
    """Whether checkpoint ``later`` is ``earlier``'s run trained further: the same epochs
    first, at least as many steps."""
    history = earlier.get("history", [])
    return (newness(later) >= newness(earlier)
            and later.get("history", [])[:len(history)] == history)


def restarted_job() -> bool:
    """Whether this process is a restart of a torchrun job (``--max-restarts``): torchrun
    starts it with the same command line as the attempt that failed."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0


def own_checkpoint(args: argparse.Namespace, ctx: Context,
                   save_dir: Path) -> tuple[dict[str, Any] | None, Path | None, str]:
    """``--resume none`` in a restarted torchrun job: the job's first attempt started over, and
    the attempts after it continue the newest checkpoint that attempt or a later one wrote
    (the same ``TORCHELASTIC_RUN_ID``); starting over again would throw away the job's own
    progress at every restart. A checkpoint of another job is not taken."""
    job = os.environ.get("TORCHELASTIC_RUN_ID")
    auto = argparse.Namespace(**{**vars(args), "resume": "auto"})
    try:
        state, path, note = find_resume_state(
            auto, ctx, save_dir, accept=lambda s: s.get("run_id") == job)
    except UsageError:
        return None, None, ""  # nothing of this job's that verifies: start over, as asked
    if state is None:
        return None, None, ""
    restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
    return state, path, (f"{note} (restart {restart} of this torchrun job: --resume none "
                         "applied to its first attempt)")


def nothing_to_resume(save_dir: Path) -> tuple[str | None, str]:
    """``(error, note)`` for a ``save_dir`` without a checkpoint that verifies. The results of
    a run (metrics.csv, summary.json: written only after its last.pt) without its checkpoint
    are an error, not something to overwrite; a best.pt or an unfinished first write (a crash
    during the first epoch's saves) are named in a note."""
    results = [n for n in ("metrics.csv", "summary.json") if (save_dir / n).exists()]
    if results:
        return (f"{save_dir} holds the results of a run ({', '.join(results)}) but no "
                "checkpoint (last.pt) to continue it; start over with --resume none (which "
                "overwrites them) or choose another --save-dir"), ""
    left = [f.name for f in checkpoint.candidates(save_dir / "last.pt") if f.exists()]
    left += ["best.pt"] if (save_dir / "best.pt").exists() else []
    if left:
        return None, (f"{save_dir} holds no complete checkpoint, only {', '.join(left)} from a "
                      "run stopped during its first saves")
    return None, ""
