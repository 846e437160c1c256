"""Shared benchmark plumbing: smoke mode, machine facts, and JSON results for the report.

``FASTDDP_BENCH_SMOKE=1`` shrinks every size so CI can run the suite quickly without judging
speed. Each benchmark calls :func:`record` with its measured numbers; the JSON files under
``benchmarks/results/`` are what ``python benchmarks/report.py`` turns into docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

SMOKE = os.environ.get("FASTDDP_BENCH_SMOKE") == "1"
RESULTS_DIR = Path(os.environ.get("FASTDDP_BENCH_RESULTS", Path(__file__).parent / "results"))


def machine() -> dict[str, Any]:
    """Where a number was measured."""
    info: dict[str, Any] = {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def record(capability: str, name: str, values: dict[str, Any]) -> None:
    """Append one measurement to ``results/<capability>.json`` (skipped in smoke mode)."""
    if SMOKE:
        return
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{capability}.json"
    rows = json.loads(path.read_text()) if path.exists() else []
    rows = [r for r in rows if r.get("name") != name]
    rows.append({"name": name, "time": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(), **values})
    path.write_text(json.dumps(rows, indent=1))

