"""`planner.plan`, the one entry point, composes the pieces as their direct calls do: one problem gives the same
plan through it as through `solve`/`solve_with_strategy`, and the plan passes the independent validator."""

from __future__ import annotations

import pytest

from fxkfac.planner import (
    Budget,
    ConfigError,
    Distributions,
    Overhead,
    Problem,
    SearchOptions,
    SolverConfig,
    Strategy,
    StrategyKind,
    StreamApply,
    plan,
    validate,
)
from fxkfac.planner.search.attempt import solve
from fxkfac.planner.search.budget import DTIME_PER_SECOND
from fxkfac.planner.search.choose import solve_with_strategy
from fxkfac.planner.search.plan_search import choose_block_size
from tests.planner.kfac_cases import problem

CONFIG = SolverConfig(time_limit_s=1.0)


def test_a_forced_strategy_plans_as_solve_does_on_the_problem_under_it() -> None:
    p = problem("1f1b", 2, 4, W=2, inv=1.0)
    mem = Strategy(StrategyKind.MEM_OPT)
    made = plan(p, SearchOptions(CONFIG, strategy=mem, stream_apply=StreamApply.OFF))
    assert made == solve(p.with_strategy(mem), CONFIG)
    assert {made.problem.where(x.name).strategy for s in p.costs.stages for x in s.layers} == {mem}
    assert validate(made.problem, made) == []


def test_the_chosen_distributions_plan_as_the_strategy_search_does() -> None:
    p = problem("gpipe", 2, 4, W=2, inv=1.0)
    made = plan(p, SearchOptions(CONFIG, strategy=Distributions.CHOSEN, stream_apply=StreamApply.OFF))
    assert made == solve_with_strategy(p, None, CONFIG)
    assert validate(made.problem, made) == []


def test_one_budget_holds_the_whole_search() -> None:
    """The budget a caller passes is the one every solve spends: what it spent is the search's time."""
    budget = Budget.of(CONFIG)
    plan(problem("1f1b", 2, 4, W=2, inv=1.0), SearchOptions(CONFIG), budget=budget)
    assert 0 < budget.tally.spent <= budget.end + budget.overtime


def test_the_least_overhead_rule_starts_from_the_bubbles_alone() -> None:
    with pytest.raises(ConfigError, match="Overhead.STRICT"):
        plan(problem("1f1b", 2, 4, max_overhead=0.1), SearchOptions(CONFIG, overhead=Overhead.LEAST))


def test_gpt2_on_a100s_plans_at_the_cli_defaults_with_the_least_overhead() -> None:
    """`fxkfac plan gpt2 --stages 4 --microbatches 8 --schedule 1f1b --hardware a100` (issue 36): the bubbles alone
    cannot hold the K-FAC work within the card's 80 GiB (the kept statistics need fusing, which max_overhead 0 does
    not allow), so the default rule plans at the least max_overhead the refusal found, within the device's memory.
    Refused before: first-fit was charged 1e-5 deterministic seconds a task, 8x its time, and the refusal's search
    ran out of the 10 s limit in 5 s. The deterministic budget makes this the same plan on any load."""
    from fxkfac.planner.problem.analytic import analytic_cost_table
    from fxkfac.planner.problem.hardware import hardware

    device = hardware("a100").memory_bytes
    costs = analytic_cost_table("gpt2", 4, 32, None, "a100")
    search = SearchOptions(SolverConfig(time_limit_s=10.0), overhead=Overhead.LEAST, whole_backward=True)
    made = plan(Problem("1f1b", 4, 8, costs, memory_budget=device), search)
    m = made.metrics
    assert 0 < made.problem.max_overhead < 0.01
    assert max(m.peak_memory.values()) <= device
    assert m.step_time <= m.step_time_reference * (1 + made.problem.max_overhead) * (1 + 1e-9)
    assert validate(made.problem, made) == []


def test_the_block_size_search_plans_each_side_by_the_whole_search_in_one_budget() -> None:
    """Each block side is a candidate of the one `plan` search it is given (here a forced MEM-OPT, which `solve` of
    the side's own problem would not place) in one budget: the side too long for any step is refused without
    solving, the next plans, and what both spent is the budget's."""
    mem = Strategy(StrategyKind.MEM_OPT)
    sides = {None: problem("1f1b", 2, 4, W=2, inv=100.0), 256: problem("1f1b", 2, 4, W=2, inv=1.0)}
    budget = Budget.of(CONFIG, whole=True)
    options = SearchOptions(CONFIG, strategy=mem, stream_apply=StreamApply.OFF)
    choice = choose_block_size(sides.__getitem__, [None, 256], options, budget)
    assert choice.max_dim == 256 and choice.tried[0][0] == "no blocking" and "longer than a step" in choice.tried[0][1]
    assert {choice.plan.problem.where(x.name).strategy for s in sides[256].costs.stages for x in s.layers} == {mem}
    assert validate(choice.plan.problem, choice.plan) == []
    assert 0 < budget.tally.spent <= budget.end + budget.overtime


def test_a_whole_search_on_the_wall_clock_converts_at_the_rate_cpsat_ran() -> None:
    """The wall-clock mode of a whole search (`fxkfac plan --nondeterministic`) is calibrated: each CP-SAT call gets the
    deterministic time its share is worth at the rate measured so far (DTIME_PER_SECOND before) and advances the clock
    by what it spent at that rate; the deterministic mode converts at DTIME_PER_SECOND always, and a budget of one
    solve on the wall clock stays in wall seconds."""
    calibrated = Budget.of(SolverConfig(time_limit_s=10.0, deterministic=False), whole=True)
    plain = Budget.of(SolverConfig(time_limit_s=10.0), whole=True)
    assert calibrated.calibrated and calibrated.deterministic and not plain.calibrated
    assert not Budget.of(SolverConfig(time_limit_s=10.0, deterministic=False)).deterministic
    for b in (calibrated, plain):
        assert b.solver_limit(0.01) == 0.01
        b.charge(0.3, wall=1.0)  # CP-SAT's first call: 0.3 deterministic s in 1 wall s (a fast machine)
    assert plain.now() == plain.tally.spent == 0.3 and plain.solver_limit(0.01) == 0.01
    assert DTIME_PER_SECOND < calibrated.rate() <= 0.3 and 0.01 < calibrated.solver_limit(0.01) <= 0.03
    assert calibrated.now() < 0.3 and calibrated.tally.spent == 0.3


def test_a_whole_search_on_the_wall_clock_plans_what_the_deterministic_one_proves() -> None:
    p = problem("1f1b", 4, 4, layers=2)
    deterministic = plan(p, SearchOptions(CONFIG))
    wall = plan(p, SearchOptions(SolverConfig(time_limit_s=1.0, deterministic=False)))
    assert validate(wall.problem, wall) == []
    assert deterministic.metrics.solver.status == "OPTIMAL"
    assert wall.metrics.refresh_steps == deterministic.metrics.refresh_steps
