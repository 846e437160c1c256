"""The training run behind ``python -m fastddp.train`` (and ``torchrun -m fastddp.train``):
build the pieces (:func:`build`), restore a checkpoint (:func:`restore`), run the epochs
(:mod:`.epoch`), write the summary."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

import fastddp

from .._net import finish_collectives
from . import checkpoint, signals
from .epoch import end_epoch, run_epoch
from .errors import UsageError
from .graph import GraphedStep, hold_lr
from .models import build_model
from .outputs import (
    EARLIER_RUN_FILES,
    FINAL_FILES,
    TENSORBOARD_DIRS,
    GpuMonitor,
    TensorBoard,
    keep_earlier_files,
    keep_foreign_metrics,
    log_header,
    make_tensorboard,
    metrics_csv,
    plot_curves,
    summary_is_current,
    write_config,
)
from .resume import find_resume_state
from .save_dir import check_save_dir, save_dir_lock
from .settings import resume_flags
from .setup import (
    Context,
    class_weights,
    data_identity,
    load_data,
    log,
    lr_lambda,
    resolve_cuda_graph,
    schedule_change,
    seed_everything,
    setup_distributed,
)
from .state import TrainState, restore_rank_state, unwrap
from .step import EpochSums, Partial, TrainStep


@dataclass
class Run:
    """The pieces of one training run; :attr:`state` is what its checkpoints hold."""

    args: argparse.Namespace
    ctx: Context
    save_dir: Path
    saver: checkpoint.CheckpointWriter
    model: nn.Module  # as trained: the DDPWrapper / DataParallel, or the module itself
    state: TrainState
    val_loader: Any
    loss_fn: nn.Module
    amp: bool
    amp_dtype: torch.dtype
    lr: float
    steps_per_epoch: int
    step: TrainStep
    sums: EpochSums
    graphed: Optional[GraphedStep] = None
    board: Optional[TensorBoard] = None
    monitor: Optional[GpuMonitor] = None


def autocast_factory(amp: bool, dtype: torch.dtype,
                     device: torch.device) -> Callable[[], AbstractContextManager]:
    """The context each forward runs in: autocast to ``dtype``, or nothing."""
    if not amp:
        # A disabled torch.autocast still costs ~10 us to enter and leave, every step.
        return contextlib.nullcontext
    return lambda: torch.autocast(device.type, dtype=dtype)


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
        # starting from epoch 1 over a run with a history: that run's files are kept too
        earlier_run = not resumed and (save_dir / "metrics.csv").is_file()
        kept = keep_earlier_files(save_dir, FINAL_FILES + (EARLIER_RUN_FILES if earlier_run else ()))
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


def trained_before(history: list[dict[str, Any]], partial: Optional[Partial]) -> float:
    """Seconds a resumed run trained before this process: its last finished epoch's
    ``elapsed_s`` and the part of an unfinished epoch up to its checkpoint. A run's
    ``elapsed_s`` and summary count training time, not the time between a checkpoint and an
    interruption, nor the time the run was stopped."""
    before = history[-1]["elapsed_s"] if history else 0.0
    return before + (float(partial[3]) if partial is not None and len(partial) > 3 else 0.0)


def samples_trained(history: list[dict[str, Any]]) -> int:
    """The samples all ranks trained on in the epochs of ``history``."""
    return round(sum(row["samples_per_s"] * row["epoch_time_s"] for row in history))


def build(args: argparse.Namespace, ctx: Context, save_dir: Path,
          saver: checkpoint.CheckpointWriter) -> Run:
    """Model, data, optimizer, schedule, scaler and step of a run, in the order that fixes the
    initial weights (seeded identically on every rank)."""
    use_cuda = ctx.device.type == "cuda"
    amp = args.amp if args.amp is not None else use_cuda
    # An explicit --amp-dtype is honoured on every device; the default follows the device.
    amp_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[
        args.amp_dtype or ("fp16" if use_cuda else "bf16")]
    seed_everything(args.seed)  # identical initial weights on every rank
    model = wrap_model(args, ctx, build_model(args.mode, args.model).to(ctx.device))
    train_set, test_set = load_data(args)
    loader, val_loader = make_loaders(args, ctx, train_set, test_set)
    accum = args.grad_accum_steps
    if len(loader) < accum:
        raise UsageError(f"--batch-size {args.batch_size} x --grad-accum-steps {accum} leaves "
                         f"no full optimizer step per epoch on {ctx.world} rank(s) of "
                         f"{len(train_set)} samples; lower them", shared=True)
    scale = {"linear": ctx.world * accum, "sqrt": math.sqrt(ctx.world * accum), "none": 1}
    lr = args.lr * scale[args.scale_lr]
    scaler_on = amp and amp_dtype == torch.float16
    graph = resolve_cuda_graph(args, ctx, model, scaler_on)
    # torch's fused AdamW has CPU and CUDA kernels: one vectorised pass per tensor instead of
    # ~10 ATen ops per parameter (2.8 of 15.8 ms per step for the HAR MLP on 2 CPU ranks).
    optimizer = torch.optim.AdamW(unwrap(model).parameters(), lr=lr,
                                  weight_decay=args.weight_decay, fused=True, capturable=graph)
    if graph:
        hold_lr(optimizer, None, ctx.device)
    steps_per_epoch = len(loader) // accum
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(
        steps_per_epoch * args.epochs, int(args.warmup_epochs * steps_per_epoch)))
    scaler = fastddp.GradScaler(device=ctx.device.type, enabled=scaler_on)
    weight = class_weights(train_set, ctx.device) if args.class_weights == "auto" else None
    settings = {**resume_flags(args), "amp": amp, "lr_scaled": lr,
                "amp_dtype": {torch.float16: "fp16", torch.bfloat16: "bf16"}[amp_dtype] if amp else None,
                "train_samples": len(train_set) if hasattr(train_set, "__len__") else None,
                "data": data_identity(args, train_set, test_set)}
    state = TrainState(model, optimizer, scheduler, scaler, loader, mode=args.model or args.mode,
                       world=ctx.world, settings=settings, epochs=args.epochs,
                       run_id=os.environ.get("TORCHELASTIC_RUN_ID"))
    loss_fn = nn.CrossEntropyLoss(weight=weight)
    step = TrainStep(model, loss_fn, optimizer, scaler, autocast_factory(amp, amp_dtype, ctx.device),
                     args.clip_grad or None,
                     ddp=model if isinstance(model, fastddp.DDPWrapper) else None,
                     # without fp16's GradScaler (AMP off, or bf16) nothing else skips a
                     # non-finite step: the weights would turn NaN and training go on
                     check_finite=not scaler_on, max_nan_steps=args.max_nan_steps,
                     rank=ctx.rank, world=ctx.world)
    sums = EpochSums(ctx.device)
    return Run(args, ctx, save_dir, saver, model, state, val_loader, loss_fn, amp, amp_dtype, lr,
               steps_per_epoch, step, sums,
               graphed=GraphedStep(step, sums, ctx.device) if graph else None)


def wrap_model(args: argparse.Namespace, ctx: Context, model: nn.Module) -> nn.Module:
    """The model as ``--multi-gpu`` trains it: DDPWrapper, DataParallel or itself."""
    if args.multi_gpu == "ddp":
        if args.sync_batchnorm:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        comm = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.comm_dtype]
        return fastddp.DDPWrapper(
            model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
            find_unused_parameters=args.find_unused_parameters, comm_dtype=comm)
    if args.multi_gpu == "dp":
        return nn.DataParallel(model, device_ids=args.gpu_list or None)
    return model


def make_loaders(args: argparse.Namespace, ctx: Context, train_set: Any, test_set: Any):
    """The training loader (sharded, shuffled per epoch) and the evaluation loader (every test
    sample exactly once across the ranks)."""
    sampler = fastddp.DistributedSampler(train_set, num_replicas=ctx.world, rank=ctx.rank,
                                         shuffle=True, seed=args.seed, drop_last=True)
    # On a GPU a data set that fits (HAR: 34 MB) lives on the device: batches are gathered
    # there, with no host work per batch.
    resident = "auto" if ctx.device.type == "cuda" and isinstance(train_set, TensorDataset) else False
    loader = fastddp.PrefetchLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                                    num_workers=args.num_workers, device=ctx.device,
                                    drop_last=True, device_resident=resident)
    # Every world-th test sample from this rank's: each sample is evaluated exactly once.
    val_loader = fastddp.PrefetchLoader(test_set, batch_size=max(256, args.batch_size),
                                        sampler=range(ctx.rank, len(test_set), ctx.world),
                                        num_workers=args.num_workers, device=ctx.device,
                                        drop_last=False, device_resident=resident)
    return loader, val_loader


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
    if loaded.get("world") != ctx.world:
        state.reposition(r.steps_per_epoch)
    check_complete_elsewhere(r, path)
    if ctx.is_main:
        carry_best(r, path)
    hold_lr(state.optimizer, state.scheduler, ctx.device if r.graphed is not None else None)
    partial = restore_rank_state(state.ranks[ctx.rank], ctx.device) if mid_epoch else None
    if not mid_epoch and not state.epoch_done:
        log(ctx, f"note: world size changed ({loaded.get('world')} -> {ctx.world}); the "
                 f"interrupted epoch {state.epoch + 1} restarts from its beginning")
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


def carry_best(r: Run, path: Path) -> None:
    """``--resume PATH`` from another directory into a ``--save-dir`` without a best.pt: the
    best epoch so far is in PATH's run, so its best.pt is copied here (queued behind the
    writer's other files) when it is the best epoch of the history loaded; a later epoch that
    does better replaces it as usual. Otherwise the run says where the best weights are not."""
    source, target = path.resolve().parent / "best.pt", r.save_dir / "best.pt"
    if source.parent == r.save_dir.resolve() or target.exists() or not r.state.history:
        return
    try:
        best = checkpoint.verify(source)
    except (checkpoint.CheckpointError, OSError):
        best = None
    top = max(r.state.history, key=lambda row: row["val_f1"])
    if best is not None and best.get("metrics") == top:
        r.saver.write(source.read_bytes(), target)
        log(r.ctx, f"note: copied {source} (the best epoch so far, {top['epoch']}) into {r.save_dir}")
        return
    log(r.ctx, f"note: {source} is missing, unreadable or not the best epoch of {path}'s "
               f"history (epoch {top['epoch']}); {r.save_dir} gets a best.pt from the first epoch "
               "this run trains that does better")


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
    log(r.ctx, f"fastddp.train: the run in {save_dir} is already complete ({len(state.history)} "
               f"epochs, --epochs {r.args.epochs}; best val F1 {best:.4f}). Its results are in "
               f"{save_dir} (metrics.csv, best.pt, summary.json). To train from scratch add "
               "--resume none (it keeps them aside as .bak) or choose another --save-dir; to train "
               "further raise --epochs")
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


def finish(r: Run, total: float, samples_total: int, quiet: bool = False) -> dict[str, Any]:
    """The run's summary: logged (unless ``quiet``), written to summary.json, and returned."""
    args, ctx, history = r.args, r.ctx, r.state.history
    accum = args.grad_accum_steps
    summary = {
        "best_val_f1": r.state.best_f1,
        "best_val_acc": max((row["val_acc"] for row in history), default=0.0),
        "final": history[-1] if history else {},
        "total_time_s": total,
        "samples_per_s": samples_total / total if total > 0 else 0.0,
        "effective_batch": args.batch_size * ctx.world * accum,
        "world_size": ctx.world,
        "save_dir": str(r.save_dir.resolve()),
    }
    if ctx.is_main:
        curves = plot_curves(history) if history else None
        if curves is not None:
            r.saver.write(curves, r.save_dir / "curves.png")
        elif history:
            log(ctx, "note: curves.png not drawn: matplotlib is not installed "
                     "(pip install matplotlib; metrics.csv holds the same numbers)")
        # through the writer thread: never on disk before the checkpoints it summarises
        r.saver.write(json.dumps(summary, indent=1).encode(), r.save_dir / "summary.json")
        gpu = r.monitor.summary() if r.monitor is not None else ""
        if not quiet:
            log(ctx, f"done: best val acc {summary['best_val_acc']:.4f} F1 {r.state.best_f1:.4f} "
                     f"| {total:.1f}s, {summary['samples_per_s']:.0f} samples/s, effective "
                     f"batch {summary['effective_batch']} | files in {summary['save_dir']}{gpu}")
    if r.board is not None:
        r.board.close()
    return summary
