"""Which layers of the first stage to stream, and to which ranks (planner/problem/lowering.py): the choice that
shortens the reference step most without costing any refresh, and a plan that falls back to none where it cannot place.

A Muon stage with copies (W > 1, Chimera) never streams: its owner sends the Newton-Schulz input, which it makes of
the reduced gradient, but a streamed gradient leaves during the backward, before the copies' all-reduce, so the
runtime refuses such a plan (fxkfac/runtime/streaming.py); its copies share its matrices by MEM-OPT instead."""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from enum import StrEnum
from typing import Protocol

from fxkfac.planner.plan.plan import Plan, rank
from fxkfac.planner.problem.costs import LayerCost, PreconditionerKind
from fxkfac.planner.problem.errors import PlanError
from fxkfac.planner.problem.ir import Op, OpKind
from fxkfac.planner.problem.lowering import Streaming, can_stream, ready_fractions
from fxkfac.planner.problem.problem import Problem, SolverConfig, copies_of_stage, stage_groups
from fxkfac.planner.problem.step_timeline import StepTimeline, group_load, refresh_lower_bound, step_timeline
from fxkfac.planner.problem.strategy import LayerDistribution
from fxkfac.planner.search.budget import Budget

__all__ = [
    "StreamApply",
    "Solver",
    "with_streaming",
    "solve_streamed",
    "STREAMED_STAGE",
    "STREAMED_PART",
    "STREAM_CHOICE_PART",
    "HELPER_CANDIDATES",
]

log = logging.getLogger(__name__)


class StreamApply(StrEnum):
    """When the first stage's APPLY streams to idle ranks: never; where that costs no refresh (the plan refreshing
    as often as without it, plans ranking periods first); or wherever it shortens the step, refreshes or not (a
    shorter step shortens every other rank's bubbles too, so on Chimera it costs refreshes)."""

    OFF = "off"
    KEEP_REFRESH = "keep-refresh"
    SHORTEST_STEP = "shortest-step"


class Solver(Protocol):
    """A solve of one problem within `budget` (a part of the search's); `suggest` False where its refusal is only
    logged, so that no time goes to searching what would plan it (`planner.solve.solve`'s `suggest`)."""

    def __call__(self, problem: Problem, budget: Budget, /, *, suggest: bool = True) -> Plan: ...


STREAMED_PART = 0.5
"""Of the time left, the part the streamed try takes where the plan without streaming may follow: the rest, and
what the streamed try leaves, go to that one."""


STREAMED_STAGE = 0
"""The stage whose APPLY lies on the cycle every step repeats (GPipe, 1F1B): its last backward ends the step."""

HELPER_CANDIDATES = 4
"""How many ranks, those that end their step's work first, are tried as helpers: each alone, and the first m of
them together (m = 2 ..) sharing the layers. For Muon, whose large Newton-Schulz tasks all wait for the last
backward, also the first m of every rank idle at the step's end with all the layers dealt by `_balanced`."""


def _streamable(problem: Problem) -> list[str]:
    """The first stage's layers a helper may apply, in the order its backward makes their gradients final: every
    layer a helper may apply (`planner.streaming.can_stream`: K-FAC's APPLY, Shampoo's and
    SOAP's statistics fold and APPLY, Muon's Newton-Schulz) that every copy applies itself (COMM-OPT)."""
    layers = problem.costs.stages[STREAMED_STAGE].layers
    fractions = ready_fractions(problem.costs.stages[STREAMED_STAGE])
    ok = [
        x.name
        for x in layers
        if can_stream(problem.costs.family, x)
        and problem.where(x.name) == LayerDistribution()
        and _worth_a_helper(problem, x)
    ]
    return sorted(ok, key=lambda n: fractions[n])


def _worth_a_helper(problem: Problem, layer: LayerCost) -> bool:
    """Whether a Muon unit's APPLY outlasts its gradient's transfer to a helper: a matrix's Newton-Schulz (compute on
    m^2 n, bytes m n) does but for tiny ones, an AdamW parameter's elementwise step (embeddings, the head, 1-D
    parameters; planner/problem/analytic.py: passes at memory bandwidth) only on a link faster than a twelfth of it,
    so it stays with its owner. Only a bound: the step timeline, which prices both transfers, chooses among the rest.
    Every other family's layer: always (their choice as before)."""
    if problem.costs.family is not PreconditionerKind.MUON:
        return True
    send = Op(OpKind.SEND_LGRAD, STREAMED_STAGE, peer=STREAMED_STAGE + 1, layer=layer.name)
    return layer.prec > problem.costs.collective_seconds(send, 2)


def _helpers(problem: Problem) -> list[int]:
    """Every rank but the streamed stage's copies, those that end their step's F/B and per-step work first (they idle
    longest before the step ends) first, the lowest first on a tie."""
    step = step_timeline(problem)
    owners = copies_of_stage(problem, STREAMED_STAGE)
    ends = {
        d: max((end for op, _, end in step.ops[d] if op.kind is not OpKind.OPT_STEP), default=0.0)
        for d in problem.devices
        if d not in owners
    }
    return sorted(ends, key=lambda d: (ends[d], d))


def _helper_sets(helpers: list[int]) -> list[tuple[int, ...]]:
    """The helper sets tried: each candidate alone, then the first m candidates together (m = 2 ..)."""
    return [(h,) for h in helpers] + [tuple(helpers[:m]) for m in range(2, len(helpers) + 1)]


def _assign(layers: list[str], helpers: tuple[int, ...]) -> tuple[int, ...]:
    """A helper for each of `layers` (in the order their gradients become final): round robin from the last, so the
    layers the backward finishes last, whose APPLYs end the step, run side by side on different helpers."""
    m = len(helpers)
    return tuple(helpers[(len(layers) - 1 - i) % m] for i in range(len(layers)))


def _balanced(problem: Problem, names: list[str], helpers: tuple[int, ...]) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The layers streamed and their helpers when every APPLY is dealt, longest first, to whichever of the owner and
    `helpers` has the least APPLY time so far (the owner's share stays with it): where the gradients come at once
    (compiled stages, Muon's large Newton-Schulz tasks) the APPLYs then end together rather than in a row."""
    seconds = {n: problem.costs.layer(n).prec for n in names}
    load = {rank: 0.0 for rank in (-1, *helpers)}  # -1: the owner
    dealt: dict[str, int] = {}
    for n in sorted(names, key=lambda n: (-seconds[n], names.index(n))):
        rank = min(load, key=lambda r: (load[r], r))
        dealt[n], load[rank] = rank, load[rank] + seconds[n]
    streamed = tuple(n for n in names if dealt[n] >= 0)
    return streamed, tuple(dealt[n] for n in streamed)


def _helper_load(problem: Problem) -> float:
    """The largest share of its bubbles a helper's stage group needs for one refresh per step (inf without
    bubble)."""
    assert problem.streaming is not None, "only a streaming problem has helpers"
    loads = []
    for helper in problem.streaming.ranks:
        group = next(g for g in stage_groups(problem) if helper in g.devices)
        work, bubble = group_load(problem, group)
        loads.append(work / bubble if bubble > 0 else math.inf)
    return max(loads)


def with_streaming(
    problem: Problem, whole_backward: bool = False, keep_bounds: bool = True, budget: Budget | None = None
) -> Problem:
    """`problem` with the first stage's APPLY streamed, for the helpers (`_helper_sets`, the layers shared by
    `_assign`, or for Muon all dealt with the owner's by `_balanced`) and the prefix of its layers (in the order their
    gradients become final) that give the shortest reference step without raising any stage group's least refresh
    period (any, without `keep_bounds`), the lowest largest helper load and then the fewest helpers among equals;
    unchanged where nothing does, where every rank holds the stage, or where it already streams. `whole_backward`:
    the stages run compiled, each backward making every gradient at its end (`Streaming.whole_backward`): the
    helper then only applies its layers beside the owner. Each candidate's simulations
    are charged to `budget`, and the search keeps the best found so far once it has spent STREAM_CHOICE_PART of the
    whole time limit (of the limit, not of what is left: a candidate distribution of the choice streams as it would
    forced, `planner.plan`)."""
    if problem.streaming is not None or len(copies_of_stage(problem, STREAMED_STAGE)) == len(problem.devices):
        return problem
    if problem.costs.family is PreconditionerKind.MUON and len(copies_of_stage(problem, STREAMED_STAGE)) > 1:
        return problem  # the runtime streams a Muon stage with one copy only (module doc)
    names = _streamable(problem)
    if not names:
        return problem
    bounds, length = _bounds(problem) if keep_bounds else None, step_timeline(problem).length
    best: tuple[float, float, int] | None = None
    chosen = problem
    stop = None if budget is None else budget.now() + budget.limit * STREAM_CHOICE_PART
    ranked, dealt = _helpers(problem), problem.costs.family is PreconditionerKind.MUON
    sets = [(h, True) for h in _helper_sets(ranked[:HELPER_CANDIDATES])]
    # Muon's matrices dealt over every idle rank first: the streaming choice may stop at its part of the time limit
    dealt_sets = [(tuple(ranked[:m]), False) for m in range(len(ranked), HELPER_CANDIDATES, -1)] if dealt else []
    sets = dealt_sets + sets
    for helpers, prefixes in sets:
        tries = [(tuple(names[:n]), _assign(names[:n], helpers)) for n in range(len(helpers), len(names) + 1)]
        tries = tries if prefixes else []
        tries += [_balanced(problem, names, helpers)] if dealt and len(helpers) > 1 else []
        for layers, assigned in tries:
            if not layers:
                continue
            if budget is not None and stop is not None and best is not None and budget.now() >= stop:
                log.info("streaming choice: its part of the time limit is spent; the best found so far is kept")
                return chosen
            streaming = Streaming(STREAMED_STAGE, assigned, layers, whole_backward)
            candidate = replace(problem, streaming=streaming)
            step = step_timeline(candidate)
            if budget is not None:
                budget.charge_simulated(_simulated_ops(step) * (1 + len(stage_groups(candidate)) * bool(bounds)))
            shorter = step.length
            if shorter >= length * (1 - 1e-9) or (bounds is not None and _bounds(candidate) != bounds):
                continue
            key = (round(shorter, 12), _helper_load(candidate), len(helpers))
            if best is None or key < best:
                best, chosen = key, candidate
    return chosen


def _simulated_ops(step: StepTimeline) -> int:
    """The ops of one simulated step, what its simulation is charged by (`Budget.charge_simulated`)."""
    return sum(len(ops) for ops in step.ops.values())


STREAM_CHOICE_PART = 0.05
"""Of the whole time limit, the most the streaming choice's simulations take before it keeps the best found so far."""


def solve_streamed(
    problem: Problem,
    solve: Solver,
    policy: StreamApply = StreamApply.KEEP_REFRESH,
    whole_backward: bool = False,
    budget: Budget | None = None,
    streamed: Problem | None = None,
) -> Plan:
    """`solve` the problem with streaming where `with_streaming` finds some (`policy` not OFF), else as given.
    KEEP_REFRESH: a streamed plan whose refresh periods are the unstreamed problem's lower bounds is kept (no plan
    without streaming refreshes more often, nor steps faster); otherwise the problem is solved without streaming too
    and the better plan by `planner.plan.rank` (periods first) kept. SHORTEST_STEP: the streamed plan is kept.
    Without a streamed plan, the unstreamed one; each choice is logged. `whole_backward`: as `with_streaming`'s.
    Only the unstreamed problem's refusal is raised: the other solves search no suggestions (`Solver`). Everything
    runs in `budget` (a new one of the default SolverConfig when None): the streamed try in STREAMED_PART of it
    where the unstreamed may follow, the unstreamed one in the rest. `streamed`: the streaming choice, where made
    already (`with_streaming` of `problem`)."""
    budget = budget or Budget.of(SolverConfig())
    if policy is StreamApply.OFF:
        return solve(problem, budget)
    if streamed is None:
        streamed = with_streaming(problem, whole_backward, policy is StreamApply.KEEP_REFRESH, budget)
    if streamed is problem:
        return solve(problem, budget)
    assert streamed.streaming is not None, "with_streaming returns a streaming problem or the same one"
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
    """Each stage's least refresh period: its stage group's `refresh_lower_bound`. Streaming shortens the step, which
    shortens every bubble, and adds the helper's APPLYs to its own; a choice that raises any bound would trade
    refreshes, which plans value first, for step time."""
    out = [0] * problem.num_stages
    for group in stage_groups(problem):
        for s in group.stages:
            out[s] = refresh_lower_bound(problem, group)
    return tuple(out)
