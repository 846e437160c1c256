"""A run's summary: training time and samples over its epochs, and the summary.json, curves
and last log line written at its end."""

from __future__ import annotations

import json
from typing import Any, Optional

from .build import Run
from .outputs import (
    plot_curves,
)
from .setup import (
    log,
)
from .step import Partial


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
