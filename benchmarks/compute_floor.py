"""The compute floor of a HAR training step: what no data-parallel stack can beat.

Times the bare model's forward + backward + fused AdamW step on one resident batch (no data
loading, no communication, no logging), in ``--nproc`` concurrent processes with
``OMP_NUM_THREADS`` threads each, as the training processes share the machine. The
end-to-end benchmark divides ``nproc * batch`` by the median step to get the samples/s that
pure model compute allows, so its report can say which speed-up is reachable at all.

    python benchmarks/compute_floor.py --batch 64 --nproc 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def measure(mode: str, batch: int, steps: int, device: str) -> float:
    """Median seconds per training step of the bare model in this process."""
    import torch
    from torch import nn

    from fastddp.train.models import build_model

    torch.manual_seed(0)
    dev = torch.device(device)
    model = build_model(mode).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-2, fused=True)
    x = torch.randn(batch, 9, 128, device=dev)
    y = torch.randint(0, 6, (batch,), device=dev)
    loss_fn = nn.CrossEntropyLoss()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()

    for _ in range(10):
        step()
    times = []
    for _ in range(steps):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        step()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def floor(mode: str, batch: int, nproc: int, steps: int = 150, device: str = "cpu",
          threads: int | None = None) -> dict:
    """Runs ``nproc`` concurrent measuring processes (``threads`` intra-op threads each, default
    ``OMP_NUM_THREADS`` or 1); returns the slowest one's median step and the samples/s it allows
    for ``nproc * batch`` samples per step."""
    cmd = [sys.executable, __file__, "--worker", "--mode", mode, "--batch", str(batch),
           "--steps", str(steps), "--device", device]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads or os.environ.get("OMP_NUM_THREADS", "1")))
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env) for _ in range(nproc)]
    medians = []
    for p in procs:
        out, _ = p.communicate(timeout=600)
        if p.returncode != 0:
            raise RuntimeError(f"compute_floor worker failed with exit code {p.returncode}")
        medians.append(float(out.strip().splitlines()[-1]))
    step_s = max(medians)  # the ranks of a data-parallel step wait for the slowest
    return {"floor_step_ms": step_s * 1e3, "floor_samples_per_s": nproc * batch / step_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", default="flatten")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--device", default="cpu")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        import torch

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        print(measure(args.mode, args.batch, args.steps, args.device))
        return
    print(json.dumps(floor(args.mode, args.batch, args.nproc, args.steps, args.device)))


if __name__ == "__main__":
    main()
