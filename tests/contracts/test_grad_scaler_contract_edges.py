"""Contract, less common uses: fastddp.GradScaler beside torch.amp.GradScaler with argument
types torch takes (numpy / tensor integers) or refuses late (in update()), fused optimizers
without gradients or with a ``grad_scale`` of their own, and optimizers whose step() takes
``grad_scaler=``. Same harness as test_grad_scaler_contract."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from .test_grad_scaler_contract import INF, NAN, _model, _side_by_side


def _steps(cls: type, opt: torch.optim.Optimizer, model: nn.Module, scaler: Any, n: int = 4) -> list:
    out = []
    for step in range(n):
        opt.zero_grad()
        scaler.scale(model(torch.ones(2, 6)).sum() * (INF if step == 1 else 1.0)).backward()
        out.append(scaler.step(opt))
        scaler.update()
        out.append(scaler.state_dict())
    return out + [list(model.parameters())]


@pytest.mark.parametrize("interval", [np.int64(2), np.int32(1), torch.tensor(2)], ids=["np64", "np32", "tensor"])
def test_growth_interval_integer_types_torch_takes(interval) -> None:
    def run(cls):
        model = _model()
        scaler = cls("cpu", init_scale=8.0, growth_interval=interval)
        out = _steps(cls, torch.optim.SGD(model.parameters(), lr=0.1), model, scaler)
        scaler.set_growth_interval(interval)
        return out + [scaler.get_growth_interval()]

    _side_by_side(run)


SETTERS = {
    "growth_factor_int": lambda s: s.set_growth_factor(3),
    "growth_factor_tensor": lambda s: s.set_growth_factor(torch.tensor(3.0)),
    "backoff_factor_numpy": lambda s: s.set_backoff_factor(np.float32(0.25)),
    "growth_factor_str": lambda s: s.set_growth_factor("3"),
    "backoff_factor_none": lambda s: s.set_backoff_factor(None),
    "growth_factor_1d_tensor": lambda s: s.set_growth_factor(torch.tensor([3.0])),
    "loaded_float_interval": lambda s: s.load_state_dict(
        {"scale": 8.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2.5, "_growth_tracker": 0}),
    "loaded_str_factor": lambda s: s.load_state_dict(
        {"scale": 8.0, "growth_factor": "2", "backoff_factor": 0.5, "growth_interval": 2, "_growth_tracker": 0}),
}


@pytest.mark.parametrize("case", sorted(SETTERS))
def test_factors_set_after_construction(case) -> None:
    # torch's scaler takes any value here and its update kernel refuses what is not a float
    # (factors) or an int (interval), with a TypeError; ours refuses the same values, never
    # converting them ("3" -> 3.0, 2.5 -> 2).
    def run(cls):
        model = _model()
        scaler = cls("cpu", init_scale=8.0, growth_interval=1)
        SETTERS[case](scaler)
        return _steps(cls, torch.optim.SGD(model.parameters(), lr=0.1), model, scaler)

    _side_by_side(run, same_message=False)


def test_fused_optimizer_without_gradients_beside_another() -> None:
    # A GAN-like step where the fused optimizer's module took no part in this backward: torch
    # steps it (a no-op) and update() counts the other optimizer's inf check.
    def run(cls):
        torch.manual_seed(0)
        used, idle = nn.Linear(3, 2), nn.Linear(3, 2)
        o_used = torch.optim.SGD(used.parameters(), lr=0.1)
        o_idle = torch.optim.AdamW(idle.parameters(), lr=0.1, fused=True)
        scaler = cls("cpu", init_scale=8.0, growth_interval=1)
        out = []
        for step in range(3):
            scaler.scale(used(torch.ones(2, 3)).sum() * (INF if step == 1 else 1.0)).backward()
            if step == 2:
                scaler.unscale_(o_idle)
            out += [scaler.step(o_used), scaler.step(o_idle)]
            scaler.update()
            out.append(scaler.get_scale())
            o_used.zero_grad()
        return out + [list(used.parameters()), list(idle.parameters())]

    _side_by_side(run)


def test_fused_optimizer_alone_without_gradients() -> None:
    def run(cls):
        opt = torch.optim.AdamW(nn.Linear(3, 2).parameters(), lr=0.1, fused=True)
        scaler = cls("cpu")
        scaler.scale(torch.ones(()))
        scaler.step(opt)
        scaler.update()

    assert _side_by_side(run)[0] is AssertionError


@pytest.mark.parametrize("as_tensor", [True, False])
@pytest.mark.parametrize("unscale_first", [False, True])
def test_fused_optimizer_with_its_own_grad_scale(unscale_first, as_tensor) -> None:
    # torch's scaler multiplies a grad_scale the user set on a fused optimizer by its scale
    # (or uses it alone after unscale_), then deletes the attribute.
    def run(cls):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
        scaler = cls("cpu", init_scale=4.0)
        out = []
        for step in range(3):
            opt.zero_grad()
            scaler.scale(model(torch.ones(2, 6)).sum()).backward()
            if unscale_first:
                scaler.unscale_(opt)
            opt.grad_scale = torch.tensor(2.0 + step) if as_tensor else 2.0 + step
            out += [scaler.step(opt), hasattr(opt, "grad_scale")]
            scaler.update()
        return out + [list(model.parameters())]

    _side_by_side(run)


class _TakesGradScaler(torch.optim.SGD):
    """The older contract of _step_supports_amp_scaling: step() receives the scaler."""

    _step_supports_amp_scaling = True

    def step(self, closure=None, grad_scaler=None):  # unscales through the scaler it is given
        if grad_scaler is not None and not grad_scaler._found_inf_per_device(self):
            grad_scaler.unscale_(self)
        super().step()
        return ("stepped", grad_scaler is not None, getattr(self, "grad_scale", "unset"))


def test_optimizer_whose_step_takes_grad_scaler() -> None:
    def run(cls):
        model = _model()
        opt = _TakesGradScaler(model.parameters(), lr=0.1)
        scaler = cls("cpu", init_scale=4.0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = _steps(cls, opt, model, scaler, n=2)
        return out + [[(w.category, str(w.message)) for w in caught]]

    assert _side_by_side(run)[-1][0][0] is FutureWarning


def test_float64_gradients_beyond_float32_range() -> None:
    # torch checks each float64 gradient element for inf/NaN; values whose squares overflow a
    # double (|g| > 1.3e154), or that float32 cannot hold, are finite and the step is taken.
    def run(cls):
        p = nn.Parameter(torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64))
        opt = torch.optim.SGD([p], lr=1e-303)
        scaler = cls("cpu", init_scale=2.0, growth_interval=1)
        out = []
        for factor in (1e300, 1e40, INF, 1e200, -NAN):
            opt.zero_grad()
            scaler.scale((p * factor).sum()).backward()
            out += [scaler.step(opt), p.detach().clone()]
            scaler.update()
            out.append(scaler.get_scale())
        return out

    _side_by_side(run)


@pytest.mark.parametrize("unscale_first", [False, True])
def test_complex_gradients_not_implemented(unscale_first) -> None:
    def run(cls):
        p = nn.Parameter(torch.tensor([1 + 2j, 3 - 1j]))
        opt = torch.optim.SGD([p], lr=0.1)
        scaler = cls("cpu")
        scaler.scale((p * p.conj()).real.sum()).backward()
        if unscale_first:
            scaler.unscale_(opt)
        scaler.step(opt)

    assert _side_by_side(run, same_message=False)[0] is NotImplementedError
