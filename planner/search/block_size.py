"""`max_preconditioner_dim="auto"`: the largest Shampoo/SOAP block side whose plan fits the pipeline's bubbles."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from fxkfac.planner.plan.plan import Plan
from fxkfac.planner.problem.errors import Knob, PlanError
from fxkfac.planner.problem.problem import Problem, SolverConfig, format_bytes
from fxkfac.planner.problem.step_timeline import min_memory_bytes, step_timeline
from fxkfac.planner.search.attempt import Method
from fxkfac.planner.search.budget import Budget
from fxkfac.planner.search.solve import solve

__all__ = ["SMALLEST_BLOCK", "BlockChoice", "block_candidates", "block_label", "choose_block_size"]

log = logging.getLogger(__name__)

SMALLEST_BLOCK = 256
"""The smallest block side tried: below it launch overhead dominates (the paper recommends 1024-8192)."""


def block_candidates(largest: int) -> list[int | None]:
    """The block sides tried, largest first: no blocking (None), then the powers of two from SMALLEST_BLOCK
    below `largest` (the longest side of any parameter: a block that long blocks nothing)."""
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
    """Why `problem` cannot plan, when a check cheaper than solving shows it: a decomposition longer than the
    longest step max_overhead allows (no task spans a step boundary), or a budget below the least memory any
    plan needs. None when only solving can tell."""
    longest = (1 + problem.max_overhead) * step_timeline(problem).length
    task = max(
        ((p.decomp, f"{x.name} {p.part}") for s in problem.costs.stages for x in s.layers for p in x.parts),
        default=(0.0, ""),
    )
    if task[0] > longest:
        return f"decomposing {task[1]} takes {task[0]:.3g} s, longer than a step ({longest:.3g} s)"
    budget = problem.memory_budget
    if budget is not None and min_memory_bytes(problem) > budget:
        return f"needs at least {format_bytes(min_memory_bytes(problem))} per device, over {format_bytes(budget)}"
    return None


def _least_overhead(error: PlanError) -> float | None:
    """The max_overhead alone that the planner's refusal says places the work, if it names one."""
    values = [s.changes[0][1] for s in error.suggestions if [k for k, _ in s.changes] == [Knob.MAX_OVERHEAD]]
    return float(min(values)) if values else None


def choose_block_size(
    problem_for: Callable[[int | None], Problem],
    candidates: Sequence[int | None],
    config: SolverConfig = SolverConfig(),
    method: Method | str = Method.CPSAT,
    budget: Budget | None = None,
) -> BlockChoice:
    """The LARGEST block side whose plan fits (every side a candidate of one search in `budget`, each with an equal
    share of what is left; without one, each solve in a budget of its own): `problem_for(side)` is the planning
    problem with that side's
    costs (its max_overhead and max_period, the refresh frequency, are what "fits" means: 0 is the bubbles
    alone, no step-time overhead beyond the plain pipeline's with preconditioning). Candidates are tried in
    the order given (largest first), each solved with `config`; the first plan found is chosen, since larger
    blocks precondition better (Shampoo's full-matrix statistics of a block) and every smaller one only
    costs less. When none fits, each candidate's refusal names the least max_overhead that places it
    (solved with an equal share of the time limit) and the side needing the least is planned at that overhead.
    PlanError when no side plans even so, naming what each came to."""
    tried: list[tuple[str, str]] = []
    overheads: dict[int | None, float] = {}
    for n, side in enumerate(candidates):
        problem = problem_for(side)
        refusal = _quick_refusal(problem)
        if refusal is None:
            try:
                plan = _solve(problem, config, method, budget, len(candidates) - n)
            except PlanError as e:
                refusal = str(e)
                found = _least_overhead(e)
                if found is not None:
                    overheads[side] = found
            else:
                reason = (
                    f"block side {block_label(side)}: the largest of {[block_label(c) for c in candidates]} "
                    f"whose plan fits (max_overhead {problem.max_overhead:.3g}, refresh within "
                    f"{problem.max_period} steps)"
                )
                log.info("max_preconditioner_dim=auto chose %s", reason)
                return BlockChoice(side, plan, reason, (*tried, (block_label(side), "plans")))
        tried.append((block_label(side), refusal))
    return _least_overhead_choice(problem_for, candidates, config, method, overheads, tried, budget)


def _solve(problem: Problem, config: SolverConfig, method: Method | str, budget: Budget | None, shares: int) -> Plan:
    """`solve` as one of `shares` candidates left in `budget`, or in a budget of its own."""
    if budget is None:
        return solve(problem, config, method)
    return solve(problem, config, method, budget=budget, shares=shares)


def _least_overhead_choice(
    problem_for: Callable[[int | None], Problem],
    candidates: Sequence[int | None],
    config: SolverConfig,
    method: Method | str,
    overheads: dict[int | None, float],
    tried: list[tuple[str, str]],
    budget: Budget | None,
) -> BlockChoice:
    """No side fits: the one whose refusal names the least max_overhead, planned at that overhead."""
    share = replace(config, time_limit_s=max(1.0, config.time_limit_s / len(candidates)))
    for n, side in enumerate(candidates):
        problem = problem_for(side)
        if side not in overheads and _quick_refusal(problem) is None:
            try:
                if budget is None:
                    solve(problem, share, method)
                else:
                    solve(problem, config, method, budget=budget, shares=len(candidates) - n + 1)
            except PlanError as e:
                found = _least_overhead(e)
                if found is not None:
                    overheads[side] = found
    if not overheads:
        raise PlanError("no block side plans: " + "; ".join(f"{side}: {why}" for side, why in tried))
    side = min(overheads, key=lambda c: (overheads[c], candidates.index(c)))  # a tie: the larger side
    problem = problem_for(side)
    plan = _solve(replace(problem, max_overhead=overheads[side]), config, method, budget, 1)
    reason = (
        f"block side {block_label(side)}: no side fits with max_overhead {problem.max_overhead:.3g}; it needs "
        f"the least, {overheads[side]:.3g} (refresh within {problem.max_period} steps)"
    )
    log.info("max_preconditioner_dim=auto chose %s", reason)
    return BlockChoice(side, plan, reason, tuple(tried))
