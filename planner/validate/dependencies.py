"""Checks of the order of a refresh's tasks: statistics after the F/B they read, the synchronization, decomposition
(its pieces in a row) and broadcast after them and before the next refresh, APPLY after the gradient is reduced, and
each layer's `use_offset`: the first step its new decomposition can be used."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import replace

from fxkfac.planner.ir import Op, OpKind, Placement
from fxkfac.planner.problem import copies_of_stage, returned, streamed_stats
from fxkfac.planner.schedules import weight_gradient_kind
from fxkfac.planner.validate.context import (
    Context,
    apply_start,
    capture_after,
    end_of,
    gradient_fed_parts,
    per_step,
)
from fxkfac.planner.w_tasks import placed_w


def check_dependencies(c: Context) -> None:
    factor_tasks: defaultdict[tuple[str, str | None], defaultdict[OpKind, list[Placement]]] = defaultdict(
        lambda: defaultdict(list)
    )
    applies = {(p.op.stage, p.device, p.step): p.start for p in c.plan.placements if p.op.kind is OpKind.APPLY}
    updates: dict[tuple[int | None, int, int], float] = {}  # the first per-step op's start by stage, device, step
    for p in c.plan.placements:
        if per_step(p.op):
            key = (p.op.stage, p.device, p.step)
            updates[key] = min(updates.get(key, p.start), p.start)
    for p in c.plan.placements:
        if p.op.kind is OpKind.STATS and p.op.mb is None:
            _check_gradient_stats(c, p, applies)
        elif p.op.kind is OpKind.STATS:
            kind = capture_after(c, p.op)
            ready = end_of(c.refresh, p.device, kind, p.op.stage_id, p.op.mb_id, p.op.pipe)
            if p.start < ready - c.tol:
                c.errors.append(f"{p.op} on r{p.device} starts at {p.start:.6g} before its {kind} ends ({ready:.6g})")
            if p.end > ready + c.length(c.period(p.op.stage_id)) + c.tol:
                c.errors.append(f"{p.op} on r{p.device} keeps its a/e longer than one window")
        if p.op.kind is OpKind.BWD_W:
            _check_w(c, p, updates)
        elif p.op.kind is OpKind.BCAST_PREC:
            _check_shared_gradient(c, p)
        elif p.op.kind is not OpKind.APPLY:
            # STATS, SYNC_STATS (no factor), DECOMP and BCAST name their layer
            factor_tasks[p.op.layer_name, p.op.part][p.op.kind].append(p)
    for (layer, side), kinds in factor_tasks.items():
        _check_factor(c, layer, side, kinds)
    _check_warm_starts(c, factor_tasks)


def _check_w(c: Context, p: Placement, updates: Mapping[tuple[int | None, int, int], float]) -> None:
    """A placed W starts after its B ends and ends by its stage's gradient all-reduce, in its own step, or where
    the stage has one copy (a no-op all-reduce, after its W's in the program) by its per-step slot ([Note: placed W]
    in planner/w_tasks.py)."""
    k = c.period(p.op.stage_id)
    timeline, base = c.timeline(p.step, k), c.base(p.step, k)
    key = (p.op.stage, p.device, p.step)
    ready = base + end_of(timeline, p.device, OpKind.BWD, p.op.stage_id, p.op.mb_id, p.op.pipe)
    due = base + next(
        a for op, a, _ in timeline.ops[p.device] if op.kind is OpKind.ALLREDUCE_GRAD and op.stage == p.op.stage
    )
    if len(copies_of_stage(c.problem, p.op.stage_id)) == 1:  # a no-op all-reduce: due by the stage's update
        due = min(c.base(p.step + 1, k), updates.get(key, math.inf))
    if p.start < ready - c.tol or p.end > due + c.tol:
        c.errors.append(
            f"{p.op} on r{p.device} at step {p.step} is not between its B ({ready:.6g}) and its "
            f"stage's update ({due:.6g})"
        )


def _check_shared_gradient(c: Context, p: Placement) -> None:
    """A BCAST_PREC of window step j starts on every member of its row at once, after its root's APPLY of the
    layer in that step (which made the preconditioned gradient)."""
    same = [q for q in c.plan.placements if q.op == p.op and q.step == p.step]
    if max(q.start for q in same) - min(q.start for q in same) > c.tol:
        c.errors.append(f"{p.op} at step {p.step}: the row starts it at different times")
    made = [
        q
        for q in c.plan.placements
        if q.op.kind is OpKind.APPLY and q.device == p.op.root and q.step == p.step and q.op.layer == p.op.layer
    ]
    if not made or p.start < made[0].end - c.tol:
        c.errors.append(f"{p.op} on r{p.device} at step {p.step} starts before r{p.op.root} applied {p.op.layer}")


def _check_gradient_stats(c: Context, p: Placement, applies: Mapping[tuple[int | None, int, int], float]) -> None:
    """A gradient STATS of window step j starts after its stage's gradient all-reduce of that step on its device
    and ends by the start of the stage's APPLY there (`applies`: APPLY starts by stage, device and step), which
    overwrites the gradient."""
    s = p.op.stage
    assert s is not None, "a STATS names its stage (Op checks it)"
    k = c.period(s)
    if (p.device, s) not in c.refresh.allreduce_end or not 0 <= p.step < k:
        return  # check_placed_once says where it should be
    ready = c.base(p.step, k) + c.timeline(p.step, k).allreduce_end[p.device, s]
    if p.start < ready - c.tol:
        c.errors.append(
            f"{p.op} on r{p.device} at step {p.step} starts at {p.start:.6g} before the stage's "
            f"gradient is reduced ({ready:.6g})"
        )
    apply = applies.get((s, p.device, p.step))
    if apply is not None and p.end > apply + c.tol:
        c.errors.append(
            f"{p.op} on r{p.device} at step {p.step} ends at {p.end:.6g}, after APPLY s{s} starts ({apply:.6g})"
        )


def _check_factor(c: Context, layer: str, side: str | None, kinds: dict) -> None:
    stage = c.problem.costs.stage_of(layer)
    L = c.length(c.period(stage))
    copies = copies_of_stage(c.problem, stage)
    curv, sync, inv, bcast = (kinds.get(k, []) for k in (OpKind.STATS, OpKind.SYNC_STATS, OpKind.DECOMP, OpKind.BCAST))
    if (layer, side) in gradient_fed_parts(c, stage):
        _check_gradient_refresh(c, layer, side, L, curv, inv + bcast)
        return
    if layer in c.fused:
        kind = c.problem.costs.layer(layer).part(side).after  # type: ignore[arg-type]  # fused: per part
        kind = weight_gradient_kind(c.problem.kind) if kind is OpKind.BWD else kind  # made with the W
        ready = max(b for d in copies for op, _, b in c.refresh.fixed(d) if op.stage == stage and op.kind is kind)
        if kind is OpKind.BWD_W and placed_w(c.problem):  # the refresh step's W's, placed
            ready = max(q.end for q in c.plan.placements if q.op.kind is kind and q.op.stage == stage and q.step == 0)
    else:
        ready = max((p.end for p in curv), default=0.0)
    for group in (sync, bcast):
        if group and max(p.start for p in group) - min(p.start for p in group) > c.tol:
            c.errors.append(f"{group[0].op}: the copies start it at different times")
    chain = [x for x in (sync, inv, bcast) if x]
    for x in chain:
        if min(p.start for p in x) < ready - c.tol:
            c.errors.append(f"{x[0].op} starts before the work it depends on ends ({ready:.6g})")
        ready = max(p.end for p in x)
    if inv:
        inv = sorted(inv, key=lambda p: p.op.piece or (0, 1))
        _check_pieces(c, layer, side, inv)
        if any(p.op.root != inv[-1].device for p in bcast):
            c.errors.append(f"broadcast of {layer} {side} does not come from r{inv[-1].device}, where it was inverted")
        if any(inv[-1].end > p.start + L + c.tol for p in curv):
            c.errors.append(f"DECOMP {layer} {side} ends after the next refresh starts its curvature")
        if any(p.end > inv[0].start + L + c.tol for p in bcast):
            c.errors.append(f"BCAST {layer} {side} ends after the next refresh's inversion starts")


def _check_warm_starts(c: Context, factor_tasks: Mapping[tuple[str, str | None], dict]) -> None:
    """A layer whose decompositions start from its previous preconditioner (pieces: Newton-Schulz; any DECOMP of a
    `Problem.warm_start`) makes each refresh before the next refresh's first DECOMP of any part starts, and starts
    its broadcasts before it (collectives keep their order)."""
    layers: dict[str, list[Placement]] = {}
    for (layer, _), kinds in factor_tasks.items():
        layers.setdefault(layer, []).extend(kinds.get(OpKind.DECOMP, []) + kinds.get(OpKind.BCAST, []))
    for layer, refresh in layers.items():
        firsts = [
            p
            for p in refresh
            if p.op.kind is OpKind.DECOMP and (p.op.piece[0] == 0 if p.op.piece is not None else c.problem.warm_start)
        ]
        if not firsts:
            continue
        L = c.length(c.period(c.problem.costs.stage_of(layer)))
        start = min(p.start for p in firsts)
        for p in refresh:
            done = p.end if p.op.kind is OpKind.DECOMP else p.start
            if done > start + L + c.tol:
                c.errors.append(
                    f"{p.op} is done after the next refresh of {layer} starts decomposing: that refresh "
                    "would not start from this one's preconditioner"
                )


def _check_pieces(c: Context, layer: str, side: str | None, pieces: list[Placement]) -> None:
    """The pieces of one decomposition (sorted by index) run one after another on one rank."""
    for a, b in zip(pieces, pieces[1:]):
        if b.device != a.device:
            c.errors.append(
                f"{b.op} runs on r{b.device}, piece {a.op.piece} of {layer} {side} on r{a.device}: the "
                "pieces of a decomposition run on one rank"
            )
        if b.start < a.end - c.tol:
            c.errors.append(f"{b.op} starts at {b.start:.6g}, before {a.op} ends ({a.end:.6g})")


def _check_gradient_refresh(
    c: Context, layer: str, side: str | None, L: float, stats: list[Placement], refresh: list[Placement]
) -> None:
    """A gradient-fed part's DECOMP starts after the refresh step's STATS of the part on its rank (which
    snapshots the statistic), its BCASTs after the DECOMP, together, from the DECOMP's rank, and before the next
    refresh's DECOMP (`L`: the window's length)."""
    decomps = [p for p in refresh if p.op.kind is OpKind.DECOMP]
    bcasts = [p for p in refresh if p.op.kind is OpKind.BCAST]
    if len(decomps) != 1:
        return  # check_placed_once counts them
    decomp = decomps[0]
    snapshot = [p for p in stats if (p.device, p.step) == (decomp.device, 0)]
    if streamed_stats(c.problem, layer):  # the helper folds it: the snapshot lands with the refresh step's return
        landed = c.refresh.end_of(decomp.device, returned(c.problem, layer))
        if decomp.start < landed - c.tol:
            c.errors.append(
                f"{decomp.op} starts at {decomp.start:.6g}, before the refresh step's statistics of {layer} return "
                f"from its helper to r{decomp.device} ({landed:.6g})"
            )
    elif not snapshot:
        c.errors.append(f"{decomp.op} on r{decomp.device}: no STATS of the refresh step on r{decomp.device}")
    elif decomp.start < snapshot[0].end - c.tol:
        c.errors.append(
            f"{decomp.op} starts at {decomp.start:.6g}, before the refresh step's {snapshot[0].op} "
            f"on r{decomp.device} ends ({snapshot[0].end:.6g})"
        )
    if bcasts and max(p.start for p in bcasts) - min(p.start for p in bcasts) > c.tol:
        c.errors.append(f"{bcasts[0].op}: the copies start it at different times")
    if any(p.start < decomp.end - c.tol for p in bcasts):
        c.errors.append(f"{bcasts[0].op} starts before the work it depends on ends ({decomp.end:.6g})")
    if any(p.op.root != decomp.device for p in bcasts):
        c.errors.append(f"broadcast of {layer} {side} does not come from r{decomp.device}, where it was decomposed")
    if any(p.end > decomp.start + L + c.tol for p in bcasts):
        c.errors.append(f"BCAST {layer} {side} ends after the next refresh's DECOMP starts")


def check_precs_and_offsets(c: Context) -> None:
    prec: dict[tuple[Op, int, int], Placement] = {
        (p.op, p.device, p.step): p for p in c.plan.placements if p.op.kind is OpKind.APPLY
    }
    for p in prec.values():
        s, d, j = p.op.stage, p.device, p.step
        if p.op.piece is not None and p.op.piece[0] > 0:  # a cut APPLY: piece i after piece i-1, on the same rank
            before = prec.get((replace(p.op, piece=(p.op.piece[0] - 1, p.op.piece[1])), d, j))
            if before is None or before.end > p.start + c.tol:
                c.errors.append(f"'{p.op}' on r{d} step {j} does not follow its previous piece there")
        assert s is not None, "an APPLY names its stage (Op checks it)"
        k = c.period(s)
        lo, hi = c.base(j, k) + c.timeline(j, k).allreduce_end[d, s], c.step_start(d, j + 1, k)
        if p.start < lo - c.tol or p.end > hi + c.tol:
            c.errors.append(f"APPLY s{s} step {j} on r{d} [{p.start:.6g}, {p.end:.6g}) is outside [{lo:.6g}, {hi:.6g})")
    for layer, ends in c.made.items():
        t = max(ends)
        k = c.period(c.problem.costs.stage_of(layer))
        workers = c.problem.workers(layer)
        u = next(
            (u for u in range(2 * k + 1) if all(apply_start(c, layer, u, d) >= t - c.tol for d in workers)), 2 * k + 1
        )
        claimed = c.plan.layers[layer].use_offset
        if claimed != u:
            c.errors.append(f"layer {layer}: use_offset {claimed} claimed, but its inverse is first usable at step {u}")
