"""Contract: DDPWrapper's constructor arguments as torch.nn.parallel.DistributedDataParallel
takes them, side by side in one gloo rank: device_ids / output_device on a CPU module (torch's
ValueError, or accepted with the attributes torch sets) and torch's FutureWarnings for its
deprecated arguments."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastddp


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


def _built(cls: type, kwargs: dict[str, Any]) -> tuple:
    """What wrapping ``_model()`` gives: the exception type, or the device attributes; and
    the FutureWarnings raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            ddp = cls(_model(), **kwargs)
            result: Any = ("ok", ddp.device_ids, ddp.output_device)
        except ValueError as exc:
            result = ("ValueError", str(exc))
    return result, [str(w.message) for w in caught if w.category is FutureWarning]


DEVICE_ARGS = [
    {"device_ids": ["cpu"]}, {"device_ids": [torch.device("cpu")]}, {"output_device": "cpu"},
    {"device_ids": [0]}, {"device_ids": [0, 1]}, {"device_ids": []}, {"output_device": 0},
    {"device_ids": [], "output_device": None},
]


def _device_arguments(rank: int, world_size: int) -> list:
    out = []
    for kwargs in DEVICE_ARGS:
        (ref, _), (ours, _) = _built(TorchDDP, kwargs), _built(fastddp.DDPWrapper, kwargs)
        assert ours[0] == ref[0], (kwargs, ref, ours)
        if ref[0] == "ValueError":  # torch's message, then the fix
            assert ours[1].startswith(ref[1] + " (DDPWrapper: "), (ref, ours)
        if ref[0] == "ok":
            assert ours == ref, kwargs  # torch keeps None for a CPU module, whatever was given
        out.append(ref[0])
    return out


def test_device_ids_and_output_device_on_a_cpu_module(ranks) -> None:
    assert ranks.run(_device_arguments, world_size=1) == [["ValueError"] * 5 + ["ok"] * 3]


DEPRECATED = [
    {"broadcast_buffers": False}, {"broadcast_buffers": True}, {"broadcast_buffers": None},
    {"broadcast_buffers": False, "forward_sync_buffers": True}, {"check_reduction": True},
    {"forward_sync_buffers": False}, {},
]


def _deprecation_warnings(rank: int, world_size: int) -> list[int]:
    counts = []
    for kwargs in DEPRECATED:
        (_, ref), (_, ours) = _built(TorchDDP, kwargs), _built(fastddp.DDPWrapper, kwargs)
        assert ours == ref, kwargs
        counts.append(len(ref))
    return counts


def test_deprecated_arguments_warn_as_torch(ranks) -> None:
    assert ranks.run(_deprecation_warnings, world_size=1) == [[1, 1, 0, 1, 1, 0, 0]]


def _cap_error(rank: int, world_size: int, cap: float) -> list[str]:
    kinds = []
    for cls in (TorchDDP, fastddp.DDPWrapper):
        try:
            cls(_model(), bucket_cap_mb=cap)
            kinds.append("ok")
        except Exception as exc:  # the type is what is compared
            kinds.append(type(exc).__name__)
    return kinds


@pytest.mark.parametrize(("cap", "error"), [(float("inf"), "OverflowError"), (float("nan"), "ValueError")])
def test_non_finite_bucket_cap_mb_raises_torchs_exception_type(ranks, cap, error) -> None:
    assert ranks.run(_cap_error, world_size=1, args=(cap,)) == [[error, error]]


FLAGS = [{"static_graph": 1}, {"static_graph": 0}, {"find_unused_parameters": 1},
         {"gradient_as_bucket_view": 0}]


def _flag_attributes(rank: int, world_size: int, kwargs: dict[str, Any]) -> list[str]:
    names = ("static_graph", "find_unused_parameters", "gradient_as_bucket_view")
    ref, ours = TorchDDP(_model(), **kwargs), fastddp.DDPWrapper(_model(), **kwargs)
    assert [repr(getattr(ours, n)) for n in names] == [repr(getattr(ref, n)) for n in names], kwargs
    return [repr(getattr(ref, n)) for n in names]


@pytest.mark.parametrize("kwargs", FLAGS)
def test_flag_attributes_hold_what_torch_sets(ranks, kwargs) -> None:
    # torch sets static_graph to True/False itself and keeps the other flags as given
    assert len(ranks.run(_flag_attributes, world_size=1, args=(kwargs,))[0]) == 3


def _sync_batchnorm_errors(rank: int, world_size: int, training: bool) -> list[tuple[str, bool]]:
    """A CPU module with SyncBatchNorm layers: what wrapping it (then one forward) raises, and
    whether the message carries torch's sentence."""
    found = []
    for cls in (TorchDDP, fastddp.DDPWrapper):
        model = nn.SyncBatchNorm.convert_sync_batchnorm(_model()).train(training)
        try:
            cls(model)(torch.randn(4, 3))
            found.append(("ok", False))
        except ValueError as exc:
            found.append(("ValueError", "SyncBatchNorm layers only work with GPU modules" in str(exc)))
    return found


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_sync_batchnorm_on_a_cpu_module_is_torchs_valueerror_at_construction(ranks, training) -> None:
    # in eval mode SyncBatchNorm itself would run on the CPU: only the wrapper refuses it
    assert ranks.run(_sync_batchnorm_errors, world_size=2, args=(training,)) == [[("ValueError", True)] * 2] * 2
