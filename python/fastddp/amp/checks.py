"""What GradScaler accepts: its numeric settings (with the types torch's update kernel takes)
and the gradients its kernels work on in place."""

from __future__ import annotations

import numbers
import operator
from typing import Any, Optional

import torch

# torch's scaler refuses to unscale float16 gradients (small unscaled ones flush to zero in
# float16); so does this one, with torch's message first.
FP16_GRADS = ("Attempting to unscale FP16 gradients. The parameters are float16: keep them in float32 "
              "and let torch.autocast(dtype=torch.float16) run the forward in float16 (as "
              "torch.amp.GradScaler requires too)")


class TorchPathGradients(TypeError):
    """An optimizer holds gradients the fused kernels do not work on in place (sparse ones, or
    strided ones with gaps or overlaps): unscale_/step then run torch's own code, which takes
    them (or raises what torch raises)."""


def check_growth_interval(value: Any) -> int:
    """``value`` as the int torch's update kernel takes (int, numpy integer, 0-dim integer
    tensor); TypeError for what that kernel refuses (bool, float, str, ...)."""
    # torch's update kernel takes an integer and grows the scale when the count of clean steps
    # equals it: an interval <= 0 is accepted and never reached. A non-integer fails only in
    # torch's first update(); it is refused here when given, and again by update().
    if not isinstance(value, bool) and (not isinstance(value, torch.Tensor) or value.dim() == 0):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise TypeError(f"GradScaler: growth_interval must be an integer, got {value!r}")


def check_factor(name: str, value: Any) -> float:
    """``value`` as the float torch's update kernel takes (a real number or a 0-dim tensor);
    TypeError, naming ``name``, for what that kernel refuses."""
    if isinstance(value, numbers.Real) or (isinstance(value, torch.Tensor) and value.dim() == 0
                                           and not value.is_complex()):
        return float(value)
    raise TypeError(f"GradScaler.update: {name} must be a float, got {value!r} "
                    f"(set it with set_{name}(float) or a state_dict holding a float)")


def is_dense(t: torch.Tensor) -> bool:
    """True when ``t``'s elements fill one gap-free span of memory in some dimension order
    (row-major, channels_last, transposed, ...): what the C++ kernels take in place."""
    if t.is_contiguous() or t.numel() == 0:
        return True
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


# fastddp's own keywords of GradScaler.fused_step; GradScaler.step passes every keyword to the
# optimizer, as torch's does
FUSED_STEP_KEYWORDS = ("max_grad_norm", "grads", "ddp")


def collect_grads(optimizer: torch.optim.Optimizer, grads: Optional[list[torch.Tensor]],
                  unscaling: bool = True) -> list[torch.Tensor]:
    """The gradients to handle (``grads``, or the optimizer's ``.grad``s), checked in one pass:
    dense, on one device, and (``unscaling``) not float16. Sparse or non-dense ones raise
    TorchPathGradients."""
    if grads is None:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"]
                 if p.grad is not None]
    out = []
    for g in grads:
        if g.is_sparse:
            raise TorchPathGradients("fastddp.GradScaler: sparse gradients (e.g. nn.Embedding("
                                  "sparse=True)) are handled by torch's scaler code, which takes "
                                  "neither fused_step's max_grad_norm nor grads=; clip them with "
                                  "torch.nn.utils.clip_grad_norm_ after unscale_()")
        if not is_dense(g):
            # Any dense layout (row-major, channels_last, transposed) is one span of memory
            # and handled in place; autograd never makes a gradient with gaps or overlaps, but a
            # script can assign one (a view of a larger buffer).
            raise TorchPathGradients(f"fastddp.GradScaler: a gradient of shape {tuple(g.shape)} has strides "
                                     f"{g.stride()}, which leave gaps or overlap: torch's scaler code handles it "
                                     "in step() and unscale_(), which take neither fused_step's max_grad_norm "
                                     "nor grads=; set a dense gradient (p.grad = g.contiguous()) for those")
        if unscaling and g.dtype == torch.float16:
            raise ValueError(FP16_GRADS)
        out.append(g)
    devices = {g.device for g in out}
    if len(devices) > 1:
        raise ValueError("fastddp.GradScaler: this optimizer's gradients are on several devices "
                         f"({', '.join(sorted(map(str, devices)))}); it handles one device per "
                         "optimizer. Use one optimizer per device, or torch.amp.GradScaler")
    return out
