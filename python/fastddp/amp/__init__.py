"""``fastddp.GradScaler``: AMP loss scaling with unscale, inf/NaN check, grad-norm clipping and
the scale update fused in C++/CUDA, with no host sync on the fused-optimizer path.

- ``scaler``: the GradScaler class (torch.amp.GradScaler's API and state).
- ``checks``: the settings and gradients it accepts.
- ``stats``: the gradients' inf/NaN flag and sum of squares, from one pass or a DDPWrapper's reduction.
- ``fused``: stepping torch's fused optimizers with ``grad_scale``/``found_inf``.
"""

from .scaler import GradScaler

__all__ = ["GradScaler"]
