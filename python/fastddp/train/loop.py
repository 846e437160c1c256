"""The training run behind ``python -m fastddp.train`` (and ``torchrun -m fastddp.train``):
build the pieces (:mod:`.build`), restore a checkpoint (:mod:`.restore`), run the epochs
(:mod:`.epoch`), write the summary (:mod:`.summary`)."""

from __future__ import annotations

import argparse
import contextlib
import time
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist

from .._net import finish_collectives
from . import checkpoint, signals
from .build import build
from .epoch import end_epoch, run_epoch
from .errors import UsageError
from .outputs import (
    FINAL_FILES,
    TENSORBOARD_DIRS,
    GpuMonitor,
    earlier_run_files,
    keep_earlier_files,
    log_header,
    make_tensorboard,
    write_config,
)
from .restore import already_complete, restore
from .save_dir import check_save_dir, save_dir_lock
from .setup import (
    Context,
    log,
    setup_distributed,
)
from .summary import finish, samples_trained, trained_before


def run(args: argparse.Namespace) -> dict[str, Any]:
    ctx = setup_distributed(args)
    # Rank 0 writes checkpoints in the background (the other ranks would wait for it).
    saver = checkpoint.CheckpointWriter(asynchronous=not getattr(args, "sync_checkpoints", False))
    # SIGTERM (torchrun stopping the survivors of a failed rank, a preemption) raises
    # signals.Terminated instead of ending the process on the spot, so the checkpoint still
    # being written reaches the disk.
    # The save directory's lock is released after the writer closed (the last with-item exits
    # first), so no second run starts writing there before this one's files are on disk.
    with contextlib.ExitStack() as held, signals.SigtermGuard() as sigterm:
        try:
            try:
                result = _train(args, ctx, saver, held)
            except BaseException:
                try:
                    with sigterm.shielded():
                        saver.close()  # what was saved reaches the disk; the error comes first
                except OSError as exc:
                    log(ctx, f"warning: {exc}")
                raise
            with sigterm.shielded():
                saver.close()  # what was saved is on disk before the process ends
            if ctx.distributed:
                finish_collectives()  # no collective left for a gloo thread to free at exit
            return result
        finally:
            if ctx.distributed and dist.is_initialized():
                dist.destroy_process_group()


def _train(args: argparse.Namespace, ctx: Context, saver: checkpoint.CheckpointWriter,
           held: contextlib.ExitStack) -> dict[str, Any]:
    save_dir = Path(args.save_dir)
    # Rank 0 checks the directory; every rank stops with its verdict, so that the others end
    # with the same input error (printed once) instead of being stopped by torchrun.
    problem: list[Optional[str]] = [None]
    if ctx.is_main:
        try:
            created = check_save_dir(save_dir, TENSORBOARD_DIRS if args.tensorboard else ())
            held.enter_context(save_dir_lock(save_dir, created))
        except UsageError as exc:
            problem[0] = str(exc)
    if ctx.distributed:
        dist.broadcast_object_list(problem, src=0)
    if problem[0] is not None:
        raise UsageError(problem[0], shared=True)
    r = build(args, ctx, save_dir, saver)
    partial, resumed = restore(r)
    if resumed and r.state.start_epoch >= args.epochs:
        return already_complete(r)
    if ctx.is_main:
        # starting from epoch 1 over a run with a history, or over the best weights or the
        # checkpoints of a run (--resume none): that run's files are kept too, its checkpoints
        # with them, so that a stop before this run's first save leaves no mix of the two runs
        kept = keep_earlier_files(save_dir, FINAL_FILES + (() if resumed else earlier_run_files(save_dir)))
        if kept:
            log(ctx, f"note: the {'/'.join(kept)} in {save_dir} (of an earlier run, or of this "
                     f"one with fewer --epochs) kept as {', '.join(p.name for p in kept.values())}; "
                     "this run writes its own")
        write_config(save_dir, args, ctx, r.amp, r.amp_dtype)
    log_header(r)
    r.board = make_tensorboard(save_dir, args, ctx, r.state.step, resumed, r.state.epoch_done)
    r.monitor = GpuMonitor(ctx.device) if ctx.device.type == "cuda" else None
    t_start = time.perf_counter() - trained_before(r.state.history, partial)
    for epoch in range(r.state.start_epoch, args.epochs):
        epoch_time = run_epoch(r, epoch, partial)
        partial = None
        end_epoch(r, epoch, epoch_time, t_start)
    return finish(r, time.perf_counter() - t_start, samples_trained(r.state.history))
