"""Contract: DDPWrapper's constructor arguments as torch.nn.parallel.DistributedDataParallel
takes them, side by side in one gloo rank: device_ids / output_device on a CPU module (torch's
ValueError, or accepted with the attributes torch sets) and torch's FutureWarnings for its
deprecated arguments."""

from __future__ import annotations

import warnings
from decimal import Decimal
from typing import Any

import numpy as np
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


def _outcome(cls: type, kwargs: dict[str, Any]) -> tuple:
    """The exception type of wrapping ``_model()`` with ``kwargs``, or the attributes torch sets
    from them."""
    names = ("find_unused_parameters", "gradient_as_bucket_view", "static_graph", "forward_sync_buffers",
             "broadcast_buffers", "bucket_bytes_cap", "bucket_bytes_cap_list", "bucket_bytes_cap_default",
             "skip_all_reduce_unused_params", "batched_grad_copy")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            ddp = cls(_model(), **kwargs)
        except Exception as exc:  # the type is what is compared
            return (type(exc).__name__,)
    return ("ok",) + tuple(repr(getattr(ddp, n)) for n in names)


ODD_VALUES = [
    {"find_unused_parameters": None}, {"find_unused_parameters": "yes"}, {"find_unused_parameters": np.True_},
    {"gradient_as_bucket_view": "x"}, {"static_graph": "x"}, {"static_graph": []},
    {"broadcast_buffers": 0}, {"broadcast_buffers": 2}, {"forward_sync_buffers": "x"},
    {"forward_sync_buffers": torch.tensor(True)}, {"batched_grad_copy": "x"},
    {"skip_all_reduce_unused_params": None},
    {"bucket_cap_mb": Decimal("1.5")}, {"bucket_cap_mb": torch.tensor(1.5)}, {"bucket_cap_mb": -float("inf")},
    {"bucket_cap_mb": 1e300}, {"bucket_cap_mb": None}, {"bucket_cap_mb": True},
    {"bucket_cap_mb_list": "25"}, {"bucket_cap_mb_list": ["25"]}, {"bucket_cap_mb_list": [0]},
    {"bucket_cap_mb_list": [1, float("nan")]}, {"bucket_cap_mb_list": [1, float("inf")]},
    {"bucket_cap_mb_list": []}, {"bucket_cap_mb_list": [1, None]}, {"bucket_cap_mb_list": (Decimal("0.5"), 2)},
]


def _odd_values(rank: int, world_size: int, kwargs: dict[str, Any]) -> str:
    ref, ours = _outcome(TorchDDP, kwargs), _outcome(fastddp.DDPWrapper, kwargs)
    assert ours == ref, (kwargs, ref, ours)
    return ref[0]


@pytest.mark.parametrize("kwargs", ODD_VALUES, ids=lambda kw: ",".join(f"{k}={v!r}" for k, v in kw.items()))
def test_odd_argument_values_are_taken_or_refused_as_torch_does(ranks, kwargs) -> None:
    """Values torch DDP takes (None for a flag, a Decimal cap, a 0 entry in bucket_cap_mb_list)
    are taken, with the attributes torch sets; those it refuses (a string flag, a string cap, a
    cap beyond 64-bit bytes) raise torch's exception type."""
    assert ranks.run(_odd_values, world_size=1, args=(kwargs,))[0] in ("ok", "TypeError", "ValueError",
                                                                        "OverflowError")


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


def _without_trainable_parameters(kind: str) -> nn.Module:
    model = {"none": nn.ReLU(), "frozen": _model(), "ignored": _model()}[kind]
    if kind == "frozen":
        model.requires_grad_(False)
    if kind == "ignored":
        TorchDDP._set_params_and_buffers_to_ignore_for_model(model, [n for n, _ in model.named_parameters()])
    return model


def _no_trainable_parameter_errors(rank: int, world_size: int, kind: str) -> list[tuple[str, str]]:
    """What wrapping a module without a parameter to reduce raises: type and message."""
    found = []
    for cls in (TorchDDP, fastddp.DDPWrapper):
        try:
            cls(_without_trainable_parameters(kind))
            found.append(("ok", ""))
        except RuntimeError as exc:
            found.append(("RuntimeError", str(exc)))
    return found


@pytest.mark.parametrize("kind", ["none", "frozen", "ignored"])
def test_a_module_without_trainable_parameters_is_torchs_runtimeerror(ranks, kind) -> None:
    (ref, ours), = ranks.run(_no_trainable_parameter_errors, world_size=1, args=(kind,))
    assert ref[0] == ours[0] == "RuntimeError", (ref, ours)
    assert ours[1].startswith(ref[1] + " (DDPWrapper: "), (ref, ours)  # torch's sentence, then the fix


def _sync_batchnorm_errors(rank: int, world_size: int, training: bool) -> list[tuple]:
    """A CPU module with SyncBatchNorm layers, its weights different on each rank: what
    wrapping it (then one forward) raises, whether the message starts with torch's sentence, the
    FutureWarnings, and the weights the failed construction left (torch copies rank 0's
    before it refuses)."""
    found = []
    for cls in (TorchDDP, fastddp.DDPWrapper):
        model = nn.SyncBatchNorm.convert_sync_batchnorm(_model()).train(training)
        with torch.no_grad():
            model[0].weight.add_(rank)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                cls(model, broadcast_buffers=True)(torch.randn(4, 3))
                outcome = ("ok", False)
            except ValueError as exc:
                outcome = ("ValueError", str(exc).startswith("SyncBatchNorm layers only work with GPU modules"))
        warned = [str(w.message)[:40] for w in caught if w.category is FutureWarning]
        found.append((*outcome, warned, model[0].weight.detach().clone()))
    return found


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_sync_batchnorm_on_a_cpu_module_is_torchs_valueerror_at_construction(ranks, training) -> None:
    # in eval mode SyncBatchNorm itself would run on the CPU: only the wrapper refuses it
    results = ranks.run(_sync_batchnorm_errors, world_size=2, args=(training,))
    for ref, ours in results:
        assert ref[:2] == ours[:2] == ("ValueError", True), (ref[:2], ours[:2])
        assert ref[2] == ours[2] and len(ref[2]) == 1, (ref[2], ours[2])  # broadcast_buffers' FutureWarning
        assert torch.equal(ref[3], ours[3])
    assert torch.equal(results[1][1][3], results[0][1][3])  # rank 0's weights on every rank
