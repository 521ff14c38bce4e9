"""Parts fed by the reduced gradient (Shampoo's and SOAP's L and R): planned, lowered, checked and simulated.

The programs are checked against the runtime's contract (fxkfac/runtime/preconditioning.py) by a small
independent interpreter of it: a gradient STATS folds at every step between the stage's gradient and its APPLY,
snapshots at a refresh step, and a DECOMP decomposes the oldest snapshot.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path

import pytest

from fxkfac.planner.plan.plan import Plan
from fxkfac.planner.problem.costs import CostTable, StageCost
from fxkfac.planner.problem.errors import InfeasibleBudgetError, PlanFormatError
from fxkfac.planner.problem.ir import LayerTiming, Op, OpKind, Program, ops_at
from fxkfac.planner.problem.lowering import naive_programs
from fxkfac.planner.problem.problem import Problem, SolverConfig
from fxkfac.planner.problem.schedules import num_stages
from fxkfac.planner.problem.step_timeline import min_memory_bytes, simulate
from fxkfac.planner.search.attempt import solve
from fxkfac.planner.validate import validate
from fxkfac.planner.validate.plan_file import load_plan
from tests.planner.kfac_cases import gradient_layer

FAST = SolverConfig(time_limit_s=3.0, num_workers=2)

CASES = {
    "gpipe": ("gpipe", 2, 2, 1, 0.0),
    "1f1b": ("1f1b", 4, 4, 1, 0.0),
    "1f1b-W2": ("1f1b", 2, 2, 2, 0.0),
    # Chimera's second all-reduce waits for the first stage's statistics and APPLY; the window blocks the tick
    # before an all-reduce, so both slots go after it and the step must grow a little (planner/plan/window.py notes)
    "chimera": ("chimera", 4, 4, 1, 0.1),
}
"""Tiny problems: (schedule, D, N, W, max_overhead), two Shampoo-like layers per stage."""


def _problem(
    schedule: str,
    D: int,
    N: int,
    W: int = 1,
    max_overhead: float = 0.0,
    *,
    optimizer: int = 0,
    captured: bool = False,
    budget: int | None = None,
) -> Problem:
    stages = tuple(
        StageCost(
            1.0,
            2.0,
            1000,
            50,
            tuple(gradient_layer(f"l{s}_{i}", optimizer=optimizer, captured=captured) for i in range(2)),
        )
        for s in range(num_stages(schedule, D))
    )
    return Problem(
        schedule, D, N, CostTable(stages, 1, "test", "cpu"), W=W, max_overhead=max_overhead, memory_budget=budget
    )


@cache
def _plan(case: str, method: str) -> Plan:
    return solve(_problem(*CASES[case]), FAST, method)


def _gradient_parts(problem: Problem) -> dict[int, list[tuple[str, str]]]:
    """Per stage, its (layer, part) fed by the reduced gradient."""
    return {
        s: [(x.name, p.part) for x in stage.layers for p in x.parts if p.after is OpKind.ALLREDUCE_GRAD]
        for s, stage in enumerate(problem.costs.stages)
    }


def _order_errors(problem: Problem, ops: list[Op], where: str) -> list[str]:
    """Each gradient STATS of a stage this step's ops run, exactly once, after the stage's last BWD and
    ALLREDUCE_GRAD and before its APPLY."""
    errors = []
    for s, parts in _gradient_parts(problem).items():
        positions = [i for i, op in enumerate(ops) if op.kind is OpKind.APPLY and op.stage == s]
        if not positions:
            continue
        ready = max(i for i, op in enumerate(ops) if op.stage == s and op.kind in (OpKind.BWD, OpKind.ALLREDUCE_GRAD))
        for layer, part in parts:
            found = [i for i, op in enumerate(ops) if op == Op(OpKind.STATS, s, layer=layer, part=part)]
            if len(found) != 1 or not ready < found[0] < positions[0]:
                errors.append(
                    f"{where}: STATS s{s} {part} {layer} at {found}, gradient ready at {ready}, APPLY at {positions[0]}"
                )
    return errors


@dataclass
class _Record:
    """One refresh of one layer on one rank, as the runtime keeps it."""

    step: int
    folded: set[str] = field(default_factory=set)
    halves: set[str] = field(default_factory=set)


@dataclass
class _Rank:
    """The refresh records of one rank and what each op does to them (the runtime's contract, see the module
    doc); each method returns the contract's violation, or ''."""

    problem: Problem
    timings: Mapping[str, LayerTiming]
    rank: int
    records: dict[str, deque[_Record]] = field(default_factory=dict)

    def begin(self, t: int) -> None:
        """Open the records of the layers refreshing at step t."""
        for name, timing in self.timings.items():
            if t % timing.period == timing.curv_step:
                self.records.setdefault(name, deque()).append(_Record(t))

    def run(self, op: Op, t: int) -> str:
        """What `op` of step t does: a gradient STATS folds (and snapshots at its refresh step), a DECOMP or a
        received BCAST decomposes, an APPLY needs every due preconditioner made."""
        layer, part = op.layer or "", op.part or ""
        if op.kind is OpKind.STATS and op.mb is None:
            for record in self.records.get(layer, ()):
                if record.step == t:
                    record.folded.add(part)
        elif op.kind is OpKind.DECOMP or (op.kind is OpKind.BCAST and op.root != self.rank):
            return self._decomposed(op, layer, part)
        elif op.kind is OpKind.APPLY:
            stage = self.problem.costs.stages[op.stage or 0]
            late = [
                (x.name, r.step)
                for x in stage.layers
                for r in self.records.get(x.name, ())
                if r.step + self.timings[x.name].use_offset <= t
            ]
            return f"preconditioners {late} are due but not made" if late else ""
        return ""

    def _decomposed(self, op: Op, layer: str, part: str) -> str:
        """A DECOMP (or a received BCAST) gives the oldest record without it its part's decomposition."""
        waiting = [r for r in self.records.get(layer, ()) if part not in r.halves]
        if not waiting:
            return "no refresh to act on"
        gradient = self.problem.costs.layer(layer).part(part).after is OpKind.ALLREDUCE_GRAD
        if op.kind is OpKind.DECOMP and gradient and part not in waiting[0].folded:
            return f"decomposes the refresh of step {waiting[0].step} before its STATS"
        waiting[0].halves.add(part)
        queue = self.records[layer]
        while queue and queue[0].halves == {p.part for p in self.problem.costs.layer(layer).parts}:
            queue.popleft()
        return ""


def _contract_errors(
    problem: Problem,
    timings: Mapping[str, LayerTiming],
    programs: Mapping[int, Program],
    startup: Mapping[int, Program],
    steps: int,
) -> list[str]:
    """Every violation of the runtime's contract when every rank runs `steps` steps (start-up steps first)."""
    errors: list[str] = []
    for rank in programs:
        state = _Rank(problem, timings, rank)
        for t in range(steps):
            state.begin(t)
            errors += [
                f"r{rank} step {t} '{op}': {e}" for op in ops_at(programs, startup, rank, t) if (e := state.run(op, t))
            ]
    return errors


@pytest.mark.parametrize("method", ["cpsat", "greedy"])
@pytest.mark.parametrize("case", list(CASES))
def test_plans_with_gradient_parts_pass_the_validator(case: str, method: str) -> None:
    plan = _plan(case, method)
    assert validate(plan.problem, plan) == []
    assert not any(p.op.kind is OpKind.SYNC_STATS for p in plan.placements)  # every copy folds the same gradient
    assert all(t.use_offset >= 1 for t in plan.layers.values())  # a refresh snapshots at its own step's end


@pytest.mark.parametrize("method", ["cpsat", "greedy"])
@pytest.mark.parametrize("case", list(CASES))
def test_gradient_stats_run_every_step_after_the_gradient_and_before_apply(case: str, method: str) -> None:
    plan = _plan(case, method)
    errors = []
    for rank in plan.programs:
        steps = len(plan.startup.get(rank, [])) + 2 * len(plan.programs[rank])
        for t in range(steps):
            errors += _order_errors(plan.problem, ops_at(plan.programs, plan.startup, rank, t), f"r{rank} step {t}")
    assert errors == []


@pytest.mark.parametrize("method", ["cpsat", "greedy"])
@pytest.mark.parametrize("case", list(CASES))
def test_decompositions_follow_their_refresh_steps_statistics(case: str, method: str) -> None:
    plan = _plan(case, method)
    steps = 4 * max(len(p) for p in plan.programs.values()) + max(map(len, plan.startup.values()), default=0)
    assert _contract_errors(plan.problem, plan.layers, plan.programs, plan.startup, steps) == []


def test_contract_check_catches_a_decomposition_before_its_statistics() -> None:
    plan = _plan("gpipe", "cpsat")
    rank = next(r for r, prog in plan.programs.items() if any(op.kind is OpKind.DECOMP for op in prog[0]))
    steps = [list(step) for step in plan.programs[rank]]
    decomp = next(op for op in steps[0] if op.kind is OpKind.DECOMP)
    steps[0].remove(decomp)
    steps[0].insert(0, decomp)
    programs = {**plan.programs, rank: steps}
    assert _contract_errors(plan.problem, plan.layers, programs, {}, 6) != []
    moved = replace(plan, programs=programs)
    assert any("wrong order" in e or "not in time order" in e for e in validate(plan.problem, moved))


def test_naive_programs_fold_gradient_statistics_every_step() -> None:
    p = _problem("1f1b", 2, 2, W=2)
    timings = {name: replace(t, use_offset=0) for name, t in _plan("1f1b-W2", "greedy").layers.items()}
    stage_layers = {s: [x.name for x in stage.layers] for s, stage in enumerate(p.costs.stages)}
    programs = naive_programs("1f1b", 2, 2, 2, timings, stage_layers, parts=("L", "R"), gradient_parts=frozenset("LR"))
    assert [
        e for r, prog in programs.items() for j, ops in enumerate(prog) for e in _order_errors(p, ops, f"r{r} step {j}")
    ] == []
    assert _contract_errors(p, timings, programs, {}, 3 * len(programs[0])) == []


def test_validator_refuses_statistics_after_apply() -> None:
    plan = _plan("1f1b-W2", "cpsat")
    step = list(plan.programs[0][0])
    stats = next(op for op in step if op.kind is OpKind.STATS)
    step.remove(stats)
    step.insert(step.index(Op(OpKind.OPT_STEP)), stats)
    programs = {**plan.programs, 0: [step, *plan.programs[0][1:]]}
    assert any("not in time order" in e for e in validate(plan.problem, replace(plan, programs=programs)))
    placed = next(p for p in plan.placements if p.op == stats and (p.device, p.step) == (0, 0))
    apply = next(p for p in plan.placements if p.op == Op(OpKind.APPLY, stats.stage) and (p.device, p.step) == (0, 0))
    late = replace(placed, start=apply.end, end=apply.end + placed.end - placed.start)
    moved = replace(plan, programs=programs, placements=tuple(late if p is placed else p for p in plan.placements))
    errors = validate(plan.problem, moved)
    assert any(str(stats) in e and "after APPLY" in e for e in errors), errors
    assert any(str(stats) in e and "does not come before the APPLY" in e for e in errors), errors


def test_validator_refuses_a_decomposition_placed_before_the_refresh_statistics() -> None:
    plan = _plan("gpipe", "cpsat")
    decomp = next(p for p in plan.placements if p.op.kind is OpKind.DECOMP and p.step == 0)
    early = replace(decomp, start=0.0, end=decomp.end - decomp.start)
    placements = tuple(early if p is decomp else p for p in plan.placements)
    errors = validate(plan.problem, replace(plan, placements=placements), run=False)
    assert any("before the refresh step's STATS" in e for e in errors), errors


def test_plan_with_gradient_parts_round_trips_through_a_file(tmp_path: Path) -> None:
    plan = _plan("chimera", "cpsat")
    path = tmp_path / "plan.json"
    plan.save(path)
    assert load_plan(path) == plan


def test_loader_refuses_a_gradient_statistic_with_a_micro_batch(tmp_path: Path) -> None:
    plan = _plan("gpipe", "greedy")
    text = plan.to_json().replace('"op": "STATS s0 L l0_0"', '"op": "STATS s0 m0 L l0_0"', 1)
    path = tmp_path / "plan.json"
    path.write_text(text)
    with pytest.raises(PlanFormatError, match="no micro-batch"):
        load_plan(path)


def test_memory_counts_the_optimizer_state() -> None:
    base = _problem("1f1b", 2, 2)
    heavy = _problem("1f1b", 2, 2, optimizer=700)
    # rank 0: 2 stages' worth of nothing else changes; two layers of 700 bytes each on every device
    assert min_memory_bytes(heavy) - min_memory_bytes(base) == 2 * 700
    need = min_memory_bytes(heavy)
    # independent count for rank 0: params+grads, 2 layers x 2 parts x (statistic + two decompositions: the
    # active one and the next), optimizer state, 2 micro-batches of activations in flight
    assert need == 2 * 1000 + 2 * 2 * 3 * 100 + 2 * 700 + 2 * 50
    plan = solve(replace(heavy, memory_budget=need), FAST)
    assert validate(plan.problem, plan) == [] and max(plan.metrics.peak_memory.values()) == need
    with pytest.raises(InfeasibleBudgetError, match=f"{need} bytes.*optimizer state") as info:
        solve(replace(heavy, memory_budget=need - 1), FAST)
    assert info.value.needed_bytes == need


@pytest.mark.parametrize("case", ["gpipe", "1f1b", "1f1b-W2"])
def test_simulated_step_time_equals_the_planned(case: str) -> None:
    plan = _plan(case, "cpsat")
    costs = plan.problem.costs
    parts = {(x.name, p.part): p for stage in costs.stages for x in stage.layers for p in x.parts}

    def duration(rank: int, op: Op) -> float:
        stage = costs.stages[op.stage] if op.stage is not None else None
        if stage is not None and op.kind in (OpKind.FWD, OpKind.BWD, OpKind.APPLY):
            return {OpKind.FWD: stage.fwd, OpKind.BWD: stage.bwd, OpKind.APPLY: stage.prec}[op.kind]
        if op.kind in (OpKind.STATS, OpKind.DECOMP):
            part = parts[op.layer, op.part]  # type: ignore[index]  # planned ops name both
            return part.stats if op.kind is OpKind.STATS else part.decomp
        return 0.0

    periods = 3 * max(len(p) for p in plan.programs.values())
    timeline = simulate(plan.programs, duration, steps=periods)
    assert timeline.length == pytest.approx(periods * plan.metrics.step_time)
    assert plan.metrics.step_time == pytest.approx(plan.metrics.step_time_reference)


def test_layers_mixing_captured_and_gradient_parts_plan_validly() -> None:
    p = _problem("1f1b", 2, 2, W=2, captured=True)
    for method in ("greedy", "cpsat"):
        plan = solve(p, FAST, method)
        assert validate(p, plan) == []
        synced = {p.op.part for p in plan.placements if p.op.kind is OpKind.SYNC_STATS}
        assert synced == {"B"}  # only the captured part is summed over the copies
        steps = 4 * max(len(q) for q in plan.programs.values()) + max(map(len, plan.startup.values()), default=0)
        assert _contract_errors(p, plan.layers, plan.programs, plan.startup, steps) == []
