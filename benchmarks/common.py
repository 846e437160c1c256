"""Shared benchmark plumbing: smoke mode, machine facts, and JSON results for the report.

``FASTDDP_BENCH_SMOKE=1`` shrinks every size so CI can run the suite quickly without judging
speed. Each benchmark calls :func:`record` with its measured numbers; the JSON files under
``benchmarks/results/`` are what ``python benchmarks/report.py`` turns into docs/benchmarks.md.
"""

from __future__ import annotations

import json
import math
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
    info.update(_cpu_model())
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def _cpu_model() -> dict[str, str]:
    """The host CPU's family and model, and the features that change the zoo's steps (on a VM
    the brand string is generic, and the same VM ran on hosts whose float16 steps differed
    several times over): empty where /proc/cpuinfo does not say."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    if "cpu family" not in fields or "model" not in fields:
        return {}
    flags = set(fields.get("flags", "").split())
    notable = [f for f in ("avx512f", "avx512_bf16", "avx512_fp16", "amx_tile") if f in flags]
    return {"cpu_model": f"family {fields['cpu family']} model {fields['model']}",
            "cpu_features": " ".join(notable)}


def median_interval(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """A distribution-free confidence interval for the median of ``values``: the order
    statistics ``k`` and ``n + 1 - k``, ``k`` the largest with a binomial(n, 1/2) tail below
    ``k`` of at most ``(1 - level) / 2`` (11 values: the 2nd and 10th, 98.8 %; 41 values: the
    14th and 28th, 97.2 %). Fewer than 6 values cannot reach 95 %: the whole range."""
    xs, n = sorted(values), len(values)
    if n == 0:
        raise ValueError("median_interval needs at least one value")
    tail, k = 0.0, 0
    while k < n // 2:
        tail += math.comb(n, k) / 2**n  # P(Binomial(n, 1/2) <= k)
        if tail > (1 - level) / 2:
            break
        k += 1
    k = max(k, 1)
    return xs[k - 1], xs[n - k]


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

