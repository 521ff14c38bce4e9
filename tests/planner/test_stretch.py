"""Stretching the step when bubbles are too short: within max_overhead, as little as the grid allows,
valid, checked by the validator, nothing changed at max_overhead=0, never worse than greedy."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fxkfac.planner.plan.plan import Plan
from fxkfac.planner.problem.costs import CostTable
from fxkfac.planner.problem.errors import Knob, PlanError
from fxkfac.planner.problem.ir import OpKind
from fxkfac.planner.problem.problem import Problem, SolverConfig
from fxkfac.planner.problem.step_timeline import step_timeline
from fxkfac.planner.search.attempt import solve
from fxkfac.planner.validate import validate
from fxkfac.planner.validate.plan_file import parse_plan
from tests.planner.brute_force import brute_feasible
from tests.planner.kfac_cases import problem, problems
from tests.support.cost_tables import kfac_stages

FAST = SolverConfig(time_limit_s=4.0, num_workers=2)
MS = 1e-3


def _chimera_costs(layers: int = 6) -> CostTable:
    """The brief's Chimera D=2 case: 1/2 ms F/B per stage, 0.1 ms curvature, 0.25/0.2 ms inversions."""
    return kfac_stages((layers, layers), 0.1, (0.25, 0.2), 0.01, source="synthetic")


def _added(plan: Plan) -> float:
    return plan.metrics.step_time - plan.metrics.step_time_reference


def test_chimera_d2_has_no_bubble_and_plans_with_the_least_stretch() -> None:
    p = Problem("chimera", 2, 2, _chimera_costs(), max_overhead=1.0)
    with pytest.raises(PlanError, match="cannot fit any bubble.*Stretching the step is off"):
        solve(p, dataclasses.replace(FAST, stretch=False))
    plan = solve(p, FAST)
    assert validate(p, plan) == []
    reference = step_timeline(p).length
    assert 0 < _added(plan) <= p.max_overhead * reference
    assert _added(plan) == pytest.approx(plan.metrics.stretch)
    assert plan.metrics.refresh_steps == (1, 1)
    # No idle time but the stretch: every device's K-FAC work of a step must fit its own stretch.
    # Per device: curvature after each of its F/B (6 layers x 0.1 ms), half of the 24 inversions, and one
    # tick (10 us on this grid) per curvature sync and inverse broadcast (24 each, on both devices). The second
    # all-reduce, between the two PRECs, is free (no comm model): an instant, which takes no tick ([Note: time grid]).
    tick = 1e-5
    assert all(len(p.holders[s]) == 2 for s in range(2))
    work = [
        sum(0.1 * MS * 6 for _ in step_timeline(p).fixed(d)) + (12 * 0.25 * MS + 12 * 0.2 * MS) / 2 + 2 * 24 * tick
        for d in p.devices
    ]
    assert plan.metrics.stretch == pytest.approx(max(work), abs=1e-12)
    with pytest.raises(PlanError):  # one tick less does not place it (k=1 is the only period allowed)
        solve(dataclasses.replace(p, max_period=1, max_overhead=(plan.metrics.stretch - tick) / reference), FAST)
    kfac = [pl for pl in plan.placements if pl.op.kind in (OpKind.STATS, OpKind.DECOMP)]
    assert kfac and all(pl.end <= 2 * plan.metrics.step_time + 1e-12 for pl in kfac)


@pytest.mark.parametrize(
    "schedule,N,curv,inv,overhead",
    [
        ("1f1b", 2, 1, 3, 0.3),
        ("1f1b", 1, 2, 4, 0.6),
        ("1f1b", 1, 1, 5, 1.0),
        ("gpipe", 1, 2, 4, 0.8),
        ("gpipe", 1, 1, 5, 1.0),
    ],
)
def test_a_layer_longer_than_every_bubble_plans_with_the_least_stretch_by_brute_force(
    schedule: str, N: int, curv: int, inv: int, overhead: float
) -> None:
    p = problem(schedule, 2, N, fwd=1, bwd=2, curv=curv, inv=inv, prec=1, max_period=4, max_overhead=overhead)
    reference = round(step_timeline(p).length)
    with pytest.raises(PlanError, match="Solved with: max_overhead="):  # bubbles alone cannot hold the inversion
        solve(dataclasses.replace(p, max_overhead=0.0), FAST)
    cap = int(overhead * reference + 1e-9)
    periods = [next(k for k in range(1, p.max_period + 1) if brute_feasible(p, s, k, cap)) for s in range(2)]
    least = max(next(x for x in range(cap + 1) if brute_feasible(p, s, k, x)) for s, k in enumerate(periods))
    plan = solve(p, FAST)
    assert validate(p, plan) == []
    assert plan.metrics.refresh_steps == tuple(periods)
    assert plan.metrics.stretch == least
    assert _added(plan) == pytest.approx(least) and least <= overhead * reference


def test_the_error_names_the_least_max_overhead_that_places_the_work() -> None:
    p = problem("1f1b", 2, 1, fwd=1, bwd=2, curv=1, inv=4, prec=1, max_period=2, max_overhead=0.5)
    with pytest.raises(PlanError, match="least max_overhead that places it") as info:
        solve(p, FAST)
    (hint,) = [s for s in info.value.suggestions if [k for k, _ in s.changes] == [Knob.MAX_OVERHEAD]]
    need = hint.fields()["max_overhead"]
    assert hint.least and f"max_overhead={need:g}" in str(info.value)
    # brute force: stage 0 needs 4 s of stretch per 7 s step (3 s, what 0.5 allows, is not enough)
    assert not any(brute_feasible(p, 0, k, 3) for k in (1, 2)) and brute_feasible(p, 0, 2, 4)
    assert need == pytest.approx(4 / 7, rel=1e-3) and need >= 4 / 7
    plan = solve(dataclasses.replace(p, max_overhead=need), FAST)
    assert validate(plan.problem, plan) == [] and plan.metrics.stretch == 4


def test_max_overhead_zero_plans_are_what_they_were_without_stretching() -> None:
    one = SolverConfig(time_limit_s=20.0, num_workers=1)
    for p in (
        problem("1f1b", 4, 4, layers=2),
        problem("gpipe", 2, 3, curv=0.25, inv=1.0),
        problem("chimera", 4, 4, W=2, curv=0.5, inv=1.0, prec=0.25),
    ):
        plan = solve(p, one)
        off = solve(p, dataclasses.replace(one, stretch=False))
        assert plan.metrics.stretch == 0.0 and plan.metrics.step_time == plan.metrics.step_time_reference
        assert (plan.programs, plan.layers, plan.placements) == (off.programs, off.layers, off.placements)
        assert dataclasses.replace(plan.metrics, solver=off.metrics.solver) == off.metrics
        assert '"stretch"' not in plan.to_json()  # files read by fxkfac before stretching still load


def _stretched_plan() -> tuple[Problem, Plan]:
    p = problem("1f1b", 2, 1, fwd=1, bwd=2, curv=1, inv=5, prec=1, max_period=4, max_overhead=1.0)
    return p, solve(p, FAST)


def test_the_validator_accepts_exactly_the_allowance_and_rejects_more() -> None:
    p, plan = _stretched_plan()
    stretch, reference = plan.metrics.stretch, step_timeline(p).length
    assert stretch == 5 and parse_plan(plan.to_json()) == plan
    exact = dataclasses.replace(p, max_overhead=stretch / reference)
    assert validate(exact, dataclasses.replace(plan, problem=exact)) == []
    short = dataclasses.replace(p, max_overhead=(stretch - 0.01) / reference)
    errors = validate(short, dataclasses.replace(plan, problem=short))
    assert len(errors) == 1 and "exceeds" in errors[0], errors
    claimed = dataclasses.replace(plan.metrics, stretch=stretch - 1, step_time=plan.metrics.step_time - 1)
    errors = validate(p, dataclasses.replace(plan, metrics=claimed))
    assert any("not within window step" in e or "overlaps" in e for e in errors), errors
    assert validate(p, dataclasses.replace(plan, metrics=dataclasses.replace(plan.metrics, stretch=-1.0)))


@st.composite
def _overhead_problems(draw: st.DrawFn) -> Problem:
    return dataclasses.replace(draw(problems()), max_overhead=draw(st.sampled_from([0.0, 0.1, 0.5])))


def _key(plan: Plan) -> tuple[tuple[int, ...], float]:
    """The planner's ranking: refresh periods, then the simulated step (the stretch alone leaves out the time that
    curvature fused into the backward to fit a memory budget adds)."""
    return plan.metrics.refresh_steps, plan.metrics.step_time


@settings(max_examples=10, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(_overhead_problems())
def test_random_plans_with_an_allowance_are_valid_and_never_worse_than_greedy(p: Problem) -> None:
    config = SolverConfig(time_limit_s=2.0, num_workers=2)
    try:
        greedy: Plan | None = solve(p, config, method="greedy")
    except PlanError:
        greedy = None
    try:
        plan = solve(p, config)
    except PlanError:
        assert greedy is None, "CP-SAT gave up where greedy found a plan"
        return
    assert validate(p, plan) == []
    assert _added(plan) <= p.max_overhead * plan.metrics.step_time_reference * (1 + 1e-9)
    if greedy is not None:
        assert validate(p, greedy) == []
        steps, step_time = _key(plan)
        assert all(c <= g for c, g in zip(steps, greedy.metrics.refresh_steps))
        if steps == greedy.metrics.refresh_steps:
            assert step_time <= greedy.metrics.step_time * (1 + 1e-9)
