"""``python -m fastddp.launch --nproc auto [train args]``: the ``train_multigpu.sh N`` equivalent.

Detects the GPUs (or, without any, uses CPU ranks with gloo), checks N, and starts
``fastddp.train`` through torchrun's Python API (``torch.distributed.run``), or with
``torch.multiprocessing.spawn`` when ``--spawn`` is given.
"""

from __future__ import annotations

import argparse
import os
import sys

from ._net import free_port


def resolve_nproc(spec: str, gpus: int, cpus: int) -> int:
    """``auto`` -> one rank per GPU, or 2 CPU ranks (at most the core count) without GPUs."""
    if spec == "auto":
        return gpus if gpus > 0 else max(1, min(2, cpus))
    try:
        n = int(spec)
    except ValueError:
        raise ValueError(f"--nproc must be 'auto' or a positive integer, got {spec!r}") from None
    if n <= 0:
        raise ValueError(f"--nproc must be positive, got {n}")
    if gpus > 0 and n > gpus:
        raise ValueError(f"--nproc {n} but only {gpus} GPU(s) are visible: use --nproc {gpus} or "
                         "fewer (CPU ranks: hide the GPUs with CUDA_VISIBLE_DEVICES='')")
    return n


def _spawn_entry(local_rank: int, world: int, port: int, train_args: list[str]) -> None:
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from fastddp.train import main

    code = main(train_args)
    if code:
        sys.exit(code)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m fastddp.launch",
        description="Start fastddp.train on every GPU of this machine (or on CPU ranks). "
                    "Arguments after the launcher's own go to fastddp.train.")
    p.add_argument("--nproc", default="auto", help="ranks: auto (one per GPU, else 2 CPU ranks) or N")
    p.add_argument("--spawn", action="store_true",
                   help="use torch.multiprocessing.spawn instead of torchrun's engine")
    args, train_args = p.parse_known_args(argv)
    import torch

    try:
        n = resolve_nproc(args.nproc, torch.cuda.device_count(), os.cpu_count() or 1)
    except ValueError as exc:
        print(f"fastddp.launch: error: {exc}", file=sys.stderr)
        return 2
    if "--multi-gpu" not in train_args:
        train_args = ["--multi-gpu", "ddp", *train_args]
    print(f"fastddp.launch: {n} rank(s) on {'GPU' if torch.cuda.device_count() else 'CPU'}",
          flush=True)
    if args.spawn:
        import torch.multiprocessing as mp

        try:
            mp.spawn(_spawn_entry, args=(n, free_port(), train_args), nprocs=n, join=True)
        except mp.ProcessExitedException as exc:
            print(f"fastddp.launch: error: {exc}", file=sys.stderr)
            return 1
        return 0
    from torch.distributed import run as torchrun

    torchrun_args = torchrun.get_args_parser().parse_args(
        ["--nproc_per_node", str(n), "--standalone", "-m", "fastddp.train", *train_args])
    try:
        torchrun.run(torchrun_args)
    except Exception as exc:  # ChildFailedError: torchrun already printed the per-rank report
        print(f"fastddp.launch: error: training failed ({type(exc).__name__})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
