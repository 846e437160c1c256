"""Plain-PyTorch reference for the HAR run: what a user writes without fastddp.

The classic ``main_multi_gpu.py`` stack, honestly configured: torch DDP + torch
DistributedSampler + DataLoader(num_workers, pin_memory=True, persistent_workers=True) +
torch.amp.GradScaler + clip_grad_norm_ + AdamW (fused on CUDA) + linear warm-up then cosine.
Same model definitions, data, hyper-parameters and seeds as ``fastddp.train``.

    python benchmarks/reference/torch_har.py --epochs 3
    torchrun --nproc_per_node=2 benchmarks/reference/torch_har.py --epochs 3
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from fastddp.data import har
from fastddp.train.metrics import accuracy, confusion, macro_f1
from fastddp.train.models import build_model
from fastddp.train.setup import lr_lambda


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--mode", default="flatten")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-epochs", type=float, default=1.0)
    p.add_argument("--weight-decay", type=float, default=1e-2)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--amp", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--json-out", default=None, help="write the per-epoch history here")
    args = p.parse_args()

    distributed = "WORLD_SIZE" in os.environ
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if distributed:
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(seconds=300))

    torch.manual_seed(args.seed)
    model = build_model(args.mode).to(device)
    data = har.synthetic_har(seed=0)
    train = TensorDataset(data.x_train, data.y_train)
    test = TensorDataset(data.x_test, data.y_test)
    if distributed:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank] if use_cuda else None)
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True,
                                 seed=args.seed, drop_last=True)
    workers = args.num_workers
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                        num_workers=workers, pin_memory=use_cuda, persistent_workers=workers > 0)
    test_idx = list(range(rank, len(test), world))
    val_loader = DataLoader(torch.utils.data.Subset(test, test_idx), batch_size=max(256, args.batch_size),
                            num_workers=workers, pin_memory=use_cuda, persistent_workers=workers > 0)
    amp = args.amp if args.amp is not None else use_cuda
    amp_dtype = torch.float16 if use_cuda else torch.bfloat16
    scaler = torch.amp.GradScaler(device.type, enabled=amp and amp_dtype == torch.float16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay,
                                  fused=use_cuda)
    steps = len(loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(steps * args.epochs, int(args.warmup_epochs * steps)))
    loss_fn = nn.CrossEntropyLoss()
    history = []
    t0 = time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        torch.manual_seed(args.seed + 1000 * rank + epoch)
        model.train()
        te = time.perf_counter()
        seen = 0
        for x, y in loader:
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp):
                loss = loss_fn(model(x).float(), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            if args.clip_grad:
                nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            seen += y.numel()
        epoch_time = time.perf_counter() - te
        model.eval()
        cm = torch.zeros(6, 6, dtype=torch.int64, device=device)
        with torch.no_grad():
            for x, y in val_loader:
                x, y = x.to(device), y.to(device)
                with torch.autocast(device.type, dtype=amp_dtype, enabled=amp):
                    out = model(x)
                cm += confusion(out.argmax(1), y, 6)
        stats = torch.tensor([float(seen)], device=device)
        if distributed:
            dist.all_reduce(cm)
            dist.all_reduce(stats)
        row = {"epoch": epoch + 1, "val_acc": accuracy(cm.cpu()), "val_f1": macro_f1(cm.cpu()),
               "epoch_time_s": epoch_time, "samples_per_s": float(stats[0]) / epoch_time,
               "elapsed_s": time.perf_counter() - t0}
        history.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
    if rank == 0 and args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"history": history, "total_time_s": time.perf_counter() - t0,
                       "world_size": world}, f, indent=1)
    if distributed:
        dist.destroy_process_group()
    if not math.isfinite(history[-1]["val_acc"]):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
