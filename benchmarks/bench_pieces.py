"""pytest-benchmark views of the pieces that run in one process: every case runs once with
torch's piece and once with fastddp's, in one benchmark group, so pytest-benchmark's table puts
the two side by side in the same run, each column with its ratio to the faster in parentheses.

    pytest benchmarks/bench_pieces.py --benchmark-group-by=group --benchmark-columns=min,median,rounds

These are quick, repeatable microbenchmarks (more rounds, statistics from pytest-benchmark).
The numbers tabled in docs/benchmarks.md — at the issue's sizes, with peak memory and the
multi-process cases — come from the other ``bench_*.py`` files, which record JSON for the report.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler as TorchSampler

import fastddp

from .common import SMOKE

IMPLS = ["torch", "fastddp"]


@pytest.mark.parametrize("impl", IMPLS)
def test_sampler_epoch(benchmark, impl: str) -> None:
    """One rank's shuffled indices of one epoch (8 replicas), as a loader consumes them."""
    n = 10_000 if SMOKE else 2_000_000
    benchmark.group = f"sampler: one epoch of {n:,} items, 8 replicas"

    def run() -> int:
        if impl == "torch":
            s = TorchSampler(range(n), num_replicas=8, rank=1, shuffle=True, seed=0)
            s.set_epoch(1)
            return len(list(s))
        ours = fastddp.DistributedSampler(n, num_replicas=8, rank=1, shuffle=True, seed=0)
        ours.set_epoch(1)
        return len(ours.indices())

    assert benchmark.pedantic(run, rounds=3 if SMOKE else 10, warmup_rounds=1) == -(-n // 8)


@pytest.mark.parametrize("impl", IMPLS)
def test_amp_unscale_clip_step(benchmark, impl: str) -> None:
    """Unscale + inf check + clip to norm 1 + fused AdamW + scale update (CPU), gradients
    refilled before every round outside the timing."""
    total, count = (30_000, 30) if SMOKE else (4_000_000, 100)
    benchmark.group = f"amp: unscale + clip + AdamW step, {total:,} params in {count} tensors"
    g = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(total // count, generator=g)) for _ in range(count)]
    template = [torch.randn(total // count, generator=g) * 2.0**16 for _ in range(count)]
    opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
    scaler = (fastddp.GradScaler if impl == "fastddp" else torch.amp.GradScaler)("cpu")
    scaler.scale(torch.ones(()))  # the scale tensor exists before the first round

    def refill() -> None:
        for p, t in zip(params, template):
            p.grad = t.clone()

    def step() -> None:
        if impl == "torch":
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(params, 1.0)
            scaler.step(opt)
        else:
            scaler.fused_step(opt, max_grad_norm=1.0)
        scaler.update()

    before = [p.detach().clone() for p in params]
    benchmark.pedantic(step, setup=refill, rounds=3 if SMOKE else 30, warmup_rounds=2)
    assert all(not torch.equal(a, p) for a, p in zip(before, params))  # the steps were taken


@pytest.mark.parametrize("impl", IMPLS)
def test_loader_epoch(benchmark, impl: str) -> None:
    """One shuffled epoch of HAR-sized windows (7352 x 9 x 128 float32) at batch 64 on the CPU:
    DataLoader with 2 persistent workers vs PrefetchLoader with 2 gather threads."""
    n = 512 if SMOKE else 7352
    benchmark.group = f"loader: one shuffled epoch, {n} x 9 x 128 float32, batch 64"
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(n, 9, 128, generator=g), torch.randint(0, 6, (n,), generator=g))
    if impl == "torch":
        loader = DataLoader(ds, batch_size=64, shuffle=True, num_workers=2, persistent_workers=True,
                            pin_memory=False)
    else:
        loader = fastddp.PrefetchLoader(ds, batch_size=64, shuffle=True, num_workers=2, pin_memory=False)

    def epoch() -> int:
        return sum(len(y) for _, y in loader)

    # warm-up round: DataLoader starts its persistent worker processes there
    assert benchmark.pedantic(epoch, rounds=2 if SMOKE else 10, warmup_rounds=1) == n
