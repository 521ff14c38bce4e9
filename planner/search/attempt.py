"""`solve()`: one problem's placement within its part of the budget: an attempt, then a refusal's suggestions.

An attempt places every stage group (first-fit, then CP-SAT warm-started by it), fuses the curvature of layers that
miss the memory budget, gives every group the largest stretch any needs ([Note: stretch]) and assembles the Plan.

[Note: time limit] Every solve runs in a `Budget` ([Note: one budget]): CP-SAT stops at its part's deadline, greedy
placement goes on to half the overtime past it, and a refusal then searches, to the overtime's end, for values of
max_overhead, the memory budget or N that plan it, naming only those it solved with (every plan kept in the budget).
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from decimal import ROUND_CEILING, Decimal
from enum import StrEnum

from fxkfac.planner.plan.plan import Plan, PlanMetrics, SolverStats, rank
from fxkfac.planner.plan.solution import GroupSolution, all_placed, fits_memory, peak_bytes, placements_of, plan_born
from fxkfac.planner.plan.window import (
    TaskKind,
    Window,
    allreduce_after_w,
    grid_scale,
    longest_gaps,
    placed_w,
    too_long,
)
from fxkfac.planner.problem.costs import LayerCost, words_of
from fxkfac.planner.problem.errors import InfeasibleBudgetError, Knob, PlanError, ScheduleError, Suggestion
from fxkfac.planner.problem.hardware import HARDWARE
from fxkfac.planner.problem.ir import Capture, LayerTiming, Op, OpKind, Placement, Program
from fxkfac.planner.problem.lowering import add_replicas, made_refreshes, startup_programs
from fxkfac.planner.problem.problem import Problem, SolverConfig, StageGroup, format_bytes, is_streamed, stage_groups
from fxkfac.planner.problem.schedules import weight_gradient_kind
from fxkfac.planner.problem.step_timeline import (
    BUSY_KINDS,
    fused_extra,
    fused_stats,
    min_memory_bytes,
    plain_step_time,
    plain_utilization,
    refresh_lower_bound,
    step_timeline,
    utilization,
)
from fxkfac.planner.search.budget import Budget
from fxkfac.planner.search.greedy import (
    Allowance,
    allowance,
    greedy_group,
    greedy_overhead,
    group_lower_bound,
    restretch,
)

log = logging.getLogger(__name__)


class Method(StrEnum):
    """How the work is placed: CP-SAT warm-started by first-fit (kept where it finds none better) or the paper's
    greedy first-fit."""

    CPSAT = "cpsat"
    GREEDY = "greedy"


@dataclass
class Attempt:
    """Solutions per group for one set of fused layers (None where no k worked), first-fit's, and the allowance."""

    solutions: list[GroupSolution | None]
    greedy: list[GroupSolution | None]
    allowance: Allowance


def same_stretch(solutions: list[GroupSolution | None]) -> list[GroupSolution | None]:
    """Every group at the largest stretch any needs (one step for all ranks); one moved is no longer proven optimal
    (unless nothing is stale: it might be less stale there)."""
    placed = all_placed(solutions)
    if placed is None:
        return solutions
    stretch = max(s.window.stretch for s in placed)
    out: list[GroupSolution | None] = []
    for s in placed:
        moved = restretch(s, stretch)
        if moved is not s and moved.status == "OPTIMAL" and any(moved.use_offset.values()):
            moved = replace(moved, status="FEASIBLE")
        out.append(moved)
    return out


_PLACED_KINDS = frozenset({OpKind.STATS, OpKind.APPLY, OpKind.BCAST_PREC, OpKind.OPT_STEP})
"""Ops of the reference step a plan places itself (the per-step slot) or appends (OPT_STEP)."""


def _device_plan(problem: Problem, w: Window, device: int, placed: list[Placement]) -> tuple[Program, float]:
    """The device's ops per step of the period in tick order (a placed op after every fixed op ending by its start; at
    the refresh step each W followed by its fused layers' STATS folds) and its utilization over the window."""
    steps: list[list[tuple[tuple[int, ...], Op]]] = [[] for _ in range(w.k)]
    timelines = [step_timeline(problem, w.fused, refresh=True)] + [step_timeline(problem)] * (w.k - 1)
    tasks = placed_w(problem)  # the W's are placed ops ([Note: placed W] in planner/plan/window.py)
    for j, st in enumerate(timelines):
        for seq, (op, _, end) in enumerate(st.ops[device]):
            if tasks and op.kind is OpKind.BWD_W:
                continue
            if op.kind not in _PLACED_KINDS or is_streamed(problem, device, op):
                at = w.offsets[j] + round(end * w.scale)
                steps[j].append(((at, 0, seq), op))
                if j == 0 and op.kind is weight_gradient_kind(problem.kind) and w.fused:
                    folds = fused_stats(problem, w.fused, device, op)
                    steps[j].extend(((at, 0, seq, i), fold) for i, fold in enumerate(folds))
    for n, p in enumerate(sorted(placed, key=lambda p: (p.start, p.end))):
        at = round(p.start * w.scale) - w.length * (p.step // w.k)
        steps[p.step % w.k].append(((at, 1, n), p.op))
        if p.step == 0 and p.op.kind is OpKind.BWD_W and w.fused:
            steps[0].extend(((at, 1, n, i), fold) for i, fold in enumerate(fused_stats(problem, w.fused, device, p.op)))
    steps = [allreduce_after_w(problem, items) for items in steps] if tasks else steps
    program = [[op for _, op in sorted(items, key=lambda item: item[0])] + [Op(OpKind.OPT_STEP)] for items in steps]
    busy = sum(b - a for st in timelines for _, a, b in st.fixed(device))
    busy += sum(
        b - a
        for st in timelines
        for op, a, b in st.ops[device]
        if is_streamed(problem, device, op) and op.kind is OpKind.APPLY
    )
    # a placed W is in the F/B above
    busy += sum(p.end - p.start for p in placed if p.op.kind in BUSY_KINDS and p.op.kind is not OpKind.BWD_W)
    return program, utilization(busy, w.seconds(w.length))


def assemble(problem: Problem, attempt: Attempt, fused: frozenset[str], wall: float) -> Plan:
    """The plan of an attempt that placed every group, `fused` layers fused (`wall`: seconds the planning took)."""
    groups = stage_groups(problem)
    programs: dict[int, Program] = {}
    layers: dict[str, LayerTiming] = {}
    placements: list[Placement] = []
    peak: dict[int, int] = {}
    per_device: dict[int, float] = {}
    refresh, bound = [0] * problem.num_stages, [0] * problem.num_stages
    greedy_k: list[int | None] = [None] * problem.num_stages
    for group, sol, g in zip(groups, attempt.solutions, attempt.greedy):
        assert sol is not None
        w, placed = sol.window, placements_of(sol)
        placements += placed
        for d in group.devices:
            programs[d], per_device[d] = _device_plan(problem, w, d, [p for p in placed if p.device == d])
            peak[d] = peak_bytes(sol, d)
        for s in group.stages:
            lower = refresh_lower_bound(problem, group, fused, stretch=attempt.allowance.enabled)
            refresh[s], bound[s] = w.k, min(w.k, max(sol.k_lower_bound, lower))  # a bound past a plan bounds another
            greedy_k[s] = g.window.k if g is not None else None
            for x in problem.costs.stages[s].layers:
                layers[x.name] = LayerTiming(
                    w.k, 0, sol.use_offset.get(x.name, 0), Capture.FUSED if x.name in fused else Capture.DEFERRED
                )
    sols = [s for s in attempt.solutions if s is not None]
    # GREEDY when first-fit placed every group, OPTIMAL when CP-SAT proved every one, else FEASIBLE
    status = "OPTIMAL" if {s.status for s in sols} == {"OPTIMAL"} else "FEASIBLE"
    status = "GREEDY" if all(s.method == "greedy" for s in sols) else status
    objective = (sum(refresh), sum(t.use_offset for t in layers.values()))  # refresh steps, staleness
    metrics = PlanMetrics(
        utilization_baseline=plain_utilization(problem),
        utilization=sum(per_device.values()) / len(per_device),
        refresh_steps=tuple(refresh),
        step_time_baseline=plain_step_time(problem),
        step_time=max(s.window.seconds(s.window.length) / s.window.k for s in sols),
        step_time_reference=step_timeline(problem).length,
        peak_memory=dict(sorted(peak.items())),
        lower_bound_steps=tuple(bound),
        solver=SolverStats(status, wall, objective, (sum(refresh) - sum(bound)) / max(1, sum(refresh))),
        greedy_refresh_steps=tuple(greedy_k),
        time_quantum=0.0 if all(s.window.exact for s in sols) else max(s.window.seconds(1) for s in sols),
        stretch=max(s.window.seconds(s.window.stretch) for s in sols),
    )
    if problem.streaming is not None:
        sender = problem.stream_owners[0]
        made = made_refreshes(problem.streaming, placements, layers, sender)
        programs = add_replicas(programs, problem.streaming, sender, made)
    programs = dict(sorted(programs.items()))
    startup = startup_programs(programs, plan_born(problem, placements, layers))
    return Plan(problem, programs, layers, tuple(placements), metrics, problem.fingerprint, startup=startup)


class Refused(Exception):
    """A refusal before suggestions: the error, the knobs that may lift it (in order), the layers fused by then."""

    def __init__(self, error: PlanError, knobs: tuple[Knob, ...], fused: frozenset[str] = frozenset()) -> None:
        super().__init__(str(error))
        self.error, self.knobs, self.fused = error, knobs, fused


def stats_chunk_of(problem: Problem, group: StageGroup, config: SolverConfig, allowed: Allowance) -> int:
    """Layers per STATS task (`SolverConfig.stats_chunk` when set): the fewest within `max_stats_tasks` tasks, halved
    while such a task is longer than every bubble (small tasks pack best)."""
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
    """The least period that amortizes the fused curvature's extra refresh-step time within max_overhead."""
    extra = fused_extra(problem, fused)
    if extra <= 1e-12:
        return 1
    allowed = problem.max_overhead * step_timeline(problem).length
    if allowed <= 0:
        return problem.max_period + 1
    return max(1, math.ceil(extra / allowed - 1e-9))


def _solve_groups(
    problem: Problem, fused: frozenset[str], config: SolverConfig, method: Method, min_k: int, clock: Budget
) -> Attempt:
    """Every group's solution at periods >= min_k in two passes: every group's least period first (sharing the solver
    time left), then each one's stretch and staleness with the time the first left; chunked STATS tasks per
    `stats_chunk_of`, per layer where that places nothing."""
    from fxkfac.planner.search.group_search import Period, fixed_shape, least_group_period, refine_group, within_budget

    groups = stage_groups(problem)
    allowed = allowance(problem, fused, config)
    stretched = f", even with the step stretched by max_overhead={problem.max_overhead:g}" if allowed.enabled else ""
    knobs = (Knob.MAX_OVERHEAD, Knob.MICROBATCHES) if config.stretch else (Knob.MICROBATCHES,)
    work, resolution = words_of(problem.costs).name, config.time_resolution

    def first(group: StageGroup, chunk: int, later: int) -> tuple[GroupSolution | None, Period | GroupSolution | None]:
        """First-fit's placement, and CP-SAT's least period warm-started by it in the group's share of the solver time
        left (else first-fit's within the budget: the greedy method or no time left); Refused where none holds it."""
        k, most = max(2, min_k), allowed.ticks(problem.max_period)
        long = too_long(allowed.window(group, k, most, stats_chunk=chunk, resolution=resolution))
        if long:
            off = "" if config.stretch else ". Stretching the step is off (SolverConfig.stretch=False)"
            message = f"some {work} work cannot fit any bubble, whatever the refresh period{stretched}: "
            raise Refused(PlanError(message + "; ".join(long[:5]) + off), knobs, fused)
        if refresh_lower_bound(problem, group, fused, stretch=allowed.enabled) > problem.max_period:
            idle = f"is more than the idle time of {problem.max_period} steps holds{stretched}"
            raise Refused(PlanError(f"the {work} work of stages {list(group.stages)} {idle}"), knobs, fused)
        try:  # a candidate's first plan comes out whatever the time left (charged, not cut)
            g = greedy_group(
                allowed, group, stats_chunk=chunk, resolution=resolution, min_k=min_k, meter=clock, cut=False
            )
        except PlanError:
            g = None
        share = _share(problem, clock, later, reserve=g is None or not fits_memory(g))
        if method is Method.GREEDY or share is None:
            return g, within_budget(g)
        began = clock.now()
        shape = fixed_shape(allowed, group, config, clock, g, stats_chunk=chunk, min_k=min_k)
        return g, least_group_period(shape, config, share, clock, began)

    def second(passed: Period | GroupSolution | None, later: int) -> GroupSolution | None:
        """The first pass's solution, or its period refined in the group's share of the time left (without time, the
        period's placement within the budget)."""
        if not isinstance(passed, Period):
            return passed
        placed = within_budget(passed.found, passed.shape.fallback)
        share = _share(problem, clock, later, reserve=placed is None)
        return placed if share is None else refine_group(passed, config, share, clock)

    placings: list[tuple[GroupSolution | None, Period | GroupSolution | None]] = []
    for n, group in enumerate(groups):
        chunk, chunked = stats_chunk_of(problem, group, config, allowed), config.stats_chunk is None
        try:
            placing = first(group, chunk, len(groups) - n)
        except Refused:
            if chunk == 1 or not chunked:
                raise
            placing = (None, None)
        if chunk > 1 and chunked and placing == (None, None):
            log.info("stages %s: no placement with chunked STATS tasks; placing them per layer", list(group.stages))
            placing = first(group, 1, len(groups) - n)
        placings.append(placing)
    solutions = [second(placing, len(groups) - n) for n, (_, placing) in enumerate(placings)]
    return Attempt(same_stretch(solutions), [g for g, _ in placings], allowed)


def _share(problem: Problem, clock: Budget, later: int, *, reserve: bool) -> float | None:
    """A group's share of the solver time left among `later` groups (None: none left), FUSING_RESERVE of it kept for
    fusing rounds under a memory budget while the group has no placement within it (`reserve`)."""
    return clock.share(later, keep=FUSING_RESERVE if problem.memory_budget is not None and reserve else 0.0)


FUSING_RESERVE = 0.5
"""Of the CP-SAT time left, the part a group with no placement within the memory budget keeps for fusing rounds."""


def _next_fused(problem: Problem, attempt: Attempt, fused: frozenset[str], *, by_excess: bool) -> frozenset[str] | None:
    """More layers fused (largest kept bytes first) in every group with no plan: one, or `by_excess` as many as
    first-fit's bytes over the budget call for; None if none is left."""
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
        budget = problem.memory_budget or 0
        excess = 0
        if by_excess and first is not None:
            excess = max(peak_bytes(first, d) - budget for d in first.window.group.devices)
        saved = 0
        for x in candidates:
            more.add(x.name)
            saved += x.capture_bytes * problem.N * 2  # both Chimera pipelines at most
            if saved >= excess:
                break
    return frozenset(more)


def _captures(layer: LayerCost) -> bool:
    """Whether the layer has a part fed by a capture of its F/B (only those can be fused)."""
    return any(p.after is not OpKind.ALLREDUCE_GRAD for p in layer.parts)


def attempt_plan(problem: Problem, config: SolverConfig, method: Method, clock: Budget, began: float) -> Plan:
    """One planning run without suggestions (Refused when it makes none). With CP-SAT and a budget, first-fit fusing
    by its memory excess runs first; its plan is kept when CP-SAT's rounds of fusing find none in time."""
    if problem.memory_budget is not None and problem.memory_budget < (need := min_memory_bytes(problem)):
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
    """The work placed (`_fitted`); where fusing some layers costs less than deferring them (`cheaper_fused`), also
    with those fused when the plan stretches its steps or is refused, the better by `rank` kept."""
    cheaper = cheaper_fused(problem)
    plans: list[Plan] = []
    refusal: Refused | None = None
    for fused in (frozenset(), cheaper) if cheaper else (frozenset(),):
        if plans and plans[0].metrics.stretch <= 0:
            break
        try:
            plans.append(_fitted(problem, config, method, clock, began, fused))
        except Refused as refused:
            refusal = refusal or refused
    if not plans:
        assert refusal is not None, "no plan means a refusal"
        raise refusal
    best = min(plans, key=rank)
    if len(plans) > 1:
        log.info(
            "the steps stretch for deferred curvature: %.4g ms per step, %.4g ms with that of %d layers fused; kept %s "
            "(fresher curvature first, then the shorter step)",
            plans[0].metrics.step_time * 1e3,
            plans[1].metrics.step_time * 1e3,
            len(cheaper),
            "fused" if best is plans[1] else "deferred",
        )
    return best


def cheaper_fused(problem: Problem) -> frozenset[str]:
    """The captured layers whose curvature fused into F/B (where profiled) costs less than their statistics deferred."""
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
    """The work placed with `fused` layers fused, fusing more each round that misses the budget (one layer per group
    while CP-SAT has time; as many as first-fit's excess calls for after, and with the greedy method)."""
    while True:
        min_k = _overhead_period(problem, fused)
        if min_k > problem.max_period:
            names = sorted(fused)
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            error = InfeasibleBudgetError(
                f"the memory budget {format_bytes(problem.memory_budget or 0)} per device does not fit the a and e "
                f"kept for deferred curvature; fusing the curvature of {len(names)} layers ({shown}) adds "
                f"{fused_extra(problem, fused):.4g} s to each refresh step, more than "
                f"max_overhead={problem.max_overhead:g} allows within {problem.max_period} steps"
            )
            raise Refused(error, (Knob.MEMORY_BUDGET, Knob.MAX_OVERHEAD), fused)
        attempt = _solve_groups(problem, fused, config, method, min_k, clock)
        while fused and (placed := all_placed(attempt.solutions)) and len({s.window.k for s in placed}) > 1:
            common = max(s.window.k for s in placed)
            attempt = _solve_groups(problem, fused, config, method, common, clock)
        if all(attempt.solutions):
            return assemble(problem, attempt, fused, time.perf_counter() - began)
        # unplaced for want of time, not memory: before any fusing, first-fit (blind to the budget) placed it nowhere
        short = not fused and any(s is None and g is None for s, g in zip(attempt.solutions, attempt.greedy))
        if problem.memory_budget is None or short:
            raise _unplaced(problem, attempt, fused, config, method, clock)
        greedy = method is Method.GREEDY
        nxt = _next_fused(problem, attempt, fused, by_excess=greedy or clock.solver_time() <= 0)
        if nxt is None or (clock.out() and not greedy):
            bad = [g.stages for g, s in zip(stage_groups(problem), attempt.solutions) if s is None]
            why = "even with all their curvature fused"
            if nxt is not None:
                why = f"before the time limit ({config.time_limit_s:g} s) ran out, {len(fused)} layers fused"
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


def _unplaced(
    problem: Problem, attempt: Attempt, fused: frozenset[str], config: SolverConfig, method: Method, clock: Budget
) -> Refused:
    """The refusal when some group has no placement for want of bubble time; its whole-task check is charged to
    `clock` (and counts as not exceeding when the time runs out first)."""
    groups = [g for g, s in zip(stage_groups(problem), attempt.solutions) if s is None]
    bad, work = [g.stages for g in groups], words_of(problem.costs).name
    stretches = config.stretch and problem.max_overhead > 0
    stretched = f", the step stretched by up to max_overhead={problem.max_overhead:g}" if stretches else ""
    whole = functools.partial(attempt.allowance.window, stats_chunk=1, resolution=config.time_resolution, meter=clock)
    # one STATS task per layer (what packs best) fits in no window up to max_period: no search could place it
    if all(
        group_lower_bound(attempt.allowance, g, functools.partial(whole, g), meter=clock) > problem.max_period
        for g in groups
    ):
        message = (
            f"the {work} work of stages {bad} is more than the idle time of {problem.max_period} steps holds in "
            f"whole tasks{stretched}: its statistics and decomposition pieces leave part of every bubble they cannot "
            "fill"
        )
    else:
        timed = f", or the time limit ({config.time_limit_s:g} s) was" if method is Method.CPSAT else ""
        message = (
            f"no placement of the {work} work of stages {bad} within {problem.max_period} steps "
            f"({method.value}{stretched}): the bubbles are too short{timed}"
        )
    return Refused(PlanError(message), (Knob.MAX_OVERHEAD, Knob.MICROBATCHES), fused)


STRETCH_SEARCH_S = 5.0
"""The most seconds of the limit (and at most half the time left) CP-SAT refines the least stretch of one group."""


@dataclass(frozen=True)
class _Hints:
    """A refusal's search for what plans it: each knob that may lift it, upward from the refused value, naming only
    values it solved the problem with (everything else unchanged), every plan kept in `until`."""

    config: SolverConfig
    method: Method
    until: Budget

    def plan(self, problem: Problem, *, thorough: bool = False) -> Plan | None:
        """`problem`'s plan: first-fit first (CP-SAT's first pass), then, `thorough` with CP-SAT, CP-SAT itself in the
        time left; None where neither plans."""
        until, method = self.until, self.method
        made = until.made.get((problem, method))
        if made is not None:
            return made
        tries = [until.now()]
        if thorough and method is Method.CPSAT:
            tries.append(min(until.cutoff, tries[0] + until.units(self.config.time_limit_s)))
        for deadline in tries:
            if until.out():
                return None
            try:
                plan = attempt_plan(problem, self.config, method, until.later(deadline), time.perf_counter())
            except Refused:
                continue
            until.made[(problem, method)] = plan
            return plan
        return None

    def first(self, knob: Knob, values: Iterable[int], make: Callable[[int], Problem]) -> Suggestion | None:
        """The first of `values` of `knob` whose problem (`make`) plans (one the schedule refuses skipped), until the
        time runs out."""
        for value in values:
            try:
                candidate = make(value)
            except ScheduleError:
                continue
            if self.plan(candidate) is not None:
                return Suggestion(((knob, value),))
            if self.until.out():
                return None
        return None

    def overhead(self, problem: Problem, fused: frozenset[str]) -> Suggestion | None:
        """A max_overhead that plans: from greedy's stretch estimate doubling, checked by first-fit (then with CP-SAT,
        by CP-SAT); then while time is left, CP-SAT's least stretch (least where proven) or bisection below it."""
        estimate, proven = self.estimate(problem, fused, Method.GREEDY)
        ladder, x = [], _sig_up(max(estimate or 0.0, problem.max_overhead * 1.01, 1e-4))
        while x < 10:  # doubling, 3 significant digits, above the refused value and below 10
            if x > problem.max_overhead:
                ladder.append(x)
            x = _sig_up(x * 2)
        for thorough in (False, True) if self.method is Method.CPSAT else (False,):
            failed = problem.max_overhead
            for candidate in ladder:
                if self.plan(replace(problem, max_overhead=candidate), thorough=thorough) is not None:
                    break
                if self.until.out():
                    return None
                failed = candidate
            else:
                continue
            break
        else:
            return None
        if proven and candidate == estimate:
            return Suggestion(((Knob.MAX_OVERHEAD, candidate),), least=True)
        if self.method is Method.CPSAT:
            least, proven = self.estimate(problem, fused, self.method)
            if (
                least is not None
                and failed < least < candidate
                and self.plan(replace(problem, max_overhead=least), thorough=True) is not None
            ):
                return Suggestion(((Knob.MAX_OVERHEAD, least),), least=proven)
        for _ in range(4):  # a few bisection probes between the last that failed and the one that plans
            middle = _sig_up((failed + candidate) / 2)
            if not failed < middle < candidate:
                break
            if self.plan(replace(problem, max_overhead=middle)) is not None:
                candidate = middle
            elif self.until.out():
                break
            else:
                failed = middle
        return Suggestion(((Knob.MAX_OVERHEAD, candidate),))

    def memory(self, problem: Problem, fused: frozenset[str]) -> Suggestion | None:
        """A memory budget that plans at the problem's max_overhead: the peak of the plan made without one, rounded up
        (raised by a quarter while it does not plan), never above the device's memory."""
        free = self.plan(replace(problem, memory_budget=None))
        if free is None:
            return None
        peak = max(free.metrics.peak_memory.values())
        budgets = [_bytes_up(max(peak, min_memory_bytes(problem), (problem.memory_budget or 0) + 1))]
        for _ in range(3):
            budgets.append(_bytes_up(budgets[-1] * 1.25))
        device = device_bytes(problem)
        budgets = [b for b in budgets if device is None or b <= device]
        return self.first(Knob.MEMORY_BUDGET, budgets, lambda budget: replace(problem, memory_budget=budget))

    def microbatches(self, problem: Problem, fused: frozenset[str]) -> Suggestion | None:
        """The nearest N valid for the schedule that plans: fewer first (less work for the same bubbles), then more,
        up to 4 times this one."""
        ns = [*range(problem.N - 1, 0, -1), *range(problem.N + 1, 4 * problem.N + 1)]
        return self.first(Knob.MICROBATCHES, ns, lambda n: replace(problem, N=n))

    def together(self, problem: Problem, fused: frozenset[str]) -> Suggestion | None:
        """A max_overhead that plans without the budget, and a budget that plans at it."""
        overhead = self.overhead(replace(problem, memory_budget=None), frozenset())
        if overhead is None:
            return None
        value = overhead.fields()["max_overhead"]
        memory = self.memory(replace(problem, max_overhead=value), fused)
        return None if memory is None else Suggestion(((Knob.MAX_OVERHEAD, value),) + memory.changes)

    def estimate(self, problem: Problem, fused: frozenset[str], method: Method) -> tuple[float | None, bool]:
        """The max_overhead the stretch at max_period needs (3 digits, rounded up) and whether it is proven least
        (CP-SAT refines first-fit's while time is left); None when stretching is off or no stretch up to 10 steps
        places it."""
        config, until = self.config, self.until
        if not config.stretch:
            return None, False
        grid = Allowance(problem, fused, grid_scale(problem, range(problem.num_stages), fused, config.time_resolution))
        upper, proven = 0, True
        for group in stage_groups(problem):
            chunk = stats_chunk_of(problem, group, config, grid)
            low, found = greedy_overhead(group, grid, stats_chunk=chunk, resolution=config.time_resolution, meter=until)
            if found is None:
                return None, False
            least = found.window.stretch <= low
            left = until.left()
            if method is Method.CPSAT and not least and left > 0:
                from fxkfac.planner.search.group_search import least_stretch_at

                limit = min(until.units(min(STRETCH_SEARCH_S, config.time_limit_s)), left / 2)
                found, least = least_stretch_at(found, grid, config, until, until.now() + 2 * limit)
            upper, proven = max(upper, found.window.stretch), proven and least
        assert grid.scale is not None, "the allowance has a grid"
        extra = fused_extra(problem, fused) / problem.max_period
        need = (upper / grid.scale[0] + extra) / step_timeline(problem).length
        return (_sig_up(need) if need > 0 else None), proven


_SEARCHES: dict[tuple[Knob, ...], tuple[str, Callable[[_Hints, Problem, frozenset[str]], Suggestion | None]]] = {
    (Knob.MAX_OVERHEAD,): ("max_overhead below 10", _Hints.overhead),
    (Knob.MEMORY_BUDGET,): ("memory budget from the peak of a plan made without one", _Hints.memory),
    (Knob.MAX_OVERHEAD, Knob.MEMORY_BUDGET): ("max_overhead with a memory budget", _Hints.together),
    (Knob.MICROBATCHES,): ("number of micro-batches from 1 to {N}", _Hints.microbatches),
}
"""Each knob set's search, and what it tries (for the message that says none of it plans)."""


def with_suggestions(refused: Refused, problem: Problem, hints: _Hints) -> PlanError:
    """The refusal's error with the values that plan, searched until `hints.until`: each knob alone; where none does
    and a budget is set, max_overhead and the budget together; then more micro-batches."""
    found: list[Suggestion] = []
    searched: list[str] = []
    stages: list[tuple[Knob, ...]] = [(knob,) for knob in refused.knobs if knob is not Knob.MICROBATCHES]
    device, budget = device_bytes(problem), problem.memory_budget
    if device is not None and budget is not None and budget >= device and Knob.MEMORY_BUDGET in refused.knobs:
        # the budget is all the device has: no suggestion may raise it, so more time (fusing) first
        stages = [(Knob.MAX_OVERHEAD,)] + [k for k in stages if k not in ((Knob.MAX_OVERHEAD,), (Knob.MEMORY_BUDGET,))]
    if problem.memory_budget is not None and {Knob.MAX_OVERHEAD, Knob.MEMORY_BUDGET} & set(refused.knobs):
        stages.append((Knob.MAX_OVERHEAD, Knob.MEMORY_BUDGET))
    if Knob.MICROBATCHES in refused.knobs:
        stages.append((Knob.MICROBATCHES,))
    for knobs in stages:
        if hints.until.out() or (len(knobs) > 1 or knobs == (Knob.MICROBATCHES,)) and found:
            break
        what, search = _SEARCHES[knobs]
        searched.append(what.format(N=4 * problem.N))
        suggestion = search(hints, problem, refused.fused)
        if suggestion is not None:
            found.append(suggestion)
    if found:
        text = "Solved with: " + "; or ".join(_describe(problem, s) for s in found)
    elif hints.until.out():
        text = (
            f"Nothing that plans it was found before the time ran out (time limit {hints.config.time_limit_s:g} s): "
            f"searched {'; '.join(searched) or 'nothing'}; a longer time limit searches further"
        )
    else:
        text = f"Nothing plans it: no {'; no '.join(searched)}"
    error = refused.error
    if isinstance(error, InfeasibleBudgetError):
        return InfeasibleBudgetError(f"{error}. {text}", error.needed_bytes, suggestions=tuple(found))
    return PlanError(f"{error}. {text}", suggestions=tuple(found))


def _describe(problem: Problem, s: Suggestion) -> str:
    """A suggestion in words: every value as `field=value`."""
    words = {
        Knob.MAX_OVERHEAD: "max_overhead={:g}",
        Knob.MEMORY_BUDGET: "memory_budget={} bytes ({})",
        Knob.MICROBATCHES: "N={} micro-batches (of the same size)",
    }
    text = " with ".join(words[knob].format(value, format_bytes(int(value))) for knob, value in s.changes)
    if s.least:
        text += ", the least max_overhead that places it (rounded up to 3 digits; refresh every "
        text += f"{problem.max_period} steps)"
    if [knob for knob, _ in s.changes] == [Knob.MEMORY_BUDGET]:
        text += f" at max_overhead={problem.max_overhead:g}"
    return text


def device_bytes(problem: Problem) -> int | None:
    """The memory of the problem's device (`planner.problem.hardware.HARDWARE`), None where it is not a known one."""
    spec = HARDWARE.get(problem.hardware.lower())
    return None if spec is None else spec.memory_bytes


def _sig_up(x: float, digits: int = 3) -> float:
    """`x` > 0 rounded up to `digits` significant digits: a value to type that is never short."""
    quantum = Decimal(1).scaleb(math.floor(math.log10(x)) - digits + 1)
    return float((Decimal(repr(x)) / quantum).to_integral_value(rounding=ROUND_CEILING) * quantum)


def _bytes_up(n: float) -> int:
    """`n` bytes rounded up to two decimals of GiB, MiB or KiB (whole bytes below 1 KiB), as the CLI reads
    '84.47GiB': int(float('84.47') * 2**30)."""
    for unit in ((1 << 30), (1 << 20), (1 << 10)):
        if n >= unit:
            hundredths = math.ceil(n * 100 / unit - 1e-6)
            while int(float(f"{hundredths / 100:.2f}") * unit) < n:
                hundredths += 1
            return int(float(f"{hundredths / 100:.2f}") * unit)
    return math.ceil(n)


REFUSED = "refused"
"""The first part of the key under which a budget keeps a problem's refusal (`Budget.made`)."""


def solve(
    problem: Problem,
    config: SolverConfig = SolverConfig(),
    method: Method | str = Method.CPSAT,
    *,
    budget: Budget | None = None,
    shares: float = 1,
    suggest: bool = True,
) -> Plan:
    """Plan `problem`'s preconditioner work (CPSAT warm-started by first-fit, or GREEDY) in 1/`shares` of the solver
    time left in `budget` (a new one of `config` when None; [Note: time limit]). Raises InfeasibleBudgetError or
    PlanError, unless `suggest` is False with the values of max_overhead, memory budget or N that it solved with."""
    try:
        how = Method(method)
    except ValueError:
        raise PlanError(f"unknown planning method {method!r}; use 'cpsat' or 'greedy'") from None
    budget = budget or Budget.of(config)
    made = budget.made.get((problem, how))
    if made is not None:
        return made  # solved in this planning already: while searching for the value a refusal names
    try:
        refused = budget.made.get((REFUSED, problem, how))
        if refused is None or not budget.over():
            plan = attempt_plan(problem, config, how, budget.solving(shares), time.perf_counter())
        else:  # refused in this planning already and no time left to try again: its suggestions are searched
            raise refused
    except Refused as refused:
        budget.made[(REFUSED, problem, how)] = refused
        if not suggest:
            raise refused.error from None
        raise with_suggestions(refused, problem, _Hints(config, how, budget.suggesting())) from None
    budget.made[(problem, how)] = plan
    return plan
