"""A typical torch DDP training script, switched to fastddp by changing its imports only.

Two ranks on CPU (gloo), a DataLoader over a DistributedSampler with ``set_epoch``, a look at
one batch before the epoch loop, gradient accumulation under ``no_sync``, AMP loss scaling
with a GradScaler, gradient clipping after ``unscale_``, and ``.module`` state_dict
checkpoints that a plain model loads. Run it either way and compare the losses:

    python examples/client_swap.py --impl torch   --out stock.json
    python examples/client_swap.py --impl fastddp --out swapped.json

``--impl`` is the one switch; ``--swap ddp,scaler`` swaps only the named classes (``ddp``,
``scaler``, ``sampler``, ``loader``), to see which one a difference comes from, and repeated
(``--swap none --swap all``) trains once per value in the same two processes.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import multiprocessing
import os
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import TensorDataset

KINDS = ("ddp", "scaler", "sampler", "loader")
EPOCHS, BATCH, ACCUM, CLIP = 3, 8, 2, 0.5


def classes(swap: set[str]) -> dict[str, Any]:
    """The swap itself: torch's classes, with fastddp's drop-ins for the kinds in ``swap``."""
    from torch.amp import GradScaler
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    chosen = {"ddp": DDP, "scaler": GradScaler, "sampler": DistributedSampler, "loader": DataLoader}
    if swap:
        import fastddp  # the swapped script: `from fastddp import DDPWrapper as DDP, ...`

        ours = {"ddp": fastddp.DDPWrapper, "scaler": fastddp.GradScaler,
                "sampler": fastddp.DistributedSampler, "loader": fastddp.PrefetchLoader}
        chosen.update({kind: ours[kind] for kind in swap})
    return chosen


def make_data() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(200, 12, generator=g)
    y = (x[:, :3].sum(1) > 0).long() + (x[:, 3] > 1).long()
    return TensorDataset(x, y)


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Dropout(0.2), nn.Linear(32, 32),
                         nn.GELU(), nn.Dropout(0.2), nn.Linear(32, 3))


def train(rank: int, world: int, init_file: str, swap: list[str], ckpt_dir: str) -> dict[str, Any]:
    """One rank's run; returns what the comparison needs (losses, counts, checkpoints)."""
    cls = classes(set(swap))
    torch.manual_seed(0)  # the same seed on every rank, as scripts do
    data = make_data()
    sampler = cls["sampler"](data, shuffle=True, seed=3)  # world and rank from the process group
    loader = cls["loader"](data, batch_size=BATCH, sampler=sampler, num_workers=2, drop_last=False)
    model = cls["ddp"](make_model())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scaler = cls["scaler"]("cpu", init_scale=2.0**12, growth_interval=3)
    loss_fn = nn.CrossEntropyLoss()

    x0, _ = next(iter(loader))  # a peek at one batch before training
    out: dict[str, Any] = {"peek": x0.shape[0], "losses": [], "batches": [], "scales": [], "norms": []}
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        model.train()
        batches = 0
        for i, (x, y) in enumerate(loader):
            batches += 1
            boundary = (i + 1) % ACCUM == 0 or i + 1 == len(loader)
            with contextlib.nullcontext() if boundary else model.no_sync():
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = loss_fn(model(x), y)
                scaler.scale(loss / ACCUM).backward()
            out["losses"].append(loss.item())
            if boundary:
                scaler.unscale_(opt)
                out["norms"].append(nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
                out["scales"].append(scaler.get_scale())
        out["batches"].append(batches)
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                        "scaler": scaler.state_dict(), "epoch": epoch}, os.path.join(ckpt_dir, "last.pt"))
        dist.barrier()
    # the checkpoint loads into the plain model, as with stock DDP
    state = torch.load(os.path.join(ckpt_dir, "last.pt"))
    plain = make_model()
    plain.load_state_dict(state["model"])
    out["checkpoint"] = [p.tolist() for p in plain.parameters()]
    out["scaler_state"] = state["scaler"]
    out["rng"] = hashlib.sha256(torch.random.get_rng_state().numpy().tobytes()).hexdigest()
    return out


def _rank_main(rank: int, world: int, init_file: str, runs: list[list[str]], ckpt_dir: str,
               out_dir: str) -> None:
    torch.set_num_threads(1)
    # DataLoader's workers start as they do in a rank torchrun launched on Linux: forked.
    # (mp.spawn's children inherit its "spawn" method, and each pass's workers would then
    # start a fresh interpreter that imports torch: about 2.5 s a pass.)
    multiprocessing.set_start_method("fork", force=True)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:  # every run starts from the same seeds, so runs in one process compare as separate ones
        results = [train(rank, world, init_file, swap, ckpt_dir) for swap in runs]
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


def run(runs: list[list[str]], world: int = 2) -> list[list[dict[str, Any]]]:
    """Train once per entry of ``runs`` (the kinds to swap; [] is stock) on ``world`` CPU
    ranks; for each run, every rank's results in rank order."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank_main, args=(world, os.path.join(tmp, "init"), runs, tmp, tmp), nprocs=world)
        per_rank = []
        for r in range(world):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                per_rank.append(json.load(f))
        return [[per_rank[r][i] for r in range(world)] for i in range(len(runs))]


def _parse_swap(text: str) -> list[str]:
    swap = list(KINDS) if text == "all" else [k for k in text.split(",") if k and k != "none"]
    unknown = sorted(set(swap) - set(KINDS))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {','.join(KINDS)}, all, none")
    return swap


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impl", choices=("torch", "fastddp"), default="fastddp",
                        help="stock torch classes, or fastddp's drop-ins for all four")
    parser.add_argument("--swap", type=_parse_swap, action="append", default=None,
                        help=f"comma-separated subset of {','.join(KINDS)} to take from fastddp, or "
                             "'all' or 'none' (overrides --impl); repeat it for several runs in a row")
    parser.add_argument("--out", default=None, help="write the results (a list per run, a dict per "
                                                    "rank) here as JSON")
    args = parser.parse_args()
    runs = args.swap if args.swap is not None else [list(KINDS) if args.impl == "fastddp" else []]
    results = run(runs)
    for swap, ranks in zip(runs, results):
        for r, res in enumerate(ranks):
            print(f"[{','.join(swap) or 'stock'}] rank {r}: peek batch {res['peek']}, batches per "
                  f"epoch {res['batches']}, first/last loss {res['losses'][0]:.6f}/{res['losses'][-1]:.6f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
