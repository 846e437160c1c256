"""Where a DDP step's time goes on one GPU: torch.profiler tables (host and device time) for
the bare model, DDPWrapper and torch DDP on the same model (NCCL, world size 1).

    python benchmarks/profile_ddp.py [--model mlp_10M|small_200] [--steps 10]

A diagnostic for the overhead numbers of bench_ddp.py; it records nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.profiler import ProfilerActivity, profile

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fastddp
from benchmarks.bench_ddp import MODELS
from fastddp._net import free_port


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="mlp_10M", choices=list(MODELS))
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1)
    factory, make_x = MODELS[args.model]
    x = make_x().cuda()
    for kind in ("bare", "fastddp", "torch"):
        torch.manual_seed(0)
        m = factory().cuda()
        if kind == "fastddp":
            m = fastddp.DDPWrapper(m, device_ids=[0])
        elif kind == "torch":
            m = TorchDDP(m, device_ids=[0])
        opt = torch.optim.SGD(m.parameters(), lr=1e-3)

        def step(m: torch.nn.Module = m, opt: torch.optim.Optimizer = opt) -> None:
            opt.zero_grad()
            m(x).pow(2).mean().backward()
            opt.step()

        for _ in range(10):
            step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        host = (time.perf_counter() - t0) / args.steps
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / args.steps
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                step()
            torch.cuda.synchronize()
        print(f"\n===== {kind}: host {host * 1e3:.3f} ms/step (launch), wall {wall * 1e3:.3f} ms/step")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=10))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
