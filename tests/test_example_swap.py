"""examples/client_swap.py trained stock and with fastddp's classes swapped in: the losses,
gradient norms, loss scales, checkpoints and global RNG state must agree bit for bit on CPU.

The script runs once (two gloo ranks) with four configurations in a row: stock, and three
swaps, each adding classes, so a difference names the class it comes from.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNS = {"stock": "none", "sampler+scaler": "sampler,scaler", "ddp+sampler+scaler": "ddp,sampler,scaler",
        "all": "all"}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("swap") / "results.json"
    cmd = [sys.executable, str(ROOT / "examples" / "client_swap.py"), "--out", str(out)]
    for swap in RUNS.values():
        cmd += ["--swap", swap]
    # The example imports the fastddp this interpreter imports (installed, or the working tree
    # through the caller's PYTHONPATH), as a user's script would.
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return dict(zip(RUNS, json.loads(out.read_text())))


def _assert_same_run(stock: list[dict], swapped: list[dict]) -> None:
    for rank, (want, got) in enumerate(zip(stock, swapped)):
        for key in want:  # losses step by step first: the earliest difference is the telling one
            if want[key] != got[key]:
                first = next((i for i, (a, b) in enumerate(zip(want[key], got[key])) if a != b), None) \
                    if isinstance(want[key], list) else None
                pytest.fail(f"rank {rank}: {key} differs from the stock run (first at index {first})")


def test_stock_run_sees_every_batch(results) -> None:
    for rank_result in results["stock"]:
        assert rank_result["peek"] == 8 and rank_result["batches"] == [13, 13, 13]
        assert len(rank_result["losses"]) == 39


def test_sampler_and_scaler_swapped(results) -> None:
    _assert_same_run(results["stock"], results["sampler+scaler"])


def test_ddp_sampler_and_scaler_swapped(results) -> None:
    _assert_same_run(results["stock"], results["ddp+sampler+scaler"])


def test_all_four_swapped(results) -> None:
    _assert_same_run(results["stock"], results["all"])
