"""Does one bucket size serve every zoo model? DDPWrapper's step time at several
``bucket_cap_mb`` values, on two gloo ranks (CPU, fp32):

    pytest benchmarks/zoo/bench_buckets.py -s

Per model, one DDPWrapper per cap over the same weights, interleaved in rotated rounds (all
ranks start each block together); each cap's step time is paired within a round with the
default cap's (25 MB, as torch DDP). A ratio well below 1.0 for some cap on some model would
mean the default does not serve it (and a self-tuned size would). One progress line per model;
rows go to ``benchmarks/results/zoo_buckets.json``.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Callable

import pytest
import torch
from tests.distributed import run_distributed

import fastddp

from ..common import SMOKE, record
from .measure import Contender, Rounds, Schedule, interleave, new_model, other_load, step
from .models import NAMES, workload

CAPS_MB = (1.0, 4.0, 25.0, 100.0)
DEFAULT_MB = 25.0
SCHEDULE = Schedule(1, 1, 0.0) if SMOKE else Schedule(rounds=15, min_steps=4, block_s=0.3)
ROUNDS = SCHEDULE.rounds


def _wrapped(wl, cap_mb: float) -> Contender:
    model = fastddp.DDPWrapper(new_model(wl, torch.device("cpu")), bucket_cap_mb=cap_mb)
    return Contender(model, torch.optim.AdamW(model.parameters(), lr=1e-4), None)


def _time_caps(rank: int, world_size: int, name: str, scratch: str) -> Rounds:
    """Seconds per step of each cap, one figure per round."""
    cpu = torch.device("cpu")
    wl = workload(name, cpu, Path(scratch), SMOKE)
    contenders = {cap: _wrapped(wl, cap) for cap in CAPS_MB}
    for c in contenders.values():  # warm-up, including the bucket rebuild after step one
        for i in range(3):
            step(c, wl, wl.batch(i), "fp32", cpu)

    def prepare(cap: float, first: int, n: int) -> Callable[[], None]:
        batches = [wl.batch(first + i) for i in range(n)]
        return lambda: [step(contenders[cap], wl, b, "fp32", cpu) for b in batches]

    return interleave(CAPS_MB, prepare, SCHEDULE, cpu)


@pytest.mark.parametrize("name", [*NAMES, "mlp50m"])
def test_bucket_cap_cpu_gloo_world2(name: str, tmp_path: Path) -> None:
    if SMOKE and name != "har":
        pytest.skip("smoke run: the HAR model alone shows the path works")
    workload(name, torch.device("cpu"), tmp_path, SMOKE)  # writes the video clips once
    per_rank = run_distributed(_time_caps, 2, backend="gloo", timeout=3600,
                               args=(name, str(tmp_path)))
    # A step is as slow as its slowest rank: the per-round maximum over ranks.
    times = {cap: [max(r.times[cap][i] for r in per_rank) for i in range(ROUNDS)]
             for cap in CAPS_MB}
    row: dict = {"model": name, "precision": "fp32", "world_size": 2, "rounds": ROUNDS,
                 "steps_per_round": per_rank[0].steps, "other_load_cores": other_load(per_rank),
                 "default_cap_mb": DEFAULT_MB,
                 "command": "pytest benchmarks/zoo/bench_buckets.py -s"}
    line = []
    for cap in CAPS_MB:
        ratios = [a / b for a, b in zip(times[cap], times[DEFAULT_MB])]
        row[f"cap{cap:g}_step_ms"] = statistics.median(times[cap]) * 1e3
        row[f"cap{cap:g}_over_default"] = {"median": statistics.median(ratios),
                                           "min": min(ratios), "max": max(ratios)}
        line.append(f"{cap:g} MB {statistics.median(ratios):.3f}")
    print(f"\n[buckets] {name}: step time / default cap: " + ", ".join(line)
          + f" | other load {row['other_load_cores']:.2f} cores", flush=True)
    record("zoo_buckets", f"cpu-gloo-w2-{name}-fp32", row)
    assert all(t > 0 for ts in times.values() for t in ts)
