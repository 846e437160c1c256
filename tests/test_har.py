"""HAR data: the embedded synthetic set and the UCI HAR file layout."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from fastddp.data.har import SIGNALS, load_uci_har, synthetic_har
from fastddp.train.models import FlattenMLP


def test_synthetic_shapes_and_determinism() -> None:
    d = synthetic_har()
    assert d.x_train.shape == (7352, 9, 128) and d.x_test.shape == (2947, 9, 128)
    assert d.x_train.dtype == torch.float32 and d.y_train.dtype == torch.int64
    assert set(d.y_train.unique().tolist()) == set(range(6))
    assert not set(d.s_train.unique().tolist()) & set(d.s_test.unique().tolist())
    again = synthetic_har()
    assert torch.equal(d.x_train, again.x_train) and torch.equal(d.y_test, again.y_test)
    assert not torch.equal(d.x_train, synthetic_har(seed=1).x_train)


def test_small_mlp_learns_to_90_percent_but_not_trivially() -> None:
    d = synthetic_har()
    torch.manual_seed(0)
    model = FlattenMLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-2)
    g = torch.Generator().manual_seed(0)
    accs = []
    while len(accs) < 3 and not (accs and accs[-1] >= 0.90):  # 90 % within 3 epochs
        model.train()
        perm = torch.randperm(len(d.y_train), generator=g)
        for i in range(0, len(perm) - 63, 64):
            idx = perm[i:i + 64]
            loss = torch.nn.functional.cross_entropy(model(d.x_train[idx]), d.y_train[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            accs.append(float((model(d.x_test).argmax(1) == d.y_test).float().mean()))
    assert accs[-1] >= 0.90, accs
    # not trivially separable: a linear model on the class-mean channel levels is far off
    means = d.x_train.mean(-1)
    centroids = torch.stack([means[d.y_train == c].mean(0) for c in range(6)])
    nearest = torch.cdist(d.x_test.mean(-1), centroids).argmin(1)
    assert float((nearest == d.y_test).float().mean()) < 0.9


def _write_uci(root: Path, n: int, split: str, seed: int, bad: str | None = None) -> tuple:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 9, 128)).astype(np.float32)
    y = rng.integers(1, 7, size=n)
    s = rng.integers(1, 31, size=n)
    sig = root / split / "Inertial Signals"
    sig.mkdir(parents=True)
    for c, name in enumerate(SIGNALS):
        np.savetxt(sig / f"{name}_{split}.txt", x[:, c, :], fmt="%.7e")
    np.savetxt(root / split / f"y_{split}.txt", y, fmt="%d")
    np.savetxt(root / split / f"subject_{split}.txt", s, fmt="%d")
    (root / split / f"X_{split}.txt").write_text("\n".join(" ".join(["0.1"] * 561) for _ in range(n)))
    if bad == "label":
        (root / split / f"y_{split}.txt").write_text("1\n7\n" + "2\n" * (n - 2))
    if bad == "row":
        path = sig / f"body_gyro_y_{split}.txt"
        lines = path.read_text().splitlines()
        lines[2] = lines[2] + " abc"
        path.write_text("\n".join(lines) + "\n")
    return x, y - 1, s


def test_uci_layout_round_trip_and_cache(tmp_path) -> None:
    x_tr, y_tr, s_tr = _write_uci(tmp_path, 12, "train", 0)
    _x_te, y_te, _ = _write_uci(tmp_path, 5, "test", 1)
    d = load_uci_har(tmp_path)
    torch.testing.assert_close(d.x_train, torch.from_numpy(x_tr), rtol=1e-6, atol=1e-6)
    assert d.y_train.tolist() == y_tr.tolist() and d.s_train.tolist() == s_tr.tolist()
    assert d.x_test.shape == (5, 9, 128) and d.y_test.tolist() == y_te.tolist()
    assert (tmp_path / ".fastddp_cache" / "x_train.npy").exists()
    cached = load_uci_har(tmp_path)
    assert torch.equal(cached.x_train, d.x_train)


def test_uci_missing_file_named(tmp_path) -> None:
    _write_uci(tmp_path, 4, "train", 0)
    with pytest.raises(FileNotFoundError, match=r"test/Inertial Signals/body_acc_x_test\.txt"):
        load_uci_har(tmp_path)


@pytest.mark.parametrize(("bad", "message"), [
    ("label", r"y_train\.txt:2: label 7 is not 1-6"),
    ("row", r"body_gyro_y_train\.txt:3: "),
])
def test_uci_malformed_file_and_line_named(tmp_path, bad, message) -> None:
    _write_uci(tmp_path, 4, "train", 0, bad=bad)
    _write_uci(tmp_path, 4, "test", 1)
    with pytest.raises(ValueError, match=message):
        load_uci_har(tmp_path)
