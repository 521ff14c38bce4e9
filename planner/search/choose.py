"""The distribution choice: which distribution (planner/problem/strategy.py) each layer takes when the user forces none.

[Note: strategy search] The candidates are each KAISA strategy the copies allow and one per-layer mix, those that can
win (a reference step within max_overhead and STEP_TIE of the least) planned as forcing each would, and CP-SAT's joint
choice ([Note: joint strategy]) where it `has_choice`: after them at max_overhead 0 (first, it spent a short limit on
first-fit's plan where a forced candidate did better), before them above it. `best` keeps the least by `rank` within
the allowance; without a caller's budget each gets its own, so the choice is never worse than a forced candidate. No
joint model with the greedy method, under `StepBarrier.AGREEMENT_SET` or with one copy per stage; never DP-KFAC.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from typing import TypeVar

from fxkfac.planner.plan.plan import Plan, rank
from fxkfac.planner.plan.solution import GroupSolution
from fxkfac.planner.plan.window import grid_scale
from fxkfac.planner.problem.errors import PlanError
from fxkfac.planner.problem.problem import Problem, SolverConfig, StepBarrier, stage_groups
from fxkfac.planner.problem.step_timeline import step_timeline
from fxkfac.planner.problem.strategy import COMM_OPT, LayerDistribution, Strategy, StrategyKind
from fxkfac.planner.search.attempt import Attempt, Method, assemble, cheaper_fused, same_stretch, solve, stats_chunk_of
from fxkfac.planner.search.budget import Budget
from fxkfac.planner.search.cpsat import (
    comm_slot_seconds,
    layer_options,
    least_step,
    options_of,
    reference_step,
    timeline_stages,
    transfer,
)
from fxkfac.planner.search.greedy import Allowance, allowance, greedy_group, restretch
from fxkfac.planner.search.group_search import joint_placements

log = logging.getLogger(__name__)

T = TypeVar("T")


def candidate_strategies(problem: Problem) -> list[Strategy]:
    """COMM-OPT, HYBRID for each grad-worker count dividing H (the most copies of a stage), MEM-OPT (H > 1)."""
    H = _most_copies(problem)
    if H == 1:
        return [COMM_OPT]
    hybrids = [Strategy(StrategyKind.HYBRID, Fraction(g, H)) for g in range(H - 1, 1, -1) if H % g == 0]
    return [COMM_OPT, *hybrids, Strategy(StrategyKind.MEM_OPT)]


def _most_copies(problem: Problem) -> int:
    return max(len(problem.holders[s]) for s in range(problem.num_stages))


def mixed(problem: Problem) -> Problem | None:
    """MEM-OPT on the layers holding the larger half of the statistics bytes, COMM-OPT on the others (None: one)."""
    layers = sorted(problem.costs.layers, key=lambda x: (-x.factor_bytes, x.name))
    total, big, held = sum(x.factor_bytes for x in layers), [], 0
    for x in layers:
        if 2 * held >= total:
            break
        big.append(x.name)
        held += x.factor_bytes
    if not big or len(big) == len(layers):
        return None
    mem = problem.with_strategy(Strategy(StrategyKind.MEM_OPT))
    return problem.with_distributions({name: mem.where(name) for name in big})


def candidate_problems(problem: Problem) -> list[Problem]:
    """The problem under each of `candidate_strategies`, then under the `mixed` distribution where it differs."""
    out = [problem.with_strategy(s) for s in candidate_strategies(problem)]
    mix = mixed(problem) if len(out) > 1 else None
    return out + ([mix] if mix is not None else [])


Each = Callable[[Problem, Budget, float], Plan]
"""Plan a candidate as forcing it would, in the budget as one of `shares` still to plan (PlanError naming nothing)."""


def solve_with_strategy(
    problem: Problem,
    strategy: Strategy | None,
    config: SolverConfig = SolverConfig(),
    method: Method | str = Method.CPSAT,
    budget: Budget | None = None,
    *,
    joint: bool | None = None,
    suggest: bool = True,
    each: Each | None = None,
    reference: Callable[[Problem], float] | None = None,
    own: Callable[[], Budget] | None = None,
) -> Plan:
    """`solve` with every layer under `strategy`, or when None the best of `candidate_problems` ([Note: strategy
    search]) planned by `each` (else `solve`) in `budget`, else each in its own (`own()`): those that can win and,
    with `joint` (None: where CP-SAT has a choice), the joint choice; the others only where none of those plans.
    `reference`: a candidate's least reference step, streaming included; `suggest` False: a refusal names nothing."""
    if strategy is not None:
        forced = problem.with_strategy(strategy)
        return solve(forced, config, method, budget=budget or Budget.of(config), suggest=suggest)
    if budget is None:
        own = own or (lambda: Budget.of(config))
        budget = Budget.untimed(config.deterministic)
    made = candidate_problems(problem)
    steps = [step_timeline(c).length for c in made]
    most = [min(steps) * (1 + c.max_overhead + STEP_TIE) for c in made]
    # those that can lie within `best`'s allowance first (streamed, with `reference`, only where they must be)
    wins = [t <= m or (reference is not None and reference(c) <= m) for c, t, m in zip(made, steps, most)]
    candidates, hopeful = [made[i] for i in sorted(range(len(made)), key=lambda i: not wins[i])], sum(wins)
    timed = Method(method) is Method.CPSAT and own is None

    def applies() -> bool:
        if joint is not None:
            return joint
        barrier = problem.barrier is StepBarrier.WORLD
        return Method(method) is Method.CPSAT and barrier and _most_copies(problem) > 1 and has_choice(problem, budget)

    def joint_plans() -> list[Plan]:
        chosen = solve_joint(problem, config, own() if own else budget)
        return [] if chosen is None else [chosen]

    def plan_one(candidate: Problem, view: Budget, shares: float) -> Plan:
        if own is not None:
            view, shares = own(), 1
        if each is not None:
            return each(candidate, view, shares)
        return solve(candidate, config, method, budget=view, shares=shares, suggest=False)

    plans = joint_plans() if problem.max_overhead > 0 and applies() else []
    plans += _plan_each(candidates[:hopeful], plan_one, budget, timed, after=bool(plans))
    if problem.max_overhead <= 0 and (not plans or own is not None or budget.solving().solver_time() > 0) and applies():
        plans += joint_plans()
    if plans and hopeful < len(candidates):
        log.info(
            "distributions %s not planned: their reference steps are past the allowance",
            [strategy_of(c) for c in candidates[hopeful:]],
        )
    plans = plans or _plan_each(candidates[hopeful:], plan_one, budget, timed)
    if not plans and not suggest:
        raise PlanError(f"no distribution of {[strategy_of(c) for c in candidates]} plans")
    if not plans:
        return _plan_or_least_step_refusal(candidates, config, method, own() if own else budget)
    chosen = best(plans)
    log.info("distribution %s chosen among %s", strategy_of(chosen), [strategy_of(p) for p in plans])
    return chosen


def least_overhead(planned: Callable[[float], T]) -> tuple[T, float | None]:
    """The rule of max_overhead None: `planned(0)` (the bubbles alone), else `planned` at the least max_overhead the
    refusal names; what it made and the value taken (None: 0)."""
    try:
        return planned(0.0), None
    except PlanError as e:
        if e.max_overhead is None:
            raise
        log.info("the bubbles alone cannot hold the work: planning with max_overhead %.4g", e.max_overhead)
        return planned(e.max_overhead), e.max_overhead


def has_choice(problem: Problem, budget: Budget) -> bool:
    """Whether some layer of a free stage has another distribution that, switched alone in the candidate of least
    reference step, keeps it within what `best` keeps (else the joint model is a forced one); charged to `budget`."""
    free = frozenset(range(problem.num_stages)) - timeline_stages(problem)
    names = [x.name for s in sorted(free) for x in problem.costs.stages[s].layers]
    if not names:
        return False
    candidates = candidate_problems(problem)
    steps = [step_timeline(c) for c in candidates]
    ops = sum(len(o) for o in steps[0].ops.values())
    most = min(t.length for t in steps) * (1 + problem.max_overhead + STEP_TIE)
    base = candidates[min(range(len(steps)), key=lambda i: steps[i].length)]
    own = {n: base.where(n) for n in names}
    others = [(n, where) for n in names for where in layer_options(problem, n) if where != own[n]]
    hit = next(
        (i for i, (n, where) in enumerate(others) if reference_step(base, free, {**own, n: where}) <= most), None
    )
    budget.charge_simulated((len(steps) + (len(others) if hit is None else hit + 1)) * ops)
    return hit is not None


def shares_of(n: int, total: int) -> float:
    """Into how many shares the time left is cut for candidate `n` of `total`: the first (the likely choice) counts
    each other as a quarter, so it gets most of the time; each later one an equal share."""
    return 1 + (total - 1) / 4 if n == 0 else total - n


def _plan_each(
    candidates: Sequence[Problem], each: Each, budget: Budget, timed: bool, *, after: bool = False
) -> list[Plan]:
    """The plans of `candidates` in turn, each in its `shares_of` the time left, until the time is up once one planned
    (`after` another plan: once CP-SAT's time is)."""
    plans: list[Plan] = []
    for n, candidate in enumerate(candidates):
        if timed and ((after and budget.solving().solver_time() <= 0) or (plans and budget.over())):
            log.info("no time left to plan distributions %s", [strategy_of(c) for c in candidates[n:]])
            break
        try:
            plans.append(each(candidate, budget, shares_of(n, len(candidates))))
        except PlanError as e:
            log.info("distribution %s does not plan: %s", strategy_of(candidate), e)
    return plans


def _plan_or_least_step_refusal(
    candidates: Sequence[Problem], config: SolverConfig, method: Method | str, budget: Budget
) -> Plan:
    """Each candidate's refusal searched, least reference step first (the others while time is left), raising the one
    whose least max_overhead gives the least step; one that plans here (it had more time) is returned."""
    refusals: list[tuple[float, int, PlanError]] = []
    order = sorted(range(len(candidates)), key=lambda n: step_timeline(candidates[n]).length)
    for searched, n in enumerate(order):
        candidate = candidates[n]
        if searched and budget.over():
            break
        try:
            return solve(candidate, config, method, budget=budget)
        except PlanError as e:
            value = e.max_overhead
            step = math.inf if value is None else step_timeline(candidate).length * (1 + value)
            refusals.append((step, n, e))
    step, n, error = min(refusals, key=lambda r: r[:2])
    log.info(
        "distribution %s gives the least step once max_overhead grows (%.4g ms; %d of %d searched)",
        strategy_of(candidates[n]),
        step * 1e3,
        len(refusals),
        len(candidates),
    )
    raise error


LEAST_STEP_PART = 0.1
"""Of a joint solve's time, the part its search for the distributions of least step within the memory takes."""
STEP_TIE = 1e-3
"""Steps within this fraction of the least reference step beyond the allowance count as within it to `best`."""


def best(plans: Sequence[Plan]) -> Plan:
    """The least by `rank` of the plans whose step lies within max_overhead (and STEP_TIE) of the least reference step
    of any: the growth the user accepts over the fastest plain step, whichever distribution gives it. Where no step
    does, of those within STEP_TIE of the least step: the least growth any makes."""
    least = min(p.metrics.step_time_reference for p in plans)
    most = least * (1 + plans[0].problem.max_overhead + STEP_TIE)
    within = [p for p in plans if p.metrics.step_time <= most]
    if not within:
        fastest = min(p.metrics.step_time for p in plans) * (1 + STEP_TIE)
        within = [p for p in plans if p.metrics.step_time <= fastest]
    return min(within, key=rank)


def solve_joint(problem: Problem, config: SolverConfig = SolverConfig(), budget: Budget | None = None) -> Plan | None:
    """The joint choice ([Note: joint strategy]) once per option set of the `timeline_stages`, each an equal share of
    the solver time left; the best plan (None: none)."""
    budget = budget or Budget.of(config)
    moving = timeline_stages(problem)
    names = [x.name for s in sorted(moving) for x in problem.costs.stages[s].layers]
    forced = [problem.with_strategy(s) for s in candidate_strategies(problem)] if moving else []
    sets = [{n: f.where(n) for n in names} for f in forced] or [{}]
    plans = []
    for n, fixed in enumerate(sets):
        clock = budget.solving(len(sets) - n)
        plan = _joint_plan(problem, fixed, config, budget, clock.solver_time())
        if plan is not None:
            plans.append(plan)
        if clock.out():
            break
    if not plans:
        return None
    chosen = best(plans)
    log.info("joint choice: %s", strategy_of(chosen))
    return chosen


def _joint_plan(
    problem: Problem, fixed: Mapping[str, LayerDistribution], config: SolverConfig, budget: Budget, limit: float
) -> Plan | None:
    """One joint solve with the timeline stages' layers at `fixed`, within `limit` of the budget's clock."""
    start, began = budget.now(), time.perf_counter()
    anchor = problem.with_distributions(fixed)
    free = frozenset(range(problem.num_stages)) - timeline_stages(problem)
    least = least_step(anchor, free, config, budget, limit * LEAST_STEP_PART)
    if least is None:
        log.info("joint choice: no distribution of %s meets the memory budget", sorted(free))
        return None
    anchor = anchor.with_distributions({**fixed, **least})
    scale = grid_scale(anchor, range(anchor.num_stages), frozenset(), config.time_resolution, _option_seconds(anchor))
    allowed = Allowance(anchor, frozenset(), scale if config.stretch and anchor.max_overhead > 0 else None)
    forced = [problem.with_strategy(s) for s in candidate_strategies(problem)]
    chunk_of = functools.partial(stats_chunk_of, anchor, config=config, allowed=allowed)
    placements = joint_placements(anchor, free, forced, scale, allowed, chunk_of, config, budget, start + limit)
    if placements is None:
        return None if anchor.memory_budget is None else _fused(problem, anchor, config, budget)
    step_ticks = max(p.step_ticks for p in placements)
    placements = [restretch(p, p.window.stretch + step_ticks - p.step_ticks) for p in placements]
    chosen = anchor.with_distributions({n: d for p in placements for n, d in p.distributions().items()})
    solutions = [transfer(p, chosen) for p in placements]
    if not all(solutions):
        log.info(
            "joint choice (%s): its placement does not fit that choice's own windows; planning the choice itself",
            strategy_of(chosen),
        )
        return _planned(chosen, config, budget)
    placed = same_stretch(list(solutions))
    attempt = Attempt(placed, _greedy(chosen, config, budget), Allowance(chosen, frozenset(), allowed.scale))
    plan = assemble(chosen, attempt, frozenset(), time.perf_counter() - began)
    if plan.metrics.stretch <= 0 or not cheaper_fused(plan.problem):
        return plan
    # the steps stretch for deferred statistics where fusing some costs less: `solve` places those fused too
    again = _planned(plan.problem, config, budget)
    return plan if again is None else min((plan, again), key=rank)


def _fused(problem: Problem, anchor: Problem, config: SolverConfig, budget: Budget) -> Plan | None:
    """Under a budget the joint model cannot meet unfused: `best` of the least-step distributions and MEM-OPT planned
    by `solve`, which fuses curvature as needed (MEM-OPT by first-fit where CP-SAT had too little time)."""
    first = _planned(anchor, config, budget)
    mem = problem.with_strategy(Strategy(StrategyKind.MEM_OPT))
    second = _planned(mem, config, budget) or _planned(mem, config, budget, Method.GREEDY)
    plans = [p for p in (first, second) if p is not None]
    return best(plans) if plans else None


def _planned(problem: Problem, config: SolverConfig, budget: Budget, method: Method = Method.CPSAT) -> Plan | None:
    """`problem` planned by `solve` in `budget`, None where it refuses."""
    try:
        return solve(problem, config, method, budget=budget, shares=2, suggest=False)
    except PlanError as e:
        log.info("distribution %s does not plan: %s", strategy_of(problem), e)
        return None


def _greedy(problem: Problem, config: SolverConfig, budget: Budget) -> list[GroupSolution | None]:
    """The paper's refresh period per group, for the plan's metrics (None where it places nothing)."""
    allowed, resolution = allowance(problem, frozenset(), config), config.time_resolution
    out: list[GroupSolution | None] = []
    for group in stage_groups(problem):
        chunk = stats_chunk_of(problem, group, config, allowed)
        try:
            g = greedy_group(
                allowed, group, stats_chunk=chunk, resolution=resolution, meter=budget, shrink_stretch=False
            )
        except PlanError:
            g = None
        out.append(g)
    return out


def _option_seconds(problem: Problem) -> list[float]:
    """Every duration an option may give a task or slot, for an exact grid where the costs allow one."""
    out = [comm_slot_seconds(problem, s) for s in range(problem.num_stages)]
    for opts in options_of(problem, range(problem.num_stages), range(problem.num_stages)).values():
        out += [t for o in opts for t in (o.apply, o.share, *o.bcast.values())]
    return out


def strategy_of(of: Plan | Problem) -> str:
    """A plan's (or problem's) distribution in words: the strategy of every layer, else how many follow each."""
    problem = of.problem if isinstance(of, Plan) else of
    counts = Counter(str(problem.where(name).strategy) for name in problem.costs.layer_names)
    if len(counts) == 1:
        return next(iter(counts))
    return ", ".join(f"{key} on {n} layers" for key, n in sorted(counts.items()))
