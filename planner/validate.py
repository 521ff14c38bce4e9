"""Checks a plan against its problem, independently of the solvers: every constraint, in seconds.

It recomputes what the plan must contain from the problem alone (the simulated step timelines, the
cost table, whose comm model prices the collectives: the gradient all-reduce, SYNC_STATS and BCAST) and
shares no code with planner.window, greedy or cpsat. Times may be off by the plan's
`metrics.time_quantum` (the planner's time grid, see [Note: time grid] in planner/window.py). Every
step is followed by `metrics.stretch` idle seconds ([Note: stretch]); the step time, stretch included,
must stay within the problem's max_overhead. A part fed by the reduced gradient (`PartCost.after`
ALLREDUCE_GRAD) has a STATS without micro-batch at every step on every copy of its stage, between the
stage's gradient all-reduce and its APPLY, and no SYNC_STATS; its DECOMP follows the refresh step's STATS
on the deciding rank. Each layer's distribution (planner/strategy.py, the definition of KAISA's grid and
DP-KFAC's owner) says which copies take its statistics, sync them, decompose (one of its grad workers),
receive the decomposition, apply it at every step, and broadcast the preconditioned gradient along a row.
Under `StepBarrier.AGREEMENT_SET` a step begins on a rank once its agreement set (the ranks linked by copies of a
stage) can have ended the step before, and the programs are simulated with OPT_STEP over agreement sets only.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from fxkfac.planner.errors import DeadlockError, PlanError
from fxkfac.planner.ir import PRECONDITIONER_KINDS, Op, OpKind
from fxkfac.planner.memory import activation_intervals, peak_level, static_bytes
from fxkfac.planner.problem import Problem, StepBarrier, agreement_set, copies_of_stage, stage_groups
from fxkfac.planner.simulate import simulate
from fxkfac.planner.step_timeline import StepTimeline, early_start, step_begins, step_timeline, window_length
from fxkfac.planner.strategy import COMM_OPT, keeps_statistics, receivers

if TYPE_CHECKING:
    from fxkfac.planner.plan import Plan
    from fxkfac.planner.solution import Placement

__all__ = ["validate", "check_plan"]

_KFAC = PRECONDITIONER_KINDS


@dataclass
class _Ctx:
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


def _key(op: Op) -> Op:
    """An op without the root of its broadcast (which `_check_chains` checks against the inversion)."""
    return replace(op, root=op.group[0] if op.group else 0) if op.kind is OpKind.BCAST else op


def _per_step(op: Op) -> bool:
    """Whether `op` runs at every step of the period (APPLY, BCAST_PREC, a gradient STATS) rather than once per
    refresh."""
    return op.kind in (OpKind.APPLY, OpKind.BCAST_PREC) or (op.kind is OpKind.STATS and op.mb is None)


def _step_ops(c: _Ctx, stage: int, device: int) -> list[Op]:
    """What `device` runs of `stage` at every step: the gradient STATS of the layers it applies, then APPLY of
    the stage (every layer COMM-OPT) or of each layer it applies and the BCAST_PREC of each layer of its row."""
    p, layers = c.problem, c.problem.costs.stages[stage].layers
    copies = copies_of_stage(p, stage)
    ops = [Op(OpKind.STATS, stage, layer=layer, part=part) for layer, part in _gradient_parts(c, stage)
           if device in p.workers(layer)]
    if all(p.where(x.name).strategy == COMM_OPT for x in layers):
        return ops + [Op(OpKind.APPLY, stage)]
    ops += [Op(OpKind.APPLY, stage, layer=x.name) for x in layers if device in p.workers(x.name)]
    return ops + [Op(OpKind.BCAST_PREC, stage, root=root, layer=x.name, group=None if row == copies else row)
                  for x in layers for root, row in receivers(copies, p.where(x.name)) if device in row]


def _gradient_parts(c: _Ctx, stage: int) -> list[tuple[str, str]]:
    """(layer, part) of the stage's parts fed by the reduced gradient."""
    return [(x.name, p.part) for x in c.problem.costs.stages[stage].layers for p in x.parts
            if p.after is OpKind.ALLREDUCE_GRAD]


def _expected(c: _Ctx) -> Counter:
    """(op, device) of every K-FAC op the plan must place, with multiplicity (DECOMP: on one copy)."""
    want: Counter = Counter()
    p = c.problem
    for s, stage in enumerate(p.costs.stages):
        copies = copies_of_stage(p, s)
        for d in copies:
            for op, _, _ in c.refresh.fixed(d):
                if op.stage != s:
                    continue
                for x in stage.layers:
                    for side in (part.part for part in x.parts if part.after is op.kind):
                        if x.name not in c.fused and keeps_statistics(d, copies, p.where(x.name)):
                            want[Op(OpKind.STATS, s, op.mb, op.pipe, layer=x.name, part=side), d] += 1
            for j in range(c.period(s)):
                for op in _step_ops(c, s, d):
                    want[op, d, j] += 1
        for x in stage.layers:
            workers = p.workers(x.name)
            for side, after in ((part.part, part.after) for part in x.parts):
                for piece in _pieces(p.decomp_pieces):
                    want[Op(OpKind.DECOMP, s, layer=x.name, part=side, piece=piece), None] += 1
                synced = after is not OpKind.ALLREDUCE_GRAD and not p.where(x.name).strategy.local_factors
                for d in copies if synced and len(copies) > 1 else ():
                    want[Op(OpKind.SYNC_STATS, s, layer=x.name, part=side), d] += 1
                group = None if workers == copies else workers
                for d in workers if len(workers) > 1 else ():
                    want[_key(Op(OpKind.BCAST, s, layer=x.name, part=side, root=workers[0], group=group)), d] += 1
    return want


def _check_layers(c: _Ctx) -> None:
    p = c.problem
    names = set(p.costs.layer_names)
    if set(c.plan.layers) != names:
        c.errors.append(f"layers timed {sorted(c.plan.layers)} differ from the cost table's {sorted(names)}")
        return
    for group in stage_groups(p):
        periods = {c.plan.layers[x.name].period for s in group.stages for x in p.costs.stages[s].layers}
        if len(periods) != 1:
            c.errors.append(f"stages {group.stages} share devices but have refresh periods {sorted(periods)}")
    for name, t in c.plan.layers.items():
        if not 1 <= t.period <= p.max_period or t.curv_step != 0 or t.capture not in ("fused", "deferred"):
            c.errors.append(f"layer {name}: bad timing {t}")
    if c.fused and len({t.period for t in c.plan.layers.values()}) != 1:
        c.errors.append("with fused curvature every layer must share one refresh period")


def _duration(c: _Ctx, op: Op) -> float:
    stage = c.problem.costs.stages[op.stage]  # type: ignore[index]  # K-FAC ops name their stage
    if op.kind is OpKind.APPLY:
        return stage.prec if op.layer is None else c.problem.costs.layer(op.layer).prec
    if op.kind in (OpKind.SYNC_STATS, OpKind.BCAST, OpKind.BCAST_PREC):
        return _collective(c, op)
    part = c.problem.costs.layer(op.layer).part(op.part)  # type: ignore[arg-type]  # STATS and DECOMP name both
    return part.stats if op.kind is OpKind.STATS else part.decomp / (1 if op.piece is None else op.piece[1])


def _pieces(n: int) -> list[tuple[int, int] | None]:
    """The `piece` of each DECOMP of one part's decomposition made in n pieces (None: whole)."""
    return [None] if n == 1 else [(i, n) for i in range(n)]


def _collective(c: _Ctx, op: Op) -> float:
    """Seconds of a collective (ALLREDUCE_GRAD, SYNC_STATS, BCAST, BCAST_PREC) over the ranks it names, else every
    copy of its stage, by the cost table's comm model."""
    group = op.group if op.group is not None else copies_of_stage(c.problem, op.stage)  # type: ignore[arg-type]  # a collective of the schedules and plans names its stage
    return c.problem.costs.collective_seconds(op, len(group))


def _check_placed_once(c: _Ctx) -> None:
    got: Counter = Counter()
    for p in c.plan.placements:
        if _per_step(p.op):
            got[_key(p.op), p.device, p.step] += 1
        else:
            got[_key(p.op), None if p.op.kind is OpKind.DECOMP else p.device] += 1
        if abs(p.end - p.start - _duration(c, p.op)) > c.tol + 1e-9 * max(1.0, p.end):
            c.errors.append(f"{p.op} on r{p.device}: lasts {p.end - p.start:.6g} s, costs {_duration(c, p.op):.6g} s")
        k = c.period(p.op.stage)  # type: ignore[arg-type]  # a placed op is K-FAC work on a stage
        if not 0 <= p.step < 2 * k or not c.step_start(p.device, p.step, k) - c.tol <= p.start \
                or p.end > c.step_start(p.device, p.step + 1, k) + c.tol:
            c.errors.append(f"{p.op} on r{p.device} at [{p.start:.6g}, {p.end:.6g}) s is not within window step "
                            f"{p.step} (k={k})")
        if p.op.kind is OpKind.DECOMP and p.device not in c.problem.workers(p.op.layer):  # type: ignore[arg-type]  # a DECOMP names its layer
            c.errors.append(f"{p.op} runs on r{p.device}, which is not a grad worker of {p.op.layer} "
                            f"{list(c.problem.workers(p.op.layer))}")  # type: ignore[arg-type]  # see above
    want = _expected(c)
    for item in sorted(set(want) | set(got), key=str):
        if want[item] != got[item]:
            c.errors.append(f"{item[0]} on {item[1:]} placed {got[item]} times, expected {want[item]}")


def _fixed_intervals(c: _Ctx, device: int, k: int) -> list[tuple[float, float, str]]:
    """The device's F/B and gradient all-reduces over a window of k steps: nothing else may run then (an op of no
    duration, such as a backward a noisy profile timed at 0 s, occupies nothing)."""
    out = []
    for j in range(k):
        for op, a, b in c.timeline(j, k).ops[device]:
            if b > a and op.kind in (OpKind.FWD, OpKind.BWD, OpKind.ALLREDUCE_GRAD):
                out.append((c.base(j, k) + a, c.base(j, k) + b, f"{op} (step {j})"))
    return out


def _mod(start: float, end: float, length: float) -> list[tuple[float, float]]:
    s = start % length
    if length - s < 1e-12:
        s = 0.0
    e = s + (end - start)
    return [(s, e)] if e <= length + 1e-12 else [(s, length), (0.0, e - length)]


def _check_overlap(c: _Ctx) -> None:
    by_device = defaultdict(list)
    for p in c.plan.placements:
        by_device[p.device].append(p)
    for d in c.problem.devices:
        ks = {c.period(s) for s in range(c.problem.num_stages) if d in copies_of_stage(c.problem, s)}
        k = max(ks)
        L = c.length(k)
        items = [(s, e, name) for a, b, name in _fixed_intervals(c, d, k) for s, e in _mod(a, b, L)]
        items += [(s, e, f"{p.op}") for p in by_device[d] for s, e in _mod(p.start, p.end, L)]
        items.sort()
        for i, (s1, e1, n1) in enumerate(items):
            for s2, e2, n2 in items[i + 1:]:
                if s2 >= max(e1, s1 + c.tol) - c.tol:
                    break
                if min(e1, e2) - s2 > c.tol or (s1 + c.tol < s2 < e1 - c.tol):
                    c.errors.append(f"r{d}: {n1} [{s1:.6g}, {e1:.6g}) overlaps {n2} [{s2:.6g}, {e2:.6g}) (mod {L:.6g})")


def _end_of(timeline: StepTimeline, device: int, kind: OpKind, stage: int, mb: int, pipe: int) -> float:
    return next(b for op, _, b in timeline.ops[device]
                if op.kind is kind and (op.stage, op.mb, op.pipe) == (stage, mb, pipe))


def _after(c: _Ctx, op: Op) -> OpKind:
    """The op (FWD or BWD) whose end makes the capture a STATS op consumes."""
    return c.problem.costs.layer(op.layer).part(op.part).after  # type: ignore[arg-type]  # a STATS names both


def _check_dependencies(c: _Ctx) -> None:
    factor_tasks: defaultdict[tuple[str, str | None], defaultdict[OpKind, list[Placement]]] = \
        defaultdict(lambda: defaultdict(list))
    applies = {(p.op.stage, p.device, p.step): p.start for p in c.plan.placements if p.op.kind is OpKind.APPLY}
    for p in c.plan.placements:
        if p.op.kind is OpKind.STATS and p.op.mb is None:
            _check_gradient_stats(c, p, applies)
        elif p.op.kind is OpKind.STATS:
            kind = _after(c, p.op)
            ready = _end_of(c.refresh, p.device, kind, p.op.stage, p.op.mb, p.op.pipe)  # type: ignore[arg-type]  # a STATS names its stage and micro-batch
            if p.start < ready - c.tol:
                c.errors.append(f"{p.op} on r{p.device} starts at {p.start:.6g} before its {kind} ends ({ready:.6g})")
            if p.end > ready + c.length(c.period(p.op.stage)) + c.tol:  # type: ignore[arg-type]  # a STATS names its stage
                c.errors.append(f"{p.op} on r{p.device} keeps its a/e longer than one window")
        if p.op.kind is OpKind.BCAST_PREC:
            _check_shared_gradient(c, p)
        elif p.op.kind is not OpKind.APPLY:
            # STATS, SYNC_STATS (no factor), DECOMP and BCAST name their layer
            factor_tasks[p.op.layer, p.op.part][p.op.kind].append(p)  # type: ignore[index]  # see above
    for (layer, side), kinds in factor_tasks.items():
        _check_factor(c, layer, side, kinds)
    _check_warm_starts(c, factor_tasks)


def _check_shared_gradient(c: _Ctx, p: Placement) -> None:
    """A BCAST_PREC of window step j starts on every member of its row at once, after its root's APPLY of the
    layer in that step (which made the preconditioned gradient)."""
    same = [q for q in c.plan.placements if q.op == p.op and q.step == p.step]
    if max(q.start for q in same) - min(q.start for q in same) > c.tol:
        c.errors.append(f"{p.op} at step {p.step}: the row starts it at different times")
    made = [q for q in c.plan.placements if q.op.kind is OpKind.APPLY and q.device == p.op.root
            and q.step == p.step and q.op.layer == p.op.layer]
    if not made or p.start < made[0].end - c.tol:
        c.errors.append(f"{p.op} on r{p.device} at step {p.step} starts before r{p.op.root} applied {p.op.layer}")


def _check_gradient_stats(c: _Ctx, p: Placement, applies: Mapping[tuple[int | None, int, int], float]) -> None:
    """A gradient STATS of window step j starts after its stage's gradient all-reduce of that step on its device
    and ends by the start of the stage's APPLY there (`applies`: APPLY starts by stage, device and step), which
    overwrites the gradient."""
    s = p.op.stage
    assert s is not None, "a STATS names its stage (Op checks it)"
    k = c.period(s)
    if (p.device, s) not in c.refresh.allreduce_end or not 0 <= p.step < k:
        return  # _check_placed_once says where it should be
    ready = c.base(p.step, k) + c.timeline(p.step, k).allreduce_end[p.device, s]
    if p.start < ready - c.tol:
        c.errors.append(f"{p.op} on r{p.device} at step {p.step} starts at {p.start:.6g} before the stage's "
                        f"gradient is reduced ({ready:.6g})")
    apply = applies.get((s, p.device, p.step))
    if apply is not None and p.end > apply + c.tol:
        c.errors.append(f"{p.op} on r{p.device} at step {p.step} ends at {p.end:.6g}, after APPLY s{s} starts "
                        f"({apply:.6g})")


def _check_factor(c: _Ctx, layer: str, side: str | None, kinds: dict) -> None:
    stage = c.problem.costs.stage_of(layer)
    L = c.length(c.period(stage))
    copies = copies_of_stage(c.problem, stage)
    curv, sync, inv, bcast = (kinds.get(k, []) for k in (OpKind.STATS, OpKind.SYNC_STATS, OpKind.DECOMP, OpKind.BCAST))
    if (layer, side) in _gradient_parts(c, stage):
        _check_gradient_refresh(c, layer, side, L, curv, inv + bcast)
        return
    if layer in c.fused:
        kind = c.problem.costs.layer(layer).part(side).after  # type: ignore[arg-type]  # fused: per part
        ready = max(b for d in copies for op, _, b in c.refresh.fixed(d) if op.stage == stage and op.kind is kind)
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


def _check_warm_starts(c: _Ctx, factor_tasks: Mapping[tuple[str, str | None], dict]) -> None:
    """A layer decomposed in pieces makes and broadcasts each refresh before the next refresh's first piece of any
    part starts (Newton-Schulz starts from the layer's previous inverse)."""
    layers: dict[str, list[Placement]] = {}
    for (layer, _), kinds in factor_tasks.items():
        layers.setdefault(layer, []).extend(kinds.get(OpKind.DECOMP, []) + kinds.get(OpKind.BCAST, []))
    for layer, refresh in layers.items():
        firsts = [p for p in refresh if p.op.piece is not None and p.op.piece[0] == 0]
        if not firsts:
            continue
        L = c.length(c.period(c.problem.costs.stage_of(layer)))
        start = min(p.start for p in firsts)
        for p in refresh:
            if p.end > start + L + c.tol:
                c.errors.append(f"{p.op} ends after the next refresh of {layer} starts its first piece: that piece "
                                "would not start from this refresh's inverse")


def _check_pieces(c: _Ctx, layer: str, side: str | None, pieces: list[Placement]) -> None:
    """The pieces of one decomposition (sorted by index) run one after another on one rank."""
    for a, b in zip(pieces, pieces[1:]):
        if b.device != a.device:
            c.errors.append(f"{b.op} runs on r{b.device}, piece {a.op.piece} of {layer} {side} on r{a.device}: the "
                            "pieces of a decomposition run on one rank")
        if b.start < a.end - c.tol:
            c.errors.append(f"{b.op} starts at {b.start:.6g}, before {a.op} ends ({a.end:.6g})")


def _check_gradient_refresh(c: _Ctx, layer: str, side: str | None, L: float, stats: list[Placement],
                            refresh: list[Placement]) -> None:
    """A gradient-fed part's DECOMP starts after the refresh step's STATS of the part on its rank (which
    snapshots the statistic), its BCASTs after the DECOMP, together, from the DECOMP's rank, and before the next
    refresh's DECOMP (`L`: the window's length)."""
    decomps = [p for p in refresh if p.op.kind is OpKind.DECOMP]
    bcasts = [p for p in refresh if p.op.kind is OpKind.BCAST]
    if len(decomps) != 1:
        return  # _check_placed_once counts them
    decomp = decomps[0]
    snapshot = [p for p in stats if (p.device, p.step) == (decomp.device, 0)]
    if not snapshot:
        c.errors.append(f"{decomp.op} on r{decomp.device}: no STATS of the refresh step on r{decomp.device}")
    elif decomp.start < snapshot[0].end - c.tol:
        c.errors.append(f"{decomp.op} starts at {decomp.start:.6g}, before the refresh step's {snapshot[0].op} "
                        f"on r{decomp.device} ends ({snapshot[0].end:.6g})")
    if bcasts and max(p.start for p in bcasts) - min(p.start for p in bcasts) > c.tol:
        c.errors.append(f"{bcasts[0].op}: the copies start it at different times")
    if any(p.start < decomp.end - c.tol for p in bcasts):
        c.errors.append(f"{bcasts[0].op} starts before the work it depends on ends ({decomp.end:.6g})")
    if any(p.op.root != decomp.device for p in bcasts):
        c.errors.append(f"broadcast of {layer} {side} does not come from r{decomp.device}, where it was decomposed")
    if any(p.end > decomp.start + L + c.tol for p in bcasts):
        c.errors.append(f"BCAST {layer} {side} ends after the next refresh's DECOMP starts")


def _check_precs_and_offsets(c: _Ctx) -> None:
    prec: dict[tuple[int | None, str | None, int, int], Placement] = {
        (p.op.stage, p.op.layer, p.device, p.step): p for p in c.plan.placements if p.op.kind is OpKind.APPLY}
    for p in prec.values():
        s, d, j = p.op.stage, p.device, p.step
        assert s is not None, "an APPLY names its stage (Op checks it)"
        k = c.period(s)
        lo, hi = c.base(j, k) + c.timeline(j, k).allreduce_end[d, s], c.step_start(d, j + 1, k)
        if p.start < lo - c.tol or p.end > hi + c.tol:
            c.errors.append(f"APPLY s{s} step {j} on r{d} [{p.start:.6g}, {p.end:.6g}) is outside [{lo:.6g}, {hi:.6g})")
    ready: dict[str, float] = defaultdict(float)
    for p in c.plan.placements:
        if p.op.kind in (OpKind.DECOMP, OpKind.BCAST):
            ready[p.op.layer] = max(ready[p.op.layer], p.end)  # type: ignore[index]  # DECOMP and BCAST name their layer
    for layer, t in ready.items():
        s, k = c.problem.costs.stage_of(layer), c.period(c.problem.costs.stage_of(layer))
        L = c.length(k)
        apply = Op(OpKind.APPLY, s) if Op(OpKind.APPLY, s) in _step_ops(c, s, c.problem.workers(layer)[0]) else \
            Op(OpKind.APPLY, s, layer=layer)  # the stage's APPLY, or the layer's own where the stage has them
        u = next((u for u in range(2 * k + 1) if all(
            (prec[s, apply.layer, d, u % k].start if (s, apply.layer, d, u % k) in prec else 0.0) + L * (u // k)
            >= t - c.tol for d in c.problem.workers(layer))), 2 * k + 1)
        claimed = c.plan.layers[layer].use_offset
        if claimed != u:
            c.errors.append(f"layer {layer}: use_offset {claimed} claimed, but its inverse is first usable at step {u}")


def _check_memory(c: _Ctx) -> None:
    budget = c.problem.memory_budget
    keeps = defaultdict(list)
    for p in c.plan.placements:
        if p.op.kind is OpKind.STATS and p.op.mb is not None:
            part = c.problem.costs.layer(p.op.layer).part(p.op.part)  # type: ignore[arg-type]  # a STATS names both
            since = _end_of(c.refresh, p.device, part.after, p.op.stage, p.op.mb, p.op.pipe)  # type: ignore[arg-type]  # a STATS names its stage and micro-batch
            keeps[p.device].append((since, p.end, part.capture_bytes))
    for d in c.problem.devices:
        k = max(c.period(s) for s in range(c.problem.num_stages) if d in copies_of_stage(c.problem, s))
        L = c.length(k)
        spans = [(c.base(j, k) + a, c.base(j, k) + b, n) for j in range(k)
                 for a, b, n in activation_intervals(c.problem, d, c.timeline(j, k))] + keeps[d]
        held = [(s + c.tol, e - c.tol, n) for a, b, n in spans for s, e in _mod(a, b, L) if e - s > 2 * c.tol]
        total = static_bytes(c.problem, d) + peak_level(held)
        if budget is not None and total > budget:
            c.errors.append(f"r{d}: memory peaks at {total} bytes, over the budget of {budget}")
        claimed = c.plan.metrics.peak_memory.get(d)
        if c.tol == 0 and claimed != total:
            c.errors.append(f"r{d}: peak memory {claimed} claimed, {total} found")


def _check_step_time(c: _Ctx) -> None:
    periods = {t.period for t in c.plan.layers.values()}
    step = max(c.length(k) / k for k in periods)
    allowed = c.normal.length * (1 + c.problem.max_overhead)
    if step > allowed + c.tol:
        c.errors.append(f"step time {step:.6g} s exceeds {allowed:.6g} s (reference {c.normal.length:.6g} s, "
                        f"max_overhead {c.problem.max_overhead:g}, stretch {c.stretch:.6g} s per step)")
    if abs(c.plan.metrics.step_time - step) > c.tol + 1e-9 * step:
        c.errors.append(f"step time {c.plan.metrics.step_time:.6g} s claimed, {step:.6g} s found")


def _check_programs(c: _Ctx, run: bool) -> None:
    plan = c.plan
    for d in c.problem.devices:
        prog = plan.programs.get(d)
        k = max(c.period(s) for s in range(c.problem.num_stages) if d in copies_of_stage(c.problem, s))
        if prog is None or len(prog) != k:
            c.errors.append(f"r{d}: the program must have {k} steps")
            continue
        for j, ops in enumerate(prog):
            want = [op for op, _, _ in c.timeline(j, k).ops[d] if op.kind not in _KFAC]
            if [op for op in ops if op.kind not in _KFAC] != want:
                c.errors.append(f"r{d} step {j}: the pipeline ops differ from the schedule's")
        times = {(p.step % k, str(p.op)): (p.start - c.length(k) * (p.step // k), p.end - c.length(k) * (p.step // k))
                 for p in plan.placements if p.device == d}
        listed = [(j, str(op)) for j, ops in enumerate(prog) for op in ops if op.kind in _KFAC]
        if sorted(listed) != sorted(times):
            c.errors.append(f"r{d}: the program's K-FAC ops differ from the placements")
        elif any(a[0] == b[0] and times[a] > times[b] for a, b in zip(listed, listed[1:])):
            c.errors.append(f"r{d}: the program's K-FAC ops are not in time order")
        else:
            _check_interleaving(c, d, k, prog)
    if run:
        _check_runs(c)


def _check_interleaving(c: _Ctx, device: int, k: int, prog: list[list[Op]]) -> None:
    """Within each step, a K-FAC op comes after every pipeline op that ended before it was placed and
    before every pipeline op that ends after its start (a RECV still waiting included); APPLY follows
    its stage's backwards and gradient all-reduce; OPT_STEP ends the step. The runtime executes the
    program in order, so a program that disagrees with its placements runs other semantics."""
    starts = {(p.step % k, str(p.op)): p.start - c.base(p.step, k) for p in c.plan.placements if p.device == device}
    for j, ops in enumerate(prog):
        fixed = iter(c.timeline(j, k).ops[device])
        times: list[tuple[Op, float, float] | None] = []
        for op in ops:
            times.append(None if op.kind in _KFAC else next((x for x in fixed if x[0].kind not in _KFAC), None))
        for i, op in enumerate(ops):
            if op.kind is OpKind.OPT_STEP and i != len(ops) - 1:
                c.errors.append(f"r{device} step {j}: OPT_STEP is not the last op")
            if op.kind not in _KFAC:
                continue
            t = starts[(j, str(op))]
            for n, item in enumerate(times):
                if item is None or item[0].kind is OpKind.OPT_STEP:
                    continue  # OPT_STEP ends the step (the barrier): work placed in the stretch runs before it
                other, a, b = item
                before = b <= t + c.tol and a < t - c.tol
                if (n > i and before) or (n < i and b > t + c.tol):
                    c.errors.append(f"r{device} step {j}: '{op}' (placed at {t:.6g} s) and "
                                    f"'{other}' ({a:.6g}-{b:.6g} s)"
                                    " are in the wrong order in the program")
            if _per_step(op):
                _check_gradient_order(c, device, j, ops, i)


def _check_gradient_order(c: _Ctx, device: int, j: int, ops: list[Op], i: int) -> None:
    """An APPLY or gradient STATS (ops[i]) comes after every BWD and ALLREDUCE_GRAD of its stage in the step (the
    gradient is complete); a gradient STATS also before its stage's APPLY (which overwrites the gradient)."""
    op = ops[i]
    after = [o for o in ops[i + 1:] if o.stage == op.stage and o.kind in (OpKind.BWD, OpKind.ALLREDUCE_GRAD)]
    if after:
        c.errors.append(f"r{device} step {j}: '{op}' comes before '{after[0]}' of its stage")
    if op.kind is OpKind.STATS and not any(o.kind is OpKind.APPLY and o.stage == op.stage for o in ops[i + 1:]):
        c.errors.append(f"r{device} step {j}: '{op}' does not come before the APPLY of its stage")


def _check_runs(c: _Ctx) -> None:
    """Simulate the programs (ops in program order, as soon as possible): no deadlock, and the run is
    no slower than planned (the durations of a non-refresh step are used: exact when nothing is fused)."""
    stages = c.problem.costs.stages

    def duration(rank: int, op: Op) -> float:
        if op.kind is OpKind.FWD:
            return stages[op.stage].fwd  # type: ignore[index]  # a FWD names its stage
        if op.kind is OpKind.BWD:
            return stages[op.stage].bwd  # type: ignore[index]  # a BWD names its stage
        if op.kind is OpKind.ALLREDUCE_GRAD:
            return _collective(c, op)
        return _duration(c, op) if op.kind in _KFAC else 0.0

    periods = [len(p) for p in c.plan.programs.values()]
    steps = max(periods) * 2
    try:
        barrier = None if c.problem.barrier is StepBarrier.WORLD else \
            {d: agreement_set(c.problem, d) for d in c.problem.devices}
        timeline = simulate(c.plan.programs, duration, steps=steps, barrier=barrier)
    except DeadlockError as e:
        c.errors.append(f"the programs deadlock: {e}")
        return
    if not c.fused:
        limit = c.plan.metrics.step_time * steps + max(c.length(k) for k in set(periods))
        if timeline.makespan > limit + c.tol * steps:
            c.errors.append(f"the simulated programs take {timeline.makespan:.6g} s for {steps} steps, "
                            f"over {limit:.6g}")


def validate(problem: Problem, plan: Plan, *, run: bool = True) -> list[str]:
    """Every way `plan` breaks `problem`'s constraints, as readable lines (empty: valid). `run` also
    simulates the programs (deadlock, speed)."""
    fused = frozenset(n for n, t in plan.layers.items() if t.capture == "fused")
    tol = plan.metrics.time_quantum + 1e-9 * step_timeline(problem).length
    stretch = plan.metrics.stretch
    c = _Ctx(problem, plan, tol, fused, step_timeline(problem, fused), step_timeline(problem), [],
             stretch if isinstance(stretch, (int, float)) and 0 <= stretch < math.inf else 0.0)
    if plan.problem != problem:
        c.errors.append("the plan was made for another problem")
    if c.stretch != stretch:
        c.errors.append(f"the step stretch must be a finite number of seconds >= 0, got {stretch!r}")
    _check_layers(c)
    if c.errors:
        return c.errors
    for check in (_check_placed_once, _check_overlap, _check_dependencies, _check_precs_and_offsets,
                  _check_memory, _check_step_time):
        check(c)
    _check_programs(c, run)
    return c.errors


def check_plan(problem: Problem, plan: Plan, *, run: bool = True) -> None:
    """Raise PlanError listing every violation of `validate`."""
    errors = validate(problem, plan, run=run)
    if errors:
        shown = "\n  ".join(errors[:20]) + (f"\n  ... and {len(errors) - 20} more" if len(errors) > 20 else "")
        raise PlanError(f"the plan is not valid for its problem ({len(errors)} violations):\n  {shown}")
