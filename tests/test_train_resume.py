"""What a run continues and what it refuses to overwrite: a checkpoint resumed with flags that
change what the run computes is refused, naming the flags, before anything in --save-dir is
written (more --epochs, logging, checkpoint timing continue the run); --resume PATH run again
continues its own --save-dir; a torchrun restart of a --resume none job continues the job's
checkpoints; a --save-dir in use by another run is refused."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests import trainer_runs

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def data_path(tmp_path_factory) -> str:
    path = trainer_runs.write_data(tmp_path_factory.mktemp("data"))
    (Path(path) / "tiny_half.py").write_text(
        "from torch.utils.data import TensorDataset\n\nfrom tiny_har import make\n\n\n"
        "def first_half():\n    train, test = make()\n"
        "    return TensorDataset(*(t[:96] for t in train.tensors)), test\n\n\n"
        "def shifted():\n    train, test = make()\n"
        "    return TensorDataset(train.tensors[0] + 1, train.tensors[1]), test\n")
    return path


@pytest.fixture(scope="module")
def one_epoch(tmp_path_factory, data_path) -> Path:
    """A finished run of one epoch (default flags, tiny data)."""
    save = tmp_path_factory.mktemp("done") / "run"
    codes, out = trainer_runs.run(save, data_path, ["--epochs", "1"])
    assert codes == [0], out
    return save


def _files(save: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(save.iterdir())}


def _resume(one_epoch: Path, tmp_path: Path, data_path: str, extra: list[str],
            world: int = 1) -> tuple[Path, list[int], str]:
    save = tmp_path / "run"
    shutil.copytree(one_epoch, save)
    codes, out = trainer_runs.run(save, data_path, ["--epochs", "2", *extra], world=world)
    return save, codes, out


@pytest.mark.parametrize(("extra", "named"), [
    (["--lr", "0.01"], "--lr 0.001 (this run: 0.01)"),
    (["--batch-size", "16"], "--batch-size 32 (this run: 16)"),
    (["--seed", "7"], "--seed 42 (this run: 7)"),
    (["--weight-decay", "0"], "--weight-decay 0.01 (this run: 0.0)"),
    (["--amp"], "--amp off (this run: on)"),
    (["--dataset", "tiny_half:first_half"], "training samples (--dataset, --data-dir) 192 "
                                              "(this run: 96)"),
    (["--dataset", "tiny_half:shifted"], "training and validation data (--dataset, --data-dir): samples "),
], ids=["lr", "batch-size", "seed", "weight-decay", "amp", "data-size", "data-values"])
def test_resume_with_other_settings_is_refused_and_writes_nothing(
        one_epoch, tmp_path, data_path, extra, named) -> None:
    before = _files(one_epoch)
    save, codes, out = _resume(one_epoch, tmp_path, data_path, extra)
    assert codes == [2], out
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in out, out
    assert lines[0].startswith(f"fastddp.train: error: {save / 'last.pt'} was written by a run "
                               f"with other settings: {named}"), out
    assert re.search(r"\(this run: [^)]+\)\. Resuming it would continue neither that run nor this one; "
                     "give the checkpoint's values", lines[0]), out
    assert "start a new run with --resume none" in lines[0]
    after = _files(save)
    assert after == before  # no config.json, metrics.csv or checkpoint rewritten


def test_resume_with_more_epochs_and_other_logging_continues(one_epoch, tmp_path, data_path) -> None:
    save, codes, out = _resume(one_epoch, tmp_path, data_path,
                               ["--log-interval", "2", "--sync-checkpoints", "--save-interval", "3"])
    assert codes == [0], out
    assert f"resumed from {save / 'last.pt'} at epoch 2, step 6" in out, out
    # one epoch of warm-up (6 steps): both schedules stand at the peak at step 6
    assert ("note: --epochs 2 continues a finished run of --epochs 1: the learning-rate schedule (a "
            "cosine to 0) now ends at step 12 instead of 6 (in this run's 6 steps an epoch); at step 6 the rate "
            "is 0.001 (the "
            "checkpoint's run: 0.001)") in out, out
    assert [row["epoch"] for row in trainer_runs.metrics(save)] == ["1", "2"]


def test_resume_with_fewer_epochs_names_the_schedule_change(tmp_path, data_path) -> None:
    """An unfinished run resumed with fewer --epochs: its cosine is recomputed over the new
    total, and the run says so, with the rate before and after and how to keep it."""
    save = tmp_path / "run"
    flags = ["--warmup-epochs", "0"]
    codes, out = trainer_runs.run(save, data_path, ["--epochs", "3", *flags],
                                  env={"FASTDDP_FAULT_KILL_AFTER_EPOCH": "1"})
    assert codes == [-9], out
    codes, out = trainer_runs.run(save, data_path, ["--epochs", "2", *flags])
    assert codes == [0], out
    assert ("note: --epochs 2, where the checkpoint's run had --epochs 3: the learning-rate schedule "
            "(a cosine to 0) now ends at step 12 instead of 18 (in this run's 6 steps an epoch); at step 6 "
            "the rate is 0.0005 (the "
            "checkpoint's run: 0.00075). Rerun with --epochs 3 to keep the run's schedule") in out, out
    codes, out = trainer_runs.run(save, data_path, ["--epochs", "3", *flags])  # the checkpoint now says 2
    assert codes == [0] and "note: --epochs 3 continues a finished run of --epochs 2" in out, out


def test_resume_on_another_world_size_with_scale_lr_is_refused(tmp_path, data_path) -> None:
    save = tmp_path / "run"
    codes, out = trainer_runs.run(save, data_path, ["--epochs", "1", "--scale-lr", "linear"],
                                  world=2)
    assert codes == [0, 0], out
    codes, out = trainer_runs.run(save, data_path, ["--epochs", "2", "--scale-lr", "linear"])
    assert codes == [2], out
    assert re.search(r"other settings: learning rate after --scale-lr and the world size 0\.002 "
                     r"\(this run: 0\.001\)\.", out), out


def test_resume_on_another_world_size_keeps_the_schedule_of_this_world(tmp_path, data_path) -> None:
    """One epoch on 2 ranks (3 steps), resumed on 1 rank (6 steps an epoch) for a second: the
    run goes on at step 6, where this world's schedule has the second epoch start, and ends
    where an uninterrupted 1-rank run ends (a learning rate of 0 after the cosine)."""
    save = tmp_path / "run"
    codes, out = trainer_runs.run(save, data_path, ["--epochs", "1"], world=2)
    assert codes == [0, 0], out
    codes, out = trainer_runs.run(save, data_path, ["--epochs", "2"])
    assert codes == [0], out
    assert f"resumed from {save / 'last.pt'} at epoch 2, step 6" in out, out
    # said once, at an epoch's end too: the samples a step takes, and the steps counted anew
    assert ("note: world size changed (2 -> 1): a step takes 64 -> 32 samples at the same --lr, and the "
            "checkpoint's step 3 is step 6 here (6 steps an epoch)") in out, out
    assert "Warning" not in out, out  # the schedule is moved without torch's out-of-order warning
    whole = tmp_path / "whole"
    codes, out = trainer_runs.run(whole, data_path, ["--epochs", "2"])
    assert codes == [0], out
    assert trainer_runs.metrics(save)[1]["lr"] == trainer_runs.metrics(whole)[1]["lr"]


def test_resume_from_best_pt_is_one_clear_error(one_epoch, tmp_path, data_path) -> None:
    best = one_epoch / "best.pt"
    codes, out = trainer_runs.run(tmp_path / "run", data_path, ["--resume", str(best)])
    assert codes == [2], out
    assert out.strip().splitlines() == [
        f"fastddp.train: error: {best} is not a checkpoint to resume from (it has no optimizer, "
        "scheduler, scaler, loader, step, best_f1, history): best.pt holds only the weights of "
        "the best epoch, for evaluation. Resume from last.pt (--resume auto does) or start over "
        "with --resume none"], out


@pytest.mark.slow  # 19 s; the elastic restart of test_train.py runs in every CI
def test_torchrun_restart_of_a_resume_none_job_continues_its_own_checkpoint(tmp_path,
                                                                            data_path) -> None:
    """torchrun --max-restarts reruns the failed attempt's command line, --resume none
    included: the restart continues what the job's first attempt saved, not a checkpoint of
    another run in the same directory (here a longer one, left as last.pt.prev)."""
    save = tmp_path / "run"
    codes, out = trainer_runs.run(save, data_path, ["--epochs", "3", "--batch-size", "16"])
    assert codes == [0], out  # another run's checkpoint: 36 steps
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--max-restarts=1",
           "--nproc_per_node=2", "-m", "fastddp.train", "--multi-gpu", "ddp",
           *trainer_runs.ARGS, "--save-dir", str(save), "--resume", "none", "--save-interval", "2"]
    env = dict(os.environ, OMP_NUM_THREADS="1", FASTDDP_FAULT_KILL_AFTER_STEP="2",
               FASTDDP_FAULT_RANK="1",
               PYTHONPATH=os.pathsep.join(filter(None, [data_path, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (f"resumed from {save / 'last.pt'} at epoch 1, step 2 (restart 1 of this torchrun "
            "job: --resume none applied to its first attempt)") in proc.stdout, proc.stdout
    assert [row["epoch"] for row in trainer_runs.metrics(save)] == ["1", "2", "3"]


def test_resume_path_command_run_again_after_a_kill_continues_its_save_dir(
        one_epoch, tmp_path, data_path) -> None:
    save, given = tmp_path / "run", one_epoch / "last.pt"
    argv = ["--epochs", "3", "--resume", str(given)]
    codes, out = trainer_runs.run(save, data_path, argv,
                                  env={"FASTDDP_FAULT_KILL_AFTER_EPOCH": "2"})
    assert codes == [-9] and f"resumed from {given} at epoch 2, step 6" in out, out
    codes, out = trainer_runs.run(save, data_path, argv)
    assert codes == [0], out
    assert (f"resumed from {save / 'last.pt'} at epoch 3, step 12 (it continues --resume "
            f"{given})") in out, out
    assert [row["epoch"] for row in trainer_runs.metrics(save)] == ["1", "2", "3"]


def test_resume_path_into_the_save_dir_of_another_run_is_refused(one_epoch, tmp_path,
                                                                  data_path) -> None:
    save, given = tmp_path / "run", one_epoch / "last.pt"
    codes, out = trainer_runs.run(save, data_path, ["--epochs", "1", "--lr", "0.01"])
    assert codes == [0], out
    before = _files(save)
    codes, out = trainer_runs.run(save, data_path, ["--epochs", "2", "--resume", str(given)])
    assert codes == [2], out
    assert (f"fastddp.train: error: --save-dir {save} holds the checkpoint of another run "
            f"({save / 'last.pt'}: 1 epoch(s), step 6); continuing {given} there would "
            "overwrite it. Choose another --save-dir, or continue that run with --resume auto"
            ) in out, out
    assert _files(save) == before


def test_second_run_into_a_save_dir_in_use_is_refused(tmp_path, data_path) -> None:
    save = tmp_path / "run"
    codes, out = trainer_runs.run(save, data_path, ["--epochs", "1"])
    assert codes == [0], out
    before = _files(save)
    # a run writing there holds the lock: here a process that holds it as the launcher does
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(save / ".fastddp.lock")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        codes, out = trainer_runs.run(save, data_path, ["--epochs", "2"])
    finally:
        holder.kill()
        holder.wait()
    assert codes == [2], out
    assert out.strip().splitlines()[-1] == (
        f"fastddp.train: error: --save-dir {save}: another fastddp.train run is writing there; "
        "wait for it to end, or choose another --save-dir"), out
    assert _files(save) == before


HOLD_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
print("locked", flush=True)
time.sleep(300)
"""


def test_unusable_save_dir_stops_every_rank_with_one_error(tmp_path, data_path) -> None:
    save = tmp_path / "run"
    save.write_text("not a directory")
    codes, out = trainer_runs.run(save, data_path, ["--epochs", "1"], world=2)
    assert codes == [2, 2], out
    assert out.strip().splitlines() == [
        f"fastddp.train: error: --save-dir {save}: is a file, not a directory; choose a "
        "directory (it is created if missing)"], out


def test_run_started_over_then_killed_continues_itself_not_the_run_before(tmp_path,
                                                                          data_path) -> None:
    """--resume none into the directory of a longer run, killed after its first epoch: its
    first save kept the longer run's checkpoint as last.pt.prev (more steps). The next
    --resume auto continues the new run's last.pt, not the run before."""
    save = tmp_path / "run"
    codes, out = trainer_runs.run(save, data_path, ["--epochs", "3"])
    assert codes == [0], out
    codes, out = trainer_runs.run(save, data_path, ["--epochs", "3", "--resume", "none"],
                                  env={"FASTDDP_FAULT_KILL_AFTER_EPOCH": "1"})
    assert codes == [-9], out
    started_over = trainer_runs.metrics(save)
    assert len(started_over) == 1
    codes, out = trainer_runs.run(save, data_path, ["--epochs", "3"])
    assert codes == [0], out
    assert f"resumed from {save / 'last.pt'} at epoch 2, step 6" in out, out
    rows = trainer_runs.metrics(save)
    assert [row["epoch"] for row in rows] == ["1", "2", "3"] and rows[0] == started_over[0]


@pytest.mark.parametrize(("saved", "named"), [
    ("module", "holds a FlattenMLP, not a checkpoint (a dict written by fastddp.train"),
    ("tensor", "holds a Tensor, not a checkpoint (a dict written by fastddp.train"),
    ("weights", "is not a checkpoint to resume from (it has no optimizer, scheduler, scaler, "
                "loader, epoch, step, best_f1, history): it is not a training checkpoint of "
                "fastddp.train (a model's weights"),
], ids=["module", "tensor", "weights"])
def test_resume_from_a_file_torch_save_wrote_elsewhere_is_one_clear_error(
        tmp_path, data_path, saved, named) -> None:
    """torch.save(model), of a tensor or of a state_dict, given as --resume: one line naming
    what the file holds (a model or a tensor ended in a traceback from the key look-ups)."""
    import torch

    from fastddp.train.models import FlattenMLP

    given = tmp_path / f"{saved}.pt"
    obj = {"module": FlattenMLP(), "tensor": torch.zeros(3),
           "weights": FlattenMLP().state_dict()}[saved]
    torch.save(obj, given)
    save = tmp_path / "run"
    codes, out = trainer_runs.run(save, data_path, ["--epochs", "1", "--resume", str(given)])
    assert codes == [2], out
    lines = out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"fastddp.train: error: {given}"), out
    assert named in lines[0] and "--resume none" in lines[0], out
    assert not (save / "last.pt").exists()


@pytest.mark.parametrize("epochs", [1, 2], ids=["complete", "continued"])
def test_metrics_edited_by_hand_are_kept_aside(one_epoch, tmp_path, data_path, epochs) -> None:
    """metrics.csv that is not the checkpoint's history (nor a part of it) is moved to
    metrics.csv.<time>.bak with a note, then written again from the checkpoint: a hand edit
    is not overwritten without a word, whether the run is complete or continues."""
    save = tmp_path / "run"
    shutil.copytree(one_epoch, save)
    written = (save / "metrics.csv").read_bytes()
    edited = written.replace(b"\n1,", b"\n1,0.123,", 1) + b"my note\n"
    (save / "metrics.csv").write_bytes(edited)
    codes, out = trainer_runs.run(save, data_path, ["--epochs", str(epochs)])
    assert codes == [0], out
    kept = list(save.glob("metrics.csv.*.bak"))
    assert len(kept) == 1 and kept[0].read_bytes() == edited, out
    assert (f"note: {save / 'metrics.csv'} did not hold the history of {save / 'last.pt'} "
            f"(edited by hand, or written after a checkpoint that is gone): kept as "
            f"{kept[0].name}") in out, out
    assert (save / "metrics.csv").read_bytes().startswith(written)
    assert [row["epoch"] for row in trainer_runs.metrics(save)] == [str(e + 1) for e in range(epochs)]


def test_summary_of_another_run_is_kept_aside_and_written_again(one_epoch, tmp_path,
                                                                data_path) -> None:
    """A complete run whose summary.json is not its own (a run started over, killed before its
    summary, leaves the earlier run's) is not called complete with it: summary.json and
    curves.png are moved to .bak and written from last.pt's history."""
    save = tmp_path / "run"
    shutil.copytree(one_epoch, save)
    summary = json.loads((save / "summary.json").read_text())
    summary["final"]["val_f1"] = summary["best_val_f1"] = 0.01  # another run's numbers
    (save / "summary.json").write_text(json.dumps(summary))
    codes, out = trainer_runs.run(save, data_path, ["--epochs", "1"])
    assert codes == [0], out
    assert "already complete" in out and "kept summary.json." in out, out
    kept = list(save.glob("summary.json.*.bak"))
    assert len(kept) == 1 and json.loads(kept[0].read_text()) == summary, out
    assert len(list(save.glob("curves.png.*.bak"))) == 1
    rows = trainer_runs.metrics(save)
    assert json.loads((save / "summary.json").read_text())["final"]["val_f1"] == float(
        rows[-1]["val_f1"])


def test_run_started_over_keeps_the_earlier_run_aside(one_epoch, tmp_path, data_path) -> None:
    """--resume none trains afresh: the earlier run's summary.json and curves.png would pass
    for its results until it writes its own, and its metrics.csv, best.pt, config.json and
    last.pt would be overwritten, so all are moved to .bak when it starts."""
    save = tmp_path / "run"
    shutil.copytree(one_epoch, save)
    names = ("summary.json", "curves.png", "metrics.csv", "best.pt", "config.json", "last.pt")
    earlier = {name: (save / name).read_bytes() for name in names if (save / name).exists()}
    codes, out = trainer_runs.run(save, data_path, ["--epochs", "1", "--resume", "none",
                                                    "--lr", "0.002"])
    assert codes == [0], out
    assert f"note: the {'/'.join(earlier)} in {save} (of an earlier run" in out, out
    for name, content in earlier.items():
        kept = list(save.glob(f"{name}.*.bak"))
        assert len(kept) == 1 and kept[0].read_bytes() == content, name
        assert (save / name).read_bytes() != content or name == "curves.png", name


def test_run_started_over_and_stopped_before_its_first_save_leaves_no_mix_of_two_runs(
        one_epoch, tmp_path, data_path) -> None:
    """--resume none over a finished run, killed at its first write (config.json): the earlier
    run's files, its checkpoint among them, are all kept aside together, so the next run
    starts over as asked instead of finding the earlier run complete without its best.pt and
    config.json (which were only in .bak)."""
    save = tmp_path / "run"
    shutil.copytree(one_epoch, save)
    names = ("metrics.csv", "best.pt", "config.json", "last.pt", "summary.json")
    earlier = {name: (save / name).read_bytes() for name in names}
    codes, out = trainer_runs.run(save, data_path, ["--epochs", "1", "--resume", "none"], exit_after=1)
    assert codes == [137], out
    for name, content in earlier.items():
        kept = list(save.glob(f"{name}.*.bak"))
        assert len(kept) == 1 and kept[0].read_bytes() == content, name
        assert not (save / name).exists(), name
    codes, out = trainer_runs.run(save, data_path, ["--epochs", "1"])
    assert codes == [0], out
    assert "already complete" not in out, out
    assert [row["epoch"] for row in trainer_runs.metrics(save)] == ["1"]
    assert (save / "best.pt").is_file() and (save / "config.json").is_file()


def test_resume_path_keeps_aside_a_best_pt_that_is_not_its_historys(one_epoch, tmp_path,
                                                                     data_path) -> None:
    """--resume PATH into a --save-dir holding a best.pt of another run: that file is kept
    aside and PATH's best epoch is copied in, so best.pt never holds weights the history does
    not have (the other run's file was kept as this run's best model, and metrics.csv and
    summary.json named another epoch)."""
    save = tmp_path / "run"
    save.mkdir()
    other = tmp_path / "other"
    codes, out = trainer_runs.run(other, data_path, ["--epochs", "1", "--lr", "0.5"])
    assert codes == [0], out
    foreign = (other / "best.pt").read_bytes()
    (save / "best.pt").write_bytes(foreign)
    given = one_epoch / "last.pt"
    codes, out = trainer_runs.run(save, data_path, ["--epochs", "2", "--resume", str(given)])
    assert codes == [0], out
    assert "holds no complete checkpoint" not in out, out
    kept = list(save.glob("best.pt.*.bak"))
    assert len(kept) == 1 and kept[0].read_bytes() == foreign
    best = torch.load(save / "best.pt", weights_only=False)
    top = max(trainer_runs.metrics(save), key=lambda row: float(row["val_f1"]))
    assert best["metrics"]["epoch"] == int(top["epoch"]), (best["metrics"], top)


def test_resume_path_of_a_finished_run_into_a_new_save_dir(one_epoch, tmp_path,
                                                           data_path) -> None:
    """--resume PATH of a complete run into another --save-dir with no epoch left is refused,
    naming both directories and the fix, and the --save-dir it created is taken away again;
    the fix (more --epochs) then trains."""
    save, given = tmp_path / "new", one_epoch / "last.pt"
    codes, out = trainer_runs.run(save, data_path, ["--epochs", "1", "--resume", str(given)])
    assert codes == [2], out
    assert (f"fastddp.train: error: --resume {given}: that run is already complete (1 epochs, "
            f"--epochs 1); its results are in {one_epoch.resolve()}, and nothing is left to "
            f"train into --save-dir {save.resolve()}. To train it further there, raise --epochs "
            "above 1") in out, out
    assert not save.exists(), list(save.iterdir())
    codes, out = trainer_runs.run(save, data_path, ["--epochs", "2", "--resume", str(given)])
    assert codes == [0], out
    assert [row["epoch"] for row in trainer_runs.metrics(save)] == ["1", "2"]
    # the best epoch so far came along: best.pt is the given run's or a better one of this run
    best = torch.load(save / "best.pt", weights_only=False)
    first = torch.load(one_epoch / "best.pt", weights_only=False)
    assert best["metrics"]["val_f1"] >= first["metrics"]["val_f1"]
    assert f"copied {(one_epoch / 'best.pt').resolve()}" in out, out


def test_epoch_resumed_in_its_middle_counts_its_time_before_the_checkpoint(tmp_path,
                                                                         data_path) -> None:
    """metrics.csv's epoch_time_s / samples_per_s of an epoch continued from a mid-epoch
    checkpoint cover the whole epoch: the seconds trained before the checkpoint travel in it."""
    save = tmp_path / "run"
    extra = ["--epochs", "1", "--save-interval", "1", "--sync-checkpoints"]
    codes, out = trainer_runs.run(save, data_path, extra,
                                  env={"FASTDDP_FAULT_KILL_AFTER_STEP": "4"})
    assert codes == [-9], out
    partial = torch.load(save / "last.pt", weights_only=False)["rng"][0]["partial"]
    assert partial[2] == 4 * 32 and partial[3] > 0, partial
    codes, out = trainer_runs.run(save, data_path, extra)
    assert codes == [0], out
    row = trainer_runs.metrics(save)[0]
    epoch_time, rate = float(row["epoch_time_s"]), float(row["samples_per_s"])
    assert epoch_time >= partial[3] and float(row["elapsed_s"]) >= epoch_time, row
    assert round(rate * epoch_time) == 192, row


def test_resume_from_a_save_cut_off_before_its_rename_completes_that_save_first(
        one_epoch, tmp_path, data_path) -> None:
    """A stop between a save's complete last.pt.tmp and its rename leaves the newest state in
    the temporary; the resuming run finishes that save first (last.pt.tmp becomes last.pt),
    because its own next save truncates last.pt.tmp, and a stop then would lose that state."""
    save = tmp_path / "run"
    shutil.copytree(one_epoch, save)
    os.replace(save / "last.pt", save / "last.pt.tmp")  # epoch 1's save, cut off before its rename
    if (save / "last.pt.prev").exists():
        os.remove(save / "last.pt.prev")
    codes, out = trainer_runs.run(save, data_path, ["--epochs", "2"])
    assert codes == [0], out
    assert "the save a stop cut off is completed: last.pt.tmp is now last.pt" in out, out
    assert not (save / "last.pt.tmp").exists()
    # epoch 2's save kept epoch 1's state, which lived only in the temporary, as last.pt.prev
    assert torch.load(save / "last.pt.prev", weights_only=False)["step"] == 6
    assert torch.load(save / "last.pt", weights_only=False)["step"] == 12


@pytest.mark.parametrize("epochs", ["1", "2"], ids=["complete", "training_on"])
def test_a_damaged_best_pt_is_named_and_kept_aside(one_epoch, tmp_path, data_path, epochs) -> None:
    save = tmp_path / "run"
    shutil.copytree(one_epoch, save)
    damaged = (save / "best.pt").read_bytes()[:1000]
    (save / "best.pt").write_bytes(damaged)
    codes, out = trainer_runs.run(save, data_path, ["--epochs", epochs])
    assert codes == [0], out
    assert re.search(rf"warning: {re.escape(str(save / 'best.pt'))} does not verify \(.*\): the weights of the "
                     r"best epoch so far \(epoch 1, val F1 [0-9.]+\) are lost; the file is kept as best\.pt\.", out), out
    assert ("the run is complete, so there is no best.pt" in out) == (epochs == "1"), out
    assert [p.read_bytes() for p in save.glob("best.pt.*.bak")] == [damaged]
