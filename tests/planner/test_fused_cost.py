"""Fused curvature priced as profiled (`StageCost.fused_fwd` / `fused_bwd`): a fused layer's share of the measured
extra F/B, and the planner fusing where that is cheaper than deferred statistics no bubble hides."""

from __future__ import annotations

import dataclasses

import pytest

from fxkfac.planner.attempt import cheaper_fused
from fxkfac.planner.costs import CostTable
from fxkfac.planner.ir import OpKind
from fxkfac.planner.problem import Problem, SolverConfig
from fxkfac.planner.solve import solve
from fxkfac.planner.step_timeline import step_timeline
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
