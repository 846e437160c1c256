"""DDPWrapper's shared-memory all-reduce for co-located CPU ranks: the ranks agree on the
transport, nothing is left in /dev/shm, and a dead or stuck peer fails the collective with a
clear error instead of hanging. (Gradient parity with torch DDP over this transport is in
test_ddp.py, which runs its whole suite over both transports.)"""

from __future__ import annotations

import datetime
import gc
import glob
import os
import queue
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import fastddp
from fastddp._ext import C
from fastddp.train import lost_peer_message
from tests import forking


def _rank0_segments() -> list[str]:
    pids = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    return glob.glob(f"/dev/shm/fastddp-{pids[0]}-*")


def _auto_transport(rank: int, world_size: int) -> tuple[str, list[str]]:
    torch.manual_seed(0)
    auto = fastddp.DDPWrapper(nn.Linear(8, 8))
    dist.barrier()  # rank 0 unlinks the name right after the handshake's last collective
    auto(torch.ones(2, 8)).sum().backward()
    return auto.transport, _rank0_segments()


def test_ranks_agree_on_shared_memory_and_leave_nothing_in_dev_shm(ranks) -> None:
    assert ranks.run(_auto_transport, world_size=3) == [("shm", [])] * 3


def _one_rank_opts_out(rank: int, world_size: int) -> tuple[str, str]:
    """One rank opts out: every rank falls back to the process group, none hangs."""
    mixed = fastddp.DDPWrapper(nn.Linear(8, 8), shm_allreduce=False if rank == 1 else None)
    mixed(torch.ones(2, 8)).sum().backward()
    return mixed.transport, mixed.bucket_report()["transport_note"]


def test_one_rank_opting_out_moves_every_rank_to_the_process_group(ranks) -> None:
    for transport, note in ranks.run(_one_rank_opts_out, world_size=3):
        assert transport == "c10d" and "disabled on some rank" in note, (transport, note)


def _forced(rank: int, world_size: int) -> tuple[str, bool, list[str]]:
    forced = fastddp.DDPWrapper(nn.Linear(8, 8), shm_allreduce=True)
    x = torch.full((2, 8), float(rank + 1))
    forced(x).sum().backward()
    # d(sum(Wx+b))/dW[i, j] = sum over the batch of x[j] = 2 * (rank + 1); averaged over ranks
    expected = 2 * sum(r + 1 for r in range(world_size)) / world_size
    return forced.transport, bool(torch.equal(forced.module.weight.grad, torch.full((8, 8), expected))), \
        _rank0_segments()


def test_forced_shared_memory_averages_the_gradients(ranks) -> None:
    assert ranks.run(_forced, world_size=3) == [("shm", True, [])] * 3


class _Buffers(nn.Module):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("stats", torch.full((3, 5), float(rank)))
        self.register_buffer("count", torch.tensor(rank, dtype=torch.int64))
        self.register_buffer("strided", torch.full((6, 4), float(rank)).t())  # non-contiguous

    def forward(self, x):
        return self.lin(x) + self.stats.sum() + self.strided.sum()


def _wrapper_collected_in_a_forked_child(rank: int, world_size: int) -> int | None:
    with forking.garbage_kept_until_forked():
        model = fastddp.DDPWrapper(nn.Linear(8, 8), shm_allreduce=True)
        model(torch.ones(2, 8)).sum().backward()  # its comm thread now waits for work
        cycle: dict[str, Any] = {"model": model}
        cycle["self"] = cycle
        del model, cycle
        return forking.child_collects_within(30)


def test_forked_child_frees_a_wrapper_left_in_a_reference_cycle(ranks) -> None:
    """A forked child (a DataLoader worker) that collects a DDPWrapper left in a reference
    cycle frees its shared-memory transport without joining the parent's comm thread or
    destroying the condition variable that thread waits on (which would hang the child)."""
    assert ranks.run(_wrapper_collected_in_a_forked_child, world_size=2) == [0, 0]


def _forward_in_a_forked_child(rank: int, world_size: int) -> str | None:
    model = fastddp.DDPWrapper(_Buffers(rank), shm_allreduce=True)
    x = torch.ones(2, 4)
    for _ in range(2):  # the second forward rebuilds the buckets (over gloo): done before the fork
        model(x).sum().backward()
    return forking.child_error_within(lambda: model(x), 30)


def test_a_forked_child_cannot_run_the_wrappers_collectives(ranks) -> None:
    """A forward in a forked child (a DataLoader worker) would publish into its parent's slot
    of the mapping, or wait for a comm thread the child does not have: it fails, naming the fix."""
    for message in ranks.run(_forward_in_a_forked_child, world_size=2):
        assert message is not None and "is a fork of rank" in message and "ddp.module" in message, message


def _buffers(rank: int, world_size: int) -> list:
    model = fastddp.DDPWrapper(_Buffers(rank))  # construction broadcasts (c10d) once
    with torch.no_grad():  # diverge again: every forward must bring rank 0's values back
        for b in model.module.buffers():
            b.fill_(rank + 10)
    model(torch.ones(2, 4)).sum().backward()
    return [model.transport, *(b.tolist() for b in model.module.buffers())]


def test_buffers_broadcast_from_rank_0_through_shared_memory(ranks) -> None:
    results = ranks.run(_buffers, world_size=3)
    assert results[0][0] == "shm"
    assert all(r == results[0] for r in results)
    assert results[0][1:] == [[[10.0] * 5] * 3, 10, [[10.0] * 6] * 4]


def _forward_on_rank_0_only(rank: int, world_size: int) -> list[str]:
    """Rank 0 runs one forward more than the others (a loss it never backwards): its buffer
    broadcast meets rank 1's bucket all-reduce."""
    torch.manual_seed(0)
    model = fastddp.DDPWrapper(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)))
    assert model.transport == "shm"
    x = torch.randn(4, 8)
    model(x).sum().backward()
    if rank == 0:
        model(x)
    with pytest.raises(dist.DistBackendError) as info:
        model(x).sum().backward()
    return str(info.value).split("\n")[0]


def test_ranks_that_issued_different_collectives_both_fail_naming_them(ranks) -> None:
    """Instead of reading a broadcast as a gradient chunk and waiting for the process group's
    timeout (30 min; the case's is 60 s): the rank that sees the difference names both
    collectives, the other names it."""
    first, second = ranks.run(_forward_on_rank_0_only, world_size=2, timeout=60)
    assert "the ranks issued different collectives" in second, second
    assert "an all-reduce of 424 bytes of Float (a gradient bucket, in a backward) on rank 1" in second, second
    assert "a broadcast of 192 bytes of module buffers from rank 0 (in a forward) on rank 0" in second, second
    assert "ddp.module" in second, second
    assert "rank 1 stopped in collective" in first and "its error says why" in first, first


def _step_more_on_rank_1(rank: int, world_size: int) -> str:
    """Rank 1 trains one step more than rank 0, which destroys its wrapper after its last step
    (its process lives on, as a notebook's or a pool's does)."""
    torch.manual_seed(0)
    model = fastddp.DDPWrapper(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)))
    assert model.transport == "shm"
    x = torch.randn(4, 8)
    for _ in range(2):  # the buckets are rebuilt (over c10d) before the second forward
        model(x).sum().backward()
    if rank == 0:
        del model
        gc.collect()
        return ""
    loss = model(x).sum()
    with pytest.raises(dist.DistBackendError) as info:
        loss.backward()
    return str(info.value)


def test_rank_waiting_for_a_destroyed_wrapper_fails_naming_it(ranks) -> None:
    """Instead of waiting for the process group's timeout (30 min; the case's is 60 s) for a
    peer whose process is alive but whose wrapper is gone: the waiting rank fails at once,
    naming the peer, its last collective and the one it waits in."""
    _, message = ranks.run(_step_more_on_rank_1, world_size=2, timeout=60)
    assert ("rank 0 destroyed its DDPWrapper after its last collective (an all-reduce of 360 bytes of Float (a "
            "gradient bucket, in a backward), from collective 2 on), while rank 1 waits for it in collective 3, an "
            "all-reduce of 360 bytes of Float") in message, message
    assert "rank 1 ran a forward (gradients on) or a backward that rank 0 did not" in message, message


def _world_one(rank: int, world_size: int) -> str:
    with pytest.raises(ValueError, match="shm_allreduce=True needs CPU parameters and more than one process"):
        fastddp.DDPWrapper(nn.Linear(4, 4), shm_allreduce=True)
    model = fastddp.DDPWrapper(nn.Linear(4, 4))
    ref = torch.nn.parallel.DistributedDataParallel(nn.Linear(4, 4))
    ref.module.load_state_dict(model.module.state_dict())
    x = torch.randn(3, 4)
    for m in (model, ref):
        m(x).pow(2).sum().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))
    # the sum over one rank is the bucket itself: no collective is issued
    return model.transport, [b["allreduce_ms"] for b in model.bucket_report()["buckets"]]


def test_world_of_one_issues_no_collective(ranks) -> None:
    assert ranks.run(_world_one, world_size=1) == [("c10d", [0.0])]


def _faulty_peer(rank: int, init_file: str, fault: str, results) -> None:
    """Rank 1 takes part in two steps, then dies (`exit`) or stops calling collectives
    (`stall`); rank 0 reports how its next backward ended."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=3))
    model = fastddp.DDPWrapper(nn.Linear(64, 64))
    assert model.transport == "shm"
    for _ in range(2):  # the second forward rebuilds the buckets (a gloo broadcast)
        model(torch.randn(4, 64)).sum().backward()
    if rank == 1:
        if fault == "exit":
            os._exit(3)
        time.sleep(20)
        os._exit(0)
    start = time.monotonic()
    try:
        model(torch.randn(4, 64)).sum().backward()
        results.put(("no error", "", time.monotonic() - start, None))
    except Exception as exc:
        results.put((type(exc).__name__, str(exc), time.monotonic() - start, lost_peer_message(exc, 0, 2)))
    results.close()
    results.join_thread()  # flushed before the hard exit (a clean one would wait for gloo)
    os._exit(0)


@pytest.mark.parametrize("fault", ["exit", "stall"])
def test_dead_or_stuck_peer_fails_the_collective_clearly(fault: str) -> None:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_faulty_peer, args=(r, os.path.join(tmp, "init"), fault, results))
                 for r in range(2)]
        for p in procs:
            p.start()
        try:
            kind, text, waited, line = results.get(timeout=60)
        except queue.Empty:
            pytest.fail(f"rank 0 reported nothing: exit codes {[p.exitcode for p in procs]}")
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
    assert kind == "DistBackendError", (kind, text)
    if fault == "exit":
        # found by the liveness check ("exited"), not by the 3 s timeout ("timed out")
        assert "rank 1" in text and "exited" in text and "timed out" not in text, (text, waited)
        assert line is not None and "lost contact with the other ranks" in line and "rank 1 died" in line, line
    else:
        # a live peer is waited for the whole timeout, not given up on earlier
        assert "timed out after 3000 ms waiting for rank 1" in text and waited >= 3, (text, waited)


def _small_dev_shm(rank: int, world_size: int) -> tuple[str, str, list[str], bool, list[str]]:
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = fastddp.DDPWrapper(nn.Linear(512, 1024))  # 2 MiB of gradients per rank
    dist.barrier()
    leftovers = glob.glob("/dev/shm/fastddp-*")  # this tmpfs is private to the test
    x = torch.full((2, 512), float(rank + 1))
    model(x).sum().backward()
    expected = 2 * sum(r + 1 for r in range(world_size)) / world_size
    return (model.transport, model.bucket_report()["transport_note"], [str(w.message) for w in caught],
            bool(torch.equal(model.module.weight.grad, torch.full((1024, 512), expected))), leftovers)


_SMALL_SHM_SCRIPT = """
import json, sys
from tests.distributed import run_distributed
from tests.test_shm_allreduce import _small_dev_shm
if __name__ == "__main__":
    print(json.dumps(run_distributed(_small_dev_shm, world_size=2)))
"""


def _run_in_small_dev_shm(tmp_path: Path, size: str) -> list:
    """_small_dev_shm on two ranks, in a mount namespace whose /dev/shm is a tmpfs of `size`."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare(1) to mount a small tmpfs on /dev/shm")
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot create a mount namespace here: {probe.stderr.decode().strip()}")
    script = tmp_path / "small_shm.py"
    script.write_text(_SMALL_SHM_SCRIPT)
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(root)])))
    # A sanitizer runtime preloaded for Python (scripts/sanitize.sh) is handed to Python only:
    # unshare, sh and mount are not built for it (TSan's crashes them).
    preload = env.pop("LD_PRELOAD", "")
    python = f"env LD_PRELOAD={shlex.quote(preload)} {sys.executable}" if preload else sys.executable
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-c",
         f"mount -t tmpfs -o size={size} tmpfs /dev/shm && exec {python} {script}"],
        cwd=root, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_gradients_larger_than_dev_shm_reduce_through_it(tmp_path: Path) -> None:
    """A container's /dev/shm is often 64 MB, less than many models' gradients: the mapping
    holds fixed-size chunks, not the gradients, so 4 MiB of gradients (two ranks) go through a
    1 MiB /dev/shm, exactly, and nothing is left there."""
    for rank, (transport, note, warned, grad_ok, leftovers) in enumerate(_run_in_small_dev_shm(tmp_path, "1m")):
        assert transport == "shm" and grad_ok and leftovers == [] and warned == [], (rank, transport, note, warned)


def test_too_small_dev_shm_falls_back_with_a_warning(tmp_path: Path) -> None:
    """Where even the chunks do not fit, the ranks train through the process group and rank 0
    says why (instead of dying of SIGBUS later)."""
    results = _run_in_small_dev_shm(tmp_path, "128k")
    for rank, (transport, note, _warned, grad_ok, leftovers) in enumerate(results):
        assert transport == "c10d" and grad_ok and leftovers == [], (rank, transport, note, leftovers)
        assert "No space left on device" in note or rank != 0, (rank, note)
    assert any("not shared memory" in w and "/dev/shm" in w for w in results[0][2]), results[0][2]
    assert results[1][2] == [], results[1][2]


def _grad_stats(rank: int, world_size: int, shm: bool, comm_dtype) -> list:
    # The reducer's AMP statistics (sum of squares of the reduced buckets) come out of the
    # shared-memory reduction itself on that transport, and from a separate pass on gloo: both
    # must equal the sum of squares of the buckets as they end up, on every rank. The fourth
    # backward poisons one rank's gradients: the statistics turn non-finite everywhere.
    torch.manual_seed(0)
    model = fastddp.DDPWrapper(nn.Sequential(nn.Linear(300, 200), nn.Linear(200, 7)), bucket_cap_mb=0.004,
                               shm_allreduce=shm, comm_dtype=comm_dtype)
    visitor = C.amp_bucket_stats()
    model.register_bucket_visitor(visitor)
    g = torch.Generator().manual_seed(rank)
    out = []
    for step in range(4):
        model.zero_grad()
        poison = float("nan") if (step == 3 and rank == 1) else 1.0
        (model(torch.randn(5, 300, generator=g)).square().sum() * poison).backward()
        stats = C.amp_take_bucket_stats(visitor)
        expected = sum(float(b.double().square().sum()) for b in model.bucket_buffers())
        out.append((model.transport, len(model.bucket_buffers()), float(stats), expected))
    return out


@pytest.mark.parametrize("shm", [True, False])
@pytest.mark.parametrize("comm_dtype", [None, torch.bfloat16])
def test_reducer_grad_stats_equal_the_reduced_buckets(ranks, shm: bool, comm_dtype) -> None:
    results = ranks.run(_grad_stats, world_size=3, args=(shm, comm_dtype))
    for rows in results:
        for step, (transport, buckets, stats, expected) in enumerate(rows):
            # one bucket until the rebuild, as torch DDP's
            assert transport == ("shm" if shm else "c10d") and (buckets > 1 or step == 0)
            if step < 3:
                assert stats == pytest.approx(expected, rel=1e-12), (step, rows)
                assert stats == results[0][step][2]  # every rank reaches the same statistics
            else:
                assert stats != stats, rows  # NaN on every rank
