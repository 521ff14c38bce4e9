"""A refresh first used after its next refresh has made a decomposition holds a third one meanwhile (the active, the
pending and the newest). `planner.memory.static_bytes` counts two; a plan's peak memory adds the third
(`planner.solution.remade_spans`) and the validator counts it from the placements alone."""

from __future__ import annotations

import dataclasses

from fxkfac.planner.ir import OpKind
from fxkfac.planner.memory import decomposition_bytes
from fxkfac.planner.plan import Plan
from fxkfac.planner.problem import SolverConfig
from fxkfac.planner.solve import solve
from fxkfac.planner.step_timeline import step_timeline, window_length
from fxkfac.planner.validate import validate
from tests.planner.kfac_cases import problem


def _plan() -> Plan:
    """Chimera D=4 W=2 whose CP-SAT plan uses two layers' refreshes a period and more after they begin."""
    return solve(problem("chimera", 4, 4, W=2, curv=0.5, inv=1.0, prec=0.25, layers=2), SolverConfig(time_limit_s=1.0))


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
