"""`plan(problem, options)`: the planner's one entry point, the whole search (streaming, strategy, recompute, overhead).

[Note: plan search] Every caller plans through `plan`, which composes, outside in: the max_overhead rule (`Overhead`),
the recomputing stages, the distributions (forced, given, or chosen: planner/search/choose.py) and streaming the first
stage's APPLY around each placement, each a candidate taking a part of one `Budget` ([Note: one budget]).
TimeLimit.EACH_SOLVE gives each placement the whole limit instead (as the golden records were planned). Around `plan`:
the schedule of schedule="auto" (`choose_schedule`) and the block side of Shampoo/SOAP (`choose_block_size`).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from itertools import combinations
from typing import TypeVar

from fxkfac.planner.plan.plan import Plan, rank
from fxkfac.planner.problem.costs import PreconditionerKind
from fxkfac.planner.problem.errors import ConfigError, PlanError, PlannerError, ScheduleError
from fxkfac.planner.problem.ir import Op, OpKind
from fxkfac.planner.problem.lowering import Streaming, can_stream, ready_fractions
from fxkfac.planner.problem.problem import Problem, SolverConfig, format_bytes, stage_groups
from fxkfac.planner.problem.schedules import ScheduleKind, validate_schedule_args
from fxkfac.planner.problem.step_timeline import (
    Timeline,
    group_load,
    min_memory_bytes,
    refresh_lower_bound,
    step_timeline,
)
from fxkfac.planner.problem.strategy import LayerDistribution, Strategy
from fxkfac.planner.search.attempt import Method, solve
from fxkfac.planner.search.budget import Budget

log = logging.getLogger(__name__)

EXHAUSTIVE_STAGES = 8
"""Up to this many stages every subset of recomputing stages is priced; beyond, stages are added greedily."""
MAX_TRIES = 4
"""`plan_recomputing` solves at most this many choices before it gives up."""

T = TypeVar("T")


def recompute_price(problem: Problem, stages: Iterable[int]) -> tuple[int, float]:
    """(least bytes per device any plan needs, reference step seconds) of `problem` with `stages` recomputing."""
    candidate = replace(problem, recompute=tuple(sorted(set(stages))))
    return min_memory_bytes(candidate), step_timeline(candidate).length


def recompute_choices(problem: Problem) -> list[tuple[int, ...]]:
    """The recomputing stages that fit the budget, shortest reference step (then fewest stages) first; [()] without
    a budget, every stage when none fits (its refusal names the least memory reached)."""
    budget, S = problem.memory_budget, problem.num_stages
    if budget is None:
        return [()]
    every = S <= EXHAUSTIVE_STAGES
    candidates = [c for n in range(S + 1) for c in combinations(range(S), n)] if every else [(), *_greedy(problem)]
    priced = {c: recompute_price(problem, c) for c in candidates}
    fitting = sorted((step, len(c), c) for c, (memory, step) in priced.items() if memory <= budget)
    return [c for _, _, c in fitting] or [tuple(range(S))]


def choose_recompute(problem: Problem) -> Problem:
    """`problem` with the first of its `recompute_choices` recomputing."""
    return replace(problem, recompute=recompute_choices(problem)[0])


def plan_recomputing(problem: Problem, solve: Callable[[Problem], T]) -> T:
    """`solve` of the first of `recompute_choices` (at most `MAX_TRIES`) that plans; else the first one's refusal."""
    first: PlanError | None = None
    for chosen in recompute_choices(problem)[:MAX_TRIES]:
        if chosen:
            memory, step = recompute_price(problem, chosen)
            log.info(
                "activation checkpointing: stages %s recompute (least memory %s per device for a budget of %s, "
                "reference step %.4g s)",
                list(chosen),
                format_bytes(memory),
                format_bytes(problem.memory_budget or 0),
                step,
            )
        try:
            return solve(replace(problem, recompute=chosen))
        except PlanError as e:
            log.info("activation checkpointing: stages %s recomputing do not plan (%s)", list(chosen), e)
            first = first or e
    assert first is not None, "recompute_choices returns at least one choice"
    raise first


def _greedy(problem: Problem) -> list[tuple[int, ...]]:
    """Stages added one at a time, most bytes saved per second of step added first: every choice on the way."""
    chosen: tuple[int, ...] = ()
    memory, step = recompute_price(problem, chosen)
    out = []
    while len(chosen) < problem.num_stages:
        priced = {s: recompute_price(problem, (*chosen, s)) for s in range(problem.num_stages) if s not in chosen}
        saved = {s: memory - m for s, (m, _) in priced.items()}
        worth = {s: (t <= step, saved[s] if t <= step else saved[s] / (t - step)) for s, (_, t) in priced.items()}
        best = max(sorted(worth), key=worth.__getitem__)
        chosen = tuple(sorted((*chosen, best)))
        memory, step = priced[best]
        out.append(chosen)
    return out


@dataclass(frozen=True)
class ScheduleCandidate:
    """One schedule with its stages per rank `v`."""

    kind: ScheduleKind
    v: int = 1

    def __str__(self) -> str:
        return f"{self.kind.value} v={self.v}" if self.v != 1 else self.kind.value


def schedule_candidates(D: int, N: int, v: int = 1) -> tuple[ScheduleCandidate, ...]:
    """Every schedule that runs D ranks and N micro-batches, in `ScheduleKind`'s order, with its stages per rank (ZB-V
    2; interleaved and zb-1p `v`, at least 2)."""
    out = []
    for kind in ScheduleKind:
        stages = {ScheduleKind.ZB_V: 2, ScheduleKind.INTERLEAVED: max(v, 2), ScheduleKind.ZB_1P: max(v, 2)}.get(kind, 1)
        try:
            validate_schedule_args(kind, D, N, stages)
        except ScheduleError:
            continue
        out.append(ScheduleCandidate(kind, stages))
    return tuple(out)


@dataclass
class Tried:
    """One schedule: its plan as asked (`first`), at the freshest period (`plan`; None: out), why it is out, and its
    plain step (the least any plan has)."""

    candidate: ScheduleCandidate
    first: Plan | None = None
    plan: Plan | None = None
    why_not: str = ""
    plain: float = 0.0


@dataclass(frozen=True)
class ScheduleChoice:
    """The chosen plan, every candidate tried, the refresh period compared at, and the choice in words."""

    plan: Plan
    tried: tuple[Tried, ...]
    period: int
    reason: str


FIRST_PLANS_PART = 0.5
"""Of a schedule choice's time, the part the plans as asked share; the re-plans share the rest."""
NO_TIME = "no time left to plan it (a longer time limit plans it)"


def _first_line(error: Exception) -> str:
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def choose_schedule(
    candidates: Sequence[ScheduleCandidate],
    problem_for: Callable[[ScheduleCandidate], Problem],
    plan_of: Callable[[Problem, Budget], Plan],
    budget: Budget,
) -> ScheduleChoice:
    """The least step at the freshest curvature among `candidates` (`problem_for`: its problem; `plan_of`: `plan` in a
    part of `budget`): each planned as asked, those refreshing less often than the freshest plan planned again at its
    period, the least step winning (ties: `candidates`' order); PlanError with each one's reason when none plans.

    [Note: schedule order] Both rounds go least plain step first (a bound of any plan's step), so a short budget goes
    to schedules that can win; a re-plan whose plain step cannot beat the leader is not made. Every plan as asked is
    made while time is left: a slower schedule may refresh more often and so set the period all are compared at."""
    tried = [Tried(c) for c in candidates]
    problems: dict[int, Problem] = {}  # by the candidate's index, those whose problem could be made
    for n, t in enumerate(tried):
        try:
            problems[n] = problem_for(t.candidate)
            step = step_timeline(problems[n], frozenset(), False)  # the plain pipeline, charged as simulated
            budget.charge_simulated(_simulated_ops(step))
            t.plain = step.length
        except PlannerError as e:  # a cut the costs do not allow: out, with the reason
            t.why_not = _first_line(e)
    order = sorted(problems, key=lambda n: (tried[n].plain, n))
    firsts = budget.part(FIRST_PLANS_PART, search=True)
    for left, n in enumerate(order):
        if any(t.first is not None for t in tried) and firsts.over():
            tried[n].why_not = NO_TIME
            continue
        try:
            tried[n].first = plan_of(problems[n], firsts.part(1 / (len(order) - left), search=True))
        except PlannerError as e:  # a budget refused: out, with the reason
            tried[n].why_not = _first_line(e)
    planned = [t.first for t in tried if t.first is not None]
    if not planned:
        raise PlanError("no schedule plans: " + "; ".join(f"{t.candidate}: {t.why_not}" for t in tried))
    period = min(max(p.metrics.refresh_steps) for p in planned)
    for t in tried:
        t.plan = t.first if t.first is not None and max(t.first.metrics.refresh_steps) <= period else None

    def ranked(n: int) -> tuple[float, int]:
        plan = tried[n].plan
        assert plan is not None, "only planned candidates rank"
        return plan.metrics.step_time, n

    stale = [n for n in order if tried[n].first is not None and tried[n].plan is None]
    for left, n in enumerate(stale):
        leader = min((m for m, t in enumerate(tried) if t.plan is not None), key=ranked)
        if (tried[n].plain, n) > ranked(leader):
            tried[n].why_not = (
                f"cannot beat {candidates[leader]}'s {_ms(ranked(leader)[0])} at refresh every {period} steps: "
                f"its plain step is {_ms(tried[n].plain)}"
            )
            continue
        if budget.over():
            tried[n].why_not = f"cannot refresh every {period} steps: {NO_TIME}"
            continue
        try:
            tried[n].plan = plan_of(
                replace(problems[n], max_period=period), budget.part(1 / (len(stale) - left), search=True)
            )
        except PlanError as e:
            tried[n].why_not = f"cannot refresh every {period} steps: {_first_line(e)}"
    best = tried[min((n for n, t in enumerate(tried) if t.plan is not None), key=ranked)]
    assert best.plan is not None, "compared candidates have a plan"
    others = ", ".join(
        f"{t.candidate} {_ms(t.plan.metrics.step_time)}" for t in tried if t is not best and t.plan is not None
    )
    reason = (
        f"{best.candidate}: the least step, {_ms(best.plan.metrics.step_time)}, with every layer refreshed at "
        f"least every {period} steps (the freshest curvature any schedule plans)"
        + (f"; {others}" if others else "")
        + "".join(f"; {t.candidate} out: {t.why_not}" for t in tried if t.why_not)
        + "; planned least plain step first: "
        + ", ".join(f"{candidates[n]} {_ms(tried[n].plain)}" for n in order)
    )
    return ScheduleChoice(best.plan, tuple(tried), period, reason)


class StreamApply(StrEnum):
    """When the first stage's APPLY streams to idle ranks: never, where it costs no refresh, or wherever it shortens the
    step (which shortens the bubbles too)."""

    OFF = "off"
    KEEP_REFRESH = "keep-refresh"
    SHORTEST_STEP = "shortest-step"


STREAMED_PART = 0.5
"""Of the time left, the part the streamed try takes where the plan without streaming may follow."""
STREAMED_STAGE = 0
"""The stage whose APPLY lies on the cycle every step repeats (GPipe, 1F1B): its last backward ends the step."""
HELPER_CANDIDATES = 4
"""Ranks, those ending their work first, tried as helpers: each alone and the first m together (Muon: all dealt)."""
STREAM_CHOICE_PART = 0.05
"""Of the whole time limit, the most the streaming choice's simulations take before it keeps the best so far."""


def _streamable(problem: Problem) -> list[str]:
    """The first stage's COMM-OPT layers a helper may apply, in the order their gradients get final; a Muon unit only
    where what a helper takes off its owner (APPLY less `hand_off`) outlasts what it adds to its bucket's transfer."""
    stage, costs = problem.costs.stages[STREAMED_STAGE], problem.costs
    send = [Op(OpKind.SEND_LGRAD, STREAMED_STAGE, peer=STREAMED_STAGE + 1, layer=x.name) for x in stage.layers]
    ok = [
        x.name
        for x, sent in zip(stage.layers, send)
        if can_stream(costs.family, x)
        and problem.where(x.name) == LayerDistribution()
        and (
            costs.family is not PreconditionerKind.MUON
            or x.prec - x.hand_off > costs.bucket_seconds([sent]) - costs.bucket_seconds([])
        )
    ]
    fractions = ready_fractions(stage)
    return sorted(ok, key=lambda n: fractions[n])


def _balanced(problem: Problem, names: list[str], helpers: tuple[int, ...]) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The layers streamed and their helpers when every APPLY is dealt, longest first, to whichever of the owner and
    `helpers` has the least so far: where the gradients come at once the APPLYs then end together."""
    seconds = {n: problem.costs.layer(n).prec for n in names}
    load = {rank: 0.0 for rank in (-1, *helpers)}  # -1: the owner
    dealt: dict[str, int] = {}
    for n in sorted(names, key=lambda n: (-seconds[n], names.index(n))):
        rank = min(load, key=lambda r: (load[r], r))
        dealt[n], load[rank] = rank, load[rank] + seconds[n]
    streamed = tuple(n for n in names if dealt[n] >= 0)
    return streamed, tuple(dealt[n] for n in streamed)


def _helper_load(problem: Problem) -> float:
    """The largest share of its bubbles a helper's stage group needs for one refresh per step (inf without bubble)."""
    assert problem.streaming is not None, "only a streaming problem has helpers"
    groups = stage_groups(problem)
    loads = [group_load(problem, next(g for g in groups if h in g.devices)) for h in problem.streaming.ranks]
    return max(work / bubble if bubble > 0 else math.inf for work, bubble in loads)


def with_streaming(
    problem: Problem, whole_backward: bool = False, keep_bounds: bool = True, budget: Budget | None = None
) -> Problem:
    """`problem` with the first stage's APPLY streamed: of the helper sets (the ranks ending their work first) and
    prefixes of its layers (Muon: also every idle rank, `_balanced`), the shortest reference step that raises no
    group's least period (any, without `keep_bounds`), then the lowest helper load, then the fewest helpers;
    unchanged where none shortens it. Charged to `budget`; past STREAM_CHOICE_PART of its limit the best is kept."""
    if problem.streaming is not None or len(problem.holders[STREAMED_STAGE]) == len(problem.devices):
        return problem
    if problem.costs.family is PreconditionerKind.MUON and len(problem.holders[STREAMED_STAGE]) > 1:
        return problem  # the runtime streams a Muon stage with one copy only
    names = _streamable(problem)
    if not names:
        return problem
    plain = step_timeline(problem)
    bounds, length = _bounds(problem) if keep_bounds else None, plain.length
    best: tuple[float, float, int] | None = None
    chosen, budget = problem, budget or Budget.untimed()
    stop = budget.now() + budget.limit * STREAM_CHOICE_PART
    owners = problem.holders[STREAMED_STAGE]
    ends = {
        d: max((end for op, _, end in plain.ops[d] if op.kind is not OpKind.OPT_STEP), default=0.0)
        for d in problem.devices
        if d not in owners
    }
    ranked, dealt = sorted(ends, key=lambda d: (ends[d], d)), problem.costs.family is PreconditionerKind.MUON
    firsts = ranked[:HELPER_CANDIDATES]
    sets = [((h,), True) for h in firsts] + [(tuple(firsts[:m]), True) for m in range(2, len(firsts) + 1)]
    # Muon's matrices dealt over every idle rank first: the streaming choice may stop at its part of the time limit
    dealt_sets = [(tuple(ranked[:m]), False) for m in range(len(ranked), HELPER_CANDIDATES, -1)] if dealt else []
    for helpers, prefixes in dealt_sets + sets:
        # round robin from the last layer: the APPLYs that end the step run side by side
        tries = [
            (tuple(names[:n]), tuple(helpers[(n - 1 - i) % len(helpers)] for i in range(n)))
            for n in range(len(helpers), len(names) + 1)
            if prefixes
        ]
        tries += [_balanced(problem, names, helpers)] if dealt and len(helpers) > 1 else []
        for layers, assigned in tries:
            if not layers:
                continue
            if best is not None and budget.now() >= stop:
                log.info("streaming choice: its part of the time limit is spent; the best found so far is kept")
                return chosen
            candidate = replace(problem, streaming=Streaming(STREAMED_STAGE, assigned, layers, whole_backward))
            step = step_timeline(candidate)
            budget.charge_simulated(_simulated_ops(step) * (1 + len(stage_groups(candidate)) * bool(bounds)))
            if step.length >= length * (1 - 1e-9) or (bounds is not None and _bounds(candidate) != bounds):
                continue
            key = (round(step.length, 12), _helper_load(candidate), len(helpers))
            if best is None or key < best:
                best, chosen = key, candidate
    return chosen


def _simulated_ops(step: Timeline) -> int:
    """The ops of one simulated step, what its simulation is charged by."""
    return sum(len(ops) for ops in step.ops.values())


def solve_streamed(
    problem: Problem,
    solve: Callable[..., Plan],
    policy: StreamApply = StreamApply.KEEP_REFRESH,
    whole_backward: bool = False,
    budget: Budget | None = None,
    streamed: Problem | None = None,
) -> Plan:
    """`solve(problem, budget, suggest=...)` streamed where `with_streaming` finds it pays (`streamed`: chosen already):
    KEEP_REFRESH keeps a streamed plan at the unstreamed bounds, else the better by `rank` of it and the unstreamed
    plan (the streamed try in STREAMED_PART); SHORTEST_STEP keeps it. Only the unstreamed refusal is raised."""
    budget = budget or Budget.of(SolverConfig())
    if streamed is None and policy is not StreamApply.OFF:
        streamed = with_streaming(problem, whole_backward, policy is StreamApply.KEEP_REFRESH, budget)
    if policy is StreamApply.OFF or streamed is problem:
        return solve(problem, budget)
    assert streamed is not None and streamed.streaming is not None, "with_streaming: a streaming problem or the same"
    log.info(
        "streaming %d layer(s) of stage %d to rank(s) %s (their APPLY leaves the step's cycle)",
        len(streamed.streaming.layers),
        streamed.streaming.stage,
        list(streamed.streaming.ranks),
    )
    part = 1.0 if policy is StreamApply.SHORTEST_STEP else STREAMED_PART
    try:
        plan = solve(streamed, budget.part(part), suggest=False)
    except PlanError as e:
        log.info("no plan with streaming (%s); planning without it", str(e).splitlines()[0])
        return solve(problem, budget)
    if policy is StreamApply.SHORTEST_STEP or tuple(plan.metrics.refresh_steps) == _bounds(problem):
        return plan
    try:
        alone = solve(problem, budget, suggest=False)
    except PlanError:
        return plan
    if rank(alone) < rank(plan):
        log.info(
            "planned without streaming: refresh every %s steps, where streaming's plan refreshes every %s",
            list(alone.metrics.refresh_steps),
            list(plan.metrics.refresh_steps),
        )
        return alone
    return plan


def _bounds(problem: Problem) -> tuple[int, ...]:
    """Each stage's least refresh period: a streaming that raises one trades refreshes (ranked first) for step time."""
    out = [0] * problem.num_stages
    for group in stage_groups(problem):
        for s in group.stages:
            out[s] = refresh_lower_bound(problem, group)
    return tuple(out)


class Distributions(StrEnum):
    """Where each layer's work lives when no Strategy is forced: CHOSEN by the planner ([Note: strategy search]), or the
    problem's own `distributions` as GIVEN."""

    CHOSEN = "chosen"
    GIVEN = "given"


class TimeLimit(StrEnum):
    """What `SolverConfig.time_limit_s` bounds: the WHOLE_SEARCH (one Budget), or EACH_SOLVE (one per placement)."""

    WHOLE_SEARCH = "whole-search"
    EACH_SOLVE = "each-solve"


class Overhead(StrEnum):
    """How max_overhead is read: STRICT, a bound the plan keeps; LEAST (max_overhead None): the bubbles alone, else the
    least max_overhead the refusal names."""

    STRICT = "strict"
    LEAST = "least"


@dataclass(frozen=True)
class SearchOptions:
    """What `plan` searches besides the placement."""

    solver: SolverConfig = field(default_factory=SolverConfig)
    method: Method = Method.CPSAT
    strategy: Strategy | Distributions = Distributions.CHOSEN
    stream_apply: StreamApply = StreamApply.KEEP_REFRESH
    whole_backward: bool = False
    """The stages run compiled: a backward makes every gradient at its end (`planner.problem.lowering.Streaming`)."""
    choose_recompute: bool = False
    """The planner chooses which stages recompute (activation checkpointing AUTO)."""
    overhead: Overhead = Overhead.STRICT
    time_limit: TimeLimit = TimeLimit.WHOLE_SEARCH

    def __post_init__(self) -> None:
        if not isinstance(self.solver, SolverConfig):
            raise ConfigError(f"SearchOptions.solver must be a SolverConfig, got {self.solver!r}")
        kinds = {"method": Method, "stream_apply": StreamApply, "overhead": Overhead, "time_limit": TimeLimit}
        try:
            for name, kind in kinds.items():
                object.__setattr__(self, name, kind(getattr(self, name)))
        except ValueError as e:
            raise ConfigError(f"SearchOptions: {e}") from None
        if not isinstance(self.strategy, (Strategy, Distributions)):
            raise ConfigError(
                f"SearchOptions.strategy must be a Strategy or Distributions.CHOSEN/GIVEN, got {self.strategy!r}"
            )


def plan(
    problem: Problem,
    options: SearchOptions = SearchOptions(),
    *,
    budget: Budget | None = None,
    new_budget: Callable[[], Budget] | None = None,
) -> Plan:
    """The plan of `problem` by the whole search `options` ask for ([Note: plan search]), all in `budget` (a new one
    when None), or under EACH_SOLVE each placement in its own (`new_budget()`); PlanError with suggestions."""
    if options.overhead is Overhead.LEAST and problem.max_overhead != 0:
        raise ConfigError(
            f"Overhead.LEAST plans at max_overhead 0 first, but the problem has {problem.max_overhead:g}; "
            "use Overhead.STRICT to plan within it"
        )
    from fxkfac.planner.search.choose import (  # loads ortools: at the first plan only
        least_overhead,
        solve_with_strategy,
    )

    config, method = options.solver, options.method
    each_solve = options.time_limit is TimeLimit.EACH_SOLVE
    whole = Budget.untimed(config.deterministic) if each_solve else budget or Budget.of(config, whole=True)
    fresh = new_budget or functools.partial(Budget.of, config)

    def solved(p: Problem, view: Budget, *, suggest: bool = True) -> Plan:
        return solve(p, config, method, budget=fresh() if each_solve else view, suggest=suggest)

    quiet = functools.partial(solved, suggest=False)
    choices: dict[int, tuple[Problem, Problem]] = {}

    def streaming_of(p: Problem) -> Problem:
        if id(p) not in choices:
            keep = options.stream_apply is StreamApply.KEEP_REFRESH
            choices[id(p)] = (p, with_streaming(p, options.whole_backward, keep_bounds=keep, budget=whole))
        return choices[id(p)][1]

    def reference(p: Problem) -> float:
        return step_timeline(streaming_of(p)).length

    def candidate(p: Problem, view: Budget, shares: float) -> Plan:
        """One distribution planned as forcing it would be, its refusal naming nothing; of the time left it takes half
        and an equal share of the other half among the `shares` still to plan (all of it left later ones short)."""
        part = view if shares == 1 else view.part((shares + 1) / (2 * shares))
        return solve_streamed(p, quiet, options.stream_apply, options.whole_backward, part, streaming_of(p))

    def placed(p: Problem) -> Plan:
        if options.strategy is Distributions.CHOSEN:
            off = options.stream_apply is StreamApply.OFF
            each, ref = (None, None) if off else (candidate, reference)
            own = fresh if each_solve else None  # each candidate in a budget of its own, as forcing it would be planned
            return solve_with_strategy(p, None, config, method, whole, each=each, reference=ref, own=own)
        given = p.with_strategy(options.strategy) if isinstance(options.strategy, Strategy) else p
        return solve_streamed(given, solved, options.stream_apply, whole_backward=options.whole_backward, budget=whole)

    def recomputing(p: Problem) -> Plan:
        return plan_recomputing(p, placed) if options.choose_recompute else placed(p)

    if options.overhead is Overhead.STRICT:
        return recomputing(problem)
    made, _ = least_overhead(lambda value: recomputing(replace(problem, max_overhead=value)))
    return made


SMALLEST_BLOCK = 256
"""The smallest block side tried: below it launch overhead dominates (the paper recommends 1024-8192)."""


def block_candidates(largest: int) -> list[int | None]:
    """The block sides tried, largest first: no blocking (None), then the powers of two from SMALLEST_BLOCK below
    `largest` (the longest side of any parameter)."""
    sides = []
    side = SMALLEST_BLOCK
    while side < largest:
        sides.append(side)
        side *= 2
    return [None, *reversed(sides)]


def block_label(max_dim: int | None) -> str:
    """A block side in words."""
    return "no blocking" if max_dim is None else f"{max_dim}"


@dataclass(frozen=True)
class BlockChoice:
    """The block side chosen (None: no blocking), its plan, why, and what each side tried came to."""

    max_dim: int | None
    plan: Plan
    reason: str
    tried: tuple[tuple[str, str], ...]


def _quick_refusal(problem: Problem) -> str | None:
    """Why `problem` cannot plan where a check cheaper than solving shows it (a decomposition longer than the longest
    step allowed, a budget below the least memory); None: only solving tells."""
    longest = (1 + problem.max_overhead) * step_timeline(problem).length
    task = max(
        ((p.decomp, f"{x.name} {p.part}") for x in problem.costs.layers for p in x.parts),
        default=(0.0, ""),
    )
    if task[0] > longest:
        return f"decomposing {task[1]} takes {task[0]:.3g} s, longer than a step ({longest:.3g} s)"
    budget = problem.memory_budget
    if budget is not None and min_memory_bytes(problem) > budget:
        return f"needs at least {format_bytes(min_memory_bytes(problem))} per device, over {format_bytes(budget)}"
    return None


def choose_block_size(
    problem_for: Callable[[int | None], Problem],
    candidates: Sequence[int | None],
    options: SearchOptions | None = None,
    budget: Budget | None = None,
) -> BlockChoice:
    """The LARGEST block side whose plan fits (larger blocks precondition better): each side, largest first, a
    candidate of one `plan` search (max_overhead strict) in one budget, each an equal part of what is left. When none
    fits, the side whose refusal names the least max_overhead is planned at it; PlanError when none plans even so."""
    options = replace(options or SearchOptions(), overhead=Overhead.STRICT)
    whole = budget or Budget.of(options.solver, whole=True)
    tried: list[tuple[str, str]] = []
    overheads: dict[int | None, float] = {}

    def planned(side: int | None, problem: Problem, left: int) -> Plan | str:
        """The side's plan in its part of the time left, or its refusal in words (its least max_overhead kept)."""
        try:
            return plan(problem, options, budget=whole.part(1 / left))
        except PlanError as e:
            if e.max_overhead is not None:  # one suggestion per knob (`with_suggestions`): the least found
                overheads[side] = e.max_overhead
            return str(e)

    for n, side in enumerate(candidates):
        problem = problem_for(side)
        made = _quick_refusal(problem) or planned(side, problem, len(candidates) - n)
        if isinstance(made, Plan):
            limits = f"max_overhead {problem.max_overhead:.3g}, refresh within {problem.max_period} steps"
            labels = [block_label(c) for c in candidates]
            reason = f"block side {block_label(side)}: the largest of {labels} whose plan fits ({limits})"
            log.info("max_preconditioner_dim=auto chose %s", reason)
            return BlockChoice(side, made, reason, (*tried, (block_label(side), "plans")))
        tried.append((block_label(side), made))
    for n, side in enumerate(candidates):  # no side fits: price those whose refusal named no max_overhead
        problem = problem_for(side)
        if side not in overheads and _quick_refusal(problem) is None:
            planned(side, problem, len(candidates) - n + 1)
    if not overheads:
        raise PlanError("no block side plans: " + "; ".join(f"{side}: {why}" for side, why in tried))
    side = min(overheads, key=lambda c: (overheads[c], candidates.index(c)))  # a tie: the larger side
    problem = problem_for(side)
    made = plan(replace(problem, max_overhead=overheads[side]), options, budget=whole)
    reason = (
        f"block side {block_label(side)}: no side fits with max_overhead {problem.max_overhead:.3g}; it needs "
        f"the least, {overheads[side]:.3g} (refresh within {problem.max_period} steps)"
    )
    log.info("max_preconditioner_dim=auto chose %s", reason)
    return BlockChoice(side, made, reason, tuple(tried))
