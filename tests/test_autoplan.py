"""plan="auto" without an explicit max_overhead always plans: bubbles first, else the least growth that places
the work; an explicit max_overhead stays strict."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest

from fxkfac.autoplan import Target, check_matches, resumed_plan, solve_for
from fxkfac.config import PlanOptions
from fxkfac.planner.problem.costs import CostTable, LayerCost, StageCost
from fxkfac.planner.problem.errors import PlanError, PlanMismatchError
from fxkfac.planner.problem.schedules import ScheduleKind
from fxkfac.planner.validate import validate

MS = 1e-3


def _costs(stages: int) -> CostTable:
    """Two layers per stage whose inversions are longer than any bubble of a 2-stage pipeline."""
    return CostTable(
        tuple(
            StageCost(
                1 * MS,
                2 * MS,
                1 << 20,
                1 << 16,
                tuple(
                    LayerCost.kfac(f"s{s}.l{i}", 0.2 * MS, 0.2 * MS, 4 * MS, 4 * MS, 0.05 * MS, 4096, 4096, 4096, 4096)
                    for i in range(2)
                ),
            )
            for s in range(stages)
        ),
        2,
        "test",
        "cpu",
    )


def test_auto_overhead_plans_where_the_bubbles_alone_cannot(caplog: pytest.LogCaptureFixture) -> None:
    target = Target("graph", ScheduleKind.ONE_F_ONE_B, 2, 2, 1)
    with pytest.raises(PlanError, match="max_overhead"):
        solve_for(target, _costs(2), PlanOptions(max_overhead=0.0, time_limit_s=3.0))
    with caplog.at_level(logging.WARNING, logger="fxkfac.autoplan"):
        plan = solve_for(target, _costs(2), PlanOptions(time_limit_s=3.0))
    assert plan.problem.max_overhead > 0 and validate(plan.problem, plan) == []
    assert any("planning with max_overhead=" in r.getMessage() for r in caplog.records)
    assert plan.metrics.step_time <= plan.metrics.step_time_reference * (1 + plan.problem.max_overhead) + 1e-9


def test_a_warm_started_run_plans_for_it_and_refuses_a_plan_made_without() -> None:
    """A family whose decompositions start from the previous one (SOAP's QR basis) gets a plan made for that, and
    refuses a plan that may start the next refresh before the previous one is made (it would train otherwise than
    on one device); a plan in pieces (Newton-Schulz, also warm-started) is one it accepts."""
    warm = Target("graph", ScheduleKind.ONE_F_ONE_B, 2, 2, 1, warm_start=True)
    options = PlanOptions(max_overhead=1.0, time_limit_s=3.0)
    plan = solve_for(warm, _costs(2), options)
    assert plan.problem.warm_start and validate(plan.problem, plan) == []
    check_matches(plan, warm)
    cold = solve_for(replace(warm, warm_start=False), _costs(2), options)
    with pytest.raises(PlanMismatchError, match="start from the layer's previous one"):
        check_matches(cold, warm)
    check_matches(cold, replace(warm, warm_start=False))
    pieces = solve_for(replace(warm, warm_start=False, decomp_pieces=2), _costs(2), options)
    check_matches(pieces, replace(warm, decomp_pieces=2))


def test_a_relaunch_adopts_the_plan_of_a_complete_checkpoint_made_for_its_run(tmp_path: Path) -> None:
    """plan="auto" with `compile(resume_from=...)`: the checkpoint's plan when it is complete and its plan was made for
    this graph, mesh and schedule; else None (plan anew, and the load follows the state)."""
    target = Target("graph", ScheduleKind.ONE_F_ONE_B, 2, 2, 1)
    plan = solve_for(target, _costs(2), PlanOptions(max_overhead=1.0, time_limit_s=3.0))
    stage_layers = {s: [f"s{s}.l{i}" for i in range(2)] for s in range(2)}
    ckpt = tmp_path / "ckpt"
    assert resumed_plan(ckpt, target, stage_layers, rank=0, world=1) is None  # the first launch: nothing there
    ckpt.mkdir()
    (ckpt / "plan.json").write_text(plan.to_json())
    assert resumed_plan(ckpt, target, stage_layers, rank=0, world=1) is None  # no header: not a complete checkpoint
    (ckpt / "fxkfac.json").write_text("{}")
    adopted = resumed_plan(ckpt, target, stage_layers, rank=0, world=1)
    assert adopted is not None and adopted.to_dict() == plan.to_dict()
    assert resumed_plan(ckpt, replace(target, N=4), stage_layers, rank=0, world=1) is None  # another layout


def test_fxkfac_plan_and_plan_auto_make_one_plan_of_one_problem(tmp_path: Path) -> None:
    """The command line and plan="auto" ask `planner.plan` for the same search: the bubbles alone first, then the
    least max_overhead (these costs need some), the distributions chosen over W=2, streaming where it keeps the
    refresh, compiled stages, the device's memory as the budget."""
    from fxkfac.cli import main
    from fxkfac.planner.problem.hardware import hardware
    from fxkfac.planner.validate.plan_file import read_plan

    costs, exported = tmp_path / "costs.json", tmp_path / "plan.json"
    _costs(2).save(costs)
    argv = ["plan", "custom", "-D", "2", "-N", "2", "--dp", "2", "--schedule", "1f1b", "--costs", str(costs)]
    assert main([*argv, "--time-limit", "2", "--export", str(exported)]) == 0
    target = Target("", ScheduleKind.ONE_F_ONE_B, 2, 2, 2, compiled=True)
    options = PlanOptions(time_limit_s=2.0, memory_budget=hardware("cpu").memory_bytes)
    auto = solve_for(target, _costs(2), options)
    assert auto.problem.max_overhead > 0
    assert read_plan(exported) == auto


def test_schedule_auto_plans_the_schedule_the_planner_chooses_stamped_with_its_fingerprint(
    caplog: pytest.LogCaptureFixture,
) -> None:
    choices = tuple((k, f"graph-{k.value}") for k in (ScheduleKind.ONE_F_ONE_B, ScheduleKind.ZB_H1))
    target = Target("graph-1f1b", ScheduleKind.ONE_F_ONE_B, 2, 2, 1, choices=choices)
    with caplog.at_level(logging.WARNING, logger="fxkfac.autoplan"):
        plan = solve_for(target, _costs(2), PlanOptions(max_overhead=1.0, time_limit_s=2.0))
    kind = ScheduleKind(plan.problem.schedule)
    assert plan.problem.fingerprint == f"graph-{kind.value}" and validate(plan.problem, plan) == []
    said = [r.getMessage() for r in caplog.records if "schedule='auto'" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(f"schedule='auto': {kind.value}: the least step")
    check_matches(plan, replace(target, schedule=kind, fingerprint=f"graph-{kind.value}", choices=()))
