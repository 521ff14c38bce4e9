"""schedule="auto": the candidates a mesh allows and the least step at the freshest curvature among their plans."""

from __future__ import annotations

import pytest

from fxkfac.planner import Budget, Method, Overhead, Plan, SearchOptions, TimeLimit
from fxkfac.planner import plan as plan_search
from fxkfac.planner.problem.errors import ConfigError, PlanError
from fxkfac.planner.problem.problem import Problem, SolverConfig
from fxkfac.planner.problem.schedules import ScheduleKind
from fxkfac.planner.search.plan_search import NO_TIME, ScheduleCandidate, choose_schedule, schedule_candidates
from fxkfac.planner.validate import validate
from tests.planner.kfac_cases import problem

OPTIONS = SearchOptions(
    solver=SolverConfig(time_limit_s=2.0, num_workers=2),
    method=Method.CPSAT,
    overhead=Overhead.STRICT,
    time_limit=TimeLimit.EACH_SOLVE,
)


def test_candidates_are_the_schedules_the_mesh_allows() -> None:
    assert [str(c) for c in schedule_candidates(2, 4)] == [
        "gpipe",
        "1f1b",
        "interleaved v=2",
        "chimera",
        "zb-h1",
        "zb-v v=2",
        "zb-1p v=2",
    ]
    assert [str(c) for c in schedule_candidates(3, 4, v=3)] == ["gpipe", "1f1b", "zb-h1", "zb-v v=2"]
    assert ScheduleCandidate(ScheduleKind.ZB_1P, 3) in schedule_candidates(3, 6, v=3)


def _problem_for(c: ScheduleCandidate) -> Problem:
    if c.kind is ScheduleKind.GPIPE:
        raise ConfigError("the model has too few layers for this cut")  # a candidate the costs refuse
    return problem(c.kind, 2, 4, v=c.v, fwd=1.0, bwd=2.0, curv=0.25, inv=1.5, max_overhead=0.3, max_period=8)


def _each_solve(p: Problem, part: Budget) -> Plan:  # EACH_SOLVE: every placement the whole limit, `part` unused
    return plan_search(p, OPTIONS, budget=part)


def test_auto_takes_the_least_step_among_plans_at_the_freshest_curvature() -> None:
    choice = choose_schedule(schedule_candidates(2, 4), _problem_for, _each_solve, Budget.of(OPTIONS.solver))
    firsts = [t.first for t in choice.tried if t.first is not None]
    assert choice.period == min(max(p.metrics.refresh_steps) for p in firsts)
    compared = [t.plan for t in choice.tried if t.plan is not None]
    assert all(max(p.metrics.refresh_steps) <= choice.period for p in compared)
    assert choice.plan.metrics.step_time == min(p.metrics.step_time for p in compared)
    assert validate(choice.plan.problem, choice.plan) == []
    assert choice.reason.startswith(f"{choice.plan.problem.schedule}")
    assert "gpipe out: the model has too few layers" in choice.reason
    for t in choice.tried:  # out of the comparison, each with its reason in the choice's words
        assert (t.plan is None) == bool(t.why_not)
        assert not t.why_not or f"{t.candidate} out: {t.why_not}" in choice.reason
        if t.first is not None and t.plan is None:  # could not refresh that often, or could not beat the chosen step
            assert t.why_not.startswith(f"cannot refresh every {choice.period} steps") or (
                t.why_not.startswith("cannot beat") and t.plain > choice.plan.metrics.step_time
            )
        for plan in (t.first, t.plan):  # the plain step the choice orders and skips by bounds every plan's step
            assert plan is None or plan.metrics.step_time >= t.plain * (1 - 1e-9)


def test_auto_says_why_when_no_schedule_plans() -> None:
    def refused(c: ScheduleCandidate) -> Problem:
        raise ConfigError(f"no cut for {c}")

    with pytest.raises(PlanError, match="1f1b: no cut for 1f1b"):
        choose_schedule(schedule_candidates(2, 4), refused, _each_solve, Budget.of(OPTIONS.solver))


def test_auto_charges_the_whole_choice_to_one_budget() -> None:
    """`--time-limit` bounds the whole choice: every candidate's plan and re-plan takes its part of one deterministic
    budget, so what they spent together (CP-SAT's deterministic time and the charges) stays within the limit's."""
    whole = SearchOptions(solver=SolverConfig(time_limit_s=1.0), overhead=Overhead.STRICT)
    budget = Budget.of(whole.solver, whole=True)
    parts: list[tuple[float, float]] = []  # (clock at the call, the part's end)

    def plan_of(p: Problem, part: Budget) -> Plan:
        parts.append((budget.now(), part.end))
        return plan_search(p, whole, budget=part)

    choice = choose_schedule(schedule_candidates(2, 4), _problem_for, plan_of, budget)
    assert validate(choice.plan.problem, choice.plan) == []
    assert len(parts) > len(schedule_candidates(2, 4)) - 1  # every schedule gpipe's cut leaves, and re-plans
    assert all(end <= max(now, budget.end) for now, end in parts)  # each part within the one budget (or none left)
    assert 0 < budget.tally.spent <= budget.limit * 1.1  # the T plus 10%, on the deterministic clock


def test_a_short_budget_plans_the_schedule_of_the_least_plain_step_first() -> None:
    """Candidates are planned least plain step first ([Note: schedule order]): a budget spent by the first plan leaves
    the zero-bubble schedule, not GPipe's or 1F1B's wide bubbles, as the one planned, and says the order."""
    whole = SearchOptions(solver=SolverConfig(time_limit_s=1.0), overhead=Overhead.STRICT)
    budget = Budget.of(whole.solver, whole=True)
    calls: list[str] = []

    def plan_of(p: Problem, part: Budget) -> Plan:
        calls.append(p.schedule)
        made = plan_search(p, whole, budget=part)
        budget.charge(budget.limit)  # the first plan spends the whole budget
        return made

    choice = choose_schedule(schedule_candidates(2, 4), _problem_for, plan_of, budget)
    plain = {str(t.candidate.kind): t.plain for t in choice.tried if t.plain > 0}
    assert calls == [min(plain, key=lambda kind: plain[kind])] == [str(choice.plan.problem.schedule)]
    assert plain[calls[0]] < plain["1f1b"]
    assert all(t.why_not == NO_TIME for t in choice.tried if t.plan is None and t.plain > 0)
    assert "planned least plain step first: " in choice.reason


def test_a_replan_that_cannot_beat_the_best_step_is_not_made() -> None:
    """At the freshest period a stale candidate whose plain step is above the best plan's step is out without a
    re-plan, and says why; those whose plain step could still win are planned again."""
    calls: list[tuple[str, int]] = []

    def plan_of(p: Problem, part: Budget) -> Plan:
        calls.append((p.schedule, p.max_period))
        return _each_solve(p, part)

    choice = choose_schedule(schedule_candidates(2, 4), _problem_for, plan_of, Budget.of(OPTIONS.solver))
    replans = [kind for kind, period in calls if period == choice.period and kind != "1f1b"]
    for t in choice.tried:
        if t.why_not.startswith("cannot beat"):
            assert (str(t.candidate.kind), choice.period) not in calls
            assert t.plain > choice.plan.metrics.step_time
            assert f"its plain step is {t.plain * 1e3:.1f} ms" in t.why_not
        elif t.first is not None and max(t.first.metrics.refresh_steps) > choice.period:
            assert str(t.candidate.kind) in replans
    assert any(t.why_not.startswith("cannot beat") for t in choice.tried)
