"""Classification metrics reduced over ranks through a confusion matrix."""

from __future__ import annotations

import torch


def confusion(pred: torch.Tensor, target: torch.Tensor, classes: int) -> torch.Tensor:
    """``classes × classes`` counts, rows = true class, columns = predicted class (int64)."""
    idx = target.to(torch.int64) * classes + pred.to(torch.int64)
    return torch.bincount(idx, minlength=classes * classes).reshape(classes, classes)


def macro_f1(cm: torch.Tensor) -> float:
    """Macro-averaged F1 over the classes that occur (true or predicted) in ``cm``."""
    cm = cm.to(torch.float64)
    tp = cm.diag()
    precision_den = cm.sum(0)
    recall_den = cm.sum(1)
    present = (precision_den + recall_den) > 0
    f1 = 2 * tp / (precision_den + recall_den).clamp_min(1e-12)
    return float(f1[present].mean()) if bool(present.any()) else 0.0


def accuracy(cm: torch.Tensor) -> float:
    total = int(cm.sum())
    return float(cm.diag().sum()) / total if total else 0.0
