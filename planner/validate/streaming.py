"""Checks of a streamed stage's hand-offs (planner/problem/lowering.py): every step the owner sends each streamed
layer's gradient after the stage's last backward and takes it back before its step ends, the layer's helper receives,
applies and returns it, and every refresh's preconditioner reaches the helper before the helper's first APPLY that uses
it."""

from __future__ import annotations

import math

from fxkfac.planner.problem.ir import Op, OpKind, ops_at
from fxkfac.planner.problem.lowering import Streaming
from fxkfac.planner.validate.context import Context, apply_ops

__all__ = ["check_streaming"]

_MAKES = (OpKind.DECOMP, OpKind.BCAST)
"""The ops after which a refresh is made on the replicas' sender (a copied stage's halves made elsewhere arrive by
BCAST)."""


def check_streaming(c: Context) -> None:
    """The hand-offs of every step and the replicas of every refresh (nothing to check without streaming)."""
    streaming = c.problem.streaming
    if streaming is None:
        return
    owners = c.problem.stream_owners
    for owner in owners:
        for j, ops in enumerate(c.plan.programs[owner]):
            _check_owner_step(c, streaming, owner, j, ops)
    for helper in streaming.ranks:
        for j, ops in enumerate(c.plan.programs[helper]):
            _check_helper_step(c, streaming, helper, owners, j, ops)
    _check_replicas(c, streaming, owners[0])


def _check_owner_step(c: Context, streaming: Streaming, owner: int, j: int, ops: list[Op]) -> None:
    """The owner's step j sends every streamed layer right after its stage's last BWD, takes each back once, and
    applies none of them itself."""
    s, pairs = streaming.stage, list(zip(streaming.layers, streaming.helpers, strict=True))
    last = max((i for i, op in enumerate(ops) if op.kind in (OpKind.BWD, OpKind.BWD_W) and op.stage == s), default=None)
    sends = [Op(OpKind.SEND_LGRAD, s, peer=h, layer=n) for n, h in pairs]
    if last is None or ops[last + 1 : last + 1 + len(sends)] != sends:
        c.errors.append(f"r{owner} step {j}: the streamed layers' SEND_LGRAD do not follow the last BWD of stage {s}")
    for n, helper in pairs:
        recv = Op(OpKind.RECV_PGRAD, s, peer=helper, layer=n)
        if ops.count(recv) != 1:
            c.errors.append(f"r{owner} step {j}: '{recv}' must run once")
        if any(op.kind is OpKind.APPLY and op.stage == s and op.layer in (None, n) for op in ops):
            c.errors.append(f"r{owner} step {j}: applies {n}, which r{helper} preconditions")


def _check_helper_step(
    c: Context, streaming: Streaming, helper: int, owners: tuple[int, ...], j: int, ops: list[Op]
) -> None:
    """The helper's step j receives every layer it preconditions from every owner, applies it and returns it to
    every owner, once each, in that order (a cut APPLY's pieces in order between), and applies no other layer of the
    stage."""
    s, mine = streaming.stage, streaming.layers_of(helper)
    others = sorted({op.layer or "(all)" for op in ops if op.kind is OpKind.APPLY and op.stage == s} - set(mine))
    if others:
        c.errors.append(f"r{helper} step {j}: applies {others} of stage {s}, which it does not precondition")
    for n in mine:
        chain = [
            *(Op(OpKind.RECV_LGRAD, s, peer=owner, layer=n) for owner in owners),
            *apply_ops(c, s, n),
            *(Op(OpKind.SEND_PGRAD, s, peer=owner, layer=n) for owner in owners),
        ]
        at = [ops.index(op) if ops.count(op) == 1 else -1 for op in chain]
        if min(at) < 0 or at != sorted(at):
            c.errors.append(f"r{helper} step {j}: {n} is not received, applied and returned once, in order")


def _check_replicas(c: Context, streaming: Streaming, owner: int) -> None:
    """Replay the replicas over two periods of every program: the owner sends one after a DECOMP of the layer, the
    layer's helper takes it in the same step, and each helper APPLY finds the refresh its timing makes due (the n-th
    replica carries the layer's n-th refresh since step 0). A layer without parts (a Muon matrix) has no refresh, so
    no replica."""
    s = streaming.stage
    for n, helper in zip(streaming.layers, streaming.helpers, strict=True):
        if not c.problem.costs.layer(n).parts:
            _check_no_replica(c, streaming, n, owner, helper)
            continue
        periods = [len(c.plan.programs[r]) + len(c.plan.startup.get(r, [])) for r in (owner, helper)]
        timing = c.plan.layers[n]
        send = Op(OpKind.SEND_REPLICA, s, peer=helper, layer=n)
        recv = Op(OpKind.RECV_REPLICA, s, peer=owner, layer=n)
        received = 0
        for t in range(2 * math.lcm(*periods) + max(periods)):
            mine = ops_at(c.plan.programs, c.plan.startup, owner, t)
            theirs = ops_at(c.plan.programs, c.plan.startup, helper, t)
            if mine.count(send) != theirs.count(recv):
                c.errors.append(
                    f"step {t}: r{owner} sends {mine.count(send)} replicas of {n}, r{helper} takes {theirs.count(recv)}"
                )
                return
            if send in mine and not any(op.kind in _MAKES and op.layer == n for op in mine[: mine.index(send)]):
                c.errors.append(f"step {t}: r{owner} sends a replica of {n} before any DECOMP or BCAST of it there")
            for op in theirs:
                received += op == recv
                if op != Op(OpKind.APPLY, s, layer=n):
                    continue
                due = t - timing.use_offset
                if due >= timing.curv_step and received < (due - timing.curv_step) // timing.period + 1:
                    c.errors.append(f"step {t}: r{helper} applies {n} before the replica of its refresh due arrives")
                    return


def _check_no_replica(c: Context, streaming: Streaming, layer: str, owner: int, helper: int) -> None:
    """A layer without a refresh (a Muon matrix) sends and takes no replica, in any program."""
    s = streaming.stage
    replicas = (
        Op(OpKind.SEND_REPLICA, s, peer=helper, layer=layer),
        Op(OpKind.RECV_REPLICA, s, peer=owner, layer=layer),
    )
    for rank in (owner, helper):
        ops = [op for body in (*c.plan.startup.get(rank, []), *c.plan.programs[rank]) for op in body]
        if any(op in replicas for op in ops):
            c.errors.append(f"r{rank} transfers a replica of {layer}, which has no refresh")
