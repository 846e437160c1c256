"""Fused AMP step vs torch: unscale + inf check + grad-norm clip + fused AdamW step + scale
update over many parameters, fastddp.GradScaler vs torch.amp.GradScaler + clip_grad_norm_.

    pytest benchmarks/bench_amp.py -s

~100 M parameters in 300 tensors (CUDA), ~25 M in 300 tensors on the CPU (2 cores here).
Gradients are refilled from a template before every timed step (outside the timing).
"""

from __future__ import annotations

import json
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


@pytest.mark.parametrize("device", DEVICES)
def test_fused_unscale_clip_step(device: str) -> None:
    total = 300_000 if SMOKE else (100_000_000 if device == "cuda" else 25_000_000)
    count = 300
    repeats = 2 if SMOKE else (30 if device == "cuda" else 5)
    results = {}
    for side in ("torch", "fastddp"):
        params, template = _setup(device, total, count, seed=0)
        opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
        scaler = (fastddp.GradScaler if side == "fastddp" else torch.amp.GradScaler)(device)
        scaler.scale(torch.ones((), device=device))  # initialise the scale on the device

        def refill(params=params, template=template) -> None:
            for p, t in zip(params, template):
                if p.grad is None:
                    p.grad = t.clone()
                else:
                    p.grad.copy_(t)

        if side == "torch":
            def step(opt=opt, scaler=scaler, params=params) -> None:
                scaler.unscale_(opt)
                nn.utils.clip_grad_norm_(params, 1.0)
                scaler.step(opt)
                scaler.update()
        else:
            def step(opt=opt, scaler=scaler) -> None:
                scaler.step(opt, max_grad_norm=1.0)
                scaler.update()

        for _ in range(1 if SMOKE else 3):  # warm-up: optimizer state, allocator, kernels
            refill()
            step()
        results[side] = _time(step, refill, device, repeats)
        del params, template, opt
    result = {"device": device, "params": total, "tensors": count,
              "fastddp_ms": results["fastddp"] * 1e3, "torch_ms": results["torch"] * 1e3,
              "speedup": results["torch"] / results["fastddp"],
              "command": "pytest benchmarks/bench_amp.py -s"}
    print(json.dumps(result, indent=1))
    record("amp", f"{device}-{total // 10**6}M-{count}t", result)
