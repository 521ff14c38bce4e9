"""Where a step's late receives are posted ([Note: when receives are posted] in fxkfac/runtime/interpreter.py)."""

from __future__ import annotations

import pytest

from fxkfac.planner.problem import OpKind
from fxkfac.planner.problem.lowering import rank_programs
from fxkfac.runtime.interpreter import _late_from

SENDS = (OpKind.SEND_ACT, OpKind.SEND_GRAD)
RECEIVES = (OpKind.RECV_ACT, OpKind.RECV_GRAD)


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


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_on_gloo_a_step_that_begins_with_a_receive_posts_every_receive_at_its_start(schedule: str) -> None:
    """The last stage waits for its first activation anyway: its late receives are posted then (-1: before any op),
    not between its first FWD and first BWD, on the critical path; under NCCL they wait for the first FWD."""
    ops = rank_programs(schedule, 2, 4, 1)[1]
    assert ops[0].kind is OpKind.RECV_ACT
    assert _late_from(ops, sends_first=True) == -1
    assert ops[_late_from(ops, sends_first=False)].kind is OpKind.FWD
