"""One epoch of a run: its steps, its evaluation, its checkpoints (:func:`run_epoch`,
:func:`end_epoch`)."""

from __future__ import annotations

import math
import os
import signal
import time
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

from .metrics import accuracy, confusion, macro_f1
from .outputs import metrics_csv, progress
from .setup import CLASSES, Context, log
from .state import model_signature, rank_state, unwrap
from .step import Partial

if TYPE_CHECKING:
    from .build import Run


def run_epoch(r: Run, epoch: int, partial: Optional[Partial]) -> float:
    """Train epoch ``epoch`` (continuing it from ``partial`` sums when resumed in its middle);
    returns its training time (:meth:`EpochSums.elapsed`: a resumed epoch's part before the
    checkpoint included). The eager loop and the CUDA graph replay the same
    :class:`~fastddp.train.step.TrainStep`."""
    args, ctx, state = r.args, r.ctx, r.state
    state.loader.set_epoch(epoch)
    if partial is None:
        torch.manual_seed(args.seed + 1000 * ctx.rank + epoch)  # per-rank dropout stream
    r.model.train()
    state.epoch, state.epoch_done = epoch, False
    r.sums.reset(partial or (0.0, 0, 0, 0.0))
    bar = progress(state.loader, ctx, args, epoch)
    accum, micro = args.grad_accum_steps, 0
    if r.graphed is None:
        state.optimizer.zero_grad(set_to_none=True)
    for x, y in bar:
        if r.graphed is not None:  # the whole step, replayed as one CUDA graph
            r.graphed(x, y)
            loss = r.graphed.loss
        else:
            last = (micro + 1) % accum == 0
            loss = r.step(x, y, r.sums, accum, last, state.step)
            if loss is None:  # a non-finite loss: the accumulation starts over
                micro = 0
                continue
            micro += 1
            if not last:
                continue
            state.optimizer.zero_grad(set_to_none=True)
        state.scheduler.step()
        state.step += 1
        after_step(r, loss, bar)
    return r.sums.elapsed()


def after_step(r: Run, loss: torch.Tensor, bar: Any) -> None:
    """Logging and the mid-epoch checkpoint after an optimizer step."""
    args, ctx, step = r.args, r.ctx, r.state.step
    r.saver.check()  # a checkpoint write that failed since the last step
    if step % args.log_interval == 0:
        elapsed = r.sums.elapsed()
        loss_value = float(loss.detach())  # one sync per log interval, not per step
        acc = float(r.sums.correct) / max(1, r.sums.seen)
        sps = r.sums.seen * ctx.world / max(elapsed, 1e-9)
        if hasattr(bar, "set_postfix"):
            bar.set_postfix(loss=f"{loss_value:.4f}", acc=f"{acc:.3f}", sps=f"{sps:.0f}")
        else:  # no bar (--no-progress, or no tqdm): a line, so that a long epoch shows progress
            log(ctx, f"epoch {r.state.epoch + 1} step {step}: loss {loss_value:.4f} acc {acc:.3f} "
                     f"samples/s {sps:.0f}")
        if r.monitor is not None:
            r.monitor.sample()
        if r.board is not None:
            r.board.step_scalar("train/loss", loss_value, step)
    if args.save_interval and step % args.save_interval == 0:
        save_checkpoint(r, r.sums.partial())
        inject_fault("STEP", step, ctx, r.saver)  # reliability tests: die mid-epoch


def end_epoch(r: Run, epoch: int, epoch_time: float, t_start: float) -> None:
    """Reduce the epoch's sums, evaluate, log, and write best.pt, last.pt and metrics.csv.
    ``t_start`` is the run's start on the ``perf_counter`` clock (earlier processes' training
    time of a resumed run included: ``elapsed_s``)."""
    args, ctx, state = r.args, r.ctx, r.state
    stats = torch.stack([r.sums.loss_sum, r.sums.correct.double(),
                         torch.tensor(float(r.sums.seen), dtype=torch.float64, device=ctx.device)])
    if ctx.distributed:
        dist.all_reduce(stats)
    val = evaluate(r)
    row = {"epoch": epoch + 1, "train_loss": float(stats[0] / stats[2].clamp_min(1)),
           "train_acc": float(stats[1] / stats[2].clamp_min(1)), **val,
           "lr": float(state.scheduler.get_last_lr()[0]), "epoch_time_s": epoch_time,
           "samples_per_s": float(stats[2]) / epoch_time,
           "elapsed_s": time.perf_counter() - t_start}
    state.history.append(row)
    is_best = row["val_f1"] > state.best_f1
    state.best_f1 = max(state.best_f1, row["val_f1"])
    log(ctx, f"epoch {epoch + 1}/{args.epochs}: train loss {row['train_loss']:.4f} "
             f"acc {row['train_acc']:.4f} | val loss {row['val_loss']:.4f} "
             f"acc {row['val_acc']:.4f} F1 {row['val_f1']:.4f} | {epoch_time:.1f}s "
             f"{row['samples_per_s']:.0f} samples/s")
    check_finite_outcome(r, row)
    if r.board is not None:  # at the step the epoch ended, on the per-step figures' axis
        r.board.epoch_scalars({k: row[k] for k in ("train_loss", "train_acc", "val_loss", "val_acc",
                                                   "val_f1", "lr")}, state.step)
    # In this order (one writer thread keeps it): best.pt is never older than the best
    # epoch last.pt knows, metrics.csv never newer than last.pt.
    if ctx.is_main and is_best:
        r.saver.save({"model": unwrap(r.model).state_dict(), "mode": state.mode,
                      "signature": model_signature(r.model), "epoch": epoch,
                      "metrics": row}, r.save_dir / "best.pt")
    state.epoch_done = True
    save_checkpoint(r, (0.0, 0, 0, 0.0))
    if ctx.is_main:
        r.saver.write(metrics_csv(state.history), r.save_dir / "metrics.csv")
    inject_fault("EPOCH", epoch + 1, ctx, r.saver)  # reliability tests: die after an epoch


def check_finite_outcome(r: Run, row: dict[str, Any]) -> None:
    """After an epoch: weights that are no longer finite stop the run before they are saved
    (last.pt keeps the epoch before); a validation loss that is not finite with finite weights
    (non-finite values in the validation data) is named."""
    epoch = row["epoch"]
    bad = [name for name, p in unwrap(r.model).named_parameters() if not bool(torch.isfinite(p).all())]
    if bad:
        raise FloatingPointError(
            f"the model's weights are not finite after epoch {epoch} ({', '.join(bad[:3])}"
            f"{', ...' if len(bad) > 3 else ''}): training diverged; lower --lr or --weight-decay, or clip "
            f"with --clip-grad. The checkpoints hold the epoch before (resume from them with the change)")
    if not math.isfinite(row["val_loss"]):
        log(r.ctx, f"warning: the validation loss of epoch {epoch} is {row['val_loss']} with finite weights: "
                   "the validation data hold non-finite values (NaN or inf), whose predictions mean nothing; "
                   "check the data")


def evaluate(r: Run) -> dict[str, float]:
    """Loss, accuracy and macro-F1 over the test set (each sample on exactly one rank)."""
    ctx, model = r.ctx, r.model
    model.eval()
    cm = torch.zeros(CLASSES, CLASSES, dtype=torch.int64, device=ctx.device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=ctx.device)
    with torch.no_grad():
        for x, y in r.val_loader:
            with r.step.amp_ctx():
                out = model(x)
            loss_sum += r.loss_fn(out.float(), y).double() * y.numel()
            cm += confusion(out.argmax(1), y, CLASSES)
    if ctx.distributed:
        dist.all_reduce(cm)
        dist.all_reduce(loss_sum)
    n = int(cm.sum())
    model.train()
    return {"val_loss": float(loss_sum) / max(1, n), "val_acc": accuracy(cm.cpu()),
            "val_f1": macro_f1(cm.cpu()), "val_n": n}


def save_checkpoint(r: Run, partial: Partial) -> None:
    """Write ``r.state`` to last.pt (rank 0, in the background). Each rank's part — its RNG
    streams and ``partial``, an unfinished epoch's sums — comes to rank 0 first."""
    ctx = r.ctx
    ranks = [rank_state(ctx.device, partial)]
    if ctx.distributed:
        ranks = [None] * ctx.world
        dist.all_gather_object(ranks, rank_state(ctx.device, partial))
    if ctx.is_main:
        r.state.ranks = ranks
        r.saver.save(r.state.state_dict(), r.save_dir / "last.pt")


def inject_fault(unit: str, count: int, ctx: Context, saver: Any) -> None:
    """Fault injection for the reliability tests, right after the checkpoint of step/epoch
    ``count`` (``unit`` is ``"STEP"`` or ``"EPOCH"``).

    ``FASTDDP_FAULT_KILL_AFTER_<unit>=count``: die like a SIGKILLed process once that checkpoint
    is on disk (every rank waits for rank 0's write, so a kill on another rank cannot overtake
    it); ``FASTDDP_FAULT_RANK`` (optional) names the only rank that dies.
    ``FASTDDP_FAULT_TERM_AFTER_<unit>=count``: send this process SIGTERM at once, with the
    checkpoint still being written (what torchrun or a scheduler does at an arbitrary time);
    ``FASTDDP_FAULT_INT_AFTER_<unit>=count``: the same with SIGINT (Ctrl-C).
    """
    only = os.environ.get("FASTDDP_FAULT_RANK")
    this_rank = only is None or only == str(ctx.rank)
    for name in ("TERM", "INT"):
        if os.environ.get(f"FASTDDP_FAULT_{name}_AFTER_{unit}") == str(count) and this_rank:
            os.kill(os.getpid(), getattr(signal, f"SIG{name}"))
    if os.environ.get(f"FASTDDP_FAULT_KILL_AFTER_{unit}") == str(count):
        saver.flush()
        if ctx.distributed:
            dist.barrier()
        if this_rank:
            os.kill(os.getpid(), signal.SIGKILL)
