"""Fused AMP step vs torch: unscale + inf check + grad-norm clip + fused AdamW step + scale
update over many parameters, fastddp.GradScaler vs torch.amp.GradScaler + clip_grad_norm_.

    pytest benchmarks/bench_amp.py -s

~100 M parameters in 300 tensors (CUDA), ~25 M in 300 tensors on the CPU (2 cores here).
Gradients are refilled from a template before every timed step (outside the timing).
"""

from __future__ import annotations

import json
import statistics
import time

import pytest
import torch
from torch import nn

import fastddp

from .common import SMOKE, record

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _setup(device: str, total: int, count: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    per = total // count
    params = [nn.Parameter(torch.randn(per, generator=g).to(device)) for _ in range(count)]
    grads = [torch.randn(per, generator=g).to(device) * 2.0**16 for _ in range(count)]
    return params, grads


def _time(fn, refill, device: str, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        refill()
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def _side(side: str, device: str, total: int, count: int):
    """One contender's parameters, optimizer and step (warmed up), and the refill of its
    gradients from the template."""
    params, template = _setup(device, total, count, seed=0)
    opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
    scaler = (fastddp.GradScaler if side == "fastddp" else torch.amp.GradScaler)(device)
    scaler.scale(torch.ones((), device=device))  # initialise the scale on the device

    def refill() -> None:
        for p, t in zip(params, template):
            if p.grad is None:
                p.grad = t.clone()
            else:
                p.grad.copy_(t)

    if side == "torch":
        def step() -> None:
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(params, 1.0)
            scaler.step(opt)
            scaler.update()
    else:
        def step() -> None:
            scaler.fused_step(opt, max_grad_norm=1.0)
            scaler.update()

    for _ in range(1 if SMOKE else 3):  # warm-up: optimizer state, allocator, kernels
        refill()
        step()
    return step, refill


def _copy_bandwidth(nbytes: int) -> float:
    """Device memory bandwidth in bytes/s: a device-to-device copy, bytes read plus written."""
    src = torch.empty(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 10 * 2 * nbytes / (time.perf_counter() - t0)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_unscale_clip_step(device: str) -> None:
    """Both contenders built once, then ``runs`` runs alternating between them, each the best
    of ``repeats`` steps; the speedup of every run is reported. On a GPU the fused step's
    least traffic (a gradient-norm pass reading each gradient, then AdamW reading parameter,
    gradient and both moments and writing three of them: 32 bytes a parameter) over its time
    is also given as a share of the measured copy bandwidth."""
    total = 300_000 if SMOKE else (100_000_000 if device == "cuda" else 25_000_000)
    count = 300
    runs, repeats = (1, 2) if SMOKE else ((10, 10) if device == "cuda" else (3, 5))
    sides = {side: _side(side, device, total, count) for side in ("torch", "fastddp")}
    times: dict[str, list[float]] = {side: [] for side in sides}
    for _ in range(runs):
        for side, (step, refill) in sides.items():
            times[side].append(_time(step, refill, device, repeats))
    speedups = [t / f for t, f in zip(times["torch"], times["fastddp"])]
    best = {side: min(v) for side, v in times.items()}
    result = {"device": device, "params": total, "tensors": count, "runs": runs,
              "repeats": repeats, "fastddp_ms": best["fastddp"] * 1e3,
              "torch_ms": best["torch"] * 1e3, "speedup": statistics.median(speedups),
              "speedup_min": min(speedups), "speedup_max": max(speedups),
              "runs_at_1_5x": sum(s >= 1.5 for s in speedups),
              "command": "pytest benchmarks/bench_amp.py -s"}
    if device == "cuda":
        bandwidth = _copy_bandwidth(1 << 30)
        result["copy_gb_s"] = bandwidth / 1e9
        result["fastddp_share_of_copy_bandwidth"] = 32 * total / best["fastddp"] / bandwidth
    print(json.dumps(result, indent=1))
    record("amp", f"{device}-{total // 10**6}M-{count}t", result)
