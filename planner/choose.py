"""The strategy search: which distribution strategy (planner/strategy.py) plans a problem best.

[Note: strategy search] With the strategy left to the planner, every KAISA strategy the stages' copies allow
(COMM-OPT, HYBRID with each grad-worker count that divides the copies, MEM-OPT) is planned in full by `solve`,
its layers dealt to columns by KAISA's greedy on their decomposition seconds, and so is one per-layer mix:
MEM-OPT on the layers that hold the larger half of the statistics bytes, COMM-OPT on the rest (the big layers'
decompositions are what a memory budget cannot afford on every copy, the small ones' broadcasts what the step
cannot afford). The plan with the shortest step, then the shortest refresh periods, then the least peak
memory wins (ties: the order above, least communication first). All candidates share one time limit
([Note: time limit] in planner/plan.py). A candidate that cannot meet the memory
budget or max_overhead drops out; when none plans, COMM-OPT's refusal (with its suggestions) is raised.
DP-KFAC is never chosen: its factors come from one replica's micro-batches, a different algorithm that only
the user may ask for. CP-SAT places the work of each candidate; it does not choose among them itself.
"""

from __future__ import annotations

import logging
from fractions import Fraction

from fxkfac.planner.errors import PlanError
from fxkfac.planner.plan import Method, Plan, TimeBox, solve
from fxkfac.planner.problem import Problem, SolverConfig, copies_of_stage
from fxkfac.planner.strategy import COMM_OPT, Strategy, StrategyKind

__all__ = ["candidate_strategies", "candidate_problems", "mixed", "solve_with_strategy", "strategy_of"]

log = logging.getLogger(__name__)


def candidate_strategies(problem: Problem) -> list[Strategy]:
    """COMM-OPT, then HYBRID for each grad-worker count between 1 and H that divides H (the copies of the
    stage held most often), then MEM-OPT; COMM-OPT alone when no stage has several copies."""
    H = max(len(copies_of_stage(problem, s)) for s in range(problem.num_stages))
    if H == 1:
        return [COMM_OPT]
    hybrids = [Strategy(StrategyKind.HYBRID, Fraction(g, H)) for g in range(H - 1, 1, -1) if H % g == 0]
    return [COMM_OPT, *hybrids, Strategy(StrategyKind.MEM_OPT)]


def mixed(problem: Problem) -> Problem | None:
    """MEM-OPT on the layers holding the larger half of the statistics bytes (largest first), COMM-OPT on the
    others; None when that is one strategy on every layer."""
    layers = sorted((x for stage in problem.costs.stages for x in stage.layers),
                    key=lambda x: (-x.factor_bytes, x.name))
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


def solve_with_strategy(problem: Problem, strategy: Strategy | None, config: SolverConfig = SolverConfig(),
                        method: Method | str = Method.CPSAT, box: TimeBox | None = None) -> Plan:
    """`solve` with every layer under `strategy`, or with the best of `candidate_problems` when it is None
    (see [Note: strategy search]), all within one time limit (`box`, or a new one): each candidate gets an
    equal share of the solver time left. When none plans, the first's refusal names what would."""
    box = box or TimeBox(config)
    if strategy is not None:
        return solve(problem.with_strategy(strategy), config, method, box=box)
    candidates = candidate_problems(problem)
    plans: list[Plan] = []
    for n, candidate in enumerate(candidates):
        if plans and box.over():
            log.info("no time left to plan distributions %s", [_words(c) for c in candidates[n:]])
            break
        try:
            plans.append(solve(candidate, config, method, box=box, shares=len(candidates) - n, suggest=False))
        except PlanError as e:
            log.info("distribution %s does not plan: %s", _words(candidate), e)
    if not plans:
        return solve(candidates[0], config, method, box=box)  # refused at once: it searches what would plan
    best = min(plans, key=lambda p: (p.metrics.step_time, sum(p.metrics.refresh_steps),
                                     max(p.metrics.peak_memory.values(), default=0)))
    log.info("distribution %s chosen among %s", strategy_of(best), [strategy_of(p) for p in plans])
    return best


def strategy_of(plan: Plan) -> str:
    """The plan's strategy in words: the one every layer follows, else how many layers follow each."""
    return _words(plan.problem)


def _words(problem: Problem) -> str:
    counts: dict[str, int] = {}
    for name in problem.costs.layer_names:
        key = str(problem.where(name).strategy)
        counts[key] = counts.get(key, 0) + 1
    if len(counts) == 1:
        return next(iter(counts))
    return ", ".join(f"{key} on {n} layers" for key, n in sorted(counts.items()))
