"""What the desync and hang detector costs: DDPWrapper step time with the detector on (the
default: reduction fingerprints, stall watchdog running) and off (a wrapper built with
``FASTDDP_FINGERPRINT=0``, no watchdog thread), in the same two gloo ranks, alternated in
rounds; the ratio on/off of each round, and the median and spread over the rounds. Both
transports: shared memory (co-located ranks' default) and the gloo process group.

    pytest benchmarks/bench_detector.py -s

The status board the reducer and the wrapper update (a relaxed atomic store at each phase
change) is part of both settings: it has no switch.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from tests.distributed import run_distributed

import fastddp
from fastddp import diag

from .bench_ddp import MODELS
from .common import SMOKE, record

ROUNDS = 2 if SMOKE else 24
STEPS = 2 if SMOKE else 15


def _wrapper(factory: Any, shm: bool, fingerprint: bool) -> fastddp.DDPWrapper:
    os.environ["FASTDDP_FINGERPRINT"] = "1" if fingerprint else "0"  # read when the reducer is built
    try:
        torch.manual_seed(0)
        return fastddp.DDPWrapper(factory(), shm_allreduce=shm)
    finally:
        del os.environ["FASTDDP_FINGERPRINT"]


def _rounds(rank: int, world_size: int, name: str, shm: bool) -> dict:
    torch.set_num_threads(1)
    factory, make_x = MODELS[name]
    models = {"on": _wrapper(factory, shm, True), "off": _wrapper(factory, shm, False)}
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}
    x = make_x()

    def step(setting: str) -> float:
        t0 = time.perf_counter()
        opts[setting].zero_grad()
        models[setting](x).pow(2).mean().backward()
        opts[setting].step()
        return time.perf_counter() - t0

    for setting in models:
        for _ in range(3):
            step(setting)
    medians: dict[str, list[float]] = {"on": [], "off": []}
    for r in range(ROUNDS):
        for setting in (("on", "off") if r % 2 == 0 else ("off", "on")):  # both orders
            if setting == "on":
                diag.ensure_started()
            else:
                diag.stop()
            dist.barrier()
            medians[setting].append(statistics.median(step(setting) for _ in range(STEPS)))
    diag.ensure_started()
    return medians


@pytest.mark.parametrize("transport", ["shm", "gloo"])
@pytest.mark.parametrize("name", ["small_200"] if SMOKE else list(MODELS))  # smoke: the path works
def test_detector_overhead_cpu_world2(name: str, transport: str) -> None:
    res = run_distributed(_rounds, world_size=2, args=(name, transport == "shm"), timeout=900)[0]
    ratios = [on / off for on, off in zip(res["on"], res["off"])]
    result = {"model": name, "world_size": 2, "transport": transport, "rounds": len(ratios),
              "steps_per_round": STEPS, "on_step_ms": statistics.median(res["on"]) * 1e3,
              "off_step_ms": statistics.median(res["off"]) * 1e3,
              "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
              "command": "pytest benchmarks/bench_detector.py -s"}
    print(json.dumps(result, indent=1))
    record("detector", f"cpu-{transport}-w2-{name}", result)
