"""The overhead benchmarks' timed block (`block_steps`): each variant's own whole refresh cycles, at least a minimum."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
from pipefisher_overhead import block_steps  # noqa: E402 - a benchmark script, found on the path just set


def _fewest_whole_cycles(periods: list[int], least: int) -> int:
    """The reference: count up from `least` to the first step count every period divides."""
    n = least
    while any(n % p for p in periods):
        n += 1
    return n


@pytest.mark.parametrize(
    ("periods", "least"),
    [([1], 10), ([3, 5], 10), ([3, 5], 15), ([6, 13], 10), ([29], 10), ([2, 4], 9), ([7], 1), ([4, 6], 30)],
)
def test_block_is_the_fewest_whole_common_periods_of_at_least_least_steps(periods: list[int], least: int) -> None:
    block = block_steps(periods, least)
    assert block == _fewest_whole_cycles(periods, least)
    assert block >= least and all(block % p == 0 for p in periods)
