"""Where the direct H2D path's time goes: GB/s of the C++ pipeline alone (no Python loader
around it) over gather threads x ring slots x batch rows, against a pinned ``copy_`` of the
same bytes measured in the same run.

    python benchmarks/h2d_sweep.py [--rows 4096 16384] [--workers 1 2 4 8] [--prefetch 2 4 8]

On a GPU the data set is pinned once, so the pipeline takes the direct path (the GPU gathers
rows from host memory); ``--staged`` keeps it pageable (C++ threads gather into pinned slots,
then a side-stream copy). Without a GPU it runs the CPU gather, which checks the script. A
row's best configuration against the pinned copy says whether the gather itself (one
configuration at most ~70 % everywhere) or the pipeline around it (more threads or slots
help) holds the direct path below the copy engine. A diagnostic; it records nothing.
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch

from fastddp import _C as C

ROW_SHAPE = (9, 128)  # the HAR window: 4.6 KB of fp32 a row


def pipeline_rate(x: torch.Tensor, y: torch.Tensor, device: str, rows: int, workers: int,
                  prefetch: int, passes: int) -> tuple[float, bool]:
    """GB/s of ``passes`` shuffled passes of ``rows``-row batches through one pipeline each,
    and whether the pipeline took the direct path."""
    nbytes = x.numel() * x.element_size() + y.numel() * y.element_size()
    best = float("inf")
    for p in range(passes + 1):  # the first pass warms slots, streams and the allocator
        opts = C.PipelineOptions()
        opts.num_workers, opts.prefetch = workers, prefetch
        opts.pin_memory, opts.device, opts.batch_rows = device != "cpu", device, rows
        order = torch.randperm(len(x))
        if device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        pipe = C.PrefetchPipeline([x, y], opts)
        pipe.submit_split(order, rows)
        pipe.finish()
        while pipe.next():
            pass
        if device != "cpu":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        direct = bool(pipe.direct)
        pipe.close()
        if p:
            best = min(best, elapsed)
    return nbytes / best / 1e9, direct


def copy_rate(x: torch.Tensor, device: str, passes: int) -> float:
    """GB/s of a plain copy of ``x`` (pinned on a GPU) to ``device``."""
    src = x.pin_memory() if device != "cpu" else x
    dst = torch.empty_like(src, device=device)
    best = float("inf")
    for p in range(passes + 1):
        if device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        if device != "cpu":
            torch.cuda.synchronize()
        if p:
            best = min(best, time.perf_counter() - t0)
    return src.numel() * src.element_size() / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1024, 4096, 16384], help="rows a batch")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8], help="gather threads")
    ap.add_argument("--prefetch", type=int, nargs="+", default=[2, 4, 8], help="ring slots")
    ap.add_argument("--batches", type=int, default=32, help="batches a pass (of the largest rows)")
    ap.add_argument("--passes", type=int, default=3, help="timed passes (best kept)")
    ap.add_argument("--staged", action="store_true", help="pageable data set: the staged path")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    n = max(args.rows) * args.batches
    x = torch.randn(n, *ROW_SHAPE)
    y = torch.zeros(n, dtype=torch.int64)
    if device == "cuda" and not args.staged:
        x, y = x.pin_memory(), y.pin_memory()
    copy = copy_rate(x, device, args.passes)
    path = "cpu gather" if device == "cpu" else ("staged" if args.staged else "direct")
    print(f"{path} path, {n} rows of {tuple(x.shape[1:])} fp32 ({x.numel() * 4 / 1e9:.2f} GB); "
          f"plain copy {copy:.1f} GB/s")
    print("rows  workers  prefetch  GB/s  of copy  direct")
    for rows, workers, prefetch in itertools.product(args.rows, args.workers, args.prefetch):
        rate, direct = pipeline_rate(x, y, device, rows, workers, prefetch, args.passes)
        print(f"{rows:5d}  {workers:7d}  {prefetch:8d}  {rate:5.1f}  {rate / copy:6.0%}  {direct}",
              flush=True)


if __name__ == "__main__":
    main()
