"""Runs the multi-GPU projection of benchmarks/scaling.py (a model, not a measurement) on this
device and checks its bookkeeping; `python benchmarks/scaling.py` writes the reported numbers."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

from .common import SMOKE
from .scaling import measure, project


def test_projection_runs_and_is_consistent() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        m = measure("flatten", 64, torch.device("cpu"), steps=3 if SMOKE else 10)
    finally:
        dist.destroy_process_group()
    rows = project(m, [1, 2, 8], busbw_gbs=370.0, latency_us=10.0)
    assert rows[0]["gpus"] == 1
    assert abs(rows[0]["comm_s"] - len(m["bucket_bytes"]) * 10e-6) < 1e-12  # n=1: latency only
    assert all(0 < r["efficiency"] <= 1.0 for r in rows)
    assert rows[1]["comm_s"] < rows[2]["comm_s"]  # 2(n-1)/n grows with n
