"""Curvature placed as one STATS task per F/B (`_aggregate`, for groups of many layers) or per layer: a group whose
aggregated tasks each fit a bubble but do not all fit is placed per layer, so a larger max_overhead never refuses
what a smaller one planned."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from fxkfac.planner.errors import PlanError
from fxkfac.planner.problem import Problem, SolverConfig
from fxkfac.planner.solve import solve
from fxkfac.planner.validate import validate

# A profiled BERT (hidden 128, 4 blocks) on Chimera D=2, N=4 (no bubble): at max_overhead 0.06 its aggregated
# STATS tasks (each about one step's stretch long) found no placement within 32 steps, while 0.0379 planned.
DATA = Path(__file__).parent.parent / "data" / "chimera_aggregated_stats_unplaceable_problem.json"
PROBLEM = Problem.from_dict(json.loads(DATA.read_text()))
CONFIG = SolverConfig(time_limit_s=5.0, num_workers=2)


def test_aggregated_statistics_alone_place_nothing_here() -> None:
    with pytest.raises(PlanError, match="no placement"):
        solve(PROBLEM, dataclasses.replace(CONFIG, aggregate=True), "greedy", suggest=False)


@pytest.mark.parametrize("max_overhead", [0.0379, 0.06, 0.1])
def test_a_group_the_aggregated_tasks_cannot_place_is_placed_per_layer(max_overhead: float) -> None:
    problem = dataclasses.replace(PROBLEM, max_overhead=max_overhead)
    plan = solve(problem, CONFIG, "greedy", suggest=False)
    assert validate(problem, plan) == []


def test_more_max_overhead_never_refreshes_less_often() -> None:
    periods = [
        max(solve(dataclasses.replace(PROBLEM, max_overhead=m), CONFIG, "greedy", suggest=False).metrics.refresh_steps)
        for m in (0.0379, 0.06, 0.1)
    ]
    assert periods == sorted(periods, reverse=True) and periods[0] > periods[-1], periods
