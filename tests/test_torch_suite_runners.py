"""The runner of torch's own sampler and GradScaler cases (benchmarks/torch_suites/
run_sampler_scaler.py) on a torch-style device-generic test module: the cases are instantiated
per device, every name torch's tests use points at fastddp's class, a swapped scaler pickles,
and each case says whether it built one of ours."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

import fastddp

_TORCH_STYLE_SUITE = '''
import pickle
import torch
from torch.testing._internal.common_utils import TestCase


class TestTorchDeviceType(TestCase):
    def test_grad_scaling_top_level_name(self, device):
        scaler = torch.GradScaler(device, init_scale=4.0)
        self.assertEqual(type(scaler).__module__, "fastddp.amp.scaler")

    def test_pickle_gradscaler(self, device):
        scaler = torch.amp.GradScaler(device, init_scale=3.0)
        again = pickle.loads(pickle.dumps(scaler))
        self.assertEqual(again.get_scale(), 3.0)

    def test_grad_scaling_fails(self, device):
        self.assertEqual(torch.amp.GradScaler(device).get_scale(), 1.0)

    def test_not_selected(self, device):
        raise AssertionError("a case that names no scaler is not selected")
'''


def _runner():
    path = Path(__file__).parents[1] / "benchmarks" / "torch_suites" / "run_sampler_scaler.py"
    spec = importlib.util.spec_from_file_location("run_sampler_scaler", path)
    runner = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = runner  # its dataclasses look their module up
    spec.loader.exec_module(runner)
    return runner


def test_scaler_runner_swaps_every_name_and_keeps_pickling(tmp_path) -> None:
    runner = _runner()
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "test_torch.py").write_text(_TORCH_STYLE_SUITE)
    suite = next(s for s in runner.SUITES if s.path == "test/test_torch.py")
    rows = {o.test.rsplit(".", 1)[1]: o for o in runner.run_suite(suite, tmp_path)}
    assert set(rows) == {"test_grad_scaling_top_level_name_cpu", "test_pickle_gradscaler_cpu",
                         "test_grad_scaling_fails_cpu"}, rows
    for name in ("test_grad_scaling_top_level_name_cpu", "test_pickle_gradscaler_cpu"):
        assert rows[name].status == "pass" and rows[name].used_fastddp, rows[name]
    failed = rows["test_grad_scaling_fails_cpu"]
    assert failed.status == "fail" and failed.used_fastddp and "Relative difference" in failed.detail, failed
    assert torch.GradScaler is torch.amp.GradScaler and torch.amp.GradScaler.__module__ == "torch.amp.grad_scaler"
    assert "__init__" in fastddp.GradScaler.__dict__  # its own, restored
    assert not hasattr(fastddp.GradScaler.__init__, "__wrapped__")  # the counting wrapper is gone
