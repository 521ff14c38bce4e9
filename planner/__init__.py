"""fxkfac.planner: pure-Python planning of a preconditioner's work into pipeline bubbles (no torch, no front).

Describe the pipeline and its costs as a `Problem` and how to search as `SearchOptions`: `plan(problem, options)`
returns a `Plan` (or raises a `PlanError` naming what would plan), `check_plan` validates one independently, and the
plan-file functions read one back. The sub-packages problem, plan, search and validate each export their own surface;
their modules stay importable for what is not planning (cost tables, schedules, the timeline)."""

from fxkfac.planner.plan import Plan
from fxkfac.planner.problem import (
    ConfigError,
    CostModelError,
    CostTable,
    DeadlockError,
    InfeasibleBudgetError,
    Knob,
    PlanError,
    PlanFormatError,
    PlanMismatchError,
    PlannerError,
    Problem,
    ScheduleError,
    ScheduleKind,
    SolveProgress,
    SolverConfig,
    StepBarrier,
    Strategy,
    StrategyKind,
    Suggestion,
    parse_strategy,
)
from fxkfac.planner.search import Budget, Distributions, Method, Overhead, SearchOptions, StreamApply, TimeLimit, plan
from fxkfac.planner.validate import check_plan, load_plan, parse_plan, read_plan, validate

__all__ = [
    "Budget",
    "ConfigError",
    "CostModelError",
    "CostTable",
    "DeadlockError",
    "Distributions",
    "InfeasibleBudgetError",
    "Knob",
    "Method",
    "Overhead",
    "Plan",
    "PlanError",
    "PlanFormatError",
    "PlanMismatchError",
    "PlannerError",
    "Problem",
    "ScheduleError",
    "ScheduleKind",
    "SearchOptions",
    "SolveProgress",
    "SolverConfig",
    "StepBarrier",
    "Strategy",
    "StrategyKind",
    "StreamApply",
    "Suggestion",
    "TimeLimit",
    "check_plan",
    "load_plan",
    "parse_plan",
    "parse_strategy",
    "plan",
    "read_plan",
    "validate",
]
