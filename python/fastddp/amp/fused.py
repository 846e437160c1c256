"""Stepping torch's fused optimizers (``_step_supports_amp_scaling``): they divide by
``grad_scale`` and skip the update on ``found_inf`` inside their kernel, so the gradients are
never rewritten and nothing is read back to the host."""

from __future__ import annotations

import contextlib
import inspect
import weakref
from typing import Any, Optional

import torch

_TAKES_GRAD_SCALER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # step function -> takes grad_scaler=
_ABSENT = object()  # no grad_scale set on the optimizer


def step_in_kernel(optimizer: torch.optim.Optimizer, grad_scale: Optional[torch.Tensor],
                   found_inf: torch.Tensor, args: tuple, kwargs: dict, restore: bool = False) -> Any:
    """Step a fused optimizer that divides the gradients by ``grad_scale`` and skips the
    update where ``found_inf`` is set, inside its kernel.

    As torch's scaler hands them over: ``grad_scale`` is a 0-dim tensor of its own, times a
    ``grad_scale`` the user set on the optimizer (that one alone when ``grad_scale`` is None:
    the gradients were unscaled already), and ``found_inf`` a 0-dim tensor of its own, so
    an optimizer that keeps or edits them changes neither the scale nor the inf check that
    ``update()`` reads. Both attributes are deleted after the step, and left in place when the
    step raises, as torch's scaler does (``restore``: a user's ``grad_scale`` is put back
    either way, for a step torch's scaler would not have touched)."""
    preset = getattr(optimizer, "grad_scale", _ABSENT)
    if grad_scale is not None:
        grad_scale = grad_scale.reshape(()) * (1 if preset is _ABSENT else preset)
    elif preset is not _ABSENT:
        grad_scale = preset
    optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
    optimizer.found_inf = found_inf.reshape(()).clone()  # type: ignore[attr-defined]
    try:
        retval = optimizer.step(*args, **kwargs)
    except BaseException:
        if restore:
            _put_back(optimizer, preset)
        # else both stay on the optimizer, as torch's scaler leaves them when the step raises
        # (a retried step() then multiplies the scale by the grad_scale left there, as torch's)
        raise
    _put_back(optimizer, preset if restore else _ABSENT)
    return retval


def _put_back(optimizer: torch.optim.Optimizer, preset: Any) -> None:
    """Delete the step's ``grad_scale`` and ``found_inf``; set ``grad_scale`` to ``preset``
    unless it is absent."""
    del optimizer.grad_scale  # type: ignore[attr-defined]
    del optimizer.found_inf  # type: ignore[attr-defined]
    if preset is not _ABSENT:
        optimizer.grad_scale = preset  # type: ignore[attr-defined]


def takes_keyword(optimizer: torch.optim.Optimizer, name: str) -> bool:
    """Whether ``optimizer.step`` accepts the keyword argument ``name`` (declared, or through
    ``**kwargs``); True where its signature cannot be read."""
    try:
        params = inspect.signature(optimizer.step).parameters
    except (TypeError, ValueError):
        return True
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def passes_itself(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` takes ``grad_scaler=`` (the older contract of
    ``_step_supports_amp_scaling``, under which torch's scaler passes itself)."""
    step = getattr(optimizer.step, "__func__", optimizer.step)
    try:
        return _TAKES_GRAD_SCALER[step]
    except (KeyError, TypeError):  # not seen yet; TypeError: not weakly referenceable
        known = "grad_scaler" in inspect.signature(optimizer.step).parameters
    with contextlib.suppress(TypeError):
        _TAKES_GRAD_SCALER[step] = known
    return known
