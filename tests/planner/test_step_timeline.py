"""step_timeline is the step a steady run repeats: compared with multi-step simulations over random, uneven costs."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fxkfac.planner.problem.costs import CostTable, LayerCost, StageCost
from fxkfac.planner.problem.ir import Op, OpKind
from fxkfac.planner.problem.problem import Problem
from fxkfac.planner.problem.step_timeline import (
    Timeline,
    base_programs,
    plain_step_time,
    reference_programs,
    simulate,
    step_timeline,
)

# (schedule, v, N for a given D): interleaved and chimera need N a multiple of D.
SHAPES = [
    ("gpipe", 1, lambda D: D + 1),
    ("1f1b", 1, lambda D: 2 * D),
    ("interleaved", 2, lambda D: D),
    ("chimera", 1, lambda D: D),
]

SECONDS = st.one_of(st.just(0.0), st.floats(1e-9, 1e-5), st.floats(1e-3, 0.1), st.floats(0.5, 5.0))
"""Zero, near zero, and milliseconds to seconds: stages and APPLY up to 10^9 times apart."""


def _costs(times: list[tuple[float, float, float]]) -> CostTable:
    """One stage per (fwd, bwd, prec), each with one K-FAC layer that carries the APPLY time."""
    stages = tuple(
        StageCost(f, b, 0, 0, (LayerCost.kfac(f"layer{s}", 0.0, 0.0, 0.0, 0.0, p, 0, 0, 0, 0),))
        for s, (f, b, p) in enumerate(times)
    )
    return CostTable(stages, 1, "test", "test")


def _durations(times: list[tuple[float, float, float]]) -> Callable[[int, Op], float]:
    """Op durations read straight from the drawn numbers (F, B, APPLY; everything else takes no time)."""
    index = {OpKind.FWD: 0, OpKind.BWD: 1, OpKind.APPLY: 2}
    return lambda rank, op: times[op.stage][index[op.kind]] if op.kind in index else 0.0  # type: ignore[index]  # FWD and BWD name their stage


def _step(run: Timeline, rank: int, j: int, shift: float) -> list[tuple[Op, float, float]]:
    """Step j of `rank` in the run, moved back by `shift` seconds."""
    return [(iv.op, iv.start - shift, iv.end - shift) for iv in run.of_rank(rank) if iv.step == j]


def _assert_repeats(problem: Problem, times: list[tuple[float, float, float]], with_prec: bool, steps: int) -> None:
    """Every simulated step of a steady run is step_timeline moved by a whole number of its lengths."""
    step = step_timeline(problem, frozenset(), with_prec)
    programs = reference_programs(problem) if with_prec else base_programs(problem)
    run = simulate(programs, _durations(times), steps=steps)
    tol = 1e-9 * step.length  # rounding grows with the times, which are at most `steps` lengths
    assert run.length == pytest.approx(steps * step.length, rel=1e-9, abs=tol)
    for j in range(steps):
        for rank in run.ranks:
            got = _step(run, rank, j, j * step.length)
            assert [op for op, _, _ in got] == [op for op, _, _ in step.ops[rank]]
            assert [t for _, a, b in got for t in (a, b)] == pytest.approx(
                [t for _, a, b in step.ops[rank] for t in (a, b)], rel=1e-9, abs=tol
            )
    for j in range(steps - 1):  # the barrier: step j+1 starts nowhere before step j has ended everywhere
        ended = max(iv.end for iv in run.intervals if iv.step == j)
        assert min(iv.start for iv in run.intervals if iv.step == j + 1) >= ended - tol


@settings(max_examples=60, deadline=None)
@given(
    shape=st.sampled_from(SHAPES),
    D=st.sampled_from([2, 4]),
    W=st.sampled_from([1, 2]),
    steps=st.sampled_from([3, 4]),
    with_prec=st.booleans(),
    data=st.data(),
)
def test_step_timeline_is_every_step_of_a_multi_step_simulation(
    shape: tuple, D: int, W: int, steps: int, with_prec: bool, data: st.DataObject
) -> None:
    schedule, v, n_of = shape
    S = D * v
    times = data.draw(st.lists(st.tuples(SECONDS, SECONDS, SECONDS), min_size=S, max_size=S), label="fwd/bwd/prec")
    problem = Problem(schedule, D, n_of(D), _costs(times), W=W, v=v)
    _assert_repeats(problem, times, with_prec, steps)


UNEVEN = [(0.015, 0.0, 0.0003), (0.057, 0.0, 2.0)]
"""Two stages, forwards of 15 ms and 57 ms, no backward time, APPLY of 0.3 ms and 2 s (it crashed step_timeline)."""


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_uneven_stages_with_a_long_prec_regression(schedule: str) -> None:
    problem = Problem(schedule, 2, 4, _costs(UNEVEN))
    # by hand: stage 1 runs its 4 forwards back to back once stage 0's first is done, then its APPLY
    plain = 0.015 + 4 * 0.057
    assert plain_step_time(problem) == pytest.approx(plain)
    assert step_timeline(problem).length == pytest.approx(plain + 2.0)
    run = simulate(reference_programs(problem), _durations(UNEVEN), steps=3)
    first_fwd = [iv.start for iv in run.of_rank(0) if iv.op == Op(OpKind.FWD, 0, 0)]
    assert first_fwd == pytest.approx([0.0, plain + 2.0, 2 * (plain + 2.0)])  # rank 0 waits for the barrier
    for with_prec in (True, False):
        _assert_repeats(problem, UNEVEN, with_prec, 3)
