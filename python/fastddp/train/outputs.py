"""The files and displays of a run besides its checkpoints: config.json, metrics.csv,
curves.png, TensorBoard events, the progress bar and the GPU monitor."""

from __future__ import annotations

import csv
import io
import json
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch

import fastddp

from . import checkpoint
from .setup import Context, log

if TYPE_CHECKING:
    from .build import Run


def log_header(r: Run) -> None:
    """The run's first line: what trains, where, in what batches and steps."""
    args, ctx = r.args, r.ctx
    accum = args.grad_accum_steps
    amp = "off" if not r.amp else str(r.amp_dtype).split(".")[-1]
    log(ctx, f"fastddp.train: {args.multi_gpu} world={ctx.world} device={ctx.device} "
             f"mode={args.model or args.mode} amp={amp} "
             f"batch={args.batch_size}x{ctx.world}x{accum}={args.batch_size * ctx.world * accum} "
             f"lr={r.lr:g} steps/epoch={r.steps_per_epoch} "
             f"cuda-graph={'on' if r.graphed is not None else 'off'}")
    micro = len(r.state.loader)
    if micro % accum:
        log(ctx, f"note: --grad-accum-steps {accum} over {micro} batches an epoch: the last {micro % accum} "
                 "of each epoch are trained but not stepped (the next epoch starts with fresh gradients); "
                 "choose --grad-accum-steps dividing the batches an epoch to use them")
    if args.save_interval > r.steps_per_epoch:
        log(ctx, f"note: --save-interval {args.save_interval} is more than the {r.steps_per_epoch} "
                 "steps of an epoch: no checkpoint inside an epoch, one at each epoch's end")


def write_config(save_dir: Path, args, ctx: Context, amp: bool, amp_dtype) -> None:
    cfg = {k: v for k, v in vars(args).items() if k != "config_keys"}
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


def keep_aside(path: Path) -> Optional[Path]:
    """Rename ``path`` to ``<name>.<time>.bak`` (``<name>.<time>.<n>.bak`` when that exists),
    so that a file the run would overwrite or leave looking current is kept; returns the new
    path, or None when there is no ``path`` (a file, or a directory such as ``tensorboard/``)."""
    if not (path.is_file() or path.is_dir()):
        return None
    stamp = time.strftime('%Y%m%d-%H%M%S')
    kept, n = path.with_name(f"{path.name}.{stamp}.bak"), 1
    while kept.exists():
        kept = path.with_name(f"{path.name}.{stamp}.{n}.bak")
        n += 1
    path.rename(kept)
    return kept


def keep_foreign_metrics(save_dir: Path, history: list[dict[str, Any]]) -> Optional[Path]:
    """Move ``save_dir/metrics.csv`` aside when it is not what the run's ``history`` wrote:
    neither that history nor an earlier state of it (a run killed between last.pt and
    metrics.csv leaves fewer rows, a byte prefix). Such a file was edited by hand, or was
    written after a checkpoint that is gone; the run rewrites metrics.csv from its checkpoint,
    so the file goes to ``metrics.csv.<time>.bak`` instead of being overwritten. Returns the
    new path, or None when nothing was moved."""
    path = save_dir / "metrics.csv"
    if not history or not path.is_file():
        return None
    if metrics_csv(history).startswith(path.read_bytes()):
        return None
    return keep_aside(path)


# The files a run writes once, after its last epoch: present before it trains, they belong to
# an earlier run (or to this run with fewer --epochs).
FINAL_FILES = ("summary.json", "curves.png")
# What a run that starts from its first epoch (--resume none) over an earlier run with a
# history would overwrite besides those: that run's history, best weights and flags.
EARLIER_RUN_FILES = ("metrics.csv", "best.pt", "best.pt.prev", "config.json", "tensorboard")
# ... and its checkpoints (checkpoint.candidates of last.pt)
CHECKPOINT_FILES = ("last.pt.tmp", "last.pt", "last.pt.prev.tmp", "last.pt.prev")


def earlier_run_files(save_dir: Path) -> tuple[str, ...]:
    """The names to keep aside before a run that starts from its first epoch trains into
    ``save_dir``: an earlier run's history, best weights, flags and checkpoints when any of
    them is there, else none."""
    names = EARLIER_RUN_FILES + CHECKPOINT_FILES
    return names if any((save_dir / n).is_file() for n in names) else ()


def keep_earlier_files(save_dir: Path, names: tuple[str, ...]) -> dict[str, Path]:
    """Move the files ``names`` of ``save_dir`` aside (:func:`keep_aside`) before a run trains
    into it: until it writes its own, they would pass for its results, or be overwritten.
    Returns where each file that was there went."""
    kept = {name: keep_aside(save_dir / name) for name in names}
    return {name: path for name, path in kept.items() if path is not None}


def summary_is_current(save_dir: Path, history: list[dict[str, Any]]) -> bool:
    """Whether ``save_dir/summary.json`` summarises ``history``: its final epoch's row is
    ``history``'s last one (a summary of another run, or of fewer epochs, is not)."""
    try:
        summary = json.loads((save_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(history) and isinstance(summary, dict) and summary.get("final") == history[-1]


def plot_curves(history: list[dict[str, Any]]) -> Optional[bytes]:
    """Loss, accuracy and macro-F1 per epoch, drawn as the PNG bytes of ``curves.png`` (written
    like the run's other files: atomically, a failure named in one line); None when matplotlib
    is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
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
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    plt.close(fig)
    return png.getvalue()


TENSORBOARD_DIRS = ("tensorboard", "tensorboard/epoch")  # the per-step and the per-epoch events


class TensorBoard:
    """The run's TensorBoard events (main rank, --tensorboard): per-step figures in
    ``tensorboard/`` and each epoch's figures in ``tensorboard/epoch/`` (TensorBoard shows the
    two as runs of one log directory), both at the step the figure belongs to.

    A resumed run hides what an attempt killed after the checkpoint it loads wrote (TensorBoard
    purges a directory's events from a step on), so no figure shows twice: per-step events from
    the checkpoint's step + 1 on (that step's own were logged before the checkpoint); epoch
    events from the checkpoint's step on when it was taken inside an epoch, as a checkpoint at
    an epoch's last step precedes that epoch's figures. Each directory has its own purge, which
    is why the epoch figures live in a directory of their own."""

    def __init__(self, save_dir: Path, step: int, resumed: bool, epoch_done: bool) -> None:
        from torch.utils.tensorboard import SummaryWriter

        step_purge = epoch_purge = 0  # a fresh run: nothing of this run's before it
        if resumed:
            step_purge = step + 1
            epoch_purge = step + 1 if epoch_done else step
        self._steps = SummaryWriter(str(save_dir / TENSORBOARD_DIRS[0]), purge_step=step_purge)
        self._epochs = SummaryWriter(str(save_dir / TENSORBOARD_DIRS[1]), purge_step=epoch_purge)

    def step_scalar(self, tag: str, value: float, step: int) -> None:
        self._steps.add_scalar(tag, value, step)

    def epoch_scalars(self, figures: dict[str, float], step: int) -> None:
        """The figures of the epoch that ended at ``step``, each as ``epoch/<name>``."""
        for name, value in figures.items():
            self._epochs.add_scalar(f"epoch/{name}", value, step)

    def close(self) -> None:
        self._steps.close()
        self._epochs.close()


def make_tensorboard(save_dir: Path, args, ctx: Context, step: int, resumed: bool,
                     epoch_done: bool) -> Optional[TensorBoard]:
    """The run's :class:`TensorBoard` (main rank, --tensorboard), None otherwise. ``step`` and
    ``epoch_done`` are those of the checkpoint a ``resumed`` run loaded."""
    if not (args.tensorboard and ctx.is_main):
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401  (needs tensorboard)
    except ImportError:
        log(ctx, "note: --tensorboard needs the tensorboard package (pip install tensorboard); "
                 "continuing without it")
        return None
    return TensorBoard(save_dir, step, resumed, epoch_done)


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
