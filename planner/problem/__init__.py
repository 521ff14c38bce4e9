"""The problem and its costs: the program IR, schedules and strategies, cost tables and the hardware they price,
the `Problem`, its programs and its simulated step. The bottom of the planner: it imports nothing else of it.

Below, what describes a problem and its errors; the rest (the timeline, lowering, hardware fits, the sympy-backed
`analytic` and `perf_model`) is imported from its module."""

from fxkfac.planner.problem.costs import CostTable, InverseMethod, LayerCost, PartCost, PreconditionerKind, StageCost
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
from fxkfac.planner.problem.ir import Capture, LayerTiming, Op, OpKind, Program, Programs
from fxkfac.planner.problem.problem import Problem, SolveProgress, SolverConfig, StepBarrier
from fxkfac.planner.problem.profiles import ProfileLayers, load_cost_table
from fxkfac.planner.problem.schedules import ScheduleKind
from fxkfac.planner.problem.strategy import LayerDistribution, Strategy, StrategyKind

__all__ = [
    "Capture", "ConfigError", "CostModelError", "CostTable", "DeadlockError", "InfeasibleBudgetError",
    "InverseMethod", "Knob", "LayerCost", "LayerDistribution", "LayerTiming", "Op", "OpKind", "PartCost",
    "PlanError", "PlanFormatError", "PlanMismatchError", "PlannerError", "PreconditionerKind", "Problem",
    "ProfileLayers", "Program", "Programs", "ScheduleError", "ScheduleKind", "SolveProgress", "SolverConfig",
    "StageCost", "StepBarrier", "Strategy", "StrategyKind", "Suggestion", "load_cost_table",
]  # fmt: skip
