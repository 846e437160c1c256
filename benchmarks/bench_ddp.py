"""DDPWrapper vs torch DistributedDataParallel: step time (forward + backward + optimizer),
same model, data and process group, measured alternately in the same ranks.

    pytest benchmarks/bench_ddp.py -s          # CPU, gloo, world sizes 2 and 1
    pytest benchmarks/bench_ddp.py -s -m cuda  # GPU, NCCL, world size 1: overhead over the bare model

On CPU, fastddp runs twice: with its default transport for co-located ranks (shared memory)
and on the gloo process group (``shm_allreduce=False``), so both ratios come from one run.

Models: an MLP of ~10 M parameters (few large gradients; also with bf16 parameters in the
step-time comparison) and a stack of 100 small linear layers (~200 parameters: per-parameter
overhead dominates); the per-tensor cost is measured on
a chain of 1024 Linear(32, 32) against the bare model.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import pytest
import torch
import torch.distributed as dist
from tests.distributed import run_distributed
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastddp

from .common import SMOKE, record

STEPS = 2 if SMOKE else 30


def _big() -> nn.Module:
    w = 64 if SMOKE else 2048
    return nn.Sequential(nn.Linear(w // 2, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(),
                         nn.Linear(w, w), nn.ReLU(), nn.Linear(w, w // 2))


def _small() -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(100)])


MODELS = {"mlp_10M": (_big, lambda: torch.randn(32, (64 if SMOKE else 2048) // 2)),
          "small_200": (_small, lambda: torch.randn(64, 32))}
# The step-time comparison also trains the MLP with bf16 parameters (bf16 gradient buckets).
STEP_MODELS = {**MODELS, "mlp_10M_bf16": (lambda: _big().to(torch.bfloat16),
                                          lambda: torch.randn(32, (64 if SMOKE else 2048) // 2).bfloat16())}


def _mean_hook(state, bucket):
    """A user's Python communication hook: average the bucket with an async all-reduce."""
    tensor = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(tensor, async_op=True).get_future().then(lambda fut: fut.value()[0])


def _bench(rank: int, world_size: int, name: str, python_hook: bool = False) -> dict:
    torch.set_num_threads(1)
    factory, make_x = STEP_MODELS[name]
    torch.manual_seed(0)
    if python_hook:  # both wrappers call the same Python hook per bucket
        models = {"fastddp": fastddp.DDPWrapper(factory()), "torch": TorchDDP(factory())}
        for m in models.values():
            m.register_comm_hook(None, _mean_hook)
    else:
        # fastddp's default on co-located CPU ranks reduces through shared memory;
        # "fastddp_c10d" is the same reducer on the gloo process group, as torch DDP uses it.
        models = {"fastddp": fastddp.DDPWrapper(factory()), "torch": TorchDDP(factory()),
                  "fastddp_c10d": fastddp.DDPWrapper(factory(), shm_allreduce=False)}
        assert models["fastddp"].transport == "shm" and models["fastddp_c10d"].transport == "c10d"
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}
    x = make_x()

    def step(kind: str) -> float:
        m, o = models[kind], opts[kind]
        t0 = time.perf_counter()
        o.zero_grad()
        m(x).pow(2).mean().backward()
        o.step()
        return time.perf_counter() - t0

    for kind in models:  # warm-up (allocations, first-iteration work)
        for _ in range(3):
            step(kind)
    times: dict[str, list[float]] = {k: [] for k in models}
    for _ in range(STEPS):
        for kind in models:  # alternate so both see the same machine state
            dist.barrier()
            times[kind].append(step(kind))
    n_params = sum(p.numel() for p in models["torch"].parameters())
    return {k: statistics.median(v) for k, v in times.items()} | {"params": n_params,
                                                                   "tensors": len(list(models["torch"].parameters()))}


@pytest.mark.parametrize("name", list(STEP_MODELS))
def test_ddp_step_time_cpu_world2(name: str) -> None:
    res = run_distributed(_bench, world_size=2, args=(name,), timeout=900)[0]
    result = {"model": name, "params": res["params"], "tensors": res["tensors"], "world_size": 2,
              "backend": "gloo", "fastddp_step_ms": res["fastddp"] * 1e3,
              "torch_step_ms": res["torch"] * 1e3, "time_ratio": res["fastddp"] / res["torch"],
              "fastddp_c10d_step_ms": res["fastddp_c10d"] * 1e3,
              "c10d_time_ratio": res["fastddp_c10d"] / res["torch"],
              "command": "pytest benchmarks/bench_ddp.py -s"}
    print(json.dumps(result, indent=1))
    record("ddp", f"cpu-gloo-w2-{name}", result)


@pytest.mark.parametrize("name", list(MODELS))
def test_ddp_python_comm_hook_cpu_world2(name: str) -> None:
    res = run_distributed(_bench, world_size=2, args=(name, True), timeout=900)[0]
    result = {"model": name, "params": res["params"], "tensors": res["tensors"], "world_size": 2,
              "backend": "gloo", "hook": "python all-reduce mean (same on both)",
              "fastddp_step_ms": res["fastddp"] * 1e3, "torch_step_ms": res["torch"] * 1e3,
              "time_ratio": res["fastddp"] / res["torch"],
              "command": "pytest benchmarks/bench_ddp.py -s -k python_comm_hook"}
    print(json.dumps(result, indent=1))
    record("ddp", f"cpu-gloo-w2-pyhook-{name}", result)


def _chain(layers: int) -> nn.Module:
    return nn.Sequential(*[nn.Linear(32, 32) for _ in range(layers)])


def _bench_per_tensor(rank: int, world_size: int, layers: int) -> dict:
    """Step time of a chain of ``layers`` Linear(32, 32) (2 x layers small gradients): the bare
    model, the bare model plus one 1-element all-reduce per step (the floor of a synchronous
    step), torch DDP and DDPWrapper, alternated step by step after a barrier."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    sync = torch.zeros(1)
    models = {"bare": _chain(layers), "bare_sync": _chain(layers), "torch": TorchDDP(_chain(layers)),
              "fastddp": fastddp.DDPWrapper(_chain(layers))}
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}
    x = torch.randn(16, 32)

    def step(kind: str) -> float:
        m, o = models[kind], opts[kind]
        t0 = time.perf_counter()
        o.zero_grad()
        m(x).pow(2).mean().backward()
        if kind == "bare_sync":
            dist.all_reduce(sync)
        o.step()
        return time.perf_counter() - t0

    for kind in models:
        for _ in range(3):
            step(kind)
    times: dict[str, list[float]] = {k: [] for k in models}
    for _ in range(STEPS):
        for kind in models:
            dist.barrier()
            times[kind].append(step(kind))
    return {k: statistics.median(v) for k, v in times.items()}


def test_ddp_per_tensor_cost_cpu_world2() -> None:
    """What each gradient tensor costs per step over the bare model (and over the bare model
    synchronised once per step), for a chain of 1024 Linear(32, 32): 2048 tensors, 8.5 MB."""
    layers = 16 if SMOKE else 1024
    per_rank = run_distributed(_bench_per_tensor, world_size=2, args=(layers,), timeout=900)
    res = {k: max(r[k] for r in per_rank) for k in per_rank[0]}  # a step is its slowest rank's
    tensors = 2 * layers
    result = {"model": f"chain_{layers}x_linear32", "tensors": tensors, "world_size": 2, "backend": "gloo",
              **{f"{k}_step_ms": v * 1e3 for k, v in res.items()},
              "fastddp_us_per_tensor": (res["fastddp"] - res["bare"]) / tensors * 1e6,
              "fastddp_us_per_tensor_over_sync": (res["fastddp"] - res["bare_sync"]) / tensors * 1e6,
              "torch_us_per_tensor": (res["torch"] - res["bare"]) / tensors * 1e6,
              "command": "pytest benchmarks/bench_ddp.py -s -k per_tensor"}
    print(json.dumps(result, indent=1))
    record("ddp", f"cpu-gloo-w2-per-tensor-{layers}", result)


def _bench_join(rank: int, world_size: int, name: str) -> dict:
    """Uneven inputs: rank 1 has half as many batches again as rank 0; the whole ``join()``
    loop (rank 0 standing in for its missing batches) is timed, fastddp and torch alternately."""
    torch.set_num_threads(1)
    factory, make_x = MODELS[name]
    torch.manual_seed(0)
    models = {"fastddp": fastddp.DDPWrapper(factory()), "torch": TorchDDP(factory())}
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}
    x = make_x()
    steps = STEPS + (STEPS // 2 if rank == 1 else 0)

    def loop(kind: str, n: int) -> float:
        m, o = models[kind], opts[kind]
        dist.barrier()
        t0 = time.perf_counter()
        with m.join():
            for _ in range(n):
                o.zero_grad()
                m(x).pow(2).mean().backward()
                o.step()
        return time.perf_counter() - t0

    for kind in models:  # warm-up, bucket rebuild included
        loop(kind, 3 + rank)
    times: dict[str, list[float]] = {k: [] for k in models}
    for _ in range(1 if SMOKE else 3):
        for kind in models:
            times[kind].append(loop(kind, steps))
    return {k: statistics.median(v) for k, v in times.items()} | {"steps": steps}


@pytest.mark.parametrize("name", list(MODELS))
def test_ddp_uneven_inputs_join_cpu_world2(name: str) -> None:
    res = run_distributed(_bench_join, world_size=2, args=(name,), timeout=900)
    fast, ref = max(r["fastddp"] for r in res), max(r["torch"] for r in res)
    result = {"model": name, "world_size": 2, "backend": "gloo",
              "join_steps_per_rank": "/".join(str(r["steps"]) for r in res),
              "fastddp_join_s": fast, "torch_join_s": ref, "time_ratio": fast / ref,
              "command": "pytest benchmarks/bench_ddp.py -s -k join"}
    print(json.dumps(result, indent=1))
    record("ddp", f"cpu-gloo-w2-join-{name}", result)


def _world1_step_times(name: str, device: str) -> dict:
    """One process, world size 1: the bare model, DDPWrapper (gradients passed through, its
    default in a world of one), DDPWrapper through its buckets (``FASTDDP_WORLD1_PASSTHROUGH=0``:
    the copies into the buckets a larger world makes, without the collective) and torch DDP,
    on the same model and batch, alternated; median step time of each (CUDA-synchronised)."""
    factory, make_x = MODELS[name]
    torch.manual_seed(0)
    dev = torch.device(device)
    ids = [0] if dev.type == "cuda" else None
    base = factory().to(dev)
    models: dict[str, nn.Module] = {}
    for kind in ("bare", "fastddp", "fastddp_buckets", "torch"):
        m = factory().to(dev)
        m.load_state_dict(base.state_dict())
        if kind == "fastddp_buckets":
            os.environ["FASTDDP_WORLD1_PASSTHROUGH"] = "0"
            try:
                models[kind] = fastddp.DDPWrapper(m, device_ids=ids)
            finally:
                del os.environ["FASTDDP_WORLD1_PASSTHROUGH"]
        else:
            models[kind] = (m if kind == "bare" else
                            fastddp.DDPWrapper(m, device_ids=ids) if kind == "fastddp" else
                            TorchDDP(m, device_ids=ids))
    assert models["fastddp"].bucket_report()["passthrough"]
    assert not models["fastddp_buckets"].bucket_report()["passthrough"]
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}
    x = make_x().to(dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def step(kind: str) -> float:
        m, o = models[kind], opts[kind]
        sync()
        t0 = time.perf_counter()
        o.zero_grad()
        m(x).pow(2).mean().backward()
        o.step()
        sync()
        return time.perf_counter() - t0

    for kind in models:
        for _ in range(5):
            step(kind)
    times: dict[str, list[float]] = {k: [] for k in models}
    for _ in range(STEPS * 3):
        for kind in models:
            times[kind].append(step(kind))
    return {k: statistics.median(v) for k, v in times.items()}


def _cpu_world1_rank(rank: int, world_size: int, name: str) -> dict:
    torch.set_num_threads(1)
    return _world1_step_times(name, "cpu")


def _world1(name: str, backend: str) -> None:
    if backend == "gloo":  # in a spawned rank with its own gloo group, one thread
        res = run_distributed(_cpu_world1_rank, world_size=1, args=(name,), timeout=900)[0]
    else:
        from fastddp._net import free_port

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        dist.init_process_group(backend, rank=0, world_size=1)
        try:
            res = _world1_step_times(name, "cuda")
        finally:
            dist.destroy_process_group()
    result = {"model": name, "world_size": 1, "backend": backend,
              "bare_step_ms": res["bare"] * 1e3, "fastddp_step_ms": res["fastddp"] * 1e3,
              "fastddp_buckets_step_ms": res["fastddp_buckets"] * 1e3,
              "torch_step_ms": res["torch"] * 1e3,
              "fastddp_overhead": res["fastddp"] / res["bare"] - 1,
              "fastddp_buckets_overhead": res["fastddp_buckets"] / res["bare"] - 1,
              "torch_overhead": res["torch"] / res["bare"] - 1,
              "command": "pytest benchmarks/bench_ddp.py -s" + (" -m cuda" if backend == "nccl" else "")}
    print(json.dumps(result, indent=1))
    record("ddp", f"{'gpu' if backend == 'nccl' else 'cpu'}-{backend}-w1-{name}", result)


@pytest.mark.parametrize("name", list(MODELS))
def test_ddp_overhead_cpu_gloo_world1(name: str) -> None:
    _world1(name, "gloo")


@pytest.mark.cuda
@pytest.mark.parametrize("name", list(MODELS))
def test_ddp_overhead_gpu_nccl_world1(name: str) -> None:
    _world1(name, "nccl")
