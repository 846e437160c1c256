"""DistributedSampler: time and peak memory for one epoch of one rank's indices, vs torch.

    pytest benchmarks/bench_sampler.py -s

Each measurement runs in a fresh subprocess so its peak RSS (minus the RSS after imports) is
the memory that one call needed. torch's sampler is measured the way a loader uses it:
``list(sampler)`` (its randperm, ``.tolist()``, padding, striding and iteration). Ours:
``sampler.indices()`` (the int64 tensor the PrefetchLoader consumes).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from .common import SMOKE, record

SIZES = [100_000] if SMOKE else [10_000_000, 100_000_000]
REPLICAS = 8

_SCRIPT = textwrap.dedent("""
    import json, resource, sys, time
    import torch
    import fastddp
    from torch.utils.data.distributed import DistributedSampler as TorchSampler
    kind, n, replicas = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(torch.get_num_threads())
    def rss_kib():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize() // 1024
    # warm the code paths on a tiny case so lazy initialisation is not counted
    list(TorchSampler(range(10), num_replicas=2, rank=0)); fastddp.DistributedSampler(10, 2, 0).indices()
    base = rss_kib()
    t0 = time.perf_counter()
    if kind == "reference":
        s = TorchSampler(range(n), num_replicas=replicas, rank=1, shuffle=True, seed=0)
        s.set_epoch(1)
        out = list(s)
        count = len(out)
    else:
        s = fastddp.DistributedSampler(n, num_replicas=replicas, rank=1, shuffle=True, seed=0,
                                       order=kind)
        s.set_epoch(1)
        count = len(s.indices())
    dt = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"seconds": dt, "peak_mib": max(0, peak - base) / 1024, "count": count}))
""")


def _measure(kind: str, n: int) -> dict:
    out = subprocess.run([sys.executable, "-c", _SCRIPT, kind, str(n), str(REPLICAS)],
                         capture_output=True, text=True, check=True, timeout=1200)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("n", SIZES)
def test_sampler_epoch_indices(n: int) -> None:
    torch_r = _measure("reference", n)
    ours = {order: _measure(order, n) for order in ("torch", "stateless")}
    assert ours["torch"]["count"] == torch_r["count"] == ours["stateless"]["count"]
    result = {
        "n": n, "replicas": REPLICAS,
        "torch_s": torch_r["seconds"], "torch_peak_mib": torch_r["peak_mib"],
        "ours_torch_order_s": ours["torch"]["seconds"],
        "ours_torch_order_peak_mib": ours["torch"]["peak_mib"],
        "ours_stateless_s": ours["stateless"]["seconds"],
        "ours_stateless_peak_mib": ours["stateless"]["peak_mib"],
        "speedup_torch_order": torch_r["seconds"] / ours["torch"]["seconds"],
        "memory_ratio_torch_order": ours["torch"]["peak_mib"] / max(torch_r["peak_mib"], 1e-9),
        "speedup_stateless": torch_r["seconds"] / ours["stateless"]["seconds"],
        "command": "pytest benchmarks/bench_sampler.py -s",
    }
    print(json.dumps(result, indent=1))
    record("sampler", f"n{n}", result)
