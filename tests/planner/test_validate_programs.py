"""The validator checks the order of each program, which the runtime executes as written."""

from __future__ import annotations

from dataclasses import replace

from fxkfac.planner.plan.plan import Plan
from fxkfac.planner.problem.ir import OpKind
from fxkfac.planner.problem.problem import Problem, SolverConfig
from fxkfac.planner.search.attempt import solve
from fxkfac.planner.validate import validate
from tests.support.cost_tables import kfac_stages


def _plan() -> Plan:
    problem = Problem("gpipe", 2, 2, kfac_stages((3, 3), 0.1, (0.25, 0.2), 0.01, name="s{s}.l{i}"))
    return solve(problem, SolverConfig(time_limit_s=2))


def _moved(plan: Plan, rank: int, kind: OpKind, before: OpKind) -> Plan:
    """The plan with rank's first `kind` op of step 0 moved just before the step's last `before` op."""
    step = list(plan.programs[rank][0])
    op = next(o for o in step if o.kind is kind)
    step.remove(op)
    at = max(i for i, o in enumerate(step) if o.kind is before)
    step.insert(at, op)
    programs = {**plan.programs, rank: [step, *plan.programs[rank][1:]]}
    return replace(plan, programs=programs)


def test_solved_plan_is_valid() -> None:
    plan = _plan()
    assert validate(plan.problem, plan) == []


def test_prec_before_the_last_backward_is_refused() -> None:
    plan = _plan()
    errors = validate(plan.problem, _moved(plan, 0, OpKind.APPLY, OpKind.BWD))
    assert any("APPLY s0" in e and ("wrong order" in e or "comes before" in e) for e in errors), errors


def test_curvature_before_its_forward_ends_is_refused() -> None:
    plan = _plan()
    errors = validate(plan.problem, _moved(plan, 0, OpKind.STATS, OpKind.FWD))
    assert any("STATS" in e and "wrong order" in e for e in errors), errors
