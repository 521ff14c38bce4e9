"""A stage without preconditioned layers (a small BERT cut in 4 stages: stage 0 holds only the embeddings) plans,
validates, and survives the plan file round trip; the validator takes its refresh period from the plan's metrics and
still refuses a wrong one."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fxkfac.planner import SearchOptions, SolverConfig, check_plan, parse_plan, plan, validate
from fxkfac.planner.plan.plan import Plan
from fxkfac.planner.problem.costs import CostTable
from fxkfac.planner.problem.problem import Problem
from tests.support.cost_tables import kfac_stages


def _costs() -> CostTable:
    """4 stages, the first without K-FAC layers, the others two each."""
    return kfac_stages((0, 2, 2, 2), 0.05, (0.2, 0.2), 0.01)


def _plan(schedule: str) -> Plan:
    return plan(Problem(schedule, 4, 8, _costs(), W=1), SearchOptions(SolverConfig(time_limit_s=1.0)))


def _with_period(made: Plan, stage: int, k: int) -> Plan:
    steps = list(made.metrics.refresh_steps)
    steps[stage] = k
    return replace(made, metrics=replace(made.metrics, refresh_steps=tuple(steps)))


@pytest.mark.parametrize("schedule", ["1f1b", "chimera"])
def test_a_stage_without_layers_plans_validates_and_reloads(schedule: str) -> None:
    made = _plan(schedule)
    assert validate(made.problem, made) == []
    again = parse_plan(made.to_json())
    assert again == made
    check_plan(again.problem, again)


def test_a_wrong_period_of_a_stage_without_layers_is_refused() -> None:
    made = _plan("1f1b")  # stage 0 alone on its devices: only the period's range binds it
    bad = _with_period(made, 0, made.problem.max_period + 1)
    assert any("stage 0 (no preconditioned layer): bad refresh period" in e for e in validate(bad.problem, bad))


def test_a_stage_without_layers_shares_its_devices_period() -> None:
    made = _plan("chimera")  # stage 0 shares its devices with stage 3
    k = made.metrics.refresh_steps[0]
    bad = _with_period(made, 0, k + 1)
    assert any("share devices but have refresh periods" in e for e in validate(bad.problem, bad))


def test_the_plan_view_draws_a_stage_without_layers() -> None:
    """`fxkfac plan --show`'s summary finds nothing to contradict, and the view and its table render."""
    from rich.console import Console

    from fxkfac.plan_view import planned_view, render_plan, summary_errors

    made = _plan("1f1b")
    assert summary_errors(made) == []
    view = planned_view(made)
    assert view.steps >= made.metrics.refresh_steps[0] and view.end > 0
    console = Console(width=100, record=True)
    console.print(render_plan(made))
    assert "refresh" in console.export_text()
