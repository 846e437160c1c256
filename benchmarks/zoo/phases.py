"""Where a zoo contender's step goes: the medians of zero_grad, forward, backward, the
``bare_sync`` contender's one-element all-reduce and the optimizer step, on two gloo ranks of
the CPU, each step started after a barrier; for torch DDP and DDPWrapper also ``tail``, the
mean time from the last gradient's arrival to the end of the reduction (the part of the
reduction no backward computation hides), read from torch DDP's runtime logging
(``_get_ddp_logging_data()``, sampled every iteration).

    python benchmarks/zoo/phases.py mlp50m --contenders bare_sync fastddp [--precision fp32] [--steps 10]

Each contender runs in a pair of processes of its own, one pair after the other (the zoo's
interleaved rounds are in bench_zoo.py; this splits a step, it does not rank the contenders).
DDPWrapper reduces inside backward, so its reduction shows in the backward column. Prints one
line per contender for the slower rank's medians (``tail``: the rank with the longer one). A
diagnostic; it records nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.zoo.measure import PRECISIONS, TIMED, build, new_model
from benchmarks.zoo.models import workload

PHASES = ("zero_grad", "forward", "backward", "sync", "optimizer")


def _reduction_tail(model: torch.nn.Module) -> tuple[float, int]:
    """torch DDP's running mean of (communication end - last gradient) in ns, and the count."""
    d = model._get_ddp_logging_data()
    return d.get("avg_backward_comm_time", 0) - d.get("avg_backward_compute_comm_overlap_time", 0), d["iteration"]


def _phase_times(kind: str, name: str, precision: str, steps: int,
                 scratch: Path) -> tuple[list[list[float]], float]:
    """This rank's per-step times (ms) of each phase, after 3 warm-up steps, and the mean
    reduction tail (ms) over those steps (NaN for a contender without a reducer)."""
    device = torch.device("cpu")
    wl = workload(name, device, scratch)
    c = build(kind, new_model(wl, device), device, precision)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    times: list[list[float]] = [[] for _ in PHASES]
    logged = hasattr(c.model, "_get_ddp_logging_data")
    if logged:
        c.model._set_ddp_runtime_logging_sample_rate(1)
    for i in range(steps + 3):
        dist.barrier()
        marks = [time.perf_counter()]
        c.opt.zero_grad(set_to_none=True)
        marks.append(time.perf_counter())
        with torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext():
            loss = wl.loss(c.model, wl.batch(i))
        if logged and i == 3:  # this forward sampled the last warm-up step
            warm = _reduction_tail(c.model)
        marks.append(time.perf_counter())
        (loss if c.scaler is None else c.scaler.scale(loss)).backward()
        marks.append(time.perf_counter())
        if c.sync is not None:
            c.sync()
        marks.append(time.perf_counter())
        if c.scaler is None:
            c.opt.step()
        else:
            c.scaler.step(c.opt)
            c.scaler.update()
        marks.append(time.perf_counter())
        if i >= 3:
            for k in range(len(PHASES)):
                times[k].append((marks[k + 1] - marks[k]) * 1e3)
    if not logged:
        return times, float("nan")
    wl.loss(c.model, wl.batch(0))  # a reducing forward samples the step before it
    (mean_w, n_w), (mean_e, n_e) = warm, _reduction_tail(c.model)
    return times, (mean_e * n_e - mean_w * n_w) / max(1, n_e - n_w) / 1e6


def _rank(rank: int, kind: str, args: argparse.Namespace, init: str, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        times, tail = _phase_times(kind, args.model, args.precision, args.steps, Path(args.scratch))
        medians = torch.tensor([statistics.median(t) for t in times], dtype=torch.float64)
        total = torch.tensor([statistics.median([sum(s) for s in zip(*times)]), tail], dtype=torch.float64)
        both = torch.cat([total, medians])
        gathered = [torch.empty_like(both) for _ in range(2)]
        dist.all_gather(gathered, both)
        if rank == 0:
            slower = max(gathered, key=lambda t: float(t[0])).tolist()
            out[kind] = [slower[0], max(float(t[1]) for t in gathered), *slower[2:]]
    finally:
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a zoo model (benchmarks/zoo/models.py), e.g. mlp50m, gpt2, resnet18")
    p.add_argument("--contenders", nargs="+", default=["bare_sync", "fastddp"], choices=TIMED)
    p.add_argument("--precision", default="fp32", choices=PRECISIONS)
    p.add_argument("--steps", type=int, default=10, help="timed steps per contender (default 10)")
    args = p.parse_args()
    if args.steps < 1:
        p.error(f"--steps must be at least 1, got {args.steps}")
    with tempfile.TemporaryDirectory() as tmp:
        args.scratch = tmp
        workload(args.model, torch.device("cpu"), Path(tmp))  # writes the video clips once, before the ranks read them
        out = mp.Manager().dict()
        for n, kind in enumerate(args.contenders):
            init = f"file://{tmp}/pg{n}"
            mp.start_processes(_rank, args=(kind, args, init, out), nprocs=2, start_method="spawn")
            total, tail, *phases = out[kind]
            cells = "  ".join(f"{ph} {v:7.1f}" for ph, v in zip(PHASES, phases))
            tail_cell = "" if tail != tail else f"  tail {tail:6.2f}"  # NaN: no reducer
            print(f"{args.model} {args.precision} {kind:>9}: step {total:7.1f} ms  {cells}{tail_cell}", flush=True)


if __name__ == "__main__":
    main()
