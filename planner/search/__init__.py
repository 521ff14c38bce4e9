"""The search: `plan()`, the one entry point, and every candidate it weighs under one `Budget` (placements by
first-fit and CP-SAT, strategies, streaming, block sizes, recomputation, fusing, schedules). Imports planner.problem
and planner.plan. The names below load without ortools; `search.choose`, `search.cpsat` and `search.group_search`,
which need it, are imported by their module path (plan() loads them at its first placement)."""

from fxkfac.planner.search.attempt import Method
from fxkfac.planner.search.budget import Budget
from fxkfac.planner.search.plan_search import (
    BlockChoice,
    Distributions,
    Overhead,
    ScheduleCandidate,
    ScheduleChoice,
    SearchOptions,
    StreamApply,
    TimeLimit,
    block_candidates,
    choose_block_size,
    choose_recompute,
    choose_schedule,
    plan,
    schedule_candidates,
)

__all__ = [
    "BlockChoice",
    "Budget",
    "Distributions",
    "Method",
    "Overhead",
    "ScheduleCandidate",
    "ScheduleChoice",
    "SearchOptions",
    "StreamApply",
    "TimeLimit",
    "block_candidates",
    "choose_block_size",
    "choose_recompute",
    "choose_schedule",
    "plan",
    "schedule_candidates",
]
