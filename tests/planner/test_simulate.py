"""The simulator against the Chimera note's timeline, an independent longest-path reference, and hand cases."""

from __future__ import annotations

import functools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fxkfac.planner.problem.errors import DeadlockError
from fxkfac.planner.problem.ir import Op, OpKind
from fxkfac.planner.problem.lowering import add_send_recv, rank_programs
from fxkfac.planner.problem.schedules import schedule_programs, stage_rank
from fxkfac.planner.problem.step_timeline import simulate


def fb(tf: float, tb: float):
    return lambda rank, op: tf if op.kind is OpKind.FWD else tb if op.kind is OpKind.BWD else 0.0


# Chimera (Li & Hoefler, SC 2021), Fig. 3's setting: D=4, N=4, T_f=T_b=1, each op as early as possible ("·" = bubble).
CHIMERA_GRID = [
    "F↓0 F↓1  ·  F↑2 B↑2 F↑3 B↑3 B↓0  ·  B↓1",
    " ·  F↓0 F↑2 F↓1 F↑3 B↑2 B↓0 B↑3 B↓1  · ",
    " ·  F↑2 F↓0 F↑3 F↓1 B↓0 B↑2 B↓1 B↑3  · ",
    "F↑2 F↑3  ·  F↓0 B↓0 F↓1 B↓1 B↑2  ·  B↑3",
]


def test_chimera_timeline_matches_the_note() -> None:
    timeline = simulate(rank_programs("chimera", 4, 4, 1), fb(1, 1))
    for rank, row in enumerate(CHIMERA_GRID):
        expect = {}
        for t, token in enumerate(row.split()):
            if token != "·":
                pipe = 0 if token[1] == "↓" else 1
                stage = rank if pipe == 0 else 3 - rank
                expect[Op(OpKind.FWD if token[0] == "F" else OpKind.BWD, stage, int(token[2:]), pipe)] = t
        got = {iv.op: iv.start for iv in timeline.of_rank(rank) if iv.op.kind in (OpKind.FWD, OpKind.BWD)}
        assert got == expect
        assert timeline.bubbles(rank) in ([(2.0, 3.0), (8.0, 9.0)], [(0.0, 1.0), (9.0, 10.0)])
    assert timeline.length == 10


def _longest_path_starts(programs: dict[int, list[Op]], dur, comm: float, S: dict[int, int]) -> dict:
    """Independent reference: earliest starts as a longest path over program-order and data edges."""
    index = {(r, op): i for r, ops in programs.items() for i, op in enumerate(ops)}
    rank_of = {op: r for r, ops in programs.items() for op in ops}

    @functools.cache
    def start(r: int, i: int) -> float:
        op = programs[r][i]
        t = end(r, i - 1) if i else 0.0
        deps = []
        if op.kind is OpKind.FWD and op.stage:
            deps.append(Op(OpKind.FWD, op.stage - 1, op.mb, op.pipe))
        if op.kind is OpKind.BWD:
            deps.append(
                Op(OpKind.BWD, op.stage + 1, op.mb, op.pipe)
                if op.stage + 1 < S[op.pipe]
                else Op(OpKind.FWD, op.stage, op.mb, op.pipe)
            )
        for dep in deps:
            q = rank_of[dep]
            t = max(t, end(q, index[q, dep]) + (comm if q != r else 0.0))
        return t

    def end(r: int, i: int) -> float:
        return start(r, i) + dur(r, programs[r][i])

    return {(r, op): start(r, i) for r, ops in programs.items() for i, op in enumerate(ops)}


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(
        [
            ("gpipe", 3, 4, 1),
            ("1f1b", 4, 6, 1),
            ("interleaved", 2, 4, 2),
            ("chimera", 4, 8, 1),
            ("chimera", 6, 6, 1),
            ("1f1b", 5, 3, 1),
        ]
    ),
    st.integers(0, 10**6),
    st.sampled_from([0.0, 0.3]),
)
def test_matches_longest_path_reference(case: tuple, seed: int, comm: float) -> None:
    kind, D, N, v = case
    programs = {
        r: [op for op in ops if op.kind in (OpKind.FWD, OpKind.BWD)]
        for r, ops in schedule_programs(kind, D, N, v=v).items()
    }
    rng = random.Random(seed)
    table = {(r, op): rng.choice([0.5, 1.0, 1.5, 2.0, 3.25]) for r, ops in programs.items() for op in ops}
    dur = lambda r, op: table.get((r, op), 0.0)  # noqa: E731  # transfers take no time
    S = {
        p: max(op.stage for ops in programs.values() for op in ops if op.pipe == p) + 1
        for p in {op.pipe for ops in programs.values() for op in ops}
    }
    reference = _longest_path_starts(programs, dur, comm, S)
    timeline = simulate(add_send_recv(programs, kind, D, v), dur, comm=comm)
    fb_starts = {(iv.rank, iv.op): iv.start for iv in timeline.intervals if iv.op.kind in (OpKind.FWD, OpKind.BWD)}
    assert fb_starts == pytest.approx(reference)


def test_gpipe_two_ranks_by_hand() -> None:
    timeline = simulate(rank_programs("gpipe", 2, 2, 1), fb(1, 2))
    # r0: F0 0-1, F1 1-2, idle 2-4? r1: F0 1-2, F1 2-3, B0 3-5, B1 5-7; r0: B0 5-7, B1 7-9.
    assert [(str(iv.op), iv.start, iv.end) for iv in timeline.of_rank(0) if iv.op.kind in (OpKind.FWD, OpKind.BWD)] == [
        ("F s0 m0", 0, 1),
        ("F s0 m1", 1, 2),
        ("B s0 m0", 5, 7),
        ("B s0 m1", 7, 9),
    ]
    assert timeline.length == 9
    assert timeline.bubbles(0) == [(2, 5)]
    assert timeline.bubbles(1) == [(0, 1), (7, 9)]
    assert timeline.busy(0) == 6 and timeline.utilization() == pytest.approx(6 / 9)


@pytest.mark.parametrize("kind,D,N", [("gpipe", 3, 5), ("1f1b", 4, 4), ("chimera", 4, 8)])
def test_several_steps_repeat_the_flushed_step(kind: str, D: int, N: int) -> None:
    one = simulate(rank_programs(kind, D, N, 1), fb(1, 2))
    three = simulate(rank_programs(kind, D, N, 1), fb(1, 2), steps=3)
    step_starts = [next(iv.start for iv in three.of_rank(0) if iv.step == j) for j in (1, 2)]
    assert step_starts[1] - step_starts[0] == pytest.approx(one.length)
    assert three.length == pytest.approx(3 * one.length)
    assert {iv.step for iv in three.intervals} == {0, 1, 2}


def test_collectives_start_together_after_every_member_arrives() -> None:
    timeline = simulate(
        rank_programs("chimera", 4, 4, 1), lambda r, op: 0.5 if op.kind is OpKind.ALLREDUCE_GRAD else fb(1, 2)(r, op)
    )
    syncs: dict[int, set] = {}
    for iv in timeline.intervals:
        if iv.op.kind is OpKind.ALLREDUCE_GRAD:
            syncs.setdefault(iv.op.stage, set()).add((iv.rank, iv.start, iv.end))
    for stage, members in syncs.items():
        assert {r for r, _, _ in members} == {stage, 3 - stage}
        assert len({(s, e) for _, s, e in members}) == 1
        last_b = max(iv.end for iv in timeline.intervals if iv.op.kind is OpKind.BWD and iv.op.stage == stage)
        assert next(iter(members))[1] >= last_b


def test_opt_step_is_a_barrier_over_all_ranks() -> None:
    """The runtime's OPT_STEP all-reduces over the world: rank 0 starts step 1 only after rank 1's long APPLY."""
    programs = {
        0: [Op(OpKind.FWD, 0, 0), Op(OpKind.OPT_STEP)],
        1: [Op(OpKind.FWD, 1, 0), Op(OpKind.APPLY, 1), Op(OpKind.OPT_STEP)],
    }
    dur = {OpKind.FWD: 1.0, OpKind.APPLY: 5.0}
    timeline = simulate(add_send_recv(programs, "gpipe", 2), lambda r, op: dur.get(op.kind, 0.0), steps=2)
    at = {(iv.rank, iv.step, iv.op.kind): (iv.start, iv.end) for iv in timeline.intervals}
    # step 0: F s0 0-1, F s1 1-2, APPLY 2-7; every OPT_STEP at 7; step 1 is step 0 moved by 7
    assert at[0, 0, OpKind.OPT_STEP] == at[1, 0, OpKind.OPT_STEP] == (7, 7)
    assert at[0, 1, OpKind.FWD] == (7, 8) and at[1, 1, OpKind.FWD] == (8, 9)
    assert timeline.length == 14


def test_k_fac_ops_follow_program_order_and_group_by_stage() -> None:
    programs = {
        r: [
            Op(OpKind.FWD, 0, 0),
            Op(OpKind.STATS, 0, 0, layer="fc", part="A"),
            Op(OpKind.BWD, 0, 0),
            Op(OpKind.STATS, 0, 0, layer="fc", part="B"),
            Op(OpKind.SYNC_STATS, 0, layer="fc", part="A"),
            *([Op(OpKind.DECOMP, 0, layer="fc", part="A")] if r == 1 else []),
            Op(OpKind.BCAST, 0, layer="fc", part="A", root=1),
            Op(OpKind.ALLREDUCE_GRAD, 0),
            Op(OpKind.APPLY, 0),
            Op(OpKind.OPT_STEP),
        ]
        for r in (0, 1)
    }
    dur = {
        OpKind.FWD: 1,
        OpKind.BWD: 2,
        OpKind.STATS: 0.5,
        OpKind.SYNC_STATS: 0.25,
        OpKind.DECOMP: 3,
        OpKind.BCAST: 0.25,
        OpKind.APPLY: 1,
        OpKind.ALLREDUCE_GRAD: 0.5,
    }
    timeline = simulate(
        programs, lambda r, op: 4 * dur.get(op.kind, 0) if r == 0 and op.kind is OpKind.BWD else dur.get(op.kind, 0)
    )
    at = {(iv.rank, iv.op.kind): (iv.start, iv.end) for iv in timeline.intervals}
    # rank 0: F 0-1, STATS A 1-1.5, slow B 1.5-9.5, STATS B 9.5-10; rank 1 is done at 4 and waits.
    assert at[0, OpKind.SYNC_STATS] == at[1, OpKind.SYNC_STATS] == (10, 10.25)
    assert at[1, OpKind.DECOMP] == (10.25, 13.25)
    assert at[0, OpKind.BCAST] == at[1, OpKind.BCAST] == (13.25, 13.5)
    assert at[0, OpKind.APPLY] == (14, 15)


def test_deadlock_names_the_blocked_ops() -> None:
    programs = {0: [Op(OpKind.BWD, 0, 0), Op(OpKind.FWD, 0, 0)], 1: [Op(OpKind.FWD, 1, 0), Op(OpKind.BWD, 1, 0)]}
    with pytest.raises(DeadlockError, match=r"rank 0: RECV_GRAD s0 m0 <r1 \(step 0\) waits for a matching") as info:
        simulate(add_send_recv(programs, "gpipe", 2), fb(1, 1))
    assert "rank 1: RECV_ACT s1 m0 <r0 (step 0) waits for a matching send on rank 0" in str(info.value)


def test_unlowered_programs_are_refused() -> None:
    """Without SEND/RECV an F would not wait for its input on another rank: `simulate` says to lower them."""
    with pytest.raises(ValueError, match="add_send_recv"):
        simulate(schedule_programs("1f1b", 2, 2), fb(1, 1))
    simulate(schedule_programs("1f1b", 1, 2), fb(1, 1))  # one rank: nothing to pass


def test_unmatched_receive_and_missing_collective_member_deadlock() -> None:
    with pytest.raises(DeadlockError, match="matching send on rank 1"):
        simulate({0: [Op(OpKind.RECV_ACT, 1, 0, peer=1)], 1: [Op(OpKind.FWD, 0, 0)]}, fb(1, 1))
    with pytest.raises(DeadlockError, match=r"ranks \[1\] to reach it"):
        simulate(
            {
                0: [Op(OpKind.ALLREDUCE_GRAD, 0)],
                1: [Op(OpKind.RECV_GRAD, 0, 0, peer=0), Op(OpKind.ALLREDUCE_GRAD, 0)],
            },
            fb(1, 1),
        )


def test_stage_rank_agrees_with_where_the_schedule_puts_ops() -> None:
    programs = schedule_programs("chimera", 6, 6)
    for r, ops in programs.items():
        for op in ops:
            if op.kind is OpKind.FWD:
                assert stage_rank("chimera", 6, op.stage, op.pipe) == r
