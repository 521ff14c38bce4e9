"""Pure program -> program passes: point-to-point transfers, data-parallel expansion."""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Sequence, TypeVar

from fxkfac.planner.ir import Op, OpKind, Program
from fxkfac.planner.schedules import ScheduleKind, num_stages, stage_rank

__all__ = ["add_send_recv", "expand_dp"]

P = TypeVar("P", Sequence[Op], Program)


def _is_program(body: object) -> bool:
    items = list(body)  # type: ignore[call-overload]
    return bool(items) and not isinstance(items[0], Op)


def _transfers(op: Op, kind: ScheduleKind, D: int, v: int, rank: int) -> tuple[list[Op], list[Op]]:
    """The RECVs to put before `op` and the SENDs to put after it on `rank`."""
    S = num_stages(kind, D, v)
    if op.stage is None or op.kind not in (OpKind.FWD, OpKind.BWD):
        return [], []
    before, after = [], []
    prev_rank = stage_rank(kind, D, op.stage - 1, op.pipe, v=v) if op.stage > 0 else None
    next_rank = stage_rank(kind, D, op.stage + 1, op.pipe, v=v) if op.stage + 1 < S else None
    fields = {"stage": op.stage, "mb": op.mb, "pipe": op.pipe}
    if op.kind is OpKind.FWD:
        if prev_rank is not None and prev_rank != rank:
            before.append(Op(OpKind.RECV_ACT, peer=prev_rank, **fields))
        if next_rank is not None and next_rank != rank:
            after.append(Op(OpKind.SEND_ACT, peer=next_rank, **fields))
    else:
        if next_rank is not None and next_rank != rank:
            before.append(Op(OpKind.RECV_GRAD, peer=next_rank, **fields))
        if prev_rank is not None and prev_rank != rank:
            after.append(Op(OpKind.SEND_GRAD, peer=prev_rank, **fields))
    return before, after


def _lower_step(ops: Sequence[Op], kind: ScheduleKind, D: int, v: int, rank: int) -> list[Op]:
    lowered: list[Op] = []
    for op in ops:
        before, after = _transfers(op, kind, D, v, rank)
        lowered += before + [op] + after
    return lowered


def add_send_recv(
    programs: Mapping[int, P], kind: ScheduleKind | str, D: int, v: int = 1
) -> dict[int, P]:
    """Insert the transfers between stages on different pp ranks.

    A SEND_ACT (SEND_GRAD) goes right after the FWD (BWD) that produces the tensor, a RECV_ACT
    (RECV_GRAD) right before the FWD (BWD) that consumes it; each carries its own op's stage,
    micro-batch and pipe, and `peer` the other pp rank. Ranks are pp ranks (apply before
    `expand_dp`). Accepts one step's ops or a period program per rank; returns the same shape.
    """
    kind = ScheduleKind(kind)
    result: dict[int, P] = {}
    for rank, body in programs.items():
        if _is_program(body):
            result[rank] = [_lower_step(step, kind, D, v, rank) for step in body]  # type: ignore[assignment]
        else:
            result[rank] = _lower_step(body, kind, D, v, rank)  # type: ignore[arg-type, assignment]
    return result


def _remap(op: Op, W: int, dp: int) -> Op:
    return op if op.peer is None else replace(op, peer=op.peer * W + dp)


def expand_dp(programs_by_pp_rank: Mapping[int, P], W: int) -> dict[int, P]:
    """Copy each pp rank's program to its W data-parallel replicas: global rank = pp * W + dp.

    Peers (pp ranks) become the global rank of the same replica. Collectives keep their ops:
    their group is every rank that runs them (all copies of the stage).
    """
    if W < 1:
        raise ValueError(f"the data-parallel size W must be >= 1, got {W}")
    result: dict[int, P] = {}
    for pp, body in programs_by_pp_rank.items():
        for dp in range(W):
            if _is_program(body):
                result[pp * W + dp] = [[_remap(op, W, dp) for op in step] for step in body]  # type: ignore[assignment]
            else:
                result[pp * W + dp] = [_remap(op, W, dp) for op in body]  # type: ignore[assignment]
    return result
