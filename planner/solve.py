"""`solve()`, one problem's placement within its part of the budget: an attempt, then a refusal's suggestions.

Callers plan through `planner.plan` (planner/plan_search.py), which runs its whole search, every `solve`, in one
`planner.budget.Budget`. `solve(problem, config, method)` refuses a budget below the
least memory any plan needs, solves every stage group (greedy, then CP-SAT warm-started by it),
fuses the curvature of the layers that do not fit the budget deferred (largest kept bytes first,
when max_overhead allows the time they add), gives every group the same stretch of the step (the
largest any group needs, [Note: stretch] in planner/window.py), and assembles the Plan.

[Note: time limit] One planning, every solve and retry of it, runs in one `Budget`: CP-SAT stops
config.time_limit_s after the budget opened (several solves in one budget, such as the strategy candidates of
planner/choose.py, each get an equal share of what is left; a whole search's budget, `Budget.of(..., whole=True)`,
holds what follows within the limit too); greedy placement (and fusing by greedy's
memory excess) goes on until at most OVERTIME / 2 past that. A refusal then searches, until OVERTIME
past the limit, for values of max_overhead, the memory budget or N that plan the same problem, and
names only those it has solved with (`PlanError.suggestions`); the budget keeps every plan it made, so
planning again at a suggested value takes no more time. With config.deterministic (the default) these
times are on CP-SAT's deterministic clock, converted from seconds ([Note: deterministic budget] in
planner/budget.py), so the same problem and options give the same plan, or the same refusal, on any
load; `SolverStats.wall_time` is then the only field of a plan that differs between runs.
"""

from __future__ import annotations

import time

from fxkfac.planner.attempt import Method, Refused, attempt_plan
from fxkfac.planner.budget import Budget
from fxkfac.planner.errors import PlanError
from fxkfac.planner.plan import Plan
from fxkfac.planner.problem import Problem, SolverConfig
from fxkfac.planner.suggest import with_suggestions

__all__ = ["solve"]


def solve(
    problem: Problem,
    config: SolverConfig = SolverConfig(),
    method: Method | str = Method.CPSAT,
    *,
    budget: Budget | None = None,
    shares: int = 1,
    suggest: bool = True,
) -> Plan:
    """Plan the K-FAC work of `problem` (Method.CPSAT: optimal placement warm-started by greedy; GREEDY:
    the paper's rule, fusing curvature by its excess over a memory budget) within config.time_limit_s plus
    OVERTIME, or within `budget` (a planning that solves several problems: this one gets 1/`shares` of the
    solver time left). Raises InfeasibleBudgetError when the memory budget cannot be met and PlanError
    when the work cannot be placed within problem.max_period steps; unless `suggest` is False, the error's
    message and `suggestions` name values of max_overhead, the budget or N that the planner has solved this
    problem with (the rest unchanged), or say that none was found in time."""
    how = _method(method)
    budget = budget or Budget.of(config)
    made = budget.made.get((problem, how))
    if made is not None:
        return made  # solved in this planning already: while searching for the value a refusal names
    try:
        refused = budget.made.get((REFUSED, problem, how))
        if refused is None or not budget.over():
            plan = attempt_plan(problem, config, how, budget.solving(shares), time.perf_counter())
        else:  # refused in this planning already, and no time is left to try again: its suggestions are searched
            raise refused
    except Refused as refused:
        budget.made[(REFUSED, problem, how)] = refused
        if not suggest:
            raise refused.error from None
        raise with_suggestions(refused, problem, config, how, budget.suggesting()) from None
    budget.made[(problem, how)] = plan
    return plan


REFUSED = "refused"
"""The key's first part under which a budget keeps a problem's refusal (`Budget.made`): a later `solve` of it with no
solver time left searches the refusal's suggestions without placing it again."""


def _method(method: Method | str) -> Method:
    try:
        return Method(method)
    except ValueError:
        raise PlanError(f"unknown planning method {method!r}; use 'cpsat' or 'greedy'") from None
