"""fastddp.GradScaler against torch.amp.GradScaler (+ clip_grad_norm_), step by step."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

import fastddp
from fastddp._ext import C
from tests.amp_common import _layout_model, _model, _optim

from .conftest import devices


def _run(device: str, opt_kind: str, clip: float | None, explicit_unscale: bool, factory=_model):
    ours_m, ref_m = factory(device), factory(device)
    ours_o, ref_o = _optim(opt_kind, ours_m.parameters(), device), _optim(opt_kind, ref_m.parameters(), device)
    kw = {"init_scale": 2.0**10, "growth_interval": 3}
    ours_s, ref_s = fastddp.GradScaler(device, **kw), torch.amp.GradScaler(device, **kw)
    g = torch.Generator().manual_seed(1)
    scales = []
    for step in range(12):
        x = torch.randn(8, 16, generator=g).to(device)
        y = torch.randn(8, 4, generator=g).to(device)
        for m, o, s in ((ours_m, ours_o, ours_s), (ref_m, ref_o, ref_s)):
            o.zero_grad()
            loss = nn.functional.mse_loss(m(x), y)
            s.scale(loss).backward()
            if step in (4, 9):  # inject an inf / a NaN into one gradient
                m[2].weight.grad[0, 0] = float("inf") if step == 4 else float("nan")
        if explicit_unscale:
            ours_s.unscale_(ours_o)
        ours_norm = ours_s.fused_step(ours_o, max_grad_norm=clip)
        ref_s.unscale_(ref_o)
        ref_norm = nn.utils.clip_grad_norm_(ref_m.parameters(), clip) if clip else None
        ref_s.step(ref_o)
        ours_s.update()
        ref_s.update()
        assert ours_s.get_scale() == ref_s.get_scale(), step
        scales.append(ours_s.get_scale())
        assert ours_s._get_growth_tracker() == ref_s._get_growth_tracker(), step
        if clip and step not in (4, 9):
            torch.testing.assert_close(ours_norm, ref_norm)
        elif clip:  # skipped step: inf, where clip_grad_norm_ says nan for the NaN (step's docstring)
            assert float(ours_norm) == float("inf"), (step, ours_norm)
            assert float(ref_norm) == float("inf") if step == 4 else ref_norm.isnan(), (step, ref_norm)
        for a, b in zip(ours_m.parameters(), ref_m.parameters()):
            torch.testing.assert_close(a, b)
    # clean steps grew the scale and the injected infs backed it off
    assert any(b > a for a, b in zip(scales, scales[1:]))
    assert any(b < a for a, b in zip(scales, scales[1:]))
    return ours_s, ref_s


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("opt_kind", ["adamw", "adamw_fused", "sgd"])
@pytest.mark.parametrize("clip", [None, 0.5])
def test_matches_torch_scaler(device, opt_kind, clip) -> None:
    _run(device, opt_kind, clip, explicit_unscale=False)


@pytest.mark.parametrize("device", devices())
def test_explicit_unscale_then_step(device) -> None:
    _run(device, "adamw", 0.5, explicit_unscale=True)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("opt_kind", ["adamw", "sgd"])
def test_channels_last_and_transposed_gradients(device, opt_kind) -> None:
    """Dense gradients in any layout are unscaled, checked and clipped in place like torch's
    scaler does them (they were refused as "not contiguous")."""
    m = _layout_model(device)
    assert not m[2].weight.is_contiguous() and not m[4].weight.is_contiguous()
    _run(device, opt_kind, 0.5, explicit_unscale=False, factory=_layout_model)
    _run(device, opt_kind, None, explicit_unscale=True, factory=_layout_model)


def test_gradient_with_gaps_refused_by_the_fused_clip() -> None:
    # step() and unscale_() hand such a gradient to torch's code (tests/contracts); fused_step's
    # clip works on dense gradients in place and says so
    m, o, s = _one_step_setup()
    m[0].weight.grad = torch.zeros(32, 32)[:, ::2]  # right shape, strides (32, 2): gaps
    with pytest.raises(TypeError, match=r"strides \(32, 2\), which leave gaps or overlap: torch's scaler code"):
        s.fused_step(o, max_grad_norm=1.0)


def test_state_dict_round_trips_with_torch() -> None:
    ours, ref = _run("cpu", "sgd", None, explicit_unscale=False)
    sd = ours.state_dict()
    assert set(sd) == set(ref.state_dict())
    assert sd == ref.state_dict()
    loaded_into_torch = torch.amp.GradScaler("cpu")
    loaded_into_torch.load_state_dict(sd)
    loaded_into_ours = fastddp.GradScaler("cpu")
    loaded_into_ours.load_state_dict(ref.state_dict())
    for s in (loaded_into_torch, loaded_into_ours):
        s.scale(torch.ones(()))
        assert s.get_scale() == ref.get_scale()
        assert s._get_growth_tracker() == ref._get_growth_tracker()


def _one_step_setup():
    m = _model("cpu")
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    s = fastddp.GradScaler("cpu")
    s.scale(m(torch.randn(2, 16)).sum()).backward()
    return m, o, s


def test_unscale_twice_is_an_error() -> None:
    _, o, s = _one_step_setup()
    s.unscale_(o)
    with pytest.raises(RuntimeError, match="unscale_\\(\\) has already been called"):
        s.unscale_(o)


def test_step_twice_and_unscale_after_step_are_errors() -> None:
    _, o, s = _one_step_setup()
    s.step(o)
    with pytest.raises(RuntimeError, match="step\\(\\) has already been called"):
        s.step(o)
    with pytest.raises(RuntimeError, match="unscale_\\(\\) is being called after step\\(\\)"):
        s.unscale_(o)


@pytest.mark.parametrize("bad", [0.0, -1.0])
def test_bad_max_grad_norm(bad) -> None:
    _, o, s = _one_step_setup()
    with pytest.raises(ValueError, match="max_grad_norm must be > 0"):
        s.fused_step(o, max_grad_norm=bad)


def test_mixed_devices_rejected() -> None:
    _, o, s = _one_step_setup()
    grads = [torch.zeros(3), torch.zeros(3, device="meta")]
    with pytest.raises(ValueError, match="several devices"):
        s.fused_step(o, grads=grads)


@pytest.mark.parametrize("opt", ["sgd", "adamw_fused"])
def test_disabled_scaler_clips_like_clip_grad_norm(opt) -> None:
    # SGD: the clip coefficient multiplies the gradients; fused AdamW: it is handed to the
    # optimizer as grad_scale instead. Both must match clip_grad_norm_ + step, gradients too.
    def make(m):
        if opt == "sgd":
            return torch.optim.SGD(m.parameters(), lr=0.1)
        return torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.1, fused=True)

    ours_m, ref_m = _model("cpu"), _model("cpu")
    ours_o, ref_o = make(ours_m), make(ref_m)
    s = fastddp.GradScaler("cpu", enabled=False)
    for _ in range(3):
        x = torch.randn(4, 16)
        for m, o in ((ours_m, ours_o), (ref_m, ref_o)):
            o.zero_grad()
            (m(x) ** 2).sum().mul(100).backward()
        norm = s.fused_step(ours_o, max_grad_norm=1.0)
        ref_norm = nn.utils.clip_grad_norm_(ref_m.parameters(), 1.0)
        ref_o.step()
        assert float(ref_norm) > 1.0  # the clip is active
        torch.testing.assert_close(norm, ref_norm)
        for a, b in zip(ours_m.parameters(), ref_m.parameters()):
            torch.testing.assert_close(a.grad, b.grad)
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kernels_on_many_tensors_and_dtypes(device, dtype) -> None:
    g = torch.Generator().manual_seed(0)
    # sizes around the chunk size and a count beyond one launch's tensor list
    sizes = [1, 7, 65536, 65537, 200_000] + [33] * 60
    grads = [torch.randn(n, generator=g).to(device=device, dtype=dtype) for n in sizes]
    stats = torch.zeros(1, dtype=torch.float64, device=device)
    C.amp_accumulate_stats_(grads, stats)
    ref = sum(float(t.double().pow(2).sum()) for t in grads)
    assert float(stats) == pytest.approx(ref, rel=1e-9)
    scale = torch.full((1,), 4.0, device=device)
    found, norm, coef, inv = C.amp_finalize(stats, scale, 2.0, 1e-6)
    ref_norm = ref ** 0.5 / 4.0
    assert float(found) == 0.0 and float(norm) == pytest.approx(ref_norm, rel=1e-6)
    assert float(coef) == pytest.approx(0.25 * 2.0 / (ref_norm + 1e-6), rel=1e-6)
    assert float(inv) == pytest.approx(1 / float(coef), rel=1e-6)
    before = [t.clone() for t in grads]
    C.amp_scale_(grads, coef)
    for a, b in zip(grads, before):
        torch.testing.assert_close(a, (b.float() * float(coef)).to(dtype))
    grads[-1][3] = float("nan")
    stats.zero_()
    C.amp_accumulate_stats_(grads, stats)
    found, *_ = C.amp_finalize(stats, scale, 2.0, 1e-6)
    assert float(found) == 1.0


@pytest.mark.cuda
def test_fused_step_makes_no_host_sync() -> None:
    m = _model("cuda")
    o = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)
    s = fastddp.GradScaler("cuda")
    x = torch.randn(8, 16, device="cuda")
    for _ in range(3):  # warm up lazily initialised state first
        o.zero_grad()
        s.scale(m(x).sum()).backward()
        s.fused_step(o, max_grad_norm=1.0)
        s.update()
    o.zero_grad()
    s.scale(m(x).sum()).backward()
    torch.cuda.set_sync_debug_mode("error")
    try:
        s.fused_step(o, max_grad_norm=1.0)
        s.update()
    finally:
        torch.cuda.set_sync_debug_mode(0)


def _gan_like(scaler_cls) -> tuple[list, list[torch.Tensor]]:
    """Two optimizers sharing one scaler (a GAN's pattern): the critic's step clips after an
    explicit unscale_, the generator's does not; an inf in the critic's loss at step 3 and a
    NaN in the generator's at step 5 each skip their own step and back the shared scale off."""
    torch.manual_seed(0)
    gen_m, critic = nn.Linear(8, 8), nn.Linear(8, 1)
    opt_g = torch.optim.Adam(gen_m.parameters(), lr=1e-2)
    opt_c = torch.optim.SGD(critic.parameters(), lr=1e-2, momentum=0.9)
    scaler = scaler_cls("cpu", init_scale=2.0**8, growth_interval=2)
    seen: list = []
    g = torch.Generator().manual_seed(1)
    for step in range(8):
        x = torch.randn(4, 8, generator=g)
        opt_c.zero_grad()
        opt_g.zero_grad()
        scaler.scale(critic(gen_m(x).detach()).mean() * (float("inf") if step == 3 else 1.0)).backward()
        scaler.unscale_(opt_c)
        seen.append(float(nn.utils.clip_grad_norm_(critic.parameters(), 0.1)))
        scaler.step(opt_c)
        scaler.scale(-critic(gen_m(x)).mean() * (float("nan") if step == 5 else 1.0)).backward()
        scaler.step(opt_g)
        scaler.update()
        seen.append(scaler.get_scale())
    # the rest of torch's scaler API on the same object
    seen.append(copy.deepcopy(scaler).get_scale())
    seen.append(pickle.loads(pickle.dumps(scaler)).state_dict() == scaler.state_dict())
    scaler.set_growth_factor(3.0)
    scaler.set_backoff_factor(0.25)
    scaler.set_growth_interval(5)
    seen += [scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval()]
    scaler.update(new_scale=128.0)
    seen.append(scaler.get_scale())
    scaler.update(new_scale=torch.tensor(64.0))
    seen.append(scaler.get_scale())
    return seen, [p.detach().clone() for p in list(gen_m.parameters()) + list(critic.parameters())]


def test_two_optimizers_share_one_scaler_like_torch() -> None:
    ours, ours_params = _gan_like(fastddp.GradScaler)
    ref, ref_params = _gan_like(torch.amp.GradScaler)
    assert [x for x in ours if x == x] == [x for x in ref if x == x]  # the NaN norm at step 5 aside
    scales = ref[1:16:2]  # after each of the 8 steps
    assert any(b < a for a, b in zip(scales, scales[1:])) and any(b > a for a, b in zip(scales, scales[1:]))
    for a, b in zip(ours_params, ref_params):
        torch.testing.assert_close(a, b)


def test_float16_gradients_are_refused_like_torch() -> None:
    """torch's scaler refuses to unscale float16 gradients (float16 parameters), in unscale_ and
    in step; ours the same way, with torch's message first and the fix after it."""
    for scaler_cls in (torch.amp.GradScaler, fastddp.GradScaler):
        for explicit_unscale in (False, True):
            m = nn.Linear(4, 4).half()
            o = torch.optim.SGD(m.parameters(), lr=0.1)
            s = scaler_cls("cpu")
            s.scale(m(torch.randn(2, 4).half()).float().sum()).backward()
            with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
                s.unscale_(o) if explicit_unscale else s.step(o)
    # bfloat16 gradients are taken, by both
    for scaler_cls in (torch.amp.GradScaler, fastddp.GradScaler):
        m = nn.Linear(4, 4).bfloat16()
        o = torch.optim.SGD(m.parameters(), lr=0.1)
        s = scaler_cls("cpu")
        s.scale(m(torch.randn(2, 4).bfloat16()).float().sum()).backward()
        s.step(o)
        s.update()


@pytest.mark.parametrize("calls", ["step", "unscale_,step", "unscale_,update"])
def test_no_gradients_fail_like_torch(calls: str) -> None:
    """scale() ran but no parameter has a gradient (backward forgotten): the same assertion
    as torch's scaler, at the same call."""
    failures = []
    for scaler_cls in (torch.amp.GradScaler, fastddp.GradScaler):
        o = torch.optim.SGD(nn.Linear(4, 4).parameters(), lr=0.1)
        s = scaler_cls("cpu")
        s.scale(torch.ones(()))
        with pytest.raises(AssertionError) as info:
            for call in calls.split(","):
                getattr(s, call)() if call == "update" else getattr(s, call)(o)
        failures.append((call, str(info.value)))
    assert failures[0] == failures[1] and "No inf checks were recorded" in failures[0][1]


def _scale_history(scaler_cls, growth_interval: int, later_interval=None) -> list:
    """Scale and growth tracker after each of 6 steps (an inf at step 2); ``later_interval``
    is set with set_growth_interval after step 3."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = scaler_cls("cpu", init_scale=8.0, growth_interval=growth_interval)
    seen = []
    for step in range(6):
        opt.zero_grad()
        scaler.scale(model(torch.ones(3, 4)).sum() * (float("inf") if step == 2 else 1.0)).backward()
        scaler.step(opt)
        scaler.update()
        seen.append((scaler.get_scale(), scaler.state_dict()["_growth_tracker"]))
        if step == 3 and later_interval is not None:
            scaler.set_growth_interval(later_interval)
    return seen


@pytest.mark.parametrize(("interval", "later"), [(0, None), (-3, None), (1, 0), (0, 1)])
def test_growth_interval_not_positive_as_torch(interval, later) -> None:
    # torch accepts growth_interval <= 0: the scale then never grows, only backs off.
    ours = _scale_history(fastddp.GradScaler, interval, later)
    assert ours == _scale_history(torch.amp.GradScaler, interval, later)
    assert ours[2][0] == ours[1][0] / 2


@pytest.mark.parametrize("bad", [2.5, "3", True])
def test_growth_interval_not_an_integer_refused(bad) -> None:
    with pytest.raises(TypeError, match="growth_interval must be an integer"):
        fastddp.GradScaler("cpu", growth_interval=bad)
    with pytest.raises(TypeError, match="growth_interval must be an integer"):
        fastddp.GradScaler("cpu").set_growth_interval(bad)


def test_sparse_gradients_with_fused_clip_refused() -> None:
    # torch's scaler handles sparse gradients (and the plain step here hands them to its code);
    # the fused clip of fused_step(max_grad_norm=) works on dense gradients only, and says so.
    emb = nn.Embedding(10, 3, sparse=True)
    opt = torch.optim.SGD(emb.parameters(), lr=0.5)
    scaler = fastddp.GradScaler("cpu")
    scaler.scale(emb(torch.tensor([1, 2])).sum()).backward()
    with pytest.raises(TypeError, match=r"sparse gradients .* clip them with torch.nn.utils.clip_grad_norm_"):
        scaler.fused_step(opt, max_grad_norm=1.0)
    scaler.step(opt)
    scaler.update()


def _fp16_fused_run(scaler_cls: type, max_grad_norm: float | None = None) -> tuple:
    torch.manual_seed(0)
    m = nn.Linear(4, 4).half()
    o = torch.optim.AdamW(m.parameters(), lr=0.1, fused=True)
    s = scaler_cls("cpu", init_scale=2.0**14, growth_interval=1)
    for step in range(3):
        x = torch.randn(2, 4).half() * (1e4 if step == 1 else 1)  # step 1 overflows: skipped
        o.zero_grad()
        s.scale(m(x).float().square().sum()).backward()
        s.step(o) if max_grad_norm is None else s.fused_step(o, max_grad_norm=max_grad_norm)
        s.update()
    return [p.detach().clone() for p in m.parameters()], s.get_scale()


def test_float16_gradients_step_a_fused_optimizer_like_torch() -> None:
    """A fused optimizer unscales float16 gradients in its own kernel: torch's scaler checks
    them (inf/NaN) in step() without refusing float16, and ours trains the same parameters and
    scale, also with max_grad_norm (the overflow skipped, the scale backed off and grown).
    unscale_() still refuses them, as torch's does."""
    (ref, ref_scale), (ours, scale) = _fp16_fused_run(torch.amp.GradScaler), _fp16_fused_run(fastddp.GradScaler)
    assert scale == ref_scale == 2.0**15  # grown, backed off (the overflow), grown
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)
    _, clipped_scale = _fp16_fused_run(fastddp.GradScaler, max_grad_norm=0.5)
    assert clipped_scale == ref_scale
    m = nn.Linear(4, 4).half()
    s = fastddp.GradScaler("cpu")
    s.scale(m(torch.randn(2, 4).half()).float().sum()).backward()
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        s.unscale_(torch.optim.AdamW(m.parameters(), fused=True))
