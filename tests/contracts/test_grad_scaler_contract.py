"""Contract: fastddp.GradScaler behaves as torch.amp.GradScaler (on CPU, in this process).

Each test runs one scenario with torch's class and with ours from the same seeds and compares
what a user can observe: scales, returned values, parameters and optimizer state, state_dicts,
exceptions (type and message) and the global RNG state afterwards.
"""

from __future__ import annotations

import copy
import inspect
import pickle
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import fastddp

INF, NAN = float("inf"), float("nan")


def _plain(value: Any) -> Any:
    """Tensors to (dtype, shape, values) and containers recursively, so == compares exactly."""
    if isinstance(value, torch.Tensor):
        v = value.detach()
        return ("tensor", v.dtype, tuple(v.shape), v.to_dense().tolist() if v.is_sparse else v.tolist())
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


def _outcome(fn: Callable[[type], Any], cls: type) -> tuple[str, Any, torch.Tensor]:
    torch.manual_seed(4321)
    try:
        result: tuple[str, Any] = ("ok", _plain(fn(cls)))
    except Exception as exc:  # the exception itself is what is compared
        result = ("raise", (type(exc), str(exc)))
    return result[0], result[1], torch.random.get_rng_state()


def _side_by_side(fn: Callable[[type], Any], same_message: bool = True) -> Any:
    """Run ``fn`` with both classes; the outcome, value (NaN-aware via repr) or exception
    type and message, and the RNG state afterwards must agree. Returns torch's value."""
    kind_t, val_t, rng_t = _outcome(fn, torch.amp.GradScaler)
    kind_o, val_o, rng_o = _outcome(fn, fastddp.GradScaler)
    assert kind_o == kind_t, (val_t, val_o)
    assert torch.equal(rng_o, rng_t), "the global RNG state differs after the same calls"
    if kind_t == "ok":
        assert repr(val_o) == repr(val_t)
    else:
        assert val_o[0] is val_t[0], (val_t, val_o)
        if same_message:
            assert val_t[1] in val_o[1], (val_t, val_o)
    return val_t


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)


def _train(cls: type, optim: Callable, steps: int = 8, poison: dict | None = None,
           unscale_clip: float | None = None, accumulate: int = 1, **scaler_kw: Any) -> list:
    """A training loop; ``poison`` maps step -> factor on the loss (inf/NaN skips the step)."""
    model = _model()
    opt = optim(model.parameters())
    scaler = cls("cpu", **{"init_scale": 2.0**6, "growth_interval": 2, **scaler_kw})
    seen: list = []
    for step in range(steps):
        opt.zero_grad()
        for micro in range(accumulate):
            x, y = _batch(step * accumulate + micro)
            loss = nn.functional.mse_loss(model(x), y) * (poison or {}).get(step, 1.0)
            scaler.scale(loss).backward()
        if unscale_clip is not None:
            scaler.unscale_(opt)
            seen.append(nn.utils.clip_grad_norm_(model.parameters(), unscale_clip))
        seen.append(scaler.step(opt))
        scaler.update()
        seen.append((scaler.get_scale(), scaler.state_dict()))
    return seen + [list(model.parameters()), opt.state_dict()["state"]]


OPTIMS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adam_foreach": lambda p: torch.optim.Adam(p, lr=1e-2, foreach=True),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
}


@pytest.mark.parametrize("optim", sorted(OPTIMS))
def test_training_with_skipped_steps(optim) -> None:
    _side_by_side(lambda cls: _train(cls, OPTIMS[optim], poison={2: INF, 5: NAN}))


@pytest.mark.parametrize("optim", sorted(OPTIMS))
def test_unscale_then_clip(optim) -> None:
    _side_by_side(lambda cls: _train(cls, OPTIMS[optim], poison={3: INF}, unscale_clip=0.05))


@pytest.mark.parametrize("optim", ["adamw_fused", "sgd_fused"])
@pytest.mark.parametrize("scale", [1000.0, 12345.0])
def test_scale_not_a_power_of_two(optim, scale) -> None:
    """A fused optimizer divides by the scale itself, as torch's scaler hands it: the
    reciprocal of float32(1 / scale) differs from a scale that is not a power of two in its
    last bit, and the parameters did too."""
    optims = {**OPTIMS, "sgd_fused": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True)}
    _side_by_side(lambda cls: _train(cls, optims[optim], steps=6, poison={3: INF}, init_scale=scale,
                                     growth_factor=3.0, backoff_factor=0.3))


def test_gradient_accumulation() -> None:
    _side_by_side(lambda cls: _train(cls, OPTIMS["sgd"], accumulate=3, poison={1: INF}))


@pytest.mark.parametrize("interval", [0, -1, 1, 3])
def test_growth_interval(interval) -> None:
    _side_by_side(lambda cls: _train(cls, OPTIMS["sgd"], steps=6, poison={4: INF}, growth_interval=interval))


def test_factors_and_setters() -> None:
    def run(cls):
        s = cls("cpu", init_scale=3.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=7)
        out = [s.get_scale(), s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval(),
               s.is_enabled(), s.state_dict()]
        s.set_growth_factor(8.0)
        s.set_backoff_factor(0.125)
        s.set_growth_interval(0)
        return out + [s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval(), s.state_dict()]

    _side_by_side(run)


def test_scale_of_nested_outputs() -> None:
    def run(cls):
        s = cls("cpu", init_scale=4.0)
        t = torch.tensor([1.0, 2.0])
        nested = s.scale([t, (t * 2, [t * 3])])
        return [s.scale(t), nested, type(nested), type(nested[1]), list(s.scale(iter([t, t])))]

    _side_by_side(run)


def test_scale_refuses_non_tensors() -> None:
    _side_by_side(lambda cls: cls("cpu").scale(3.0))


def _stepped(cls: type, opt_kind: str = "sgd"):
    model = _model()
    opt = OPTIMS[opt_kind](model.parameters())
    scaler = cls("cpu", init_scale=8.0)
    scaler.scale(model(torch.ones(2, 6)).sum()).backward()
    return scaler, opt, model


PROTOCOL_ERRORS = {
    "unscale_twice": lambda s, o: (s.unscale_(o), s.unscale_(o)),
    "unscale_after_step": lambda s, o: (s.step(o), s.unscale_(o)),
    "step_twice": lambda s, o: (s.step(o), s.step(o)),
    "closure": lambda s, o: s.step(o, closure=lambda: 0.0),
    "update_before_step": lambda s, o: s.update(),
    "new_scale_wrong_shape": lambda s, o: s.update(torch.ones(2)),
    "new_scale_requires_grad": lambda s, o: s.update(torch.ones(1, requires_grad=True)),
    "pickle_mid_iteration": lambda s, o: (s.step(o), pickle.dumps(s)),
    "load_empty_state": lambda s, o: s.load_state_dict({}),
}


@pytest.mark.parametrize("case", sorted(PROTOCOL_ERRORS))
def test_protocol_errors(case) -> None:
    def run(cls):
        scaler, opt, _ = _stepped(cls)
        PROTOCOL_ERRORS[case](scaler, opt)

    assert _side_by_side(run)[0] in (RuntimeError, AssertionError)


def test_unscale_before_scale() -> None:
    def run(cls):
        model = _model()
        opt = OPTIMS["sgd"](model.parameters())
        model(torch.ones(2, 6)).sum().backward()
        cls("cpu").unscale_(opt)

    assert _side_by_side(run)[0] is AssertionError


def test_step_without_gradients() -> None:
    def run(cls):
        scaler, _, _ = _stepped(cls)
        scaler.step(torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=1.0))

    assert _side_by_side(run)[0] is AssertionError


def test_step_without_gradients_leaves_unscale_done() -> None:
    """torch's step() runs unscale_() before it finds no check: a second unscale_() is refused."""
    def run(cls):
        scaler, _, _ = _stepped(cls)
        opt = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=1.0)
        with pytest.raises(AssertionError, match="No inf checks were recorded for this optimizer"):
            scaler.step(opt)
        scaler.unscale_(opt)

    assert _side_by_side(run)[0] is RuntimeError


@pytest.mark.parametrize("optim", sorted(OPTIMS))
@pytest.mark.parametrize("factor", [1.0, INF, NAN])
def test_step_after_unscale_and_cleared_gradients(optim, factor) -> None:
    """A step dropped after unscale_() (zero_grad(set_to_none=True) before step()): the
    optimizer steps without gradients, and update() goes by the check unscale_() recorded."""
    def run(cls):
        model = _model()
        opt = OPTIMS[optim](model.parameters())
        scaler = cls("cpu", init_scale=8.0, growth_interval=1)
        seen = []
        for step in range(3):
            x, y = _batch(step)
            scaler.scale(nn.functional.mse_loss(model(x), y) * (factor if step == 1 else 1.0)).backward()
            scaler.unscale_(opt)
            if step != 2:
                opt.zero_grad(set_to_none=True)
            seen += [scaler.step(opt), scaler.get_scale()]
            scaler.update()
            seen.append(scaler.get_scale())
            opt.zero_grad()
        return seen + [list(model.parameters()), opt.state_dict()["state"]]

    _side_by_side(run)


def test_float16_gradients_refused() -> None:
    def run(cls):
        p = nn.Parameter(torch.ones(3, dtype=torch.float16))
        opt = torch.optim.SGD([p], lr=1.0)
        scaler = cls("cpu")
        scaler.scale((p.float() * 2).sum()).backward()
        scaler.step(opt)

    assert _side_by_side(run)[0] is ValueError


def _steps_through(cls: type, opt_cls: type, *args: Any, **kwargs: Any) -> list:
    """Three steps of an ``opt_cls`` optimizer (the second skipped for an inf), ``args`` and
    ``kwargs`` passed through ``scaler.step``: what each step returned, then the parameters."""
    model = _model()
    opt = opt_cls(model.parameters(), lr=0.1)
    scaler = cls("cpu", init_scale=4.0)
    out = []
    for factor in (1.0, INF, 1.0):
        opt.zero_grad()
        scaler.scale(model(torch.ones(2, 6)).sum() * factor).backward()
        out.append(scaler.step(opt, *args, **kwargs))
        scaler.update()
    return out + [list(model.parameters())]


def test_step_forwards_arguments_and_returns_the_optimizers_value() -> None:
    class Recording(torch.optim.SGD):
        def step(self, *args, **kwargs):  # records what GradScaler passes on
            super().step()
            return ("stepped", args, kwargs)

    _side_by_side(lambda cls: _steps_through(cls, Recording, 1, flag=True))


@pytest.mark.parametrize("name", ["max_grad_norm", "grads", "ddp"])
def test_step_forwards_the_keywords_fused_step_takes(name) -> None:
    """step() passes every keyword to the optimizer, fused_step()'s names too, as torch's does."""
    class Taking(torch.optim.SGD):
        def step(self, closure=None, **kwargs):  # an optimizer with keywords of its own
            super().step(closure)
            return sorted(kwargs.items())

    _side_by_side(lambda cls: _steps_through(cls, Taking, **{name: 0.25}))


def test_step_keyword_the_optimizer_does_not_take_names_fused_step() -> None:
    """torch's step() hands max_grad_norm= to the optimizer, which raises TypeError; ours raises
    the same type before touching anything, naming fused_step()."""
    def run(cls):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = cls("cpu", init_scale=4.0)
        scaler.scale(model(torch.ones(2, 6)).sum()).backward()
        scaler.step(opt, max_grad_norm=1.0)

    _side_by_side(run, same_message=False)
    with pytest.raises(TypeError, match=r"scaler.fused_step\(optimizer, max_grad_norm=...\)"):
        run(fastddp.GradScaler)


def _logging_subclass(base: type, calls: list) -> type:
    class Logging(base):  # type: ignore[misc,valid-type]
        def unscale_(self, optimizer):
            calls.append("unscale_")
            return super().unscale_(optimizer)

        def _unscale_grads_(self, *args, **kwargs):
            calls.append("_unscale_grads_")
            return super()._unscale_grads_(*args, **kwargs)

        def _maybe_opt_step(self, *args, **kwargs):
            calls.append("_maybe_opt_step")
            return super()._maybe_opt_step(*args, **kwargs)

    return Logging


@pytest.mark.parametrize("optim", sorted(OPTIMS))
def test_subclass_overrides_are_called_as_by_torch(optim) -> None:
    """A subclass overriding the methods torch's step() calls (logging, or the found_inf
    all-reduce of a sharded scaler) sees the same calls, and trains the same."""
    def run(cls):
        calls: list = []
        out = _train(_logging_subclass(cls, calls), OPTIMS[optim], poison={2: INF}, unscale_clip=None)
        return out + [calls]

    calls = _side_by_side(run)[-1]
    assert calls, "torch's step() called none of the overridden methods"


def test_fused_step_extras_refused_for_an_overriding_subclass() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = _logging_subclass(fastddp.GradScaler, [])("cpu")
    scaler.scale(model(torch.ones(2, 6)).sum()).backward()
    with pytest.raises(TypeError, match="replaces unscale_, _unscale_grads_, _maybe_opt_step"):
        scaler.fused_step(opt, max_grad_norm=1.0)


def test_update_with_new_scale() -> None:
    def run(cls):
        scaler, opt, _ = _stepped(cls)
        scaler.step(opt)
        scaler.update(new_scale=2.5)
        first = scaler.get_scale()
        new = torch.tensor(7.0)
        scaler.update(new_scale=new)
        new.fill_(1.0)  # the scaler copied it
        return first, scaler.get_scale(), scaler.state_dict()

    _side_by_side(run)


def test_state_dict_round_trip_and_cross_loading() -> None:
    def run(cls):
        trained = _train(cls, OPTIMS["sgd"], steps=5, poison={1: INF})[-3][1]
        out = []
        for other in (torch.amp.GradScaler, fastddp.GradScaler):
            s = other("cpu")
            s.load_state_dict(trained)
            out.append(s.state_dict())
            s.scale(torch.ones(1))  # the loaded scale reaches the lazily created tensor
            out.append(s.get_scale())
        return trained, out

    _side_by_side(run)


def test_state_dict_before_first_scale() -> None:
    _side_by_side(lambda cls: cls("cpu", init_scale=32.0).state_dict())


def test_disabled() -> None:
    def run(cls):
        model = _model()
        opt = OPTIMS["sgd"](model.parameters())
        s = cls("cpu", enabled=False)
        loss = model(torch.ones(2, 6)).sum()
        scaled = s.scale(loss)
        scaled.backward()
        s.unscale_(opt)
        ret = s.step(opt)
        s.update()
        s.load_state_dict({})
        return [scaled is loss, ret, s.get_scale(), s.state_dict(), s.is_enabled(), list(model.parameters())]

    _side_by_side(run)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback when CUDA is absent")
def test_cuda_device_without_cuda_disables_with_a_warning() -> None:
    def run(cls):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            s = cls("cuda")
        # the warning names this line, the caller's (`filterwarnings(module=...)` matches it)
        return s.is_enabled(), [(w.category, str(w.message), w.filename) for w in caught]

    _side_by_side(run)


def test_pickle_and_deepcopy() -> None:
    def run(cls):
        trained_state = _train(cls, OPTIMS["sgd"], steps=3)[-3][1]
        s = cls("cpu")
        s.load_state_dict(trained_state)
        return [c.state_dict() for c in (pickle.loads(pickle.dumps(s)), copy.deepcopy(s))]

    _side_by_side(run)


def test_two_optimizers_one_scaler() -> None:
    def run(cls):
        torch.manual_seed(0)
        a, b = nn.Linear(4, 4), nn.Linear(4, 1)
        oa, ob = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.Adam(b.parameters(), lr=0.1)
        scaler = cls("cpu", init_scale=16.0, growth_interval=1)
        out = []
        for step in range(5):
            oa.zero_grad()
            ob.zero_grad()
            x = torch.full((3, 4), float(step + 1))
            scaler.scale(b(a(x)).sum() * (INF if step == 2 else 1.0)).backward()
            scaler.unscale_(oa)
            out.append(scaler.step(oa))
            out.append(scaler.step(ob))
            scaler.update()
            out.append(scaler.get_scale())
        return out + [list(a.parameters()), list(b.parameters())]

    _side_by_side(run)


def test_sparse_gradients() -> None:
    def run(cls):
        torch.manual_seed(0)
        emb = nn.Embedding(10, 3, sparse=True)
        opt = torch.optim.SGD(emb.parameters(), lr=0.5)
        scaler = cls("cpu", init_scale=8.0, growth_interval=1)
        out = []
        for step in range(4):
            opt.zero_grad()
            loss = emb(torch.tensor([1, 4, 4, step])).sum() * (INF if step == 1 else 1.0)
            scaler.scale(loss).backward()
            if step == 3:
                scaler.unscale_(opt)
            out.append(scaler.step(opt))
            scaler.update()
            out.append(scaler.get_scale())
        return out + [emb.weight]

    _side_by_side(run)


def test_same_constructor_signature() -> None:
    ours = inspect.signature(fastddp.GradScaler.__init__).parameters
    theirs = inspect.signature(torch.amp.GradScaler.__init__).parameters
    assert [(p.name, p.default, p.kind) for p in ours.values()] == \
        [(p.name, p.default, p.kind) for p in theirs.values()]
    assert issubclass(fastddp.GradScaler, torch.amp.GradScaler)
