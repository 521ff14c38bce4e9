"""Streamed buckets ([Note: streamed buckets] in fxkfac/runtime/streaming.py) for the runtime and the planner: which
(owner, helper, stage) may send their split-APPLY transfers together (`bucketable`) and how their units are cut
(`cut`); each bucket is one message each way."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import TypeVar

from fxkfac.planner.problem.costs import LayerCost, PreconditionerKind, streamed_bytes
from fxkfac.planner.problem.ir import Op, OpKind

__all__ = ["BUCKET_BYTES", "bucketable", "bundles_streams", "cut", "send_buckets"]

BUCKET_BYTES = 1 << 20  # a bucket of streamed units closes once it holds this many bytes (its fixed cost then small)

K = TypeVar("K", bound=Hashable)


def cut(
    units: Sequence[tuple[K, str, int, Hashable]], order: Mapping[str, int], cap: int = BUCKET_BYTES
) -> list[tuple[K, tuple[str, ...]]]:
    """The buckets (group, units) of one end's (group, unit, bytes, element type) units: per group in descending
    `order`, closed at `cap` bytes or an element type change (both ends cut the same)."""
    groups: dict[K, list[tuple[str, int, Hashable]]] = {}
    for group, unit, nbytes, dtype in units:
        groups.setdefault(group, []).append((unit, nbytes, dtype))
    out: list[tuple[K, tuple[str, ...]]] = []
    for group, members in groups.items():
        members.sort(key=lambda m: -order[m[0]])
        start = 0
        while start < len(members):
            size, dtype, end = 0, members[start][2], start
            while end < len(members) and members[end][2] == dtype and (size < cap or end == start):
                size += members[end][1]
                end += 1
            out.append((group, tuple(m[0] for m in members[start:end])))
            start = end
    return out


_BETWEEN_RETURNS = frozenset({OpKind.APPLY, OpKind.SEND_PGRAD, OpKind.RECV_LGRAD})  # between bucketed SEND_PGRADs


def _sends_in_a_row(ops: Sequence[Op], where: Sequence[int], stage: int) -> bool:
    """Whether an owner's SEND_LGRADs of `stage` (at `where`) run in a row, none waiting on a peer since its last B."""
    if where[-1] - where[0] + 1 != len(where):
        return False
    last_backward = max(
        (i for i, op in enumerate(ops[: where[0]]) if op.kind in (OpKind.BWD, OpKind.BWD_W) and op.stage == stage),
        default=-1,
    )
    since = ops[last_backward + 1 : where[-1] + 1]  # none may wait for another rank: a receive, or the step's end
    return not any(op.kind.value.startswith("RECV_") or op.kind is OpKind.OPT_STEP for op in since)


def bucketable(programs: Mapping[int, Sequence[Sequence[Op]]]) -> frozenset[tuple[int, int, int]]:
    """The (owner, helper, stage) whose split-APPLY transfers travel in buckets: the owner's SEND_LGRADs in a row
    (`_sends_in_a_row`) and RECV_PGRADs in a row, the helper's SEND_PGRADs with only `_BETWEEN_RETURNS` between."""
    seen: set[tuple[int, int, int]] = set()
    refused: set[tuple[int, int, int]] = set()
    for rank, steps in programs.items():
        for ops in steps:
            at: dict[tuple[OpKind, int, int], list[int]] = {}
            for i, op in enumerate(ops):
                if op.kind in (OpKind.SEND_LGRAD, OpKind.RECV_PGRAD, OpKind.SEND_PGRAD, OpKind.RECV_LGRAD):
                    at.setdefault((op.kind, op.peer_rank, op.stage_id), []).append(i)
            for (kind, peer, stage), where in at.items():
                owner, helper = (rank, peer) if kind in (OpKind.SEND_LGRAD, OpKind.RECV_PGRAD) else (peer, rank)
                pair = (owner, helper, stage)
                seen.add(pair)
                if kind is OpKind.SEND_LGRAD:
                    ok = _sends_in_a_row(ops, where, stage)
                elif kind is OpKind.RECV_PGRAD:
                    ok = where[-1] - where[0] + 1 == len(where)
                elif kind is OpKind.SEND_PGRAD:
                    ok = all(
                        op.kind in _BETWEEN_RETURNS
                        and op.stage == stage
                        and (op.kind is OpKind.APPLY or op.peer == peer)
                        for op in ops[where[0] : where[-1] + 1]
                    )
                else:
                    ok = True
                if not ok:
                    refused.add(pair)
    return frozenset(seen - refused)


def bundles_streams(family: PreconditionerKind) -> bool:
    """Whether the runtime sends `family`'s streamed transfers in buckets: Muon's cores and Shampoo's and SOAP's
    packed units (one message each way a unit, fxkfac/runtime/streaming.py `Packing`); K-FAC's travel alone."""
    return family is not PreconditionerKind.KFAC


def send_buckets(
    programs: Mapping[int, Sequence[Sequence[Op]]], layers: Sequence[LayerCost], family: PreconditionerKind
) -> dict[tuple[int, Op], frozenset[Op]]:
    """Per (rank, streamed SEND) that travels with others, the SENDs of its bucket, as the runtime cuts them (`layers`
    in the runtime's order, by streamed bytes)."""
    if not bundles_streams(family):
        return {}
    pairs = bucketable(programs)
    order = {x.name: i for i, x in enumerate(layers)}
    size = {x.name: x for x in layers}
    out: dict[tuple[int, Op], frozenset[Op]] = {}
    for rank, steps in programs.items():
        for ops in steps:
            units: list[tuple[tuple[OpKind, int, int], str, int, Hashable]] = []
            for op in ops:
                if op.kind not in (OpKind.SEND_LGRAD, OpKind.SEND_PGRAD) or op.layer is None:
                    continue
                peer, stage = op.peer_rank, op.stage_id
                if ((rank, peer, stage) if op.kind is OpKind.SEND_LGRAD else (peer, rank, stage)) in pairs:
                    units.append(((op.kind, peer, stage), op.layer, streamed_bytes(size[op.layer], op.kind), 0))
            for (kind, peer, stage), names in cut(units, order):
                together = frozenset(Op(kind, stage, peer=peer, layer=n) for n in names)
                out.update(dict.fromkeys(((rank, op) for op in together), together))
    return out
