"""The status board, the stall watchdog's settings and the stack summaries of its reports
(the multi-rank fault matrix is tests/test_hang_reports.py)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import traceback
import weakref
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fastddp
from fastddp import diag
from fastddp._ext import C
from fastddp._net import free_port
from fastddp.diag import stacks
from fastddp.diag.watchdog import stall_threshold_s


def _frame(path: str, line: int, name: str) -> traceback.FrameSummary:
    return traceback.FrameSummary(path, line, name, lookup_line=False)


def test_summary_names_the_torch_collective_and_the_line_that_called_it() -> None:
    frames = [_frame("/job/train.py", 10, "<module>"), _frame("/job/train.py", 40, "evaluate"),
              _frame(stacks._TORCH + "distributed/c10d_logger.py", 83, "wrapper"),
              _frame(stacks._TORCH_C10D, 4000, "all_gather"), _frame(stacks._TORCH_C10D, 4100, "_inner")]
    assert stacks.summarize(frames) == "in torch.distributed.all_gather called at /job/train.py:40 in evaluate"


def test_summary_says_data_loading_and_else_the_innermost_user_line() -> None:
    loader = [_frame("/job/train.py", 12, "main"), _frame(stacks._TORCH + "utils/data/dataloader.py", 700, "__next__"),
              _frame("/job/data.py", 5, "__getitem__")]
    assert stacks.summarize(loader) == "loading data (__next__ in dataloader.py) called at /job/train.py:12 in main"
    plain = [_frame("/job/train.py", 12, "main"), _frame("/job/model.py", 30, "forward"),
             _frame(stacks._TORCH + "nn/modules/linear.py", 125, "forward")]
    assert stacks.summarize(plain) == "at /job/model.py:30 in forward"


def test_describe_thread_lists_this_test() -> None:
    import threading

    text = stacks.describe_thread(threading.get_ident())
    assert "test_describe_thread_lists_this_test" in text.splitlines()[0]


@pytest.mark.parametrize("given, env, message", [
    (0, None, "stall_threshold_s=0 s must be > 0 and below the process-group timeout (60 s)"),
    (60, None, "stall_threshold_s=60 s must be > 0"),
    (None, "90", "FASTDDP_STALL_THRESHOLD_S=90 s must be > 0"),
    (None, "soon", "FASTDDP_STALL_THRESHOLD_S must be a number of seconds, got 'soon'"),
])
def test_bad_thresholds_are_refused_naming_the_setting(monkeypatch, given, env, message) -> None:
    if env is not None:
        monkeypatch.setenv("FASTDDP_STALL_THRESHOLD_S", env)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        stall_threshold_s(given, 60.0)


def test_threshold_defaults(monkeypatch) -> None:
    monkeypatch.delenv("FASTDDP_STALL_THRESHOLD_S", raising=False)
    assert stall_threshold_s(None, 1800.0) == 30.0
    assert stall_threshold_s(None, 20.0) == 10.0  # half a short timeout
    monkeypatch.setenv("FASTDDP_STALL_THRESHOLD_S", "2.5")
    assert stall_threshold_s(None, 20.0) == 2.5
    assert stall_threshold_s(4, 20.0) == 4.0  # the argument wins


def test_native_options_are_checked() -> None:
    store = dist.HashStore()
    options = C.WatchdogOptions()
    options.world, options.threshold_s, options.timeout_s = 2, 10.0, 5.0
    with pytest.raises(RuntimeError, match=r"stall threshold \(10 s\) must be > 0 and below the process-group timeout"):
        C.Watchdog(store, options, lambda: "")
    options.threshold_s, options.rank = 1.0, 2
    with pytest.raises(RuntimeError, match="rank 2 outside a world of 2"):
        C.Watchdog(store, options, lambda: "")


_SILENT_STORE = """
import time, torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
print(store.port, flush=True)
time.sleep(600)
"""


def _client_of(server: subprocess.Popen, timeout: timedelta) -> tuple[dist.TCPStore, object]:
    """A client of the store ``server`` hosts, and watchdog options polling it every 50 ms as
    one rank of two."""
    port = int(server.stdout.readline())
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    options = C.WatchdogOptions()
    options.world, options.threshold_s, options.timeout_s, options.poll_s = 2, 5.0, 600.0, 0.05
    return store, options


def test_stop_returns_when_the_store_stops_answering(capfd) -> None:
    """A store cut off from this host (a network cut, a frozen host) leaves the watchdog's
    thread blocked in a store call: stop(), which runs at exit, must still return (and say it
    left the thread behind) instead of holding the process forever."""
    server = subprocess.Popen([sys.executable, "-c", _SILENT_STORE], stdout=subprocess.PIPE, text=True)
    try:
        store, options = _client_of(server, timedelta(seconds=600))
        options.stack_timeout_s = 1.0
        watchdog = C.Watchdog(store, options, lambda: "")
        time.sleep(0.3)  # polling the store
        os.kill(server.pid, signal.SIGSTOP)  # the store's host stops answering
        time.sleep(0.5)  # the watchdog is now inside a store call that never returns
        t0 = time.monotonic()
        watchdog.stop()
        waited = time.monotonic() - t0
        assert waited < options.poll_s + options.stack_timeout_s + 3 + 2, waited
        assert "c10d store did not answer" in capfd.readouterr().err
        os.kill(server.pid, signal.SIGKILL)  # the left-behind thread's call fails, and it ends
        deadline = time.monotonic() + 10
        while not watchdog.store_failed and time.monotonic() < deadline:
            time.sleep(0.05)  # (c10d's warning of the failed call comes within this test)
        assert watchdog.store_failed
    finally:
        os.kill(server.pid, signal.SIGKILL)
        server.wait()


class _Stack:
    def __call__(self) -> str:
        return ""


def test_a_watchdog_ended_by_its_store_releases_its_stack_function() -> None:
    """When the store's host dies, the watchdog's thread ends and holds the watchdog's last
    reference: the Python stack function goes without the thread waiting for the GIL (a wait
    that, reached while the interpreter finalizes, ends the thread inside a destructor and
    aborts the process), and is not leaked either."""
    server = subprocess.Popen([sys.executable, "-c", _SILENT_STORE], stdout=subprocess.PIPE, text=True)
    try:
        store, options = _client_of(server, timedelta(seconds=5))
        stack = _Stack()
        alive = weakref.ref(stack)
        watchdog = C.Watchdog(store, options, stack)
        del stack, watchdog  # the thread owns the watchdog now
        time.sleep(0.3)  # polling the store
        server.kill()  # its next poll fails and the thread ends
        deadline = time.monotonic() + 10
        while alive() is not None and time.monotonic() < deadline:
            time.sleep(0.05)  # the interpreter runs the pending release between bytecodes
        assert alive() is None, "the watchdog's stack function was never released"
    finally:
        server.kill()
        server.wait()


def test_phases_of_a_training_step_on_the_board(tmp_path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/init", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    try:
        model = fastddp.DDPWrapper(nn.Linear(4, 2))
        assert C.diag_snapshot()[0] == diag.Phase.OUTSIDE
        before = C.diag_snapshot()[2]
        loss = model(torch.randn(3, 4)).sum()
        assert C.diag_snapshot()[0] == diag.Phase.OUTSIDE  # forward done
        assert C.diag_snapshot()[2] == before + 1  # a reducing step started
        loss.backward()
        phase, _, started, finished, _ = C.diag_snapshot()
        assert (phase, started, finished) == (diag.Phase.OUTSIDE, before + 1, before + 1)
        with diag.phase(diag.Phase.JOIN):
            assert C.diag_snapshot()[0] == diag.Phase.JOIN
        assert C.diag_snapshot()[0] == diag.Phase.OUTSIDE
    finally:
        dist.destroy_process_group()


_STORE_HOST = """
import time, torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, world_size=3, is_master=True, wait_for_workers=False)
print(store.port, flush=True)
time.sleep(600)
"""

_RANK_OF_A_LOST_AGENT = """
import os, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
import fastddp
rank, port = int(sys.argv[1]), int(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))
model = fastddp.DDPWrapper(torch.nn.Linear(4, 2))
model(torch.randn(3, 4)).sum().backward()
print("stepped", flush=True)
sys.stdin.readline()  # the store's host is killed meanwhile
time.sleep(2.0)  # the watchdog polls it every 0.25 s
model(torch.randn(3, 4)).sum().backward()  # gloo needs no store: training goes on
print("done", flush=True)
# gloo's threads end here, not while the interpreter finalizes (docs/compatibility.md, Teardown):
# the wrapper holds the group (as torch DDP does), so it goes first
del model
dist.destroy_process_group()
"""


def test_ranks_whose_store_host_was_killed_end_without_a_store_write() -> None:
    """A SIGKILLed torchrun agent (the c10d store's host) leaves its ranks training on: they
    end as usual, and do not write their exit note into the dead store (c10d would print a
    C++ stack trace for it) once the watchdog saw the store fail. c10d's warning of that failed
    poll, at the moment the host died, is the one trace left."""
    host = subprocess.Popen([sys.executable, "-c", _STORE_HOST], stdout=subprocess.PIPE, text=True)
    port = host.stdout.readline().strip()
    env = dict(os.environ, FASTDDP_STALL_THRESHOLD_S="1", FASTDDP_SHM_ALLREDUCE="0")
    ranks = [subprocess.Popen([sys.executable, "-c", _RANK_OF_A_LOST_AGENT, str(r), port], env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in range(2)]
    try:
        assert [p.stdout.readline().strip() for p in ranks] == ["stepped"] * 2
        host.kill()
        host.wait()
        for p in ranks:
            p.stdin.write("go\n")
            p.stdin.flush()
        outs = [p.communicate(timeout=60) for p in ranks]
    finally:
        for p in (host, *ranks):
            p.kill()
    for p, (out, err) in zip(ranks, outs):
        assert p.returncode == 0 and out.strip() == "done", (p.returncode, out, err)
        assert "sendBytes failed" not in err, err  # the exit note's write
        assert err.count("Exception raised from") <= 1, err


_FORKED_CHILD_OF_A_RANK = """
import os, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
import fastddp
rank, port = int(sys.argv[1]), int(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, world_size=2, is_master=rank == 0, timeout=timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))
model = fastddp.DDPWrapper(torch.nn.Linear(4, 2))
model(torch.randn(3, 4)).sum().backward()
if rank == 1:
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:
        sys.exit(0)  # a plain fork whose child ends normally: its atexit handlers run
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    print(f"child: status {status} after {time.monotonic() - started:.1f} s", flush=True)
dist.barrier()
print("exit note of rank 1 posted:", store.check(["fastddp/diag/exit/1"]), flush=True)
dist.barrier()
"""


def test_forked_child_of_a_rank_ends_at_once_and_posts_nothing() -> None:
    """A child forked from a rank (a plain os.fork whose child returns, so its atexit handlers
    run) is not that rank ending: it posts no exit note for the others' reports, and it ends at
    once, without stopping or destroying the watchdog or the transport of the parent, whose
    threads it does not have."""
    port = str(free_port())
    ranks = [subprocess.Popen([sys.executable, "-c", _FORKED_CHILD_OF_A_RANK, str(r), port],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], outs
    status, took = re.search(r"child: status (-?\d+) after ([\d.]+) s", outs[1]).groups()
    assert status == "0" and float(took) < 5.0, outs[1]
    assert "exit note of rank 1 posted: False" in outs[0], outs[0]
