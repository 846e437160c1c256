"""The training run behind ``python -m fastddp.train`` (and ``torchrun -m fastddp.train``)."""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import math
import os
import random
import signal
import sys
import time
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

import fastddp

from .._net import finish_collectives, free_port
from . import checkpoint, signals
from .cli import UsageError
from .graph import GraphedStep, hold_lr
from .metrics import accuracy, confusion, macro_f1
from .models import build_model, load_factory

CLASSES = 6


@dataclass
class Context:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    distributed: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def log(ctx: Context, msg: str) -> None:
    if ctx.is_main:
        print(msg, flush=True)


# ----------------------------------------------------------------------------- set-up
def setup_distributed(args: argparse.Namespace) -> Context:
    ctx = Context()
    if args.multi_gpu != "ddp":
        if torch.cuda.is_available():
            ctx.device = torch.device("cuda", args.gpu_list[0] if args.gpu_list else 0)
        return ctx
    ctx.rank = int(os.environ.get("RANK", "0"))
    ctx.world = int(os.environ.get("WORLD_SIZE", "1"))
    ctx.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() and args.backend != "gloo"
    backend = "nccl" if use_cuda else "gloo"
    if args.backend == "nccl":
        backend = "nccl"
    if use_cuda:
        gpu = args.gpu_list[ctx.local_rank] if args.gpu_list else ctx.local_rank
        ctx.device = torch.device("cuda", gpu)
        torch.cuda.set_device(ctx.device)
    if "MASTER_ADDR" not in os.environ:  # `--multi-gpu ddp` run by plain python: a world of 1
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    timeout = timedelta(seconds=args.timeout)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is not None:
        # Under torchrun the workers of every restart share the agent's store; without a
        # per-restart prefix the restarted ranks can read the addresses the dead attempt's
        # gloo ranks published and fail with "connectFullMesh ... Connection refused".
        store, _, _ = next(dist.rendezvous("env://", rank=ctx.rank, world_size=ctx.world,
                                           timeout=timeout))
        dist.init_process_group(backend, store=dist.PrefixStore(f"fastddp/restart_{restart}", store),
                                rank=ctx.rank, world_size=ctx.world, timeout=timeout)
    else:
        dist.init_process_group(backend, rank=ctx.rank, world_size=ctx.world, timeout=timeout)
    ctx.distributed = True
    return ctx




def resolve_cuda_graph(args: argparse.Namespace, ctx: Context, model: nn.Module,
                       scaler_on: bool) -> bool:
    """Whether the training step runs as one CUDA graph (``--cuda-graph auto|on|off``)."""
    if args.cuda_graph == "off":
        return False
    reasons = []
    if ctx.device.type != "cuda":
        reasons.append("it needs a CUDA device")
    if isinstance(model, (fastddp.DDPWrapper, nn.DataParallel)):
        reasons.append("it runs in a single process without --multi-gpu ddp/dp")
    if not scaler_on:
        reasons.append("it needs fp16 AMP (--amp --amp-dtype fp16: inf/NaN steps are then "
                       "skipped on the device; without it non-finite losses are checked on the host)")
    if args.grad_accum_steps != 1:
        reasons.append("it needs --grad-accum-steps 1")
    if reasons and args.cuda_graph == "on":
        raise UsageError("--cuda-graph on: " + "; ".join(reasons) + ". Use --cuda-graph auto or off")
    return not reasons


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass


def load_data(args: argparse.Namespace) -> tuple[Any, Any]:
    """(train, test) datasets of (x: float32 N×9×128, y: int64) samples."""
    if args.dataset:
        try:
            train, test = load_factory(args.dataset, "--dataset")()
        except (TypeError, ValueError) as exc:
            raise UsageError(f"--dataset {args.dataset}: must return (train, test) ({exc})") from exc
        return train, test
    from fastddp.data import har

    if args.data_dir:
        try:
            data = har.load_uci_har(args.data_dir)
        except (FileNotFoundError, ValueError) as exc:
            raise UsageError(f"--data-dir {args.data_dir}: {exc}") from exc
    else:
        data = har.synthetic_har(seed=0)
    return (TensorDataset(data.x_train, data.y_train), TensorDataset(data.x_test, data.y_test))


class ShardSampler:
    """Every ``world``-th index from ``rank``: each test sample is evaluated exactly once."""

    def __init__(self, length: int, rank: int, world: int) -> None:
        self._indices = torch.arange(rank, length, world, dtype=torch.int64)

    def indices(self) -> torch.Tensor:
        return self._indices

    def __iter__(self):
        return iter(self._indices.tolist())

    def __len__(self) -> int:
        return len(self._indices)


def class_weights(train: Any, device: torch.device) -> torch.Tensor:
    y = train.tensors[1] if hasattr(train, "tensors") else torch.tensor([int(s[1]) for s in train])
    counts = torch.bincount(y.to(torch.int64), minlength=CLASSES).to(torch.float32).clamp_min(1)
    return (counts.sum() / (CLASSES * counts)).to(device)


def lr_lambda(total_steps: int, warmup_steps: int):
    def f(step: int) -> float:
        if warmup_steps > 0 and step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return f


def unwrap(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)


def model_signature(model: nn.Module) -> dict[str, list[int]]:
    return {k: list(v.shape) for k, v in unwrap(model).state_dict().items()}


def check_save_dir(save_dir: Path) -> None:
    try:
        save_dir.mkdir(parents=True, exist_ok=True)
        probe = save_dir / ".write-test"
        probe.write_bytes(b"0" * 4096)
        probe.unlink()
    except OSError as exc:
        raise UsageError(f"--save-dir {save_dir}: cannot write there ({exc.strerror or exc}); "
                         "choose a writable directory") from None


def newness(state: dict[str, Any]) -> tuple[int, bool]:
    """Orders a run's checkpoints: by optimizer step, an epoch's end after its mid-epoch save."""
    return int(state.get("step", -1)), bool(state.get("epoch_done"))


def find_resume_state(args: argparse.Namespace, ctx: Context,
                      save_dir: Path) -> tuple[dict[str, Any] | None, Path | None, str]:
    """The checkpoint ``--resume`` asks for: ``(state, file, note for the log)``, or ``None``s.

    With ``auto`` rank 0 picks the newest checkpoint in ``save_dir`` that verifies and every
    rank loads that file; checkpoint files of which none verifies stop the run (UsageError)
    instead of starting over."""
    if args.resume == "none":
        return None, None, ""
    if args.resume != "auto":
        path = Path(args.resume)
        try:
            return checkpoint.load(path), path, ""
        except checkpoint.CheckpointError as exc:
            raise UsageError(str(exc)) from None
    choice: list[Any] = [None, None, ""]  # path, error, note
    if ctx.is_main:
        try:
            found = checkpoint.latest(save_dir / "last.pt", key=newness)
        except checkpoint.CheckpointError as exc:
            choice[1] = str(exc)
        else:
            if found is not None:
                choice[0] = str(found.path)
                if found.skipped or found.path.name != "last.pt":
                    choice[2] = (" (the newest checkpoint that verifies"
                                 + "".join(f"; passed over {s}" for s in found.skipped) + ")")
            elif any(f.exists() for f in checkpoint.candidates(save_dir / "last.pt")):
                choice[2] = "unfinished"
    if ctx.distributed:
        dist.broadcast_object_list(choice, src=0)
    path, error, note = choice
    if error is not None:
        raise UsageError(error)
    if path is None:
        if note:
            log(ctx, f"note: {save_dir} holds only an unfinished first checkpoint write; "
                     "starting from epoch 1")
        return None, None, ""
    try:
        state = found.state if ctx.is_main else checkpoint.verify(path)
    except checkpoint.CheckpointError as exc:
        raise UsageError(str(exc)) from None
    return state, Path(path), note


# ----------------------------------------------------------------------------- loop
def evaluate(model: nn.Module, loader: Any, ctx: Context, amp_ctx, loss_fn) -> dict[str, float]:
    model.eval()
    cm = torch.zeros(CLASSES, CLASSES, dtype=torch.int64, device=ctx.device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=ctx.device)
    with torch.no_grad():
        for x, y in loader:
            with amp_ctx():
                out = model(x)
            loss_sum += loss_fn(out.float(), y).double() * y.numel()
            cm += confusion(out.argmax(1), y, CLASSES)
    if ctx.distributed:
        dist.all_reduce(cm)
        dist.all_reduce(loss_sum)
    n = int(cm.sum())
    model.train()
    return {"val_loss": float(loss_sum) / max(1, n), "val_acc": accuracy(cm.cpu()),
            "val_f1": macro_f1(cm.cpu()), "val_n": n}


def run(args: argparse.Namespace) -> dict[str, Any]:
    ctx = setup_distributed(args)
    # Rank 0 writes checkpoints in the background (the other ranks would wait for it).
    saver = checkpoint.CheckpointWriter(asynchronous=not getattr(args, "sync_checkpoints", False))
    # SIGTERM (torchrun stopping the survivors of a failed rank, a preemption) raises
    # signals.Terminated instead of ending the process on the spot, so the checkpoint still
    # being written reaches the disk.
    with signals.SigtermGuard() as sigterm:
        try:
            try:
                result = _train(args, ctx, saver)
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


def _train(args: argparse.Namespace, ctx: Context, saver: checkpoint.CheckpointWriter) -> dict[str, Any]:
    save_dir = Path(args.save_dir)
    if ctx.is_main:
        check_save_dir(save_dir)
    use_cuda = ctx.device.type == "cuda"
    amp = args.amp if args.amp is not None else use_cuda
    amp_dtype = torch.bfloat16 if (args.amp_dtype == "bf16" or not use_cuda) else torch.float16

    seed_everything(args.seed)  # identical initial weights on every rank
    model = build_model(args.mode, args.model).to(ctx.device)
    train_set, test_set = load_data(args)

    if args.multi_gpu == "ddp":
        if args.sync_batchnorm:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        comm = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.comm_dtype]
        model = fastddp.DDPWrapper(
            model, device_ids=[ctx.device.index] if use_cuda else None,
            find_unused_parameters=args.find_unused_parameters, comm_dtype=comm)
    elif args.multi_gpu == "dp":
        model = nn.DataParallel(model, device_ids=args.gpu_list or None)

    sampler = fastddp.DistributedSampler(train_set, num_replicas=ctx.world, rank=ctx.rank,
                                         shuffle=True, seed=args.seed, drop_last=True)
    # On a GPU a data set that fits (HAR: 34 MB) lives on the device: batches are gathered
    # there, with no host work per batch.
    resident = "auto" if use_cuda and isinstance(train_set, TensorDataset) else False
    loader = fastddp.PrefetchLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                                    num_workers=args.num_workers, device=ctx.device,
                                    drop_last=True, device_resident=resident)
    val_loader = fastddp.PrefetchLoader(test_set, batch_size=max(256, args.batch_size),
                                        sampler=ShardSampler(len(test_set), ctx.rank, ctx.world),
                                        num_workers=args.num_workers, device=ctx.device,
                                        drop_last=False, device_resident=resident)
    if len(loader) < args.grad_accum_steps:
        raise UsageError(f"--batch-size {args.batch_size} x --grad-accum-steps "
                         f"{args.grad_accum_steps} leaves no full optimizer step per epoch "
                         f"on {ctx.world} rank(s) of {len(train_set)} samples; lower them")

    accum = args.grad_accum_steps
    scale = {"linear": ctx.world * accum, "sqrt": math.sqrt(ctx.world * accum), "none": 1}[args.scale_lr]
    lr = args.lr * scale
    # torch's fused AdamW has CPU and CUDA kernels: one vectorised pass per tensor instead of
    # ~10 ATen ops per parameter (2.8 of 15.8 ms per step for the HAR MLP on 2 CPU ranks).
    fused = True
    scaler_on = amp and amp_dtype == torch.float16
    graph = resolve_cuda_graph(args, ctx, model, scaler_on)
    optimizer = torch.optim.AdamW(unwrap(model).parameters(), lr=lr,
                                  weight_decay=args.weight_decay, fused=fused, capturable=graph)
    if graph:
        hold_lr(optimizer, None, ctx.device)
    steps_per_epoch = len(loader) // accum
    total_steps = steps_per_epoch * args.epochs
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(total_steps, int(args.warmup_epochs * steps_per_epoch)))
    scaler = fastddp.GradScaler(device=ctx.device.type, enabled=scaler_on)
    weight = class_weights(train_set, ctx.device) if args.class_weights == "auto" else None
    loss_fn = nn.CrossEntropyLoss(weight=weight)

    def amp_ctx():
        # A disabled torch.autocast still costs ~10 us to enter and leave, every step.
        return torch.autocast(ctx.device.type, dtype=amp_dtype) if amp else contextlib.nullcontext()

    # ---------------------------------------------------------------- resume
    start_epoch, global_step, best_f1, history = 0, 0, -1.0, []
    resumed_mid_epoch = False
    partial = (0.0, 0, 0)  # this rank's (loss sum, correct, seen) of an interrupted epoch
    state, resume_path, note = find_resume_state(args, ctx, save_dir)
    if state is not None:
        if state.get("signature") != model_signature(model) or state.get("mode") != (
                args.model or args.mode):
            raise UsageError(f"{resume_path} was written for model {state.get('mode')!r} with "
                             "other parameter shapes; use a different --save-dir or --resume none")
        unwrap(model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        scaler.load_state_dict(state["scaler"])
        hold_lr(optimizer, scheduler, ctx.device if graph else None)
        start_epoch, global_step = state["epoch"], state["step"]
        best_f1, history = state["best_f1"], state["history"]
        if state.get("epoch_done"):
            start_epoch += 1
        elif state.get("world") == ctx.world:
            loader.set_epoch(start_epoch)
            loader.load_state_dict(state["loader"])
            resumed_mid_epoch = True
            rng = state["rng"][ctx.rank]
            partial = rng.get("partial", partial)
            torch.set_rng_state(rng["cpu"])
            if use_cuda and rng.get("cuda") is not None:
                torch.cuda.set_rng_state(rng["cuda"], ctx.device)
        else:
            log(ctx, f"note: world size changed ({state.get('world')} -> {ctx.world}); the "
                     f"interrupted epoch {start_epoch + 1} restarts from its beginning")
        log(ctx, f"resumed from {resume_path} at epoch {start_epoch + 1}, step {global_step}{note}")

    if ctx.is_main:
        write_config(save_dir, args, ctx, amp, amp_dtype)
    log(ctx, f"fastddp.train: {args.multi_gpu} world={ctx.world} device={ctx.device} "
             f"mode={args.model or args.mode} amp={'off' if not amp else str(amp_dtype).split('.')[-1]} "
             f"batch={args.batch_size}x{ctx.world}x{accum}={args.batch_size * ctx.world * accum} "
             f"lr={lr:g} steps/epoch={steps_per_epoch} cuda-graph={'on' if graph else 'off'}")
    writer = make_tensorboard(save_dir, args, ctx)
    monitor = GpuMonitor(ctx.device) if use_cuda else None

    def after_step(step: int) -> None:
        """Logging and mid-epoch checkpoints after optimizer step ``step`` (reads the running
        epoch's ``loss``, ``loss_sum``, ``correct`` and ``seen``)."""
        if step % args.log_interval == 0:
            elapsed = time.perf_counter() - t_epoch
            loss_value = float(loss.detach())  # one sync per log interval, not per step
            if hasattr(bar, "set_postfix"):
                bar.set_postfix(loss=f"{loss_value:.4f}",
                                acc=f"{float(correct) / max(1, seen):.3f}",
                                sps=f"{seen * ctx.world / max(elapsed, 1e-9):.0f}")
            if monitor is not None:
                monitor.sample()
            if writer is not None:
                writer.add_scalar("train/loss", loss_value, step)
        if args.save_interval and step % args.save_interval == 0:
            save_state(saver, save_dir / "last.pt", ctx, args, model, optimizer, scheduler,
                       scaler, loader, epoch, step, best_f1, history, epoch_done=False,
                       partial=(float(loss_sum), int(correct), seen))
            _inject_fault("STEP", step, ctx, saver)  # reliability tests: die mid-epoch

    step_fn = GraphedStep(model, loss_fn, optimizer, scaler, amp_ctx, args.clip_grad or None,
                          ctx.device) if graph else None
    t_start = time.perf_counter()
    samples_total = 0
    nan_streak = 0
    for epoch in range(start_epoch, args.epochs):
        loader.set_epoch(epoch)
        if not (epoch == start_epoch and resumed_mid_epoch):
            torch.manual_seed(args.seed + 1000 * ctx.rank + epoch)  # per-rank dropout stream
        model.train()
        t_epoch = time.perf_counter()
        resuming = epoch == start_epoch and resumed_mid_epoch
        loss_sum = torch.tensor(partial[0] if resuming else 0.0, dtype=torch.float64, device=ctx.device)
        correct = torch.tensor(partial[1] if resuming else 0, dtype=torch.int64, device=ctx.device)
        seen = partial[2] if resuming else 0
        bar = progress(loader, ctx, args, epoch)
        if step_fn is None:
            optimizer.zero_grad(set_to_none=True)
        micro = 0
        if step_fn is not None:
            step_fn.reset_sums(*(partial[:2] if resuming else (0.0, 0)))
            loss_sum, correct = step_fn.loss_sum, step_fn.correct  # the graph adds into these
        for x, y in bar:
            if step_fn is not None:  # the whole step, replayed as one CUDA graph
                step_fn(x, y)
                loss = step_fn.loss
                seen += y.numel()
                scheduler.step()
                global_step += 1
                after_step(global_step)
                continue
            last_micro = (micro + 1) % accum == 0
            sync_ctx = model.no_sync() if (args.multi_gpu == "ddp" and not last_micro) else contextlib.nullcontext()
            with sync_ctx:
                with amp_ctx():
                    out = model(x)
                    loss = loss_fn(out.float(), y)
                if not amp and not torch.isfinite(loss):
                    nan_streak += 1
                    warnings.warn(f"rank {ctx.rank}: non-finite loss at step {global_step}; "
                                  "skipping this step", stacklevel=1)
                    if nan_streak >= args.max_nan_steps:
                        raise FloatingPointError(
                            f"loss was non-finite for {nan_streak} steps in a row; lower --lr, "
                            "enable --clip-grad, or check the data")
                    optimizer.zero_grad(set_to_none=True)
                    micro = 0
                    continue
                scaler.scale(loss / accum if accum > 1 else loss).backward()
            loss_sum += loss.detach().double() * y.numel()
            correct += (out.detach().argmax(1) == y).sum()
            seen += y.numel()
            micro += 1
            if not last_micro:
                continue
            nan_streak = 0
            scaler.step(optimizer, max_grad_norm=args.clip_grad or None,
                        ddp=model if isinstance(model, fastddp.DDPWrapper) else None)
            scaler.update()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            global_step += 1
            after_step(global_step)
        epoch_time = time.perf_counter() - t_epoch
        stats = torch.stack([loss_sum, correct.double(), torch.tensor(float(seen), dtype=torch.float64, device=ctx.device)])
        if ctx.distributed:
            dist.all_reduce(stats)
        samples_total += int(stats[2])
        val = evaluate(model, val_loader, ctx, amp_ctx, loss_fn)
        row = {"epoch": epoch + 1, "train_loss": float(stats[0] / stats[2].clamp_min(1)),
               "train_acc": float(stats[1] / stats[2].clamp_min(1)), **val,
               "lr": float(scheduler.get_last_lr()[0]), "epoch_time_s": epoch_time,
               "samples_per_s": float(stats[2]) / epoch_time,
               "elapsed_s": time.perf_counter() - t_start}
        history.append(row)
        is_best = row["val_f1"] > best_f1
        best_f1 = max(best_f1, row["val_f1"])
        log(ctx, f"epoch {epoch + 1}/{args.epochs}: train loss {row['train_loss']:.4f} "
                 f"acc {row['train_acc']:.4f} | val loss {row['val_loss']:.4f} "
                 f"acc {row['val_acc']:.4f} F1 {row['val_f1']:.4f} | {epoch_time:.1f}s "
                 f"{row['samples_per_s']:.0f} samples/s")
        if writer is not None:
            for k in ("train_loss", "train_acc", "val_loss", "val_acc", "val_f1", "lr"):
                writer.add_scalar(k.replace("_", "/", 1), row[k], epoch + 1)
        # In this order (one writer thread keeps it): best.pt is never older than the best
        # epoch last.pt knows, metrics.csv never newer than last.pt.
        if ctx.is_main and is_best:
            saver.save({"model": unwrap(model).state_dict(), "mode": args.model or args.mode,
                        "signature": model_signature(model), "epoch": epoch,
                        "metrics": row}, save_dir / "best.pt")
        save_state(saver, save_dir / "last.pt", ctx, args, model, optimizer, scheduler, scaler,
                   loader, epoch, global_step, best_f1, history, epoch_done=True)
        if ctx.is_main:
            saver.write(metrics_csv(history), save_dir / "metrics.csv")
        _inject_fault("EPOCH", epoch + 1, ctx, saver)  # reliability tests: die after an epoch

    total = time.perf_counter() - t_start
    summary = {
        "best_val_f1": best_f1,
        "best_val_acc": max((r["val_acc"] for r in history), default=0.0),
        "final": history[-1] if history else {},
        "total_time_s": total,
        "samples_per_s": samples_total / total if total > 0 else 0.0,
        "effective_batch": args.batch_size * ctx.world * accum,
        "world_size": ctx.world,
        "save_dir": str(save_dir.resolve()),
    }
    if ctx.is_main:
        if history and not plot_curves(save_dir, history):
            log(ctx, "note: curves.png not drawn: matplotlib is not installed "
                     "(pip install matplotlib; metrics.csv holds the same numbers)")
        checkpoint.write_file(json.dumps(summary, indent=1).encode(), save_dir / "summary.json")
        gpu = monitor.summary() if monitor is not None else ""
        log(ctx, f"done: best val acc {summary['best_val_acc']:.4f} F1 {best_f1:.4f} | "
                 f"{total:.1f}s, {summary['samples_per_s']:.0f} samples/s, effective batch "
                 f"{summary['effective_batch']} | files in {summary['save_dir']}{gpu}")
    if writer is not None:
        writer.close()
    return summary


def _inject_fault(unit: str, count: int, ctx: Context, saver: checkpoint.CheckpointWriter) -> None:
    """Fault injection for the reliability tests, right after the checkpoint of step/epoch
    ``count`` (``unit`` is ``"STEP"`` or ``"EPOCH"``).

    ``FASTDDP_FAULT_KILL_AFTER_<unit>=count``: die like a SIGKILLed process once that checkpoint
    is on disk (every rank waits for rank 0's write, so a kill on another rank cannot overtake
    it); ``FASTDDP_FAULT_RANK`` (optional) names the only rank that dies.
    ``FASTDDP_FAULT_TERM_AFTER_<unit>=count``: send this process SIGTERM at once, with the
    checkpoint still being written (what torchrun or a scheduler does at an arbitrary time).
    """
    only = os.environ.get("FASTDDP_FAULT_RANK")
    this_rank = only is None or only == str(ctx.rank)
    if os.environ.get(f"FASTDDP_FAULT_TERM_AFTER_{unit}") == str(count) and this_rank:
        os.kill(os.getpid(), signal.SIGTERM)
    if os.environ.get(f"FASTDDP_FAULT_KILL_AFTER_{unit}") == str(count):
        saver.flush()
        if ctx.distributed:
            dist.barrier()
        if this_rank:
            os.kill(os.getpid(), signal.SIGKILL)


# ----------------------------------------------------------------------------- outputs
def save_state(saver: checkpoint.CheckpointWriter, path: Path, ctx: Context, args, model,
               optimizer, scheduler, scaler, loader, epoch: int, step: int, best_f1: float,
               history: list, epoch_done: bool, partial: tuple[float, int, int] = (0.0, 0, 0)) -> None:
    # Per-rank state (RNG streams, the running sums of an unfinished epoch) comes to rank 0.
    rng = {"cpu": torch.get_rng_state(),
           "cuda": torch.cuda.get_rng_state(ctx.device) if ctx.device.type == "cuda" else None,
           "partial": partial}
    rngs = [rng]
    if ctx.distributed:
        rngs = [None] * ctx.world
        dist.all_gather_object(rngs, rng)
    if not ctx.is_main:
        return
    saver.save({
        "model": unwrap(model).state_dict(), "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
        "loader": loader.state_dict(), "epoch": epoch, "step": step, "epoch_done": epoch_done,
        "best_f1": best_f1, "history": history, "rng": rngs, "world": ctx.world,
        "mode": args.model or args.mode, "signature": model_signature(model),
    }, path)


def write_config(save_dir: Path, args, ctx: Context, amp: bool, amp_dtype) -> None:
    cfg = {k: v for k, v in vars(args).items()}
    cfg.update(world_size=ctx.world, device=str(ctx.device), amp_resolved=amp,
               amp_dtype_resolved=str(amp_dtype), torch=torch.__version__,
               fastddp=fastddp.__version__, python=sys.version.split()[0])
    checkpoint.write_file(json.dumps(cfg, indent=1, default=str).encode(), save_dir / "config.json")


def metrics_csv(history: list[dict[str, Any]]) -> bytes:
    """``history`` (one dict per epoch) as the bytes of ``metrics.csv``."""
    out = io.StringIO(newline="")
    w = csv.DictWriter(out, fieldnames=list(history[0]))
    w.writeheader()
    w.writerows(history)
    return out.getvalue().encode()


def plot_curves(save_dir: Path, history: list[dict[str, Any]]) -> bool:
    """Draws loss, accuracy and macro-F1 per epoch into ``curves.png``; False when matplotlib
    is not installed (nothing is drawn then)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    epochs = [r["epoch"] for r in history]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    axes[0].plot(epochs, [r["train_loss"] for r in history], label="train")
    axes[0].plot(epochs, [r["val_loss"] for r in history], label="val")
    axes[0].set_title("loss")
    axes[1].plot(epochs, [r["train_acc"] for r in history], label="train")
    axes[1].plot(epochs, [r["val_acc"] for r in history], label="val")
    axes[1].set_title("accuracy")
    axes[2].plot(epochs, [r["val_f1"] for r in history], label="val macro-F1")
    axes[2].set_title("macro-F1")
    for ax in axes:
        ax.set_xlabel("epoch")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(save_dir / "curves.png", dpi=100)
    plt.close(fig)
    return True


def make_tensorboard(save_dir: Path, args, ctx: Context):
    if not (args.tensorboard and ctx.is_main):
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        log(ctx, "note: --tensorboard needs the tensorboard package (pip install tensorboard); "
                 "continuing without it")
        return None
    return SummaryWriter(str(save_dir / "tensorboard"))


def progress(loader, ctx: Context, args, epoch: int):
    if args.no_progress or not ctx.is_main:
        return loader
    try:
        from tqdm import tqdm
    except ImportError:
        return loader
    return tqdm(loader, desc=f"epoch {epoch + 1}/{args.epochs}", leave=False, dynamic_ncols=True)


class GpuMonitor:
    """Per-GPU utilisation and memory, through NVML when installed, else torch's counters."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.samples: list[tuple[float, float]] = []
        self._nvml = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
        except Exception:
            self._nvml = None

    def sample(self) -> None:
        if self._nvml is not None:
            util = self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu
            mem = self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used / 2**20
        else:
            util = float("nan")
            mem = torch.cuda.memory_allocated(self.device) / 2**20
        self.samples.append((float(util), float(mem)))

    def summary(self) -> str:
        peak = torch.cuda.max_memory_allocated(self.device) / 2**20
        if not self.samples:
            return f" | GPU peak allocated {peak:.0f} MiB"
        utils = [u for u, _ in self.samples if not math.isnan(u)]
        util = f"mean util {sum(utils) / len(utils):.0f}%, " if utils else ""
        return f" | GPU {util}peak allocated {peak:.0f} MiB"
