"""Shared by tests/ and benchmarks/: the ``cuda`` marker auto-skips without a GPU, and
``slow`` tests (the 10,000-step soaks) run only with ``--run-slow``, the one switch for them:
``pytest tests --run-slow``, or ``bash scripts/test.sh --run-slow`` (CI leaves them out for time)."""

from __future__ import annotations

import pytest
import torch


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="also run tests marked slow")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (auto-skipped without one)")
    config.addinivalue_line("markers", "slow: long-running; run with --run-slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    has_cuda = torch.cuda.is_available()
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    skip_slow = pytest.mark.skip(reason="slow: run with --run-slow")
    for item in items:
        if "cuda" in item.keywords and not has_cuda:
            item.add_marker(skip_cuda)
        if "slow" in item.keywords and not config.getoption("--run-slow"):
            item.add_marker(skip_slow)
