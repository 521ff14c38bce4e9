"""A refresh step's taps (`StageCost.tap_fwd` / `tap_bwd`, profiled): its F/B are longer by them, a plan pays them
once per refresh period, and max_overhead does not count them (as it does not count APPLY)."""

from __future__ import annotations

import dataclasses

import pytest

from fxkfac.planner.problem.problem import Problem, SolverConfig
from fxkfac.planner.problem.step_timeline import step_timeline, tap_extra
from fxkfac.planner.search.attempt import solve
from fxkfac.planner.validate import validate
from tests.planner.kfac_cases import problem

FAST = SolverConfig(time_limit_s=4.0, num_workers=2)
PLAIN = problem("1f1b", 2, 4, fwd=1, bwd=2, curv=0.25, inv=1, prec=0.25, max_period=8)


def _with_stage0(p: Problem, **fields: float) -> Problem:
    """`p` with stage 0's cost fields replaced."""
    first, *rest = p.costs.stages
    return dataclasses.replace(
        p, costs=dataclasses.replace(p.costs, stages=(dataclasses.replace(first, **fields), *rest))
    )


TAPPED = _with_stage0(PLAIN, tap_fwd=0.25, tap_bwd=0.5)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_refresh_step_is_the_step_of_stages_whose_f_and_b_include_their_taps(schedule: str) -> None:
    plain = dataclasses.replace(PLAIN, schedule=schedule)
    tapped = _with_stage0(plain, tap_fwd=0.25, tap_bwd=0.5)
    first = plain.costs.stages[0]
    grown = _with_stage0(plain, fwd=first.fwd + 0.25, bwd=first.bwd + 0.5)
    assert step_timeline(tapped, refresh=True).length == pytest.approx(step_timeline(grown).length)
    assert step_timeline(tapped).length == pytest.approx(step_timeline(plain).length)
    assert tap_extra(tapped) > 0


@pytest.mark.parametrize("method", ["greedy", "cpsat"])
def test_a_plan_pays_the_taps_once_per_refresh_within_max_overhead_zero(method: str) -> None:
    plan = solve(TAPPED, FAST, method=method)
    assert TAPPED.max_overhead == 0 and validate(TAPPED, plan) == []
    k = min(plan.metrics.refresh_steps)
    expected = plan.metrics.step_time_reference + tap_extra(TAPPED) / k
    assert plan.metrics.step_time == pytest.approx(expected, abs=plan.metrics.time_quantum + 1e-9)


def test_a_plan_made_without_the_taps_claims_a_step_they_break() -> None:
    cold = solve(PLAIN, FAST, method="cpsat")
    errors = validate(TAPPED, dataclasses.replace(cold, problem=TAPPED))
    assert any("step time" in e and "claimed" in e for e in errors), errors
