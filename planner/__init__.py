"""fxkfac.planner: pure-Python planning of a preconditioner's work into pipeline bubbles (no torch, no front).

The front door: describe the pipeline and its costs as a `Problem`, say how to search with `SearchOptions`, and
`plan(problem, options)` returns a `Plan` (or raises a `PlanError` naming what would plan); `check_plan` validates
one independently, and the plan-file functions read one back. The modules below stay importable for the planner's
own tests and for what is not planning (cost tables, schedules, the timeline).
"""

from fxkfac.planner.plan.plan import Plan
from fxkfac.planner.problem.costs import CostTable
from fxkfac.planner.problem.errors import (
    ConfigError,
    CostModelError,
    DeadlockError,
    InfeasibleBudgetError,
    Knob,
    PlanError,
    PlanFormatError,
    PlanMismatchError,
    PlannerError,
    ScheduleError,
    Suggestion,
)
from fxkfac.planner.problem.problem import Problem, SolveProgress, SolverConfig, StepBarrier
from fxkfac.planner.problem.schedules import ScheduleKind
from fxkfac.planner.problem.strategy import Strategy, StrategyKind, parse_strategy
from fxkfac.planner.search.attempt import Method
from fxkfac.planner.search.budget import Budget
from fxkfac.planner.search.plan_search import Distributions, Overhead, SearchOptions, StreamApply, TimeLimit, plan
from fxkfac.planner.validate import check_plan, validate
from fxkfac.planner.validate.plan_file import load_plan, parse_plan, read_plan

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
