"""Checkpoints: atomic replace, checksum detection, fallback to the previous good file."""

from __future__ import annotations

import threading
import time

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
    with pytest.warns(UserWarning, match="truncated or corrupted"):
        state = checkpoint.load(path)
    assert state["epoch"] == 1


def test_corrupt_without_previous_is_clear_error(tmp_path) -> None:
    path = tmp_path / "last.pt"
    checkpoint.save(_state(1), path)
    path.write_bytes(path.read_bytes()[:10])
    with pytest.raises(checkpoint.CheckpointError, match=r"truncated or corrupted.*--resume none"):
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
    with pytest.raises(checkpoint.CheckpointWriteError,
                       match=r"last\.pt could not be written .*previous one is intact\. Free space"):
        saver.save(_state(2), path)
        saver.flush()
    saver.close()  # the error was raised once; closing does not raise it again
    assert checkpoint.load(path)["epoch"] == 1


def test_writer_check_raises_a_failed_write_without_waiting(tmp_path) -> None:
    """check() (called by the training loop every step) raises the background write's error
    as soon as it happened, without a flush: a full disk stops training within a step."""
    saver = checkpoint.CheckpointWriter()
    (tmp_path / "last.pt.tmp").symlink_to("/dev/full")  # the write fails with ENOSPC
    saver.save(_state(1), tmp_path / "last.pt")
    deadline = time.monotonic() + 30
    with pytest.raises(checkpoint.CheckpointWriteError, match=r"last\.pt could not be written \(No space"):
        while time.monotonic() < deadline:
            saver.check()
            time.sleep(0.001)
    saver.close()
    assert not (tmp_path / "last.pt").exists()


def _legacy_save(state: dict, path) -> None:
    """The sidecar-digest layout: a plain torch.save file, its SHA-256 in ``<name>.sha256`` beside."""
    import hashlib
    import io

    buf = io.BytesIO()
    torch.save(state, buf)
    path.write_bytes(buf.getvalue())
    path.with_name(path.name + ".sha256").write_text(hashlib.sha256(buf.getvalue()).hexdigest())


def test_checkpoint_is_a_plain_torch_file_with_its_digest_inside(tmp_path) -> None:
    path = tmp_path / "last.pt"
    checkpoint.save(_state(1), path)
    assert torch.load(path)["epoch"] == 1  # torch.load reads it as it is
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]
    data = bytearray(path.read_bytes())
    data[40] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(checkpoint.CheckpointError, match="checksum mismatch"):
        checkpoint.verify(path)


def test_sidecar_digest_layout_loads_and_is_verified(tmp_path) -> None:
    path = tmp_path / "last.pt"
    _legacy_save(_state(1), path)
    assert checkpoint.load(path)["epoch"] == 1
    checkpoint.save(_state(2), path)  # upgrading: the previous keeps its checksum file
    assert checkpoint.verify(path)["epoch"] == 2
    assert checkpoint.verify(tmp_path / "last.pt.prev")["epoch"] == 1
    assert not (tmp_path / "last.pt.sha256").exists()
    _legacy_save(_state(3), path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(checkpoint.CheckpointError, match="checksum mismatch"):
        checkpoint.verify(path)


def _newest(path):
    return checkpoint.latest(path)


@pytest.mark.parametrize("layout", ["current", "earlier"])
def test_crash_after_each_call_of_a_save(tmp_path, layout) -> None:
    """The writer stopped after each of its file-system calls in turn (1, 2, ... until the save
    completes): last.pt is always a complete checkpoint, the newest complete state is found,
    and the next save works."""
    from tests import fsfault

    for k in range(1, 100):
        d = tmp_path / f"k{k}"
        d.mkdir()
        path = d / "last.pt"
        for epoch in (1, 2):
            (_legacy_save if layout == "earlier" else checkpoint.save)(_state(epoch), path)
        fsfault.install(k, action="raise")
        try:
            checkpoint.save(_state(3), path)
            done = True
        except fsfault.Crash:
            done = False
        finally:
            fsfault.uninstall()
        assert checkpoint.verify(path)["epoch"] in (2, 3)
        found = _newest(path)
        # call 2 writes the whole new file: from then on it is the newest complete state
        assert found.state["epoch"] == (3 if k >= 2 else 2), (k, found)
        checkpoint.save(_state(4), path)  # the next run's save
        assert _newest(path).state["epoch"] == 4 and checkpoint.verify(path)["epoch"] == 4
        assert checkpoint.verify(d / "last.pt.prev")["epoch"] in (2, 3)
        if done:
            # open, write, fsync, close, link, replace (.prev), replace, the directory's open,
            # fsync, close; the sidecar-digest layout adds the .prev digest (5 calls) and an unlink
            assert k - 1 == {"current": 10, "earlier": 16}[layout], k  # k - 1 calls, no crash
            return
    raise AssertionError("the save never completed")


def test_latest_refuses_when_no_checkpoint_verifies(tmp_path) -> None:
    path = tmp_path / "last.pt"
    checkpoint.save(_state(1), path)
    checkpoint.save(_state(2), path)
    for name in ("last.pt", "last.pt.prev"):
        f = tmp_path / name
        f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(checkpoint.CheckpointError, match=r"no checkpoint in .* verifies.*--resume none"):
        _newest(path)
    assert (tmp_path / "last.pt").stat().st_size == 100  # nothing was touched


def test_latest_takes_a_complete_temporary_and_skips_a_partial_one(tmp_path) -> None:
    path = tmp_path / "last.pt"
    assert _newest(path) is None
    (tmp_path / "last.pt.tmp").write_bytes(b"PK\x03\x04partial")
    assert _newest(path) is None  # a crash during the first write: nothing to resume
    checkpoint.save(_state(1), path)
    (tmp_path / "last.pt.tmp").write_bytes(checkpoint._serialize(_state(2)))
    found = _newest(path)
    assert found.state["epoch"] == 2 and found.path.name == "last.pt.tmp"
    path.write_bytes(path.read_bytes()[:50])
    (tmp_path / "last.pt.tmp").write_bytes(b"partial")
    with pytest.raises(checkpoint.CheckpointError, match=r"last\.pt: no checksum"):
        _newest(path)


def test_latest_goes_by_write_order_not_by_step(tmp_path) -> None:
    """A run started over (--resume none) after a longer one: its first save keeps the longer
    run's checkpoint as last.pt.prev, which holds more steps, but last.pt is the newer."""
    path = tmp_path / "last.pt"
    checkpoint.save(_state(40), path)  # the run before, further on
    checkpoint.save(_state(1), path)  # the run started over
    found = _newest(path)
    assert found.path == path and found.state["epoch"] == 1
    (tmp_path / "last.pt.tmp").write_bytes(checkpoint._serialize(_state(2)))
    assert _newest(path).path.name == "last.pt.tmp"  # written after last.pt: its rename cut off
    found = checkpoint.latest(path, accept=lambda s: s["epoch"] > 10)
    assert found.path.name == "last.pt.prev" and found.state["epoch"] == 40
    assert checkpoint.latest(path, accept=lambda s: False) is None
