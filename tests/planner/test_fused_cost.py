"""Fused curvature priced as profiled (`StageCost.fused_fwd` / `fused_bwd`): a fused layer's share of the measured
extra F/B, and the planner fusing where that is cheaper than deferred statistics no bubble hides."""

from __future__ import annotations

import dataclasses

import pytest

from fxkfac.planner.problem.costs import CostTable
from fxkfac.planner.problem.ir import OpKind
from fxkfac.planner.problem.problem import Problem, SolverConfig
from fxkfac.planner.problem.step_timeline import step_timeline
from fxkfac.planner.search.attempt import cheaper_fused, solve
from fxkfac.planner.search.choose import solve_with_strategy
from fxkfac.planner.validate import validate
from tests.planner.kfac_cases import layer, problem

FAST = SolverConfig(time_limit_s=4.0, num_workers=2)


def _stages(p: Problem, **fields: float | None) -> Problem:
    """`p` with every stage's cost fields replaced."""
    stages = tuple(dataclasses.replace(s, **fields) for s in p.costs.stages)
    return dataclasses.replace(p, costs=dataclasses.replace(p.costs, stages=stages))


def test_a_fused_layer_costs_its_statistics_share_of_the_measured_extra() -> None:
    stage = dataclasses.replace(
        problem("gpipe", 2, 2).costs.stages[0],
        layers=(layer("a", curv=0.3), layer("b", curv=0.1)),
        fused_fwd=0.2,
        fused_bwd=0.08,
    )
    # a's statistics are 3/4 of the stage's on each side (A after FWD, B after BWD).
    assert stage.fused_curvature({"a"}, OpKind.FWD) == pytest.approx(0.15)
    assert stage.fused_curvature({"a"}, OpKind.BWD) == pytest.approx(0.06)
    assert stage.fused_curvature({"a", "b"}, OpKind.FWD) == pytest.approx(0.2)
    assert stage.fused_curvature(set(), OpKind.FWD) == 0
    unmeasured = dataclasses.replace(stage, fused_fwd=None, fused_bwd=None)
    assert unmeasured.fused_curvature({"a"}, OpKind.FWD) == pytest.approx(0.3)


def test_measured_fused_times_round_trip_scale_and_stay_out_of_a_file_without_them() -> None:
    p = problem("gpipe", 2, 2)
    measured = _stages(p, fused_fwd=0.01, fused_bwd=0.03).costs
    again = CostTable.from_json(measured.to_json())
    assert again == measured
    half = measured.with_micro_batch_size(2)  # micro-batch 1 -> 2: per-micro-batch times double
    assert [(s.fused_fwd, s.fused_bwd) for s in half.stages] == [(0.02, 0.06)] * 2
    assert "fused_fwd" not in p.costs.to_json()


def test_a_refresh_step_with_fused_layers_is_the_step_of_stages_whose_f_and_b_include_their_share() -> None:
    plain = problem("1f1b", 2, 4, curv=0.25)
    measured = _stages(plain, fused_fwd=0.05, fused_bwd=0.125)
    names = frozenset(plain.costs.layer_names)
    grown = _stages(plain, fwd=1.0 + 0.05, bwd=2.0 + 0.125)
    assert step_timeline(measured, names, refresh=True).length == pytest.approx(step_timeline(grown).length)


# Chimera on D=2 with N=2 has no bubble: deferred statistics stretch every step of a window.
NO_BUBBLE = problem("chimera", 2, 2, curv=0.25, inv=0.25, prec=0.05, max_period=8, max_overhead=1.0)


@pytest.mark.parametrize("method", ["greedy", "cpsat"])
def test_where_no_bubble_hides_the_statistics_the_plan_fuses_what_is_cheaper_fused(method: str) -> None:
    deferred = solve(NO_BUBBLE, FAST, method=method)
    assert deferred.metrics.stretch > 0 and all(t.capture == "deferred" for t in deferred.layers.values())
    cheap = _stages(NO_BUBBLE, fused_fwd=0.01, fused_bwd=0.01)
    assert cheaper_fused(cheap) == frozenset(cheap.costs.layer_names)
    plan = solve(cheap, FAST, method=method)
    assert validate(cheap, plan) == []
    assert all(t.capture == "fused" for t in plan.layers.values())
    assert plan.metrics.step_time < deferred.metrics.step_time


def test_fused_curvature_dearer_than_deferred_is_never_chosen_for_speed() -> None:
    dear = _stages(NO_BUBBLE, fused_fwd=0.6, fused_bwd=0.6)  # more than the 0.25 + 0.25 of statistics per layer
    assert cheaper_fused(dear) == frozenset()
    plan = solve(dear, FAST, method="cpsat")
    assert all(t.capture == "deferred" for t in plan.layers.values())


def test_a_fused_plan_folds_each_micro_batchs_statistics_right_after_its_backward() -> None:
    """The runtime has no statistic of a fused layer to sync or decompose unless a STATS folds each micro-batch's
    (made in its F/B): the refresh step follows every BWD with them on each rank that keeps the layer's statistics,
    and the validator refuses a plan without them."""
    cheap = _stages(NO_BUBBLE, fused_fwd=0.01, fused_bwd=0.01)
    plan = solve(cheap, FAST, method="greedy")
    for rank, program in plan.programs.items():
        refresh = program[0]
        for i, op in enumerate(refresh):
            if op.kind is OpKind.BWD:
                layers = [x.name for x in cheap.costs.stages[op.stage].layers]  # type: ignore[index]  # BWD names its stage
                folds = refresh[i + 1 : i + 1 + 2 * len(layers)]
                assert {(f.kind, f.mb, f.pipe, f.layer, f.part) for f in folds} == {
                    (OpKind.STATS, op.mb, op.pipe, name, side) for name in layers for side in "AB"
                }, (rank, op)
    unfolded = {
        rank: [[op for op in ops if not (op.kind is OpKind.STATS and op.mb is not None)] for ops in program]
        for rank, program in plan.programs.items()
    }
    errors = validate(cheap, dataclasses.replace(plan, programs=unfolded))
    assert any("is not followed by the folds" in e for e in errors), errors


def test_the_joint_distribution_choice_fuses_what_is_cheaper_fused_too() -> None:
    """Chimera's two pipes hold two copies of every stage: with the strategy free, CP-SAT chooses each layer's
    distribution with the placement (`choose.solve_joint`), and where no bubble hides the statistics it fuses the
    layers whose fused curvature is cheaper, as `solve` does."""
    deferred = solve_with_strategy(NO_BUBBLE, None, FAST)
    assert deferred.metrics.stretch > 0 and all(t.capture == "deferred" for t in deferred.layers.values())
    cheap = _stages(NO_BUBBLE, fused_fwd=0.01, fused_bwd=0.01)
    plan = solve_with_strategy(cheap, None, FAST)
    assert validate(plan.problem, plan) == []
    assert all(t.capture == "fused" for t in plan.layers.values())
    assert plan.metrics.step_time < deferred.metrics.step_time
