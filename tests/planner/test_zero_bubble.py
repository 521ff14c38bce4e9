"""The zero-bubble schedules in the planner: the split backward's times, the W's operands in memory, and plans on
ZB-H1, ZB-V and interleaved zero bubble checked by the independent validator and against the lower bound."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings

from fxkfac.planner.plan import window
from fxkfac.planner.plan.plan import Plan
from fxkfac.planner.problem.costs import CostTable, LayerCost, StageCost
from fxkfac.planner.problem.errors import PlanError
from fxkfac.planner.problem.ir import Capture, OpKind, Placement
from fxkfac.planner.problem.problem import Problem, SolverConfig
from fxkfac.planner.problem.schedules import stages_of_rank
from fxkfac.planner.problem.step_timeline import (
    activation_intervals,
    activation_peak,
    min_memory_bytes,
    plain_step_time,
    step_timeline,
    w_operand_bytes,
)
from fxkfac.planner.search.attempt import solve
from fxkfac.planner.validate import validate
from tests.planner.kfac_cases import ZERO_BUBBLE, problem, problems

FAST = SolverConfig(time_limit_s=4.0, num_workers=2)


@pytest.mark.parametrize("D,N", [(2, 4), (4, 4), (4, 8), (3, 7)])
def test_zb_h1_cuts_1f1b_bubble_to_f_plus_b_minus_w_per_hop(D: int, N: int) -> None:
    """Qi et al.'s ZB-H1: with F = B = W (a backward of 2) 1F1B idles (D-1)(F+B+W) per step, ZB-H1 (D-1)(F+B-W),
    a third."""
    one_f_one_b, zb = (plain_step_time(problem(kind, D, N, fwd=1.0, bwd=2.0)) for kind in ("1f1b", "zb-h1"))
    assert one_f_one_b == pytest.approx(3 * N + 3 * (D - 1))
    assert zb == pytest.approx(3 * N + (D - 1))


def test_a_zero_bubble_w_takes_its_share_of_the_backward() -> None:
    p = problem("zb-h1", 2, 2, fwd=1.0, bwd=3.0)
    ops = step_timeline(p, with_prec=False).ops[1]
    times = {op.kind: end - start for op, start, end in ops if op.kind in (OpKind.FWD, OpKind.BWD, OpKind.BWD_W)}
    assert times == {OpKind.FWD: 1.0, OpKind.BWD: 1.5, OpKind.BWD_W: 1.5}  # unmeasured wgrad: half the backward


def test_a_deferred_w_keeps_its_layers_operands_until_it_runs() -> None:
    """Each layer's input and output gradient (the `keep` bytes of each K-FAC part) stay from the B's end to the W's,
    on top of the activations 1F1B holds."""
    zb = problem("zb-h1", 4, 8, keep=10, act=50)
    spans = activation_intervals(zb, 3, step_timeline(zb))
    assert sorted({nbytes for _, _, nbytes in spans}) == [20, 50]
    one_f_one_b = problem("1f1b", 4, 8, keep=10, act=50)
    # the last rank holds back 3 W's: one micro-batch's activations plus three W's operands
    assert activation_peak(zb, 3) == 50 + 3 * 20 > activation_peak(one_f_one_b, 3) == 50


@pytest.mark.parametrize(
    "kind,D,N,v",
    [("zb-h1", 2, 4, 1), ("zb-h1", 4, 6, 1), ("zb-v", 2, 4, 2), ("zb-v", 3, 5, 2), ("zb-1p", 2, 4, 2)],
)
@pytest.mark.parametrize("method", ["greedy", "cpsat"])
def test_plans_on_zero_bubble_schedules_validate_and_keep_the_lower_bound(
    kind: str, D: int, N: int, v: int, method: str
) -> None:
    p = problem(kind, D, N, v=v, fwd=1.0, bwd=2.0, curv=0.25, inv=1.0, prec=0.25, max_overhead=0.5, max_period=8)
    plan = solve(p, FAST, method)
    assert validate(plan.problem, plan) == []
    assert all(lb <= k for lb, k in zip(plan.metrics.lower_bound_steps, plan.metrics.refresh_steps, strict=True))
    for rank, program in plan.programs.items():  # every step runs the W of each micro-batch of each stage held
        held = {s for s, _ in stages_of_rank(kind, D, rank, v=v)}
        for step in program:
            assert sorted((op.stage, op.mb) for op in step if op.kind is OpKind.BWD_W) == [
                (s, m) for s in sorted(held) for m in range(N)
            ]


@pytest.mark.parametrize("kind,D,N,v", [("zb-h1", 2, 4, 1), ("zb-v", 2, 4, 2)])
def test_a_fused_layer_folds_its_curvature_after_its_w(kind: str, D: int, N: int, v: int) -> None:
    """Under the least memory every layer's curvature is fused: made with the W (one task on one copy of the
    operands), its STATS folded right after the W at the refresh step."""
    base = problem(kind, D, N, v=v, fwd=1.0, bwd=2.0, curv=0.25, inv=1.0, keep=40, max_overhead=0.5, max_period=8)
    plan = solve(replace(base, memory_budget=min_memory_bytes(base)), FAST, "cpsat")
    assert {t.capture for t in plan.layers.values()} == {Capture.FUSED}
    assert validate(plan.problem, plan) == []
    for program in plan.programs.values():
        refresh = program[0]
        for i, op in enumerate(refresh):
            if op.kind is OpKind.STATS and op.mb is not None:
                anchor = next(o for o in reversed(refresh[:i]) if o.kind is not OpKind.STATS)
                assert (anchor.kind, anchor.stage, anchor.mb) == (OpKind.BWD_W, op.stage, op.mb)


def _uneven_zb_h1() -> Problem:
    """ZB-H1 on 2 ranks, N=2: stage 0 (F 1 s, B 1 s, W 2 s, one layer whose decompositions take 4 s each) waits
    4 s, then 2 s, for stage 1's long B (4 s; W 3 s)."""

    def stage(s: int, bwd: float, wgrad: float, inv: float) -> StageCost:
        layer = LayerCost.kfac(f"s{s}.l0", 0.125, 0.125, inv, inv, 0.125, 10, 10, 100, 100)
        return StageCost(1.0, bwd, 1000, 50, (layer,), wgrad=wgrad)

    return Problem("zb-h1", 2, 2, CostTable((stage(0, 3.0, 2.0, 4.0), stage(1, 7.0, 3.0, 0.125)), 1, "t", "cpu"))


def test_a_w_moves_where_it_joins_bubbles_for_a_decomposition() -> None:
    """At the schedule's places rank 0's bubbles are 4 s (waiting for m0's gradient), 2 s (for m1's, after W m0) and
    3 s (after its update): two 4 s decompositions need two steps. Deferring W m0 past B m1 joins its 2 s with the
    2 s bubble after it, so the plan refreshes at every step."""
    p = _uneven_zb_h1()
    plan = solve(p, FAST, "cpsat")
    assert plan.metrics.refresh_steps == (1, 1)
    assert validate(p, plan) == []
    placed = {(x.op.stage, x.op.mb, x.step): x for x in plan.placements if x.op.kind is OpKind.BWD_W}
    b_m1 = next(b for op, _, b in step_timeline(p, refresh=True).ops[0] if str(op) == "B s0 m1")
    assert placed[0, 0, 0].start >= b_m1


def test_the_validator_refuses_a_w_before_its_b_or_after_its_update() -> None:
    p = _uneven_zb_h1()
    plan = solve(p, FAST, "cpsat")
    w = next(x for x in plan.placements if x.op.kind is OpKind.BWD_W and x.device == 0)
    for shift, words in ((-20.0, "is not between its B"), (20.0, "is not between its B")):
        moved = replace(w, start=w.start + shift, end=w.end + shift)
        placements = tuple(moved if x is w else x for x in plan.placements)
        assert any(words in e for e in validate(p, replace(plan, placements=placements), run=False))


def _two_layer_zb_h1() -> Problem:
    """`_uneven_zb_h1` with two layers a stage: l1 has twice l0's parameters and operands, and quick decompositions."""

    def stage(s: int, bwd: float, wgrad: float, inv: float) -> StageCost:
        layers = tuple(
            LayerCost.kfac(
                f"s{s}.l{i}",
                0.125,
                0.125,
                inv if i == 0 else 0.125,
                inv if i == 0 else 0.125,
                0.125,
                10 * (i + 1),
                10 * (i + 1),
                100,
                100,
                grad_bytes=100 * (i + 1),
            )  # fmt: skip
            for i in range(2)
        )
        return StageCost(1.0, bwd, 1000, 50, layers, wgrad=wgrad)

    costs = CostTable((stage(0, 3.0, 2.0, 4.0), stage(1, 7.0, 3.0, 0.125)), 1, "t", "cpu")
    return Problem("zb-h1", 2, 2, costs, max_overhead=0.5)


@pytest.mark.parametrize("method", ["greedy", "cpsat"])
def test_placed_ws_are_one_per_layer_with_its_share_and_its_operands(method: str) -> None:
    """A stage's W is planned as one W per layer ("W s0 m1 s0.l1"): each in every step's program once, lasting its
    layer's share of the stage's W (by parameters: l1 twice l0) plus its own fused curvature, holding its own layer's
    operands; the plan validates."""
    p = _two_layer_zb_h1()
    stage = p.costs.stages[0]
    assert [w_operand_bytes(stage, x.name) for x in stage.layers] == [20, 40]
    assert w_operand_bytes(stage) == 60
    plan = solve(p, FAST, method)
    assert validate(p, plan) == []
    for rank, program in plan.programs.items():
        (held,) = {s for s, _ in stages_of_rank("zb-h1", 2, rank)}
        for step in program:
            ws = sorted(str(op) for op in step if op.kind is OpKind.BWD_W)
            assert ws == [f"W s{held} m{m} s{held}.l{i}" for m in range(2) for i in range(2)]
    fused = {n for n, t in plan.layers.items() if t.capture is Capture.FUSED}
    for x in plan.placements:
        if x.op.kind is OpKind.BWD_W:
            s = p.costs.stages[x.op.stage_id]
            curvature = s.fused_curvature({x.op.layer_name} & fused, OpKind.BWD) if x.step == 0 else 0.0
            share = (1 if x.op.layer_name.endswith("l0") else 2) / 3
            assert x.end - x.start == pytest.approx(share * s.weight_grad + curvature, abs=0.01), x  # cut at 1/100 s


def test_the_validator_refuses_a_per_layer_w_before_its_b_or_after_its_update() -> None:
    p = _two_layer_zb_h1()
    plan = solve(p, FAST, "cpsat")
    w = next(x for x in plan.placements if x.op.kind is OpKind.BWD_W and x.op.layer == "s0.l1" and x.device == 0)
    for shift in (-20.0, 20.0):
        moved = replace(w, start=w.start + shift, end=w.end + shift)
        placements = tuple(moved if x is w else x for x in plan.placements)
        errors = validate(p, replace(plan, placements=placements), run=False)
        assert any(str(w.op) in e and "is not between its B" in e for e in errors), errors


def test_too_many_per_layer_ws_are_placed_a_stage_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the per-layer W's of the longest window would pass `MAX_W_TASKS`, the plan places one W per stage."""
    p = _two_layer_zb_h1()
    monkeypatch.setattr(window, "MAX_W_TASKS", p.N * p.num_stages * p.max_period)
    plan = solve(p, FAST, "cpsat")
    assert validate(p, plan) == []
    placed = [x.op for x in plan.placements if x.op.kind is OpKind.BWD_W]
    assert placed and all(op.layer is None for op in placed)


def _timed_layer_w(p: Problem, pieces: dict[str, float]) -> Problem:
    """`p` with each layer's measured W piece (`LayerCost.wgrad`, seconds): less in all than its stage's W, which
    also holds the shared piece."""
    stages = tuple(replace(s, layers=tuple(replace(x, wgrad=pieces[x.name]) for x in s.layers)) for s in p.costs.stages)
    return replace(p, costs=replace(p.costs, stages=stages))


@pytest.mark.parametrize("method", ["greedy", "cpsat"])
def test_measured_per_layer_ws_last_their_share_of_the_stages_w(method: str) -> None:
    """Where every layer of a stage has its W piece measured, its W task lasts the piece's share of the layers'
    (the shared piece spread over them so; l0 three times l1, against its parameters' half) of the stage's W, plus
    its fused curvature; the plan validates, and a W lasting its parameters' share instead is refused."""
    p = _timed_layer_w(_two_layer_zb_h1(), {"s0.l0": 1.2, "s0.l1": 0.4, "s1.l0": 2.1, "s1.l1": 0.7})
    plan = solve(p, FAST, method)
    assert validate(p, plan) == []
    fused = {n for n, t in plan.layers.items() if t.capture is Capture.FUSED}
    ws = [x for x in plan.placements if x.op.kind is OpKind.BWD_W]
    assert {x.op.layer for x in ws} == {"s0.l0", "s0.l1", "s1.l0", "s1.l1"}
    for x in ws:
        s = p.costs.stages[x.op.stage_id]
        curvature = s.fused_curvature({x.op.layer_name} & fused, OpKind.BWD) if x.step == 0 else 0.0
        share = 3 / 4 if x.op.layer_name.endswith("l0") else 1 / 4
        assert x.end - x.start == pytest.approx(share * s.weight_grad + curvature, abs=0.01), x  # cut at 1/100 s
    w = next(x for x in ws if x.op.layer == "s0.l0")
    by_parameters = replace(w, end=w.end - (3 / 4 - 1 / 3) * p.costs.stages[0].weight_grad)
    placements = tuple(by_parameters if x is w else x for x in plan.placements)
    errors = validate(p, replace(plan, placements=placements), run=False)
    assert any(str(w.op) in e and "lasts" in e for e in errors), errors


def test_measured_per_layer_ws_in_the_parameters_proportion_plan_as_a_table_without_them() -> None:
    """A table without per-layer W times (every table before them) plans its W's by parameters; one whose
    measured pieces are in that proportion plans the same W's, at the same places."""
    old = _two_layer_zb_h1()
    timed = _timed_layer_w(old, {"s0.l0": 0.5, "s0.l1": 1.0, "s1.l0": 0.9, "s1.l1": 1.8})
    plans = [solve(p, FAST, "greedy") for p in (old, timed)]
    assert plans[0].programs == plans[1].programs
    assert plans[0].placements == plans[1].placements


def _output_gradient(p: Problem, x: Placement) -> bool:
    """Whether `x` is a micro-batch's STATS of a capture taken after the backward (K-FAC's output gradient G)."""
    return (
        x.op.kind is OpKind.STATS
        and x.op.mb is not None
        and p.costs.layer(x.op.layer_name).part(x.op.part_name).after is OpKind.BWD
    )


def _deferred_zb_h1(layers: int) -> Problem:
    """ZB-H1 on 4 ranks, N = 2 (each rank's W's wait), `layers` K-FAC layers a stage, deferred curvature."""
    return problem(
        "zb-h1", 4, 2, layers=layers, fwd=1.0, bwd=2.0, curv=0.25, inv=1.0, prec=0.25, max_overhead=0.5, max_period=8
    )


def _read_before_w(p: Problem, plan: Plan) -> list[str]:
    """The STATS of an output gradient that start before the refresh step's W making it ends (its rank's W of its
    micro-batch naming its layer or none: placed, else at the schedule's place), or that come between the
    micro-batch's B and that W in the refresh step's program: each would have B make the gradient, running the
    stage's backward chain, which no plan prices."""
    tol = plan.metrics.time_quantum + 1e-9
    fused = frozenset(n for n, t in plan.layers.items() if t.capture is Capture.FUSED)
    refresh = step_timeline(p, fused, refresh=True)
    placed = [(x.device, x.op, x.end) for x in plan.placements if x.op.kind is OpKind.BWD_W and x.step == 0]
    fixed = [(d, op, end) for d in refresh.ops for op, _, end in refresh.ops[d] if op.kind is OpKind.BWD_W]
    out = []
    for x in plan.placements:
        if not _output_gradient(p, x):
            continue
        key = (x.device, x.op.stage, x.op.mb, x.op.pipe)
        ends = [
            end for d, w, end in placed or fixed if (d, w.stage, w.mb, w.pipe) == key and w.layer in (None, x.op.layer)
        ]
        if not ends or x.start < max(ends) - tol:
            out.append(f"{x.op} on r{x.device} at {x.start}")
    for rank, program in plan.programs.items():
        backward: set[tuple[int | None, int | None, int]] = set()
        made: set[tuple[int | None, int | None, int, str | None]] = set()
        for op in program[0]:
            key = (op.stage, op.mb, op.pipe)
            if op.kind is OpKind.BWD:
                backward.add(key)
            elif op.kind is OpKind.BWD_W:
                made.add((*key, op.layer))
            elif op.kind is OpKind.STATS and op.mb is not None and op.part == "B" and key in backward:
                if not {(*key, None), (*key, op.layer)} & made:
                    out.append(f"r{rank} program: {op}")
    return out


@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("method", ["greedy", "cpsat"])
def test_an_output_gradients_stats_starts_after_the_w_that_makes_it(method: str, layers: int) -> None:
    """A deferred layer's output gradient is made by its micro-batch's W (of its layer, [Note: per-layer W]): its
    STATS are placed after that W and follow it in the refresh step's program, never between its B and W (with two
    layers first-fit placed 4 there, CP-SAT 2, before the rule)."""
    p = _deferred_zb_h1(layers)
    plan = solve(p, FAST, method)
    assert validate(p, plan) == []
    assert any(_output_gradient(p, x) for x in plan.placements)
    assert _read_before_w(p, plan) == []


@pytest.mark.parametrize("method", ["greedy", "cpsat"])
def test_an_output_gradients_stats_follows_a_w_at_the_schedules_place(
    monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    """Where plans do not place W's (too many for the window), each W runs at the schedule's place and the STATS of
    what it makes are released at its end."""
    p = _deferred_zb_h1(2)
    monkeypatch.setattr(window, "MAX_W_TASKS", 0)
    plan = solve(p, FAST, method)
    assert not any(x.op.kind is OpKind.BWD_W for x in plan.placements)
    assert validate(p, plan) == []
    assert any(_output_gradient(p, x) for x in plan.placements)
    assert _read_before_w(p, plan) == []


@settings(max_examples=5, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(ZERO_BUBBLE))
def test_no_random_zero_bubble_plan_reads_an_output_gradient_before_its_w(p: Problem) -> None:
    """First-fit and CP-SAT on random ZB-H1, ZB-V and ZB-1P problems (copies, budgets): valid plans that read no
    output gradient before its W (the golden set holds no zero-bubble problem)."""
    for method in ("greedy", "cpsat"):
        try:
            plan = solve(p, FAST, method)
        except PlanError:
            continue
        assert validate(p, plan) == []
        assert _read_before_w(p, plan) == []


def test_the_validator_refuses_an_output_gradients_stats_before_its_w() -> None:
    """A STATS of an output gradient moved to its B's end, before the W making it ends, is refused with what to do."""
    p = _deferred_zb_h1(2)
    plan = solve(p, FAST, "cpsat")
    stats = next(x for x in plan.placements if _output_gradient(p, x) and x.step == 0)
    fused = frozenset(n for n, t in plan.layers.items() if t.capture is Capture.FUSED)
    b = f"B s{stats.op.stage} m{stats.op.mb}"
    b_end = next(end for op, _, end in step_timeline(p, fused, refresh=True).ops[stats.device] if str(op) == b)
    moved = replace(stats, start=b_end, end=b_end + stats.end - stats.start)
    errors = validate(
        p, replace(plan, placements=tuple(moved if x is stats else x for x in plan.placements)), run=False
    )
    words = ("before the W that makes its output gradient ends", "place it after that W")
    assert any(str(stats.op) in e and all(w in e for w in words) for e in errors), errors
