"""Projected multi-GPU scaling from one-device measurements (a model, not a measurement).

    python benchmarks/scaling.py --busbw 370 [--mode flatten] [--batch 512] [--gpus 2 4 8]

On one device we measure, for DDPWrapper's buckets, each bucket's size and the time in
backward at which its last gradient arrives (a world of 1, so nothing is communicated), plus
the forward, backward and optimizer times. For n GPUs each bucket's ring all-reduce is
modelled as ``2 (n-1)/n * S / busbw`` (S its bytes); a bucket starts when its gradients are
ready and the previous bucket is done (buckets go in order), so the step ends at
``max(backward end, last all-reduce end) + optimizer``. Efficiency = t(1) / t(n).

busbw: 370 GB/s is the figure used for H100 SXM NVLink all-reduce (NCCL bus bandwidth at
large messages on 8 GPUs, roughly 80 % of the 450 GB/s unidirectional NVLink 4 budget).
Results go to benchmarks/results/scaling.json for the report.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fastddp
from benchmarks.common import record
from fastddp.train.models import build_model


def measure(mode: str, batch: int, device: torch.device, steps: int = 20) -> dict:
    torch.manual_seed(0)
    model = fastddp.DDPWrapper(build_model(mode).to(device),
                               device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=device.type == "cuda")
    report = model.bucket_report()
    names = dict(model.module.named_parameters())
    bucket_of = report["param_to_bucket"]
    x = torch.randn(batch, 9, 128, device=device)
    y = torch.randint(0, 6, (batch,), device=device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    arrivals: dict[int, float] = {}
    t_back = [0.0]

    def hook(name):
        def fn(_p):
            sync()
            b = bucket_of[name]
            arrivals[b] = max(arrivals.get(b, 0.0), time.perf_counter() - t_back[0])
        return fn

    handles = [p.register_post_accumulate_grad_hook(hook(n)) for n, p in names.items() if p.requires_grad]
    fwd, bwd, opt_t, ready = [], [], [], []
    for i in range(steps + 3):
        opt.zero_grad()
        sync()
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        sync()
        t1 = time.perf_counter()
        arrivals.clear()
        t_back[0] = t1
        loss.backward()
        sync()
        t2 = time.perf_counter()
        opt.step()
        sync()
        t3 = time.perf_counter()
        if i >= 3:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
            opt_t.append(t3 - t2)
            ready.append([arrivals[b] for b in range(len(report["buckets"]))])
    for h in handles:
        h.remove()
    med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
    return {"forward_s": med(fwd), "backward_s": med(bwd), "optimizer_s": med(opt_t),
            "bucket_bytes": [b["bytes"] for b in report["buckets"]],
            "bucket_ready_s": [med([r[b] for r in ready]) for b in range(len(report["buckets"]))]}


def project(m: dict, gpus: list[int], busbw_gbs: float, latency_us: float) -> list[dict]:
    t1 = m["forward_s"] + m["backward_s"] + m["optimizer_s"]
    rows = []
    for n in gpus:
        done = 0.0
        comm = 0.0
        for size, ready in zip(m["bucket_bytes"], m["bucket_ready_s"]):
            cost = 2 * (n - 1) / n * size / (busbw_gbs * 1e9) + latency_us * 1e-6
            done = max(done, ready) + cost
            comm += cost
        step = m["forward_s"] + max(m["backward_s"], done) + m["optimizer_s"]
        rows.append({"gpus": n, "step_s": step, "comm_s": comm, "exposed_comm_s": step - t1,
                     "efficiency": t1 / step})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--busbw", type=float, default=370.0, help="all-reduce bus bandwidth, GB/s")
    p.add_argument("--latency-us", type=float, default=10.0, help="per all-reduce latency, µs")
    p.add_argument("--mode", default="flatten")
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--gpus", type=int, nargs="+", default=[1, 2, 4, 8])
    args = p.parse_args()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    try:
        m = measure(args.mode, args.batch, device)
    finally:
        dist.destroy_process_group()
    rows = project(m, args.gpus, args.busbw, args.latency_us)
    name = f"{device.type}-{args.mode}-b{args.batch}-busbw{args.busbw:g}"
    out = {"measured": m, "projection": rows, "busbw_gbs": args.busbw, "device": str(device),
           "gpus": [r["gpus"] for r in rows], "efficiency": [r["efficiency"] for r in rows],
           "command": f"python benchmarks/scaling.py --busbw {args.busbw:g} --mode {args.mode} --batch {args.batch}",
           "kind": "projection (model, not measurement)"}
    print(json.dumps(out, indent=1))
    record("scaling", name, out)


if __name__ == "__main__":
    main()
