"""fastddp.GradScaler stepping a DDPWrapper (bucket statistics, Python hooks, channels_last,
random sequences of reduced and no_sync backwards) against torch DDP with torch's scaler."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from torch import nn

import fastddp
from tests.amp_common import _layout_model, _model


def _ddp_scaler_parity(rank: int, world_size: int, fused: bool, via: str = "ddp",
                       python_hook: bool = False, layouts: bool = False) -> tuple[int, bool]:
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    factory = _layout_model if layouts else _model
    ours_m, ref_m = factory("cpu"), factory("cpu")
    ours = fastddp.DDPWrapper(ours_m, bucket_cap_mb=0.002)
    ref = TorchDDP(ref_m)
    if python_hook:  # the statistics are then taken after the hook's result is in the bucket
        from .test_ddp_hooks import _mean_hook

        ours.register_comm_hook(None, _mean_hook)
        ref.register_comm_hook(None, _mean_hook)
    kw = {"lr": 1e-2, "weight_decay": 0.1}
    ours_o = torch.optim.AdamW(ours.parameters(), fused=fused, **kw)
    ref_o = torch.optim.AdamW(ref.parameters(), fused=fused, **kw)
    ours_s = fastddp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    ref_s = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    spy = _StatsSpy()
    g = torch.Generator().manual_seed(rank)
    for step in range(6):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        poison = float("inf") if (step == 3 and rank == 0) else 1.0
        for m, o, s in ((ours, ours_o, ours_s), (ref, ref_o, ref_s)):
            o.zero_grad()
            s.scale(nn.functional.mse_loss(m(x), y) * poison).backward()
        kw_step = {"ddp": ours} if via == "ddp" else {"grads": ours.bucket_buffers()}
        norm = ours_s.fused_step(ours_o, max_grad_norm=0.5, **kw_step)
        ref_s.unscale_(ref_o)
        ref_norm = nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_s.step(ref_o)
        ours_s.update()
        ref_s.update()
        assert ours_s.get_scale() == ref_s.get_scale(), step
        if step != 3:
            torch.testing.assert_close(norm, ref_norm)
        for a, b in zip(ours.parameters(), ref.parameters()):
            torch.testing.assert_close(a, b)
    return spy.hits, ours.bucket_report()["passthrough"]


class _StatsSpy:
    """Counts the reduced-bucket statistics the scaler actually consumed (in this rank's
    process, where it replaces fastddp.amp.stats.take_reduced_stats)."""

    def __init__(self) -> None:
        self.take = fastddp.amp.stats.take_reduced_stats
        self.hits = 0
        fastddp.amp.stats.take_reduced_stats = self

    def __call__(self, ddp):
        stats = self.take(ddp)
        self.hits += stats is not None
        return stats


@pytest.mark.parametrize("world_size", [1, 2])
def test_with_ddp_wrapper_and_a_python_comm_hook(world_size) -> None:
    from .distributed import run_distributed

    # a hook turns the passthrough of a world of one off: the buckets and their stats are used
    used = run_distributed(_ddp_scaler_parity, world_size=world_size, args=(False, "ddp", True))
    assert used == [(5, False)] * world_size


@pytest.mark.parametrize("world_size", [1, 2])
def test_with_ddp_wrapper_and_channels_last_gradients(world_size) -> None:
    """DDPWrapper's gradients keep channels_last/transposed layouts (views of the buckets, or
    autograd's own in a world of one) and the scaler takes them like torch's scaler does."""
    from .distributed import run_distributed

    used = run_distributed(_ddp_scaler_parity, world_size=world_size, args=(False, "ddp", False, True))
    assert [hits for hits, _ in used] == [0 if passthrough else 5 for _, passthrough in used]


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("fused", [False, True])
def test_with_ddp_wrapper_uses_bucket_stats(fused, world_size) -> None:
    from .distributed import run_distributed

    used = run_distributed(_ddp_scaler_parity, world_size=world_size, args=(fused,))
    if world_size == 1 and os.environ.get("FASTDDP_WORLD1_PASSTHROUGH", "1") != "0":
        # Nothing is reduced in a world of one: the gradients stay autograd's and the scaler
        # reads them instead of the (unused) buckets, with the same results.
        assert used == [(0, True)]
    else:
        # every backward after the first produced overlapped stats
        assert used == [(5, False)] * world_size


@pytest.mark.parametrize("world_size", [1, 2])
def test_grads_from_bucket_buffers(world_size) -> None:
    """grads=ddp.bucket_buffers() works in any world: the flat buckets, or in a world of one
    (nothing bucketed) the gradients themselves."""
    from .distributed import run_distributed

    used = run_distributed(_ddp_scaler_parity, world_size=world_size, args=(True, "grads"))
    assert [hits for hits, _ in used] == [0] * world_size


def _ddp_scaler_sequences(rank: int, world_size: int, fused: bool) -> list[str]:
    """Sequences (two written out, then random ones) of reduced backwards, no_sync backwards, injected infs, both zero_grad
    styles and steps with or without clipping: GradScaler.fused_step(ddp=...) (statistics taken
    while the buckets reduce) against torch DDP + torch's scaler + clip_grad_norm_, after every
    step. A backward after the last reduction (no_sync) makes the reduction's statistics stale,
    and a gradient made after zero_grad(set_to_none=True) lives outside the buckets: the scaler
    must then read the gradients themselves."""
    import random

    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    kinds = ["bwd", "bwd", "no_sync", "inf", "step", "step_clip", "zero", "zero_keep"]
    sequences = [
        # a no_sync backward after the reduction makes its statistics stale (the first step
        # switches the reducer's statistics on)
        (["bwd", "step", "bwd", "no_sync", "step_clip", "bwd", "no_sync", "step_clip"], True),
        # a gradient made after zero_grad(set_to_none=True), outside the buckets
        (["bwd", "step", "zero", "no_sync", "step_clip", "bwd", "step_clip"], True),
        (["bwd", "step", "zero", "no_sync", "inf", "step", "no_sync", "step_clip"], False),
    ] + [([random.Random(seed).choice(kinds) for _ in range(30)], seed % 2 == 0) for seed in range(3)]
    done = []
    for seed, (ops, as_view) in enumerate(sequences):
        ours_m, ref_m = _model("cpu"), _model("cpu")
        ours = fastddp.DDPWrapper(ours_m, bucket_cap_mb=0.002, gradient_as_bucket_view=as_view)
        ref = TorchDDP(ref_m, gradient_as_bucket_view=as_view)
        ours_o = torch.optim.AdamW(ours.parameters(), lr=1e-2, fused=fused)
        ref_o = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=fused)
        ours_s = fastddp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
        ref_s = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
        g = torch.Generator().manual_seed(rank)
        pending = False
        for i, op in enumerate(ops):
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            if op in ("bwd", "no_sync", "inf"):
                poison = float("inf") if op == "inf" and rank == 0 else 1.0
                for m, s in ((ours, ours_s), (ref, ref_s)):
                    with m.no_sync() if op == "no_sync" else contextlib.nullcontext():
                        s.scale(nn.functional.mse_loss(m(x), y) * poison).backward()
                pending = True
            elif op.startswith("step") and pending:
                clip = 0.5 if op == "step_clip" else None
                norm = ours_s.fused_step(ours_o, max_grad_norm=clip, ddp=ours)
                ref_s.unscale_(ref_o)
                ref_norm = nn.utils.clip_grad_norm_(ref.parameters(), clip) if clip else None
                ref_s.step(ref_o)
                ours_s.update()
                ref_s.update()
                assert ours_s.get_scale() == ref_s.get_scale(), (seed, i)
                if clip and torch.isfinite(ref_norm):
                    torch.testing.assert_close(norm, ref_norm, msg=lambda m, s=seed, i=i: f"seed {s} op {i}: {m}")
                for a, b in zip(ours.parameters(), ref.parameters()):
                    torch.testing.assert_close(a, b, msg=lambda m, s=seed, i=i: f"seed {s} op {i}: {m}")
                pending = False
            elif op.startswith("zero"):
                for o in (ours_o, ref_o):
                    o.zero_grad(set_to_none=op == "zero")
                pending = False
        done.append(f"sequence {seed}")
    return done


@pytest.mark.parametrize("fused", [False, True])
def test_with_ddp_wrapper_over_random_sequences(fused: bool) -> None:
    from .distributed import run_distributed

    assert run_distributed(_ddp_scaler_sequences, world_size=2, args=(fused,)) == [
        [f"sequence {s}" for s in range(6)]] * 2
