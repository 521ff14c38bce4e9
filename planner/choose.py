"""The strategy search: which distribution strategy (planner/strategy.py) plans a problem best.

[Note: strategy search] With the strategy left to the planner, every KAISA strategy the stages' copies allow
(COMM-OPT, HYBRID with each grad-worker count that divides the copies, MEM-OPT) is planned in full by `solve`,
its layers dealt to columns by KAISA's greedy on their decomposition seconds; the plan with the shortest step,
then the shortest refresh periods, then the least peak memory wins (ties: the order above, least communication
first). A strategy that cannot meet the memory budget or max_overhead drops out; when none plans, COMM-OPT's
refusal (with its suggestions) is raised. DP-KFAC is never chosen: its factors come from one replica's
micro-batches, a different algorithm that only the user may ask for. The search is per problem, not per
layer: each candidate is one strategy on every layer, and CP-SAT places the work of that distribution.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from fractions import Fraction

from fxkfac.planner.errors import PlanError
from fxkfac.planner.plan import Method, Plan, solve
from fxkfac.planner.problem import Problem, SolverConfig, copies_of_stage
from fxkfac.planner.strategy import COMM_OPT, Strategy, StrategyKind

__all__ = ["candidate_strategies", "solve_with_strategy", "strategy_of"]

log = logging.getLogger(__name__)


def candidate_strategies(problem: Problem) -> list[Strategy]:
    """COMM-OPT, then HYBRID for each grad-worker count between 1 and H that divides H (the copies of the
    stage held most often), then MEM-OPT; COMM-OPT alone when no stage has several copies."""
    H = max(len(copies_of_stage(problem, s)) for s in range(problem.num_stages))
    if H == 1:
        return [COMM_OPT]
    hybrids = [Strategy(StrategyKind.HYBRID, Fraction(g, H)) for g in range(H - 1, 1, -1) if H % g == 0]
    return [COMM_OPT, *hybrids, Strategy(StrategyKind.MEM_OPT)]


def solve_with_strategy(problem: Problem, strategy: Strategy | None, config: SolverConfig = SolverConfig(),
                        method: Method | str = Method.CPSAT) -> Plan:
    """`solve` with every layer under `strategy`, or with the best of `candidate_strategies` when it is None
    (see [Note: strategy search]); each candidate gets an equal share of the time limit."""
    if strategy is not None:
        return solve(problem.with_strategy(strategy), config, method)
    candidates = candidate_strategies(problem)
    share = replace(config, time_limit_s=config.time_limit_s / len(candidates))
    plans: list[Plan] = []
    refusal: PlanError | None = None
    for candidate in candidates:
        try:
            plans.append(solve(problem.with_strategy(candidate), share, method))
        except PlanError as e:
            log.info("strategy %s does not plan: %s", candidate, e)
            refusal = refusal or e
    if not plans:
        assert refusal is not None, "every candidate either plans or refuses"
        raise refusal
    best = min(plans, key=lambda p: (p.metrics.step_time, sum(p.metrics.refresh_steps),
                                     max(p.metrics.peak_memory.values(), default=0)))
    log.info("strategy %s chosen among %s", strategy_of(best), [strategy_of(p) for p in plans])
    return best


def strategy_of(plan: Plan) -> str:
    """The plan's strategy as text: the one every layer follows, else 'mixed' (COMM-OPT where none is named)."""
    named = {str(where.strategy) for _, where in plan.problem.distributions}
    if len(plan.problem.distributions) < len(plan.problem.costs.layer_names):
        named.add(str(COMM_OPT))
    return named.pop() if len(named) == 1 else "mixed"
