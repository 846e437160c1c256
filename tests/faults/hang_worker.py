"""One rank of a two-rank job in which one rank misbehaves (tests/test_hang_reports.py).

Usage: python tests/faults/hang_worker.py FAULT RANK WORLD INIT_FILE PG_TIMEOUT_S SHM(0|1) [torch]
The misbehaving rank is rank 1; rank 0 trains normally and ends up waiting for it. With
``torch`` the model is wrapped in torch's DistributedDataParallel instead (to compare what torch
reports, e.g. under TORCH_DISTRIBUTED_DEBUG=DETAIL)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

import fastddp

STEPS = 4
STUCK_STEP = 2


EVAL_FORWARDS = 10  # of EVAL_FORWARD_S each: 5 s, past the stall threshold of the tests
EVAL_FORWARD_S = 0.5


class Net(nn.Module):
    def __init__(self, stuck_in_forward: bool, norm: bool = False) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 2)
        self.norm = nn.BatchNorm1d(16) if norm else nn.Identity()  # buffers broadcast in forward
        self.stuck_in_forward = stuck_in_forward
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.stuck_in_forward and self.calls == STUCK_STEP:
            print("FAULT-START", flush=True)
            time.sleep(600)  # a stuck forward (e.g. waiting on a remote resource)
        if not torch.is_grad_enabled():
            time.sleep(EVAL_FORWARD_S)  # a slow evaluation forward (evaluate_alone)
        return self.b(torch.relu(self.norm(self.a(x))))


class Samples(Dataset):
    def __init__(self, stuck: bool) -> None:
        self.stuck = stuck

    def __len__(self) -> int:
        return 4 * STEPS

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.stuck and i == 4 * (STUCK_STEP - 1):
            print("FAULT-START", flush=True)
            time.sleep(600)  # a stuck data source
        g = torch.Generator().manual_seed(i)
        return torch.randn(8, generator=g), torch.tensor(i % 2)


def evaluate_alone(model: nn.Module, x: torch.Tensor) -> None:
    """An evaluation on this rank only (as scripts do on rank 0), slow enough to be reported:
    forwards without gradients through the wrapper while the other rank waits in its next
    reduction."""
    print("FAULT-START", flush=True)
    model.eval()
    with torch.no_grad():
        for _ in range(EVAL_FORWARDS):
            model(x)
            time.sleep(0.001)  # between forwards: outside fastddp, briefly
    model.train()


def main() -> None:
    in_thread = sys.argv[1].endswith("_in_thread")  # the wrapper built here, the loop in a thread
    fault = sys.argv[1].removesuffix("_in_thread")
    rank, world, init_file, timeout_s, shm = sys.argv[2:7]
    stock = sys.argv[7:] == ["torch"]
    rank, world = int(rank), int(world)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=float(timeout_s)))
    bad = rank == 1
    net = Net(bad and fault == "stuck_forward", norm=fault == "skips_backward")
    model = (torch.nn.parallel.DistributedDataParallel(net) if stock
             else fastddp.DDPWrapper(net, shm_allreduce=shm == "1"))
    if not in_thread:
        train(fault, rank, world, model)
        return
    finished = []
    trainer = threading.Thread(target=lambda: finished.append(train(fault, rank, world, model)), name="trainer")
    trainer.start()
    trainer.join()
    sys.exit(0 if finished else 1)  # an uncaught error ended the thread (reported by its hook)


def train(fault: str, rank: int, world: int, model: nn.Module) -> None:
    bad = rank == 1
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if bad and fault == "killed":  # dies while the reduction of its first step is in flight
        model.module.a.weight.register_hook(lambda g: os.kill(os.getpid(), signal.SIGKILL))
    loader = DataLoader(Samples(bad and fault == "stuck_data"), batch_size=4)
    steps = STEPS - 1 if bad and fault in ("extra_step", "fewer_batches", "ends_early") else STEPS
    for step, (x, y) in enumerate(loader):
        if step == steps:
            break
        if bad and fault == "raises" and step == 1:
            print("FAULT-START", flush=True)
            raise ValueError("bad batch (simulated)")  # uncaught: the process ends here
        if bad and fault == "evaluates_alone" and step == 1:
            evaluate_alone(model, x)
        loss = nn.functional.cross_entropy(model(x), y)
        if bad and fault == "skips_backward" and step == 1:
            print("FAULT-START", flush=True)
            continue  # e.g. `if not loss.isfinite(): continue` on this rank only
        opt.zero_grad()
        loss.backward()
        if bad and fault == "raises_after_backward" and step == 2:
            print("FAULT-START", flush=True)
            raise RuntimeError("optimizer step failed (simulated)")  # uncaught, after a reduced step
        opt.step()
        if fault == "sleeps_before_barrier":  # the script's own collective after every step
            if bad and step == 1:
                print("FAULT-START", flush=True)
                time.sleep(600)  # stuck outside any collective (e.g. writing a file)
            dist.barrier()
    if bad and fault in ("extra_step", "fewer_batches", "ends_early"):
        print("FAULT-START", flush=True)
    if fault == "extra_step":
        dist.barrier()  # rank 1 went on to a barrier while rank 0 takes one more step
    elif fault == "fewer_batches":
        out = [torch.zeros(1) for _ in range(world)]
        dist.all_gather(out, torch.ones(1))  # rank 1's evaluation, rank 0 still training
    dist.destroy_process_group()
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
