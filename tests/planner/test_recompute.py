"""Activation checkpointing in the planner: a recomputing stage's backward runs its forward again, its activations
in flight shrink to its boundary, and under a budget the planner chooses the stages that fit with the least step."""

from __future__ import annotations

import json
from dataclasses import replace
from itertools import combinations

import pytest

from fxkfac.planner.problem.costs import CostTable, LayerCost, StageCost
from fxkfac.planner.problem.errors import PlanError
from fxkfac.planner.problem.ir import OpKind
from fxkfac.planner.problem.problem import Problem, SolverConfig
from fxkfac.planner.problem.step_timeline import activation_peak, min_memory_bytes, static_bytes, step_timeline
from fxkfac.planner.search import plan_search
from fxkfac.planner.search.attempt import solve
from fxkfac.planner.search.plan_search import choose_recompute, plan_recomputing, recompute_choices, recompute_price
from fxkfac.planner.validate import check_plan
from fxkfac.planner.validate.plan_file import load_plan

MIB = 1 << 20
ACT, BOUNDARY = 64 * MIB, MIB
FWD = (1e-3, 3e-3)
"""Stage 1's forward is three times stage 0's: recomputing it costs more."""


def _costs(stages: int = 2) -> CostTable:
    """Stages with large activations and a small boundary, each with two K-FAC layers that fit the bubbles."""
    out = []
    for s in range(stages):
        layers = tuple(
            LayerCost.kfac(f"s{s}.l{i}", 2e-5, 2e-5, 1e-4, 1e-4, 1e-5, 4096, 4096, 16384, 16384) for i in range(2)
        )
        fwd = FWD[s % 2]
        out.append(StageCost(fwd, 2 * fwd, 8 * MIB, ACT, layers, boundary_bytes=BOUNDARY))
    return CostTable(tuple(out), 4, "synthetic:recompute", "cpu")


def _problem(schedule: str = "1f1b", N: int = 4, budget: int | None = None) -> Problem:
    return Problem(schedule, 2, N, _costs(), memory_budget=budget)


CONFIG = SolverConfig(time_limit_s=2.0)


def test_backward_of_a_recomputing_stage_lasts_its_forward_longer() -> None:
    plain, again = _problem(), replace(_problem(), recompute=(1,))
    for problem, extra in ((plain, 0.0), (again, FWD[1])):
        for op, start, end in step_timeline(problem).ops[1]:
            if op.kind is OpKind.BWD:
                assert end - start == pytest.approx(2 * FWD[1] + extra)
    assert step_timeline(again).length > step_timeline(plain).length


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_activation_peak_drops_to_the_boundary_of_micro_batches_in_flight(schedule: str) -> None:
    """Rank 0 holds stage 0: N micro-batches in flight under GPipe, D=2 under 1F1B; recomputing, it holds their
    boundaries plus one micro-batch's activations while that one's backward runs."""
    N = 4
    in_flight = N if schedule == "gpipe" else 2
    plain, again = _problem(schedule, N), replace(_problem(schedule, N), recompute=(0,))
    assert activation_peak(plain, 0) == in_flight * ACT
    assert activation_peak(again, 0) == in_flight * BOUNDARY + ACT
    assert activation_peak(again, 1) == activation_peak(plain, 1)  # stage 1 keeps its activations


def test_a_budget_refused_without_checkpointing_plans_with_it() -> None:
    free = _problem()
    need = min_memory_bytes(free)
    budget = need - ACT // 2  # rank 0 must drop stage 0's activations; rank 1 (one in flight) fits
    refused = replace(free, memory_budget=budget)
    with pytest.raises(PlanError, match="memory"):
        solve(refused, CONFIG)
    plan = plan_recomputing(refused, lambda p: solve(p, CONFIG))
    check_plan(plan.problem, plan)
    assert max(plan.metrics.peak_memory.values()) <= budget
    assert plan.problem.recompute == (0,)
    unconstrained = solve(free, CONFIG)
    assert plan.metrics.step_time_baseline > unconstrained.metrics.step_time_baseline  # B lasts one F longer


@pytest.mark.parametrize(("schedule", "want"), [("1f1b", (0,)), ("gpipe", (0, 1))])
def test_the_choice_fits_with_the_least_step(schedule: str, want: tuple[int, ...]) -> None:
    """Against every subset: the chosen stages fit, and no fitting subset has a shorter reference step (under 1F1B
    rank 1 has one micro-batch in flight, which recomputing does not shrink; under GPipe both ranks have four)."""
    free = _problem(schedule)
    problem = replace(free, memory_budget=min_memory_bytes(free) - ACT // 2)
    budget = problem.memory_budget
    assert budget is not None
    chosen = choose_recompute(problem).recompute
    assert chosen == want
    memory, step = recompute_price(problem, chosen)
    assert memory <= budget
    for n in range(3):
        for subset in combinations(range(2), n):
            m, t = recompute_price(problem, subset)
            assert m > budget or t >= step - 1e-12, (subset, chosen)


def test_nothing_recomputes_where_the_budget_holds_without() -> None:
    assert choose_recompute(_problem(budget=1 << 40)).recompute == ()
    assert choose_recompute(_problem()).recompute == ()


def test_greedy_search_fits_beyond_the_exhaustive_size(monkeypatch: pytest.MonkeyPatch) -> None:
    free = _problem()
    budget = min_memory_bytes(free) - ACT // 2
    monkeypatch.setattr(plan_search, "EXHAUSTIVE_STAGES", 0)
    chosen = choose_recompute(replace(free, memory_budget=budget))
    assert chosen.recompute == (0,)
    assert min_memory_bytes(chosen) <= budget


def test_nothing_fits_recomputes_every_stage_and_is_refused() -> None:
    problem = _problem(budget=static_bytes(_problem(), 0) + 1)
    assert recompute_choices(problem) == [(0, 1)]
    with pytest.raises(PlanError, match="memory"):
        plan_recomputing(problem, lambda p: solve(p, CONFIG))


def test_a_choice_the_planner_refuses_gives_way_to_the_next() -> None:
    """The next choice in step order is planned when the first is refused; every refusal: the first's."""
    problem = _problem(budget=min_memory_bytes(_problem()) - ACT // 2)
    assert recompute_choices(problem) == [(0,), (0, 1)]  # stage 0 must recompute; stage 1 may too
    tried: list[tuple[int, ...]] = []

    def refuse_first(p: Problem) -> tuple[int, ...]:
        tried.append(p.recompute)
        if len(tried) == 1:
            raise PlanError("first refused")
        return p.recompute

    assert plan_recomputing(problem, refuse_first) == (0, 1)
    assert tried == [(0,), (0, 1)]

    def refuse(p: Problem) -> None:
        raise PlanError(f"refused {p.recompute}")

    with pytest.raises(PlanError, match=r"refused \(0,\)"):
        plan_recomputing(problem, refuse)


def test_recompute_round_trips_through_the_plan_json(tmp_path) -> None:
    problem = replace(_problem(), recompute=(1,))
    assert Problem.from_dict(json.loads(json.dumps(problem.to_dict()))) == problem
    assert "recompute" not in _problem().to_dict()  # a plan without checkpointing is written as before
    plan = solve(problem, CONFIG)
    path = tmp_path / "plan.json"
    plan.save(path)
    assert load_plan(path).problem.recompute == (1,)


@pytest.mark.parametrize("bad", [(2,), (1, 0), (0, 0), (True,)])
def test_recompute_names_distinct_stages_ascending(bad: tuple) -> None:
    with pytest.raises(PlanError, match="recompute"):
        replace(_problem(), recompute=bad)


def test_boundary_bytes_round_trip_and_default() -> None:
    table = _costs()
    assert CostTable.from_dict(table.to_dict()) == table
    plain = replace(table, stages=tuple(replace(s, boundary_bytes=0) for s in table.stages))
    assert "boundary_bytes" not in json.dumps(plain.to_dict())
