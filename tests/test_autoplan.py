"""plan="auto" without an explicit max_overhead always plans: bubbles first, else the least growth that places
the work; an explicit max_overhead stays strict."""

from __future__ import annotations

import logging

import pytest

from fxkfac.autoplan import Target, solve_for
from fxkfac.config import PlanOptions
from fxkfac.planner.costs import CostTable, LayerCost, StageCost
from fxkfac.planner.errors import PlanError
from fxkfac.planner.schedules import ScheduleKind
from fxkfac.planner.validate import validate

MS = 1e-3


def _costs(stages: int) -> CostTable:
    """Two layers per stage whose inversions are longer than any bubble of a 2-stage pipeline."""
    return CostTable(
        tuple(
            StageCost(
                1 * MS,
                2 * MS,
                1 << 20,
                1 << 16,
                tuple(
                    LayerCost.kfac(f"s{s}.l{i}", 0.2 * MS, 0.2 * MS, 4 * MS, 4 * MS, 0.05 * MS, 4096, 4096, 4096, 4096)
                    for i in range(2)
                ),
            )
            for s in range(stages)
        ),
        2,
        "test",
        "cpu",
    )


def test_auto_overhead_plans_where_the_bubbles_alone_cannot(caplog: pytest.LogCaptureFixture) -> None:
    target = Target("graph", ScheduleKind.ONE_F_ONE_B, 2, 2, 1)
    with pytest.raises(PlanError, match="max_overhead"):
        solve_for(target, _costs(2), PlanOptions(max_overhead=0.0, time_limit_s=3.0))
    with caplog.at_level(logging.WARNING, logger="fxkfac.autoplan"):
        plan = solve_for(target, _costs(2), PlanOptions(time_limit_s=3.0))
    assert plan.problem.max_overhead > 0 and validate(plan.problem, plan) == []
    assert any("planning with max_overhead=" in r.getMessage() for r in caplog.records)
    assert plan.metrics.step_time <= plan.metrics.step_time_reference * (1 + plan.problem.max_overhead) + 1e-9
