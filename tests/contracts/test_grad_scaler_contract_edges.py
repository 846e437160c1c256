"""Contract, less common uses: fastddp.GradScaler beside torch.amp.GradScaler with argument
types torch takes (numpy / tensor integers) or refuses late (in update()). Same harness as
test_grad_scaler_contract."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from .test_grad_scaler_contract import INF, _model, _side_by_side


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
