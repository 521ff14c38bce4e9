"""`solve()`, one problem's placement, and its TimeBox: an attempt, then a refusal's suggestions.

Callers plan through `planner.plan` (planner/plan_search.py), which runs its whole search, every `solve`, in one
TimeBox. `solve(problem, config, method)` refuses a budget below the
least memory any plan needs, solves every stage group (greedy, then CP-SAT warm-started by it),
fuses the curvature of the layers that do not fit the budget deferred (largest kept bytes first,
when max_overhead allows the time they add), gives every group the same stretch of the step (the
largest any group needs, [Note: stretch] in planner/window.py), and assembles the Plan.

[Note: time limit] One planning, every solve and retry of it, runs in one `TimeBox`: CP-SAT stops
config.time_limit_s after the box opened (several solves in one box, such as the strategy candidates of
planner/choose.py, each get an equal share of what is left); greedy placement (and fusing by greedy's
memory excess) goes on until at most OVERTIME / 2 past that. A refusal then searches, until OVERTIME
past the limit, for values of max_overhead, the memory budget or N that plan the same problem, and
names only those it has solved with (`PlanError.suggestions`); the box keeps every plan it made, so
planning again at a suggested value takes no more time. With config.deterministic (the default) these
times are on CP-SAT's deterministic clock, converted from seconds ([Note: deterministic budget] in
planner/budget.py), so the same problem and options give the same plan, or the same refusal, on any
load; `SolverStats.wall_time` is then the only field of a plan that differs between runs.
"""

from __future__ import annotations

import time

from fxkfac.planner.attempt import OVERTIME, Clock, Method, Refused, attempt_plan
from fxkfac.planner.budget import meter
from fxkfac.planner.errors import PlanError
from fxkfac.planner.plan import Plan
from fxkfac.planner.problem import Problem, SolverConfig
from fxkfac.planner.suggest import with_suggestions

__all__ = ["TimeBox", "solve"]


class TimeBox:
    """The clock of one whole planning, all its solves and retries ([Note: time limit]): CP-SAT time ends
    config.time_limit_s after it opened, everything else OVERTIME after that; it keeps the plans it made."""

    def __init__(self, config: SolverConfig) -> None:
        self.meter = meter(config.deterministic, config.time_limit_s, OVERTIME)
        self.end = self.meter.now() + self.meter.units(config.time_limit_s)
        self.overtime = self.meter.units(OVERTIME)
        self.made: dict[tuple[Problem, Method], Plan] = {}

    def solving(self, shares: int = 1) -> Clock:
        """One solve's clock: an equal share of the CP-SAT time left among the `shares` solves still to run;
        greedy placement may go on until OVERTIME / 2 past the box's end."""
        now = self.meter.now()
        deadline = now + max(0.0, self.end - now) / shares
        return Clock(self.meter, deadline, max(deadline, self.end + self.overtime / 2), self.made)

    def over(self) -> bool:
        """Whether the time for solving is spent, greedy's OVERTIME / 2 past the limit included."""
        return self.solving().out()

    def suggesting(self) -> Clock:
        """The clock of a refusal's search for values that plan: until OVERTIME past the end (or half of it
        from now, when an uninterrupted greedy placement ran past that)."""
        until = max(self.end + self.overtime, self.meter.now() + self.overtime / 2)
        return Clock(self.meter, until, until, self.made)


def solve(
    problem: Problem,
    config: SolverConfig = SolverConfig(),
    method: Method | str = Method.CPSAT,
    *,
    box: TimeBox | None = None,
    shares: int = 1,
    suggest: bool = True,
) -> Plan:
    """Plan the K-FAC work of `problem` (Method.CPSAT: optimal placement warm-started by greedy; GREEDY:
    the paper's rule, fusing curvature by its excess over a memory budget) within config.time_limit_s plus
    OVERTIME, or within `box` (a planning that solves several problems: this one gets 1/`shares` of the
    solver time left). Raises InfeasibleBudgetError when the memory budget cannot be met and PlanError
    when the work cannot be placed within problem.max_period steps; unless `suggest` is False, the error's
    message and `suggestions` name values of max_overhead, the budget or N that the planner has solved this
    problem with (the rest unchanged), or say that none was found in time."""
    how = _method(method)
    box = box or TimeBox(config)
    made = box.made.get((problem, how))
    if made is not None:
        return made  # solved in this box already: while searching for the value a refusal names
    try:
        plan = attempt_plan(problem, config, how, box.solving(shares), time.perf_counter())
    except Refused as refused:
        if not suggest:
            raise refused.error from None
        raise with_suggestions(refused, problem, config, how, box.suggesting()) from None
    box.made[(problem, how)] = plan
    return plan


def _method(method: Method | str) -> Method:
    try:
        return Method(method)
    except ValueError:
        raise PlanError(f"unknown planning method {method!r}; use 'cpsat' or 'greedy'") from None
