"""How much of a zoo model's data-parallel overhead any synchronous step pays: the bare model on
two CPU ranks free-running, synchronised once per step by a gloo 1-element all-reduce (the zoo's
``bare_sync``) and by a spin barrier in shared memory (the cheapest wait there is: no system
call, no sleeping thread to wake), against torch DDP and DDPWrapper, all in one pair of processes.

    python benchmarks/zoo/sync_floor.py har [--precision fp32] [--steps 100] [--rounds 10]

The contenders run in rotated rounds, ``--steps`` steps each, every block started after a
barrier; a block's time is the slower rank's. Prints, per contender, the median block step time
and the median over rounds of its ratio to the free-running bare model in the same round, with
the range. The zoo (bench_zoo.py) gives each contender its own processes; here they share one
pair, so every contender sees the same allocator and cache history. A diagnostic; it records
nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.zoo.measure import PRECISIONS, build, new_model, step
from benchmarks.zoo.models import workload

CONTENDERS = ("bare", "bare_sync", "bare_spin", "torch", "fastddp")


def spin_barrier(path: Path, rank: int) -> Callable[[], None]:
    """A two-rank barrier on a shared mapping: each rank publishes its arrival count and spins
    until the peer's reaches it."""
    counts = torch.from_file(str(path), shared=True, size=2, dtype=torch.int64)
    arrived = 0

    def wait() -> None:
        nonlocal arrived
        arrived += 1
        counts[rank] = arrived
        while int(counts[1 - rank]) < arrived:
            pass

    return wait


def _rank(rank: int, args: argparse.Namespace, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{args.scratch}/pg", rank=rank, world_size=2)
    try:
        device = torch.device("cpu")
        wl = workload(args.model, device, Path(args.scratch))
        contenders = {}
        for kind in CONTENDERS:
            c = build("bare" if kind == "bare_spin" else kind, new_model(wl, device), device, args.precision)
            if kind == "bare_spin":
                c.sync = spin_barrier(Path(args.scratch) / "spin", rank)
            contenders[kind] = c
        for c in contenders.values():  # warm-up
            for i in range(3):
                step(c, wl, wl.batch(i), args.precision, device)
        blocks: dict[str, list[float]] = {k: [] for k in CONTENDERS}
        for r in range(args.rounds):
            for kind in CONTENDERS[r % len(CONTENDERS):] + CONTENDERS[:r % len(CONTENDERS)]:
                dist.barrier()
                t0 = time.perf_counter()
                for i in range(args.steps):
                    step(contenders[kind], wl, wl.batch(i), args.precision, device)
                blocks[kind].append((time.perf_counter() - t0) / args.steps)
        mine = torch.tensor([blocks[k] for k in CONTENDERS], dtype=torch.float64)
        both = [torch.empty_like(mine) for _ in range(2)]
        dist.all_gather(both, mine)
        if rank == 0:
            out["slower"] = torch.maximum(both[0], both[1]).tolist()
    finally:
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a zoo model (benchmarks/zoo/models.py), e.g. har, speech, resnet18")
    p.add_argument("--precision", default="fp32", choices=PRECISIONS)
    p.add_argument("--steps", type=int, default=100, help="steps per contender and round (default 100)")
    p.add_argument("--rounds", type=int, default=10, help="rounds (default 10)")
    args = p.parse_args()
    if args.steps < 1 or args.rounds < 1:
        p.error(f"--steps and --rounds must be at least 1, got {args.steps} and {args.rounds}")
    with tempfile.TemporaryDirectory() as tmp:
        args.scratch = tmp
        workload(args.model, torch.device("cpu"), Path(tmp))  # writes the video clips once, before the ranks read them
        out = mp.Manager().dict()
        mp.start_processes(_rank, args=(args, out), nprocs=2, start_method="spawn")
        slower = dict(zip(CONTENDERS, out["slower"]))
    free = slower["bare"]
    for kind in CONTENDERS:
        ratios = sorted(t / f for t, f in zip(slower[kind], free))
        print(f"{args.model} {args.precision} {kind:>9}: step {statistics.median(slower[kind]) * 1e3:7.2f} ms  "
              f"÷ bare {statistics.median(ratios):.3f} [{ratios[0]:.3f}, {ratios[-1]:.3f}]", flush=True)


if __name__ == "__main__":
    main()
