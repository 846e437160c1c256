"""``--data-dir``: the UCI HAR files the launcher reads, malformed values refused naming the
file and line, and the parsed-array cache that never serves stale or broken arrays."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from fastddp.data.har import SIGNALS, load_uci_har


def _write(root: Path, n: int = 12) -> None:
    """A small UCI HAR layout: ``n`` windows per split."""
    rng = np.random.default_rng(0)
    for split in ("train", "test"):
        signals = root / split / "Inertial Signals"
        signals.mkdir(parents=True, exist_ok=True)
        for name in SIGNALS:
            np.savetxt(signals / f"{name}_{split}.txt", rng.standard_normal((n, 128)), fmt="%.5f")
        np.savetxt(root / split / f"y_{split}.txt", np.arange(n) % 6 + 1, fmt="%d")
        np.savetxt(root / split / f"subject_{split}.txt", np.arange(n) % 3 + 1, fmt="%d")


def _replace_line(path: Path, lineno: int, text: str) -> None:
    lines = path.read_text().splitlines()
    lines[lineno - 1] = text
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize(("value", "message"), [
    ("nan", "nan is not a finite value"), ("inf", "inf is not a finite value"),
    ("-inf", "-inf is not a finite value"), ("1e40", "1e\\+40 is outside the float32 range")])
def test_non_finite_signal_value_is_named_with_file_and_line(tmp_path, value, message) -> None:
    _write(tmp_path)
    path = tmp_path / "train" / "Inertial Signals" / "body_gyro_y_train.txt"
    _replace_line(path, 3, " ".join([value] + ["0.5"] * 127))
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}:3: {message}$"):
        load_uci_har(tmp_path, cache=False)


def test_fractional_subject_id_is_named_with_file_and_line(tmp_path) -> None:
    _write(tmp_path)
    path = tmp_path / "test" / "subject_test.txt"
    _replace_line(path, 5, "2.5")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}:5: subject 2.5 is not a "
                                         "positive integer"):
        load_uci_har(tmp_path, cache=False)


def _cached(root: Path):
    """Load ``root`` twice: the second load comes from the cache the first one wrote."""
    first = load_uci_har(root)
    assert (root / ".fastddp_cache" / "x_train.npy").is_file()
    return first, load_uci_har(root)


def test_cache_is_not_used_after_a_source_file_changes(tmp_path) -> None:
    _write(tmp_path)
    first, cached = _cached(tmp_path)
    assert torch.equal(cached.y_train, first.y_train)
    labels = tmp_path / "train" / "y_train.txt"
    labels.write_text("".join(f"{6 - i % 6}\n" for i in range(12)))
    os.utime(labels, ns=(labels.stat().st_atime_ns, labels.stat().st_mtime_ns + 10**9))
    again = load_uci_har(tmp_path)
    assert again.y_train.tolist() == [5 - i % 6 for i in range(12)]


def test_damaged_cache_file_is_parsed_again(tmp_path) -> None:
    _write(tmp_path)
    first, _ = _cached(tmp_path)
    array = tmp_path / ".fastddp_cache" / "x_train.npy"
    array.write_bytes(array.read_bytes()[:100])  # as a crash of the writing machine leaves it
    again = load_uci_har(tmp_path)
    assert torch.equal(again.x_train, first.x_train)
    assert torch.equal(load_uci_har(tmp_path).x_train, first.x_train)  # the cache is whole again


def test_cache_whose_writing_did_not_finish_is_not_used(tmp_path) -> None:
    _write(tmp_path)
    first, _ = _cached(tmp_path)
    cache = tmp_path / ".fastddp_cache"
    # a writer stopped between its arrays: one array of other sources, no record of the sources
    (cache / "sources.json").unlink(missing_ok=True)
    np.save(cache / "y_train.npy", np.zeros(12, dtype=np.int64))
    assert torch.equal(load_uci_har(tmp_path).y_train, first.y_train)


DATASETS = '''
import torch
from torch.utils.data import TensorDataset

def _pair(x, y):
    return TensorDataset(x, y), TensorDataset(x[:6], y[:6])

def label_9():
    return _pair(torch.zeros(12, 9, 128), torch.arange(12) % 10)

def negative_label():
    return _pair(torch.zeros(12, 9, 128), torch.arange(12) % 6 - 1)

def float_labels():
    return _pair(torch.zeros(12, 9, 128), (torch.arange(12) % 6).float())

def short_windows():
    return _pair(torch.zeros(12, 3, 50), torch.arange(12) % 6)

def not_pairs():
    return [torch.zeros(9, 128)] * 4, [torch.zeros(9, 128)] * 4

def empty_test():
    train, _ = _pair(torch.zeros(12, 9, 128), torch.arange(12) % 6)
    return train, TensorDataset(torch.zeros(0, 9, 128), torch.zeros(0, dtype=torch.long))

class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter([(torch.zeros(9, 128), torch.tensor(0))] * 4)

def iterable():
    return Stream(), Stream()
'''


@pytest.mark.parametrize(("factory", "model", "message"), [
    ("label_9", None, "the train set has label 9; the labels must be 0..5 (the six HAR activities)"),
    ("label_9", "m:any", "the train set has label 9; the labels must be 0..5"),
    ("negative_label", None, "the train set has label -1; the labels must be 0..5"),
    ("float_labels", None, "the train set has torch.float32 labels; give integer class indices 0..5"),
    ("short_windows", None, "the train set has samples of shape 3x50, but --mode flatten takes "
                            "9x128 windows; reshape the data or give your own --model"),
    ("not_pairs", None, "the train set must give (x, y) samples, its first is a Tensor"),
    ("empty_test", None, "the test set is empty"),
    ("iterable", None, "the train set has no len() (a Stream, e.g. an IterableDataset): fastddp.train "
                       "splits a data set between the ranks by index"),
], ids=["label-9", "label-9-own-model", "label-minus-1", "float-labels", "window-shape",
        "not-pairs", "empty-test", "iterable"])
def test_dataset_that_does_not_fit_the_task_is_one_clear_error(tmp_path, monkeypatch, factory,
                                                               model, message) -> None:
    from fastddp.train.cli import parse_args
    from fastddp.train.errors import UsageError
    from fastddp.train.setup import load_data

    (tmp_path / "har_sets.py").write_text(DATASETS)
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = ["--dataset", f"har_sets:{factory}", *(["--model", model] if model else [])]
    with pytest.raises(UsageError, match=rf"^--dataset har_sets:{factory}: {re.escape(message)}"):
        load_data(parse_args(argv))
