"""What keeping the ring's host slots from pass to pass is worth: passes of PrefetchLoader over
the video clips (``.npy``, memory-mapped), alternating between one loader used for every pass
(its ring passes from one pass to the next) and a loader made anew, untimed, before each pass
over the same memory-mapped tensors (its first pass allocates a fresh ring, as every pass did
before the pool).

    python benchmarks/zoo/slot_pool_ab.py [--passes 40]

Batches are only touched, as in the untouched rows of bench_video_loader.py. Prints clips/s of
each side (median over the passes), their paired ratio and the minor page faults a pass. A
diagnostic; it records nothing.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import fastddp
from benchmarks.zoo.video import write_clips, write_labels

CLIPS, FRAMES, SIZE, BATCH = 384, 16, 112, 8


def make_loader(columns: tuple[torch.Tensor, torch.Tensor]) -> fastddp.PrefetchLoader:
    sampler = fastddp.DistributedSampler(CLIPS, num_replicas=1, rank=0, shuffle=True, seed=0)
    return fastddp.PrefetchLoader(columns, batch_size=BATCH, sampler=sampler, num_workers=2)


def one_pass(loader: fastddp.PrefetchLoader) -> tuple[float, int]:
    """Clips/s of one pass of ``loader``, and the minor page faults it took."""
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0 = time.perf_counter()
    acc = 0
    for batch, _ in loader:
        acc += int(batch[:, :1, :1, :1].sum())  # touched
    rate = CLIPS / (time.perf_counter() - t0)
    return rate, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--passes", type=int, default=40)
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        paths = (write_clips(Path(tmp) / "clips.npy", CLIPS, FRAMES, SIZE),
                 write_labels(Path(tmp) / "labels.npy", CLIPS))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only maps, only read
            clips, labels = (torch.from_numpy(np.load(p, mmap_mode="r")) for p in paths)
        kept = make_loader((clips, labels))
        sides: dict[str, list[tuple[float, int]]] = {"pool": [], "fresh": []}
        for _ in range(3):  # warm-up: page cache, allocator
            one_pass(kept), one_pass(make_loader((clips, labels)))
        for i in range(args.passes):
            order = ("pool", "fresh") if i % 2 else ("fresh", "pool")
            for side in order:
                sides[side].append(one_pass(kept if side == "pool" else make_loader((clips, labels))))
    rate = {k: statistics.median(r for r, _ in v) for k, v in sides.items()}
    faults = {k: statistics.median(f for _, f in v) for k, v in sides.items()}
    ratio = statistics.median(a[0] / b[0] for a, b in zip(sides["pool"], sides["fresh"]))
    print(f"{args.passes} passes each, {CLIPS} clips of {FRAMES}x{SIZE}x{SIZE}x3, batch {BATCH}: "
          f"clips/s with the pool {rate['pool']:.0f}, fresh slots {rate['fresh']:.0f}, "
          f"pool / fresh {ratio:.3f} | page faults a pass: pool {faults['pool']:.0f}, "
          f"fresh {faults['fresh']:.0f}")


if __name__ == "__main__":
    main()
