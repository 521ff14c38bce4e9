"""The problem and its costs: the program IR, schedules and strategies, cost tables and the hardware they price,
the `Problem`, its programs and its simulated step. The bottom of the planner: it imports nothing else of it.

The names below load without sympy; the analytic cost model (`problem.analytic`) and the closed-form performance
model (`problem.perf_model`), which need it, are imported by their module path.
"""

from fxkfac.planner.problem.costs import (
    WORDS,
    CostTable,
    InverseMethod,
    LayerCost,
    PartCost,
    PreconditionerKind,
    Spread,
    StageCost,
    TaskWords,
    combined_stage,
    kind_of,
    median_of,
    tied_owner,
    words_of,
)
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
from fxkfac.planner.problem.hardware import (
    AlphaBeta,
    Collective,
    CommModel,
    LinkCosts,
    Sample,
    describe,
    fit_alpha_beta,
)
from fxkfac.planner.problem.ir import COLLECTIVE_KINDS, Capture, LayerTiming, Op, OpKind, Program, Programs, ops_at
from fxkfac.planner.problem.lowering import (
    Assignment,
    decomposition_seconds,
    linked_classes,
    naive_programs,
    rank_programs,
    ranks_of_stages,
)
from fxkfac.planner.problem.problem import (
    Problem,
    SolveProgress,
    SolverConfig,
    StepBarrier,
    format_bytes,
    is_streamed,
    stages_on_device,
)
from fxkfac.planner.problem.profiles import (
    PIPEFISHER_COLUMNS,
    ProfileLayers,
    block_profile_json,
    is_profile,
    load_cost_table,
)
from fxkfac.planner.problem.schedules import (
    ZERO_BUBBLE_KINDS,
    ScheduleKind,
    num_stages,
    stages_of_rank,
    validate_schedule_args,
)
from fxkfac.planner.problem.step_timeline import (
    BUSY_KINDS,
    Interval,
    Timeline,
    plain_step_time,
    simulate,
    stage_comm,
    utilization,
)
from fxkfac.planner.problem.strategy import (
    LayerDistribution,
    Strategy,
    StrategyKind,
    distribute,
    grad_workers,
    holding,
    keeps_statistics,
    parse_strategy,
)

__all__ = [
    "BUSY_KINDS", "COLLECTIVE_KINDS", "PIPEFISHER_COLUMNS", "WORDS", "ZERO_BUBBLE_KINDS", "AlphaBeta", "Assignment",
    "Capture", "Collective", "CommModel", "ConfigError", "CostModelError", "CostTable", "DeadlockError",
    "InfeasibleBudgetError", "Interval", "InverseMethod", "Knob", "LayerCost", "LayerDistribution", "LayerTiming",
    "LinkCosts", "Op", "OpKind", "PartCost", "PlanError", "PlanFormatError", "PlanMismatchError", "PlannerError",
    "PreconditionerKind", "Problem", "ProfileLayers", "Program", "Programs", "Sample", "ScheduleError",
    "ScheduleKind", "SolveProgress", "SolverConfig", "Spread", "StageCost", "StepBarrier", "Strategy",
    "StrategyKind", "Suggestion", "TaskWords", "Timeline", "block_profile_json", "combined_stage",
    "decomposition_seconds", "describe", "distribute", "fit_alpha_beta", "format_bytes",
    "grad_workers", "holding", "is_profile", "is_streamed", "keeps_statistics", "kind_of", "linked_classes",
    "load_cost_table", "median_of", "naive_programs", "num_stages", "ops_at", "parse_strategy", "plain_step_time",
    "rank_programs", "ranks_of_stages", "simulate", "stage_comm", "stages_of_rank",
    "stages_on_device", "tied_owner", "utilization", "validate_schedule_args", "words_of",
]  # fmt: skip
