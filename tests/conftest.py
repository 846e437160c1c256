"""Shared pytest configuration: the ``cuda`` marker auto-skips without a GPU, RNG state is
restored around each test, and ``--run-slow`` opts into ``slow``-marked tests."""

from __future__ import annotations

import random

import pytest
import torch


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="also run tests marked slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    has_cuda = torch.cuda.is_available()
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    skip_slow = pytest.mark.skip(reason="slow: run with --run-slow")
    for item in items:
        if "cuda" in item.keywords and not has_cuda:
            item.add_marker(skip_cuda)
        if "slow" in item.keywords and not config.getoption("--run-slow"):
            item.add_marker(skip_slow)


@pytest.fixture(autouse=True)
def _restore_rng_state():
    py_state = random.getstate()
    cpu_state = torch.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    yield
    random.setstate(py_state)
    torch.set_rng_state(cpu_state)
    if cuda_states is not None:
        torch.cuda.set_rng_state_all(cuda_states)


def devices() -> list[str]:
    """``["cpu"]`` plus ``"cuda"`` as a cuda-marked parameter (skipped without a GPU)."""
    return ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
