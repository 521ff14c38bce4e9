"""Pure program -> program passes: transfers, data-parallel expansion, the preconditioner on the critical path,
start-up steps and streamed preconditioning (docs/STREAMED_APPLY.md); the runtime only interprets their programs."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import Enum, auto
from functools import partial
from typing import TYPE_CHECKING, Any

from fxkfac.planner.problem.costs import LayerCost, PreconditionerKind, StageCost
from fxkfac.planner.problem.errors import PlanFormatError
from fxkfac.planner.problem.ir import LayerTiming, Op, OpKind, P, Placement, Program, Programs, cut_apply, per_step
from fxkfac.planner.problem.schedules import ScheduleKind, num_stages, pipes, schedule_programs, stage_rank
from fxkfac.planner.problem.strategy import (
    COMM_OPT,
    LayerDistribution,
    grad_workers,
    keeps_statistics,
    least_loaded,
    receivers,
)

if TYPE_CHECKING:
    from fxkfac.planner.problem.costs import CostTable

KFAC_PARTS = ("A", "B")
"""K-FAC's parts: the input-side factor A and the output-side factor B (another family names its own)."""
_TRANSFERS = {OpKind.FWD: (OpKind.RECV_ACT, OpKind.SEND_ACT, 1), OpKind.BWD: (OpKind.RECV_GRAD, OpKind.SEND_GRAD, -1)}
"""Per F/B: the RECV of its input, the SEND of its output, and the stage offset its output goes to."""


def add_send_recv(programs: Mapping[int, P], kind: ScheduleKind | str, D: int, v: int = 1) -> dict[int, P]:
    """Each FWD (BWD) between the RECV of its input and the SEND of its output from and to other pp ranks (`peer`;
    apply before `expand_dp`), for one step's ops or a period program per rank."""
    kind, S = ScheduleKind(kind), num_stages(kind, D, v)

    def lower(rank: int, ops: Sequence[Op]) -> list[Op]:
        out: list[Op] = []
        for op in ops:
            if op.kind not in _TRANSFERS or op.stage is None:
                out.append(op)
                continue
            recv, send, offset = _TRANSFERS[op.kind]
            stages = (op.stage - offset, op.stage + offset)  # the pp ranks of its neighbours (`rank` beyond the ends)
            before, after = (stage_rank(kind, D, s, op.pipe, v=v) if 0 <= s < S else rank for s in stages)
            if before != rank:
                out.append(Op(recv, op.stage, op.mb, op.pipe, peer=before))
            out.append(op)
            if after != rank:
                out.append(Op(send, op.stage, op.mb, op.pipe, peer=after))
        return out

    return {rank: per_step(body, partial(lower, rank)) for rank, body in programs.items()}


def expand_dp(programs_by_pp_rank: Mapping[int, P], W: int) -> dict[int, P]:
    """Each pp rank's program copied to its W data-parallel replicas (global rank pp * W + dp, peers the same
    replica's); a collective's group is every rank that runs it."""
    if W < 1:
        raise ValueError(f"the data-parallel size W must be >= 1, got {W}")

    def remap(dp: int, ops: Sequence[Op]) -> list[Op]:
        return [op if op.peer is None else replace(op, peer=op.peer * W + dp) for op in ops]

    return {
        pp * W + dp: per_step(body, partial(remap, dp)) for pp, body in programs_by_pp_rank.items() for dp in range(W)
    }


def rank_programs(kind: ScheduleKind | str, D: int, N: int, W: int, v: int = 1) -> dict[int, list[Op]]:
    """One step of the plain pipeline per global rank: the schedule, its transfers, its dp replicas."""
    return expand_dp(add_send_recv(schedule_programs(kind, D, N, v=v), kind, D, v), W)


def ranks_of_stages(kind: ScheduleKind | str, D: int, W: int, v: int = 1) -> dict[int, tuple[int, ...]]:
    """Stage -> the sorted global ranks holding a copy of it."""
    return {
        s: tuple(sorted({stage_rank(kind, D, s, p, v=v) * W + w for p in pipes(kind) for w in range(W)}))
        for s in range(num_stages(kind, D, v))
    }


def linked_classes(sets: Iterable[Sequence[int]], count: int) -> list[tuple[int, ...]]:
    """The classes of 0..count-1 linked transitively by sharing one of `sets`, each ascending, by first member."""
    classes = [{x} for x in range(count)]
    for members in map(set, sets):
        linked = members.union(*(c for c in classes if c & members))
        classes = [c for c in classes if not c & linked] + [linked]
    return sorted(tuple(sorted(c)) for c in classes)


def refreshing(timings: Mapping[str, LayerTiming], names: Sequence[str], step: int) -> list[str]:
    """The layers among `names` whose factors global step `step` refreshes (`t % period == curv_step`)."""
    return [n for n in names if step % timings[n].period == timings[n].curv_step]


class Assignment(Enum):
    """How the critical-path programs deal a stage's decompositions at a refresh to its holders (plans use the
    solver): ROUND_ROBIN in (layer, part) order; LPT, Distributed Shampoo's Alg. 3 by the cost table's seconds."""

    ROUND_ROBIN = auto()
    LPT = auto()


Decomposition = tuple[str, str]
"""(layer, part) of one decomposition."""


def assign_decompositions(
    decomps: Sequence[Decomposition],
    ranks: Sequence[int],
    assignment: Assignment = Assignment.ROUND_ROBIN,
    seconds: Mapping[Decomposition, float] | None = None,
) -> dict[Decomposition, int]:
    """The rank among `ranks` (ascending) that runs each of `decomps` (one stage's refresh, in (layer, part) order):
    LPT gives the largest first (ties by name) to the least loaded rank (ties: the lowest), loads from zero."""
    if not ranks:
        raise ValueError("no rank to assign decompositions to")
    if assignment is Assignment.ROUND_ROBIN:
        return {d: ranks[i % len(ranks)] for i, d in enumerate(decomps)}
    if seconds is None:
        raise ValueError("Assignment.LPT deals by cost: pass the seconds of each (layer, part) decomposition")
    missing = [d for d in decomps if d not in seconds]
    if missing:
        raise ValueError(f"no decomposition seconds for {missing[:3]}{' and more' if len(missing) > 3 else ''}")
    return least_loaded({d: seconds[d] for d in decomps}, ranks)


def decomposition_seconds(costs: CostTable) -> dict[Decomposition, float]:
    """(layer, part) -> seconds of one decomposition of every part in the cost table (what LPT sorts by)."""
    return {(x.name, p.part): p.decomp for x in costs.layers for p in x.parts}


def step_applies(
    rank: int,
    stage: int,
    layers: Sequence[str],
    holders: tuple[int, ...],
    distributions: Mapping[str, LayerDistribution],
    pipe: int = 0,
    pieces: int = 1,
) -> tuple[list[Op], list[Op]]:
    """(APPLYs, BCAST_PRECs) `rank` runs of `stage` every step: one APPLY of the stage copy where every layer is
    COMM-OPT and uncut, else one per layer it is a grad worker of (`pieces` each), then its row's BCAST_PRECs."""
    where = {n: distributions.get(n, LayerDistribution()) for n in layers}
    if pieces == 1 and all(w.strategy == COMM_OPT for w in where.values()):
        return [Op(OpKind.APPLY, stage=stage, pipe=pipe)], []
    applies = [
        piece
        for n in layers
        if rank in grad_workers(holders, where[n])
        for piece in cut_apply(Op(OpKind.APPLY, stage=stage, layer=n), pieces)
    ]
    shares = [
        Op(OpKind.BCAST_PREC, stage=stage, root=root, layer=n, group=None if row == holders else row)
        for n in layers
        for root, row in receivers(holders, where[n])
        if rank in row
    ]
    return applies, shares


def capture_stats(
    bwd: Op,
    rank: int,
    parts: Mapping[str, Sequence[str]],
    holders: tuple[int, ...],
    distributions: Mapping[str, LayerDistribution],
) -> list[Op]:
    """The STATS right after `bwd` folding its micro-batch's captures: one per captured part (`parts`, by layer) of
    each layer whose statistics `rank` keeps (a plan's fused layers, plan=None's refreshing ones)."""
    return [
        Op(OpKind.STATS, stage=bwd.stage, mb=bwd.mb, pipe=bwd.pipe, part=side, layer=name)
        for name, sides in parts.items()
        if keeps_statistics(rank, holders, distributions.get(name, LayerDistribution()))
        for side in sides
    ]


def naive_programs(
    kind: ScheduleKind | str,
    D: int,
    N: int,
    W: int,
    timings: Mapping[str, LayerTiming],
    stage_layers: Mapping[int, Sequence[str]],
    *,
    v: int = 1,
    parts: Sequence[str] = KFAC_PARTS,
    gradient_parts: frozenset[str] = frozenset(),
    assignment: Assignment = Assignment.ROUND_ROBIN,
    seconds: Mapping[Decomposition, float] | None = None,
    distributions: Mapping[str, LayerDistribution] | None = None,
) -> Programs:
    """The preconditioner on the critical path (PipeFisher's "naive K-FAC", "K-FAC+skip" at period k): curvature after
    each refreshing layer's BWD and the tail before OPT_STEP, one step per step of the periods' lcm (none: plain)."""
    holders = ranks_of_stages(kind, D, W, v)
    period = math.lcm(*(t.period for t in timings.values())) if timings else 1
    where = {n: (distributions or {}).get(n, LayerDistribution()) for names in stage_layers.values() for n in names}
    captured = [side for side in parts if side not in gradient_parts]

    def tail(rank: int, copies: Mapping[int, int], step: int) -> list[Op]:
        """What `rank` (holding stage: pipe `copies`) runs before OPT_STEP: gradient STATS, SYNC_STATS, DECOMPs dealt by
        `assignment`, BCASTs, APPLYs, BCAST_PRECs; collectives in (stage, layer, part) order on every member."""
        out: list[Op] = []
        for s in sorted(copies):
            ranks, layers = holders[s], stage_layers[s]
            workers = {n: grad_workers(ranks, where[n]) for n in layers}
            names = refreshing(timings, layers, step)
            by_column: dict[tuple[int, ...], list[Decomposition]] = {}  # each decomposition dealt over its workers
            for n in names:
                by_column.setdefault(workers[n], []).extend((n, part) for part in parts)
            roots = {
                d: r
                for col, ds in by_column.items()
                for d, r in assign_decompositions(ds, col, assignment, seconds).items()
            }
            sides: Sequence[str | None] = (
                captured if gradient_parts else [None]
            )  # SYNC_STATS per captured part, or layer
            for n in layers:
                mine = rank in workers[n]
                out += [Op(OpKind.STATS, s, part=p, layer=n) for p in parts if mine and p in gradient_parts]
                if n not in names:
                    continue
                if len(ranks) > 1 and captured and not where[n].strategy.local_factors:  # averaged, but local factors
                    out += [Op(OpKind.SYNC_STATS, s, part=side, layer=n) for side in sides]
                out += [Op(OpKind.DECOMP, s, part=p, layer=n) for p in parts if roots[n, p] == rank]
                if mine and len(workers[n]) > 1:  # each decomposition from its root to the layer's other grad workers
                    group = None if workers[n] == ranks else workers[n]  # None: every holder
                    out += [Op(OpKind.BCAST, s, part=p, root=roots[n, p], layer=n, group=group) for p in parts]
            applies, shared = step_applies(rank, s, layers, ranks, where, pipe=copies[s])
            out += applies + shared
        order = [OpKind.STATS, OpKind.SYNC_STATS, OpKind.DECOMP, OpKind.BCAST, OpKind.APPLY, OpKind.BCAST_PREC]
        return sorted(out, key=lambda op: order.index(op.kind))  # stable: by kind, then stage, layer and part

    def with_prec(ops: Sequence[Op], rank: int, step: int) -> list[Op]:
        copies = {op.stage: op.pipe for op in ops if op.kind is OpKind.FWD and op.stage is not None}
        made = OpKind.BWD_W if any(op.kind is OpKind.BWD_W for op in ops) else OpKind.BWD
        body: list[Op] = []
        for op in ops:
            if op.kind is OpKind.OPT_STEP:
                body += tail(rank, copies, step)
            body.append(op)
            if op.kind is made and op.stage is not None:
                names = refreshing(timings, stage_layers[op.stage], step)
                body.extend(capture_stats(op, rank, {n: captured for n in names}, holders[op.stage], where))
        return body

    return {
        rank: [with_prec(ops, rank, step) if timings else list(ops) for step in range(period)]
        for rank, ops in rank_programs(kind, D, N, W, v).items()
    }


def startup_programs(programs: Mapping[int, Program], born: Mapping[int, Mapping[Op, int]]) -> Programs:
    """Each rank's first steps of its modulo schedule, without the work of refreshes from before step 0: step t keeps
    `op` once t reaches `born[rank][op]`, the latest window step placing it (empty: the period runs from step 0)."""
    out: Programs = {}
    for rank, program in programs.items():
        late = born.get(rank, {})
        last = max(late.values(), default=0)
        out[rank] = [[op for op in program[t % len(program)] if late.get(op, 0) <= t] for t in range(last)]
    return out


@dataclass(frozen=True)
class Streaming:
    """Layers of `stage` in the order its owners' backward makes their gradients final, and each one's helper rank."""

    stage: int
    helpers: tuple[int, ...]
    layers: tuple[str, ...]
    whole_backward: bool = False
    """Whether the owner's backward makes every gradient at its end (compiled: one autograd node), so nothing streams
    during it; else each layer's is final as the backward reaches it (`ready_fractions`)."""

    def __post_init__(self) -> None:
        ranks = (self.stage, *self.helpers) if isinstance(self.helpers, tuple) else (-1,)
        names = self.layers if isinstance(self.layers, tuple) else ()
        ok = (
            all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks)
            and 0 < len(names) == len(self.helpers) == len(set(names))
            and all(isinstance(n, str) and n for n in names)
            and isinstance(self.whole_backward, bool)
        )
        if not ok:
            raise PlanFormatError(
                f"Streaming needs a stage (int >= 0), distinct layer names and a helper rank (int >= 0) for each, "
                f"got {self!r}"
            )

    @property
    def ranks(self) -> tuple[int, ...]:
        """The helper ranks, each once, in the order of their first layer."""
        return tuple(dict.fromkeys(self.helpers))

    def helper_of(self, layer: str) -> int:
        """The rank that preconditions `layer`."""
        return self.helpers[self.layers.index(layer)]

    def layers_of(self, helper: int) -> tuple[str, ...]:
        """The layers `helper` preconditions, in the order their gradients become final."""
        return tuple(n for n, h in zip(self.layers, self.helpers, strict=True) if h == helper)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able form."""
        whole = {"whole_backward": True} if self.whole_backward else {}
        return {"stage": self.stage, "helpers": list(self.helpers), "layers": list(self.layers), **whole}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Streaming:
        """Inverse of `to_dict` (also an older plan's one {"helper": rank}); PlanFormatError when malformed."""
        try:
            layers = tuple(data["layers"])
            helpers = tuple(data["helpers"]) if "helpers" in data else (data["helper"],) * len(layers)
            return cls(data["stage"], helpers, layers, data.get("whole_backward", False))
        except (KeyError, TypeError) as e:
            raise PlanFormatError(f"the plan's streaming is malformed: {e!r}") from e


def can_stream(family: PreconditionerKind, layer: LayerCost) -> bool:
    """Whether a helper may run `layer`'s per-step work: an APPLY reading its preconditioner alone (K-FAC), one whose
    statistics all come from the gradient (Shampoo, SOAP: the helper keeps that state), or a Muon matrix's."""
    if family is PreconditionerKind.MUON:
        return True
    gradient = [p.after is OpKind.ALLREDUCE_GRAD for p in layer.parts]
    return all(gradient) if any(gradient) else not layer.state_bytes


def ready_fractions(stage: StageCost) -> dict[str, float]:
    """The share of the stage's eager backward done when each layer's gradient is final: as profiled
    (`LayerCost.grad_ready`) where every layer has it, else the layers in reverse, each a share its gradient's size."""
    layers, measured = stage.layers, [x.grad_ready for x in stage.layers]
    if layers and stage.bwd > 0 and all(t is not None for t in measured):
        return {x.name: min(1.0, t / stage.bwd) for x, t in zip(layers, measured, strict=True) if t is not None}
    total = sum(x.gradient_bytes for x in layers)
    done, out = 0, {}
    for x in reversed(layers):
        done += x.gradient_bytes
        out[x.name] = done / total if total else 1.0
    return out


def _before_step_end(ops: list[Op], extra: Sequence[Op]) -> list[Op]:
    """`ops` with `extra` before its OPT_STEP (at its end without one)."""
    at = next((i for i, op in enumerate(ops) if op.kind is OpKind.OPT_STEP), len(ops))
    return ops[:at] + list(extra) + ops[at:]


def stream_step(
    ops: Mapping[int, Sequence[Op]], streaming: Streaming, owners: Sequence[int], pieces: int = 1
) -> dict[int, list[Op]]:
    """One step's programs with the streamed layers handed over: each owner sends its gradient after its last BWD and
    takes it back before OPT_STEP; before its own OPT_STEP the helper receives, applies and returns it, by layer."""
    s, pairs = streaming.stage, list(zip(streaming.layers, streaming.helpers, strict=True))
    out = {rank: list(body) for rank, body in ops.items()}
    for owner in owners:
        body = out[owner]
        last = max(i for i, op in enumerate(body) if op.kind in (OpKind.BWD, OpKind.BWD_W) and op.stage == s)
        body[last + 1 : last + 1] = [Op(OpKind.SEND_LGRAD, s, peer=h, layer=n) for n, h in pairs]
        back = [Op(OpKind.RECV_PGRAD, s, peer=h, layer=n) for n, h in pairs]
        out[owner] = _before_step_end(body, back)
    for helper in streaming.ranks:
        chain = [
            op
            for n in streaming.layers_of(helper)
            for op in (
                *(Op(OpKind.RECV_LGRAD, s, peer=owner, layer=n) for owner in owners),
                *cut_apply(Op(OpKind.APPLY, s, layer=n), pieces),
                *(Op(OpKind.SEND_PGRAD, s, peer=owner, layer=n) for owner in owners),
            )
        ]
        out[helper] = _before_step_end(out[helper], chain)
    return out


Made = Mapping[str, tuple[Op, int, int]]
"""Per streamed layer: the op completing a refresh on the first owner, its window step, the layer's use offset."""


def made_refreshes(
    streaming: Streaming, placements: Iterable[Placement], timings: Mapping[str, LayerTiming], sender: int
) -> Made:
    """Each streamed layer's DECOMP or BCAST on `sender` (the first owner) that its window places last."""
    last: dict[str, Placement] = {}
    for p in placements:
        if p.op.kind in (OpKind.DECOMP, OpKind.BCAST) and p.device == sender and p.op.layer in streaming.layers:
            before = last.get(p.op.layer_name)
            if before is None or (p.step, p.end) > (before.step, before.end):
                last[p.op.layer_name] = p
    return {name: (p.op, p.step, timings[name].use_offset) for name, p in last.items()}


def replica_born(streaming: Streaming, owner: int, made: Made) -> dict[int, dict[Op, int]]:
    """The window step from which each replica transfer runs on the owner and the helper (`startup_programs`)."""
    s = streaming.stage
    out: dict[int, dict[Op, int]] = {owner: {}}
    for n, (_, step, _) in made.items():
        helper = streaming.helper_of(n)
        out[owner][Op(OpKind.SEND_REPLICA, s, peer=helper, layer=n)] = step
        out.setdefault(helper, {})[Op(OpKind.RECV_REPLICA, s, peer=owner, layer=n)] = step
    return out


def add_replicas(programs: Mapping[int, Program], streaming: Streaming, owner: int, made: Made) -> dict[int, Program]:
    """The programs with each streamed layer's replica: SEND_REPLICA after its `made` op on `owner`, RECV_REPLICA in
    that step on the helper (periods' lcm), before the layer's RECV_LGRAD if used in that step, else before OPT_STEP."""
    s = streaming.stage
    out = {rank: [list(step) for step in body] for rank, body in programs.items()}
    k_owner = len(out[owner])
    for h in streaming.ranks:
        out[h] = [list(out[h][j % len(out[h])]) for j in range(math.lcm(k_owner, len(out[h])))]
    for layer, (decomp, window_step, use_offset) in made.items():
        helper = streaming.helper_of(layer)
        period = len(out[helper])
        step = out[owner][window_step % k_owner]
        step.insert(step.index(decomp) + 1, Op(OpKind.SEND_REPLICA, s, peer=helper, layer=layer))
        recv = Op(OpKind.RECV_REPLICA, s, peer=owner, layer=layer)
        for j in range(window_step % k_owner, period, k_owner):
            body = out[helper][j]
            if window_step == use_offset:
                first = next(i for i, op in enumerate(body) if op.kind is OpKind.RECV_LGRAD and op.layer == layer)
                body.insert(first, recv)
            else:
                out[helper][j] = _before_step_end(body, [recv])
    return out
