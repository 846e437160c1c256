"""The model zoo on two gloo ranks (CPU), and on a GPU machine NCCL world 1 and two ranks
sharing the GPU (gloo on CUDA tensors):

    pytest benchmarks/zoo -s                # CPU: every model x fp32 / bf16 / fp16
    pytest benchmarks/zoo -s -m cuda        # GPU (FASTDDP_ZOO_MODELS=gpt2,har picks models)

For each model and precision: step time of the bare model, the bare model synchronised once
per step (one 1-element all-reduce: the floor of any synchronous data-parallel step), torch
DDP and DDPWrapper, each in processes of its own (one model per process, as in a training
job), interleaved in rounds (one contender's ranks run a block while the others wait; ratios
paired within a round, median and spread over the rounds), and each contender's peak memory
in processes of its own. On the CPU every case starts its own processes; on a GPU one set of
processes measures every case in turn (see :func:`_gpu_sweep`). A 50 M-parameter MLP (fp32)
joins the zoo as the size at which a second copy of the gradients would show. One progress
line per case; rows go to ``benchmarks/results/zoo.json`` and from there
(``python benchmarks/report.py``) into docs/benchmarks.md.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from tests.distributed import run_distributed

from ..common import SMOKE, median_interval, record
from .measure import (
    ALLOCATOR,
    MEMORY,
    PRECISIONS,
    TIMED,
    Case,
    Schedule,
    gpu_peak_memory_sweep,
    other_load,
    peak_memory,
    time_rounds,
)
from .models import NAMES, workload

# Rounds, and the least steps and seconds of one contender's block (its steps per block are
# set so the slowest contender's block lasts block_s). A round of four 0.3 s blocks lasts about
# 1.4 s: the millisecond models run 41 rounds in the minute, which narrows their medians'
# intervals about 2.4-fold over 11 (0.9 against 2.1 standard deviations of normally spread
# rounds; the rounds of one case spread by ±30 % on the 2-core VM);
# the slow ones keep 11. CPU float16 steps take 15 ms to 1.3 s, or seconds on a host whose
# float16 convolutions are slow (ResNet 4.4 s, 3D-CNN 3.9 s on 2026-11-26): two steps a block,
# not four, halve such a case's time (the ResNet case took 15 minutes with four).
SCHEDULE = (Schedule(1, 1, 0.0) if SMOKE else
            Schedule(rounds=11, min_steps=2, block_s=0.3, max_rounds=41, budget_s=60.0))
# Fewer rounds on a GPU (a lent GPU machine's time is short); blocks as long as on the CPU: with
# 0.1 s blocks a millisecond step's ratio to the bare model moved by ±25 % from round to round
# (the GPU idles while the other contenders run their blocks).
GPU_SCHEDULE = Schedule(1, 1, 0.0) if SMOKE else Schedule(rounds=7, min_steps=4, block_s=0.3)
MEM_STEPS = 1 if SMOKE else 3
# Sets of processes per CPU case, one after the other, their rounds pooled. Under glibc's
# defaults a process's allocation history decides whether a step page-faults its large
# temporaries again (docs/benchmarks.md, the zoo's notes), so one set's contenders can be
# luckier than another's; rounds within one set do not average that out, more sets do.
LAUNCHES = int(os.environ.get("FASTDDP_ZOO_LAUNCHES", "1"))
if LAUNCHES < 1:
    raise ValueError(f"FASTDDP_ZOO_LAUNCHES={LAUNCHES}: give 1 or more sets of processes per case")
CASES = [pytest.param(n, p, id=f"{n}-{p}") for n in NAMES for p in PRECISIONS]
CASES.append(pytest.param("mlp50m", "fp32", id="mlp50m-fp32"))  # the memory reference


def _paired(times: dict[str, list[float]], num: str, den: str) -> dict[str, float]:
    """Median and spread of the per-round ratio ``num / den``, and the median's 95 %
    distribution-free interval (``lo``, ``hi``: :func:`median_interval`)."""
    ratios = [a / b for a, b in zip(times[num], times[den])]
    lo, hi = median_interval(ratios)
    return {"median": statistics.median(ratios), "lo": lo, "hi": hi, "min": min(ratios),
            "max": max(ratios)}


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
    per_rank: list = []
    for _ in range(LAUNCHES):
        with busy_neighbour(neighbour):
            ranks = run_distributed(time_rounds, world_size * len(TIMED), backend="gloo",
                                    timeout=3600, args=(case, SCHEDULE))
        per_rank = [a.then(b) for a, b in zip(per_rank, ranks)] if per_rank else ranks
    mem = {}
    for kind in MEMORY:
        peaks = run_distributed(peak_memory, world_size, backend=backend, timeout=1800,
                                args=(name, precision, kind, device_type, MEM_STEPS,
                                      str(scratch), SMOKE))
        mem[kind] = max(peaks) / 2**20
    return _row(name, precision, device_type, world_size, backend, per_rank, mem, neighbour)


def _row(name: str, precision: str, device_type: str, world_size: int, backend: str,
         per_rank: list, mem: dict[str, float], neighbour: bool = False,
         progress: str = "") -> dict:
    """The zoo row of one case from every rank's timed rounds and each contender's peak MiB:
    printed as one progress line and recorded."""
    times = _per_round_max(per_rank)
    row = {"model": name, "precision": precision, "world_size": world_size, "backend": backend,
           "device": device_type, "rounds": len(times["bare"]), "steps_per_round": per_rank[0].steps,
           "other_load_cores": other_load(per_rank),
           **{f"{k}_step_ms": statistics.median(v) * 1e3 for k, v in times.items()},
           "fastddp_over_bare": _paired(times, "fastddp", "bare"),
           "fastddp_over_bare_sync": _paired(times, "fastddp", "bare_sync"),
           "fastddp_over_torch": _paired(times, "fastddp", "torch"),
           "torch_over_bare": _paired(times, "torch", "bare"),
           **{f"{k}_peak_mib": v for k, v in mem.items()},
           "command": "pytest benchmarks/zoo -s" + (" -m cuda" if device_type == "cuda" else "")}
    fb, fs, ft = row["fastddp_over_bare"], row["fastddp_over_bare_sync"], row["fastddp_over_torch"]
    print(f"\n[zoo{progress and ' ' + progress}] {name} {precision} {backend} w{world_size}: step ms bare "
          f"{row['bare_step_ms']:.1f} torch {row['torch_step_ms']:.1f} fastddp "
          f"{row['fastddp_step_ms']:.1f} | fastddp/bare {fb['median']:.3f} "
          f"[{fb['lo']:.3f}, {fb['hi']:.3f}] | fastddp/bare_sync {fs['median']:.3f} "
          f"[{fs['lo']:.3f}, {fs['hi']:.3f}] | fastddp/torch {ft['median']:.3f} "
          f"[{ft['lo']:.3f}, {ft['hi']:.3f}] | peak MiB "
          + " ".join(f"{k} {row[k + '_peak_mib']:.0f}" for k in MEMORY)
          + f" | {row['rounds']} rounds, {row['steps_per_round']} steps a block, [95 % interval of the"
          f" median], other load {row['other_load_cores']:.2f} cores"
          + (f", allocator {ALLOCATOR}" if device_type == "cpu" else ""),
          flush=True)
    row["busy_neighbour"] = neighbour
    suffix = "-busy-neighbour" if neighbour else ""
    if device_type == "cpu":
        row["allocator"] = ALLOCATOR
        if ALLOCATOR == "keep":
            suffix += "-keep-allocator"
            row["command"] = "FASTDDP_ZOO_ALLOCATOR=keep " + row["command"]
        row["launches"] = LAUNCHES
        if LAUNCHES > 1:
            suffix += f"-{LAUNCHES}-launches"
            row["command"] = f"FASTDDP_ZOO_LAUNCHES={LAUNCHES} " + row["command"]
    record("zoo", f"{device_type}-{backend}-w{world_size}-{name}-{precision}{suffix}", row)
    return row


# A slow CPU float16 case runs 4 contenders x 11 rounds x 2 steps, then the memory runs: 8
# minutes for the 3D-CNN's 3.9 s steps of 2026-11-26, near pytest-timeout's 600 s.
@pytest.mark.timeout(1800)
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


# Each precision path at least once (CPU has no float16 LSTM, so speech runs bf16; float16 on
# the GPT-2 and HAR models, whose CPU float16 steps are fast on every host seen, unlike the
# convolutions').
SMOKE_PLAN = {"resnet18": "fp32", "gpt2": "fp16", "speech": "bf16", "video3d": "fp32",
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


def _gpu_sweep_rank(rank: int, world_size: int, cases: list[tuple[str, str]], ranks: int,
                    backend: str, scratch: str, mem: dict[tuple[str, str], dict[str, float]]
                    ) -> None:
    """Every case timed in the same processes (``ranks`` per contender), rank 0 recording
    each row as soon as its rounds are gathered."""
    for i, (name, precision) in enumerate(cases):
        mine = time_rounds(rank, world_size, Case(name, precision, "cuda", ranks, backend,
                                                  scratch, SMOKE), GPU_SCHEDULE)
        gathered = [None] * world_size if rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        if rank == 0:
            _row(name, precision, "cuda", ranks, backend, gathered, mem[(name, precision)],
                 progress=f"{i + 1}/{len(cases)}")
        torch.cuda.empty_cache()


def _gpu_sweep(ranks: int, backend: str, scratch: Path, names: list[str]) -> None:
    """The zoo on the GPU, each contender on ``ranks`` processes reducing over ``backend``.
    Unlike the CPU cases (a process per contender and case, for a clean peak RSS), one set of
    processes measures every case in turn: starting a CUDA process (context, communicator,
    kernel libraries) takes seconds, longer than a case's rounds, and neither the allocator's
    peak nor a GPU step depends on the cases measured before in the same process."""
    device = torch.device("cuda")
    cases = [(n, p) for n in names for p in PRECISIONS
             if p != "fp16" or workload(n, device, scratch, SMOKE).fp16]
    if "mlp50m" in names:
        cases = [c for c in cases if c[0] != "mlp50m" or c[1] == "fp32"]
    per_rank = run_distributed(gpu_peak_memory_sweep, ranks * len(MEMORY), timeout=1800,
                               args=(cases, ranks, backend, MEM_STEPS, str(scratch), SMOKE))
    mem: dict[tuple[str, str], dict[str, float]] = {c: {} for c in cases}
    for peaks in per_rank:
        for c, (kind, nbytes) in peaks.items():
            mem[c][kind] = max(mem[c].get(kind, 0.0), nbytes / 2**20)
    run_distributed(_gpu_sweep_rank, ranks * len(TIMED), timeout=3600,
                    args=(cases, ranks, backend, str(scratch), mem))


def _gpu_models() -> list[str]:
    """The models of the GPU sweeps: ``FASTDDP_ZOO_MODELS`` (comma-separated), or all."""
    chosen = os.environ.get("FASTDDP_ZOO_MODELS")
    if not chosen:
        return [*NAMES, "mlp50m"]
    names = [n.strip() for n in chosen.split(",") if n.strip()]
    unknown = sorted(set(names) - {*NAMES, "mlp50m"})
    if unknown:
        raise ValueError(f"FASTDDP_ZOO_MODELS names unknown models {unknown}: choose among "
                         f"{', '.join(NAMES)}, mlp50m")
    return names


@pytest.mark.cuda
def test_zoo_gpu_nccl_world1(tmp_path: Path) -> None:
    _gpu_sweep(1, "nccl", tmp_path, _gpu_models())


@pytest.mark.cuda
def test_zoo_gpu_shared_gloo_world2(tmp_path: Path) -> None:
    assert dist.is_gloo_available()
    _gpu_sweep(2, "gloo", tmp_path, _gpu_models())
