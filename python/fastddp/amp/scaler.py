"""``fastddp.GradScaler``: torch.amp.GradScaler's API and state, with the gradient work (the
inf/NaN check, the norm, unscale and clip, the scale update) in fastddp's kernels."""

from __future__ import annotations

import warnings
from collections import defaultdict
from typing import Any, Optional

import torch
from torch.amp.grad_scaler import OptState, _refresh_per_optimizer_state

from .._ext import C
from .checks import (
    FP16_GRADS,
    FUSED_STEP_KEYWORDS,
    TorchPathGradients,
    check_factor,
    check_growth_interval,
    collect_grads,
)
from .fused import passes_itself, step_in_kernel, takes_keyword
from .stats import bucket_stats, grad_stats

CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s epsilon


class GradScaler(torch.amp.GradScaler):
    """Drop-in for :class:`torch.amp.GradScaler` (same constructor, calls and ``state_dict``).

    The work on gradients runs in fastddp's kernels: one read pass over all gradients computes
    the inf/NaN flag and the sum of squares; a one-thread kernel turns that into ``found_inf``,
    the global norm and one coefficient ``inv_scale * min(1, max_norm / (norm + 1e-6))``; one
    multiply pass applies it — or none at all with torch's fused optimizers
    (``AdamW(fused=True)`` etc.), which receive the coefficient as ``grad_scale`` together with
    ``found_inf`` and skip the update on the device.

    :meth:`step` is torch's (every keyword goes to the optimizer). Beyond torch's API,
    :meth:`fused_step` takes ``max_grad_norm`` (unscale + check + clip + step in one call,
    returning the unscaled global norm as a device tensor, like ``clip_grad_norm_``), ``ddp``
    (a DDPWrapper whose buckets are checked as their all-reduces complete) and ``grads``
    (operate on these tensors instead of the optimizer's ``.grad``s, e.g.
    :meth:`fastddp.DDPWrapper.bucket_buffers`, so a few flat buffers replace hundreds of small
    tensors).

    A subclass that overrides ``unscale_``, ``_unscale_grads_`` or ``_maybe_opt_step`` (the
    methods torch's ``step`` calls), or a patch of one on the class or on an instance, gets
    torch's ``step`` and ``unscale_``, which call them.

    An optimizer holding sparse gradients (``nn.Embedding(sparse=True)``), or gradients with
    gaps or overlaps (a strided view of a larger buffer assigned to ``.grad``), is unscaled and
    stepped by torch's own code, as with ``torch.amp.GradScaler``.

    Host syncs: none with a fused optimizer. With any other optimizer, deciding whether to skip
    the step reads ``found_inf`` once per step (as torch's scaler does).
    """

    # torch's step() calls these; where one is replaced (a subclass's override, or a patch on
    # the class or on the instance, e.g. mock.patch.object), step() and unscale_() are torch's,
    # which call them (the fused path does not)
    _TORCH_STEP_HOOKS = ("unscale_", "_unscale_grads_", "_maybe_opt_step")

    def _replaced_step_hooks(self) -> tuple[str, ...]:
        """The methods torch's ``step()`` calls that are not the ones this class defines."""
        return tuple(n for n in GradScaler._TORCH_STEP_HOOKS
                     if n in self.__dict__ or getattr(type(self), n) is not _OWN_STEP_HOOKS[n])

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        # torch's own warning and outcome, given here so that it names the caller's line as
        # torch's does (from torch's constructor it would name this one)
        disabling = device == "cuda" and enabled and torch.cuda.amp.common.amp_definitely_not_available()
        if disabling:
            warnings.warn("torch.cuda.amp.GradScaler is enabled, but CUDA is not available.  Disabling.",
                          stacklevel=2)
        super().__init__(device, init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval,
                         enabled=False if disabling else enabled)  # as given, as torch keeps it
        self._ddp_checked: set[tuple[int, int]] = set()
        if self._enabled:
            check_growth_interval(growth_interval)

    def set_growth_interval(self, new_interval: int) -> None:
        """As torch's: any integer; one <= 0 is never reached, so the scale never grows."""
        check_growth_interval(new_interval)
        super().set_growth_interval(new_interval)

    # ------------------------------------------------------------------ helpers
    def _ddp_grads(self, optimizer: torch.optim.Optimizer, ddp: Any, unscaling: bool = True) -> list[torch.Tensor]:
        """The flat bucket buffers of ``ddp`` (checked once to hold exactly the optimizer's
        parameters), with the statistics visitor registered on ``ddp``'s reduction."""
        key = (id(optimizer), id(ddp))
        if key not in self._ddp_checked:
            ours = {id(p) for g in optimizer.param_groups for p in g["params"] if p.requires_grad}
            if ours != {id(p) for p in ddp.reduced_parameters()}:
                raise ValueError("GradScaler.fused_step(ddp=...): the optimizer must hold exactly the "
                                 "DDPWrapper's trainable parameters; pass grads=... or no ddp for "
                                 "optimizers that hold a subset")
            bucket_stats(ddp)
            self._ddp_checked.add(key)
        buffers = ddp.reduced_gradients()  # None in a world of one, where .grad is autograd's
        if buffers is not None:
            if unscaling and any(b.dtype == torch.float16 for b in buffers):
                raise ValueError(FP16_GRADS)
            return buffers
        return collect_grads(optimizer, None, unscaling)

    def _grads(self, optimizer: torch.optim.Optimizer, grads: Optional[list[torch.Tensor]], ddp: Any,
               unscaling: bool = True) -> list[torch.Tensor]:
        """The gradients a step works on: ``ddp``'s buckets, ``grads``, or the ``.grad``s."""
        if ddp is not None:
            return self._ddp_grads(optimizer, ddp, unscaling)
        return collect_grads(optimizer, grads, unscaling)

    def _device_of(self, grads: list[torch.Tensor]) -> torch.device:
        if self._scale is not None:
            if grads and grads[0].device != self._scale.device:
                raise ValueError(f"fastddp.GradScaler: gradients are on {grads[0].device} but the "
                                 f"loss scale lives on {self._scale.device} (where scale() first "
                                 "ran); keep the loss and the parameters on one device")
            return self._scale.device
        return grads[0].device if grads else torch.device(self._device)

    def _step_disabled(self, optimizer: torch.optim.Optimizer, max_grad_norm: Optional[float],
                       grads: Optional[list[torch.Tensor]], ddp: Any, args: tuple, kwargs: dict) -> Any:
        """``enabled=False``: the optimizer's step, clipped to ``max_grad_norm`` when given."""
        if max_grad_norm is None:
            return optimizer.step(*args, **kwargs)
        g = self._grads(optimizer, grads, ddp, unscaling=False)
        if not g:
            optimizer.step(*args, **kwargs)
            return torch.zeros((), device=self._device)
        one = torch.ones(1, dtype=torch.float32, device=g[0].device)
        found_inf, norm, coef, inv_coef = C.amp_finalize(grad_stats(g, g[0].device, ddp), one,
                                                         float(max_grad_norm), CLIP_EPS)
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            # The clip coefficient rides into the fused optimizer as its grad_scale: no
            # separate multiply pass. Without AMP nothing is skipped (found_inf 0), and a
            # non-finite norm leaves the gradients as they are, as the multiply path does.
            step_in_kernel(optimizer, inv_coef, torch.zeros_like(found_inf), args, kwargs, restore=True)
            return norm
        C.amp_scale_(g, coef)
        optimizer.step(*args, **kwargs)
        return norm

    def _step_without_grads(self, optimizer: torch.optim.Optimizer, state: dict, scale: torch.Tensor,
                            clipping: bool, args: tuple, kwargs: dict) -> Any:
        """No gradient to check: torch's scaler steps a fused optimizer (a no-op) recording no
        inf check, so update() counts only the other optimizers'; any other one is refused."""
        if not getattr(optimizer, "_step_supports_amp_scaling", False):
            # torch's assertion: no parameter of this optimizer has a gradient (no backward ran?),
            # after its step() ran unscale_(), which recorded no check
            state["stage"] = OptState.UNSCALED
            raise AssertionError("No inf checks were recorded for this optimizer.")
        retval = step_in_kernel(optimizer, scale if state["stage"] is OptState.READY else None,
                                torch.zeros((), device=scale.device), args, kwargs)
        state["stage"] = OptState.STEPPED
        return torch.zeros((), device=scale.device) if clipping else retval

    def _finalize(self, state: dict, g: list[torch.Tensor], device: torch.device, scale: torch.Tensor,
                  max_grad_norm: Optional[float], ddp: Any) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[tuple]]:
        """``found_inf``, the norm (None when unscale_ ran and there is no clipping), and the
        (coef, inv_coef) that unscale and clip the gradients, or None when they stay as they
        are (unscale_ ran and no clipping)."""
        clip = float(max_grad_norm) if max_grad_norm is not None else 0.0
        if state["stage"] is OptState.READY:
            found_inf, norm, coef, inv_coef = C.amp_finalize(grad_stats(g, device, ddp), scale.view(1),
                                                             clip, CLIP_EPS)
            # Without clipping a fused optimizer divides by the scale itself, as torch's scaler
            # hands it: 1 / float32(1 / scale) is off in the last bit unless the scale is a
            # power of two.
            return found_inf, norm, (coef, inv_coef if max_grad_norm is not None else scale.view(1))
        # UNSCALED: gradients are already divided by the scale (and maybe edited since)
        found_inf = state["found_inf_per_device"][device].view(1)
        if max_grad_norm is None:
            return found_inf, None, None
        one = torch.ones(1, dtype=torch.float32, device=device)
        _, norm, coef, inv_coef = C.amp_finalize(grad_stats(g, device), one, clip, CLIP_EPS)
        return found_inf, norm, (coef, inv_coef)

    @staticmethod
    def _apply(optimizer: torch.optim.Optimizer, state: dict, g: list[torch.Tensor], found_inf: torch.Tensor,
               rescale: Optional[tuple], args: tuple, kwargs: dict) -> Any:
        """Rescale ``g`` and step unless ``found_inf``: a fused optimizer does both in its kernel
        (nothing read back to the host; the stage stays as torch's leaves it until the step
        returns); any other costs one host read of ``found_inf``, and its gradients are
        unscaled (the stage says so) before its step runs."""
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            return step_in_kernel(optimizer, rescale[1] if rescale else None, found_inf, args, kwargs)
        if rescale and g:
            C.amp_scale_(g, rescale[0])
        state["stage"] = OptState.UNSCALED
        if bool(found_inf.item()):
            return None
        return optimizer.step(*args, **kwargs)

    # ------------------------------------------------------------------ API
    def unscale_(self, optimizer: torch.optim.Optimizer, *, grads: Optional[list[torch.Tensor]] = None) -> None:
        """Divide the gradients by the scale (one fused check+norm pass and one multiply pass).

        Raises RuntimeError when called twice before :meth:`update`, or after :meth:`step`,
        exactly as torch's scaler does.
        """
        replaced = self._replaced_step_hooks()
        if replaced:
            if grads is not None:
                raise TypeError(f"GradScaler.unscale_(grads=...): {type(self).__name__} replaces "
                                f"{', '.join(replaced)}, so unscale_ is torch's, which takes "
                                "the optimizer's .grad only")
            super().unscale_(optimizer)
            return
        if not self._enabled:
            return
        scale, _ = self._check_scale_growth_tracker("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        try:
            g = collect_grads(optimizer, grads)
        except TorchPathGradients:
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
        found_inf, _, coef, _ = C.amp_finalize(grad_stats(g, scale.device), scale.view(1), 0.0, CLIP_EPS)
        C.amp_scale_(g, coef)
        state["found_inf_per_device"] = {scale.device: found_inf.view(())}

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """As torch's: unscale (unless :meth:`unscale_` ran), check for inf/NaN, and step the
        optimizer unless a gradient was inf/NaN, returning the optimizer's return value. Every
        argument after ``optimizer`` goes to ``optimizer.step``; clipping and the reads of a
        DDPWrapper's buckets are :meth:`fused_step`'s."""
        for name in FUSED_STEP_KEYWORDS:
            if name in kwargs and not takes_keyword(optimizer, name):
                raise TypeError(f"GradScaler.step(optimizer, {name}=...): step() passes its keyword "
                                f"arguments to optimizer.step(), as torch's GradScaler does, and "
                                f"{type(optimizer).__name__}.step() takes no {name!r}; for fastddp's "
                                f"fused unscale, clip and step call scaler.fused_step(optimizer, {name}=...)")
        if self._replaced_step_hooks():
            return super().step(optimizer, *args, **kwargs)
        return self._step(optimizer, args, kwargs)

    def fused_step(self, optimizer: torch.optim.Optimizer, *args: Any, max_grad_norm: Optional[float] = None,
                   grads: Optional[list[torch.Tensor]] = None, ddp: Any = None, **kwargs: Any) -> Any:
        """:meth:`step` with fastddp's fused extras: unscale (unless :meth:`unscale_` ran),
        check for inf/NaN, optionally clip to ``max_grad_norm``, and step the optimizer unless a
        gradient was inf/NaN; the other arguments go to ``optimizer.step``.

        ``ddp``: the :class:`fastddp.DDPWrapper` whose parameters this optimizer holds. Its
        reducer then reads each bucket for the inf/NaN check and the norm as soon as that
        bucket's all-reduce completes (overlapping the remaining communication), and the
        coefficient is applied to its few flat buffers; after backward only the one-thread
        kernel remains. ``grads``: work on these tensors instead of the ``.grad``s.

        Returns the optimizer's return value, or, when ``max_grad_norm`` is given, the global
        norm of the unscaled gradients as a device tensor (before clipping, like
        ``torch.nn.utils.clip_grad_norm_``). On a step skipped for an inf/NaN gradient the norm
        is ``inf``, also where a gradient was NaN (``clip_grad_norm_`` returns ``nan`` there):
        one fused pass keeps a sum of squares, in which any inf or NaN element is the same.
        """
        replaced = self._replaced_step_hooks()
        if replaced and (max_grad_norm is not None or grads is not None or ddp is not None):
            raise TypeError(f"GradScaler.fused_step: {type(self).__name__} replaces "
                            f"{', '.join(replaced)}, which the fused step does not call; "
                            "call step(), and clip between unscale_() and step()")
        if replaced:
            return super().step(optimizer, *args, **kwargs)
        return self._step(optimizer, args, kwargs, max_grad_norm, grads, ddp)

    def _step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict,
              max_grad_norm: Optional[float] = None, grads: Optional[list[torch.Tensor]] = None,
              ddp: Any = None) -> Any:
        """The fused step (:meth:`fused_step`); ``args`` and ``kwargs`` go to the optimizer."""
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"GradScaler.fused_step: max_grad_norm must be > 0, got {max_grad_norm!r} "
                             "(pass None to step without clipping)")
        if not self._enabled:
            return self._step_disabled(optimizer, max_grad_norm, grads, ddp, args, kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        scale, _ = self._check_scale_growth_tracker("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        ours = grads is not None or ddp is not None or max_grad_norm is not None
        try:
            # A fused optimizer unscales in its own kernel, which takes float16 gradients: torch's
            # scaler then checks them for inf/NaN without refusing float16 (unscale_() does refuse)
            g = self._grads(optimizer, grads, ddp, unscaling=not getattr(optimizer, "_step_supports_amp_scaling", False))
        except TorchPathGradients:
            if ours:
                raise
            return super().step(optimizer, *args, **kwargs)  # unscale_ above takes the same path
        if getattr(optimizer, "_step_supports_amp_scaling", False) and passes_itself(optimizer):
            if ours:
                raise ValueError("GradScaler.fused_step: this optimizer's step() takes grad_scaler= "
                                 "and unscales by itself; call step(optimizer) (no max_grad_norm, "
                                 "grads or ddp)")
            return super().step(optimizer, *args, **kwargs)  # torch's FutureWarning and grad_scaler=self
        # No check to go by: no gradient before unscale_(), or none when unscale_() ran. With
        # a check recorded, the gradients may have been cleared since (a dropped step): the
        # optimizer steps unless that check found inf/NaN, as torch's scaler does.
        if (not g and state["stage"] is OptState.READY) or \
                (state["stage"] is OptState.UNSCALED and not state["found_inf_per_device"]):
            return self._step_without_grads(optimizer, state, scale, max_grad_norm is not None, args, kwargs)
        device = self._device_of(g)
        found_inf, norm, rescale = self._finalize(state, g, device, scale, max_grad_norm, ddp)
        # Recorded before the optimizer steps, as torch's step() records its unscale_(): after
        # an optimizer.step() that raised, a retried step() does not unscale again and update()
        # finds the check.
        state["found_inf_per_device"] = {device: found_inf.view(())}
        retval = self._apply(optimizer, state, g, found_inf, rescale, args, kwargs)
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
        C.amp_update_scale_(scale, tracker, combined, check_factor("growth_factor", self._growth_factor),
                            check_factor("backoff_factor", self._backoff_factor),
                            check_growth_interval(self._growth_interval))
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)


# what GradScaler's step() stands for; replacing one sends step() to torch's code (see above)
_OWN_STEP_HOOKS = {name: getattr(GradScaler, name) for name in GradScaler._TORCH_STEP_HOOKS}
