"""One planning attempt: every stage group placed, curvature fused to fit the budget, or a refusal to suggest on."""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import TYPE_CHECKING

from fxkfac.planner.plan.plan import Plan, rank
from fxkfac.planner.plan.solution import GroupSolution, all_placed, fits_memory, peak_bytes
from fxkfac.planner.plan.window import TaskKind, Window, longest_gaps, too_long
from fxkfac.planner.problem.costs import LayerCost, words_of
from fxkfac.planner.problem.errors import InfeasibleBudgetError, Knob, PlanError
from fxkfac.planner.problem.ir import OpKind
from fxkfac.planner.problem.problem import Problem, SolverConfig, StageGroup, format_bytes, stage_groups
from fxkfac.planner.problem.step_timeline import fused_extra, min_memory_bytes, refresh_lower_bound, step_timeline
from fxkfac.planner.search.assemble import Attempt, assemble_attempt, same_stretch
from fxkfac.planner.search.budget import Budget
from fxkfac.planner.search.packing_bound import group_lower_bound
from fxkfac.planner.search.stretch import Allowance, allowance

if TYPE_CHECKING:
    from fxkfac.planner.search.group_search import Period

__all__ = ["Method", "Refused", "stats_chunk_of", "attempt_plan", "cheaper_fused"]

log = logging.getLogger(__name__)


class Method(StrEnum):
    """How the K-FAC work is placed: CP-SAT (least refresh periods, then staleness; warm-started by
    greedy, whose plan it keeps when it finds none better) or the PipeFisher paper's greedy first-fit."""

    CPSAT = "cpsat"
    GREEDY = "greedy"


class Refused(Exception):
    """A refusal before suggestions: the error for the user, the knobs that may lift it (searched in
    this order), and the layers fused by then."""

    def __init__(self, error: PlanError, knobs: tuple[Knob, ...], fused: frozenset[str] = frozenset()) -> None:
        super().__init__(str(error))
        self.error, self.knobs, self.fused = error, knobs, fused


def stats_chunk_of(problem: Problem, group: StageGroup, config: SolverConfig, allowed: Allowance) -> int:
    """How many consecutive layers `solve` places in one STATS task for the group (`_stats_chunk`): for a distribution
    choice made beside `solve` (planner/search/choose.py), which places the same tasks."""
    return _stats_chunk(problem, group, config, allowed)


def _stats_chunk(problem: Problem, group: StageGroup, config: SolverConfig, allowed: Allowance) -> int:
    """Layers per STATS task (`SolverConfig.stats_chunk` when set): one where the group has at most
    `max_stats_tasks` per-layer tasks (each F/B makes one a layer), else the fewest that bring it there, halved
    while such a task is longer than every bubble the allowance leaves. Small tasks pack best: one per Linear
    placed BERT-Large Chimera D=8 (the paper's profiles) at its bound, refresh 4, one per F/B for all of a
    stage's layers at 5-7."""
    if config.stats_chunk is not None:
        return config.stats_chunk
    stages = [op.stage for d in group.devices for op, _, _ in step_timeline(problem).fixed(d) if op.stage is not None]
    per_layer = sum(len(problem.costs.stages[s].layers) for s in stages)
    chunk = max(1, -(-per_layer // config.max_stats_tasks))
    while chunk > 1:
        window = allowed.window(
            group, 2, allowed.ticks(problem.max_period), stats_chunk=chunk, resolution=config.time_resolution
        )
        gaps = longest_gaps(window)
        if all(t.ticks <= gaps[t.devices[0]] for t in window.tasks if t.kind is TaskKind.CURV):
            break
        chunk //= 2
    return chunk


def _overhead_period(problem: Problem, fused: frozenset[str]) -> int:
    """The least common period that amortizes the fused curvature's extra time on the refresh step within
    max_overhead."""
    extra = fused_extra(problem, fused)
    if extra <= 1e-12:
        return 1
    allowed = problem.max_overhead * step_timeline(problem).length
    if allowed <= 0:
        return problem.max_period + 1
    return max(1, math.ceil(extra / allowed - 1e-9))


def _check_fits(
    problem: Problem,
    group: StageGroup,
    fused: frozenset[str],
    config: SolverConfig,
    allowed: Allowance,
    stats_chunk: int,
    min_k: int,
) -> None:
    """Refuse a group whose work no refresh period holds: a task longer than every bubble, or more work than the idle
    time of `max_period` steps (each refusal names the knobs that may lift it)."""
    stretched = f", even with the step stretched by max_overhead={problem.max_overhead:g}" if allowed.enabled else ""
    knobs = (Knob.MAX_OVERHEAD, Knob.MICROBATCHES) if config.stretch else (Knob.MICROBATCHES,)
    work = words_of(problem.costs).name
    window = allowed.window(
        group,
        max(2, min_k),
        allowed.ticks(problem.max_period),
        stats_chunk=stats_chunk,
        resolution=config.time_resolution,
    )
    long = too_long(window)
    if long:
        off = "" if config.stretch else ". Stretching the step is off (SolverConfig.stretch=False)"
        message = f"some {work} work cannot fit any bubble, whatever the refresh period{stretched}: "
        raise Refused(PlanError(message + "; ".join(long[:5]) + off), knobs, fused)
    if refresh_lower_bound(problem, group, fused, stretch=allowed.enabled) > problem.max_period:
        message = f"the {work} work of stages {list(group.stages)} is more than the idle time of {problem.max_period}"
        raise Refused(PlanError(f"{message} steps holds{stretched}"), knobs, fused)


@dataclass
class _Placing:
    """One group between `_solve_groups`' passes: first-fit's placement and either the group's final solution
    (greedy method, no CP-SAT time left, nothing found) or its least period, which the second pass refines."""

    group: StageGroup
    stats_chunk: int
    greedy: GroupSolution | None
    period: Period | None = None
    solution: GroupSolution | None = None


def _solve_groups(
    problem: Problem, fused: frozenset[str], config: SolverConfig, method: Method, min_k: int, clock: Budget
) -> Attempt:
    """Every stage group's solution at refresh periods >= min_k, in two passes: every group's least period first
    (`_first_pass`, the groups sharing the solver time left), then each one's stretch and staleness
    (`_second_pass`) with the time the first left, so a group found at its bound at once leaves its time to the
    groups still searching. Curvature is one STATS task per chunk of layers where `_stats_chunk` says so and per
    layer when that places nothing (chunked tasks that each fit a bubble may still not all fit)."""
    groups = stage_groups(problem)
    allowed = allowance(problem, fused, config)
    first = functools.partial(_first_pass, problem, fused, config, method, min_k, clock, allowed)
    placings = []
    for n, group in enumerate(groups):
        chunk = _stats_chunk(problem, group, config, allowed)
        try:
            placing = first(group, chunk, later=len(groups) - n)
        except Refused:
            if chunk == 1 or config.stats_chunk is not None:
                raise
            placing = _Placing(group, chunk, None)
        if _per_layer_instead(placing, config):
            placing = _again_per_layer(first, group, later=len(groups) - n)
        placings.append(placing)
    solutions = []
    for n, placing in enumerate(placings):
        solution = _second_pass(problem, placing, config, clock, allowed, later=len(groups) - n)
        if solution is None and _per_layer_instead(placing, config):
            placings[n] = _again_per_layer(first, placing.group, later=len(groups) - n)
            solution = _second_pass(problem, placings[n], config, clock, allowed, later=len(groups) - n)
        solutions.append(solution)
    return Attempt(same_stretch(solutions), [p.greedy for p in placings], allowed)


def _per_layer_instead(placing: _Placing, config: SolverConfig) -> bool:
    """Whether a group placed with chunked STATS tasks is placed again per layer: nothing was placed, and the
    chunking was the planner's choice."""
    nothing = placing.period is None and placing.solution is None and placing.greedy is None
    return placing.stats_chunk > 1 and config.stats_chunk is None and nothing


def _again_per_layer(first: Callable[..., _Placing], group: StageGroup, *, later: int) -> _Placing:
    """The first pass of `group` again with one STATS task per layer (`first`: `_first_pass` of the attempt)."""
    log.info("stages %s: no placement with chunked STATS tasks; placing them per layer", list(group.stages))
    return first(group, 1, later=later)


def _first_pass(
    problem: Problem,
    fused: frozenset[str],
    config: SolverConfig,
    method: Method,
    min_k: int,
    clock: Budget,
    allowed: Allowance,
    group: StageGroup,
    stats_chunk: int,
    *,
    later: int,
) -> _Placing:
    """First-fit's placement, then CP-SAT's least period warm-started by it with the group's share of the solver time
    left (`later` groups share it, this one included); first-fit's alone with the greedy method or no time left."""
    from fxkfac.planner.search.greedy import greedy_group

    _check_fits(problem, group, fused, config, allowed, stats_chunk, min_k)
    try:
        g = greedy_group(
            problem,
            group,
            fused,
            stats_chunk=stats_chunk,
            resolution=config.time_resolution,
            min_k=min_k,
            allowance=allowed,
            meter=clock,
        )
    except PlanError:
        g = None
    share = _share(problem, clock, later, reserve=g is None or not fits_memory(g))
    if method is Method.GREEDY or share is None:
        return _Placing(group, stats_chunk, g, solution=g if g is not None and fits_memory(g) else None)
    from fxkfac.planner.search.group_search import least_group_period

    period = least_group_period(
        problem, group, fused, config, share, clock, g, stats_chunk=stats_chunk, min_k=min_k, allowance=allowed
    )
    return _Placing(group, stats_chunk, g, period=period)


def _second_pass(
    problem: Problem, placing: _Placing, config: SolverConfig, clock: Budget, allowed: Allowance, *, later: int
) -> GroupSolution | None:
    """The group's solution: the first pass's, or its period refined (`refine_group`) with its share of the time
    left; without time, the period's placement as found (or first-fit's, where that one breaks the budget)."""
    if placing.period is None:
        return placing.solution
    from fxkfac.planner.search.group_search import refine_group, within_budget

    placed = within_budget(placing.period.found, placing.period.fallback)
    share = _share(problem, clock, later, reserve=placed is None)
    if share is None:
        return placed
    return refine_group(placing.period, allowed, config, share, clock)


def _share(problem: Problem, clock: Budget, later: int, *, reserve: bool) -> float | None:
    """A group's share of the solver time left, `later` groups sharing it (None: none is left). Under a memory
    budget, with `reserve` (the group has no placement within it yet), FUSING_RESERVE of the time is kept for the
    rounds that fuse more curvature if this one finds no fit; a group first-fit places within the budget needs none."""
    return clock.share(later, keep=FUSING_RESERVE if problem.memory_budget is not None and reserve else 0.0)


FUSING_RESERVE = 0.5
"""Of the CP-SAT time left, the part a group with no placement within the memory budget keeps for fusing rounds."""


def _next_fused(problem: Problem, attempt: Attempt, fused: frozenset[str], *, by_excess: bool) -> frozenset[str] | None:
    """Fuse more layers (largest kept bytes first) in every group that found no plan: one, or with
    `by_excess` as many as the greedy placement's bytes over the budget call for (a layer saves at most
    its a and e of every micro-batch, so this never fuses more than that placement needs); None if none
    is left."""
    groups = stage_groups(problem)
    more = set(fused)
    for group, solution, first in zip(groups, attempt.solutions, attempt.greedy):
        if solution is not None:
            continue
        candidates = sorted(
            (x for s in group.stages for x in problem.costs.stages[s].layers if x.name not in fused and _captures(x)),
            key=lambda x: (x.capture_bytes, x.name),
            reverse=True,
        )
        if not candidates:
            return None
        excess = _excess(problem, first) if by_excess and first is not None else 0
        saved = 0
        for x in candidates:
            more.add(x.name)
            saved += x.capture_bytes * problem.N * 2  # both Chimera pipelines at most
            if saved >= excess:
                break
    return frozenset(more)


def _captures(layer: LayerCost) -> bool:
    """Whether the layer has a part fed by a capture of its F/B (only those can be fused; a gradient-fed part
    keeps nothing per micro-batch)."""
    return any(p.after is not OpKind.ALLREDUCE_GRAD for p in layer.parts)


def _excess(problem: Problem, solution: GroupSolution) -> int:
    """Bytes the solution's worst device holds over the memory budget."""
    budget = problem.memory_budget or 0
    return max(peak_bytes(solution, d) - budget for d in solution.window.group.devices)


def attempt_plan(problem: Problem, config: SolverConfig, method: Method, clock: Budget, began: float) -> Plan:
    """One planning run as `solve` describes it, without suggestions: Refused when it makes no plan.
    With CP-SAT and a budget, greedy placement fusing by its memory excess runs first: quick, and its
    plan is kept when CP-SAT's own rounds of fusing (fewer layers fused) find none before the deadline."""
    _check_budget(problem)
    if method is Method.GREEDY or problem.memory_budget is None or clock.solver_time() <= 0:
        return _placed(problem, config, method, clock, began)
    try:
        fallback = _placed(problem, config, method, clock.later(clock.now()), began)
    except Refused:
        return _placed(problem, config, method, clock, began)
    try:
        return _placed(problem, config, method, clock.later(clock.deadline, clock.deadline), began)
    except Refused:
        solver = replace(fallback.metrics.solver, wall_time=time.perf_counter() - began)  # CP-SAT's time too
        return replace(fallback, metrics=replace(fallback.metrics, solver=solver))


def _placed(problem: Problem, config: SolverConfig, method: Method, clock: Budget, began: float) -> Plan:
    """Place the work (`_fitted`); where fusing some layers' curvature costs less than their statistics deferred
    (`cheaper_fused`), place it with those fused too when the plan without them stretches its steps (the
    statistics found no bubble) or is refused, and keep the better plan by `planner.plan.rank`: fresher curvature
    (the sum of refresh periods), then the shorter step, then the smaller peak memory."""
    cheaper = cheaper_fused(problem)
    try:
        plan = _fitted(problem, config, method, clock, began, frozenset())
    except Refused as refused:
        if not cheaper:
            raise
        try:
            return _fitted(problem, config, method, clock, began, cheaper)
        except Refused:
            raise refused from None
    if not cheaper or plan.metrics.stretch <= 0:
        return plan
    try:
        with_fused = _fitted(problem, config, method, clock, began, cheaper)
    except Refused:
        return plan
    best = min((plan, with_fused), key=rank)
    log.info(
        "the steps stretch for deferred curvature: %.4g ms per step, %.4g ms with that of %d layers fused; kept %s "
        "(fresher curvature first, then the shorter step)",
        plan.metrics.step_time * 1e3,
        with_fused.metrics.step_time * 1e3,
        len(cheaper),
        "fused" if best is with_fused else "deferred",
    )
    return best


def cheaper_fused(problem: Problem) -> frozenset[str]:
    """The captured layers whose curvature fused into F/B (`StageCost.fused_curvature`, where profiled) costs less
    than their statistics deferred: worth fusing where no bubble would hide the statistics."""
    return frozenset(
        x.name
        for stage in problem.costs.stages
        for x in stage.layers
        if _captures(x)
        and stage.fused_curvature({x.name}, OpKind.FWD) + stage.fused_curvature({x.name}, OpKind.BWD)
        < sum(p.stats for p in x.parts if p.after is not OpKind.ALLREDUCE_GRAD)
    )


def _fitted(
    problem: Problem, config: SolverConfig, method: Method, clock: Budget, began: float, fused: frozenset[str]
) -> Plan:
    """Place the work with `fused` layers' curvature fused, fusing more each round that misses the budget (one
    layer per group while CP-SAT has time; as many as greedy's excess calls for after that, and always with the
    greedy method, whose rounds are not timed) until every group is placed."""
    while True:
        min_k = _overhead_period(problem, fused)
        if min_k > problem.max_period:
            raise Refused(_fusing_refused(problem, fused), (Knob.MEMORY_BUDGET, Knob.MAX_OVERHEAD), fused)
        attempt = _solve_groups(problem, fused, config, method, min_k, clock)
        while fused and (placed := all_placed(attempt.solutions)) and len({s.window.k for s in placed}) > 1:
            common = max(s.window.k for s in placed)
            attempt = _solve_groups(problem, fused, config, method, common, clock)
        if all(attempt.solutions):
            return assemble_attempt(problem, attempt, fused, time.perf_counter() - began)
        if problem.memory_budget is None or _short_of_time(attempt, fused):
            raise _unplaced(problem, attempt, fused, config, method)
        greedy = method is Method.GREEDY
        nxt = _next_fused(problem, attempt, fused, by_excess=greedy or clock.solver_time() <= 0)
        if nxt is None or (clock.out() and not greedy):
            bad = [g.stages for g, s in zip(stage_groups(problem), attempt.solutions) if s is None]
            why = (
                "even with all their curvature fused"
                if nxt is None
                else (f"before the time limit ({config.time_limit_s:g} s) ran out, {len(fused)} layers fused")
            )
            raise Refused(
                InfeasibleBudgetError(
                    f"no placement of stages {bad} within the memory budget {format_bytes(problem.memory_budget)} "
                    f"per device was found {why}"
                ),
                (Knob.MEMORY_BUDGET, Knob.MAX_OVERHEAD),
                fused,
            )
        log.info("fusing curvature of %s to fit the memory budget", sorted(nxt - fused))
        fused = nxt


def _short_of_time(attempt: Attempt, fused: frozenset[str]) -> bool:
    """Whether a group is unplaced for want of time, not memory: before any fusing, greedy (which ignores the
    budget) placed it nowhere either, and fusing only lengthens F/B. Its refusal then names max_overhead or N,
    not the memory budget (pure data parallelism at max_overhead 0 has no bubble to fill)."""
    return not fused and any(s is None and g is None for s, g in zip(attempt.solutions, attempt.greedy))


def _unplaced(
    problem: Problem, attempt: Attempt, fused: frozenset[str], config: SolverConfig, method: Method
) -> Refused:
    """The refusal when some group has no placement for want of bubble time (no budget, or greedy placed it
    nowhere before any fusing)."""
    groups = [g for g, s in zip(stage_groups(problem), attempt.solutions) if s is None]
    bad, work = [g.stages for g in groups], words_of(problem.costs).name
    knobs = (Knob.MAX_OVERHEAD, Knob.MICROBATCHES)
    if all(_whole_tasks_exceed(problem, g, config, attempt.allowance) for g in groups):
        return Refused(
            PlanError(
                f"the {work} work of stages {bad} is more than the idle time of {problem.max_period} steps holds in "
                f"whole tasks{_stretched(problem, config)}: its statistics and decomposition pieces leave part of "
                "every bubble they cannot fill"
            ),
            knobs,
            fused,
        )
    timed = f", or the time limit ({config.time_limit_s:g} s) was" if method is Method.CPSAT else ""
    return Refused(
        PlanError(
            f"no placement of the {work} work of stages {bad} within {problem.max_period} steps "
            f"({method.value}{_stretched(problem, config)}): the bubbles are too short{timed}"
        ),
        knobs,
        fused,
    )


def _whole_tasks_exceed(problem: Problem, group: StageGroup, config: SolverConfig, allowed: Allowance) -> bool:
    """Whether the group's work, one STATS task per layer (what packs best), fits in no window up to max_period
    (`group_lower_bound`): then no search could have placed it, whatever its time."""

    def window_at(k: int) -> Window:
        return allowed.whole(group, k, stats_chunk=1, resolution=config.time_resolution)

    return group_lower_bound(allowed, group, window_at) > problem.max_period


def _stretched(problem: Problem, config: SolverConfig) -> str:
    return (
        f", the step stretched by up to max_overhead={problem.max_overhead:g}"
        if config.stretch and problem.max_overhead > 0
        else ""
    )


def _check_budget(problem: Problem) -> None:
    if problem.memory_budget is None:
        return
    need = min_memory_bytes(problem)
    if problem.memory_budget < need:
        raise Refused(
            InfeasibleBudgetError(
                f"memory budget {problem.memory_budget} bytes ({format_bytes(problem.memory_budget)}) per device is "
                f"below the least any plan needs: {need} bytes ({format_bytes(need)}) = parameters and gradients, "
                "factors and inverses, the optimizer state of the preconditioned layers, and the activation peak with "
                "all curvature fused (which max_overhead must pay for)",
                need,
            ),
            (Knob.MEMORY_BUDGET,),
        )


def _fusing_refused(problem: Problem, fused: frozenset[str]) -> InfeasibleBudgetError:
    extra = fused_extra(problem, fused)
    names = sorted(fused)
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return InfeasibleBudgetError(
        f"the memory budget {format_bytes(problem.memory_budget or 0)} per device does not fit the a and e kept "
        f"for deferred curvature; fusing the curvature of {len(names)} layers ({shown}) adds {extra:.4g} s to each "
        f"refresh step, more than max_overhead={problem.max_overhead:g} allows within {problem.max_period} steps"
    )
