"""The settings a checkpoint records, and why a run with other settings cannot resume it."""

from __future__ import annotations

import argparse
from typing import Any

# The flags that decide what a run computes. A checkpoint records them (with the values the
# launcher resolved from them: "amp", "amp_dtype", the learning rate after --scale-lr, the
# number of training samples), and a run that resumes it must have the same: the optimizer
# state would keep the old learning rate and weight decay, and another batch size,
# accumulation or seed would move the sampler's position, so the run would neither continue
# the old one nor be what its own flags say. --epochs may differ ("train further").
RESUME_FLAGS = ("lr", "scale_lr", "weight_decay", "warmup_epochs", "batch_size",
                "grad_accum_steps", "seed", "clip_grad", "amp", "amp_dtype", "class_weights",
                "comm_dtype", "sync_batchnorm")
DERIVED_LABELS = {"lr_scaled": "learning rate after --scale-lr and the world size",
                  "train_samples": "training samples (--dataset, --data-dir)",
                  "data": "training and validation data (--dataset, --data-dir):"}

# Settings that follow from others: named only when those others agree.
FOLLOWS = {"lr_scaled": ("lr", "scale_lr"), "amp_dtype": ("amp",), "data": ("train_samples",)}


def resume_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The values of :data:`RESUME_FLAGS` in ``args``, as a checkpoint records them."""
    return {name: getattr(args, name) for name in RESUME_FLAGS}


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return "unset" if value is None else str(value)


def resume_conflict(saved: dict[str, Any], current: dict[str, Any], source: str) -> str | None:
    """Why a checkpoint that recorded the settings ``saved`` cannot be continued by a run with
    ``current`` (naming each flag and both values, and the fix), or None."""
    differ = [k for k in current if k in saved and saved[k] != current[k]
              and not (k in DERIVED_LABELS and None in (saved[k], current[k]))]
    differ = [k for k in differ if not set(FOLLOWS.get(k, ())) & set(differ)]
    if not differ:
        return None
    named = [f"{DERIVED_LABELS.get(k) or '--' + k.replace('_', '-')} {_show(saved[k])} "
             f"(this run: {_show(current[k])})" for k in differ]
    return (f"{source} was written by a run with other settings: {', '.join(named)}. Resuming "
            "it would continue neither that run nor this one; give the checkpoint's values to "
            "continue it, or start a new run with --resume none (which keeps the earlier run's files "
            "in --save-dir as .bak) or another --save-dir")
