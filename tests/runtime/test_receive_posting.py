"""Where a step's late receives are posted ([Note: when receives are posted] in fxkfac/runtime/interpreter.py)."""

from __future__ import annotations

import pytest

from fxkfac.planner.problem import OpKind, rank_programs
from fxkfac.runtime.interpreter import _late_from, _post_points

SENDS = (OpKind.SEND_ACT, OpKind.SEND_GRAD)
RECEIVES = (OpKind.RECV_ACT, OpKind.RECV_GRAD)
COMPUTE = (OpKind.FWD, OpKind.BWD)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "chimera"])
def test_under_nccl_every_receive_is_posted_before_any_send(schedule: str) -> None:
    for ops in rank_programs(schedule, 2, 4, 1).values():
        late = _late_from(ops, sends_first=False)
        assert not any(op.kind in SENDS for op in ops[: late + 1])


def test_on_gloo_the_sends_after_the_first_compute_go_before_the_posts() -> None:
    programs = rank_programs("1f1b", 2, 4, 1)
    first = _late_from(programs[0], sends_first=False)
    late = _late_from(programs[0], sends_first=True)
    assert programs[0][first].kind is OpKind.FWD
    assert [op.kind for op in programs[0][first + 1 : late + 1]] == [OpKind.SEND_ACT]  # stage 0's first activation
    assert not any(op.kind in RECEIVES for op in programs[0][: late + 1])
    assert _late_from(programs[1], sends_first=True) == _late_from(programs[1], sends_first=False)  # F then B


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1", "chimera"])
def test_on_gloo_each_late_receive_is_posted_one_compute_ahead(schedule: str) -> None:
    """Spread posts: each late receive is posted before its op, with one FWD or BWD between where it has two before
    it, and after the step's first FWD or BWD."""
    for ops in rank_programs(schedule, 2, 4, 1).values():
        first, points = _late_from(ops, sends_first=True), _post_points(ops, sends_first=True)
        for i, op in enumerate(ops):
            if i <= first or op.kind not in (*RECEIVES, OpKind.OPT_STEP):
                continue
            computes = [j for j in range(i) if ops[j].kind in COMPUTE]
            assert first <= points[i] < i
            if len(computes) >= 2:
                assert points[i] >= computes[-2]
                assert any(ops[j].kind in COMPUTE for j in range(points[i] + 1, i)), (schedule, str(op))


def test_on_gloo_1f1b_last_stage_posts_one_receive_before_its_first_backward() -> None:
    """1F1B's last stage, D=2, N=4: one post (the next activation's) between its first FWD and first BWD, as torch's
    schedule has, not the step's four late receives."""
    ops = rank_programs("1f1b", 2, 4, 1)[1]
    first, points = _late_from(ops, sends_first=True), _post_points(ops, sends_first=True)
    assert ops[first].kind is OpKind.FWD and ops[first + 1].kind is OpKind.BWD
    late = [i for i, op in enumerate(ops) if i > first and op.kind in (*RECEIVES, OpKind.OPT_STEP)]
    assert [str(ops[i]) for i in late if points[i] == first] == ["RECV_ACT s1 m1 <r0"]
    assert _post_points(ops, sends_first=False) == [first] * len(ops)
