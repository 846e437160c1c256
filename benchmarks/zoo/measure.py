"""What one rank measures for a zoo case: step times of every contender, interleaved in rounds,
and (in a process of its own) one contender's peak memory.

Contenders: ``bare`` (the model alone, no communication), ``bare_sync`` (the model alone plus
one 1-element all-reduce per step: the least any synchronous data-parallel step costs, the
ranks waiting for each other), ``torch`` (torch DDP, default options), ``torch_bv`` (torch DDP with ``gradient_as_bucket_view=True``, memory only) and
``fastddp`` (DDPWrapper). Each runs the same workload step: zero_grad, forward (under autocast
for bf16/fp16), backward, AdamW step; fp16 goes through a GradScaler (torch's for the torch
contenders, fastddp's for DDPWrapper).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import gc
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastddp

from .models import Workload, workload

TIMED = ("bare", "bare_sync", "torch", "fastddp")
MEMORY = ("bare", "torch", "torch_bv", "fastddp")
PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass
class Contender:
    model: nn.Module
    opt: torch.optim.Optimizer
    scaler: Optional[torch.amp.GradScaler]
    sync: Optional[Callable[[], None]] = None  # called after backward (``bare_sync``: an all-reduce)
    group: Optional[dist.ProcessGroup] = None  # the contender's ranks (None: the default group)


def new_model(wl: Workload, device: torch.device) -> nn.Module:
    """A fresh copy of the workload's model, the same weights for every contender."""
    torch.manual_seed(0)
    return wl.build().to(device)


def build(kind: str, model: nn.Module, device: torch.device, precision: str,
          group: Optional[dist.ProcessGroup] = None) -> Contender:
    """Contender ``kind`` over ``model``, reducing over ``group`` (None: the default group)."""
    ids = [device.index or 0] if device.type == "cuda" else None
    if kind in ("torch", "torch_bv"):
        model = TorchDDP(model, device_ids=ids, gradient_as_bucket_view=kind == "torch_bv",
                         process_group=group)
    elif kind == "fastddp":
        model = fastddp.DDPWrapper(model, device_ids=ids, process_group=group)
    elif kind not in ("bare", "bare_sync"):
        raise ValueError(f"unknown contender {kind!r}")
    scaler = None
    if precision == "fp16":
        scaler = (fastddp.GradScaler(device.type) if kind == "fastddp"
                  else torch.amp.GradScaler(device.type))
    sync = _one_element_all_reduce(device, group) if kind == "bare_sync" else None
    return Contender(model, torch.optim.AdamW(model.parameters(), lr=1e-4), scaler, sync, group)


def _one_element_all_reduce(device: torch.device, group: Optional[dist.ProcessGroup]) -> Callable[[], None]:
    """``bare_sync``'s step end: the ranks wait for each other through one 1-element all-reduce."""
    one = torch.zeros(1, device=device)
    return lambda: dist.all_reduce(one, group=group)


def step(c: Contender, wl: Workload, batch: Any, precision: str, device: torch.device) -> None:
    """One training step of contender ``c``."""
    c.opt.zero_grad(set_to_none=True)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    ctx = torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()
    with ctx:
        loss = wl.loss(c.model, batch)
    if c.scaler is None:
        loss.backward()
    else:
        c.scaler.scale(loss).backward()
    if c.sync is not None:
        c.sync()
    if c.scaler is None:
        c.opt.step()
    else:
        c.scaler.step(c.opt)
        c.scaler.update()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy since boot (every process, and time the
    hypervisor gave to others: /proc/stat's user, nice, system, irq, softirq and steal)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


@dataclass
class Rounds:
    """What one rank measured over interleaved rounds."""

    times: dict[Any, list[float]]  # seconds per step of each contender, one figure per round
    steps: int  # steps per block (the same on every rank)
    wall_s: float  # wall time of all rounds
    own_cpu_s: float  # CPU seconds this process used over them
    machine_busy_s: float  # busy CPU seconds of the whole machine over them

    def then(self, later: Rounds) -> Rounds:
        """These rounds followed by ``later``'s (the same rank in a later set of processes):
        the rounds of both, their seconds added; ``steps`` stays this set's."""
        return Rounds({k: v + later.times.get(k, []) for k, v in self.times.items()}, self.steps,
                      self.wall_s + later.wall_s, self.own_cpu_s + later.own_cpu_s,
                      self.machine_busy_s + later.machine_busy_s)


def _timed_block(run: Callable[[], None], device: torch.device) -> float:
    """Seconds ``run`` takes, started on every rank together (a barrier)."""
    if dist.is_initialized():
        dist.barrier()
    _sync(device)
    t0 = time.perf_counter()
    run()
    _sync(device)
    return time.perf_counter() - t0


def _block_steps(keys: Sequence[Any], prepare: Callable[[Any, int, int], Callable[[], None]],
                 min_steps: int, block_s: float, device: torch.device) -> int:
    """Steps per block so that a block of the slowest contender lasts ``block_s`` (at least
    ``min_steps``), agreed over the ranks (the fewest any rank asks for, so a rank that runs
    only a fast contender does not lengthen the slow one's blocks): short blocks weigh the
    start of a block (cold caches, the ranks leaving the barrier apart) too much on
    millisecond steps."""
    slowest = max(_timed_block(prepare(key, 0, 1), device) for key in keys)  # one at a time
    steps = max(min_steps, math.ceil(block_s / slowest)) if block_s > 0 else min_steps
    if dist.is_initialized():
        agreed = torch.tensor([steps], dtype=torch.int64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        steps = int(agreed)
    return steps


def interleave(keys: Sequence[Any], prepare: Callable[[Any, int, int], Callable[[], None]],
               schedule: Schedule, device: torch.device) -> Rounds:
    """Time the contenders ``keys`` in rotated rounds of one block each (how many:
    :func:`rounds_for`). ``prepare(key, first, n)`` makes the inputs of steps
    ``first .. first + n - 1`` (before the clock starts) and returns a callable that runs those
    steps. Every block starts on all ranks together (a barrier), in an order rotated from round
    to round so no contender always follows the same one."""
    steps = _block_steps(keys, prepare, schedule.min_steps, schedule.block_s, device)
    times: dict[Any, list[float]] = {k: [] for k in keys}
    busy0, cpu0, wall0 = _busy_seconds(), time.process_time(), time.perf_counter()
    rounds, r = schedule.rounds, 0
    while r < rounds:
        for key in list(keys[r % len(keys):]) + list(keys[:r % len(keys)]):
            times[key].append(_timed_block(prepare(key, r * steps, steps), device) / steps)
        if r == 0:
            rounds = rounds_for(schedule, time.perf_counter() - wall0)
        r += 1
    if dist.is_initialized():
        dist.barrier()  # ranks idle in the last block leave only now (exiting costs CPU)
    return Rounds(times, steps, time.perf_counter() - wall0, time.process_time() - cpu0,
                  _busy_seconds() - busy0)


def rounds_for(schedule: Schedule, first_round_s: float) -> int:
    """How many rounds fit ``schedule.budget_s`` at the first round's duration (the longest
    any rank saw, so every rank runs the same rounds), between ``rounds`` and ``max_rounds``:
    cheap cases get more rounds, and a tighter interval for their medians, for the time one
    round of an expensive case takes."""
    if schedule.max_rounds <= schedule.rounds or schedule.budget_s <= 0:
        return schedule.rounds
    seconds = torch.tensor([first_round_s], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    fit = int(schedule.budget_s // max(float(seconds), 1e-9))
    return max(schedule.rounds, min(schedule.max_rounds, fit))


def other_load(per_rank: Sequence[Rounds]) -> float:
    """Cores' worth of CPU the rest of the machine used while the ranks were timed (other
    processes, and the hypervisor's steal): a synchronous step waits for its slowest rank, so a
    neighbour that takes a core slows the synchronised contenders more than the bare model."""
    own = sum(r.own_cpu_s for r in per_rank)
    return max(0.0, (per_rank[0].machine_busy_s - own) / per_rank[0].wall_s)


@dataclass(frozen=True)
class Case:
    """One zoo measurement: a model at a precision, each contender on ``ranks`` ranks of its
    own that reduce over ``backend``."""

    name: str
    precision: str
    device_type: str
    ranks: int  # each contender's world size
    backend: str  # of each contender's process group
    scratch: str
    smoke: bool = False


@dataclass(frozen=True)
class Schedule:
    """How the contenders alternate: at least ``rounds`` rotated rounds of one block each, a
    block of at least ``min_steps`` steps lasting about ``block_s`` (see :func:`interleave`);
    up to ``max_rounds`` as long as the rounds fit ``budget_s`` seconds (:func:`rounds_for`)."""

    rounds: int
    min_steps: int
    block_s: float
    max_rounds: int = 0  # 0: exactly `rounds`
    budget_s: float = 0.0


def time_rounds(rank: int, world_size: int, case: Case, schedule: Schedule) -> Rounds:
    """Step times of this rank's contender over interleaved rounds. Every timed contender
    runs in processes of its own (``case.ranks`` each: ranks ``i * case.ranks ...`` run
    ``TIMED[i]``), as a training job holds one model per process: two models in one process
    share its allocator and caches, which sped up the bare model's steps and slowed the
    wrappers'. The others wait in the barrier while one contender's ranks run a block."""
    if world_size != case.ranks * len(TIMED):
        raise ValueError(f"time_rounds needs {case.ranks} ranks for each of {TIMED}: "
                         f"world size {case.ranks * len(TIMED)}, got {world_size}")
    groups = [dist.new_group(list(range(i * case.ranks, (i + 1) * case.ranks)),
                             backend=case.backend) for i in range(len(TIMED))]
    mine = TIMED[rank // case.ranks]
    device = torch.device(case.device_type)  # on a GPU machine every rank shares GPU 0
    if device.type == "cpu" and ALLOCATOR == "keep":
        _keep_freed_memory()
    wl = workload(case.name, device, Path(case.scratch), case.smoke)
    c = build(mine, new_model(wl, device), device, case.precision, groups[rank // case.ranks])
    for i in range(3):  # warm-up: allocations, bucket rebuilds, oneDNN plans
        step(c, wl, wl.batch(i), case.precision, device)

    def prepare(kind: str, first: int, n: int) -> Callable[[], None]:
        if kind != mine:
            return lambda: None
        if case.name == "video3d":  # the video batch is read from disk inside the step
            return lambda: [step(c, wl, wl.batch(i), case.precision, device) for i in range(n)]
        batches = [wl.batch(first + i) for i in range(n)]
        return lambda: [step(c, wl, b, case.precision, device) for b in batches]

    timed = interleave(TIMED, prepare, schedule, device)
    return dataclasses.replace(timed, times={mine: timed.times[mine]})


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4  # <malloc.h>
# The timed CPU ranks' allocator: "glibc" (its defaults, as a training job runs) or "keep"
# (freed memory kept for the next step, see _keep_freed_memory).
ALLOCATOR = os.environ.get("FASTDDP_ZOO_ALLOCATOR", "glibc")
if ALLOCATOR not in ("glibc", "keep"):
    raise ValueError(f"FASTDDP_ZOO_ALLOCATOR={ALLOCATOR!r}: use 'glibc' (default) or 'keep'")


def _mallopt(param: int, value: int) -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if libc.mallopt(param, value) != 1:
        raise RuntimeError(f"mallopt({param}, {value}) failed")


def _map_large_allocations() -> None:
    """Make glibc serve every allocation of 64 KiB or more with its own mapping, returned to
    the system when freed. By default glibc raises that threshold as large blocks are freed and
    keeps later ones in its heap, so peak RSS depended on the order of earlier frees and moved
    by several MiB between runs of the same contender."""
    _mallopt(_M_MMAP_THRESHOLD, 64 << 10)  # setting it also turns off the dynamic threshold


def _keep_freed_memory() -> None:
    """Make glibc keep freed memory for the next step (``FASTDDP_ZOO_ALLOCATOR=keep``), as
    jemalloc and tcmalloc do: every allocation comes from the heap (none gets a mapping of its
    own) and the heap is never trimmed. With glibc's defaults a step page-faults wherever the
    allocator gave back what the step before freed: the bare model's gradients, freed by
    ``zero_grad(set_to_none=True)`` and made again by the next backward, and the optimizer's
    temporaries (docs/benchmarks.md, "The allocator")."""
    _mallopt(_M_MMAP_MAX, 0)
    _mallopt(_M_TRIM_THRESHOLD, 1 << 30)


def _warm_contender(kind: str, device: torch.device, precision: str,
                    group: Optional[dist.ProcessGroup]) -> None:
    """One step of contender ``kind`` around a single linear layer, then freed."""
    tiny = Workload(lambda: nn.Linear(8, 2),
                    lambda i: (torch.randn(4, 8, device=device), torch.zeros(4, dtype=torch.long, device=device)),
                    lambda m, b: nn.functional.cross_entropy(m(b[0]).float(), b[1]))
    c = build(kind, tiny.build().to(device), device, precision, group)
    step(c, tiny, tiny.batch(0), precision, device)
    del c
    gc.collect()


def peak_memory(rank: int, world_size: int, name: str, precision: str, kind: str,
                device_type: str, steps: int, scratch: str, smoke: bool,
                group: Optional[dist.ProcessGroup] = None) -> int:
    """Bytes the contender adds at its peak over the built model: wrapper, optimizer state,
    gradients, buckets and activations of ``steps`` steps, reducing over ``group`` (None: the
    default group). CPU: peak RSS (VmHWM, reset after the model is built; large allocations
    mapped one by one, see _map_large_allocations); CUDA: the allocator's peak."""
    device = torch.device(device_type)
    if device.type == "cpu":
        _map_large_allocations()
    wl = workload(name, device, Path(scratch), smoke)
    model = new_model(wl, device)
    # Throw-away steps first, so one-time costs are not counted against the contender: the
    # model's (kernel libraries, thread pools, oneDNN primitives) and the contender's (its
    # modules' first import, c10d and reducer set-up), the latter on a one-layer model.
    warm = build("bare", new_model(wl, device), device, precision)
    step(warm, wl, wl.batch(0), precision, device)
    _warm_contender(kind, device, precision, group)
    del warm
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = _rss_bytes("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    c = build(kind, model, device, precision, group)
    for i in range(steps):
        step(c, wl, wl.batch(i), precision, device)
    _sync(device)
    peak = (torch.cuda.max_memory_allocated() if device.type == "cuda"
            else _rss_bytes("VmHWM"))
    return peak - base


def gpu_peak_memory_sweep(rank: int, world_size: int, cases: Sequence[tuple[str, str]],
                          ranks: int, backend: str, steps: int, scratch: str,
                          smoke: bool) -> dict[tuple[str, str], tuple[str, int]]:
    """:func:`peak_memory` of every case on a GPU, every contender of :data:`MEMORY` at once
    in processes of its own (``ranks`` each, reducing over ``backend``): the allocator's peak
    is a count of one process's allocations, which neither the other processes on the GPU nor
    the cases measured before (each case's memory is freed and the peak reset) change.
    Returns ``{(name, precision): (contender, bytes)}`` for this rank's contender."""
    if world_size != ranks * len(MEMORY):
        raise ValueError(f"gpu_peak_memory_sweep needs {ranks} ranks for each of {MEMORY}: "
                         f"world size {ranks * len(MEMORY)}, got {world_size}")
    groups = [dist.new_group(list(range(i * ranks, (i + 1) * ranks)), backend=backend)
              for i in range(len(MEMORY))]
    kind = MEMORY[rank // ranks]
    peaks = {}
    for name, precision in cases:
        peaks[(name, precision)] = (kind, peak_memory(rank, world_size, name, precision, kind,
                                                      "cuda", steps, scratch, smoke,
                                                      groups[rank // ranks]))
        gc.collect()
        torch.cuda.empty_cache()
    return peaks
