"""Every launcher flag that changes training, checked by its effect on a short run (2 epochs
of 6 steps on 192 samples; one and two gloo ranks), not by its presence in ``--help``."""

from __future__ import annotations

import importlib.util
import json
import math
import re
from pathlib import Path

import pytest
import torch

from fastddp.train import checkpoint
from tests import trainer_runs

BASE = [*trainer_runs.ARGS[:2], "--epochs", "2", *trainer_runs.ARGS[4:], "--resume", "none"]


@pytest.fixture(scope="module")
def data_path(tmp_path_factory) -> str:
    return trainer_runs.write_data(tmp_path_factory.mktemp("data"))


def _train(save: Path, data_path: str, extra: list[str], world: int = 1,
           ok: bool = True) -> tuple[dict, str]:
    codes, out = trainer_runs.run(save, data_path, extra, world=world, base=BASE)
    if not ok:
        return {}, out
    assert codes == [0] * world, out
    return checkpoint.verify(save / "last.pt"), out


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, data_path) -> dict[int, dict]:
    """Runs with the default flags, on one and on two ranks."""
    runs = {}
    for world in (1, 2):
        runs[world], _ = _train(tmp_path_factory.mktemp(f"base{world}") / "run", data_path, [],
                                world)
    return runs


def _weights_differ(a: dict, b: dict) -> float:
    """The largest relative difference between the two checkpoints' parameters."""
    worst = 0.0
    for name, t in a["model"].items():
        if t.is_floating_point():
            worst = max(worst, float((t - b["model"][name]).abs().max() / b["model"][name].abs().max().clamp_min(1e-12)))
    return worst


@pytest.mark.parametrize("flag", [["--clip-grad", "0.05"], ["--seed", "7"], ["--weight-decay", "0.5"],
                                  ["--lr", "0.003"], ["--amp"]],
                         ids=lambda f: f[0])
def test_flag_changes_the_trained_weights(tmp_path, data_path, baseline, flag) -> None:
    got, out = _train(tmp_path / "run", data_path, flag)
    assert _weights_differ(got, baseline[1]) > 1e-4, flag
    if flag == ["--amp"]:  # on the CPU: bfloat16 autocast
        assert "amp=bfloat16" in out
        cfg = json.loads((tmp_path / "run" / "config.json").read_text())
        assert cfg["amp_resolved"] is True and cfg["amp_dtype_resolved"] == "torch.bfloat16"


def test_amp_dtype_fp16_is_honoured_on_the_cpu(tmp_path, data_path, baseline) -> None:
    """An explicit --amp-dtype fp16 on the CPU trains in float16 with the GradScaler; it is
    not replaced by bfloat16 behind the user's back."""
    got, out = _train(tmp_path / "run", data_path, ["--amp", "--amp-dtype", "fp16"])
    assert "amp=float16" in out, out
    cfg = json.loads((tmp_path / "run" / "config.json").read_text())
    assert cfg["amp_dtype_resolved"] == "torch.float16"
    assert got.get("scaler"), "fp16 AMP saves the GradScaler's state"
    assert _weights_differ(got, baseline[1]) > 1e-4


def test_grad_accum_steps_halves_the_optimizer_steps(tmp_path, data_path, baseline) -> None:
    got, out = _train(tmp_path / "run", data_path, ["--grad-accum-steps", "2"])
    assert "batch=32x1x2=64" in out and "steps/epoch=3" in out, out
    assert baseline[1]["step"] == 12 and got["step"] == 6
    assert _weights_differ(got, baseline[1]) > 1e-4
    assert "trained but not stepped" not in out, out


def test_grad_accum_steps_not_dividing_an_epoch_says_what_is_left_out(tmp_path, data_path) -> None:
    got, out = _train(tmp_path / "run", data_path, ["--grad-accum-steps", "4"])
    assert got["step"] == 2, got["step"]  # one step an epoch: 4 of its 6 batches
    assert ("note: --grad-accum-steps 4 over 6 batches an epoch: the last 2 of each epoch are trained "
            "but not stepped") in out, out


@pytest.mark.parametrize("world", [1, 2])
def test_input_error_found_at_build_leaves_no_run_directory(tmp_path, data_path, world) -> None:
    """An input error found once the run started (here: no full step per epoch) ends with its
    one line and takes away the --save-dir it created (and its parent), lock file and all; a
    directory that existed stays."""
    nested = tmp_path / "new" / "run"  # the last --save-dir wins
    codes, out = trainer_runs.run(tmp_path / "run", data_path,
                                  ["--batch-size", "500", "--save-dir", str(nested)],
                                  world=world, base=BASE)
    assert codes == [2] * world, out
    assert "--batch-size 500 x --grad-accum-steps 1 leaves no full optimizer step" in out, out
    assert not (tmp_path / "new").exists(), list((tmp_path / "new").rglob("*"))
    existing = tmp_path / "existing"
    existing.mkdir()
    codes, out = trainer_runs.run(existing, data_path, ["--batch-size", "500"], base=BASE)
    assert codes == [2], out
    assert existing.is_dir()


@pytest.mark.parametrize(("how", "factor"), [("linear", 2.0), ("sqrt", math.sqrt(2.0)), ("none", 1.0)])
def test_scale_lr_multiplies_the_learning_rate(tmp_path, data_path, how, factor) -> None:
    got, out = _train(tmp_path / "run", data_path,
                      ["--grad-accum-steps", "2", "--scale-lr", how])
    assert got["optimizer"]["param_groups"][0]["initial_lr"] == pytest.approx(1e-3 * factor)
    assert f"lr={1e-3 * factor:g}" in out


def test_warmup_epochs_shape_the_schedule(tmp_path, data_path) -> None:
    rows = {}
    for warmup in ("0", "1"):
        _train(tmp_path / warmup, data_path, ["--warmup-epochs", warmup])
        rows[warmup] = trainer_runs.metrics(tmp_path / warmup)
    # 12 steps: linear warm-up over the first 6, then cosine decay to 0 at step 12
    assert float(rows["1"][0]["lr"]) == pytest.approx(1e-3)
    assert float(rows["0"][0]["lr"]) == pytest.approx(0.5e-3)
    assert float(rows["0"][1]["lr"]) == float(rows["1"][1]["lr"]) == 0.0


def test_class_weights_auto_weights_the_loss_by_inverse_frequency(tmp_path, data_path) -> None:
    runs = {}
    for weights in ("none", "auto"):
        runs[weights], _ = _train(tmp_path / weights, data_path,
                                  ["--dataset", "tiny_har:imbalanced", "--class-weights", weights])
    assert _weights_differ(runs["auto"], runs["none"]) > 1e-4
    loss = {w: float(trainer_runs.metrics(tmp_path / w)[0]["train_loss"]) for w in runs}
    # half the samples are class 0: weighting them down raises the loss of the rare classes'
    # share, so the first epoch's weighted mean loss differs from the plain one
    assert abs(loss["auto"] - loss["none"]) > 1e-3, loss


@pytest.mark.parametrize("mode", ["conv1d", "lstm"])
def test_mode_selects_the_model(tmp_path, data_path, mode) -> None:
    got, out = _train(tmp_path / "run", data_path, ["--mode", mode])
    assert f"mode={mode}" in out and got["mode"] == mode
    key = {"conv1d": "features.0.weight", "lstm": "lstm.weight_ih_l0"}[mode]
    assert key in got["model"], sorted(got["model"])


def test_log_interval_prints_progress_lines_without_a_bar(tmp_path, data_path) -> None:
    """--no-progress: a line every --log-interval optimizer steps, from rank 0 only (2 ranks:
    3 steps an epoch)."""
    _, out = _train(tmp_path / "run", data_path, ["--log-interval", "2"], world=2)
    lines = [ln for ln in out.splitlines() if re.match(r"epoch \d+ step \d+: ", ln)]
    assert [ln.split(":")[0] for ln in lines] == ["epoch 1 step 2", "epoch 2 step 4", "epoch 2 step 6"], out
    for line in lines:
        assert re.fullmatch(r"epoch \d step \d: loss \d+\.\d{4} acc \d\.\d{3} samples/s \d+", line), line


def test_save_interval_longer_than_an_epoch_is_named(tmp_path, data_path) -> None:
    _, out = _train(tmp_path / "run", data_path, ["--save-interval", "100"])
    assert ("note: --save-interval 100 is more than the 6 steps of an epoch: no checkpoint inside an "
            "epoch, one at each epoch's end") in out, out


def test_tensorboard_writes_events_or_says_why_not(tmp_path, data_path) -> None:
    _, out = _train(tmp_path / "run", data_path, ["--tensorboard", "--log-interval", "1"])
    if importlib.util.find_spec("tensorboard") is None:
        assert "--tensorboard needs the tensorboard package (pip install tensorboard)" in out
        assert not (tmp_path / "run" / "tensorboard").exists()
        return
    assert _steps(tmp_path / "run", "train/loss") == list(range(1, 13))  # --log-interval 1
    # where each epoch ended, in a run of their own
    assert _steps(tmp_path / "run", "epoch/val_f1") == [6, 12]


def _steps(save: Path, tag: str) -> list[int]:
    """The steps of ``tag``'s events as TensorBoard shows them: ``epoch/*`` from
    ``save``/tensorboard/epoch, the others from ``save``/tensorboard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(save / "tensorboard" / ("epoch" if tag.startswith("epoch/") else "")))
    events.Reload()
    return [e.step for e in events.Scalars(tag)]


def test_tensorboard_of_a_resumed_run_shows_each_step_once(tmp_path, data_path) -> None:
    """A resume hides the events a killed attempt wrote after its last checkpoint (here: a
    whole epoch after the checkpoint that the resume loads), so no step shows twice; --resume
    none keeps the earlier run's events aside with its other files."""
    pytest.importorskip("tensorboard")
    save = tmp_path / "run"
    flags = ["--tensorboard", "--log-interval", "1"]
    _train(save, data_path, [*flags, "--epochs", "1"])
    kept = (save / "last.pt").read_bytes()
    _train(save, data_path, [*flags, "--epochs", "2", "--resume", "auto"])
    (save / "last.pt").write_bytes(kept)  # as if the second epoch's checkpoint never landed
    (save / "last.pt.prev").unlink(missing_ok=True)
    _, out = _train(save, data_path, [*flags, "--epochs", "2", "--resume", "auto"])
    assert "resumed from" in out, out
    assert _steps(save, "train/loss") == list(range(1, 13))
    assert _steps(save, "epoch/train_loss") == [6, 12]
    _, out = _train(save, data_path, [*flags, "--epochs", "1", "--resume", "none"])
    assert "tensorboard." in out and len(list(save.glob("tensorboard.*.bak"))) == 1, out
    assert _steps(save, "train/loss") == list(range(1, 7))


def test_tensorboard_epoch_figures_after_a_checkpoint_at_the_epochs_last_step_show_once(
        tmp_path, data_path) -> None:
    """--save-interval 6 checkpoints step 6, the first epoch's last, before that epoch's
    figures are logged at step 6; a kill before the epoch's own checkpoint lands resumes from
    the step-6 checkpoint and logs them again: the resume hides the killed attempt's."""
    pytest.importorskip("tensorboard")
    save = tmp_path / "run"
    flags = ["--tensorboard", "--log-interval", "1", "--save-interval", "6", "--sync-checkpoints",
             "--epochs", "1"]
    codes, out = trainer_runs.run(save, data_path, flags, base=BASE,
                                  env={"FASTDDP_FAULT_KILL_AFTER_STEP": "6"})
    assert codes == [-9], out
    at_step_6 = (save / "last.pt").read_bytes()  # inside epoch 1, after its last step
    _train(save, data_path, [*flags, "--resume", "auto"])  # the epoch's figures at step 6
    (save / "last.pt").write_bytes(at_step_6)  # as if the epoch's checkpoint never landed
    (save / "last.pt.prev").unlink(missing_ok=True)
    _, out = _train(save, data_path, [*flags, "--resume", "auto"])
    assert "resumed from" in out, out
    assert _steps(save, "epoch/val_f1") == [6]
    assert _steps(save, "train/loss") == list(range(1, 7))


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_comm_dtype_compresses_the_gradients(tmp_path, data_path, baseline, dtype) -> None:
    got, _ = _train(tmp_path / "run", data_path, ["--comm-dtype", dtype], world=2)
    assert _weights_differ(got, baseline[2]) > 0  # the gradients were rounded on the wire
    loss = [row["train_loss"] for row in (got["history"][-1], baseline[2]["history"][-1])]
    assert loss[0] == pytest.approx(loss[1], abs=0.05), loss  # and the training the same


def test_sync_batchnorm_on_cpu_ranks_is_one_clear_error(tmp_path, data_path) -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the refusal on a machine without a GPU")
    codes, out = trainer_runs.run(tmp_path / "run", data_path, ["--sync-batchnorm"], world=2,
                                  base=BASE)
    assert codes == [2, 2], out
    assert out.strip() == ("fastddp.train: error: --sync-batchnorm needs CUDA GPUs (torch's "
                           "SyncBatchNorm runs on GPUs only) and none is used here; drop the "
                           "flag on CPU ranks")


def test_find_unused_parameters(tmp_path, data_path) -> None:
    flags = ["--model", "tiny_har:with_unused", "--epochs", "1"]
    _, out = _train(tmp_path / "without", data_path, flags, world=2, ok=False)
    assert "unused.weight" in out and "find_unused_parameters" in out, out[-3000:]
    got, _ = _train(tmp_path / "with", data_path, [*flags, "--find-unused-parameters"], world=2)
    assert got["step"] == 3


def test_a_model_with_the_wrong_number_of_outputs_is_one_clear_error(tmp_path, data_path) -> None:
    """--model whose output is not (batch, 6) class scores: one line naming the shape it gives
    and what the loss takes, exit 2, before any training (was the loss's IndexError traceback)."""
    codes, out = trainer_runs.run(tmp_path / "run", data_path, ["--model", "tiny_har:three_classes"])
    assert codes == [2], out
    assert ("fastddp.train: error: --model tiny_har:three_classes: its output for one sample is of shape 1x3, "
            "but the loss and the metrics take (batch, 6) class scores") in out, out
    assert "Traceback" not in out, out


def test_curves_are_written_like_the_other_files(tmp_path, data_path) -> None:
    """curves.png goes through the run's writer (a temporary file renamed over it), as
    summary.json does: a curves.png that is a link to a full device is replaced, and the run
    ends with its summary (drawn straight into the link it failed with ENOSPC and a traceback)."""
    save = tmp_path / "run"
    save.mkdir()
    (save / "curves.png").symlink_to("/dev/full")
    _train(save, data_path, ["--epochs", "1"])
    assert not (save / "curves.png").is_symlink()
    assert (save / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (save / "summary.json").is_file()
