"""Non-finite losses stop a run whose optimizer step nothing else guards."""

from __future__ import annotations

import pytest

from tests import trainer_runs


@pytest.fixture(scope="module")
def data_path(tmp_path_factory) -> str:
    return trainer_runs.write_data(tmp_path_factory.mktemp("data"))


def test_nan_loss_with_bf16_autocast_aborts(tmp_path, data_path) -> None:
    """bf16 AMP has no GradScaler to skip non-finite steps: the loss is checked as without AMP."""
    codes, out = trainer_runs.run(tmp_path / "run", data_path, [
        "--epochs", "1", "--amp", "--amp-dtype", "bf16", "--lr", "1e6", "--clip-grad", "0",
        "--warmup-epochs", "0", "--max-nan-steps", "2"])
    assert codes == [1], out
    assert "loss was non-finite for 2 steps in a row" in out, out
