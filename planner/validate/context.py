"""What every check of the validator reads: the plan and its problem, the step timelines simulated from the problem
alone, and the costs and times of each op, recomputed from the cost table."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import TYPE_CHECKING

from fxkfac.planner.problem.ir import NS_STEPS, Op, OpKind
from fxkfac.planner.problem.problem import Problem, agreement_set, copies_of_stage, streamed_stats
from fxkfac.planner.problem.step_timeline import StepTimeline, early_start, step_begins, stream_start, window_length
from fxkfac.planner.problem.strategy import COMM_OPT, receivers

if TYPE_CHECKING:
    from fxkfac.planner.plan.plan import Plan


@dataclass
class Context:
    """One validation: the problem, the plan, the tolerance, the simulated step timelines and the violations found."""

    problem: Problem
    plan: Plan
    tol: float
    fused: frozenset[str]
    refresh: StepTimeline
    normal: StepTimeline
    errors: list[str]
    stretch: float = 0.0

    def period(self, stage: int) -> int:
        return self.plan.layers[self.problem.costs.stages[stage].layers[0].name].period

    def length(self, k: int) -> float:
        return window_length(self.refresh.length, self.normal.length, self.stretch, k)

    def base(self, j: int, k: int) -> float:
        """Absolute start of window step j (0..2k)."""
        return step_begins(self.refresh.length, self.normal.length, self.stretch, j, k)

    def step_start(self, device: int, j: int, k: int) -> float:
        """When window step j begins on `device`: at the step's start on every device under a world barrier;
        under `StepBarrier.AGREEMENT_SET` once every rank of the device's agreement set can have ended step j-1's
        work, F/B, all-reduces and per-step slots (its OPT_STEP waits for them alone: `early_start`)."""
        return self.base(j, k) - early_start(self.problem, self.timeline(j - 1, k), agreement_set(self.problem, device))

    def timeline(self, j: int, k: int) -> StepTimeline:
        return self.refresh if j % k == 0 else self.normal

    @cached_property
    def starts(self) -> dict[tuple[Op, int, int], float]:
        """Each placed op's start by (op, device, window step)."""
        return {(p.op, p.device, p.step): p.start for p in self.plan.placements}

    @cached_property
    def made(self) -> dict[str, list[float]]:
        """Per layer, the ends of its refresh's DECOMP and BCAST placements: when its decompositions exist."""
        out: dict[str, list[float]] = {}
        for p in self.plan.placements:
            if p.op.kind in (OpKind.DECOMP, OpKind.BCAST):
                out.setdefault(p.op.layer_name, []).append(p.end)
        return out


def placed_key(op: Op) -> Op:
    """An op without the root of its broadcast (which `_check_chains` checks against the inversion)."""
    return replace(op, root=op.group[0] if op.group else 0) if op.kind is OpKind.BCAST else op


def per_step(op: Op) -> bool:
    """Whether `op` runs at every step of the period (APPLY, BCAST_PREC, a gradient STATS) rather than once per
    refresh."""
    return op.kind in (OpKind.APPLY, OpKind.BCAST_PREC) or (op.kind is OpKind.STATS and op.mb is None)


def step_ops(c: Context, stage: int, device: int) -> list[Op]:
    """What `device` runs of `stage` at every step: the gradient STATS of the layers it applies, then APPLY of
    the stage (every layer COMM-OPT) or of each layer it applies and the BCAST_PREC of each layer of its row."""
    p, layers = c.problem, c.problem.costs.stages[stage].layers
    copies = copies_of_stage(p, stage)
    ops = [
        Op(OpKind.STATS, stage, layer=layer, part=part)
        for layer, part in gradient_fed_parts(c, stage)
        if device in p.workers(layer) and not streamed_stats(p, layer)
    ]
    streaming = p.streaming
    if streaming is not None and streaming.stage == stage:  # the helper applies the streamed layers
        return ops + [op for x in layers if x.name not in streaming.layers for op in apply_ops(c, stage, x.name)]
    if p.apply_pieces == 1 and all(p.where(x.name).strategy == COMM_OPT for x in layers):
        return ops + [Op(OpKind.APPLY, stage)]
    ops += [op for x in layers if device in p.workers(x.name) for op in apply_ops(c, stage, x.name)]
    return ops + [
        Op(OpKind.BCAST_PREC, stage, root=root, layer=x.name, group=None if row == copies else row)
        for x in layers
        for root, row in receivers(copies, p.where(x.name))
        if device in row
    ]


def apply_ops(c: Context, stage: int, layer: str) -> list[Op]:
    """A layer's APPLY at every step: whole, or a Muon matrix's `Problem.apply_pieces` pieces 0/n .. n-1/n in
    order, all on one rank."""
    n = c.problem.apply_pieces
    return [Op(OpKind.APPLY, stage, layer=layer, piece=None if n == 1 else (i, n)) for i in range(n)]


def piece_seconds(prec: float, piece: tuple[int, int] | None) -> float:
    """Seconds of piece (i, n) of an APPLY of `prec` seconds: the share of the NS_STEPS Newton-Schulz iterations it
    runs, [i*S//n, (i+1)*S//n)."""
    if piece is None:
        return prec
    i, n = piece
    return prec * ((i + 1) * NS_STEPS // n - i * NS_STEPS // n) / NS_STEPS


def gradient_fed_parts(c: Context, stage: int) -> list[tuple[str, str]]:
    """(layer, part) of the stage's parts fed by the reduced gradient."""
    return [
        (x.name, p.part)
        for x in c.problem.costs.stages[stage].layers
        for p in x.parts
        if p.after is OpKind.ALLREDUCE_GRAD
    ]


def op_seconds(c: Context, op: Op) -> float:
    stage = c.problem.costs.stages[op.stage_id]
    if op.kind is OpKind.APPLY:
        if op.layer is None:
            return stage.prec
        cost = c.problem.costs.layer(op.layer)
        folds = sum(p.stats for p in cost.parts) if streamed_stats(c.problem, op.layer) else 0.0
        return piece_seconds(cost.prec, op.piece) + folds
    if op.kind in (OpKind.SYNC_STATS, OpKind.BCAST, OpKind.BCAST_PREC):
        return collective_seconds(c, op)
    part = c.problem.costs.layer(op.layer_name).part(op.part_name)
    return part.stats if op.kind is OpKind.STATS else part.decomp / (1 if op.piece is None else op.piece[1])


def decomp_pieces(n: int) -> list[tuple[int, int] | None]:
    """The `piece` of each DECOMP of one part's decomposition made in n pieces (None: whole)."""
    return [None] if n == 1 else [(i, n) for i in range(n)]


def collective_seconds(c: Context, op: Op) -> float:
    """Seconds of a collective (ALLREDUCE_GRAD, SYNC_STATS, BCAST, BCAST_PREC) over the ranks it names, else every
    copy of its stage, by the cost table's comm model."""
    group = op.group if op.group is not None else copies_of_stage(c.problem, op.stage_id)
    return c.problem.costs.collective_seconds(op, len(group))


def wrapped(start: float, end: float, length: float) -> list[tuple[float, float]]:
    s = start % length
    if length - s < 1e-12:
        s = 0.0
    e = s + (end - start)
    return [(s, e)] if e <= length + 1e-12 else [(s, length), (0.0, e - length)]


def end_of(timeline: StepTimeline, device: int, kind: OpKind, stage: int, mb: int, pipe: int) -> float:
    return next(
        b for op, _, b in timeline.ops[device] if op.kind is kind and (op.stage, op.mb, op.pipe) == (stage, mb, pipe)
    )


def capture_after(c: Context, op: Op) -> OpKind:
    """The op (FWD or BWD) whose end makes the capture a STATS op consumes."""
    return c.problem.costs.layer(op.layer_name).part(op.part_name).after


def apply_start(c: Context, layer: str, u: int, device: int) -> float:
    """When window step `u` (0..2k) on `device` starts the APPLY that preconditions `layer` (the stage's, or the
    layer's own where the stage has them; a streamed layer: when its owner starts the backward that streams it),
    counted from the window's start (0 where there is none)."""
    s = c.problem.costs.stage_of(layer)
    k = c.period(s)
    streaming = c.problem.streaming
    if streaming is not None and layer in streaming.layers:  # needed once the owner starts streaming it
        return c.base(u % k, k) + stream_start(c.problem, c.timeline(u, k)) + c.length(k) * (u // k)
    apply = (
        Op(OpKind.APPLY, s)
        if Op(OpKind.APPLY, s) in step_ops(c, s, c.problem.workers(layer)[0])
        else Op(OpKind.APPLY, s, layer=layer)
    )
    return c.starts.get((apply, device, u % k), 0.0) + c.length(k) * (u // k)
