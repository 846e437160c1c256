"""Soak: 10,000 training steps keep resident memory flat, and loaders leave no threads (or
device memory) behind over 100 epochs of create/iterate/break. The 10,000-step runs are marked
``slow``: ``pytest tests/test_soak.py --run-slow`` runs them (CI leaves them out for time)."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fastddp
from fastddp import diag

PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _slope(points: list[tuple[int, int]]) -> float:
    """Least-squares slope of (step, bytes): bytes per step."""
    n = len(points)
    mx = sum(s for s, _ in points) / n
    my = sum(b for _, b in points) / n
    num = sum((s - mx) * (b - my) for s, b in points)
    den = sum((s - mx) ** 2 for s, _ in points)
    return num / den


def _soak(tmp_path: Path, steps: int) -> tuple[float, int]:
    """Train a small MLP for ``steps`` steps with all four pieces (DDPWrapper over gloo,
    GradScaler fused step with clipping, DistributedSampler, PrefetchLoader); returns the
    resident-memory slope after warm-up (bytes/step) and the growth from warm-up to the end."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        x = torch.randn(4096, 64)
        y = torch.randint(0, 4, (4096,))
        model = fastddp.DDPWrapper(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 4)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scaler = fastddp.GradScaler("cpu", init_scale=2.0**8)
        sampler = fastddp.DistributedSampler(4096, num_replicas=1, rank=0, seed=0)
        loader = fastddp.PrefetchLoader((x, y), batch_size=64, sampler=sampler, num_workers=2,
                                        drop_last=True)
        # Measured here: resident memory settles within ~2,000 steps (a one-time ~1 MiB step
        # with the gloo process group, then flat); the slope is fitted after that.
        warmup = 2_500
        points: list[tuple[int, int]] = []
        step, epoch = 0, 0
        while step < steps:
            loader.set_epoch(epoch)
            for bx, by in loader:
                opt.zero_grad(set_to_none=True)
                loss = nn.functional.cross_entropy(model(bx), by)
                scaler.scale(loss).backward()
                scaler.fused_step(opt, max_grad_norm=1.0, ddp=model)
                scaler.update()
                step += 1
                if step >= warmup and step % 50 == 0:
                    points.append((step, _rss()))
                if step >= steps:
                    break
            epoch += 1
        return _slope(points), points[-1][1] - points[0][1]
    finally:
        dist.destroy_process_group()


# A leak of one small tensor (a few hundred bytes) per step shows as a slope above this; the
# allocator's own noise on a flat run here is well under it.
MAX_SLOPE = 256.0  # bytes per step


@pytest.mark.slow
def test_memory_flat_over_10000_steps(tmp_path: Path) -> None:
    slope, growth = _soak(tmp_path, 10_000)
    print(f"RSS slope {slope:.1f} B/step, growth after warm-up {growth / 2**20:.2f} MiB")
    assert slope < MAX_SLOPE and growth < 4 * 2**20, (slope, growth)


def _shm_soak(rank: int, world_size: int, steps: int) -> tuple[float, int, int, int]:
    """Two CPU ranks, DDPWrapper on its shared-memory transport: resident memory over
    ``steps`` steps, and what 20 wrappers created, used and dropped leave behind (threads,
    mappings of /dev/shm segments)."""
    torch.manual_seed(0)
    diag.ensure_started()  # the process's one watchdog thread stays: not a wrapper's
    threads = _threads()
    for _ in range(20):
        m = fastddp.DDPWrapper(nn.Linear(16, 16))
        assert m.transport == "shm"
        m(torch.randn(2, 16)).sum().backward()
        del m
    gc.collect()
    with open("/proc/self/maps") as f:
        mappings = sum("/dev/shm/fastddp-" in line for line in f)
    extra_threads = _threads() - threads
    model = fastddp.DDPWrapper(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 4)))
    assert model.transport == "shm"
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(64, 64)
    warmup = 2_500
    points: list[tuple[int, int]] = []
    for step in range(1, steps + 1):
        opt.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        opt.step()
        if step >= warmup and step % 50 == 0:
            points.append((step, _rss()))
    return _slope(points), points[-1][1] - points[0][1], extra_threads, mappings


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_shared_memory_allreduce_flat_over_10000_steps() -> None:
    from .distributed import run_distributed

    for rank, (slope, growth, extra_threads, mappings) in enumerate(
            run_distributed(_shm_soak, world_size=2, args=(10_000,), timeout=600)):
        print(f"rank {rank}: RSS slope {slope:.1f} B/step, growth {growth / 2**20:.2f} MiB")
        assert slope < MAX_SLOPE and growth < 4 * 2**20, (rank, slope, growth)
        # every comm thread joined, every segment unmapped once its wrapper is gone
        assert extra_threads == 0 and mappings == 0, (rank, extra_threads, mappings)


def test_loader_threads_not_leaked_over_100_epochs() -> None:
    x = torch.randn(2000, 16)
    y = torch.arange(2000)
    baseline = _threads()
    for epoch in range(100):
        loader = fastddp.PrefetchLoader((x, y), batch_size=32, shuffle=True, seed=epoch,
                                        num_workers=3)
        for i, _batch in enumerate(loader):
            if i == epoch % 7:  # break at a different point each time
                break
        if epoch % 10 == 9:
            list(loader)  # and some complete passes
    gc.collect()
    assert _threads() == baseline


@pytest.mark.cuda
@pytest.mark.parametrize("pin", [False, True])
def test_cuda_loader_leaves_no_device_memory_or_threads(pin: bool) -> None:
    x = torch.randn(2000, 9, 128)
    y = torch.arange(2000)
    torch.cuda.synchronize()
    baseline_threads = _threads()
    for epoch in range(3):  # first passes: streams, events, allocator pools come to stay
        list(fastddp.PrefetchLoader((x, y), batch_size=64, shuffle=True, seed=epoch,
                                    device="cuda", pin_dataset=pin))
    torch.cuda.synchronize()
    baseline_mem = torch.cuda.memory_allocated()
    warm_threads = _threads()
    for epoch in range(100):
        loader = fastddp.PrefetchLoader((x, y), batch_size=64, shuffle=True, seed=epoch,
                                        device="cuda", pin_dataset=pin)
        for i, _batch in enumerate(loader):
            if i == epoch % 7:
                break
    del loader, _batch
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == baseline_mem
    # CUDA's own helper threads start once; ours are all joined
    assert _threads() == warm_threads and warm_threads >= baseline_threads


@pytest.mark.cuda
@pytest.mark.slow
def test_cuda_training_device_memory_flat_over_10000_steps(tmp_path: Path) -> None:
    """10,000 GPU steps (NCCL world 1, DDPWrapper, fp16 autocast + fused GradScaler step with
    clipping, fused AdamW, direct-path PrefetchLoader): allocated device memory is flat after
    warm-up."""
    torch.manual_seed(0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        x = torch.randn(4096, 64)
        y = torch.randint(0, 4, (4096,))
        net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 4)).cuda()
        model = fastddp.DDPWrapper(net, device_ids=[0])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        scaler = fastddp.GradScaler("cuda")
        loader = fastddp.PrefetchLoader((x, y), batch_size=64, shuffle=True, device="cuda",
                                        pin_dataset=True, drop_last=True)
        points: list[tuple[int, int]] = []
        step, epoch = 0, 0
        while step < 10_000:
            loader.set_epoch(epoch)
            for bx, by in loader:
                opt.zero_grad(set_to_none=True)
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = nn.functional.cross_entropy(model(bx).float(), by)
                scaler.scale(loss).backward()
                scaler.fused_step(opt, max_grad_norm=1.0, ddp=model)
                scaler.update()
                step += 1
                if step >= 1_000 and step % 100 == 0:
                    torch.cuda.synchronize()
                    points.append((step, torch.cuda.memory_allocated()))
                if step >= 10_000:
                    break
            epoch += 1
        slope = _slope(points)
        growth = points[-1][1] - points[0][1]
        print(f"device memory slope {slope:.2f} B/step, growth {growth} B")
        assert abs(slope) < 16 and growth <= 2**20, (slope, growth, points[:3], points[-3:])
    finally:
        dist.destroy_process_group()
