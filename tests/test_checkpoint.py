"""Checkpoints: atomic replace, checksum detection, fallback to the previous good file."""

from __future__ import annotations

import threading

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


@pytest.mark.parametrize("asynchronous", [True, False])
def test_writer_snapshots_and_keeps_order(tmp_path, asynchronous) -> None:
    saver = checkpoint.CheckpointWriter(asynchronous=asynchronous)
    state = _state(1)
    saver.save(state, tmp_path / "last.pt")
    state["w"].fill_(7.0)  # training goes on changing the tensors: the file keeps the snapshot
    saver.save(_state(2), tmp_path / "last.pt")
    saver.save(_state(3), tmp_path / "best.pt")
    saver.flush()
    assert checkpoint.load(tmp_path / "last.pt")["epoch"] == 2
    torch.testing.assert_close(checkpoint.load(tmp_path / "last.pt.prev")["w"], torch.full((64,), 1.0))
    assert checkpoint.load(tmp_path / "best.pt")["epoch"] == 3
    saver.close()
    saver.save(_state(4), tmp_path / "last.pt")  # a closed writer starts again
    saver.close()
    assert checkpoint.load(tmp_path / "last.pt")["epoch"] == 4
    assert not any(t.name == "fastddp-checkpoint-writer" for t in threading.enumerate())


@pytest.mark.parametrize("asynchronous", [True, False])
def test_writer_error_names_the_file_and_keeps_the_previous(tmp_path, asynchronous) -> None:
    saver = checkpoint.CheckpointWriter(asynchronous=asynchronous)
    path = tmp_path / "last.pt"
    saver.save(_state(1), path)
    saver.flush()
    # A directory where the temp file should go: the write fails with EISDIR.
    (tmp_path / "last.pt.tmp").mkdir()
    with pytest.raises(OSError, match=r"checkpoint .*last\.pt could not be written .*previous one is "
                                      r"intact.*free space and permissions"):
        saver.save(_state(2), path)
        saver.flush()
    saver.close()  # the error was raised once; closing does not raise it again
    assert checkpoint.load(path)["epoch"] == 1
