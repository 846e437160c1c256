"""The model zoo on two gloo ranks (CPU), and on a GPU machine NCCL world 1 and two ranks
sharing the GPU (gloo on CUDA tensors):

    pytest benchmarks/zoo -s                # CPU: every model x fp32 / bf16 / fp16
    pytest benchmarks/zoo -s -m cuda        # GPU

For each model and precision: step time of the bare model, the bare model synchronised once
per step (one 1-element all-reduce: the floor of any synchronous data-parallel step), torch
DDP and DDPWrapper, each in processes of its own (one model per process, as in a training
job), interleaved in rounds (one contender's ranks run a block while the others wait; ratios
paired within a round, median and spread over the rounds), and each contender's peak memory
in processes of its own. A 50 M-parameter MLP
(fp32) joins the zoo as the size at which a second copy of the gradients would show. One progress line per case; rows go to
``benchmarks/results/zoo.json`` and from there (``python benchmarks/report.py``) into
docs/benchmarks.md.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from tests.distributed import run_distributed

from ..common import SMOKE, record
from .measure import MEMORY, PRECISIONS, TIMED, Case, Schedule, other_load, peak_memory, time_rounds
from .models import NAMES, workload

# Rounds, and the least steps and seconds of one contender's block (its steps per block are
# set so the slowest contender's block lasts block_s; the fp16 rows' steps take 0.4-0.9 s).
SCHEDULE = Schedule(1, 1, 0.0) if SMOKE else Schedule(rounds=11, min_steps=4, block_s=0.3)
MEM_STEPS = 1 if SMOKE else 3
CASES = [pytest.param(n, p, id=f"{n}-{p}") for n in NAMES for p in PRECISIONS]
CASES.append(pytest.param("mlp50m", "fp32", id="mlp50m-fp32"))  # the memory reference


def _paired(times: dict[str, list[float]], num: str, den: str) -> dict[str, float]:
    """Median and spread of the per-round ratio ``num / den``."""
    ratios = [a / b for a, b in zip(times[num], times[den])]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def _per_round_max(per_rank: list) -> dict[str, list[float]]:
    """Each contender's step time per round: a step is as slow as its slowest rank."""
    return {k: [max(r.times[k][i] for r in per_rank if k in r.times)
                for i in range(len(next(r for r in per_rank if k in r.times).times[k]))]
            for k in TIMED}


def _spin(deadline: float) -> None:
    while time.time() < deadline:
        pass


@contextlib.contextmanager
def busy_neighbour(on: bool) -> Iterator[None]:
    """With ``on``, one more process spinning on a core while the body runs: another job, or a
    data-loading process, sharing the machine (it stops by itself after an hour at most)."""
    if not on:
        yield
        return
    proc = multiprocessing.get_context("spawn").Process(target=_spin, args=(time.time() + 3600,),
                                                        daemon=True)
    proc.start()
    try:
        yield
    finally:
        proc.kill()
        proc.join()


def _case(name: str, precision: str, device_type: str, world_size: int, backend: str,
          scratch: Path, neighbour: bool = False) -> dict:
    wl = workload(name, torch.device(device_type), scratch, SMOKE)  # writes the clips once
    if precision == "fp16" and not wl.fp16:
        pytest.skip(f"{name}: torch has no float16 kernel for this model on {device_type}")
    case = Case(name, precision, device_type, world_size, backend, str(scratch), SMOKE)
    # the barriers between blocks go over gloo; each contender's ranks reduce over `backend`
    with busy_neighbour(neighbour):
        per_rank = run_distributed(time_rounds, world_size * len(TIMED), backend="gloo",
                                   timeout=3600, args=(case, SCHEDULE))
    times = _per_round_max(per_rank)
    mem = {}
    for kind in MEMORY:
        peaks = run_distributed(peak_memory, world_size, backend=backend, timeout=1800,
                                args=(name, precision, kind, device_type, MEM_STEPS,
                                      str(scratch), SMOKE))
        mem[kind] = max(peaks) / 2**20
    row = {"model": name, "precision": precision, "world_size": world_size, "backend": backend,
           "device": device_type, "rounds": SCHEDULE.rounds, "steps_per_round": per_rank[0].steps,
           "other_load_cores": other_load(per_rank),
           **{f"{k}_step_ms": statistics.median(v) * 1e3 for k, v in times.items()},
           "fastddp_over_bare": _paired(times, "fastddp", "bare"),
           "fastddp_over_bare_sync": _paired(times, "fastddp", "bare_sync"),
           "fastddp_over_torch": _paired(times, "fastddp", "torch"),
           "torch_over_bare": _paired(times, "torch", "bare"),
           **{f"{k}_peak_mib": v for k, v in mem.items()},
           "command": "pytest benchmarks/zoo -s" + (" -m cuda" if device_type == "cuda" else "")}
    fb, fs, ft = row["fastddp_over_bare"], row["fastddp_over_bare_sync"], row["fastddp_over_torch"]
    print(f"\n[zoo] {name} {precision} {backend} w{world_size}: step ms bare "
          f"{row['bare_step_ms']:.1f} torch {row['torch_step_ms']:.1f} fastddp "
          f"{row['fastddp_step_ms']:.1f} | fastddp/bare {fb['median']:.3f} "
          f"[{fb['min']:.3f}, {fb['max']:.3f}] | fastddp/bare_sync {fs['median']:.3f} "
          f"[{fs['min']:.3f}, {fs['max']:.3f}] | fastddp/torch {ft['median']:.3f} "
          f"[{ft['min']:.3f}, {ft['max']:.3f}] | peak MiB "
          + " ".join(f"{k} {row[k + '_peak_mib']:.0f}" for k in MEMORY)
          + f" | {row['steps_per_round']} steps a block, other load {row['other_load_cores']:.2f} cores",
          flush=True)
    row["busy_neighbour"] = neighbour
    suffix = "-busy-neighbour" if neighbour else ""
    record("zoo", f"{device_type}-{backend}-w{world_size}-{name}-{precision}{suffix}", row)
    return row


@pytest.mark.parametrize("name,precision", CASES)
def test_zoo_cpu_gloo_world2(name: str, precision: str, tmp_path: Path) -> None:
    if SMOKE:
        pytest.skip("smoke run: test_zoo_smoke runs every model once")
    _case(name, precision, "cpu", 2, "gloo", tmp_path)


@pytest.mark.parametrize("name", ["har", "speech", "resnet18"])
def test_zoo_cpu_gloo_world2_busy_neighbour(name: str, tmp_path: Path) -> None:
    """The same with one more process spinning on one of the cores (fp32): a synchronous step
    waits for a rank the neighbour preempted, so this is where the ranks' waits must give the
    cores up rather than spin."""
    if SMOKE:
        pytest.skip("smoke run: the neighbour changes nothing that the smoke run checks")
    _case(name, "fp32", "cpu", 2, "gloo", tmp_path, neighbour=True)


# Each precision path at least once (CPU has no float16 LSTM, so speech runs bf16).
SMOKE_PLAN = {"resnet18": "fp16", "gpt2": "bf16", "speech": "bf16", "video3d": "fp32",
              "har": "fp16"}


def _smoke_rank(rank: int, world_size: int, scratch: str) -> dict:
    return {name: time_rounds(rank, world_size, Case(name, precision, "cpu", 2, "gloo", scratch,
                                                     smoke=True), SCHEDULE)
            for name, precision in SMOKE_PLAN.items()}


def _smoke_memory(rank: int, world_size: int, scratch: str) -> dict:
    return {kind: peak_memory(rank, world_size, "har", "fp16", kind, "cpu", 1, scratch, True)
            for kind in MEMORY}


@pytest.mark.skipif(not SMOKE, reason="the smoke run's quick pass; the full run measures each case")
def test_zoo_smoke(tmp_path: Path) -> None:
    """Every model, contender and precision path once (two ranks per contender, tiny batches)."""
    workload("video3d", torch.device("cpu"), tmp_path, smoke=True)  # the clips, written once
    per_rank = run_distributed(_smoke_rank, 2 * len(TIMED), args=(str(tmp_path),), timeout=900)
    for name in NAMES:
        times = _per_round_max([r[name] for r in per_rank])
        assert all(t[0] > 0 for t in times.values()), name
    memory = run_distributed(_smoke_memory, 2, args=(str(tmp_path),), timeout=900)[0]
    assert set(memory) == set(MEMORY)


@pytest.mark.cuda
@pytest.mark.parametrize("name,precision", CASES)
def test_zoo_gpu_nccl_world1(name: str, precision: str, tmp_path: Path) -> None:
    _case(name, precision, "cuda", 1, "nccl", tmp_path)


@pytest.mark.cuda
@pytest.mark.parametrize("name,precision", CASES)
def test_zoo_gpu_shared_gloo_world2(name: str, precision: str, tmp_path: Path) -> None:
    assert dist.is_gloo_available()
    _case(name, precision, "cuda", 2, "gloo", tmp_path)
