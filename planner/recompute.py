"""Activation checkpointing under a memory budget: which stages recompute their forward (`Problem.recompute`).

A stage that recomputes keeps only its boundary per micro-batch in flight and runs its forward again in its
backward (planner/memory.py, planner/step_timeline.py). `choose_recompute` takes the fewest seconds of step that
fit: every choice of stages is priced by the least memory any plan of it needs (`min_memory_bytes`) and by its
reference step (`step_timeline`); with few stages every subset is tried, else stages are added greedily, the one
that saves the most bytes per second it adds first.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import replace
from itertools import combinations

from fxkfac.planner.memory import min_memory_bytes
from fxkfac.planner.problem import Problem, format_bytes
from fxkfac.planner.step_timeline import step_timeline

__all__ = ["EXHAUSTIVE_STAGES", "choose_recompute", "recompute_price"]

log = logging.getLogger(__name__)

EXHAUSTIVE_STAGES = 8
"""Up to this many stages every subset is priced (256 step simulations at most); beyond, the greedy search."""


def recompute_price(problem: Problem, stages: Iterable[int]) -> tuple[int, float]:
    """(least bytes per device any plan needs, reference step seconds) of `problem` with `stages` recomputing."""
    candidate = replace(problem, recompute=tuple(sorted(set(stages))))
    return min_memory_bytes(candidate), step_timeline(candidate).length


def choose_recompute(problem: Problem) -> Problem:
    """`problem` with the stages that recompute chosen: none without a budget or where it fits without any,
    else the choice that fits with the shortest step (fewest stages on a tie); every stage when none fits, so
    that the planner's refusal names the least memory checkpointing reaches."""
    budget, S = problem.memory_budget, problem.num_stages
    if budget is None or min_memory_bytes(replace(problem, recompute=())) <= budget:
        return replace(problem, recompute=())
    if S <= EXHAUSTIVE_STAGES:
        priced = {c: recompute_price(problem, c) for n in range(1, S + 1) for c in combinations(range(S), n)}
        fitting = [(step, len(c), c) for c, (memory, step) in priced.items() if memory <= budget]
        chosen = min(fitting)[2] if fitting else tuple(range(S))
    else:
        chosen = _greedy(problem, budget)
    memory, step = recompute_price(problem, chosen)
    log.info(
        "activation checkpointing: stages %s recompute (least memory %s per device for a budget of %s, "
        "reference step %.4g s)",
        list(chosen),
        format_bytes(memory),
        format_bytes(budget),
        step,
    )
    return replace(problem, recompute=chosen)


def _greedy(problem: Problem, budget: int) -> tuple[int, ...]:
    """Stages added one at a time, each the one that saves the most bytes per second of step it adds (the most
    bytes when it adds none), until the choice fits (every stage when it never does)."""
    chosen: tuple[int, ...] = ()
    memory, step = recompute_price(problem, chosen)
    while memory > budget and len(chosen) < problem.num_stages:
        priced = {s: recompute_price(problem, (*chosen, s)) for s in range(problem.num_stages) if s not in chosen}

        def worth(s: int) -> tuple[bool, float]:
            saved, added = memory - priced[s][0], priced[s][1] - step
            return (added <= 0, saved if added <= 0 else saved / added)

        best = max(sorted(priced), key=worth)
        chosen = tuple(sorted((*chosen, best)))
        memory, step = priced[best]
    return chosen
