"""Contract, the scaler's protocol with the code around it: what ``step()`` hands an optimizer
that unscales by itself (``grad_scale`` and ``found_inf``, tensors of their own), methods that
torch's ``step()`` calls patched on the class or on an instance, gradients that only torch's
code takes (strided with gaps, expanded), ``unscale_``'s signature and the ``enabled`` value
kept as given. Same harness as test_grad_scaler_contract."""

from __future__ import annotations

from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch

from .test_grad_scaler_contract import INF, _batch, _model, _side_by_side


class _UnscalesItself(torch.optim.SGD):
    """An optimizer of the ``_step_supports_amp_scaling`` protocol that divides by
    ``grad_scale`` and skips on ``found_inf`` in its own code, keeps both and then edits them in
    place: the scaler's scale and inf check must not change with them."""

    _step_supports_amp_scaling = True

    def step(self, closure: Any = None) -> Any:
        scale, found_inf = self.grad_scale, self.found_inf
        self.kept = (scale, found_inf)
        seen = (None if scale is None else (tuple(scale.shape), float(scale)), tuple(found_inf.shape),
                float(found_inf))
        if not found_inf.item():
            with torch.no_grad():
                for group in self.param_groups:
                    for p in group["params"]:
                        if p.grad is not None:
                            p.add_(p.grad / (1 if scale is None else scale), alpha=-group["lr"])
        if scale is not None:
            scale.reciprocal_()
        found_inf.zero_()
        return seen


@pytest.mark.parametrize("unscale_first", [False, True])
def test_an_optimizer_that_keeps_and_edits_grad_scale_and_found_inf(unscale_first) -> None:
    def run(cls):
        model = _model()
        opt = _UnscalesItself(model.parameters(), lr=0.1)
        scaler = cls("cpu", init_scale=8.0, growth_interval=1)
        out = []
        for step in range(3):
            opt.zero_grad()
            scaler.scale(model(torch.ones(2, 6)).sum() * (INF if step == 1 else 1.0)).backward()
            if unscale_first:
                scaler.unscale_(opt)
            out += [scaler.step(opt), scaler.get_scale()]
            scaler.update()
            out += [scaler.get_scale(), [float(t) for t in opt.kept]]
        return out + [list(model.parameters())]

    _side_by_side(run)


def _counting(owner: Any, name: str, calls: list[str]) -> Any:
    """A patch of ``owner.name`` (a class or an instance) that records its calls."""
    original = getattr(owner, name)
    if isinstance(owner, type):
        def patched(self, *args, **kwargs):
            calls.append(name)
            return original(self, *args, **kwargs)
    else:
        def patched(*args, **kwargs):
            calls.append(name)
            return original(*args, **kwargs)
    return mock.patch.object(owner, name, patched)


@pytest.mark.parametrize("on", ["instance", "class"])
@pytest.mark.parametrize("name", ["unscale_", "_unscale_grads_", "_maybe_opt_step"])
def test_a_step_method_patched_on_the_class_or_an_instance_is_called(name, on) -> None:
    # torch's step() calls unscale_, which calls _unscale_grads_, then _maybe_opt_step: a patch
    # of one (a test's mock, a library's instrumentation) sees every call torch's would.
    def run(cls):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = cls("cpu", init_scale=8.0)
        calls: list[str] = []
        with _counting(scaler if on == "instance" else cls, name, calls):
            for step in range(2):
                opt.zero_grad()
                scaler.scale(model(torch.ones(2, 6)).sum() * (INF if step == 1 else 1.0)).backward()
                scaler.step(opt)
                scaler.update()
        return [calls, scaler.get_scale(), list(model.parameters())]

    assert _side_by_side(run)[0] == [name, name]


def test_an_instance_override_that_skips_the_step() -> None:
    def run(cls):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = cls("cpu", init_scale=8.0)
        scaler._maybe_opt_step = lambda *args, **kwargs: None  # a step that is never taken
        scaler.scale(model(torch.ones(2, 6)).sum()).backward()
        out = [scaler.step(opt)]
        scaler.update()
        return out + [scaler.get_scale(), list(model.parameters())]

    _side_by_side(run)


@pytest.mark.parametrize("unscale_first", [False, True])
@pytest.mark.parametrize("layout", ["gaps", "expanded"])
def test_gradients_with_gaps_or_overlaps(layout, unscale_first) -> None:
    # torch unscales a strided view with gaps; an expanded gradient (stride 0) fails in torch's
    # in-place unscale, with its RuntimeError
    def run(cls):
        p = torch.nn.Parameter(torch.arange(12.0).reshape(4, 3))
        opt = torch.optim.SGD([p], lr=0.5)
        scaler = cls("cpu", init_scale=4.0)
        scaler.scale((p * p).sum())
        p.grad = (torch.full((4, 6), 8.0)[:, ::2] if layout == "gaps"
                  else torch.full((3,), 8.0).expand(4, 3))
        if unscale_first:
            scaler.unscale_(opt)
        out = [scaler.step(opt), p.grad.clone()]
        scaler.update()
        return out + [scaler.get_scale(), p.detach().clone()]

    _side_by_side(run)


def test_unscale_takes_the_optimizer_alone() -> None:
    def run(cls):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = cls("cpu", init_scale=8.0)
        scaler.scale(model(torch.ones(2, 6)).sum()).backward()
        scaler.unscale_(opt, [p.grad for p in model.parameters()])

    assert _side_by_side(run)[0] is TypeError


@pytest.mark.parametrize("enabled", [1, np.True_, 0], ids=["int", "numpy_bool", "zero"])
def test_enabled_is_kept_as_given(enabled) -> None:
    _side_by_side(lambda cls: [cls("cpu", enabled=enabled).is_enabled()])


def _flaky(base: type) -> type:
    """``base`` whose first step() raises (a transient error in the step, caught by the script)."""

    class Flaky(base):
        calls = 0

        def step(self, *args: Any, **kwargs: Any) -> Any:
            type(self).calls += 1
            if type(self).calls == 1:
                raise RuntimeError("transient")
            return super().step(*args, **kwargs)

    return Flaky


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("after", ["retry", "update", "skip"])
def test_an_optimizer_step_that_raises(fused: bool, after: str) -> None:
    """torch's step() records its inf check (and, for an optimizer that does not unscale by
    itself, the unscaled stage) before the optimizer steps, and leaves ``grad_scale`` and
    ``found_inf`` on a fused optimizer whose step raised: a retried step(), an update() in a
    ``finally:``, or the next batch after a skipped one see that state."""

    def run(cls):
        model = _model()
        opt = _flaky(torch.optim.SGD)(model.parameters(), lr=0.1, fused=fused)
        scaler = cls("cpu", init_scale=4.0, growth_interval=1)
        out = []
        for step in range(3):
            x, y = _batch(step)
            scaler.scale(((model(x) - y) ** 2).mean()).backward()
            try:
                out.append(scaler.step(opt))
            except RuntimeError as exc:
                out.append(str(exc))
                if after == "retry":
                    out.append(scaler.step(opt))
                elif after == "skip":
                    opt.zero_grad()
                    continue
            out.append(sorted(scaler._per_optimizer_states[id(opt)]))
            out.append([getattr(opt, name, None) for name in ("grad_scale", "found_inf")])
            scaler.update()
            out.append(scaler.get_scale())
            opt.zero_grad()
        return out + [list(model.parameters())]

    assert _side_by_side(run)[0] == "transient"


def test_a_scale_of_one_leaves_subnormal_gradients_under_flush_denormal() -> None:
    """torch's unscale kernel skips the multiply where the inverse scale is 1, so subnormal
    gradients keep their bits even with ``torch.set_flush_denormal(True)``."""
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        def run(cls):
            p = torch.nn.Parameter(torch.zeros(4))
            scaler = cls("cpu", init_scale=1.0)
            scaler.scale(torch.tensor(1.0))
            p.grad = torch.tensor([1, 1000, 0x7FFFFF, 0x3F800000], dtype=torch.int32).view(torch.float32)
            scaler.unscale_(torch.optim.SGD([p], lr=1.0))
            return p.grad.view(torch.int32).tolist()

        assert _side_by_side(run) == [1, 1000, 0x7FFFFF, 0x3F800000]
    finally:
        torch.set_flush_denormal(False)
