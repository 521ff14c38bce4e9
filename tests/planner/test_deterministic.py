"""Deterministic planning: one problem and one SolverConfig give one plan, on an idle or a loaded machine.

Only `SolverStats.wall_time` may differ between two solves (it measures the machine), and it is left out of
`Plan ==`. The budgets are small, so that CP-SAT stops at its deterministic limit (status FEASIBLE, not
proven) at least in the Chimera case: a repeat there is the budget's doing, not a proof's.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from typing import Any

import pytest

from fxkfac.planner import SearchOptions
from fxkfac.planner.plan.plan import Plan
from fxkfac.planner.problem.costs import CostTable, StageCost
from fxkfac.planner.problem.errors import PlanError
from fxkfac.planner.problem.problem import Problem, SolverConfig
from fxkfac.planner.problem.schedules import num_stages
from fxkfac.planner.problem.step_timeline import min_memory_bytes
from fxkfac.planner.search import budget
from fxkfac.planner.search.attempt import solve
from fxkfac.planner.validate import validate
from tests.planner.kfac_cases import gradient_layer, problem

CONFIG = SolverConfig(time_limit_s=1.0)
"""The default (deterministic) config with a budget of 0.1 deterministic seconds."""


def _gradient_problem() -> Problem:
    """1F1B D=2 with two Shampoo-like layers per stage (parts fed by the reduced gradient)."""
    stages = tuple(
        StageCost(1.0, 2.0, 1000, 50, tuple(gradient_layer(f"l{s}_{i}") for i in range(2)))
        for s in range(num_stages("1f1b", 2))
    )
    return Problem("1f1b", 2, 2, CostTable(stages, 1, "test", "cpu"))


CASES = {
    "gpipe": lambda: problem("gpipe", 2, 3, layers=2),
    "1f1b": lambda: problem("1f1b", 4, 4, layers=2),
    "chimera": lambda: problem("chimera", 4, 4, W=2, curv=0.5, inv=1.0, prec=0.25, layers=3),
    "1f1b-W2": lambda: problem("1f1b", 2, 4, W=2, layers=2),
    "gradient-parts": _gradient_problem,
    "budget": lambda: _budget_problem(),
}
"""Small problems of each schedule, W=2, gradient-fed parts, and a memory budget that makes the planner fuse
curvature (the Chimera one stops unproven)."""


def _budget_problem() -> Problem:
    """1F1B D=2 whose budget holds less than one micro-batch's kept a: every layer's curvature is fused."""
    base = problem("1f1b", 2, 4, keep=1000)
    return Problem("1f1b", 2, 4, base.costs, memory_budget=min_memory_bytes(base) + 500, max_overhead=0.5)


@cache
def _first(case: str) -> Plan:
    return solve(CASES[case](), CONFIG)


def _text(plan: Plan) -> str:
    """The plan's JSON without its one measurement of the machine (solver wall time)."""
    data: dict[str, Any] = json.loads(plan.to_json())
    del data["metrics"]["solver"]["wall_time"]
    return json.dumps(data, indent=1)


@contextmanager
def _busy(processes: int = 3) -> Iterator[None]:
    """CPU load: `processes` busy loops (more than this machine's cores), ended on exit."""
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]
    try:
        yield
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


@pytest.mark.parametrize("case", list(CASES))
def test_the_same_problem_solved_twice_gives_the_same_plan(case: str) -> None:
    first, again = _first(case), solve(CASES[case](), CONFIG)
    assert validate(first.problem, first) == []
    assert _text(again) == _text(first)
    assert again == first  # wall_time is not part of equality


@pytest.mark.parametrize("case", ["chimera", "gradient-parts"])
def test_a_solve_under_cpu_load_gives_the_same_plan(case: str) -> None:
    first = _first(case)
    with _busy():
        loaded = solve(CASES[case](), CONFIG)
    assert _text(loaded) == _text(first)


def test_the_chimera_case_stops_at_its_deterministic_budget() -> None:
    """Not a proof that repeats: CP-SAT stopped unproven (it kept greedy's plan or found a better one that
    it could not prove), so what repeats is where its budget stopped it."""
    assert _first("chimera").metrics.solver.status in ("GREEDY", "FEASIBLE")
    assert _first("chimera").metrics.solver.gap > 0


def test_a_refusal_names_the_same_values_every_time() -> None:
    """plan="auto" re-plans with the least max_overhead a refusal names: it must not vary either."""
    p = problem("gpipe", 2, 2, inv=6.0)
    errors = []
    for _ in range(2):
        with pytest.raises(PlanError) as info:
            solve(p, CONFIG)
        errors.append(info.value)
    assert errors[0].suggestions and errors[0].suggestions == errors[1].suggestions
    assert str(errors[0]) == str(errors[1])


_IN_A_PROCESS = """
import sys
from fxkfac.planner.search.attempt import solve
from tests.planner.test_deterministic import CASES, CONFIG, _text
print(_text(solve(CASES[sys.argv[1]](), CONFIG)))
"""


def test_processes_with_other_string_hashes_give_the_same_plan() -> None:
    """Across runs of a command, not only within one: no order may come from hashing (PYTHONHASHSEED)."""
    texts = [
        subprocess.run(
            [sys.executable, "-c", _IN_A_PROCESS, "budget"],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("1", "2")
    ]
    assert texts[0] == texts[1] == _text(_first("budget")) + "\n"


def test_a_wall_clock_solve_still_plans() -> None:
    p = CASES["1f1b"]()
    plan = solve(p, SolverConfig(time_limit_s=1.0, deterministic=False))
    assert validate(p, plan) == []
    assert plan.metrics.refresh_steps == _first("1f1b").metrics.refresh_steps  # proven optimal either way


def test_the_wall_clock_safety_cap_is_logged(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(budget, "WALL_CAP", 0.0)
    p = CASES["chimera"]()
    with caplog.at_level(logging.WARNING, logger="fxkfac.planner.search.budget"):
        plan = solve(p, CONFIG)
    assert validate(p, plan) == []
    assert "wall-clock safety cap" in caplog.text and "may differ" in caplog.text


def test_plan_options_pass_determinism_to_the_solver(monkeypatch: pytest.MonkeyPatch) -> None:
    from fxkfac import autoplan
    from fxkfac.config import PlanOptions
    from fxkfac.planner.problem.schedules import ScheduleKind

    seen: list[SolverConfig] = []

    def fake(problem: Problem, options: SearchOptions) -> Plan:
        seen.append(options.solver)
        return _first("gpipe")

    monkeypatch.setattr(autoplan, "plan_search", fake)
    target = autoplan.Target("g", ScheduleKind.GPIPE, 2, 3, 1)
    costs = CASES["gpipe"]().costs
    autoplan.solve_for(target, costs, PlanOptions(max_overhead=0.0))
    autoplan.solve_for(target, costs, PlanOptions(max_overhead=0.0, deterministic=False))
    assert [c.deterministic for c in seen] == [True, False]
