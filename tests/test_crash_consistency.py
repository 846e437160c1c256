"""Crash consistency of fastddp.train's checkpoints, enumerated and at random.

A training process is stopped (``os._exit``, as a SIGKILL stops it) after each file-system call
of an epoch's saves (``tests/fsfault.py`` numbers them), in a single process, where the
background writer thread writes, and on rank 0 of two gloo ranks. After each crash the next
``--resume auto`` must continue from the newest complete checkpoint and finish with the same
``metrics.csv``, ``best.pt`` and ``last.pt`` as a run never stopped. The runs are forkserver
children of a server that imported torch once, so each costs a fraction of a second.
"""

from __future__ import annotations

import functools
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

from fastddp.train import checkpoint
from tests import trainer_runs

VALUES = ("epoch", "train_loss", "train_acc", "val_loss", "val_acc", "val_f1", "lr")
# A data set the model learns from at once: validation F1 rises every epoch, so each epoch's
# saves include best.pt (on the default tiny data F1 wanders around chance).
BASE = [*trainer_runs.ARGS, "--dataset", "tiny_har:learnable", "--warmup-epochs", "0",
        "--lr", "0.003"]
_launch = functools.partial(trainer_runs.launch, base=BASE)
_run = functools.partial(trainer_runs.run, base=BASE)
_metrics = trainer_runs.metrics


@pytest.fixture(scope="module")
def data_path(tmp_path_factory) -> str:
    return trainer_runs.write_data(tmp_path_factory.mktemp("data"))


def _same_rows(got: list[dict[str, str]], want: list[dict[str, str]]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want):
        for k in VALUES:
            assert float(a[k]) == pytest.approx(float(b[k]), rel=1e-6, abs=1e-9), (k, a, b)


def _same_best(got: Path, want: Path) -> None:
    a, b = checkpoint.verify(got / "best.pt"), checkpoint.verify(want / "best.pt")
    assert a["epoch"] == b["epoch"]
    for name, tensor in b["model"].items():
        torch.testing.assert_close(a["model"][name], tensor, rtol=1e-6, atol=1e-9)


def _ops(log: Path) -> list[tuple[int, str, str]]:
    return [(int(n), op, f) for n, op, f in (line.split() for line in log.read_text().splitlines())]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_path) -> dict:
    """Uninterrupted runs (one and two ranks) with every call logged."""
    refs = {}
    for world in (1, 2):
        root = tmp_path_factory.mktemp(f"ref{world}")
        log = root / "ops.txt"
        codes, out = _run(root / "run", data_path, ["--resume", "none"], log=str(log), world=world)
        assert codes == [0] * world, out
        refs[world] = (root / "run", _ops(log))
    return refs


def _crash_and_resume(tmp_path: Path, data_path: str, k: int, complete: int, ref: Path,
                      world: int) -> None:
    save = tmp_path / f"k{k}"
    codes, out = _run(save, data_path, [], exit_after=k, world=world)
    assert codes[0] == 137, out  # the writer stopped after call k
    # Nothing finished is damaged: metrics.csv is a prefix of the reference, best.pt verifies.
    rows = _metrics(save)
    _same_rows(rows, _metrics(ref)[: len(rows)])
    checkpoint.verify(save / "best.pt")
    codes, out = _run(save, data_path, ["--resume", "auto"], world=world)
    assert codes == [0] * world, out
    start = 3 if k >= complete else 2
    steps = 6 // world  # per epoch
    assert f"at epoch {start}, step {steps * (start - 1)}" in out, (k, complete, out)
    _same_rows(_metrics(save), _metrics(ref))
    _same_best(save, ref)
    last = checkpoint.verify(save / "last.pt")
    assert (last["epoch"], last["step"], last["epoch_done"]) == (2, 3 * steps, True)
    # (epoch 1's when the resume took epoch 2's complete last.pt.tmp: last.pt was epoch 1's then)
    assert checkpoint.verify(save / "last.pt.prev")["step"] in (steps, 2 * steps)


def test_crash_after_each_call_of_an_epochs_saves(tmp_path, data_path, reference) -> None:
    """Single process: the background writer thread of epoch 2 (best.pt, last.pt and
    metrics.csv) stopped after each of its calls in turn."""
    ref, ops = reference[1]
    metrics = [n for n, op, f in ops if op == "replace" and f == "metrics.csv"]
    calls = range(metrics[0] + 4, metrics[1] + 4)  # each after the directory fsync's 3 calls
    names = {f for n, op, f in ops if n in calls}
    assert {"best.pt", "last.pt", "last.pt.prev", "metrics.csv"} <= names, names
    opens = [n for n, op, f in ops if op == "open" and f == "last.pt.tmp"]
    complete = next(n for n, op, f in ops if n > opens[1] and op == "write")
    for k in calls:
        _crash_and_resume(tmp_path, data_path, k, complete, ref, world=1)


def test_crash_after_each_call_on_rank_0_of_two(tmp_path, data_path, reference) -> None:
    """Two gloo ranks: rank 0's writer thread stopped after each call of epoch 2's last.pt."""
    ref, ops = reference[2]
    opens = [n for n, op, f in ops if op == "open" and f == "last.pt.tmp"]
    end = next(n for n, op, f in ops if n > opens[1] and op == "replace" and f == "last.pt")
    end += 3  # the directory's open, fsync and close
    complete = next(n for n, op, f in ops if n > opens[1] and op == "write")
    for k in range(opens[1], end + 1):
        _crash_and_resume(tmp_path, data_path, k, complete, ref, world=2)


@pytest.mark.slow
def test_sigkill_at_random_instants(tmp_path, data_path, reference) -> None:
    """Runs with a checkpoint every step, SIGKILLed at random instants, each resumed by the
    next with ``--resume auto``: after every kill the newest checkpoint verifies and
    metrics.csv is a prefix of the uninterrupted run's; each chain ends with its metrics and
    best.pt. 50 kills that found the process alive."""
    ref, _ = reference[1]
    rng = random.Random(1234)
    kills, chains, runs = 0, 0, 0
    save = tmp_path / "chain0"
    while kills < 50:
        procs = _launch(save, data_path, ["--save-interval", "1"])
        runs += 1
        time.sleep(rng.uniform(0.0, 1.2))
        if procs[0].exitcode is None:
            os.kill(procs[0].pid, signal.SIGKILL)
            kills += 1
        procs[0].join(120)
        assert procs[0].exitcode in (0, -signal.SIGKILL), (save / "..").resolve()
        found = checkpoint.latest(save / "last.pt")
        if (save / "metrics.csv").exists():
            rows = _metrics(save)
            _same_rows(rows, _metrics(ref)[: len(rows)])
            assert found is not None and len(found.state["history"]) >= len(rows)
        if procs[0].exitcode == 0:
            _same_rows(_metrics(save), _metrics(ref))
            _same_best(save, ref)
            chains += 1
            save = tmp_path / f"chain{chains}"
    print(f"{kills} kills in {runs} runs, {chains} chains finished")


# The keys of last.pt, in both layouts.
KEYS = {"model", "optimizer", "scheduler", "scaler", "loader", "epoch", "step", "epoch_done",
        "best_f1", "history", "rng", "world", "mode", "signature", "settings", "run_id", "epochs"}


def test_checkpoint_of_the_sidecar_digest_layout_resumes(tmp_path, data_path, reference) -> None:
    """A run whose last.pt is a plain torch.save file with its digest in last.pt.sha256 (the
    sidecar-digest layout) continues from it and ends as the uninterrupted run."""
    import hashlib
    import io

    ref, _ = reference[1]
    save = tmp_path / "run"
    codes, out = _run(save, data_path, [], env={"FASTDDP_FAULT_KILL_AFTER_EPOCH": "1"})
    assert codes == [-signal.SIGKILL], out
    state = torch.load(save / "last.pt", weights_only=False)  # torch reads the new layout
    assert set(state) == KEYS
    for f in save.glob("last.pt*"):
        f.unlink()
    buf = io.BytesIO()
    torch.save(state, buf)
    (save / "last.pt").write_bytes(buf.getvalue())
    (save / "last.pt.sha256").write_text(hashlib.sha256(buf.getvalue()).hexdigest())
    codes, out = _run(save, data_path, [])
    assert codes == [0], out
    assert f"resumed from {save / 'last.pt'} at epoch 2, step 6" in out, out
    _same_rows(_metrics(save), _metrics(ref))
    _same_best(save, ref)
    assert set(checkpoint.verify(save / "last.pt")) == KEYS
    assert not (save / "last.pt.sha256").exists()  # replaced by the digest inside
