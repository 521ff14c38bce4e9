"""The step barrier a plan is made for ([Note: step barrier] in planner/plan/window.py): under AGREEMENT_SET the idle at
a step's end joins the next step's early idle on the devices of an agreement set."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fxkfac.planner.plan.plan import Plan
from fxkfac.planner.problem.errors import PlanError
from fxkfac.planner.problem.problem import Problem, SolverConfig, StepBarrier, stage_groups
from fxkfac.planner.problem.step_timeline import early_start, step_timeline, steps_overlap
from fxkfac.planner.search.attempt import solve
from fxkfac.planner.validate import validate
from fxkfac.planner.validate.plan_file import parse_plan
from tests.planner.kfac_cases import problem

CONFIG = SolverConfig(time_limit_s=5)
AGREE = StepBarrier.AGREEMENT_SET


def test_barrier_round_trips_and_old_files_load_as_world() -> None:
    p = problem("chimera", 4, 4, barrier=AGREE)
    assert Problem.from_dict(p.to_dict()) == p
    world = replace(p, barrier=StepBarrier.WORLD)
    assert "barrier" not in world.to_dict()
    assert Problem.from_dict(world.to_dict()).barrier is StepBarrier.WORLD
    with pytest.raises(PlanError, match="barrier"):
        replace(p, barrier="nobody")


@pytest.mark.parametrize(
    "args",
    [
        ("gpipe", 2, 4, 1, 1),
        ("1f1b", 4, 4, 1, 1),
        ("1f1b", 2, 4, 2, 1),
        ("chimera", 4, 4, 1, 1),
        ("interleaved", 2, 4, 1, 2),
    ],
)
def test_steady_run_without_world_barrier_repeats_the_step(args: tuple[str, int, int, int, int]) -> None:
    """With OPT_STEP over agreement sets only, 3 simulated steps end every op where the one-step timeline repeated
    every `length` says: the window's model of a step stays the steady run; only the group's boundary moves."""
    schedule, D, N, W, v = args
    p = problem(schedule, D, N, W, v=v, barrier=AGREE)
    assert not steps_overlap(p)
    step = step_timeline(p)
    leads = [early_start(p, step, g.devices) for g in stage_groups(p)]
    assert leads[0] == 0.0  # the group holding stage 0 starts the pipeline and ends it last
    assert all(0.0 <= x < step.length for x in leads)
    assert early_start(replace(p, barrier=StepBarrier.WORLD), step, stage_groups(p)[-1].devices) == 0.0


def _plan(p: Problem) -> Plan | None:
    try:
        return solve(p, CONFIG)
    except PlanError:
        return None


def test_a_bubble_across_the_step_end_places_what_the_world_barrier_cannot() -> None:
    """Chimera D=4: the middle ranks idle 1.5 s after their step's slots and 1 s before their first forward, each
    shorter than an inversion of 2 s, together longer. WORLD finds no placement; AGREEMENT_SET does, and valid."""
    world = problem("chimera", 4, 4, inv=2.0)
    assert _plan(world) is None
    agree = replace(world, barrier=AGREE)
    plan = _plan(agree)
    assert plan is not None
    assert validate(agree, plan) == []
    assert parse_plan(plan.to_json()).problem.barrier is AGREE
    assert validate(world, replace(plan, problem=world)) != []  # it crosses WORLD's boundary


@pytest.mark.parametrize(
    "args,kw",
    [
        (("chimera", 4, 4), {}),
        (("1f1b", 4, 4), {"inv": 2.5}),
        (("1f1b", 2, 4, 2), {"inv": 1.5}),
        (("gpipe", 2, 4), {"inv": 1.5}),
        (("chimera", 4, 4), {"inv": 3.0, "max_overhead": 0.25}),
        (("1f1b", 2, 4), {"inv": 3.0, "max_overhead": 0.2}),
    ],
)
def test_agreement_set_is_valid_and_never_worse(args: tuple, kw: dict) -> None:
    """Valid, and no longer refresh periods or stretch (the stretched cases move placements with `restretch`)."""
    world = problem(*args, **kw)
    agree = replace(world, barrier=AGREE)
    a, w = _plan(agree), _plan(world)
    assert a is not None
    assert validate(agree, a) == []
    if w is not None:
        assert sum(a.metrics.refresh_steps) <= sum(w.metrics.refresh_steps)
        assert a.metrics.stretch <= w.metrics.stretch


def test_a_task_runs_past_the_windows_end_where_that_is_no_boundary() -> None:
    """GPipe D=2: rank 1 idles 1 s before its first forward and 2 s after its step's slot, nothing between; its two
    1.2 s inversions fit one step only in the joined 3 s, across the window's own end at a refresh period of 1
    (CP-SAT lays a task twice, at pos and pos - L)."""
    world = problem("gpipe", 2, 2, inv=1.2, curv=0.05)
    agree = replace(world, barrier=AGREE)
    a, w = _plan(agree), _plan(world)
    assert a is not None and w is not None
    assert validate(agree, a) == []
    assert a.metrics.refresh_steps == (1, 1)
    assert w.metrics.refresh_steps[1] > 1
