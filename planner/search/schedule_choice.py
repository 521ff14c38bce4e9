"""schedule="auto": the pipeline schedule the planner chooses among those the mesh allows.

Every candidate (`schedule_candidates`: each kind that runs D ranks and N micro-batches) is planned as asked; a
candidate whose costs cannot be cut, or whose plan is refused (the memory budget, max_overhead), drops out with
its reason. The freshest curvature any plan reaches sets the bar: the least, over the plans, of the longest refresh
period of a plan. Each plan that refreshes less often is planned again with that period as its longest
(`Problem.max_period`; under `Overhead.LEAST` at the least step growth that places it), and of the plans that
refresh that often the one with the least step time wins (ties: the order of `ScheduleKind`). So the choice is
the least step at the freshest curvature, the same curvature for every schedule compared.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from fxkfac.planner.plan.plan import Plan
from fxkfac.planner.problem.errors import PlanError, PlannerError, ScheduleError
from fxkfac.planner.problem.problem import Problem
from fxkfac.planner.problem.schedules import ScheduleKind, validate_schedule_args

__all__ = ["ScheduleCandidate", "Tried", "ScheduleChoice", "schedule_candidates", "choose_schedule"]


@dataclass(frozen=True)
class ScheduleCandidate:
    """One schedule with its stages per rank `v`."""

    kind: ScheduleKind
    v: int = 1

    def __str__(self) -> str:
        return f"{self.kind.value} v={self.v}" if self.v != 1 else self.kind.value


def schedule_candidates(D: int, N: int, v: int = 1) -> tuple[ScheduleCandidate, ...]:
    """Every schedule that runs D ranks and N micro-batches (`validate_schedule_args`), in `ScheduleKind`'s order:
    one stage per rank, ZB-V's two, interleaved's and zb-1p's `v` (2 where the mesh names 1, which is 1F1B)."""
    out = []
    for kind in ScheduleKind:
        stages = {ScheduleKind.ZB_V: 2, ScheduleKind.INTERLEAVED: max(v, 2), ScheduleKind.ZB_1P: max(v, 2)}.get(kind, 1)
        try:
            validate_schedule_args(kind, D, N, stages)
        except ScheduleError:
            continue
        out.append(ScheduleCandidate(kind, stages))
    return tuple(out)


@dataclass(frozen=True)
class Tried:
    """One candidate: its plan as asked (`first`), its plan at the freshest curvature (`plan`, None when it
    cannot refresh that often or has no plan at all) and why it is out of the comparison ('' when in)."""

    candidate: ScheduleCandidate
    first: Plan | None
    plan: Plan | None
    why_not: str = ""


@dataclass(frozen=True)
class ScheduleChoice:
    """The chosen plan, every candidate tried, the refresh period compared at, and the choice in words."""

    plan: Plan
    tried: tuple[Tried, ...]
    period: int
    reason: str


ProblemFor = Callable[[ScheduleCandidate], Problem]
"""The problem of one candidate (its costs cut into its stages); raises a PlannerError where it cannot be made."""
PlanOf = Callable[[Problem], Plan]
"""The caller's planner run (`planner.plan` with its SearchOptions); raises PlanError when nothing plans."""


def _first_line(error: Exception) -> str:
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def _stalest(plan: Plan) -> int:
    return max(plan.metrics.refresh_steps)


def choose_schedule(
    candidates: Sequence[ScheduleCandidate], problem_for: ProblemFor, plan_of: PlanOf
) -> ScheduleChoice:
    """The least step at the freshest curvature among `candidates` (see the module's docstring); PlanError naming
    each candidate's reason when none plans."""
    first: list[tuple[ScheduleCandidate, Problem | None, Plan | None, str]] = []
    for c in candidates:
        try:
            problem = problem_for(c)
            first.append((c, problem, plan_of(problem), ""))
        except PlannerError as e:  # a cut the costs do not allow, a budget refused: out, with the reason
            first.append((c, None, None, _first_line(e)))
    planned = [plan for _, _, plan, _ in first if plan is not None]
    if not planned:
        raise PlanError("no schedule plans: " + "; ".join(f"{c}: {why}" for c, _, _, why in first))
    period = min(_stalest(p) for p in planned)
    tried = []
    for c, made, plan, why in first:
        fresh = plan
        if made is not None and plan is not None and _stalest(plan) > period:
            try:
                fresh = plan_of(replace(made, max_period=period))
            except PlanError as e:
                fresh, why = None, f"cannot refresh every {period} steps: {_first_line(e)}"
        tried.append(Tried(c, plan, fresh, why))
    compared = [t for t in tried if t.plan is not None]
    best = min(compared, key=lambda t: t.plan.metrics.step_time if t.plan is not None else 0.0)
    assert best.plan is not None, "compared candidates have a plan"
    others = ", ".join(
        f"{t.candidate} {t.plan.metrics.step_time * 1e3:.1f} ms" for t in compared if t is not best and t.plan
    )
    reason = (
        f"{best.candidate}: the least step, {best.plan.metrics.step_time * 1e3:.1f} ms, with every layer refreshed at "
        f"least every {period} steps (the freshest curvature any schedule plans)"
        + (f"; {others}" if others else "")
        + "".join(f"; {t.candidate} out: {t.why_not}" for t in tried if t.why_not)
    )
    return ScheduleChoice(best.plan, tuple(tried), period, reason)
