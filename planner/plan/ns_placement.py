"""Where a Muon plan runs each matrix's Newton-Schulz (its APPLY), read back from the plan's step: on a rank of the
matrix's own stage after its last backward (its tail bubble, or the step's cycle where the slack is short), on a
helper rank idle at the step's end (streamed, planner/problem/lowering.py), or on one copy that broadcasts the result
(mem-opt, Moonlight's distributed Muon, planner/problem/strategy.py). The plan view and `fxkfac plan --explain` show
it."""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum

from fxkfac.planner.plan.plan import Plan
from fxkfac.planner.problem.ir import LAYER_SENDS, Op, OpKind
from fxkfac.planner.problem.problem import Problem, stages_on_device
from fxkfac.planner.problem.step_timeline import plain_step_time, step_timeline
from fxkfac.planner.problem.strategy import LayerDistribution

__all__ = ["NSWhere", "NSTask", "ns_tasks", "critical_path_step", "ns_stage_lines", "ns_summary"]


class NSWhere(StrEnum):
    """Where one Newton-Schulz task runs."""

    OWN = "own"
    """On each rank holding the matrix's stage, after its gradient all-reduce."""
    STREAMED = "streamed"
    """On a helper rank, the NS input sent there and the update sent back."""
    SHARED = "shared"
    """On one copy of the stage (a grad worker), the update broadcast to the others (BCAST_PREC)."""


@dataclass(frozen=True, slots=True)
class NSTask:
    """One APPLY of a Muon plan's step (or a piece of one): its stage, matrices (`layers`), rank, where, and when it
    runs in the step (seconds from the step's start); `transfer` the seconds of its streamed sends (the input and the
    update, counted on its first piece)."""

    stage: int
    layers: tuple[str, ...]
    rank: int
    where: NSWhere
    start: float
    end: float
    transfer: float = 0.0
    piece: tuple[int, int] | None = None
    """Piece (i, n) of a cut APPLY (`Problem.apply_pieces`); None: whole."""


def _where(problem: Problem, rank: int, op: Op) -> NSWhere:
    if op.stage not in stages_on_device(problem, rank):
        return NSWhere.STREAMED
    if op.layer is not None and problem.where(op.layer) != LayerDistribution():
        return NSWhere.SHARED
    return NSWhere.OWN


def ns_tasks(plan: Plan) -> list[NSTask]:
    """Every APPLY of the plan's step, by rank and start; an APPLY naming no layer covers all its stage's."""
    problem = plan.problem
    out = []
    for rank, ops in step_timeline(problem).ops.items():
        for op, start, end in ops:
            if op.kind is not OpKind.APPLY or op.stage is None:
                continue
            names = (
                (op.layer,) if op.layer is not None else tuple(x.name for x in problem.costs.stages[op.stage].layers)
            )
            where = _where(problem, rank, op)
            transfer = 0.0
            if where is NSWhere.STREAMED and op.layer is not None and (op.piece is None or op.piece[0] == 0):
                sends = (
                    Op(kind, op.stage, peer=rank, layer=op.layer)
                    for kind in LAYER_SENDS
                    if kind is not OpKind.SEND_REPLICA
                )
                transfer = sum(problem.costs.collective_seconds(s, 2) for s in sends)
            out.append(NSTask(op.stage, names, rank, where, start, end, transfer, op.piece))
    return sorted(out, key=lambda t: (t.stage, t.start, t.rank))


def critical_path_step(problem: Problem) -> float:
    """The step with every stage orthogonalizing its own matrices after its last backward, on every copy (no
    streaming, no sharing): Muon as torch.optim.Muon would run in a pipeline."""
    return step_timeline(replace(problem, streaming=None, distributions=())).length


def ns_stage_lines(plan: Plan) -> list[str]:
    """Per stage: its units' APPLY seconds (the matrices' NS, the AdamW parameters' steps), who ran them, and when
    the last ended against the plain step's end."""
    problem = plan.problem
    plain = plain_step_time(problem)
    tasks = ns_tasks(plan)
    lines = []
    for s, stage in enumerate(problem.costs.stages):
        mine = [t for t in tasks if t.stage == s]
        if not mine:
            continue
        parts = []
        for where in NSWhere:
            placed = [t for t in mine if t.where is where]
            if not placed:
                continue
            ranks = " ".join(f"r{r}" for r in sorted({t.rank for t in placed}))
            count = len({n for t in placed for n in t.layers})
            busy = sum(t.end - t.start for t in placed) * 1e3
            sends = sum(t.transfer for t in placed) * 1e3
            text = f"{count} {where.value} on {ranks} ({busy:.1f} ms"
            parts.append(text + (f", sends {sends:.1f} ms)" if sends else ")"))
        last = max(t.end for t in mine)
        verdict = (
            f"hidden, ends {(plain - last) * 1e3:.1f} ms before"
            if last <= plain
            else f"+{(last - plain) * 1e3:.1f} ms past"
        )
        lines.append(
            f"s{s}: {len(stage.layers)} units, APPLY {stage.prec * 1e3:.1f} ms: "
            + "; ".join(parts)
            + f"; {verdict} the plain step's end"
        )
    return lines


def ns_summary(plan: Plan) -> str:
    """The step time Muon adds as planned, against Muon on the critical path."""
    m, problem = plan.metrics, plan.problem
    plain = plain_step_time(problem)
    critical = critical_path_step(problem)
    return (
        f"+{(m.step_time - plain) * 1e3:.2f} ms (+{m.step_time / plain - 1:.1%}) over the plain pipeline; on the "
        f"critical path (each stage its own matrices after its last backward) +{(critical - plain) * 1e3:.2f} ms "
        f"(+{critical / plain - 1:.1%})"
    )
