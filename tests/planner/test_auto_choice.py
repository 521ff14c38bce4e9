"""The planner's own choice of distributions (`solve_with_strategy(problem, None)`) against forcing each candidate
(issue 38): never worse by the planner's own ranking (`planner.search.choose.best`), at the same time limit, and a lower
bound that counts the collectives the forced searches count."""

from __future__ import annotations

from pathlib import Path

from hypothesis import HealthCheck, Phase, given, settings

from fxkfac.planner import Distributions, Method, Overhead, SearchOptions, StreamApply, plan
from fxkfac.planner.plan.plan import Plan, rank
from fxkfac.planner.problem.costs import CostTable
from fxkfac.planner.problem.errors import PlanError
from fxkfac.planner.problem.problem import Problem, SolverConfig
from fxkfac.planner.problem.strategy import COMM_OPT, Strategy, StrategyKind
from fxkfac.planner.search.attempt import solve
from fxkfac.planner.search.choose import best, candidate_strategies, solve_with_strategy, strategy_of
from fxkfac.planner.validate import validate
from tests.planner.kfac_cases import problems

SNIPPET = Path(__file__).resolve().parents[1] / "data" / "readme_snippet_2x2_costs.json"
"""The README snippet's profiled costs: TinyBert, 1F1B D=2 N=4 W=2 on the cpu (issue 38)."""


def _snippet() -> Problem:
    """The snippet's problem as `fxkfac plan ... --costs` makes it (the cpu's 16 GiB budget), without streaming."""
    return Problem("1f1b", 2, 4, CostTable.from_json(SNIPPET.read_text()), W=2, memory_budget=16 * 2**30)


def _no_worse(chosen: Plan, forced: Plan) -> bool:
    """Whether `best` of the two, the planner's own ranking, ranks `chosen` first in what the searches minimize:
    refresh periods, then step time (a tie counts as first). Peak memory, the ranking's next key, no search
    minimizes: two placements of one distribution differ in it by where the search stopped."""
    return rank(best([chosen, forced]))[:2] == rank(chosen)[:2]


def test_the_readme_snippet_plans_no_worse_than_forcing_a_strategy_and_better_than_first_fit() -> None:
    """Before: auto kept first-fit's 11 30 (bound 3 5, GREEDY) where forced COMM-OPT reached 11 25 and MEM-OPT, at a
    longer step, 11 20. The candidate of least reference step is now planned first as forcing it would be."""
    problem, config = _snippet(), SolverConfig(time_limit_s=5.0)
    chosen = solve_with_strategy(problem, None, config)
    assert validate(chosen.problem, chosen) == []
    comm = solve(problem.with_strategy(COMM_OPT), config)
    mem = solve(problem.with_strategy(Strategy(StrategyKind.MEM_OPT)), config)
    assert _no_worse(chosen, comm) and _no_worse(chosen, mem)
    m = chosen.metrics
    assert m.solver.status != "GREEDY" and sum(m.refresh_steps) < sum(k for k in m.greedy_refresh_steps if k)
    # the bound counts the statistics' all-reduces (70% of the refresh's device time): it read 3 5 without them
    assert all(b <= k for b, k in zip(m.lower_bound_steps, m.refresh_steps, strict=True))
    assert m.lower_bound_steps == comm.metrics.lower_bound_steps and m.lower_bound_steps[1] >= 14


def test_first_fit_alone_shows_the_bound_with_the_collectives() -> None:
    """The greedy method proves nothing: its bound is the whole-task packing bound, which counts each collective on
    every device it holds (9 14 here, what CP-SAT proves in 10 s; 3 5 without the all-reduces)."""
    plan = solve(_snippet(), SolverConfig(time_limit_s=1.0), method="greedy")
    assert plan.metrics.solver.status == "GREEDY"
    assert plan.metrics.lower_bound_steps == (9, 14)


@settings(
    max_examples=4,
    deadline=None,
    database=None,
    phases=[Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(problems().filter(lambda p: p.W >= 2 and p.max_overhead == 0))
def test_random_choices_are_no_worse_than_any_forced_candidate(problem: Problem) -> None:
    """At max_overhead 0, the default, fresh draws every run. Each candidate is planned in the budget forcing it
    gets (`solve_with_strategy` without a budget): sharing one, a time-bound candidate placed worse than forced
    (chimera D=4 N=8 W=2: MEM-OPT 1 3 3 1 where forced HYBRID 1/2 made 1 2 2 1; interleaved D=4 N=8 W=2: MEM-OPT
    10 where forced 8)."""
    config = SolverConfig(time_limit_s=1.0)
    forced = []
    for strategy in candidate_strategies(problem):
        try:
            forced.append(solve_with_strategy(problem, strategy, config))
        except PlanError:
            continue
    try:
        chosen = solve_with_strategy(problem, None, config)
    except PlanError:
        assert not forced, "a forced candidate plans where the choice refuses"
        return
    assert validate(chosen.problem, chosen) == []
    m = chosen.metrics
    assert all(b <= k for b, k in zip(m.lower_bound_steps, m.refresh_steps, strict=True))
    for made in forced:
        assert _no_worse(chosen, made), (strategy_of(chosen), rank(chosen), strategy_of(made), rank(made))
        if made.problem.distributions == chosen.problem.distributions:  # the bound counts what the forced one counts
            assert m.lower_bound_steps == made.metrics.lower_bound_steps


def _searched(
    strategy: Strategy | Distributions, method: Method = Method.CPSAT, limit: float = 4.0, least: bool = True
) -> SearchOptions:
    """`fxkfac plan`'s search (streaming where it keeps the refresh, compiled stages, the least max_overhead unless
    not `least`) with `strategy`, within `limit` for the whole search."""
    return SearchOptions(
        SolverConfig(time_limit_s=limit),
        method,
        strategy=strategy,
        stream_apply=StreamApply.KEEP_REFRESH,
        whole_backward=True,
        overhead=Overhead.LEAST if least else Overhead.STRICT,
    )


def test_the_snippets_command_chooses_the_plan_of_the_best_forced_strategy() -> None:
    """`fxkfac plan bert-base --stages 2 --microbatches 4 --dp 2 --schedule 1f1b --costs <the snippet's>`, with and
    without --strategy, through `planner.plan`: each candidate is planned as forcing it would be (streaming
    included), so the choice is the forced plan that `best` ranks first. Before: auto 11 23 (21.05 ms), comm-opt
    11 23 (20.86 ms): the choice's streamed try had shared its time among three candidates. Its bound is its own
    distribution's, as the forced run shows it. The first candidate (least reference step) gets all the time left, as
    forcing it would; a mixed candidate planned after it can rank first (its step is shorter at max_overhead 0)."""
    chosen = plan(_snippet(), _searched(Distributions.CHOSEN))
    forced = [plan(_snippet(), _searched(s)) for s in candidate_strategies(_snippet())]
    assert validate(chosen.problem, chosen) == []
    assert all(_no_worse(chosen, f) for f in forced), [(strategy_of(p), rank(p)) for p in (chosen, *forced)]
    same = [f for f in forced if strategy_of(f) == strategy_of(chosen)]  # none when a mixed candidate ranks first
    assert all(rank(f)[:2] == rank(chosen)[:2] for f in same)
    assert all(chosen.metrics.lower_bound_steps == f.metrics.lower_bound_steps for f in same)


@settings(
    max_examples=8,
    deadline=None,
    database=None,
    phases=[Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(problems().filter(lambda p: p.W >= 2))
def test_the_whole_search_chooses_no_worse_than_any_forced_candidate(problem: Problem) -> None:
    """Through `planner.plan`, first-fit (untimed, so every candidate that can win is planned whatever the budget
    left): the choice is no worse than forcing any candidate, at any max_overhead, streaming included. Not validated
    here: a streamed interleaved plan may claim a peak below the validator's, forced as chosen, before this change
    too (planner/problem/lowering.py's accounting)."""
    least, forced = problem.max_overhead == 0, []
    for strategy in candidate_strategies(problem):
        try:
            forced.append(plan(problem, _searched(strategy, Method.GREEDY, 1.0, least)))
        except PlanError:
            continue
    try:
        chosen = plan(problem, _searched(Distributions.CHOSEN, Method.GREEDY, 1.0, least))
    except PlanError:
        assert not forced, "a forced candidate plans where the choice refuses"
        return
    for made in forced:
        assert _no_worse(chosen, made), (strategy_of(chosen), rank(chosen), strategy_of(made), rank(made))
