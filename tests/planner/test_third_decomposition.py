"""A refresh first used after its next refresh has made a decomposition holds a third one meanwhile (the active, the
pending and the newest). `planner.problem.step_timeline.static_bytes` counts two; a plan's peak memory adds the third
(`planner.plan.solution.remade_spans`) and the validator counts it from the placements alone."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from fxkfac.planner.plan.plan import Plan
from fxkfac.planner.plan.solution import GroupSolution, fits_memory, peak_bytes, remade_spans
from fxkfac.planner.problem.ir import OpKind
from fxkfac.planner.problem.problem import SolverConfig
from fxkfac.planner.problem.step_timeline import decomposition_bytes, step_timeline, window_length
from fxkfac.planner.search import group_search
from fxkfac.planner.search.attempt import solve
from fxkfac.planner.validate import validate
from tests.planner.kfac_cases import problem

CONFIG = SolverConfig(time_limit_s=1.0)


def _plan() -> Plan:
    """Chimera D=4 W=2 whose CP-SAT plan uses a layer's refreshes a period and more after they begin."""
    return solve(problem("chimera", 4, 4, W=2, curv=0.5, inv=1.0, prec=0.25, layers=3), CONFIG)


def _thirds(plan: Plan) -> dict[int, set[str]]:
    """Per device, the layers of which it holds a third decomposition: from the placements, in seconds, the first
    DECOMP end of a layer a window later (its next refresh's) before the device's APPLY of step use_offset starts."""
    p = plan.problem
    normal, refresh = step_timeline(p), step_timeline(p, refresh=True)
    out: dict[int, set[str]] = {d: set() for d in p.devices}
    for name, timing in plan.layers.items():
        stage, k, u = p.costs.stage_of(name), timing.period, timing.use_offset
        L = window_length(refresh.length, normal.length, plan.metrics.stretch, k)
        made = min(x.end for x in plan.placements if x.op.kind is OpKind.DECOMP and x.op.layer == name)
        for d in p.devices:
            applies = [
                x.start
                for x in plan.placements
                if x.op.kind is OpKind.APPLY and x.op.stage == stage and x.device == d and x.step == u % k
            ]
            if decomposition_bytes(p, d, name) and applies and made + L < applies[0] + L * (u // k):
                out[d].add(name)
    return out


def test_a_third_decomposition_is_in_the_plans_peak_as_the_validator_counts_it() -> None:
    """The plan claims peaks that the validator, counting the third decompositions from the placements, finds met
    (a budget of the claimed peak validates) and not padded (one byte less does not)."""
    plan = _plan()
    thirds = _thirds(plan)
    assert any(thirds.values()), "the case no longer uses a refresh after the next one begins"
    assert validate(plan.problem, plan) == []
    for d, names in thirds.items():
        for budget, over in ((plan.metrics.peak_memory[d], False), (plan.metrics.peak_memory[d] - 1, True)):
            bound = dataclasses.replace(plan.problem, memory_budget=budget)
            errors = validate(bound, dataclasses.replace(plan, problem=bound))
            assert any(e.startswith(f"r{d}: memory peaks") for e in errors) == over, (d, names, errors)


def test_a_budget_below_the_third_decompositions_peak_still_gets_a_valid_plan_within_it() -> None:
    """One byte below the peak of the plan without a budget (a peak with a third decomposition in it), the planner
    still plans, and the validator, counting any third decomposition, finds the plan within the budget."""
    plan = _plan()
    budget = max(plan.metrics.peak_memory.values()) - 1
    bound = dataclasses.replace(plan.problem, memory_budget=budget)
    fitted = solve(bound, CONFIG)
    assert validate(bound, fitted) == []
    assert max(fitted.metrics.peak_memory.values()) <= budget


def test_a_group_solution_whose_third_decomposition_breaks_the_budget_is_not_returned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`refine_group` checks CP-SAT's last solution with the third decompositions counted (its model counts two):
    one that breaks the budget gives way to the solution found before (least staleness) or first-fit's, whichever
    fits first, else to none (`group_search.within_budget`)."""
    made: list[GroupSolution] = []
    refine_group = group_search.refine_group

    def kept(*args: Any, **kwargs: Any) -> GroupSolution | None:
        solution = refine_group(*args, **kwargs)
        made.extend([solution] if solution is not None else [])
        return solution

    monkeypatch.setattr(group_search, "refine_group", kept)
    _plan()
    over = next(s for s in made if any(remade_spans(s, d) for d in s.window.group.devices))
    fitting = dataclasses.replace(over)  # the same solution of the problem without a budget
    budget = max(peak_bytes(over, d) for d in over.window.group.devices) - 1
    bound = dataclasses.replace(over.window.problem, memory_budget=budget)
    breaking = dataclasses.replace(over, window=dataclasses.replace(over.window, problem=bound))
    assert fits_memory(fitting) and not fits_memory(breaking)
    assert group_search.within_budget(breaking, breaking, fitting) is fitting
    assert group_search.within_budget(breaking, fitting, None) is fitting
    assert group_search.within_budget(breaking, breaking, None) is None
    assert group_search.within_budget(fitting, breaking, None) is fitting
