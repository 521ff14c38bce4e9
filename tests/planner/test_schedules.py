"""Schedules against the Chimera note's golden orders, its loop form, torch's interleaved order, and invariants."""

from __future__ import annotations

from pathlib import Path

import pytest

from fxkfac.planner.problem.errors import ScheduleError
from fxkfac.planner.problem.ir import Op, OpKind, format_programs, parse_programs
from fxkfac.planner.problem.schedules import (
    ScheduleKind,
    num_stages,
    schedule_programs,
    stage_rank,
    stages_of_rank,
)

ARTIFACTS = Path(__file__).parent / "artifacts"

# Chimera's per-device order (Li & Hoefler, SC 2021) (↓ = pipe 0, ↑ = pipe 1; P_r holds ↓ stage r and ↑ stage D-1-r).
CHIMERA_D4 = {
    4: [
        "F↓0 F↓1 F↑2 B↑2 F↑3 B↑3 B↓0 B↓1",
        "F↓0 F↑2 F↓1 F↑3 B↑2 B↓0 B↑3 B↓1",
        "F↑2 F↓0 F↑3 F↓1 B↓0 B↑2 B↓1 B↑3",
        "F↑2 F↑3 F↓0 B↓0 F↓1 B↓1 B↑2 B↑3",
    ],
    8: [
        "F↓0 F↓1 F↑2 B↑2 F↑3 B↑3 B↓0 F↓4 B↓1 F↓5 F↑6 B↑6 F↑7 B↑7 B↓4 B↓5",
        "F↓0 F↑2 F↓1 F↑3 B↑2 B↓0 B↑3 B↓1 F↓4 F↑6 F↓5 F↑7 B↑6 B↓4 B↑7 B↓5",
    ],
}


def _arrow_ops(text: str, D: int, rank: int) -> list[Op]:
    ops = []
    for token in text.split():
        pipe = 0 if token[1] == "↓" else 1
        stage = rank if pipe == 0 else D - 1 - rank
        ops.append(Op(OpKind.FWD if token[0] == "F" else OpKind.BWD, stage, int(token[2:]), pipe))
    return ops


def _compute(ops: list[Op]) -> list[Op]:
    return [op for op in ops if op.kind in (OpKind.FWD, OpKind.BWD)]


@pytest.mark.parametrize("N", sorted(CHIMERA_D4))
def test_chimera_matches_the_note(N: int) -> None:
    programs = schedule_programs("chimera", 4, N)
    for rank, text in enumerate(CHIMERA_D4[N]):
        assert _compute(programs[rank]) == _arrow_ops(text, 4, rank)


def test_chimera_d2() -> None:
    programs = schedule_programs("chimera", 2, 2)
    assert _compute(programs[0]) == _arrow_ops("F↓0 F↑1 B↑1 B↓0", 2, 0)
    assert _compute(programs[1]) == _arrow_ops("F↑1 F↓0 B↓0 B↑1", 2, 1)


def _chimera_loop_form(D: int, N: int, r: int) -> list[Op]:
    """Chimera's order in the PipeFisher code's loop form: an implementation independent of the slot rule."""
    p = min(r, D - 1 - r)
    a, b = D // 2 - p, p
    low_pipe = 0 if r < D // 2 else 1
    stage_of = {low_pipe: p, 1 - low_pipe: D - 1 - p}
    half = D // 2
    mbs = {pipe: [u * D + pipe * half + j for u in range(N // D) for j in range(half)] for pipe in (0, 1)}
    counters = {(kind, pipe): 0 for kind in "FB" for pipe in (0, 1)}

    def emit(kind: str, role: str) -> Op:
        pipe = low_pipe if role == "L" else 1 - low_pipe
        mb = mbs[pipe][counters[kind, pipe]]
        counters[kind, pipe] += 1
        return Op(OpKind.FWD if kind == "F" else OpKind.BWD, stage_of[pipe], mb, pipe)

    ops = []
    for u in range(N // D):
        head = [("F", "L")] * a if u == 0 else [("B", "L"), ("F", "L")] * a
        body = head + [("F", "H"), ("F", "L")] * b + [("F", "H"), ("B", "H")] * a + [("B", "L"), ("B", "H")] * b
        ops += [emit(kind, role) for kind, role in body]
    return ops + [emit("B", "L") for _ in range(a)]


@pytest.mark.parametrize("D", [2, 4, 6, 8, 12])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_chimera_equals_loop_form(D: int, k: int) -> None:
    programs = schedule_programs("chimera", D, k * D)
    for r in range(D):
        assert _compute(programs[r]) == _chimera_loop_form(D, k * D, r)


def test_chimera_gradient_syncs_follow_the_note() -> None:
    p0, p1 = (schedule_programs("chimera", 4, 4)[r] for r in (0, 1))
    tail0 = [str(op) for op in p0[-6:]]
    assert tail0 == ["B s3 m3 p1", "ALLREDUCE_GRAD s3", "B s0 m0", "B s0 m1", "ALLREDUCE_GRAD s0", "OPT_STEP"]
    assert [str(op) for op in p1[-3:]] == ["ALLREDUCE_GRAD s2", "ALLREDUCE_GRAD s1", "OPT_STEP"]
    for D in (2, 4, 6, 8):  # partners launch their two syncs in the same order
        programs = schedule_programs("chimera", D, D)
        for r in range(D):
            syncs = [op.stage for op in programs[r] if op.kind is OpKind.ALLREDUCE_GRAD]
            assert syncs == [max(r, D - 1 - r), min(r, D - 1 - r)]
            assert syncs == [op.stage for op in programs[D - 1 - r] if op.kind is OpKind.ALLREDUCE_GRAD]


def _torch_interleaved(D: int, N: int, v: int) -> dict[int, list[Op]]:
    """torch.distributed.pipelining's interleaved 1F1B order (its private helpers), as Ops."""
    from torch.distributed.pipelining import schedules as tps

    orders = {}
    for rank in range(D):
        warmup = tps._get_warmup_ops(rank, v, D, D, N)
        fwd_bwd = v * N - warmup

        def fwd_stage(step: int, rank: int = rank) -> int:
            return (step // D) % v * D + rank

        def bwd_stage(step: int, rank: int = rank, warmup: int = warmup) -> int:
            return (v - 1 - ((step - warmup) // D) % v) * D + rank

        actions = tps._get_1f1b_rank_ops(v, D, warmup, fwd_bwd, warmup, rank, fwd_stage, bwd_stage)
        orders[rank] = [
            Op(
                OpKind.FWD if a.computation_type == tps._ComputationType.FORWARD else OpKind.BWD,
                a.stage_index,
                a.microbatch_index,
            )
            for a in actions
            if a is not None
        ]
    return orders


@pytest.mark.parametrize("D,N,v", [(2, 2, 2), (2, 4, 3), (3, 6, 2), (4, 4, 2), (4, 8, 2), (4, 12, 3)])
def test_interleaved_matches_torch(D: int, N: int, v: int) -> None:
    ours = schedule_programs("interleaved", D, N, v=v)
    theirs = _torch_interleaved(D, N, v)
    for r in range(D):
        assert _compute(ours[r]) == theirs[r]


@pytest.mark.parametrize(
    "kind,D,N,v",
    [
        ("gpipe", 3, 5, 1),
        ("1f1b", 4, 3, 1),
        ("1f1b", 4, 9, 1),
        ("interleaved", 2, 4, 3),
        ("chimera", 6, 12, 1),
        ("interleaved", 3, 3, 1),
    ],
)
def test_every_rank_runs_each_of_its_ops_once_and_in_dependency_order(kind: str, D: int, N: int, v: int) -> None:
    programs = schedule_programs(kind, D, N, v=v)
    for r, ops in programs.items():
        held = stages_of_rank(kind, D, r, v=v)
        assert all(stage_rank(kind, D, s, p, v=v) == r for s, p in held)
        mbs = {p: [m for m in range(N) if kind != "chimera" or (m % D >= D // 2) == p] for p in (0, 1)}
        expect = {Op(k, s, m, p) for s, p in held for m in mbs[p] for k in (OpKind.FWD, OpKind.BWD)}
        compute = _compute(ops)
        assert len(compute) == len(expect) and set(compute) == expect
        for op in compute:
            if op.kind is OpKind.BWD:
                assert compute.index(Op(OpKind.FWD, op.stage, op.mb, op.pipe)) < compute.index(op)
        assert ops[-1] == Op(OpKind.OPT_STEP)
        assert sorted(op.stage for op in ops if op.kind is OpKind.ALLREDUCE_GRAD) == sorted(s for s, _ in held)
    assert sum(len(stages_of_rank(kind, D, r, v=v)) for r in range(D)) == num_stages(kind, D, v) * (
        2 if kind == "chimera" else 1
    )


def _torch_zero_bubble(kind: str, D: int, N: int, v: int) -> dict[int, list[Op]]:
    """torch.distributed.pipelining's ScheduleInterleavedZeroBubble / ScheduleZBVZeroBubble orders (their per-rank
    builders, run on a stand-in for the schedule object), as Ops."""
    from types import SimpleNamespace

    from torch.distributed.pipelining import schedules as tps

    if kind == "zb-v":
        build = tps.ScheduleZBVZeroBubble._calculate_single_rank_operations
        state = SimpleNamespace(pp_group_size=D, num_stages=2 * D, _n_microbatches=N)
    else:
        build = tps.ScheduleInterleavedZeroBubble._calculate_single_rank_operations
        state = SimpleNamespace(n_local_stages=v, microbatches_per_round=D, pp_group_size=D, _n_microbatches=N)
    kinds = {
        tps._ComputationType.FORWARD: OpKind.FWD,
        tps._ComputationType.BACKWARD_INPUT: OpKind.BWD,
        tps._ComputationType.BACKWARD_WEIGHT: OpKind.BWD_W,
    }
    return {
        rank: [
            Op(kinds[a.computation_type], a.stage_index, a.microbatch_index)
            for a in build(state, rank)
            if a is not None
        ]
        for rank in range(D)
    }


@pytest.mark.parametrize(
    "kind,D,N,v",
    [
        ("zb-h1", 2, 4, 1),
        ("zb-h1", 4, 8, 1),
        ("zb-1p", 2, 4, 2),
        ("zb-1p", 4, 8, 2),
        ("zb-1p", 3, 6, 3),
        ("zb-v", 2, 4, 2),
        ("zb-v", 4, 3, 2),
        ("zb-v", 4, 12, 2),
        ("zb-v", 8, 8, 2),
    ],
)
def test_zero_bubble_matches_torch(kind: str, D: int, N: int, v: int) -> None:
    ours = schedule_programs(kind, D, N, v=v)
    theirs = _torch_zero_bubble(kind, D, N, v)
    for r in range(D):
        assert _zero_bubble_compute(ours[r]) == theirs[r]
    if kind == "zb-h1":  # ZB-H1 is interleaved zero bubble on one stage per rank
        assert ours == schedule_programs("zb-1p", D, N, v=1)


def _zero_bubble_compute(ops: list[Op]) -> list[Op]:
    return [op for op in ops if op.kind in (OpKind.FWD, OpKind.BWD, OpKind.BWD_W)]


@pytest.mark.parametrize("kind,D,N,v", [("zb-h1", 3, 5, 1), ("zb-1p", 4, 8, 3), ("zb-v", 3, 7, 2), ("zb-v", 4, 2, 2)])
def test_zero_bubble_runs_one_w_after_each_b_and_holds_a_v(kind: str, D: int, N: int, v: int) -> None:
    programs = schedule_programs(kind, D, N, v=v)
    for r, ops in programs.items():
        held = stages_of_rank(kind, D, r, v=v)
        assert all(stage_rank(kind, D, s, p, v=v) == r for s, p in held)
        compute = _zero_bubble_compute(ops)
        expect = {Op(k, s, m) for s, _ in held for m in range(N) for k in (OpKind.FWD, OpKind.BWD, OpKind.BWD_W)}
        assert len(compute) == len(expect) and set(compute) == expect
        for op in compute:
            if op.kind is not OpKind.FWD:
                before = OpKind.FWD if op.kind is OpKind.BWD else OpKind.BWD
                assert compute.index(Op(before, op.stage, op.mb)) < compute.index(op)
        syncs = [i for i, op in enumerate(ops) if op.kind is OpKind.ALLREDUCE_GRAD]
        assert len(syncs) == len(held) and min(syncs) > max(ops.index(op) for op in compute)
    if kind == "zb-v":
        assert [stage_rank(kind, D, s) for s in range(2 * D)] == [*range(D), *reversed(range(D))]
    assert num_stages(kind, D, v) == D * v


def test_1f1b_warmup_and_gpipe_order() -> None:
    programs = schedule_programs("1f1b", 4, 6)
    for r, ops in programs.items():
        kinds = "".join("F" if op.kind is OpKind.FWD else "B" for op in _compute(ops))
        warm = min(4 - r - 1, 6)
        assert kinds == "F" * warm + "FB" * (6 - warm) + "B" * warm
    gpipe = schedule_programs("gpipe", 3, 4)[1]
    assert "".join(str(op)[0] for op in _compute(gpipe)) == "FFFFBBBB"


GOLDEN = [
    ("gpipe", 2, 3, 1),
    ("1f1b", 4, 4, 1),
    ("interleaved", 2, 4, 2),
    ("chimera", 4, 4, 1),
    ("zb-h1", 4, 4, 1),
    ("zb-v", 2, 4, 2),
    ("zb-1p", 2, 4, 2),
]


@pytest.mark.parametrize("kind,D,N,v", GOLDEN)
def test_golden_files(kind: str, D: int, N: int, v: int) -> None:
    path = ARTIFACTS / f"{kind}_D{D}_N{N}_v{v}.txt"
    programs = {r: [ops] for r, ops in schedule_programs(kind, D, N, v=v).items()}
    assert parse_programs(path.read_text()) == programs
    assert format_programs(programs) == path.read_text()


@pytest.mark.parametrize(
    "kind,D,N,v,needle",
    [
        ("pipedream", 2, 2, 1, "choose one of"),
        ("chimera", 3, 3, 1, "even"),
        ("chimera", 4, 6, 1, "try N=8"),
        ("interleaved", 4, 6, 2, "try N=8"),
        ("1f1b", 4, 4, 2, "v=1"),
        ("gpipe", 0, 4, 1, "positive"),
        ("gpipe", 2, 0, 1, "positive"),
        ("zb-v", 2, 4, 1, "v=2"),
        ("zb-h1", 2, 4, 2, "v=1"),
        ("zb-1p", 4, 6, 2, "try N=8"),
    ],
)
def test_bad_arguments_say_what_works(kind: str, D: int, N: int, v: int, needle: str) -> None:
    with pytest.raises(ScheduleError, match=needle):
        schedule_programs(kind, D, N, v=v)


def test_schedule_kind_values() -> None:
    assert [k.value for k in ScheduleKind] == ["gpipe", "1f1b", "interleaved", "chimera", "zb-h1", "zb-v", "zb-1p"]
