"""``fastddp.GradScaler``: AMP loss scaling with unscale, inf/NaN check, grad-norm clipping and
the scale update fused in C++/CUDA, with no host sync on the fused-optimizer path."""

from __future__ import annotations

import contextlib
import inspect
import numbers
import operator
import weakref
from collections import defaultdict
from typing import Any, Optional

import torch
from torch.amp.grad_scaler import OptState, _refresh_per_optimizer_state

from ._ext import C

CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s epsilon
# torch's scaler refuses to unscale float16 gradients (small unscaled ones flush to zero in
# float16); so does this one, with torch's message first.
FP16_GRADS = ("Attempting to unscale FP16 gradients. The parameters are float16: keep them in float32 "
              "and let torch.autocast(dtype=torch.float16) run the forward in float16 (as "
              "torch.amp.GradScaler requires too)")


def _is_dense(t: torch.Tensor) -> bool:
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


def _check_growth_interval(value: Any) -> int:
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


def _check_factor(name: str, value: Any) -> float:
    """``value`` as the float torch's update kernel takes (a real number or a 0-dim tensor);
    TypeError, naming ``name``, for what that kernel refuses."""
    if isinstance(value, numbers.Real) or (isinstance(value, torch.Tensor) and value.dim() == 0
                                           and not value.is_complex()):
        return float(value)
    raise TypeError(f"GradScaler.update: {name} must be a float, got {value!r} "
                    f"(set it with set_{name}(float) or a state_dict holding a float)")


class _SparseGradients(TypeError):
    """An optimizer holds sparse gradients: unscale_/step then run torch's own code."""


_TAKES_GRAD_SCALER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # step function -> takes grad_scaler=
# One statistics visitor per DDPWrapper, shared by every scaler that steps it (the reduction
# computes the statistics once; the first consumer of a backward takes them).
_BUCKET_STATS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _bucket_stats(ddp: Any) -> Any:
    """The statistics visitor on ``ddp``'s reduction, registered on first use: it sums the
    squares of each reduced bucket while the later buckets are still on the wire."""
    visitor = _BUCKET_STATS.get(ddp)
    if visitor is None:
        devices = {b.device for b in ddp.bucket_buffers()}
        if len(devices) > 1:
            raise ValueError("GradScaler.step(ddp=...): the wrapper's gradient buckets are on several devices "
                             f"({', '.join(sorted(map(str, devices)))}); pass grads=... instead")
        visitor = C.amp_bucket_stats()
        ddp.register_bucket_visitor(visitor)
        _BUCKET_STATS[ddp] = visitor
    return visitor


def _take_reduced_stats(ddp: Any) -> Optional[torch.Tensor]:
    """The float64[1] sum of squares of ``ddp``'s last reduced backward, once; None when no
    fresh one exists (nothing reduced since, or the gradients changed after it)."""
    visitor = _BUCKET_STATS.get(ddp)
    return None if visitor is None else C.amp_take_bucket_stats(visitor)


class GradScaler(torch.amp.GradScaler):
    """Drop-in for :class:`torch.amp.GradScaler` (same constructor, calls and ``state_dict``).

    The work on gradients runs in fastddp's kernels: one read pass over all gradients computes
    the inf/NaN flag and the sum of squares; a one-thread kernel turns that into ``found_inf``,
    the global norm and one coefficient ``inv_scale * min(1, max_norm / (norm + 1e-6))``; one
    multiply pass applies it — or none at all with torch's fused optimizers
    (``AdamW(fused=True)`` etc.), which receive the coefficient as ``grad_scale`` together with
    ``found_inf`` and skip the update on the device.

    Beyond torch's API, :meth:`step` takes ``max_grad_norm`` (unscale + check + clip + step in
    one call, returning the unscaled global norm as a device tensor, like
    ``clip_grad_norm_``) and ``grads`` (operate on these tensors instead of the optimizer's
    ``.grad``s, e.g. :meth:`fastddp.DDPWrapper.bucket_buffers`, so a few flat buffers replace
    hundreds of small tensors).

    An optimizer holding sparse gradients (``nn.Embedding(sparse=True)``) is unscaled and
    stepped by torch's own code, as with ``torch.amp.GradScaler``.

    Host syncs: none with a fused optimizer. With any other optimizer, deciding whether to skip
    the step reads ``found_inf`` once per step (as torch's scaler does).
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        super().__init__(device, init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval,
                         enabled=enabled)
        self._ddp_checked: set[tuple[int, int]] = set()
        if self._enabled:
            _check_growth_interval(growth_interval)

    def set_growth_interval(self, new_interval: int) -> None:
        """As torch's: any integer; one <= 0 is never reached, so the scale never grows."""
        _check_growth_interval(new_interval)
        super().set_growth_interval(new_interval)

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _collect(optimizer: torch.optim.Optimizer, grads: Optional[list[torch.Tensor]],
                 unscaling: bool = True) -> list[torch.Tensor]:
        """The gradients to handle, checked in one pass (``unscaling``: float16 ones refused)."""
        if grads is None:
            grads = [p.grad for group in optimizer.param_groups for p in group["params"]
                     if p.grad is not None]
        out = []
        for g in grads:
            if g.is_sparse:
                raise _SparseGradients("fastddp.GradScaler: sparse gradients (e.g. nn.Embedding("
                                       "sparse=True)) are handled by torch's scaler code, which takes "
                                       "neither max_grad_norm nor grads=; clip them with "
                                       "torch.nn.utils.clip_grad_norm_ after unscale_()")
            if not _is_dense(g):
                # Any dense layout (row-major, channels_last, transposed) is one span of memory
                # and handled in place; autograd never makes a gradient with gaps or overlaps.
                raise ValueError(f"fastddp.GradScaler: a gradient of shape {tuple(g.shape)} has "
                                 f"strides {g.stride()}, which leave gaps or overlap; set a dense "
                                 "gradient (p.grad = g.contiguous()) or use torch.amp.GradScaler")
            if unscaling and g.dtype == torch.float16:
                raise ValueError(FP16_GRADS)
            out.append(g)
        devices = {g.device for g in out}
        if len(devices) > 1:
            raise ValueError("fastddp.GradScaler: this optimizer's gradients are on several devices "
                             f"({', '.join(sorted(map(str, devices)))}); it handles one device per "
                             "optimizer. Use one optimizer per device, or torch.amp.GradScaler")
        return out

    @staticmethod
    def _stats(grads: list[torch.Tensor], device: torch.device, ddp: Any = None) -> torch.Tensor:
        if ddp is not None:
            # Computed bucket by bucket as the all-reduces completed (see _bucket_stats).
            stats = _take_reduced_stats(ddp)
            if stats is not None:
                return stats
        stats = torch.zeros(1, dtype=torch.float64, device=device)
        if grads:
            C.amp_accumulate_stats_(grads, stats)
        return stats

    def _ddp_grads(self, optimizer: torch.optim.Optimizer, ddp: Any, unscaling: bool = True) -> list[torch.Tensor]:
        """The flat bucket buffers of ``ddp`` (checked once to hold exactly the optimizer's
        parameters), with the statistics visitor registered on ``ddp``'s reduction."""
        key = (id(optimizer), id(ddp))
        if key not in self._ddp_checked:
            ours = {id(p) for g in optimizer.param_groups for p in g["params"] if p.requires_grad}
            if ours != {id(p) for p in ddp.reduced_parameters()}:
                raise ValueError("GradScaler.step(ddp=...): the optimizer must hold exactly the "
                                 "DDPWrapper's trainable parameters; pass grads=... or no ddp for "
                                 "optimizers that hold a subset")
            _bucket_stats(ddp)
            self._ddp_checked.add(key)
        buffers = ddp.reduced_gradients()  # None in a world of one, where .grad is autograd's
        if buffers is not None:
            if unscaling and any(b.dtype == torch.float16 for b in buffers):
                raise ValueError(FP16_GRADS)
            return buffers
        return self._collect(optimizer, None, unscaling)

    @staticmethod
    def _fused_step(optimizer: torch.optim.Optimizer, grad_scale: Optional[torch.Tensor],
                    found_inf: torch.Tensor, args: tuple, kwargs: dict, restore: bool = False) -> Any:
        """Step a fused optimizer (``_step_supports_amp_scaling``) that divides the gradients by
        ``grad_scale`` and skips the update where ``found_inf`` is set, inside its kernel.

        A ``grad_scale`` the user set on the optimizer multiplies ours, as in torch's scaler,
        which then deletes it (``restore``: put it back, for a step torch's scaler would not
        have touched)."""
        preset = getattr(optimizer, "grad_scale", None)
        if grad_scale is not None:
            grad_scale = grad_scale.view(()) if preset is None else grad_scale.view(()) * preset
        optimizer.grad_scale = preset if grad_scale is None else grad_scale  # type: ignore[attr-defined]
        optimizer.found_inf = found_inf.view(())  # type: ignore[attr-defined]
        try:
            return optimizer.step(*args, **kwargs)
        finally:
            del optimizer.grad_scale  # type: ignore[attr-defined]
            del optimizer.found_inf  # type: ignore[attr-defined]
            if restore and preset is not None:
                optimizer.grad_scale = preset  # type: ignore[attr-defined]

    @staticmethod
    def _passes_itself(optimizer: torch.optim.Optimizer) -> bool:
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

    def _device_of(self, grads: list[torch.Tensor]) -> torch.device:
        if self._scale is not None:
            if grads and grads[0].device != self._scale.device:
                raise ValueError(f"fastddp.GradScaler: gradients are on {grads[0].device} but the "
                                 f"loss scale lives on {self._scale.device} (where scale() first "
                                 "ran); keep the loss and the parameters on one device")
            return self._scale.device
        return grads[0].device if grads else torch.device(self._device)

    # ------------------------------------------------------------------ API
    def unscale_(self, optimizer: torch.optim.Optimizer, grads: Optional[list[torch.Tensor]] = None) -> None:
        """Divide the gradients by the scale (one fused check+norm pass and one multiply pass).

        Raises RuntimeError when called twice before :meth:`update`, or after :meth:`step`,
        exactly as torch's scaler does.
        """
        if not self._enabled:
            return
        scale, _ = self._check_scale_growth_tracker("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        try:
            g = self._collect(optimizer, grads)
        except _SparseGradients:
            if grads is not None:
                raise
            # torch's scaler unscales sparse gradients (coalescing them); so does its code here
            super().unscale_(optimizer)
            return
        self._device_of(g)
        state["stage"] = OptState.UNSCALED
        if not g:  # as torch: nothing checked, which step() and update() then report
            state["found_inf_per_device"] = {}
            return
        found_inf, norm, coef, _ = C.amp_finalize(self._stats(g, scale.device), scale.view(1), 0.0, CLIP_EPS)
        C.amp_scale_(g, coef)
        state["found_inf_per_device"] = {scale.device: found_inf.view(())}
        state["norm"] = norm

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, max_grad_norm: Optional[float] = None,
             grads: Optional[list[torch.Tensor]] = None, ddp: Any = None, **kwargs: Any) -> Any:
        """Unscale (unless :meth:`unscale_` ran), check for inf/NaN, optionally clip to
        ``max_grad_norm``, and step the optimizer unless a gradient was inf/NaN.

        ``ddp``: the :class:`fastddp.DDPWrapper` whose parameters this optimizer holds. Its
        reducer then reads each bucket for the inf/NaN check and the norm as soon as that
        bucket's all-reduce completes (overlapping the remaining communication), and the
        coefficient is applied to its few flat buffers; after backward only the one-thread
        kernel remains.

        Returns the optimizer's return value, or, when ``max_grad_norm`` is given, the global
        norm of the unscaled gradients as a device tensor (before clipping, like
        ``torch.nn.utils.clip_grad_norm_``).
        """
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"GradScaler.step: max_grad_norm must be > 0, got {max_grad_norm!r} "
                             "(pass None to step without clipping)")
        if not self._enabled:
            if max_grad_norm is None:
                return optimizer.step(*args, **kwargs)
            g = (self._ddp_grads(optimizer, ddp, unscaling=False) if ddp is not None
                 else self._collect(optimizer, grads, unscaling=False))
            if not g:
                optimizer.step(*args, **kwargs)
                return torch.zeros((), device=self._device)
            one = torch.ones(1, dtype=torch.float32, device=g[0].device)
            found_inf, norm, coef, inv_coef = C.amp_finalize(self._stats(g, g[0].device, ddp), one,
                                                             float(max_grad_norm), CLIP_EPS)
            if getattr(optimizer, "_step_supports_amp_scaling", False):
                # The clip coefficient rides into the fused optimizer as its grad_scale: no
                # separate multiply pass. Without AMP nothing is skipped (found_inf 0), and a
                # non-finite norm leaves the gradients as they are, as the multiply path does.
                self._fused_step(optimizer, inv_coef, torch.zeros_like(found_inf), args, kwargs,
                                 restore=True)
                return norm
            C.amp_scale_(g, coef)
            optimizer.step(*args, **kwargs)
            return norm
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        scale, _ = self._check_scale_growth_tracker("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        try:
            g = self._ddp_grads(optimizer, ddp) if ddp is not None else self._collect(optimizer, grads)
        except _SparseGradients:
            if grads is not None or ddp is not None or max_grad_norm is not None:
                raise
            return super().step(optimizer, *args, **kwargs)  # unscale_ above takes the same path
        fused = getattr(optimizer, "_step_supports_amp_scaling", False)
        if fused and self._passes_itself(optimizer):
            if grads is not None or ddp is not None or max_grad_norm is not None:
                raise ValueError("GradScaler.step: this optimizer's step() takes grad_scaler= and "
                                 "unscales by itself; call step(optimizer) without max_grad_norm, "
                                 "grads or ddp")
            return super().step(optimizer, *args, **kwargs)  # torch's FutureWarning and grad_scaler=self
        if not g or (state["stage"] is OptState.UNSCALED and not state["found_inf_per_device"]):
            if not fused:
                # torch's assertion: no parameter of this optimizer has a gradient (no backward ran?)
                raise AssertionError("No inf checks were recorded for this optimizer.")
            # torch's scaler steps a fused optimizer without gradients (a no-op) and records no
            # inf check: update() then counts only the other optimizers' checks
            retval = self._fused_step(optimizer, scale if state["stage"] is OptState.READY else None,
                                      torch.zeros((), device=scale.device), args, kwargs)
            state["stage"] = OptState.STEPPED
            return torch.zeros((), device=scale.device) if max_grad_norm is not None else retval
        device = self._device_of(g)
        clip = float(max_grad_norm) if max_grad_norm is not None else 0.0
        if state["stage"] is OptState.READY:
            found_inf, norm, coef, inv_coef = C.amp_finalize(self._stats(g, device, ddp), scale.view(1),
                                                             clip, CLIP_EPS)
            rescale = True
        else:  # UNSCALED: gradients are already divided by the scale (and maybe edited since)
            found_inf = state["found_inf_per_device"][device].view(1)
            norm = state["norm"]
            rescale = max_grad_norm is not None
            if rescale:
                one = torch.ones(1, dtype=torch.float32, device=device)
                _, norm, coef, inv_coef = C.amp_finalize(self._stats(g, device), one, clip, CLIP_EPS)
        if fused:
            # Fused optimizers divide by grad_scale and skip on found_inf inside their kernel:
            # the gradients are never rewritten and nothing is read back to the host.
            retval = self._fused_step(optimizer, inv_coef if rescale else None, found_inf, args, kwargs)
        else:
            if rescale and g:
                C.amp_scale_(g, coef)
            retval = None
            if not bool(found_inf.item()):  # the one host sync of the non-fused path
                retval = optimizer.step(*args, **kwargs)
        state["found_inf_per_device"] = {device: found_inf.view(())}
        state["norm"] = norm
        state["stage"] = OptState.STEPPED
        return norm.view(()) if max_grad_norm is not None else retval

    def update(self, new_scale: Optional[float | torch.Tensor] = None) -> None:
        """Update the scale with torch's rule, in one device kernel (no host sync)."""
        if not self._enabled:
            return
        if new_scale is not None:
            super().update(new_scale)
            return
        scale, tracker = self._check_scale_growth_tracker("update")
        found_infs = [fi.to(scale.device, non_blocking=True)
                      for st in self._per_optimizer_states.values()
                      for fi in st["found_inf_per_device"].values()]
        if not found_infs:
            raise AssertionError("No inf checks were recorded prior to update.")
        combined = found_infs[0].reshape(1)
        for fi in found_infs[1:]:
            combined = combined + fi.reshape(1)
        # torch's kernel refuses what is not a float / an int here (after load_state_dict or a
        # setter took it); so does this one, instead of converting it
        C.amp_update_scale_(scale, tracker, combined, _check_factor("growth_factor", self._growth_factor),
                            _check_factor("backoff_factor", self._backoff_factor),
                            _check_growth_interval(self._growth_interval))
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)


__all__ = ["GradScaler"]
