"""SIGTERM during training: the checkpoint being written in the background still reaches the
disk (torchrun SIGTERMs the surviving ranks when one fails; schedulers preempt the same way)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fastddp.train import checkpoint
from fastddp.train.signals import SigtermGuard, Terminated

ROOT = Path(__file__).resolve().parent.parent

# Every checkpoint file write of the scripts below takes 0.5 s.
_SLOW_WRITES = textwrap.dedent("""
    import time
    from fastddp.train import checkpoint

    slow = checkpoint._write_file
    def _slow_write(path, data):
        time.sleep(0.5)
        slow(path, data)
    checkpoint._write_file = _slow_write
""")

# A process queues one checkpoint whose write takes 0.5 s, then receives SIGTERM.
_SCRIPT = _SLOW_WRITES + textwrap.dedent("""
    import contextlib, os, signal, sys, time
    import torch
    from fastddp.train import checkpoint
    from fastddp.train.signals import SigtermGuard, Terminated

    guarded = sys.argv[2] == "guarded"
    saver = checkpoint.CheckpointWriter()
    with SigtermGuard() if guarded else contextlib.nullcontext() as guard:
        try:
            saver.save({"w": torch.arange(10)}, sys.argv[1])
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
        except Terminated:
            with guard.shielded():
                saver.close()
            sys.exit(143)
""")


@pytest.mark.parametrize("guarded", [True, False])
def test_sigterm_finishes_the_queued_checkpoint(tmp_path: Path, guarded: bool) -> None:
    path = tmp_path / "last.pt"
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(path),
                           "guarded" if guarded else "bare"],
                          capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    if guarded:
        assert proc.returncode == 143, proc.stderr
        assert checkpoint.load(path)["w"].tolist() == list(range(10))
    else:  # the control: Python's default SIGTERM ends the process with the write unfinished
        assert proc.returncode == -signal.SIGTERM, proc.stderr
        assert not path.exists()


@pytest.fixture
def sigterm_fallback():
    """A SIGTERM the guard fails to catch is recorded here instead of ending pytest."""
    caught: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: caught.append(signum))
    yield caught
    signal.signal(signal.SIGTERM, previous)


def test_guard_raises_once_and_not_inside_shielded(sigterm_fallback: list[int]) -> None:
    previous = signal.getsignal(signal.SIGTERM)
    with SigtermGuard() as guard:
        with guard.shielded():
            os.kill(os.getpid(), signal.SIGTERM)  # recorded, not raised
        assert guard.received
    assert signal.getsignal(signal.SIGTERM) is previous  # the guard leaves no trace
    with pytest.raises(Terminated, match="SIGTERM"):
        with SigtermGuard() as guard:
            os.kill(os.getpid(), signal.SIGTERM)  # os.kill runs the handler before returning
    with SigtermGuard() as guard:
        with pytest.raises(Terminated):
            os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # a second SIGTERM does not cut the clean-up short
        assert guard.received
    assert sigterm_fallback == []  # every SIGTERM above reached a guard


@pytest.mark.parametrize(("signame", "code", "said"), [("TERM", 143, "stopped by SIGTERM"),
                                                       ("INT", 130, "interrupted (SIGINT")])
def test_signal_mid_training_exits_cleanly_with_the_checkpoint(tmp_path: Path, signame: str,
                                                              code: int, said: str) -> None:
    """SIGTERM (torchrun, a scheduler) or SIGINT (Ctrl-C) while a checkpoint is being written:
    the write finishes and one line says how to go on."""
    argv = [sys.executable, "-m", "fastddp.train", "--epochs", "2", "--mode", "flatten",
            "--no-progress", "--num-workers", "1", "--save-interval", "40", "--save-dir",
            str(tmp_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # A process started in the background by a shell without job control (`(cmd &)`, `nohup`
    # in a script, some CI runners) inherits SIGINT ignored, and Python then leaves it ignored,
    # as it should for a background job: the trainer would never see the SIGINT. The child
    # starts with SIGINT's default when this process handles it.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.run([*argv, "--resume", "none"], cwd=ROOT, capture_output=True,
                              text=True, timeout=600,
                              env={**env, f"FASTDDP_FAULT_{signame}_AFTER_STEP": "40"})
    finally:
        signal.signal(signal.SIGINT, previous)
    assert proc.returncode == code, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if said in ln]
    assert len(lines) == 1 and "Resume with --resume auto" in lines[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    state = checkpoint.load(tmp_path / "last.pt")  # the write in flight at the signal finished
    assert (state["epoch"], state["step"], state["epoch_done"]) == (0, 40, False)


# The main thread ends without close() (an interrupt cut the clean-up short): the queued write
# still reaches the disk and the process exits.
_UNCLOSED = _SLOW_WRITES + textwrap.dedent("""
    import sys
    import torch
    from fastddp.train import checkpoint

    checkpoint.CheckpointWriter().save({"w": torch.arange(10)}, sys.argv[1])
    print("MAIN-DONE", flush=True)
""")


def test_unclosed_writer_finishes_its_write_and_lets_the_process_exit(tmp_path: Path) -> None:
    path = tmp_path / "last.pt"
    proc = subprocess.run([sys.executable, "-c", _UNCLOSED, str(path)], capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert proc.returncode == 0 and "MAIN-DONE" in proc.stdout, proc.stderr
    assert checkpoint.load(path)["w"].tolist() == list(range(10))
