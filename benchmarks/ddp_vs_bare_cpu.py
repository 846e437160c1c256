"""What DDPWrapper adds to a HAR training step on CPU ranks: an A/B inside one gloo run.

Two spawned ranks (``OMP_NUM_THREADS`` threads each) train the bare HAR model and the same model
under DDPWrapper in alternating blocks of 20 steps, so both variants see the same spells of
machine load; prints the median step of each, their ratio and DDPWrapper's forward / backward /
optimizer split. ``--profile`` adds torch.profiler's per-op table of 200 steps of each (rank 0).

    OMP_NUM_THREADS=1 python benchmarks/ddp_vs_bare_cpu.py --batch 32 64 [--profile]

A diagnostic for the end-to-end rows of docs/benchmarks.md; it records nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fastddp
from fastddp._net import free_port
from fastddp.train.models import build_model


def _rank(rank: int, world: int, port: int, batch: int, blocks: int, profile: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    bare, wrapped = build_model("flatten"), fastddp.DDPWrapper(build_model("flatten"))
    opts = {"bare": torch.optim.AdamW(bare.parameters(), lr=1e-3, fused=True),
            "ddp": torch.optim.AdamW(wrapped.parameters(), lr=1e-3, fused=True)}
    models = {"bare": bare, "ddp": wrapped}
    x, y = torch.randn(batch, 9, 128), torch.randint(0, 6, (batch,))
    loss_fn = nn.CrossEntropyLoss()
    steps: dict[str, list[float]] = {"bare": [], "ddp": []}
    phases: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": []}

    def step(kind: str) -> tuple[float, float, float]:
        t0 = time.perf_counter()
        opts[kind].zero_grad(set_to_none=True)
        loss = loss_fn(models[kind](x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opts[kind].step()
        return t1 - t0, t2 - t1, time.perf_counter() - t2

    for block in range(blocks):
        for kind in ("bare", "ddp"):
            times = [step(kind) for _ in range(20)]
            if block < 5:  # warm-up blocks
                continue
            steps[kind].append(statistics.median(sum(t) for t in times))
            if kind == "ddp":
                for name, i in (("forward", 0), ("backward", 1), ("optimizer", 2)):
                    phases[name].extend(t[i] for t in times)
    if rank == 0:
        b, d = statistics.median(steps["bare"]), statistics.median(steps["ddp"])
        split = " ".join(f"{k} {statistics.median(v) * 1e3:.2f}" for k, v in phases.items())
        print(f"batch {batch}: bare {b * 1e3:.2f} ms, DDPWrapper {d * 1e3:.2f} ms, ratio {d / b:.2f} "
              f"(DDPWrapper ms: {split})", flush=True)
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        for kind in ("bare", "ddp"):
            with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(200):
                    step(kind)
            if rank == 0:
                print(f"===== {kind}, batch {batch}, 200 steps")
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[32, 64], help="batch per rank")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--blocks", type=int, default=60, help="alternating 20-step blocks (5 warm up)")
    p.add_argument("--profile", action="store_true", help="also print torch.profiler tables")
    args = p.parse_args()
    if args.blocks <= 5:
        p.error(f"--blocks must be > 5 (the first 5 warm up), got {args.blocks}")
    import torch.multiprocessing as mp

    for batch in args.batch:
        mp.spawn(_rank, args=(args.world, free_port(), batch, args.blocks, args.profile), nprocs=args.world)


if __name__ == "__main__":
    main()
