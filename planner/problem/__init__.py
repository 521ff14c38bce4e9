"""The problem and its costs (IR, schedules, strategies, cost tables, hardware, programs, the simulated step), the
bottom of the planner. Exported: what describes a problem, and the errors; the rest (sympy's analytic model
among it) is imported from its module."""

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
