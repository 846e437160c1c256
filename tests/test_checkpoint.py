"""Checkpoints: atomic replace, checksum detection, fallback to the previous good file."""

from __future__ import annotations

import pytest
import torch

from fastddp.train import checkpoint


def _state(v: float) -> dict:
    return {"w": torch.full((64,), float(v)), "epoch": int(v)}


def test_round_trip_and_previous_kept(tmp_path) -> None:
    path = tmp_path / "last.pt"
    checkpoint.save(_state(1), path)
    checkpoint.save(_state(2), path)
    assert checkpoint.load(path)["epoch"] == 2
    assert (tmp_path / "last.pt.prev").exists()
    torch.testing.assert_close(checkpoint.load(tmp_path / "last.pt.prev")["w"], torch.full((64,), 1.0))


def test_interrupted_write_leaves_last_intact(tmp_path) -> None:
    path = tmp_path / "last.pt"
    checkpoint.save(_state(1), path)
    # A writer killed mid-write leaves only a partial temp file behind.
    (tmp_path / "last.pt.tmp").write_bytes(b"\x80\x02partial")
    assert checkpoint.load(path)["epoch"] == 1


@pytest.mark.parametrize("damage", ["truncate", "bitflip"])
def test_corruption_detected_and_previous_used(tmp_path, damage) -> None:
    path = tmp_path / "last.pt"
    checkpoint.save(_state(1), path)
    checkpoint.save(_state(2), path)
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="checksum mismatch"):
        state = checkpoint.load(path)
    assert state["epoch"] == 1


def test_corrupt_without_previous_is_clear_error(tmp_path) -> None:
    path = tmp_path / "last.pt"
    checkpoint.save(_state(1), path)
    path.write_bytes(path.read_bytes()[:10])
    with pytest.raises(checkpoint.CheckpointError, match=r"checksum mismatch.*--resume none"):
        checkpoint.load(path)
