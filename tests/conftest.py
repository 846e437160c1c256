"""Test fixtures: RNG state restored around each test; ``devices()`` for cpu/cuda
parametrisation. The ``cuda``/``slow`` markers are handled in the repository's conftest.py."""

from __future__ import annotations

import random

import pytest
import torch


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
