"""Setting a run up: the process group, the data, the seeds, the learning-rate schedule."""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import random
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

import fastddp

from .._net import free_port
from .errors import UsageError
from .models import load_factory

if TYPE_CHECKING:
    from .state import TrainState

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
        for split, data in (("train", train), ("test", test)):
            check_dataset(data, split, args)
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


def data_identity(args: argparse.Namespace, train: Any, test: Any) -> str:
    """What a checkpoint records of the data it was trained on, so that a resume on other data
    is refused: a hash of the samples when both sets are TensorDatasets (the embedded data and
    UCI HAR have the same sizes, and the same data may move to another --data-dir), else the
    --dataset and --data-dir flags that made them."""
    tensors = [t for data in (train, test) for t in getattr(data, "tensors", [None])]
    if any(not isinstance(t, torch.Tensor) for t in tensors):
        return f"--dataset {args.dataset or 'unset'}, --data-dir {args.data_dir or 'unset'}"
    digest = hashlib.blake2b(digest_size=8)
    for t in tensors:
        t = t.detach().cpu().contiguous()
        digest.update(f"{t.dtype}{tuple(t.shape)}".encode())
        digest.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return f"samples {digest.hexdigest()}"


def check_model_outputs(module: nn.Module, data: Any, args: argparse.Namespace, device: torch.device) -> None:
    """``--model``'s output for the first training sample must be (batch, 6) class scores, as
    the loss and the metrics take them: anything else would fail inside the first training step
    with the loss's traceback. One forward in eval mode without gradients, the random state
    kept as it was (the check draws nothing a run would see); a model that cannot run that
    forward alone (one sample, no autocast) is left to the first training step."""
    training = module.training
    module.eval()
    try:
        x = torch.as_tensor(data[0][0]).unsqueeze(0).to(device)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
            out = module(x)
    except Exception:  # a model this probe cannot run alone: left to the training step to report
        return
    finally:
        module.train(training)
    if isinstance(out, torch.Tensor) and out.dim() == 2 and out.shape[1] == CLASSES:
        return
    got = (f"of shape {'x'.join(map(str, out.shape)) or 'scalar'}" if isinstance(out, torch.Tensor)
           else f"a {type(out).__name__}")
    raise UsageError(f"--model {args.model}: its output for one sample is {got}, but the loss and the metrics "
                     f"take (batch, {CLASSES}) class scores, one per HAR activity; give the model {CLASSES} outputs")


def check_dataset(data: Any, split: str, args: argparse.Namespace) -> None:
    """A ``--dataset`` split must hold (x, y) samples with labels 0..5 (the metrics count six
    classes) and, for the built-in ``--mode`` models, 9x128 windows: anything else would fail
    inside a training step with the model's or the loss's traceback. A TensorDataset's labels
    are checked in full, any other data set's first sample."""
    where = f"--dataset {args.dataset}: the {split} set"
    try:
        size = len(data)
    except TypeError:
        raise UsageError(f"{where} has no len() (a {type(data).__name__}, e.g. an IterableDataset): "
                         "fastddp.train splits a data set between the ranks by index (DistributedSampler); "
                         "give a map-style Dataset with __len__ and __getitem__, such as a TensorDataset") from None
    if size == 0:
        raise UsageError(f"{where} is empty")
    tensors = getattr(data, "tensors", None)
    sample = data[0]
    if not (isinstance(sample, (tuple, list)) and len(sample) == 2):
        raise UsageError(f"{where} must give (x, y) samples, its first is a "
                         f"{type(sample).__name__}")
    x, y = sample
    labels = tensors[1] if tensors is not None and len(tensors) == 2 else torch.as_tensor(y)
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise UsageError(f"{where} has {labels.dtype} labels; give integer class indices 0..5")
    if labels.numel() and not (0 <= int(labels.min()) and int(labels.max()) < CLASSES):
        bad = int(labels.max()) if int(labels.max()) >= CLASSES else int(labels.min())
        raise UsageError(f"{where} has label {bad}; the labels must be 0..{CLASSES - 1} (the six "
                         "HAR activities)")
    shape = tuple(torch.as_tensor(x).shape)
    if not args.model and shape != (9, 128):
        raise UsageError(f"{where} has samples of shape {'x'.join(map(str, shape)) or 'scalar'}, "
                         f"but --mode {args.mode} takes 9x128 windows; reshape the data or give "
                         "your own --model")


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


def schedule_change(args: argparse.Namespace, saved_epochs: Optional[int], steps_per_epoch: int,
                    lr: float, state: TrainState) -> Optional[str]:
    """What resuming ``state``, a run of ``saved_epochs``, with another ``--epochs`` does to its
    learning rate (the cosine of :func:`lr_lambda` is recomputed over the new total), or None."""
    if saved_epochs is None or saved_epochs == args.epochs:
        return None  # the same run, or a checkpoint that did not record it
    spe, step = steps_per_epoch, state.step
    warmup = int(args.warmup_epochs * spe)
    old, new = (lr * lr_lambda(spe * e, warmup)(step) for e in (saved_epochs, args.epochs))
    change = (f"the learning-rate schedule (a cosine to 0) now ends at step {spe * args.epochs} "
              f"instead of {spe * saved_epochs} (in this run's {spe} steps an epoch); at step {step} the "
              f"rate is {new:.3g} (the checkpoint's run: {old:.3g})")
    if state.start_epoch >= saved_epochs:  # a finished run trained further
        return f"--epochs {args.epochs} continues a finished run of --epochs {saved_epochs}: {change}"
    return (f"--epochs {args.epochs}, where the checkpoint's run had --epochs {saved_epochs}: {change}. "
            f"Rerun with --epochs {saved_epochs} to keep the run's schedule")
