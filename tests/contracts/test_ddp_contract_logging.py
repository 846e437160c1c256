"""Contract: torch DDP's ``_get_ddp_logging_data()``, side by side with torch DDP in the same
two gloo ranks. After every step the two dicts have the same keys, every key that is not a
time has torch's value (the iteration torch's logger sampled, the bucket rebuild it logged, the
unused parameter bytes, the gradients' arrival order, the buckets reduced, the communication
hook, ``join()``, errors), and the times hold what torch's own ``test_ddp_logging_data_cpu``
checks of them. ``_set_ddp_runtime_logging_sample_rate`` and its error are torch's.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastddp

# host times in ns: their values differ from run to run, so they are checked, not compared
_TIMES = ("forward_compute_time", "backward_compute_time", "backward_comm_time",
          "backward_compute_comm_overlap_time")
_STAMPS = ("forward_compute_time_start", "backward_compute_time_start", "backward_compute_time_end",
           "backward_comm_time_start", "backward_comm_time_end")


class _TwoDtypes(nn.Module):
    """float32 and float64 layers (one bucket per dtype before the rebuild) and a layer that
    only ``unused=False`` forwards reach."""

    def __init__(self) -> None:
        super().__init__()
        self.low = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
        self.high = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 2)).double()
        self.side = nn.Linear(64, 2).double()

    def forward(self, x: torch.Tensor, unused: bool = False) -> torch.Tensor:
        h = self.high(self.low(x).double())
        return h if unused else h + self.side(self.low(x).double())


def _check_times(data: dict[str, Any]) -> None:
    """torch's own checks of the sampled times (distributed_test.py)."""
    for key in ("forward_compute_time", "backward_compute_time", "backward_comm_time"):
        assert data[key] >= 1 and data["avg_" + key] >= 1, (key, data)
    for key in ("backward_compute_time", "backward_comm_time"):
        assert data[key] >= data["backward_compute_comm_overlap_time"], data
    assert data["backward_comm_time_end"] >= data["backward_comm_time_start"] >= data["backward_compute_time_start"]
    assert data["backward_compute_time_end"] >= data["backward_compute_time_start"]
    assert data["backward_compute_time_start"] >= data["forward_compute_time_start"], data


def _side_by_side(steps: int, kwargs: dict[str, Any], setup: Callable[[nn.Module], None] = lambda m: None,
                  unused: bool = False, join: bool = False) -> dict[str, Any]:
    """Train torch DDP and DDPWrapper alike for ``steps``; compare the dicts after each step."""
    models = []
    for cls in (TorchDDP, fastddp.DDPWrapper):
        torch.manual_seed(0)
        model = cls(_TwoDtypes(), bucket_cap_mb=0.02, **kwargs)
        setup(model)
        models.append(model)
    ref, ours = models
    for step in range(steps + 1):
        theirs, mine = ref._get_ddp_logging_data(), ours._get_ddp_logging_data()
        assert set(mine) == set(theirs), (step, set(mine) ^ set(theirs))
        values = {k: v for k, v in theirs.items() if not k.endswith(_TIMES + _STAMPS)}
        assert {k: mine[k] for k in values} == values, (step, mine, theirs)
        if step > 1 and theirs.get("iteration") == step - 1:  # sampled as forward `step` started
            _check_times(mine)
        if step == steps:
            return mine
        x = torch.randn(3, 64)
        for m in models:
            with m.join() if join else contextlib.nullcontext():
                m(x, unused=unused).sum().backward()


def _sampled(rank: int, world_size: int) -> None:
    # the first 10 iterations, then every 2nd: the 24th forward started after iteration 23,
    # which is not sampled, the 23rd after iteration 22, which is
    last = _side_by_side(24, {}, setup=lambda m: m._set_ddp_runtime_logging_sample_rate(2))
    assert last["iteration"] == 22 and last["has_rebuilt_buckets"] == 1, last


def _default_rate(rate: int, world_size: int) -> None:
    last = _side_by_side(12, {})
    assert last["iteration"] == 10, last  # 11 is not sampled at the default rate of 100


def _unused_layer(rank: int, world_size: int) -> None:
    last = _side_by_side(4, {"find_unused_parameters": True}, unused=True)
    assert last["unused_parameter_size"] > 0, last


def _static_graph(rank: int, world_size: int) -> None:
    last = _side_by_side(4, {"static_graph": True})
    assert last["static_graph"] == 1, last


def _comm_hook(rank: int, world_size: int) -> None:
    last = _side_by_side(3, {}, setup=lambda m: m.register_comm_hook(None, default_hooks.allreduce_hook))
    assert last["comm_hook"] == "allreduce_hook", last


def _builtin_hook(rank: int, world_size: int) -> None:
    last = _side_by_side(2, {}, setup=lambda m: m._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE))
    assert last["comm_hook"] == "BuiltinCommHookType.ALLREDUCE", last


def _joined(rank: int, world_size: int) -> None:
    assert _side_by_side(3, {}, join=True)["join_uneven_inputs"] == 1


def _errors(rank: int, world_size: int) -> None:
    """The errors torch's logger keeps (has_error, error), and their exceptions."""
    outcomes = []
    for cls in (TorchDDP, fastddp.DDPWrapper):
        model = cls(_TwoDtypes())
        with pytest.raises(ValueError) as rate:
            model._set_ddp_runtime_logging_sample_rate(0)
        first = model._get_ddp_logging_data()
        model(torch.randn(3, 64))
        with pytest.raises(RuntimeError):
            model._set_static_graph()
        outcomes.append((str(rate.value), {k: first[k] for k in ("has_error", "error")},
                         model._get_ddp_logging_data()["error"]))
    assert outcomes[0] == outcomes[1], outcomes


class _Branch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        return self.b(self.a(x)) if use_b else self.a(x)


def _reducer_errors(rank: int, world_size: int) -> None:
    """A static graph that changed: torch's sentence in the error torch's logger keeps; an
    error raised after it (unread in between) replaces it."""
    def changed_graph(cls: type) -> nn.Module:
        model = cls(_Branch(), static_graph=True)
        model(torch.randn(2, 4), use_b=False).sum().backward()
        with pytest.raises(RuntimeError):
            model(torch.randn(2, 4), use_b=True).sum().backward()
        return model

    logged = []
    for cls in (TorchDDP, fastddp.DDPWrapper):
        data = changed_graph(cls)._get_ddp_logging_data()
        later = changed_graph(cls)
        with pytest.raises(ValueError):
            later._set_ddp_runtime_logging_sample_rate(0)
        logged.append((data.get("has_error"), data.get("error", ""), later._get_ddp_logging_data()["error"]))
    sentence = "Your training graph has changed in this iteration"
    assert logged[0][0] == logged[1][0] == 1 and all(sentence in e for _, e, _ in logged), logged
    assert logged[0][2] == logged[1][2] and "sample rate" in logged[0][2], logged


@pytest.mark.parametrize("case", [_sampled, _default_rate, _unused_layer, _static_graph, _comm_hook, _builtin_hook,
                                  _joined, _errors, _reducer_errors], ids=lambda f: f.__name__.strip("_"))
def test_logging_data_as_torch_ddp(ranks, case) -> None:
    ranks.run(case, world_size=2)
