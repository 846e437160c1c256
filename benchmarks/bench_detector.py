"""What the desync and hang detector costs: DDPWrapper step time with the detector on (the
default: stall watchdog running) and off (``FASTDDP_WATCHDOG=0``'s state: no watchdog thread),
in the same two gloo ranks, alternated in rounds; the ratio on/off of each round, and the median
and spread over the rounds.

    pytest benchmarks/bench_detector.py -s

The status board the reducer and the wrapper update (a relaxed atomic store at each phase
change) is part of both settings: it has no switch.
"""

from __future__ import annotations

import json
import statistics
import time

import pytest
import torch
import torch.distributed as dist
from tests.distributed import run_distributed

import fastddp
from fastddp import diag

from .bench_ddp import MODELS
from .common import SMOKE, record

ROUNDS = 2 if SMOKE else 8
STEPS = 2 if SMOKE else 15


def _rounds(rank: int, world_size: int, name: str) -> dict:
    torch.set_num_threads(1)
    factory, make_x = MODELS[name]
    torch.manual_seed(0)
    model = fastddp.DDPWrapper(factory())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = make_x()

    def step() -> float:
        t0 = time.perf_counter()
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        return time.perf_counter() - t0

    for _ in range(3):
        step()
    medians: dict[str, list[float]] = {"on": [], "off": []}
    for _ in range(ROUNDS):
        for setting in ("on", "off"):
            if setting == "on":
                diag.ensure_started()
            else:
                diag.stop()
            dist.barrier()
            medians[setting].append(statistics.median(step() for _ in range(STEPS)))
    diag.ensure_started()
    return medians


@pytest.mark.parametrize("name", list(MODELS))
def test_detector_overhead_cpu_world2(name: str) -> None:
    res = run_distributed(_rounds, world_size=2, args=(name,), timeout=900)[0]
    ratios = [on / off for on, off in zip(res["on"], res["off"])]
    result = {"model": name, "world_size": 2, "backend": "gloo", "rounds": len(ratios),
              "steps_per_round": STEPS, "on_step_ms": statistics.median(res["on"]) * 1e3,
              "off_step_ms": statistics.median(res["off"]) * 1e3,
              "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
              "command": "pytest benchmarks/bench_detector.py -s"}
    print(json.dumps(result, indent=1))
    record("detector", f"cpu-gloo-w2-{name}", result)
