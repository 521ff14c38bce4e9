"""Activation checkpointing under a memory budget: which stages recompute their forward (`Problem.recompute`).

A stage that recomputes keeps only its boundary per micro-batch in flight and runs its forward again in its
backward (planner/problem/step_timeline.py). Each choice of stages is priced by the
least memory any plan of it needs (`min_memory_bytes`: every layer's curvature fused) and by its reference step
(`step_timeline`). `recompute_choices` lists the choices that fit, the shortest step first (none recomputing first where
that fits): with few stages every subset, else the stages added greedily, the one that saves the most bytes per second
it adds first. `plan_recomputing` plans the first that the planner places: a choice that fits only with fused curvature
may need more step than max_overhead allows, where one more stage recomputing leaves room for deferred captures.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import replace
from itertools import combinations
from typing import TypeVar

from fxkfac.planner.problem.errors import PlanError
from fxkfac.planner.problem.problem import Problem, format_bytes
from fxkfac.planner.problem.step_timeline import min_memory_bytes, step_timeline

__all__ = [
    "EXHAUSTIVE_STAGES",
    "MAX_TRIES",
    "choose_recompute",
    "plan_recomputing",
    "recompute_choices",
    "recompute_price",
]

log = logging.getLogger(__name__)

EXHAUSTIVE_STAGES = 8
"""Up to this many stages every subset is priced (256 step simulations at most); beyond, the greedy search."""
MAX_TRIES = 4
"""`plan_recomputing` solves at most this many choices (each a full solve) before it gives up."""

T = TypeVar("T")


def recompute_price(problem: Problem, stages: Iterable[int]) -> tuple[int, float]:
    """(least bytes per device any plan needs, reference step seconds) of `problem` with `stages` recomputing."""
    candidate = replace(problem, recompute=tuple(sorted(set(stages))))
    return min_memory_bytes(candidate), step_timeline(candidate).length


def recompute_choices(problem: Problem) -> list[tuple[int, ...]]:
    """The choices of recomputing stages that fit `problem`'s budget, the shortest reference step first (fewest
    stages on a tie; so none first where that fits): [()] without a budget; every stage alone when no choice fits,
    so that the planner's refusal names the least memory checkpointing reaches."""
    budget, S = problem.memory_budget, problem.num_stages
    if budget is None:
        return [()]
    if S <= EXHAUSTIVE_STAGES:
        candidates = [c for n in range(S + 1) for c in combinations(range(S), n)]
    else:
        candidates = [(), *_greedy(problem)]
    priced = {c: recompute_price(problem, c) for c in candidates}
    fitting = sorted((step, len(c), c) for c, (memory, step) in priced.items() if memory <= budget)
    return [c for _, _, c in fitting] or [tuple(range(S))]


def choose_recompute(problem: Problem) -> Problem:
    """`problem` with the first of its `recompute_choices` recomputing."""
    return replace(problem, recompute=recompute_choices(problem)[0])


def plan_recomputing(problem: Problem, solve: Callable[[Problem], T]) -> T:
    """`solve` of `problem` with the first of its `recompute_choices` (at most `MAX_TRIES`) the planner places;
    where none is placed, the first choice's refusal."""
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
    """The stages added one at a time, each the one that saves the most bytes per second of step it adds (the most
    bytes when it adds none): every choice on the way, the first (one stage) first."""
    chosen: tuple[int, ...] = ()
    memory, step = recompute_price(problem, chosen)
    out = []
    while len(chosen) < problem.num_stages:
        priced = {s: recompute_price(problem, (*chosen, s)) for s in range(problem.num_stages) if s not in chosen}
        worth = {s: _worth(memory - m, t - step) for s, (m, t) in priced.items()}
        best = max(sorted(worth), key=worth.__getitem__)
        chosen = tuple(sorted((*chosen, best)))
        memory, step = priced[best]
        out.append(chosen)
    return out


def _worth(saved: int, added: float) -> tuple[bool, float]:
    """How a stage ranks by the bytes it saves and the step seconds it adds: any that adds none first (by bytes),
    then by bytes per added second."""
    return (added <= 0, saved if added <= 0 else saved / added)
