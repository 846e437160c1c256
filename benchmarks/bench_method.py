"""The measuring method shared by the benchmarks: the median's interval that the zoo reports
and the number of rounds a case runs for its time budget."""

from __future__ import annotations

import math
import random

import pytest

from .common import median_interval
from .zoo.measure import Schedule, rounds_for


def _coverage(n: int, k: int) -> float:
    """Probability that order statistics k and n + 1 - k of n draws enclose the median."""
    return 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2**n


@pytest.mark.parametrize("n", [6, 7, 11, 20, 41, 101])
def test_median_interval_is_the_narrowest_with_95_percent(n: int) -> None:
    xs = list(range(1, n + 1))
    random.Random(n).shuffle(xs)  # order statistics, whatever order the rounds came in
    lo, hi = median_interval(xs)
    k = lo
    assert hi == n + 1 - k
    assert _coverage(n, k) >= 0.95
    assert k + 1 > n // 2 or _coverage(n, k + 1) < 0.95  # one step narrower falls short


def test_median_interval_of_few_values_is_their_range() -> None:
    assert median_interval([3.0, 1.0, 2.0]) == (1.0, 3.0)
    assert median_interval([5.0]) == (5.0, 5.0)
    with pytest.raises(ValueError, match="at least one value"):
        median_interval([])


def test_rounds_fill_the_budget_between_the_bounds() -> None:
    fixed = Schedule(rounds=11, min_steps=4, block_s=0.3)
    assert rounds_for(fixed, 0.01) == 11  # no budget: exactly `rounds`
    budget = Schedule(rounds=11, min_steps=4, block_s=0.3, max_rounds=41, budget_s=60.0)
    assert rounds_for(budget, 1.4) == 41  # 42 would fit: capped
    assert rounds_for(budget, 2.0) == 30
    assert rounds_for(budget, 9.0) == 11  # 6 fit: at least `rounds`
