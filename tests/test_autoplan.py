"""plan="auto" without an explicit max_overhead always plans: bubbles first, else the least growth that places
the work; an explicit max_overhead stays strict."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest

from fxkfac.autoplan import Target, check_matches, resumed_plan, solve_for
from fxkfac.cli_schedule import auto_candidates
from fxkfac.config import PlanOptions
from fxkfac.errors import ConfigError
from fxkfac.planner import Budget, Plan, Problem, SearchOptions
from fxkfac.planner import plan as plan_search
from fxkfac.planner.problem.costs import CostTable
from fxkfac.planner.problem.errors import PlanError, PlanMismatchError
from fxkfac.planner.problem.schedules import ScheduleKind
from fxkfac.planner.search import ScheduleCandidate
from fxkfac.planner.validate import validate
from tests.support.cost_tables import kfac_stages, light_pipeline


def _costs(stages: int) -> CostTable:
    """Two layers per stage whose inversions are longer than any bubble of a 2-stage pipeline."""
    return kfac_stages((2,) * stages, 0.2, (4, 4), 0.05, name="s{s}.l{i}")


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
    one, zb = ScheduleCandidate(ScheduleKind.ONE_F_ONE_B), ScheduleCandidate(ScheduleKind.ZB_H1)
    choices = tuple((c, f"graph-{c}") for c in (one, zb))
    target = Target("graph-1f1b", ScheduleKind.ONE_F_ONE_B, 2, 2, 1, choices=choices)
    with caplog.at_level(logging.WARNING, logger="fxkfac.autoplan"):
        plan = solve_for(target, _costs(2), PlanOptions(max_overhead=1.0, time_limit_s=2.0))
    kind = ScheduleKind(plan.problem.schedule)
    assert plan.problem.fingerprint == f"graph-{kind.value}" and validate(plan.problem, plan) == []
    said = _said(caplog)
    assert len(said) == 1 and said[0].startswith(f"schedule='auto': {kind.value}: the least step")
    check_matches(plan, replace(target, schedule=kind, fingerprint=f"graph-{kind.value}", choices=()))


def _said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("schedule='auto'")]


def _auto_target(D: int, N: int) -> Target:
    """compile(schedule="auto")'s target on D ranks and N micro-batches: every candidate, each its own fingerprint."""
    candidates = auto_candidates(D, N, 1)
    choices = tuple((c, f"graph-{c}") for c in candidates)
    return Target(choices[0][1], candidates[0].kind, D, N, 1, v=candidates[0].v, choices=choices)


def test_schedule_auto_plans_each_candidate_on_its_ownlight_pipeline(caplog: pytest.LogCaptureFixture) -> None:
    """D=2, N=3: the one-stage-per-rank schedules plan over the 2-stage table, zb-v over the 4-stage cut's; with the
    bubble zb-v leaves least, it wins, and its plan is of 4 stages, stamped with its own fingerprint."""
    target = _auto_target(2, 3)
    assert {str(c) for c, _ in target.choices} == {"gpipe", "1f1b", "zb-h1", "zb-v v=2"}
    with caplog.at_level(logging.WARNING, logger="fxkfac.autoplan"):
        plan = solve_for(
            target, light_pipeline(2), PlanOptions(time_limit_s=1.0), cut_costs={4: lambda: light_pipeline(4)}
        )
    assert (plan.problem.schedule, plan.problem.v, plan.problem.num_stages) == ("zb-v", 2, 4)
    assert plan.fingerprint == "graph-zb-v v=2" and validate(plan.problem, plan) == []
    (said,) = _said(caplog)
    assert said.startswith("schedule='auto': zb-v v=2: the least step") and all(
        name in said for name in ("gpipe", "1f1b", "zb-h1")
    )


def test_schedule_auto_charges_the_whole_choice_to_the_time_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """PlanOptions.time_limit_s bounds compile(schedule="auto")'s whole choice: every candidate's plan runs in a part
    of one budget, and together they spend no more than the limit's deterministic time (plus 10%)."""
    import fxkfac.autoplan as autoplan

    parts: list[Budget] = []

    def recorded(problem: Problem, search: SearchOptions, *, budget: Budget) -> Plan:
        parts.append(budget)
        return plan_search(problem, search, budget=budget)

    monkeypatch.setattr(autoplan, "plan_search", recorded)
    options = PlanOptions(time_limit_s=1.0)
    solve_for(_auto_target(2, 3), light_pipeline(2), options, cut_costs={4: lambda: light_pipeline(4)})
    assert len(parts) >= 4 and all(b.tally is parts[0].tally for b in parts)  # one budget's views
    assert 0 < parts[0].tally.spent <= parts[0].units(options.time_limit_s) * 1.1


def test_schedule_auto_says_when_memory_rules_a_cut_out(caplog: pytest.LogCaptureFixture) -> None:
    """A 4-stage cut whose stages hold more than the memory budget (its table says 2 GiB of parameters each): zb-v
    is out, with the budget as its reason, and the choice is among the one-stage-per-rank schedules."""
    options = PlanOptions(time_limit_s=1.0, memory_budget=3 << 30)
    with caplog.at_level(logging.WARNING, logger="fxkfac.autoplan"):
        plan = solve_for(
            _auto_target(2, 3),
            light_pipeline(2),
            options,
            cut_costs={4: lambda: light_pipeline(4, param_bytes=2 << 30)},
        )
    assert plan.problem.v == 1 and plan.problem.num_stages == 2
    (said,) = _said(caplog)
    assert "; zb-v v=2 out: memory budget 3221225472 bytes (3.0 GiB) per device is below the least" in said


def test_schedule_auto_leaves_out_a_cut_it_has_no_costs_for(caplog: pytest.LogCaptureFixture) -> None:
    """A given cost table of one stage count (PlanOptions.costs) plans the candidates of that count; the others are
    out, saying why."""
    with caplog.at_level(logging.WARNING, logger="fxkfac.autoplan"):
        plan = solve_for(_auto_target(2, 3), light_pipeline(2), PlanOptions(time_limit_s=1.0))
    assert plan.problem.v == 1
    (said,) = _said(caplog)
    assert "; zb-v v=2 out: no cost table of its 4 stages to plan it with" in said


def test_virtual_stages_keep_schedule_auto_to_that_many_stages_per_rank(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="fxkfac.cli_schedule"):
        kept = auto_candidates(2, 4, 2)
    assert [str(c) for c in kept] == ["interleaved v=2", "zb-v v=2", "zb-1p v=2"]
    assert "chooses among interleaved v=2, zb-v v=2, zb-1p v=2 only: virtual_stages=2" in caplog.text
    with pytest.raises(ConfigError, match="no schedule of 3 stages per rank for D=2, N=3"):
        auto_candidates(2, 3, 3)


def test_split_points_keep_schedule_auto_to_the_candidates_of_their_stage_count() -> None:
    from fxkfac.compile_api import _cuttable

    every = auto_candidates(2, 4, 1)
    assert _cuttable(every, 2, None) == every
    assert [str(c) for c in _cuttable(every, 2, ["b.1", "b.2", "b.3"])] == ["interleaved v=2", "zb-v v=2", "zb-1p v=2"]
    assert {c.v for c in _cuttable(every, 2, ["b.1"])} == {1}
    with pytest.raises(ConfigError, match="2 split points cuts 3 stages, which none of"):
        _cuttable(every, 2, ["b.1", "b.2"])
