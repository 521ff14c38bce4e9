"""Progress of plan="auto" and of training (fxkfac/progress.py), and plan="auto"'s default memory budget.

The solver's reports only observe: a plan made with them equals one made without. Log mode is what a piped run
shows; rich mode is drawn into a string console.
"""

from __future__ import annotations

import io
import itertools
import logging
import sys
from collections.abc import Callable
from functools import cache

import pytest
import torch
from rich.console import Console
from torch import nn

import fxkfac
from fxkfac.autoplan import Target, solve_for
from fxkfac.compile_api import auto_budget, device_memory
from fxkfac.config import PipelineOptions, PlanOptions
from fxkfac.planner.plan.plan import Plan
from fxkfac.planner.problem.errors import InfeasibleBudgetError
from fxkfac.planner.problem.problem import SolveProgress, SolverConfig
from fxkfac.planner.problem.schedules import ScheduleKind
from fxkfac.planner.problem.step_timeline import min_memory_bytes
from fxkfac.planner.search.attempt import solve
from fxkfac.progress import Display, PlanProgress, TrainingProgress, solve_text
from tests.planner.kfac_cases import problem

CONFIG = SolverConfig(time_limit_s=1.0)


@cache
def _reported_plan() -> tuple[Plan, list[SolveProgress]]:
    """A small 1F1B plan whose staleness CP-SAT improves several times, with every report it made."""
    events: list[SolveProgress] = []
    plan = solve(problem("1f1b", 4, 4, layers=2), SolverConfig(time_limit_s=1.0, progress=events.append))
    return plan, events


def _ticking(step: float = 1.0) -> Callable[[], float]:
    """A clock that advances `step` seconds at every reading."""
    counter = itertools.count()
    return lambda: next(counter) * step


def test_solver_reports_improve_and_only_observe() -> None:
    plan, events = _reported_plan()
    assert plan == solve(problem("1f1b", 4, 4, layers=2), CONFIG)  # the same plan with or without the callback
    found = [e for e in events if e.objective is not None]
    assert found and any(e.done for e in found)
    for window, group in itertools.groupby(found, key=lambda e: e.window):
        seen = list(group)
        objectives = [e.objective for e in seen]
        bounds = [e.bound for e in seen]
        assert objectives == sorted(objectives, reverse=True), window  # non-increasing
        assert bounds == sorted(bounds), window  # non-decreasing
        assert all(b <= o for o, b in zip(objectives, bounds))  # type: ignore[operator]  # objective and bound are set in every report seen here
    assert found[-1].done and found[-1].gap is not None and 0 <= found[-1].gap <= 1


def test_plan_progress_logs_phases_solver_and_summary(caplog: pytest.LogCaptureFixture) -> None:
    plan, events = _reported_plan()
    progress = PlanProgress(Display.LOG, clock=_ticking())
    with caplog.at_level(logging.INFO, logger="fxkfac.progress"):
        progress.phase("profiling the 2 stage(s)")
        progress.phase("solving")
        for event in events:
            progress.solver(event)
        progress.done(plan)
    text = [r.getMessage() for r in caplog.records]
    assert "plan='auto': profiling the 2 stage(s) took 1.0 s" in text
    solved = [t for t in text if "solving: stages" in t]
    assert any("objective" in t and "bound" in t and "gap" in t for t in solved)
    assert len(solved) < len(events)  # improvements are thinned, every minimization's end is kept
    assert any(t.startswith("plan='auto': refresh steps per stage:") for t in text)


def test_plan_progress_rich_draws_phases_and_summary() -> None:
    plan, events = _reported_plan()
    out = io.StringIO()
    progress = PlanProgress(Display.RICH, console=Console(file=out, force_terminal=True, width=100))
    progress.phase("measuring the links between ranks")
    progress.phase("solving")
    progress.solver(events[-1])
    progress.done(plan)
    drawn = out.getvalue()
    assert "✓" in drawn and "measuring the links between ranks" in drawn and "refresh steps per stage" in drawn


def test_solve_text_names_objective_bound_and_gap() -> None:
    assert (
        solve_text(SolveProgress("stages [0] k=2", "OPTIMAL", 4.0, 4.0, 0.25, True))
        == "stages [0] k=2: objective 4, bound 4, gap 0%, optimal (0.2 s)"
    )
    assert (
        solve_text(SolveProgress("stages [1] k=3", "INFEASIBLE", None, None, 0.0, True))
        == "stages [1] k=3: cannot be placed (0.0 s)"
    )
    assert SolveProgress("w", "FEASIBLE", 8.0, 2.0, 1.0, False).gap == 0.75


def test_training_progress_logs_every_interval(caplog: pytest.LogCaptureFixture) -> None:
    progress = TrainingProgress(Display.LOG, clock=_ticking(), every_s=10.0)
    with caplog.at_level(logging.INFO, logger="fxkfac.progress"):
        for step in range(1, 26):
            progress.update(step, 2.0 / step)
    assert [r.getMessage() for r in caplog.records] == [
        "step 1  loss 2.0000  - steps/s",
        "step 11  loss 0.1818  1.00 steps/s",
        "step 21  loss 0.0952  1.00 steps/s",
    ]


def test_training_progress_rich_bar() -> None:
    out = io.StringIO()
    progress = TrainingProgress(
        Display.RICH, console=Console(file=out, force_terminal=True, width=100), clock=_ticking(0.5)
    )
    for step in range(1, 4):
        progress.update(step, 1.5)
    progress.close()
    assert "step 3" in out.getvalue() and "loss 1.5000" in out.getvalue() and "2.00 steps/s" in out.getvalue()


def test_progress_flag_shows_every_step_of_one_device(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "stdout", io.StringIO())  # not a terminal: log mode, also under `pytest -s`
    monkeypatch.setattr("fxkfac.progress.LOG_EVERY_S", 0.0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
    trainer = fxkfac.compile(
        model,
        None,
        plan=None,
        example_inputs=(x,),
        loss_fn=nn.functional.cross_entropy,
        backend=None,
        pipeline=PipelineOptions(progress=True),
    )
    with caplog.at_level(logging.INFO, logger="fxkfac.progress"):
        losses = [trainer.step((x,), y) for _ in range(3)]
    lines = [r.getMessage() for r in caplog.records if r.name == "fxkfac.progress"]
    assert [line.split("  ")[:2] for line in lines] == [
        [f"step {n}", f"loss {loss:.4f}"] for n, loss in enumerate(losses, 1)
    ]


def test_progress_flag_off_is_silent(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="fxkfac.progress"):
        TrainingProgress(Display.OFF).update(1, 1.0)
    assert not caplog.records
    with pytest.raises(fxkfac.errors.ConfigError, match="progress"):
        PipelineOptions(progress="yes")  # type: ignore[arg-type]  # the wrong type is the point


def test_device_memory_is_the_default_budget_and_an_explicit_one_wins() -> None:
    assert auto_budget(PlanOptions(), lambda: 8 << 30).memory_budget == 8 << 30
    assert auto_budget(PlanOptions(), lambda: None).memory_budget is None  # CPU: unlimited

    def never() -> int:
        raise AssertionError("the device is not asked when the user set a budget")

    assert auto_budget(PlanOptions(memory_budget=1 << 30), never).memory_budget == 1 << 30
    assert device_memory([nn.Linear(2, 2).weight]) is None  # parameters on the CPU: no device budget


def test_a_device_budget_too_small_is_refused_with_the_least_that_fits() -> None:
    target = Target("graph", ScheduleKind.ONE_F_ONE_B, 2, 2, 1)
    costs = problem("1f1b", 2, 2, layers=2).costs
    options = auto_budget(PlanOptions(max_overhead=0.5, time_limit_s=1.0), lambda: 1 << 10)
    least = min_memory_bytes(solve_for(target, costs, PlanOptions(max_overhead=0.5, time_limit_s=1.0)).problem)
    with pytest.raises(InfeasibleBudgetError, match="least") as refused:
        solve_for(target, costs, options)
    assert refused.value.suggestions and least > 1 << 10
