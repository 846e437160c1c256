"""Test fixtures: RNG state restored around each test; ``devices()`` for cpu/cuda
parametrisation; ``ranks``, a pool of spawned gloo ranks per test module that runs one
multi-rank case per test. The ``cuda``/``slow`` markers are handled in the repository's
conftest.py."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch

from .distributed import RankPool


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


class Ranks:
    """One test's handle on its module's rank pools (one pool per world size)."""

    def __init__(self, pools: dict[int, RankPool], test_name: str) -> None:
        self._pools = pools
        self._test_name = test_name

    def run(self, fn: Callable[..., Any], world_size: int = 2, args: Sequence[Any] = (),
            timeout: float = 180.0) -> list[Any]:
        """``fn(rank, world_size, *args)`` on every rank of the pool of ``world_size`` (started
        on first use); the results in rank order, or :class:`tests.distributed.RankFailure`
        naming this test and the failing rank."""
        pool = self._pools.get(world_size)
        if pool is None:
            pool = self._pools[world_size] = RankPool(world_size)
        return pool.run(fn, args, timeout=timeout, name=self._test_name)


@pytest.fixture(scope="module")
def _rank_pools() -> Iterator[dict[int, RankPool]]:
    pools: dict[int, RankPool] = {}
    yield pools
    for pool in pools.values():
        pool.close()


@pytest.fixture
def ranks(_rank_pools: dict[int, RankPool], request: pytest.FixtureRequest) -> Ranks:
    """Runs multi-rank cases in gloo ranks that this test module shares (see :class:`Ranks`)."""
    return Ranks(_rank_pools, request.node.nodeid)
