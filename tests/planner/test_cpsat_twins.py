"""No CP-SAT model of the planner holds two interval constraints alike ([Note: no twin intervals] in
planner/search/cpsat.py): OR-Tools 9.15's presolve raised IndexError out of `CpSolver.solve` on such twins, which
crashed the least-overhead search of Chimera D=2 N=4 at max_period=1."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest
from ortools.sat.python import cp_model

from fxkfac.planner import Overhead, Problem, SearchOptions, SolverConfig, TimeLimit, plan, validate
from tests.support.cost_tables import light_pipeline


def _twins(model: cp_model.CpModel) -> int:
    """How many interval constraints repeat an earlier one (its name aside)."""
    seen = Counter((tuple(c.enforcement_literal), str(c.interval)) for c in model.proto.constraints if c.has_interval())
    return sum(n - 1 for n in seen.values())


@pytest.fixture
def solved_models(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The twin count of every model CP-SAT is asked to solve while the test runs."""
    counts: list[int] = []
    solve = cp_model.CpSolver.solve

    def counting(self: cp_model.CpSolver, model: cp_model.CpModel, *args: object) -> object:
        counts.append(_twins(model))
        return solve(self, model, *args)

    monkeypatch.setattr(cp_model.CpSolver, "solve", counting)
    yield counts


def test_chimera_at_period_one_plans_at_the_least_overhead_without_twin_intervals(solved_models: list[int]) -> None:
    p = Problem("chimera", 2, 4, light_pipeline(2), W=1, max_period=1)
    search = SearchOptions(SolverConfig(time_limit_s=1.0), overhead=Overhead.LEAST, time_limit=TimeLimit.WHOLE_SEARCH)
    made = plan(p, search)
    assert made.problem.max_overhead > 0  # the bubbles alone refused it: the least-overhead search ran
    assert made.metrics.refresh_steps == (1, 1)
    assert validate(made.problem, made) == []
    assert solved_models and not any(solved_models), solved_models


def test_the_twin_count_sees_per_device_copies_of_one_interval() -> None:
    """What the planner built before: the fixed work copied per device (so the test above can fail)."""
    m = cp_model.CpModel()
    m.add_no_overlap([m.new_fixed_size_interval_var(0, 5, f"fixed_r{d}_0") for d in range(2)])
    assert _twins(m) == 1
