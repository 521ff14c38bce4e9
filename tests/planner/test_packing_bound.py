"""The packing lower bound on refresh periods: exact packings, never above a period a placement was found at
(exhaustive search, greedy), and above the fluid bound where whole tasks waste bubble time."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fxkfac.planner.plan.window import build_window
from fxkfac.planner.problem.errors import PlanError
from fxkfac.planner.problem.problem import Problem, SolverConfig, StageGroup, StepBarrier, stage_groups
from fxkfac.planner.problem.profiles import load_cost_table
from fxkfac.planner.problem.step_timeline import refresh_lower_bound
from fxkfac.planner.search.attempt import solve
from fxkfac.planner.search.greedy import Packer, idle_regions, packing_lower_bound
from fxkfac.planner.validate import validate
from tests.planner.brute_force import brute_feasible
from tests.planner.kfac_cases import EXHAUSTIVE, EXHAUSTIVE_ABOVE_GREEDY, EXHAUSTIVE_AT_BOUND, problem, problems

PER_LAYER = SolverConfig(time_limit_s=4.0, num_workers=2, stats_chunk=1)


def _most(sizes: list[int], length: int) -> int:
    """The longest sum of `sizes` (each any number of times) within `length`, by enumerating counts."""
    ranges = [range(length // s + 1) for s in sizes]
    return max(
        (t for counts in itertools.product(*ranges) if (t := sum(c * s for c, s in zip(counts, sizes))) <= length),
        default=0,
    )


@settings(max_examples=60, deadline=None, database=None)
@given(st.lists(st.integers(1, 30), min_size=1, max_size=3), st.integers(0, 90), st.integers(1, 7))
def test_packer_is_exact_on_whole_units_and_an_upper_bound_on_coarser_ones(
    sizes: list[int], length: int, unit: int
) -> None:
    assert Packer(sizes, 1).packable(length) == _most(sizes, length)
    coarse = Packer(sizes, unit).packable(length)
    assert _most(sizes, length) <= coarse <= length


def test_idle_regions_join_the_span_over_the_window_end() -> None:
    assert idle_regions([(2, 5), (7, 9)], 12) == [[(9, 12), (0, 2)], [(5, 7)]]
    assert idle_regions([(0, 5), (7, 9)], 12) == [[(5, 7)], [(9, 12)]]
    assert idle_regions([], 4) == [[(0, 4)]]


def _bound(p: Problem, group: StageGroup, fused: frozenset[str], config: SolverConfig) -> int:
    lower = refresh_lower_bound(p, group, fused)
    return packing_lower_bound(
        lambda k: build_window(p, group, k, fused, stats_chunk=1, resolution=config.time_resolution),
        lower,
        p.max_period,
    )


@pytest.mark.parametrize(EXHAUSTIVE, EXHAUSTIVE_AT_BOUND + EXHAUSTIVE_ABOVE_GREEDY)
def test_never_above_the_least_period_found_by_exhaustive_search(
    schedule: str, N: int, fwd: int, bwd: int, curv: int, inv: int
) -> None:
    p = problem(schedule, 2, N, fwd=fwd, bwd=bwd, curv=curv, inv=inv, prec=1, max_period=6)
    for group in stage_groups(p):
        (stage,) = group.stages
        least = next(k for k in range(1, p.max_period + 1) if brute_feasible(p, stage, k))
        assert refresh_lower_bound(p, group, frozenset()) <= _bound(p, group, frozenset(), PER_LAYER) <= least


@settings(max_examples=12, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_never_above_a_period_greedy_placed(p: Problem) -> None:
    p = Problem(p.schedule, p.D, p.N, p.costs, W=p.W, v=p.v, max_period=p.max_period, warm_start=p.warm_start)
    try:
        plan = solve(p, PER_LAYER, method="greedy")
    except PlanError:
        return
    assert validate(p, plan) == []
    fused = frozenset(n for n, t in plan.layers.items() if t.capture == "fused")
    for group in stage_groups(p):
        assert _bound(p, group, fused, PER_LAYER) <= plan.metrics.refresh_steps[group.stages[0]]


def test_whole_tasks_raise_the_paper_bert_base_chimera_bound_and_cpsat_meets_it_on_the_outer_stages() -> None:
    """BERT-Base Chimera D=4 on the paper's P100 profiles, inversions in 4 pieces, no world barrier: the fluid
    bound is 7 steps, but a device's bubbles (29.2 and 47.5 ms a step beside a 20.4 ms APPLY) hold at most
    74.2 ms of 12.8 ms statistics and 9.0 ms pieces a step, short of 7 steps' share; 8 steps are found."""
    costs = load_cost_table("paper:bert-base/p100", blocks_per_stage=3, n_stages=4, micro_batch_size=32)
    p = Problem("chimera", 4, 4, costs, decomp_pieces=4, barrier=StepBarrier.AGREEMENT_SET)
    outer = next(g for g in stage_groups(p) if 0 in g.stages)
    assert refresh_lower_bound(p, outer, frozenset()) == 7
    assert _bound(p, outer, frozenset(), PER_LAYER) == 8
    plan = solve(p, SolverConfig(time_limit_s=10.0, num_workers=2))
    assert validate(p, plan) == []
    assert plan.metrics.lower_bound_steps == (8, 8, 8, 8)
    assert plan.metrics.refresh_steps[0] == plan.metrics.refresh_steps[3] == 8


def test_a_max_period_below_the_packing_bound_is_refused_saying_whole_tasks_do_not_fit() -> None:
    """At max_period 7 the fluid bound (7) allows BERT-Base Chimera's outer stages, whole tasks (8) do not: the
    refusal says so instead of blaming the time limit, and names a setting that plans."""
    costs = load_cost_table("paper:bert-base/p100", blocks_per_stage=3, n_stages=4, micro_batch_size=32)
    p = Problem("chimera", 4, 4, costs, decomp_pieces=4, barrier=StepBarrier.AGREEMENT_SET, max_period=7)
    with pytest.raises(
        PlanError, match=r"stages \[\(0, 3\), \(1, 2\)\] is more than the idle time of 7 steps holds in whole"
    ) as refused:
        solve(p, SolverConfig(time_limit_s=5.0))
    assert "Solved with: max_overhead=" in str(refused.value)
