"""Non-finite losses stop a run whose optimizer step nothing else guards."""

from __future__ import annotations

import math

import pytest

from tests import trainer_runs


@pytest.fixture(scope="module")
def data_path(tmp_path_factory) -> str:
    return trainer_runs.write_data(tmp_path_factory.mktemp("data"))


def test_nan_loss_with_bf16_autocast_aborts(tmp_path, data_path) -> None:
    """bf16 AMP has no GradScaler to skip non-finite steps: the loss is checked as without AMP."""
    codes, out = trainer_runs.run(tmp_path / "run", data_path, [
        "--epochs", "1", "--amp", "--amp-dtype", "bf16", "--lr", "1e6", "--clip-grad", "1",
        "--warmup-epochs", "0", "--max-nan-steps", "2"])
    assert codes == [1], out
    # clipping is on already: the advice is to lower it
    assert "loss was non-finite for 2 steps in a row (on rank(s) 0); lower --lr, lower --clip-grad" in out, out


def test_nan_loss_on_one_rank_is_skipped_by_every_rank(tmp_path, data_path) -> None:
    """A NaN sample reaches one rank's batch: the ranks agree in one all-reduce, every rank
    skips that step (none waits in a collective the other skipped) and the run finishes with
    finite metrics (the skipped forward's BatchNorm statistics are undone)."""
    codes, out = trainer_runs.run(tmp_path / "run", data_path, [
        "--dataset", "tiny_har:one_nan", "--epochs", "1", "--max-nan-steps", "2"], world=2)
    assert codes == [0, 0], out
    rank0, rank1 = out.split("--- rank 1\n")
    skipped = [line.split("non-finite loss on rank(s) ")[1].split(";")[0]
               for text in (rank0, rank1) for line in text.splitlines()
               if "every rank skips this step" in line]
    assert len(skipped) == 2 and skipped[0] == skipped[1], out  # the same rank and step
    row = trainer_runs.metrics(tmp_path / "run")[0]
    assert math.isfinite(float(row["val_loss"])) and math.isfinite(float(row["train_loss"])), row


def test_weights_that_diverged_stop_the_run_before_they_are_saved(tmp_path, data_path) -> None:
    """A weight decay that blows the weights up to inf within one epoch, the losses of its
    steps still finite: the run stops at the epoch's end naming the weights and the fix,
    exit 1, and saves no checkpoint of them (there was no earlier epoch: no last.pt)."""
    save = tmp_path / "run"
    codes, out = trainer_runs.run(save, data_path, ["--epochs", "2", "--weight-decay", "1e30"])
    assert codes == [1], out
    assert "error: the model's weights are not finite after epoch 1 (" in out, out
    assert "lower --lr or --weight-decay" in out, out
    assert not (save / "last.pt").exists() and not (save / "best.pt").exists()


def test_a_non_finite_validation_loss_is_named(tmp_path, data_path) -> None:
    codes, out = trainer_runs.run(tmp_path / "run", data_path, ["--dataset", "tiny_har:val_nan", "--epochs", "1"])
    assert codes == [0], out
    assert "warning: the validation loss of epoch 1 is nan with finite weights: the validation data hold " \
           "non-finite values" in out, out
