"""The zero-bubble schedules in the planner: the split backward's times, the W's operands in memory, and plans on
ZB-H1, ZB-V and interleaved zero bubble checked by the independent validator and against the lower bound."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fxkfac.planner.problem.ir import Capture, OpKind
from fxkfac.planner.problem.problem import SolverConfig
from fxkfac.planner.problem.schedules import stages_of_rank
from fxkfac.planner.problem.step_timeline import (
    activation_intervals,
    activation_peak,
    min_memory_bytes,
    plain_step_time,
    step_timeline,
)
from fxkfac.planner.search.attempt import solve
from fxkfac.planner.validate import validate
from tests.planner.kfac_cases import problem

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
