"""`fxkfac plan --schedule auto`: each schedule the mesh allows costed and planned, the choice and why in a table."""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING

from rich.table import Table

from fxkfac.cli_args import CliError, check_schedule
from fxkfac.planner import ConfigError, Problem
from fxkfac.planner import plan as plan_search
from fxkfac.planner.search import (
    ScheduleCandidate,
    ScheduleChoice,
    choose_schedule,
    schedule_candidates,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from fxkfac.planner import Budget, CostTable, SearchOptions

AUTO_SCHEDULE = "auto"
"""The schedule that lets the planner choose (`planner.search.plan_search`): `fxkfac plan --schedule` and
`fxkfac.compile(schedule=...)` both take it from here (torch-free, so the command line stays light)."""


log = logging.getLogger(__name__)


def auto_candidates(D: int, N: int, v: int) -> tuple[ScheduleCandidate, ...]:
    """The schedules "auto" chooses among: every one D ranks and N micro-batches allow
    (`planner.search.schedule_candidates`: one stage per rank, zb-v's two, interleaved's and zb-1p's two); a
    `virtual_stages` v > 1 keeps those of v stages per rank (said in the log). ConfigError when none is left."""
    found = schedule_candidates(D, N, v)
    kept = found if v == 1 else tuple(c for c in found if c.v == v)
    if not kept:
        raise ConfigError(
            f"schedule 'auto' has no schedule of {v} stages per rank for D={D}, N={N} (the mesh allows "
            f"{', '.join(map(str, found))}); pass virtual_stages=1 to choose among them all"
        )
    if v != 1:
        log.warning("schedule 'auto' chooses among %s only: virtual_stages=%d", ", ".join(map(str, kept)), v)
    return kept


def at_schedule(args: argparse.Namespace, candidate: ScheduleCandidate) -> argparse.Namespace:
    """The command line with `candidate`'s schedule and stages per rank."""
    return argparse.Namespace(**{**vars(args), "schedule": candidate.kind.value, "virtual_stages": candidate.v})


def choose(
    args: argparse.Namespace,
    costs: Callable[[argparse.Namespace, int], CostTable],
    problem_of: Callable[[argparse.Namespace, CostTable], Problem],
    search: SearchOptions,
    budget: Budget,
) -> ScheduleChoice:
    """The planner's choice among the schedules of --stages and --microbatches (`auto_candidates`: --virtual-stages
    above 1 keeps those of that many stages per rank), each costed by `costs` for its stages and planned with
    `search` in its part of `budget`, the command's --time-limit (`planner.search.choose_schedule`)."""

    def problem_for(candidate: ScheduleCandidate) -> Problem:
        at = at_schedule(args, candidate)
        try:
            return problem_of(at, costs(at, check_schedule(at)))
        except CliError as e:  # e.g. a profile's blocks that do not cut into the candidate's stages
            raise ConfigError(str(e)) from None

    candidates = auto_candidates(args.stages, args.microbatches, args.virtual_stages)
    return choose_schedule(
        candidates, problem_for, lambda problem, part: plan_search(problem, search, budget=part), budget
    )


def render_choice(choice: ScheduleChoice) -> Table:
    """Each candidate's plain step (the order they were planned in), plan as asked and at the freshest curvature, the
    chosen one marked, the reason below."""
    table = Table(title="schedule auto: the least step at the freshest curvature", caption=choice.reason)
    table.add_column("schedule", no_wrap=True)
    columns = ("plain step ms", "as asked: refresh / step ms", f"refresh <= {choice.period}: step ms", "out because")
    for column in columns:
        table.add_column(column)
    for t in choice.tried:
        chosen = t.plan is choice.plan
        plain = f"{t.plain * 1e3:.1f}" if t.plain > 0 else "-"
        first = "-" if t.first is None else _refresh_and_step(t.first.metrics.refresh_steps, t.first.metrics.step_time)
        fresh = "-" if t.plan is None else f"{t.plan.metrics.step_time * 1e3:.1f}"
        table.add_row(f"{t.candidate}{' (chosen)' if chosen else ''}", plain, first, fresh, t.why_not[:80])
    return table


def _refresh_and_step(steps: tuple[int, ...], step_time: float) -> str:
    return f"{' '.join(map(str, steps))} / {step_time * 1e3:.1f}"
