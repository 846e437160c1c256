"""A training run's pieces (:class:`Run`) and how they are built: model, data, optimizer,
schedule, scaler and step, in the order that fixes the initial weights."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.data import TensorDataset

import fastddp

from . import checkpoint
from .errors import UsageError
from .graph import GraphedStep, hold_lr
from .models import build_model
from .outputs import (
    GpuMonitor,
    TensorBoard,
)
from .settings import resume_flags
from .setup import (
    Context,
    check_model_outputs,
    class_weights,
    data_identity,
    load_data,
    lr_lambda,
    resolve_cuda_graph,
    seed_everything,
)
from .state import TrainState, unwrap
from .step import EpochSums, TrainStep


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
    if args.model:
        check_model_outputs(unwrap(model), train_set, args, ctx.device)
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
