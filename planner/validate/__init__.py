"""Checks a plan against its problem, independently of the solvers: every constraint, in seconds.

It recomputes what the plan must contain from the problem alone (the simulated step timelines, the
cost table, whose comm model prices the collectives: the gradient all-reduce, SYNC_STATS and BCAST) and
shares no code with planner.window, greedy or cpsat. Times may be off by the plan's
`metrics.time_quantum` (the planner's time grid, see [Note: time grid] in planner/plan/window.py). Every
step is followed by `metrics.stretch` idle seconds ([Note: stretch]); the step time, stretch included,
must stay within the problem's max_overhead. A part fed by the reduced gradient (`PartCost.after`
ALLREDUCE_GRAD) has a STATS without micro-batch at every step on every copy of its stage, between the
stage's gradient all-reduce and its APPLY, and no SYNC_STATS; its DECOMP follows the refresh step's STATS
on the deciding rank. Each layer's distribution (planner/problem/strategy.py, the definition of KAISA's grid and
DP-KFAC's owner) says which copies take its statistics, sync them, decompose (one of its grad workers),
receive the decomposition, apply it at every step, and broadcast the preconditioned gradient along a row.
Under `StepBarrier.AGREEMENT_SET` a step begins on a rank once its agreement set (the ranks linked by copies of a
stage) can have ended the step before, and the programs are simulated with OPT_STEP over agreement sets only.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from fxkfac.planner.problem.errors import PlanError
from fxkfac.planner.problem.ir import Capture
from fxkfac.planner.problem.problem import Problem
from fxkfac.planner.problem.step_timeline import step_timeline
from fxkfac.planner.validate.checks import (
    Context,
    check_dependencies,
    check_layers,
    check_memory,
    check_overlap,
    check_placed_once,
    check_precs_and_offsets,
    check_programs,
    check_step_time,
    check_streaming,
)

if TYPE_CHECKING:
    from fxkfac.planner.plan.plan import Plan

__all__ = ["validate", "check_plan"]


def validate(problem: Problem, plan: Plan, *, run: bool = True) -> list[str]:
    """Every way `plan` breaks `problem`'s constraints, as readable lines (empty: valid). `run` also
    simulates the programs (deadlock, speed)."""
    fused = frozenset(n for n, t in plan.layers.items() if t.capture is Capture.FUSED)
    tol = plan.metrics.time_quantum + 1e-9 * step_timeline(problem).length
    stretch = plan.metrics.stretch
    c = Context(
        problem,
        plan,
        tol,
        fused,
        step_timeline(problem, fused, refresh=True),
        step_timeline(problem),
        [],
        stretch if isinstance(stretch, (int, float)) and 0 <= stretch < math.inf else 0.0,
    )
    if plan.problem != problem:
        c.errors.append("the plan was made for another problem")
    if c.stretch != stretch:
        c.errors.append(f"the step stretch must be a finite number of seconds >= 0, got {stretch!r}")
    check_layers(c)
    if c.errors:
        return c.errors
    for check in (
        check_placed_once,
        check_overlap,
        check_dependencies,
        check_precs_and_offsets,
        check_memory,
        check_step_time,
    ):
        check(c)
    check_programs(c, run)
    check_streaming(c)
    return c.errors


def check_plan(problem: Problem, plan: Plan, *, run: bool = True) -> None:
    """Raise PlanError listing every violation of `validate`."""
    errors = validate(problem, plan, run=run)
    if errors:
        shown = "\n  ".join(errors[:20]) + (f"\n  ... and {len(errors) - 20} more" if len(errors) > 20 else "")
        raise PlanError(f"the plan is not valid for its problem ({len(errors)} violations):\n  {shown}")
