"""Checks a plan against its problem from the problem alone (simulated step timelines, the comm model), sharing no
code with the search, so tests can trust it. Times may be off by `metrics.time_quantum` ([Note: time grid] in
planner/plan/window.py); every step ends with `metrics.stretch` idle seconds ([Note: stretch])."""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace

from fxkfac.planner.plan.plan import Plan
from fxkfac.planner.plan.window import placed_w, w_window
from fxkfac.planner.problem.errors import DeadlockError, PlanError
from fxkfac.planner.problem.ir import (
    COLLECTIVE_KINDS,
    LAYER_TRANSFER_KINDS,
    PRECONDITIONER_KINDS,
    Capture,
    Op,
    OpKind,
    Placement,
    cut_apply,
    ops_at,
)
from fxkfac.planner.problem.lowering import Streaming
from fxkfac.planner.problem.problem import (
    Problem,
    StepBarrier,
    agreement_set,
    is_streamed,
    returned,
    stage_groups,
    streamed_stats,
)
from fxkfac.planner.problem.schedules import ZERO_BUBBLE_KINDS, capture_kind, weight_gradient_kind
from fxkfac.planner.problem.step_timeline import (
    Timeline,
    activation_intervals,
    apply_seconds,
    decomposition_bytes,
    early_start,
    fused_stats,
    peak_level,
    prec_work,
    problem_buckets,
    simulate,
    static_bytes,
    step_begins,
    step_timeline,
    stream_start,
    stream_timing,
    tap_extra,
    w_makes,
    w_operand_bytes,
    w_share,
    window_length,
)
from fxkfac.planner.problem.strategy import keeps_statistics


@dataclass
class Context:
    """One validation: the problem, the plan, its tolerance and simulated step timelines, the placements indexed in one
    walk (each rule reads the indexes) and the violations found."""

    problem: Problem
    plan: Plan
    errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        problem, plan, stretch = self.problem, self.plan, self.plan.metrics.stretch
        self.fused = frozenset(n for n, t in plan.layers.items() if t.capture is Capture.FUSED)
        self.normal, self.refresh = step_timeline(problem), step_timeline(problem, self.fused, refresh=True)
        self.tol = plan.metrics.time_quantum + 1e-9 * self.normal.length
        self.stretch = stretch if isinstance(stretch, (int, float)) and 0 <= stretch < math.inf else 0.0
        self.placed_w = placed_w(problem)  # [Note: placed W] in planner/plan/window.py
        self.placed_kinds = PRECONDITIONER_KINDS | ({OpKind.BWD_W} if self.placed_w else set())  # where placements say
        # per device, what placed work holds in memory (start, end, bytes): check_placements adds, check_devices sums
        self.held: defaultdict[int, list[tuple[float, float, int]]] = defaultdict(list)
        self.at: dict[tuple[Op, int, int], Placement] = {}  # by (op, device, window step)
        self.kinds: defaultdict[OpKind, list[Placement]] = defaultdict(list)
        self.on: defaultdict[int, list[Placement]] = defaultdict(list)
        self.made: defaultdict[str, list[Placement]] = defaultdict(list)  # per layer, its refresh's DECOMP and BCAST
        self.refresh_ws: defaultdict[tuple, list[Placement]] = defaultdict(list)  # by (device, stage, mb, pipe)
        self.updates: dict[tuple, float] = {}  # where a stage's update (per-step ops) begins by (stage, device, step)
        for p in plan.placements:  # in the plan's order
            self.at[p.op, p.device, p.step] = p
            self.kinds[p.op.kind].append(p)
            self.on[p.device].append(p)
            if p.op.kind in (OpKind.DECOMP, OpKind.BCAST):
                self.made[p.op.layer_name].append(p)
            if p.op.kind is OpKind.BWD_W and p.step == 0:
                self.refresh_ws[p.device, p.op.stage, p.op.mb, p.op.pipe].append(p)
            if per_step(p.op):
                key = (p.op.stage, p.device, p.step)
                self.updates[key] = min(p.start, self.updates.get(key, math.inf))
        if plan.problem != problem:
            self.errors.append("the plan was made for another problem")
        if self.stretch != stretch:
            self.errors.append(f"the step stretch must be a finite number of seconds >= 0, got {stretch!r}")

    def period(self, stage: int) -> int:
        """The stage's refresh period: its layers' (`check_layers` makes them agree), else its group's window."""
        layers = self.problem.costs.stages[stage].layers
        return self.plan.layers[layers[0].name].period if layers else self.plan.metrics.refresh_steps[stage]

    def device_period(self, device: int) -> int:
        """The longest refresh period of the device's stages: its window."""
        return max(self.period(s) for s in range(self.problem.num_stages) if device in self.problem.holders[s])

    def length(self, k: int) -> float:
        return window_length(self.refresh.length, self.normal.length, self.stretch, k)

    def base(self, j: int, k: int) -> float:
        """Absolute start of window step j (0..2k)."""
        return step_begins(self.refresh.length, self.normal.length, self.stretch, j, k)

    def step_start(self, device: int, j: int, k: int) -> float:
        """When window step j begins on `device`: at its start under a world barrier, else once the device's
        agreement set can have ended step j-1's F/B, all-reduces and per-step slots (`early_start`)."""
        return self.base(j, k) - early_start(self.problem, self.timeline(j - 1, k), agreement_set(self.problem, device))

    def timeline(self, j: int, k: int) -> Timeline:
        return self.refresh if j % k == 0 else self.normal

    def end_of(self, j: int, k: int, device: int, kind: OpKind, op: Op) -> float:
        """When the `kind` op of `op`'s stage, micro-batch and pipe ends on `device` in window step j (absolute)."""
        key = (op.stage, op.mb, op.pipe)
        found = (b for x, _, b in self.timeline(j, k).ops[device] if x.kind is kind and (x.stage, x.mb, x.pipe) == key)
        return self.base(j, k) + next(found)

    def capture_end(self, device: int, stats: Op) -> tuple[OpKind, float]:
        """The kind of op that makes the refresh step's capture `stats` reads on `device`, and when it ends (placed
        W's: the latest of its layer, [Note: placed W] in planner/plan/window.py)."""
        kind = capture_kind(self.problem.kind, self.problem.costs.layer(stats.layer_name).part(stats.part_name).after)
        placed = kind is OpKind.BWD_W and self.placed_w
        ready = self.end_of(0, 1, device, OpKind.BWD if placed else kind, stats)
        ws = self.refresh_ws[device, stats.stage, stats.mb, stats.pipe] if placed else []
        return kind, max([ready] + [q.end for q in ws if w_makes(q.op, stats.layer_name)])

    def follows_w(self, op: Op) -> bool:
        """Whether `op` is a no-op all-reduce (a stage without copies) that follows its stage's placed W's."""
        placed = op.kind is OpKind.ALLREDUCE_GRAD and op.stage is not None and self.placed_w
        return placed and len(self.problem.holders[op.stage_id]) == 1

    def pipeline(self, op: Op) -> bool:
        """Whether `op` is at the schedule's place in a program: neither placed nor following placed W's."""
        return op.kind not in self.placed_kinds and not self.follows_w(op)

    def fold(self, op: Op) -> bool:
        """Whether `op` folds a fused layer's capture (part of the refresh step's F/B, not placed work)."""
        return op.kind is OpKind.STATS and op.mb is not None and op.layer in self.fused

    def is_placed(self, device: int, op: Op) -> bool:
        """Whether `op` in `device`'s program runs where a placement says (not a fold, not a streamed layer's)."""
        return op.kind in self.placed_kinds and not self.fold(op) and not is_streamed(self.problem, device, op)


def placed_key(op: Op) -> Op:
    """An op without the root of its broadcast (which `_check_factor` checks against the decomposition)."""
    return replace(op, root=op.group[0] if op.group else 0) if op.kind is OpKind.BCAST else op


def per_step(op: Op) -> bool:
    """Whether `op` runs at every step (APPLY, BCAST_PREC, a gradient STATS) rather than once per refresh."""
    return op.kind in (OpKind.APPLY, OpKind.BCAST_PREC) or (op.kind is OpKind.STATS and op.mb is None)


def op_seconds(c: Context, op: Op) -> float:
    """What `op` costs; a collective over the ranks it names, else every copy of its stage, by the comm model."""
    if op.kind in COLLECTIVE_KINDS:
        group = op.group if op.group is not None else c.problem.holders[op.stage_id]
        return c.problem.costs.collective_seconds(op, len(group))
    if op.kind is OpKind.APPLY and op.layer is None:
        return c.problem.costs.stages[op.stage_id].prec
    if op.kind is OpKind.APPLY:  # a streamed layer's APPLY also folds its gradient-fed statistics
        folds = c.problem.costs.layer(op.layer_name).curv if streamed_stats(c.problem, op.layer_name) else 0.0
        return apply_seconds(c.problem, op) + folds
    part = c.problem.costs.layer(op.layer_name).part(op.part_name)
    return part.stats if op.kind is OpKind.STATS else part.decomp / (1 if op.piece is None else op.piece[1])


def wrapped(start: float, end: float, length: float) -> list[tuple[float, float]]:
    s = start % length if length - start % length >= 1e-12 else 0.0
    e = s + (end - start)
    return [(s, e)] if e <= length + 1e-12 else [(s, length), (0.0, e - length)]


def apply_start(c: Context, layer: str, u: int, device: int) -> float:
    """When window step `u` (0..2k) on `device` starts the APPLY that preconditions `layer` (a streamed layer: when
    its owner starts the backward that streams it), from the window's start (0 where there is none)."""
    s = c.problem.costs.stage_of(layer)
    k = c.period(s)
    shift = c.length(k) * (u // k)
    if c.problem.streaming is not None and layer in c.problem.streaming.layers:
        return c.base(u % k, k) + stream_start(c.problem, c.timeline(u, k)) + shift
    whole = Op(OpKind.APPLY, s)
    worker = c.problem.workers(layer)[0]
    apply = whole if any(op == whole for op, _ in prec_work(c.problem, worker, s)) else Op(OpKind.APPLY, s, layer=layer)
    placed = c.at.get((apply, device, u % k))
    return (placed.start if placed else 0.0) + shift


def _check_w(c: Context, p: Placement) -> None:
    """A placed W runs after its B and by its stage's gradient all-reduce in its step (one copy: by its per-step
    slot), holding its operands from its B's end ([Note: placed W] in planner/plan/window.py)."""
    s, k = p.op.stage_id, c.period(p.op.stage_id)
    ready = c.end_of(p.step, k, p.device, OpKind.BWD, p.op)
    c.held[p.device].append((ready, p.end, w_operand_bytes(c.problem.costs.stages[s], p.op.layer)))
    reduce = (
        a for op, a, _ in c.timeline(p.step, k).ops[p.device] if op.kind is OpKind.ALLREDUCE_GRAD and op.stage == s
    )
    due = c.base(p.step, k) + next(reduce)
    if len(c.problem.holders[s]) == 1:  # a no-op all-reduce: due by the stage's update
        due = min(c.base(p.step + 1, k), c.updates.get((s, p.device, p.step), math.inf))
    if p.start < ready - c.tol or p.end > due + c.tol:
        c.errors.append(
            f"{p.op} on r{p.device} at step {p.step} is not between its B ({ready:.6g}) and its "
            f"stage's update ({due:.6g})"
        )


def _check_shared_gradient(c: Context, p: Placement) -> None:
    """A BCAST_PREC starts on every member of its row at once, after its root's APPLY of the layer in that step."""
    same = [q.start for q in c.kinds[OpKind.BCAST_PREC] if q.op == p.op and q.step == p.step]
    if max(same) - min(same) > c.tol:
        c.errors.append(f"{p.op} at step {p.step}: the row starts it at different times")
    made = [q for q in c.kinds[OpKind.APPLY] if (q.device, q.step, q.op.layer) == (p.op.root, p.step, p.op.layer)]
    if not made or p.start < made[0].end - c.tol:
        c.errors.append(f"{p.op} on r{p.device} at step {p.step} starts before r{p.op.root} applied {p.op.layer}")


def _check_factor(c: Context, layer: str, side: str | None, kinds: Mapping[OpKind, list[Placement]]) -> None:
    """A factor's refresh in order (statistics, SYNC_STATS, DECOMP pieces, BCAST; a gradient-fed part's after its
    refresh STATS or their return), collectives started together, broadcast from the decomposer, done in time."""
    stage = c.problem.costs.stage_of(layer)
    L = c.length(c.period(stage))
    curv, sync, inv, bcast = (kinds.get(k, []) for k in (OpKind.STATS, OpKind.SYNC_STATS, OpKind.DECOMP, OpKind.BCAST))
    after = None if side is None else c.problem.costs.layer(layer).part(side).after
    what = "the work it depends on ends"
    if after is OpKind.ALLREDUCE_GRAD:
        if len(inv) != 1:
            return  # check_placements counts them
        d = inv[0].device
        snapshot = [p for p in curv if (p.device, p.step) == (d, 0)]
        if streamed_stats(c.problem, layer):
            ready = c.refresh.end_of(d, returned(c.problem, layer))
            what = f"the refresh step's statistics of {layer} return from its helper to r{d}"
        elif snapshot:
            ready, what = snapshot[0].end, f"the refresh step's {snapshot[0].op} on r{d} ends"
        else:
            c.errors.append(f"{inv[0].op} on r{d}: no STATS of the refresh step on r{d}")
            ready = -math.inf
        curv = []  # its per-step STATS are no refresh's curvature
    elif layer in c.fused and after is not None:
        kind = capture_kind(c.problem.kind, after)  # made with the W
        fixed = (item for d in c.problem.holders[stage] for item in c.refresh.fixed(d))
        ready = max(b for op, _, b in fixed if op.stage == stage and op.kind is kind)
        if kind is OpKind.BWD_W and c.placed_w:  # the refresh step's W's, placed; a per-layer W folds its own layer's
            ws = c.kinds[OpKind.BWD_W]
            ready = max(q.end for q in ws if q.op.stage == stage and q.step == 0 and w_makes(q.op, layer))
    else:
        ready = max((p.end for p in curv), default=0.0)
    for group in (sync, bcast):
        if group and max(p.start for p in group) - min(p.start for p in group) > c.tol:
            c.errors.append(f"{group[0].op}: the copies start it at different times")
    for x in (x for x in (sync, inv, bcast) if x):
        first = min(x, key=lambda p: p.start)
        if first.start < ready - c.tol:
            c.errors.append(f"{first.op} starts at {first.start:.6g}, before {what} ({ready:.6g})")
        ready = max(p.end for p in x)
    if not inv:
        return
    inv = sorted(inv, key=lambda p: p.op.piece or (0, 1))
    for a, b in zip(inv, inv[1:]):  # the pieces of one decomposition run one after another on one rank
        if b.device != a.device:
            c.errors.append(
                f"{b.op} runs on r{b.device}, piece {a.op.piece} of {layer} {side} on r{a.device}: the pieces of a "
                "decomposition run on one rank"
            )
        if b.start < a.end - c.tol:
            c.errors.append(f"{b.op} starts at {b.start:.6g}, before {a.op} ends ({a.end:.6g})")
    if any(p.op.root != inv[-1].device for p in bcast):
        c.errors.append(f"broadcast of {layer} {side} does not come from r{inv[-1].device}, where it was decomposed")
    if any(inv[-1].end > p.start + L + c.tol for p in curv):
        c.errors.append(f"DECOMP {layer} {side} ends after the next refresh starts its curvature")
    if any(p.end > inv[0].start + L + c.tol for p in bcast):
        c.errors.append(f"BCAST {layer} {side} ends after the next refresh's DECOMP starts")


def check_precs_and_offsets(c: Context) -> None:
    """Each APPLY and gradient STATS between its stage's all-reduce and the next step (a STATS before the APPLY that
    overwrites the gradient, pieces in order); use offsets as made; a warm-started refresh done before the next."""
    applies = {(p.op.stage, p.device, p.step): p.start for p in c.kinds[OpKind.APPLY]}
    for p in c.kinds[OpKind.APPLY] + [p for p in c.kinds[OpKind.STATS] if p.op.mb is None]:
        s, d, j = p.op.stage_id, p.device, p.step
        if (d, s) not in c.refresh.allreduce_end:
            continue  # check_placements says where it should be
        if p.op.piece is not None and p.op.piece[0] > 0:  # a cut APPLY: piece i after piece i-1, on the same rank
            before = c.at.get((replace(p.op, piece=(p.op.piece[0] - 1, p.op.piece[1])), d, j))
            if before is None or before.end > p.start + c.tol:
                c.errors.append(f"'{p.op}' on r{d} step {j} does not follow its previous piece there")
        k = c.period(s)
        lo, hi = c.base(j, k) + c.timeline(j, k).allreduce_end[d, s], c.step_start(d, j + 1, k)
        if p.start < lo - c.tol or p.end > hi + c.tol:
            c.errors.append(f"{p.op} step {j} on r{d} [{p.start:.6g}, {p.end:.6g}) is outside [{lo:.6g}, {hi:.6g})")
        apply = applies.get((s, d, j), math.inf) if p.op.kind is OpKind.STATS else math.inf
        if p.end > apply + c.tol:
            c.errors.append(f"{p.op} on r{d} at step {j} ends at {p.end:.6g}, after APPLY s{s} starts ({apply:.6g})")
    for layer, made in c.made.items():
        t, k, workers = max(p.end for p in made), c.period(c.problem.costs.stage_of(layer)), c.problem.workers(layer)
        usable = (u for u in range(2 * k + 1) if all(apply_start(c, layer, u, d) >= t - c.tol for d in workers))
        u, claimed = next(usable, 2 * k + 1), c.plan.layers[layer].use_offset
        if claimed != u:
            c.errors.append(f"layer {layer}: use_offset {claimed} claimed, but its inverse is first usable at step {u}")
        # decompositions that start from the previous preconditioner (pieces, or `Problem.warm_start`): each refresh
        # made, and its broadcasts started, before the next one's first DECOMP starts
        decomps = [p for p in made if p.op.kind is OpKind.DECOMP]
        warm = [p.start for p in decomps if (p.op.piece[0] == 0 if p.op.piece else c.problem.warm_start)]
        for p in made if warm else ():
            if (p.end if p.op.kind is OpKind.DECOMP else p.start) > min(warm) + c.length(k) + c.tol:
                c.errors.append(
                    f"{p.op} is done after the next refresh of {layer} starts decomposing: that refresh "
                    "would not start from this one's preconditioner"
                )


def _expected(c: Context) -> Iterator[tuple]:
    """(op, device) of every op the plan must place, once per placement (DECOMP: on any one copy; per-step ops and
    W's: (op, device, step))."""
    p = c.problem
    for s, stage in enumerate(p.costs.stages):
        copies = p.holders[s]
        for d in copies:
            for op, _, _ in c.refresh.fixed(d):
                for x in stage.layers if op.stage == s else ():
                    for side in (part.part for part in x.parts if part.after is op.kind):
                        if x.name not in c.fused and keeps_statistics(d, copies, p.where(x.name)):
                            yield Op(OpKind.STATS, s, op.mb, op.pipe, layer=x.name, part=side), d
            for j in range(c.period(s)):  # per-step work and placed W's ([Note: placed W]), per layer where they are
                yield from ((op, d, j) for op, _ in prec_work(p, d, s))
                yield from ((op, d, j) for op, _, _ in w_window(p, c.timeline(j, c.period(s)), d) if op.stage == s)
        for x in stage.layers:
            workers = p.workers(x.name)
            for side, after in ((part.part, part.after) for part in x.parts):
                n = p.decomp_pieces
                for piece in [None] if n == 1 else [(i, n) for i in range(n)]:
                    yield Op(OpKind.DECOMP, s, layer=x.name, part=side, piece=piece), None
                synced = after is not OpKind.ALLREDUCE_GRAD and not p.where(x.name).strategy.local_factors
                for d in copies if synced and len(copies) > 1 else ():
                    yield Op(OpKind.SYNC_STATS, s, layer=x.name, part=side), d
                group = None if workers == copies else workers
                for d in workers if len(workers) > 1 else ():
                    yield placed_key(Op(OpKind.BCAST, s, layer=x.name, part=side, root=workers[0], group=group)), d


def check_layers(c: Context) -> None:
    """Every layer timed, one period per stage group (per plan when fused) within max_period, curvature at step 0."""
    p = c.problem
    names = set(p.costs.layer_names)
    if set(c.plan.layers) != names:
        c.errors.append(f"layers timed {sorted(c.plan.layers)} differ from the cost table's {sorted(names)}")
        return
    if len(c.plan.metrics.refresh_steps) != p.num_stages:
        c.errors.append(f"{len(c.plan.metrics.refresh_steps)} refresh periods in the metrics for {p.num_stages} stages")
        return
    for group in stage_groups(p):
        periods = {c.period(s) for s in group.stages}
        periods |= {c.plan.layers[x.name].period for s in group.stages for x in p.costs.stages[s].layers}
        if len(periods) != 1:
            c.errors.append(f"stages {group.stages} share devices but have refresh periods {sorted(periods)}")
    for s, stage in enumerate(p.costs.stages):
        if not stage.layers and not 1 <= c.period(s) <= p.max_period:
            c.errors.append(f"stage {s} (no preconditioned layer): bad refresh period {c.period(s)}")
    for name, t in c.plan.layers.items():
        if not 1 <= t.period <= p.max_period or t.curv_step != 0:
            c.errors.append(f"layer {name}: bad timing {t}")
    if c.fused and len({t.period for t in c.plan.layers.values()}) != 1:
        c.errors.append("with fused curvature every layer must share one refresh period")


def check_placements(c: Context) -> None:
    """One walk over the placements: every op the problem asks for placed as often as `_expected` says, for its cost,
    on a worker, in its step, after what it reads; then each factor's refresh in order (`_check_factor`)."""
    got: Counter = Counter()
    factor_tasks: defaultdict[tuple[str, str | None], defaultdict[OpKind, list[Placement]]]
    factor_tasks = defaultdict(lambda: defaultdict(list))
    for p in c.plan.placements:
        k = c.period(p.op.stage_id)
        if per_step(p.op) or p.op.kind is OpKind.BWD_W:
            got[placed_key(p.op), p.device, p.step] += 1
        else:
            got[placed_key(p.op), None if p.op.kind is OpKind.DECOMP else p.device] += 1
        if p.op.kind is OpKind.BWD_W:  # its interval in its step's timeline, a per-layer W's its part of it
            fused = c.fused if p.step % k == 0 else frozenset()
            ws = w_window(c.problem, c.timeline(p.step, k), p.device, fused)
            cost = next((b - a for op, a, b in ws if op == p.op), 0.0)
        else:
            cost = op_seconds(c, p.op)
        if abs(p.end - p.start - cost) > c.tol + 1e-9 * max(1.0, p.end):
            c.errors.append(f"{p.op} on r{p.device}: lasts {p.end - p.start:.6g} s, costs {cost:.6g} s")
        inside = 0 <= p.step < 2 * k and c.step_start(p.device, p.step, k) - c.tol <= p.start
        if not inside or p.end > c.step_start(p.device, p.step + 1, k) + c.tol:
            c.errors.append(
                f"{p.op} on r{p.device} at [{p.start:.6g}, {p.end:.6g}) s is not within window step {p.step} (k={k})"
            )
        workers = c.problem.workers(p.op.layer_name) if p.op.kind is OpKind.DECOMP else (p.device,)
        if p.device not in workers:
            c.errors.append(f"{p.op} runs on r{p.device}, not a grad worker of {p.op.layer} {list(workers)}")
        if p.op.kind is OpKind.STATS and p.op.mb is not None:
            kind, ready = c.capture_end(p.device, p.op)  # the F/B (or W) whose end makes its capture: held since
            part = c.problem.costs.layer(p.op.layer_name).part(p.op.part_name)
            c.held[p.device].append((ready, p.end, part.capture_bytes))
            if p.start < ready - c.tol and kind is OpKind.BWD_W:
                c.errors.append(
                    f"{p.op} on r{p.device} starts at {p.start:.6g} before the W that makes its output gradient ends "
                    f"({ready:.6g}): place it after that W (read before it, B must make the gradient, running the "
                    "stage's backward chain, which the plan does not price)"
                )
            elif p.start < ready - c.tol:
                c.errors.append(f"{p.op} on r{p.device} starts at {p.start:.6g} before its {kind} ends ({ready:.6g})")
            if p.end > ready + c.length(c.period(p.op.stage_id)) + c.tol:
                c.errors.append(f"{p.op} on r{p.device} keeps its a/e longer than one window")
        if p.op.kind is OpKind.BWD_W:
            _check_w(c, p)
        elif p.op.kind is OpKind.BCAST_PREC:
            _check_shared_gradient(c, p)
        elif p.op.kind is not OpKind.APPLY:  # STATS, SYNC_STATS, DECOMP and BCAST name their layer
            factor_tasks[p.op.layer_name, p.op.part][p.op.kind].append(p)
    want = Counter(_expected(c))
    for item in sorted(set(want) | set(got), key=str):
        if want[item] != got[item]:
            c.errors.append(f"{item[0]} on {item[1:]} placed {got[item]} times, expected {want[item]}")
    for (layer, side), kinds in factor_tasks.items():
        _check_factor(c, layer, side, kinds)


def check_devices(c: Context) -> None:
    """Per device, modulo its window: no placed op overlaps another or the F/B (W) and all-reduces (a zero-length op
    occupies nothing); activations, captures, W operands and third decompositions within the budget and claimed peak."""
    placed, budget = c.placed_w, c.problem.memory_budget
    fixed_kinds = (OpKind.FWD, OpKind.BWD, OpKind.ALLREDUCE_GRAD, *(() if placed else (OpKind.BWD_W,)))
    for d in c.problem.devices:
        k = c.device_period(d)
        L = c.length(k)
        items = [
            (s, e, f"{op} (step {j})")
            for j in range(k)
            for op, a, b in c.timeline(j, k).ops[d]
            if b > a and op.kind in fixed_kinds
            for s, e in wrapped(c.base(j, k) + a, c.base(j, k) + b, L)
        ]
        items += [(s, e, f"{p.op}") for p in c.on[d] for s, e in wrapped(p.start, p.end, L)]
        items.sort()
        for i, (s1, e1, n1) in enumerate(items):
            for s2, e2, n2 in items[i + 1 :]:
                if s2 >= max(e1, s1 + c.tol) - c.tol:
                    break
                if min(e1, e2) - s2 > c.tol or (s1 + c.tol < s2 < e1 - c.tol):
                    c.errors.append(f"r{d}: {n1} [{s1:.6g}, {e1:.6g}) overlaps {n2} [{s2:.6g}, {e2:.6g}) (mod {L:.6g})")
        spans = [
            (c.base(j, k) + a, c.base(j, k) + b, n)
            for j in range(k)
            for a, b, n in activation_intervals(c.problem, d, c.timeline(j, k), not placed)
        ] + c.held[d]
        for layer, made in c.made.items():  # a third decomposition: the next refresh's made before this one is used
            nbytes = decomposition_bytes(c.problem, d, layer)
            next_made = min(p.end for p in made) + c.length(c.period(c.problem.costs.stage_of(layer)))
            used = apply_start(c, layer, c.plan.layers[layer].use_offset, d)
            if nbytes and next_made < used:
                spans.append((next_made, used, nbytes))
        held = [(s + c.tol, e - c.tol, n) for a, b, n in spans for s, e in wrapped(a, b, L) if e - s > 2 * c.tol]
        total = static_bytes(c.problem, d) + peak_level(held)
        if budget is not None and total > budget:
            c.errors.append(f"r{d}: memory peaks at {total} bytes, over the budget of {budget}")
        claimed = c.plan.metrics.peak_memory.get(d)
        if claimed is None or claimed < total:  # what a user budgets by: never below what the placements hold
            c.errors.append(f"r{d}: peak memory {claimed} claimed, {total} found")


def check_step_time(c: Context) -> None:
    """The step (the longest window over its period) within max_overhead of the reference step, besides the
    refresh step's taps (`tap_extra`, paid once per window), and as the plan claims."""
    periods = {c.period(s) for s in range(c.problem.num_stages)}
    step = max(c.length(k) / k for k in periods)
    taps = tap_extra(c.problem)
    for k in sorted(periods):
        allowed = c.normal.length * (1 + c.problem.max_overhead) + taps / k
        if c.length(k) / k > allowed + c.tol:
            c.errors.append(
                f"step time {c.length(k) / k:.6g} s at period {k} exceeds {allowed:.6g} s (reference "
                f"{c.normal.length:.6g} s, max_overhead {c.problem.max_overhead:g}, taps {taps:.6g} s per "
                f"refresh, stretch {c.stretch:.6g} s per step)"
            )
    if abs(c.plan.metrics.step_time - step) > c.tol + 1e-9 * step:
        c.errors.append(f"step time {c.plan.metrics.step_time:.6g} s claimed, {step:.6g} s found")


def check_programs(c: Context) -> None:
    """Each rank's program: its length, its repetition, the schedule's ops at their places, the refresh step's folds
    (`fused_stats`), the placed ones as placed (`_check_placed_order`)."""
    anchor = weight_gradient_kind(c.problem.kind)  # the op a fused layer's statistics fold after
    gradient = (OpKind.BWD, OpKind.BWD_W, OpKind.ALLREDUCE_GRAD)  # the ops that make a stage's reduced gradient
    for d in c.problem.devices:
        prog = c.plan.programs.get(d)
        k = c.device_period(d)
        streaming = c.problem.streaming  # a helper's program: the lcm of its period and the owner's (`add_replicas`)
        length = math.lcm(k, c.period(streaming.stage)) if streaming is not None and d in streaming.ranks else k
        if prog is None or len(prog) != length:
            c.errors.append(f"r{d}: the program must have {length} steps")
            continue
        placed = [[op for op in ops if not is_streamed(c.problem, d, op)] for ops in prog]  # streamed: check_streaming
        if any(placed[j] != placed[j % k] for j in range(k, length)):
            c.errors.append(f"r{d}: the program repeats its own {k} steps but for streamed layers' replicas")
        prog = prog[:k]
        shift = {p: c.length(k) * (p.step // k) for p in c.on[d]}  # into the window
        times = {(p.step % k, str(p.op)): (p.start - x, p.end - x) for p, x in shift.items()}
        listed = [(j, str(op)) for j, ops in enumerate(prog) for op in ops if c.is_placed(d, op)]
        matched = sorted(listed) == sorted(times)
        if not matched:
            c.errors.append(f"r{d}: the program's placed ops differ from the placements")
        elif any(a[0] == b[0] and times[a] > times[b] for a, b in zip(listed, listed[1:])):
            c.errors.append(f"r{d}: the program's placed ops are not in time order")
        for j, ops in enumerate(prog):
            schedule = c.timeline(j, k).ops[d]
            if [op for op in ops if c.pipeline(op)] != [op for op, _, _ in schedule if c.pipeline(op)]:
                c.errors.append(f"r{d} step {j}: the pipeline ops differ from the schedule's")
            if Counter(filter(c.follows_w, ops)) != Counter(op for op, _, _ in schedule if c.follows_w(op)):
                c.errors.append(f"r{d} step {j}: the gradient all-reduces differ from the schedule's")
            fixed = iter([item for item in schedule if c.pipeline(item[0])])
            spans = [next(fixed, None) if c.pipeline(op) else None for op in ops]  # each pipeline op's times
            for i, op in enumerate(ops):
                after = [o for o in ops[i + 1 :] if o.stage == op.stage]  # what of its stage follows it
                # a per-step op reads the complete gradient, which a gradient STATS reads before APPLY overwrites it; a
                # stage's all-reduce follows its W's (the runtime refuses it while one waits)
                kinds = gradient if per_step(op) else (OpKind.BWD_W,) if op.kind is OpKind.ALLREDUCE_GRAD else ()
                late = [o for o in after if o.kind in kinds]
                if late:
                    c.errors.append(f"r{d} step {j}: '{op}' comes before '{late[0]}' of its stage")
                if per_step(op) and op.kind is OpKind.STATS and all(o.kind is not OpKind.APPLY for o in after):
                    c.errors.append(f"r{d} step {j}: '{op}' does not come before the APPLY of its stage")
                if op.kind is OpKind.OPT_STEP and i != len(ops) - 1:
                    c.errors.append(f"r{d} step {j}: OPT_STEP is not the last op")
                # the refresh step follows each BWD (a zero-bubble schedule's W) with exactly the STATS folding its
                # fused layers' statistics here, and no other step folds any: else the runtime has none to decompose
                if j == 0 and op.kind is anchor:
                    want = fused_stats(c.problem, c.fused, d, op)
                    if ops[i + 1 : i + 1 + len(want)] != want:
                        c.errors.append(f"r{d} step 0: '{op}' is not followed by the folds of its fused layers {want}")
                elif c.fold(op) and (j != 0 or i == 0 or not (ops[i - 1].kind is anchor or c.fold(ops[i - 1]))):
                    c.errors.append(f"r{d} step {j}: '{op}' is not right after a {anchor} of the refresh step")
                if matched and c.is_placed(d, op):
                    _check_placed_order(c, f"r{d} step {j}", ops, i, times[j, str(op)][0] - c.base(j, k), spans)


def _check_placed_order(
    c: Context, where: str, ops: list[Op], i: int, t: float, spans: list[tuple[Op, float, float] | None]
) -> None:
    """A placed op (`ops[i]`, at `t` in its step) sits among the pipeline ops (`spans`: their times) as its time says:
    the runtime runs the program in order, so a program that disagrees with its placements runs other semantics."""
    op = ops[i]
    for n, item in enumerate(spans):
        if item is None or item[0].kind is OpKind.OPT_STEP:
            continue  # OPT_STEP ends the step (the barrier): work placed in the stretch runs before it
        other, a, b = item
        before = b <= t + c.tol and a < t - c.tol
        if (n > i and before) or (n < i and b > t + c.tol):
            c.errors.append(
                f"{where}: '{op}' (placed at {t:.6g} s) and '{other}' ({a:.6g}-{b:.6g} s) are in the wrong order in "
                "the program"
            )


def check_runs(c: Context) -> None:
    """Simulate the programs (ops in program order, as soon as possible): no deadlock, and the run is
    no slower than planned (the durations of a non-refresh step are used: exact when nothing is fused)."""
    stages = c.problem.costs.stages
    split = c.problem.kind in ZERO_BUBBLE_KINDS  # a BWD without its W, which runs apart
    timed = (PRECONDITIONER_KINDS - LAYER_TRANSFER_KINDS) | {OpKind.ALLREDUCE_GRAD}  # hand-offs: no time of their own

    def duration(rank: int, op: Op) -> float:
        if op.kind is OpKind.FWD:
            return stages[op.stage_id].fwd
        if op.kind is OpKind.BWD:
            again = stages[op.stage_id].fwd if c.problem.recomputes(op.stage_id) else 0.0  # activation checkpointing
            return stages[op.stage_id].bwd - (stages[op.stage_id].weight_grad if split else 0.0) + again
        if op.kind is OpKind.BWD_W:  # a per-layer W: its layer's share ([Note: per-layer W])
            stage = stages[op.stage_id]
            return stage.weight_grad * (w_share(stage, op.layer) if op.layer is not None else 1.0)
        return op_seconds(c, op) if op.kind in timed and not c.fold(op) else 0.0

    periods = [len(p) for p in c.plan.programs.values()]
    steps = max(periods) * 2
    try:
        world = c.problem.barrier is StepBarrier.WORLD
        barrier = None if world else {d: agreement_set(c.problem, d) for d in c.problem.devices}
        buckets = problem_buckets(c.problem, c.plan.programs)
        lead, link = stream_timing(c.problem, duration, buckets)
        timeline = simulate(
            c.plan.programs, duration, steps=steps, barrier=barrier, lead=lead, link=link, buckets=buckets
        )
    except DeadlockError as e:
        c.errors.append(f"the programs deadlock: {e}")
        return
    limit = c.plan.metrics.step_time * steps + max(c.length(k) for k in set(periods))
    if not c.fused and timeline.length > limit + c.tol * steps:
        c.errors.append(f"the simulated programs take {timeline.length:.6g} s for {steps} steps, over {limit:.6g}")


def check_streaming(c: Context) -> None:
    """The hand-offs of every step and the replicas of every refresh (nothing to check without streaming)."""
    streaming = c.problem.streaming
    if streaming is None:
        return
    s, owners = streaming.stage, c.problem.stream_owners
    pairs = list(zip(streaming.layers, streaming.helpers, strict=True))
    sends = [Op(OpKind.SEND_LGRAD, s, peer=h, layer=n) for n, h in pairs]
    # each owner's step sends every streamed layer right after the stage's last BWD, takes each back once and applies
    # none of them itself
    for owner, (j, ops) in ((o, step) for o in owners for step in enumerate(c.plan.programs[o])):
        backward = [i for i, op in enumerate(ops) if op.kind in (OpKind.BWD, OpKind.BWD_W) and op.stage == s]
        if not backward or ops[backward[-1] + 1 : backward[-1] + 1 + len(sends)] != sends:
            c.errors.append(
                f"r{owner} step {j}: the streamed layers' SEND_LGRAD do not follow the last BWD of stage {s}"
            )
        for n, helper in pairs:
            recv = Op(OpKind.RECV_PGRAD, s, peer=helper, layer=n)
            if ops.count(recv) != 1:
                c.errors.append(f"r{owner} step {j}: '{recv}' must run once")
            if any(op.kind is OpKind.APPLY and op.stage == s and op.layer in (None, n) for op in ops):
                c.errors.append(f"r{owner} step {j}: applies {n}, which r{helper} preconditions")
    # each helper's step receives its layers from every owner, applies them (a cut APPLY's pieces in order) and
    # returns them, once each, in that order, and applies no other layer of the stage
    for helper, (j, ops) in ((h, step) for h in streaming.ranks for step in enumerate(c.plan.programs[h])):
        mine = streaming.layers_of(helper)
        others = sorted({op.layer or "(all)" for op in ops if op.kind is OpKind.APPLY and op.stage == s} - set(mine))
        if others:
            c.errors.append(f"r{helper} step {j}: applies {others} of stage {s}, which it does not precondition")
        for n in mine:
            chain = [
                *(Op(OpKind.RECV_LGRAD, s, peer=owner, layer=n) for owner in owners),
                *cut_apply(Op(OpKind.APPLY, s, layer=n), c.problem.apply_pieces),
                *(Op(OpKind.SEND_PGRAD, s, peer=owner, layer=n) for owner in owners),
            ]
            at = [ops.index(op) if ops.count(op) == 1 else -1 for op in chain]
            if min(at) < 0 or at != sorted(at):
                c.errors.append(f"r{helper} step {j}: {n} is not received, applied and returned once, in order")
    _check_replicas(c, streaming, owners[0])


def _check_replicas(c: Context, streaming: Streaming, owner: int) -> None:
    """Replay the replicas over two periods: the owner sends one after a DECOMP (or BCAST) of the layer, the helper
    takes it that step, each helper APPLY finds the refresh due in the replicas (a Muon matrix: none made or due)."""
    s = streaming.stage
    for n, helper in zip(streaming.layers, streaming.helpers, strict=True):
        send = Op(OpKind.SEND_REPLICA, s, peer=helper, layer=n)
        recv = Op(OpKind.RECV_REPLICA, s, peer=owner, layer=n)
        refreshed = bool(c.problem.costs.layer(n).parts)
        periods = [len(c.plan.programs[r]) + len(c.plan.startup.get(r, [])) for r in (owner, helper)]
        timing = c.plan.layers[n]
        received = 0
        for t in range(2 * math.lcm(*periods) + max(periods)):
            mine = ops_at(c.plan.programs, c.plan.startup, owner, t)
            theirs = ops_at(c.plan.programs, c.plan.startup, helper, t)
            if mine.count(send) != theirs.count(recv):
                c.errors.append(
                    f"step {t}: r{owner} sends {mine.count(send)} replicas of {n}, r{helper} takes {theirs.count(recv)}"
                )
                return
            # after a DECOMP of the layer, or its BCAST (a copied stage's halves made elsewhere)
            made = (OpKind.DECOMP, OpKind.BCAST)
            if send in mine and not any(op.kind in made and op.layer == n for op in mine[: mine.index(send)]):
                c.errors.append(f"step {t}: r{owner} sends a replica of {n} before any DECOMP or BCAST of it there")
            for op in theirs:
                received += op == recv
                if op != Op(OpKind.APPLY, s, layer=n) or not refreshed:
                    continue
                due = t - timing.use_offset
                if due >= timing.curv_step and received < (due - timing.curv_step) // timing.period + 1:
                    c.errors.append(f"step {t}: r{helper} applies {n} before the replica of its refresh due arrives")
                    return


def validate(problem: Problem, plan: Plan, *, run: bool = True) -> list[str]:
    """Every way `plan` breaks `problem`'s constraints, as readable lines (empty: valid); `run` also simulates the
    programs (deadlock, speed)."""
    c = Context(problem, plan)
    check_layers(c)
    if c.errors:
        return c.errors
    rules = (check_placements, check_devices, check_precs_and_offsets, check_step_time, check_programs, check_streaming)
    for check in rules + ((check_runs,) if run else ()):
        check(c)
    return c.errors


def check_plan(problem: Problem, plan: Plan, *, run: bool = True) -> None:
    """Raise PlanError listing every violation of `validate`."""
    errors = validate(problem, plan, run=run)
    if errors:
        shown = "\n  ".join(errors[:20]) + (f"\n  ... and {len(errors) - 20} more" if len(errors) > 20 else "")
        raise PlanError(f"the plan is not valid for its problem ({len(errors)} violations):\n  {shown}")
