"""Short fastddp.train runs for the tests, as forkserver children of a server that imported
torch (and the modules that take seconds to import) once: each run costs about a second.

``launch``/``run`` start one run (``world`` ranks over gloo, environment as torchrun sets it)
on the tiny data set of :data:`TINY` (192 training samples: 6 steps of 32 per epoch)."""

from __future__ import annotations

import csv
import multiprocessing
from pathlib import Path
from typing import Optional

from fastddp._net import free_port
from tests import fsfault

CTX = multiprocessing.get_context("forkserver")
# torch._dynamo (imported by the optimizers) and pyplot take seconds to import: once, here.
CTX.set_forkserver_preload(["torch", "torch._dynamo", "matplotlib.pyplot", "fastddp.train.loop",
                            "tests.fsfault"])

TINY = '''
import torch
from torch import nn
from torch.utils.data import TensorDataset

from fastddp.train.models import FlattenMLP

def _split(g, n, labels):
    x = torch.randn(n, 9, 128, generator=g) * 2.0 + labels.view(-1, 1, 1).float() * 0.05
    return TensorDataset(x, labels)

def make():
    g = torch.Generator().manual_seed(0)
    return _split(g, 192, torch.arange(192) % 6), _split(g, 96, torch.arange(96) % 6)

def learnable(offset=1.0):
    """A stronger class signal: validation F1 rises over the first epochs, so every epoch of a
    short run writes best.pt (the crash tests need its writes in each epoch's saves)."""
    g = torch.Generator().manual_seed(0)
    split = lambda n, y: TensorDataset(torch.randn(n, 9, 128, generator=g) * 2.0
                                       + y.view(-1, 1, 1).float() * offset, y)
    return split(192, torch.arange(192) % 6), split(96, torch.arange(96) % 6)

def imbalanced():
    """Half the samples are class 0."""
    g = torch.Generator().manual_seed(0)
    y = torch.where(torch.arange(192) % 2 == 0, 0, torch.arange(192) % 6)
    return _split(g, 192, y), _split(g, 96, torch.arange(96) % 6)

def one_nan():
    """make() with one NaN training sample: in each epoch exactly one rank's batch holds it."""
    train, test = make()
    train.tensors[0][17, 0, 0] = float("nan")
    return train, test

def val_nan():
    """make() with one NaN validation sample."""
    train, test = make()
    test.tensors[0][3, 0, 0] = float("nan")
    return train, test

class WithUnused(FlattenMLP):
    """A FlattenMLP with a head that never contributes to the loss."""
    def __init__(self):
        super().__init__()
        self.unused = nn.Linear(4, 4)

def with_unused():
    return WithUnused()

def three_classes():
    """A model with 3 outputs where the task has 6 classes."""
    return nn.Sequential(nn.Flatten(), nn.Linear(9 * 128, 3))
'''
ARGS = ["--dataset", "tiny_har:make", "--epochs", "3", "--batch-size", "32", "--no-progress",
        "--num-workers", "1"]


def write_data(directory: Path) -> str:
    """Writes the ``tiny_har`` module into ``directory``; returns it for ``run(path=...)``."""
    (directory / "tiny_har.py").write_text(TINY)
    return str(directory)


def launch(save: Path, data_path: str, extra: list[str], exit_after: int = 0,
           log: Optional[str] = None, world: int = 1, base: Optional[list[str]] = None,
           env: Optional[dict[str, str]] = None) -> list[multiprocessing.Process]:
    """Start the ranks of one run into ``save`` (rank r's output: ``<save>.rank<r>.out``);
    rank 0 stops after its checkpoint call ``exit_after`` (see tests/fsfault.py)."""
    argv = [*(ARGS if base is None else base), "--save-dir", str(save), *extra]
    envs: list[dict[str, str]] = [dict(env or {})]
    if world > 1:
        port = str(free_port())
        argv = [*argv, "--multi-gpu", "ddp", "--timeout", "20"]
        envs = [dict(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world),
                     LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                     **(env or {}))
                for r in range(world)]
    procs = []
    for rank, env in enumerate(envs):
        out = str(save.parent / f"{save.name}.rank{rank}.out")
        p = CTX.Process(target=fsfault.run_trainer,
                        args=(argv, out, exit_after if rank == 0 else 0, log, env, data_path))
        p.start()
        procs.append(p)
    return procs


def run(save: Path, data_path: str, extra: list[str], exit_after: int = 0,
        log: Optional[str] = None, world: int = 1, base: Optional[list[str]] = None,
        env: Optional[dict[str, str]] = None) -> tuple[list[int], str]:
    """:func:`launch` and wait: the exit codes and the output (rank 0's, then any other
    rank's that is not empty, after a ``--- rank r`` line)."""
    procs = launch(save, data_path, extra, exit_after, log, world, base, env)
    for p in procs:
        p.join(120)  # a hung rank dumps its threads' stacks and exits after 90 s
    out = Path(save.parent / f"{save.name}.rank0.out").read_text()
    for rank in range(1, world):
        text = Path(save.parent / f"{save.name}.rank{rank}.out").read_text()
        out += f"--- rank {rank}\n{text}" if text else ""
    hung = [p for p in procs if p.exitcode is None]
    for p in hung:
        p.kill()
    assert not hung, f"a training process hung\n{out}"
    return [p.exitcode for p in procs], out


def metrics(save: Path) -> list[dict[str, str]]:
    with open(save / "metrics.csv") as f:
        return list(csv.DictReader(f))
