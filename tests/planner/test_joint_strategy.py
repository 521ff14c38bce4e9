"""CP-SAT choosing each layer's distribution with the placement (planner/search/cpsat.py given options,
planner/search/group_search.py `joint_placements`): the least step against every option set enumerated, and
joint plans against every forced strategy and the outer search."""

from __future__ import annotations

import dataclasses
import itertools
import time

import pytest

from fxkfac.planner.plan.plan import Plan
from fxkfac.planner.plan.solution import GroupSolution
from fxkfac.planner.plan.window import TaskKind, Window, grid_scale
from fxkfac.planner.problem.costs import CostTable, LayerCost, StageCost
from fxkfac.planner.problem.hardware import HARDWARE
from fxkfac.planner.problem.problem import Problem, SolverConfig, stage_groups
from fxkfac.planner.problem.step_timeline import activation_peak, min_memory_bytes, static_bytes, step_timeline
from fxkfac.planner.problem.strategy import parse_strategy
from fxkfac.planner.search.attempt import solve
from fxkfac.planner.search.budget import Budget
from fxkfac.planner.search.choose import solve_with_strategy, strategy_of
from fxkfac.planner.search.cpsat import (
    layer_options,
    least_step,
    options_of,
    reference_step,
    reference_ticks,
    solve_window,
    timeline_stages,
    transfer,
    window_at,
)
from fxkfac.planner.search.greedy import greedy_window
from fxkfac.planner.validate import validate

QUICK = SolverConfig(time_limit_s=2.0)


def _problem(
    schedule: str = "1f1b",
    stages: int = 2,
    W: int = 2,
    layers: int = 3,
    budget: int | None = None,
    max_overhead: float = 0.6,
    capture: int = 1024,
) -> Problem:
    """Uneven layers (decomposition 4..12 ms, statistics 1..3 MiB, `capture` bytes of a and of e kept per
    micro-batch) on `stages` stages, each held by W copies."""
    table = CostTable(
        tuple(
            StageCost(
                0.01,
                0.02,
                4 << 20,
                1 << 20,
                tuple(
                    LayerCost.kfac(
                        f"s{s}fc{i}",
                        0.001,
                        0.001,
                        0.004 * (i + 1),
                        0.003,
                        0.001,
                        capture,
                        capture,
                        (i + 1) << 20,
                        (i + 1) << 20,
                        grad_bytes=1 << 18,
                    )
                    for i in range(layers)
                ),
            )
            for s in range(stages)
        ),
        8,
        "hand",
        "test",
        HARDWARE["a100"].comm,
    )
    micro = stages if schedule == "chimera" else 2 * stages
    return Problem(schedule, stages, micro, table, W=W, max_overhead=max_overhead, memory_budget=budget)


def _fits(problem: Problem) -> bool:
    budget = problem.memory_budget
    return budget is None or all(
        static_bytes(problem, d) + activation_peak(problem, d) <= budget for d in problem.devices
    )


def _enumerated_least(problem: Problem) -> float:
    """The least simulated reference step over every option set of every layer that meets the static memory."""
    names = list(problem.costs.layer_names)
    steps = []
    for combo in itertools.product(*(layer_options(problem, n) for n in names)):
        candidate = problem.with_distributions(dict(zip(names, combo)))
        if _fits(candidate):
            steps.append(step_timeline(candidate).length)
    return min(steps)


@pytest.mark.parametrize("budget", [None, "tight"])
def test_least_step_is_the_least_over_every_option_set(budget: str | None) -> None:
    """Two stages of two copies, 3 options per layer (COMM-OPT, MEM-OPT on either copy): 729 option sets, each
    simulated; the model's choice's simulated step is that minimum (to the model's 1 ns)."""
    problem = _problem()
    if budget:  # between the least and the most static bytes an option set can hold
        comm = max(static_bytes(problem, d) + activation_peak(problem, d) for d in problem.devices)
        mem = problem.with_strategy(parse_strategy("mem-opt"))
        least = max(static_bytes(mem, d) + activation_peak(mem, d) for d in mem.devices)
        assert least < comm
        problem = dataclasses.replace(problem, memory_budget=(least + comm) // 2)
    free = frozenset(range(problem.num_stages)) - timeline_stages(problem)
    assert free == {0, 1}  # 1F1B: each stage's slot comes after its copies' fixed work
    meter = dataclasses.replace(Budget.untimed(), cap=time.perf_counter() + 60)
    choice = least_step(problem, free, QUICK, meter, 10.0)
    assert choice is not None
    chosen = problem.with_distributions(choice)
    best = _enumerated_least(problem)
    assert _fits(chosen)
    assert step_timeline(chosen).length == pytest.approx(best, abs=1e-8)
    assert reference_step(problem, free, choice) == pytest.approx(best, abs=1e-8)


def _checked(plan: Plan) -> Plan:
    assert validate(plan.problem, plan) == []
    return plan


def _no_worse(plan: Plan, other: Plan) -> bool:
    """In the planner's order: reference step (what max_overhead is measured against), then refresh periods, then
    step time; the last within 1% (the stretch each minimizes in its time limit, neither proven optimal)."""
    a, b = plan.metrics, other.metrics
    first, second = (
        (round(a.step_time_reference, 9), sum(a.refresh_steps)),
        (round(b.step_time_reference, 9), sum(b.refresh_steps)),
    )
    return first < second or (first == second and a.step_time <= 1.01 * b.step_time)


@pytest.mark.parametrize("schedule", ["1f1b", "chimera"])
def test_the_joint_plan_is_no_worse_than_any_forced_strategy_or_the_outer_search(schedule: str) -> None:
    """Chimera's stages move the step's fixed work (one joint solve per strategy of theirs); 1F1B's do not. The
    plans are valid (the validator checks the broadcasts and who holds what) and no worse (`_no_worse`) than each
    forced strategy's or the outer search's best whole-strategy candidate."""
    problem = _problem(schedule, max_overhead=0.3)
    assert bool(timeline_stages(problem)) == (schedule == "chimera")
    joint = _checked(solve_with_strategy(problem, None, QUICK))
    for text in ("comm-opt", "mem-opt"):
        forced = _checked(solve(problem.with_strategy(parse_strategy(text)), QUICK))
        assert _no_worse(joint, forced), (text, strategy_of(joint), joint.metrics, forced.metrics)
    outer = _checked(solve_with_strategy(problem, None, QUICK, budget=Budget.of(QUICK), joint=False))
    assert _no_worse(joint, outer), (strategy_of(joint), strategy_of(outer), joint.metrics, outer.metrics)


def test_a_budget_comm_opt_misses_is_met_by_the_joint_choice() -> None:
    problem = _problem(schedule="gpipe", stages=1, W=4, layers=4)
    comm = _checked(solve(problem, QUICK))
    mem = _checked(solve(problem.with_strategy(parse_strategy("mem-opt")), QUICK))
    budget = max(mem.metrics.peak_memory.values())
    assert budget < max(comm.metrics.peak_memory.values())
    tight = dataclasses.replace(problem, memory_budget=budget)
    chosen = _checked(solve_with_strategy(tight, None, QUICK))
    assert strategy_of(chosen) != "comm-opt"
    assert max(chosen.metrics.peak_memory.values()) <= budget


def test_a_budget_that_needs_curvature_fused_plans_with_fusing() -> None:
    """The joint model fuses no curvature: under a budget that deferred captures overflow, the candidates planned by
    `solve` (which fuses) meet it."""
    roomy = _problem(capture=4 << 20)
    free = _checked(solve_with_strategy(roomy, None, QUICK))
    budget = min_memory_bytes(roomy) + (4 << 20)  # one micro-batch's a of one layer beyond the least
    assert all(t.capture == "deferred" for t in free.layers.values())
    assert max(free.metrics.peak_memory.values()) > budget
    plan = _checked(solve_with_strategy(dataclasses.replace(roomy, memory_budget=budget), None, QUICK))
    assert any(t.capture == "fused" for t in plan.layers.values())
    assert max(plan.metrics.peak_memory.values()) <= budget


def _first_fit_window(problem: Problem) -> tuple[Window, GroupSolution]:
    """The first window of the first stage group, on the joint choice's grid, that first-fit places."""
    scale = grid_scale(problem, range(problem.num_stages), frozenset(), QUICK.time_resolution)
    group = stage_groups(problem)[0]
    for k in range(1, problem.max_period + 1):
        w = window_at(problem, group, k, reference_ticks(problem, scale), scale, stats_chunk=1)
        assert w is not None
        placed = greedy_window(w)
        if placed is not None:
            return w, placed
    raise AssertionError("first-fit places no window")


def test_a_placement_moves_into_its_own_problems_window_unchanged() -> None:
    """`transfer` reads a placement by task name (a first-fit one of a candidate, with its BCAST tasks, or a joint
    one, with the options' broadcasts): into the window it was placed in, it is the same placement."""
    problem = _problem(W=2).with_strategy(parse_strategy("comm-opt"))
    w, placed = _first_fit_window(problem)
    assert any(task.kind is TaskKind.BCAST for task in w.tasks)
    moved = transfer(placed, problem)
    assert moved is not None
    assert (moved.starts, moved.devices, moved.prec_starts) == (placed.starts, placed.devices, placed.prec_starts)
    assert moved.use_offset == placed.use_offset


@pytest.mark.parametrize("strategy", ["comm-opt", "mem-opt"])
def test_a_forced_strategy_is_the_model_with_one_option_per_layer(strategy: str) -> None:
    """A forced strategy's window solves as the joint model given each layer's own distribution as its one option: it
    places the window's own tasks (under COMM-OPT with its broadcasts), chooses each layer's own, is no staler than
    first-fit and moves into its own window unchanged."""
    problem = _problem(W=2).with_strategy(parse_strategy(strategy))
    w, placed = _first_fit_window(problem)
    options = options_of(problem, w.group.stages, ())
    assert all(len(opts) == 1 for opts in options.values())
    budget = dataclasses.replace(Budget.untimed(), cap=time.perf_counter() + 60)
    status, forced = solve_window(w, QUICK, 60.0, budget, placed, options=options)
    assert status == "OPTIMAL" and forced is not None
    assert forced.window.tasks == w.tasks
    assert all(forced.choice(layer) == problem.where(layer) for layer in options)
    assert forced.staleness <= placed.staleness
    moved = transfer(forced, problem)
    assert moved is not None and moved.staleness == forced.staleness
