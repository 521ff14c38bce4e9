"""Each rule of the validator refuses a plan broken its way, with its message: a small valid plan (every K-FAC op of
a copied stage: statistics, sync, decomposition, broadcast, APPLY) broken one way per case."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from functools import cache
from typing import Any

import pytest

from fxkfac.planner.plan.plan import Plan
from fxkfac.planner.problem.analytic import analytic_cost_table
from fxkfac.planner.problem.costs import CostTable, PreconditionerKind, StageCost
from fxkfac.planner.problem.ir import Op, Placement
from fxkfac.planner.problem.problem import Problem
from fxkfac.planner.problem.profiles import load_cost_table
from fxkfac.planner.problem.step_timeline import min_memory_bytes
from fxkfac.planner.problem.strategy import parse_strategy
from fxkfac.planner.search.attempt import solve
from fxkfac.planner.search.plan_search import with_streaming
from fxkfac.planner.validate import validate
from tests.planner.kfac_cases import gradient_layer, problem


@cache
def _plan(kind: str = "kfac") -> Plan:
    """kfac: two stages on two copies each; gradient: Shampoo-like layers (per-step STATS of the reduced gradient);
    shared: mem-opt rows (BCAST_PREC); zb: zero bubble with placed W's; stream: BERT-Base's stage 0 streams two layers
    to helpers r2 and r3 (r2's program: 12 steps, its own period repeated, with the owner's replicas); fused: every
    layer's curvature folded into the refresh step's backwards (memory at the least); muon: APPLYs cut in two pieces."""
    if kind == "gradient":
        stages = tuple(StageCost(1.0, 2.0, 1000, 50, (gradient_layer(f"l{s}_0"),)) for s in range(2))
        return solve(Problem("1f1b", 2, 2, CostTable(stages, 1, "test", "cpu")), method="greedy")
    if kind == "shared":
        mem_opt = parse_strategy("mem-opt")
        return solve(problem("1f1b", 2, 2, W=2, curv=0.25, inv=0.5).with_strategy(mem_opt), method="greedy")
    if kind == "stream":
        costs = load_cost_table("paper:bert-base/p100", blocks_per_stage=3, n_stages=4, micro_batch_size=32)
        return solve(with_streaming(Problem("1f1b", 4, 4, costs, decomp_pieces=4)), method="greedy")
    if kind == "fused":
        tight = problem("1f1b", 2, 2, keep=40, max_overhead=0.5, max_period=8)
        return solve(replace(tight, memory_budget=min_memory_bytes(tight)))
    if kind == "muon":
        return solve(
            Problem(
                "1f1b", 2, 4, analytic_cost_table("bert-base", 2, 32, kind=PreconditionerKind.MUON), decomp_pieces=2
            ),
            method="greedy",
        )
    if kind == "zb":
        return solve(problem("zb-h1", 2, 2, curv=0.25, prec=0.25, max_overhead=0.5, max_period=8), method="greedy")
    return solve(problem("1f1b", 2, 2, W=2, layers=2, curv=0.25, inv=0.5), method="greedy")


def _first(plan: Plan, text: str, device: int = 0) -> Placement:
    return next(p for p in plan.placements if str(p.op) == text and p.device == device)


def _placements(plan: Plan, old: Placement, *new: Placement) -> Plan:
    """`plan` with `old` replaced by `new` (none: removed)."""
    i = plan.placements.index(old)
    return replace(plan, placements=plan.placements[:i] + new + plan.placements[i + 1 :])


def _shifted(plan: Plan, text: str, dt: float, device: int = 0, **fields: Any) -> Plan:
    p = _first(plan, text, device)
    return _placements(plan, p, replace(p, start=p.start + dt, end=p.end + dt, **fields))


def _step_of(plan: Plan, device: int, j: int, edit: Callable[[list[Op]], None]) -> Plan:
    """`plan` with `edit` applied to step `j` of `device`'s program."""
    steps = [list(ops) for ops in plan.programs[device]]
    edit(steps[j])
    return replace(plan, programs={**plan.programs, device: steps})


def _step(plan: Plan, device: int, edit: Callable[[list[Op]], None]) -> Plan:
    return _step_of(plan, device, 0, edit)


def _swap(ops: list[Op], a: str, b: str) -> None:
    i, j = (next(i for i, op in enumerate(ops) if str(op) == t) for t in (a, b))
    ops[i], ops[j] = ops[j], ops[i]


def _metrics(plan: Plan, **fields: Any) -> Plan:
    return replace(plan, metrics=replace(plan.metrics, **fields))


def _layer(plan: Plan, name: str, **fields: Any) -> Plan:
    return replace(plan, layers={**plan.layers, name: replace(plan.layers[name], **fields)})


def _longer(plan: Plan) -> Plan:
    p = _first(plan, "DECOMP s0 A l0_0")
    return _placements(plan, p, replace(p, end=p.end + 0.1))


def _twice(plan: Plan) -> Plan:
    p = _first(plan, "APPLY s0")
    return _placements(plan, p, p, p)


def _helper_changed(plan: Plan) -> Plan:
    """r2's last step without its OPT_STEP: no longer a repeat of its own period."""
    *steps, last = plan.programs[2]
    return replace(plan, programs={**plan.programs, 2: [*steps, [op for op in last if str(op) != "OPT_STEP"]]})


def _replica_first(plan: Plan) -> Plan:
    """The owner's step 2 sends block1's replica first, before the DECOMP that makes it."""
    return _step_of(plan, 0, 2, lambda ops: ops.insert(0, ops.pop(ops.index(Op.parse("SEND_REPLICA s0 >r3 block1")))))


def _decomposed_elsewhere(plan: Plan) -> Plan:
    p = _first(plan, "DECOMP s0 A l0_0")
    return _placements(plan, p, replace(p, device=1))


def _bcast_root(plan: Plan) -> Plan:
    for device in (0, 1):
        p = _first(plan, "BCAST s0 A @r0 l0_0", device)
        plan = _placements(plan, p, replace(p, op=replace(p.op, root=1)))
    return plan


BROKEN: dict[str, tuple[Callable[[Plan], Plan], str]] = {
    "cost": (_longer, "DECOMP s0 A l0_0 on r0: lasts 0.6 s, costs 0.5 s"),
    "count": (_twice, "APPLY s0 on (0, 0) placed 2 times, expected 1"),
    "window": (lambda plan: _shifted(plan, "APPLY s0", 0.0, step=5), "is not within window step 5 (k=2)"),
    "dependency": (lambda plan: _shifted(plan, "DECOMP s0 A l0_0", -2.0), "before the work it depends on ends"),
    "copies": (lambda plan: _shifted(plan, "SYNC_STATS s0 A l0_0", 0.005, 1), "the copies start it at different times"),
    "root": (_bcast_root, "broadcast of l0_0 A does not come from r0, where it was decomposed"),
    "use_offset": (
        lambda plan: _layer(plan, "l0_0", use_offset=2),
        "layer l0_0: use_offset 2 claimed, but its inverse is first usable at step 1",
    ),
    "apply": (lambda plan: _shifted(plan, "APPLY s0", -1.0), "APPLY s0 step 0 on r0 [8, 8.5) is outside [9, "),
    "overlap": (lambda plan: _shifted(plan, "STATS s0 m0 B l0_0", -4.0), "overlaps"),
    "peak": (lambda plan: _metrics(plan, peak_memory={**plan.metrics.peak_memory, 0: 0}), "r0: peak memory 0 claimed"),
    "step_time": (lambda plan: _metrics(plan, step_time=1.0), "step time 1 s claimed, 9.5 s found"),
    "stretch": (lambda plan: _metrics(plan, stretch=math.nan), "the step stretch must be a finite number"),
    "timing": (lambda plan: _layer(plan, "l1_0", curv_step=1), "layer l1_0: bad timing"),
    "layers": (
        lambda plan: replace(plan, layers={n: t for n, t in plan.layers.items() if n != "l1_1"}),
        "differ from the cost table's",
    ),
    "periods": (lambda plan: _metrics(plan, refresh_steps=(2,)), "1 refresh periods in the metrics for 2 stages"),
    "length": (
        lambda plan: replace(plan, programs={**plan.programs, 0: plan.programs[0][:1]}),
        "r0: the program must have 2 steps",
    ),
    "placed": (lambda plan: _step(plan, 0, lambda ops: ops.remove(Op.parse("APPLY s0"))), "placed ops differ"),
    "time_order": (
        lambda plan: _step(plan, 0, lambda ops: _swap(ops, "STATS s0 m0 A l0_0", "STATS s0 m0 A l0_1")),
        "r0: the program's placed ops are not in time order",
    ),
    "pipeline": (
        lambda plan: _step(plan, 0, lambda ops: _swap(ops, "SEND_ACT s0 m0 >r2", "SEND_ACT s0 m1 >r2")),
        "r0 step 0: the pipeline ops differ from the schedule's",
    ),
    "opt_step": (
        lambda plan: _step(plan, 2, lambda ops: _swap(ops, "OPT_STEP", "APPLY s1")),
        "r2 step 0: OPT_STEP is not the last op",
    ),
    "deadlock": (lambda plan: _step(plan, 0, lambda ops: ops.remove(Op.parse("SEND_ACT s0 m1 >r2"))), "deadlock"),
    "slower": (lambda plan: _metrics(plan, step_time=1.0), "the simulated programs take"),
    "late_bcast": (
        lambda plan: _shifted(plan, "BCAST s0 A @r0 l0_0", 19.0),
        "BCAST l0_0 A ends after the next refresh's DECOMP starts",
    ),
    "capture": (
        lambda plan: _shifted(plan, "STATS s0 m0 A l0_0", -1.5),
        "STATS s0 m0 A l0_0 on r0 starts at 0.5 before its FWD ends (1)",
    ),
    "kept": (lambda plan: _shifted(plan, "STATS s0 m0 A l0_0", 19.0), "keeps its a/e longer than one window"),
    "gradient/early": (
        lambda plan: _shifted(plan, "STATS s0 L l0_0", -5.0),
        "STATS s0 L l0_0 step 0 on r0 [4, 4.25) is outside [9, ",
    ),
    "gradient/late": (
        lambda plan: _shifted(plan, "STATS s0 R l0_0", 0.6),
        "STATS s0 R l0_0 on r0 at step 0 ends at 10.1, after APPLY s0 starts (9.5)",
    ),
    "gradient/snapshot": (
        lambda plan: _placements(plan, _first(plan, "STATS s0 L l0_0")),
        "DECOMP s0 L l0_0 on r0: no STATS of the refresh step on r0",
    ),
    "gradient/program": (
        lambda plan: _step(plan, 0, lambda ops: _swap(ops, "STATS s0 R l0_0", "APPLY s0")),
        "r0 step 0: 'STATS s0 R l0_0' does not come before the APPLY of its stage",
    ),
    "shared/row": (
        lambda plan: _shifted(plan, "BCAST_PREC s0 @r0 l0_0", 0.01, 1),
        "BCAST_PREC s0 @r0 l0_0 at step 0: the row starts it at different times",
    ),
    "shared/root": (
        lambda plan: _shifted(plan, "BCAST_PREC s0 @r0 l0_0", -0.1, 1),
        "BCAST_PREC s0 @r0 l0_0 on r1 at step 0 starts before r0 applied l0_0",
    ),
    "stream/repeats": (_helper_changed, "r2: the program repeats its own 4 steps but for streamed layers' replicas"),
    "stream/replica": (_replica_first, "r0 sends a replica of block1 before any DECOMP or BCAST of it there"),
    "curvature": (
        lambda plan: _shifted(plan, "DECOMP s0 A l0_0", 18.0),
        "DECOMP l0_0 A ends after the next refresh starts its curvature",
    ),
    "shared/worker": (
        _decomposed_elsewhere,
        "DECOMP s0 A l0_0 runs on r1, not a grad worker of l0_0 [0]",
    ),
    "fused/period": (
        lambda plan: _layer(plan, "l1_0", period=plan.layers["l1_0"].period + 1),
        "with fused curvature every layer must share one refresh period",
    ),
    "fused/folds": (
        lambda plan: _step(plan, 0, lambda ops: ops.remove(Op.parse("STATS s0 m0 A l0_0"))),
        "r0 step 0: 'B s0 m0' is not followed by the folds of its fused layers",
    ),
    "fused/fold_elsewhere": (
        lambda plan: _step(plan, 0, lambda ops: ops.insert(0, ops.pop(ops.index(Op.parse("STATS s0 m1 B l0_0"))))),
        "r0 step 0: 'STATS s0 m1 B l0_0' is not right after a",
    ),
    "muon/piece": (
        lambda plan: _shifted(plan, "APPLY s0 1/2 bert.embeddings.word_embeddings.weight", -0.0005),
        "'APPLY s0 1/2 bert.embeddings.word_embeddings.weight' on r0 step 0 does not follow its previous piece there",
    ),
    "zb/allreduce": (
        lambda plan: _step(plan, 0, lambda ops: _swap(ops, "W s0 m1 l0_0", "ALLREDUCE_GRAD s0")),
        "r0 step 0: 'ALLREDUCE_GRAD s0' comes before 'W s0 m1 l0_0' of its stage",
    ),
    "zb/moved": (
        lambda plan: _step(plan, 0, lambda ops: ops.remove(Op.parse("ALLREDUCE_GRAD s0"))),
        "r0 step 0: the gradient all-reduces differ from the schedule's",
    ),
}


@pytest.mark.parametrize("kind", ["kfac", "gradient", "shared", "zb", "stream", "fused", "muon"])
def test_the_plans_are_valid(kind: str) -> None:
    assert validate(_plan(kind).problem, _plan(kind)) == []


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_plan_is_refused_with_its_rule(case: str) -> None:
    breaking, message = BROKEN[case]
    plan = breaking(_plan(case.split("/")[0] if "/" in case else "kfac"))
    errors = validate(plan.problem, plan)
    assert any(message in e for e in errors), errors


def test_a_plan_for_another_problem_is_refused() -> None:
    plan = _plan()
    assert "the plan was made for another problem" in validate(replace(plan.problem, N=4), plan)


def test_memory_over_the_budget_is_refused() -> None:
    plan = _plan()
    tight = replace(plan.problem, memory_budget=100)
    errors = validate(tight, replace(plan, problem=tight))
    assert any(e.startswith("r0: memory peaks at 3340 bytes, over the budget of 100") for e in errors), errors
