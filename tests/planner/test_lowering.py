"""Lowering passes on string programs; lowered schedules run deadlock-free with the same timeline."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fxkfac.planner.plan.solution import born_steps
from fxkfac.planner.problem.ir import LayerTiming, Op, OpKind, ops_at
from fxkfac.planner.problem.lowering import Assignment, add_send_recv, expand_dp, naive_programs, startup_programs
from fxkfac.planner.problem.schedules import schedule_programs
from fxkfac.planner.problem.step_timeline import COMPUTE_KINDS, simulate


def _ops(lines: str) -> list[Op]:
    return [Op.parse(line) for line in lines.strip().splitlines()]


def _text(ops: list[Op]) -> list[str]:
    return [str(op) for op in ops]


def test_1f1b_d2_string_program() -> None:
    lowered = add_send_recv(schedule_programs("1f1b", 2, 2), "1f1b", 2)
    assert _text(lowered[0]) == [
        "F s0 m0",
        "SEND_ACT s0 m0 >r1",
        "F s0 m1",
        "SEND_ACT s0 m1 >r1",
        "RECV_GRAD s0 m0 <r1",
        "B s0 m0",
        "RECV_GRAD s0 m1 <r1",
        "B s0 m1",
        "ALLREDUCE_GRAD s0",
        "OPT_STEP",
    ]
    assert _text(lowered[1]) == [
        "RECV_ACT s1 m0 <r0",
        "F s1 m0",
        "B s1 m0",
        "SEND_GRAD s1 m0 >r0",
        "RECV_ACT s1 m1 <r0",
        "F s1 m1",
        "B s1 m1",
        "SEND_GRAD s1 m1 >r0",
        "ALLREDUCE_GRAD s1",
        "OPT_STEP",
    ]


def test_chimera_d2_string_program() -> None:
    lowered = add_send_recv(schedule_programs("chimera", 2, 2), "chimera", 2)
    assert _text(lowered[0]) == [
        "F s0 m0",
        "SEND_ACT s0 m0 >r1",
        "RECV_ACT s1 m1 p1 <r1",
        "F s1 m1 p1",
        "B s1 m1 p1",
        "SEND_GRAD s1 m1 p1 >r1",
        "RECV_GRAD s0 m0 <r1",
        "B s0 m0",
        "ALLREDUCE_GRAD s1",
        "ALLREDUCE_GRAD s0",
        "OPT_STEP",
    ]


def test_interleaved_same_rank_neighbours_need_no_transfer() -> None:
    program = {0: _ops("F s0 m0\nF s1 m0\nB s1 m0\nB s0 m0")}
    assert add_send_recv(program, "interleaved", 1, v=2) == program


def test_period_programs_keep_their_shape_and_k_fac_ops_pass_through() -> None:
    step = _ops("F s1 m0\nSTATS s1 m0 A fc\nB s1 m0\nAPPLY s1")
    lowered = add_send_recv({1: [step, step]}, "gpipe", 3)
    expect = _ops(
        "RECV_ACT s1 m0 <r0\nF s1 m0\nSEND_ACT s1 m0 >r2\nSTATS s1 m0 A fc\n"
        "RECV_GRAD s1 m0 <r2\nB s1 m0\nSEND_GRAD s1 m0 >r0\nAPPLY s1"
    )
    assert lowered == {1: [expect, expect]}


def test_expand_dp_renumbers_ranks_and_peers() -> None:
    lowered = add_send_recv(schedule_programs("1f1b", 2, 1), "1f1b", 2)
    expanded = expand_dp(lowered, 3)
    assert sorted(expanded) == list(range(6))
    assert _text(expanded[4])[:2] == ["RECV_ACT s1 m0 <r1", "F s1 m0"]  # pp 1, dp 1: peer pp 0, dp 1
    assert _text(expanded[2])[1] == "SEND_ACT s0 m0 >r5"  # pp 0, dp 2 -> pp 1, dp 2


def _durations(op: Op) -> float:
    return {OpKind.FWD: 1.0 + 0.1 * (op.stage or 0), OpKind.BWD: 2.3, OpKind.ALLREDUCE_GRAD: 0.5}.get(op.kind, 0.0)


def _compute(timeline) -> list[tuple]:
    return sorted(
        (iv.rank, str(iv.op), iv.step, iv.start, iv.end)
        for iv in timeline.intervals
        if iv.op.kind in COMPUTE_KINDS | {OpKind.ALLREDUCE_GRAD}
    )


CASES = (
    [("gpipe", D, N, 1) for D, N in ((1, 1), (2, 3), (4, 4), (5, 2))]
    + [("1f1b", D, N, 1) for D, N in ((2, 1), (3, 7), (4, 4), (8, 8), (4, 2))]
    + [("interleaved", D, N, v) for D, N, v in ((2, 2, 2), (2, 4, 3), (4, 8, 2), (3, 6, 4), (1, 3, 2))]
    + [("chimera", D, N, 1) for D, N in ((2, 2), (2, 6), (4, 4), (4, 8), (6, 12), (8, 8))]
)


@pytest.mark.parametrize("kind,D,N,v", CASES)
@pytest.mark.parametrize("W", [1, 2])
def test_lowered_programs_are_deadlock_free_and_keep_the_timeline(kind: str, D: int, N: int, v: int, W: int) -> None:
    """Sends never block, receives do: the lowered programs finish, and each dp replica times like the one pipeline
    (that one times like the dataflow: tests/planner/test_simulate.py's longest-path reference)."""
    pipeline = add_send_recv(schedule_programs(kind, D, N, v=v), kind, D, v)
    lowered = expand_dp(pipeline, W)
    comm = 0.25
    reference = simulate(pipeline, lambda r, op: _durations(op), steps=2, comm=comm)
    actual = simulate(lowered, lambda r, op: _durations(op), steps=2, comm=comm)
    for dp in range(W):
        replica = [(rank * W + dp, *rest) for rank, *rest in _compute(reference)]
        assert sorted(row for row in _compute(actual) if row[0] % W == dp) == sorted(replica)
    sends = sum(op.kind.name.startswith("SEND") for ops in lowered.values() for op in ops)
    recvs = sum(op.kind.name.startswith("RECV") for ops in lowered.values() for op in ops)
    assert sends == recvs


def test_startup_drops_the_work_of_refreshes_from_before_step_zero() -> None:
    """A refresh op placed at window step s first runs at global step s; APPLY and F/B run from step 0."""
    late = Op(OpKind.STATS, stage=0, mb=1, part="B", layer="l")
    early = Op(OpKind.STATS, stage=0, mb=0, part="A", layer="l")
    prec = Op(OpKind.APPLY, stage=0)
    body = [late, Op(OpKind.FWD, stage=0, mb=0), early, prec, Op(OpKind.OPT_STEP)]
    placements = (
        SimpleNamespace(op=late, device=0, step=1),
        SimpleNamespace(op=early, device=0, step=0),
        SimpleNamespace(op=prec, device=0, step=1),
        SimpleNamespace(op=late, device=1, step=5),
    )
    startup = startup_programs({0: [body], 1: [body]}, born_steps(placements))
    assert startup[0] == [[body[1], early, prec, body[4]]]
    assert len(startup[1]) == 5 and all(late not in step for step in startup[1])
    assert ops_at({0: [body]}, startup, 0, 0) == startup[0][0] and ops_at({0: [body]}, startup, 0, 1) == body


def test_critical_path_deals_a_stages_inversions_round_robin_by_default() -> None:
    """Round-robin over the holders in (layer, factor) order, whatever the costs; LPT (Alg. 3) by the costs."""
    timings = {n: LayerTiming(1, 0, 0, "deferred") for n in ("x", "y", "z")}

    def roots(**kw: object) -> list[tuple[str, str, int]]:
        step = naive_programs("gpipe", 1, 1, 2, timings, {0: ["x", "y", "z"]}, **kw)[0][0]  # type: ignore[arg-type]  # kw: assignment= and seconds= of the case
        return [(op.layer or "", op.part or "", op.root or 0) for op in step if op.kind is OpKind.BCAST]

    default = roots()
    assert default == [("x", "A", 0), ("x", "B", 1), ("y", "A", 0), ("y", "B", 1), ("z", "A", 0), ("z", "B", 1)]
    assert roots(assignment=Assignment.ROUND_ROBIN) == default
    seconds = {("x", "A"): 1.0, ("x", "B"): 6.0, ("y", "A"): 2.0, ("y", "B"): 2.0, ("z", "A"): 3.0, ("z", "B"): 1.0}
    # LPT, loads (r0, r1): x.B 6 -> r0 (6, 0); z.A 3 -> r1 (6, 3); y.A 2 -> r1 (6, 5); y.B 2 -> r1 (6, 7);
    # x.A 1 -> r0 (7, 7); z.B 1 -> r0 (8, 7): ties by name (x.A before z.B), then the lowest rank
    assert roots(assignment=Assignment.LPT, seconds=seconds) == [
        ("x", "A", 0),
        ("x", "B", 0),
        ("y", "A", 1),
        ("y", "B", 1),
        ("z", "A", 1),
        ("z", "B", 0),
    ]
