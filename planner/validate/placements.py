"""Checks of where and when the preconditioner's ops are placed: each op placed as often as the problem asks, for
its cost, inside its window step, never over the pipeline's F/B or another op, within the memory budget and the step
time."""

from __future__ import annotations

from collections import Counter, defaultdict

from fxkfac.planner.ir import Op, OpKind, Placement
from fxkfac.planner.memory import (
    activation_intervals,
    decomposition_bytes,
    peak_level,
    static_bytes,
    w_operand_bytes,
)
from fxkfac.planner.problem import copies_of_stage, stage_groups
from fxkfac.planner.step_timeline import tap_extra
from fxkfac.planner.strategy import keeps_statistics
from fxkfac.planner.validate.context import (
    Context,
    apply_start,
    decomp_pieces,
    end_of,
    op_seconds,
    per_step,
    placed_key,
    step_ops,
    wrapped,
)
from fxkfac.planner.w_tasks import placed_w


def _expected(c: Context) -> Counter:
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
                for op in step_ops(c, s, d):
                    want[op, d, j] += 1
                for op, _, _ in c.timeline(j, c.period(s)).fixed(d) if placed_w(p) else ():
                    if op.kind is OpKind.BWD_W and op.stage == s:  # placed W's ([Note: placed W], planner/w_tasks.py)
                        want[op, d, j] += 1
        for x in stage.layers:
            workers = p.workers(x.name)
            for side, after in ((part.part, part.after) for part in x.parts):
                for piece in decomp_pieces(p.decomp_pieces):
                    want[Op(OpKind.DECOMP, s, layer=x.name, part=side, piece=piece), None] += 1
                synced = after is not OpKind.ALLREDUCE_GRAD and not p.where(x.name).strategy.local_factors
                for d in copies if synced and len(copies) > 1 else ():
                    want[Op(OpKind.SYNC_STATS, s, layer=x.name, part=side), d] += 1
                group = None if workers == copies else workers
                for d in workers if len(workers) > 1 else ():
                    want[placed_key(Op(OpKind.BCAST, s, layer=x.name, part=side, root=workers[0], group=group)), d] += 1
    return want


def check_layers(c: Context) -> None:
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
        if not 1 <= t.period <= p.max_period or t.curv_step != 0:
            c.errors.append(f"layer {name}: bad timing {t}")
    if c.fused and len({t.period for t in c.plan.layers.values()}) != 1:
        c.errors.append("with fused curvature every layer must share one refresh period")


def check_placed_once(c: Context) -> None:
    got: Counter = Counter()
    for p in c.plan.placements:
        k = c.period(p.op.stage_id)
        if per_step(p.op) or p.op.kind is OpKind.BWD_W:
            got[placed_key(p.op), p.device, p.step] += 1
        else:
            got[placed_key(p.op), None if p.op.kind is OpKind.DECOMP else p.device] += 1
        cost = _w_seconds(c, p, k) if p.op.kind is OpKind.BWD_W else op_seconds(c, p.op)
        if abs(p.end - p.start - cost) > c.tol + 1e-9 * max(1.0, p.end):
            c.errors.append(f"{p.op} on r{p.device}: lasts {p.end - p.start:.6g} s, costs {cost:.6g} s")
        if (
            not 0 <= p.step < 2 * k
            or not c.step_start(p.device, p.step, k) - c.tol <= p.start
            or p.end > c.step_start(p.device, p.step + 1, k) + c.tol
        ):
            c.errors.append(
                f"{p.op} on r{p.device} at [{p.start:.6g}, {p.end:.6g}) s is not within window step {p.step} (k={k})"
            )
        if p.op.kind is OpKind.DECOMP:
            workers = c.problem.workers(p.op.layer_name)
            if p.device not in workers:
                c.errors.append(f"{p.op} runs on r{p.device}, not a grad worker of {p.op.layer} {list(workers)}")
    want = _expected(c)
    for item in sorted(set(want) | set(got), key=str):
        if want[item] != got[item]:
            c.errors.append(f"{item[0]} on {item[1:]} placed {got[item]} times, expected {want[item]}")


def _w_seconds(c: Context, p: Placement, k: int) -> float:
    """Seconds of a placed W: its interval in its step's timeline (the refresh step's holds the fused curvature)."""
    return next((b - a for op, a, b in c.timeline(p.step, k).ops[p.device] if op == p.op), 0.0)


def _fixed_intervals(c: Context, device: int, k: int) -> list[tuple[float, float, str]]:
    """The device's F/B (and W) and gradient all-reduces over a window of k steps: nothing else may run then (an op
    of no duration, such as a backward a noisy profile timed at 0 s, occupies nothing)."""
    out = []
    fixed_w = () if placed_w(c.problem) else (OpKind.BWD_W,)  # placed W's are placements
    for j in range(k):
        for op, a, b in c.timeline(j, k).ops[device]:
            if b > a and op.kind in (OpKind.FWD, OpKind.BWD, OpKind.ALLREDUCE_GRAD, *fixed_w):
                out.append((c.base(j, k) + a, c.base(j, k) + b, f"{op} (step {j})"))
    return out


def check_overlap(c: Context) -> None:
    by_device = defaultdict(list)
    for p in c.plan.placements:
        by_device[p.device].append(p)
    for d in c.problem.devices:
        ks = {c.period(s) for s in range(c.problem.num_stages) if d in copies_of_stage(c.problem, s)}
        k = max(ks)
        L = c.length(k)
        items = [(s, e, name) for a, b, name in _fixed_intervals(c, d, k) for s, e in wrapped(a, b, L)]
        items += [(s, e, f"{p.op}") for p in by_device[d] for s, e in wrapped(p.start, p.end, L)]
        items.sort()
        for i, (s1, e1, n1) in enumerate(items):
            for s2, e2, n2 in items[i + 1 :]:
                if s2 >= max(e1, s1 + c.tol) - c.tol:
                    break
                if min(e1, e2) - s2 > c.tol or (s1 + c.tol < s2 < e1 - c.tol):
                    c.errors.append(f"r{d}: {n1} [{s1:.6g}, {e1:.6g}) overlaps {n2} [{s2:.6g}, {e2:.6g}) (mod {L:.6g})")


def check_memory(c: Context) -> None:
    budget = c.problem.memory_budget
    keeps = defaultdict(list)
    for p in c.plan.placements:
        if p.op.kind is OpKind.STATS and p.op.mb is not None:
            part = c.problem.costs.layer(p.op.layer_name).part(p.op.part_name)
            since = end_of(c.refresh, p.device, part.after, p.op.stage_id, p.op.mb_id, p.op.pipe)
            keeps[p.device].append((since, p.end, part.capture_bytes))
        elif p.op.kind is OpKind.BWD_W:  # a placed W holds its layers' operands from its B's end
            k = c.period(p.op.stage_id)
            since = c.base(p.step, k) + end_of(c.timeline(p.step, k), p.device, OpKind.BWD, *_key(p.op))
            keeps[p.device].append((since, p.end, w_operand_bytes(c.problem.costs.stages[p.op.stage_id])))
    for d in c.problem.devices:
        k = max(c.period(s) for s in range(c.problem.num_stages) if d in copies_of_stage(c.problem, s))
        L = c.length(k)
        spans = [
            (c.base(j, k) + a, c.base(j, k) + b, n)
            for j in range(k)
            for a, b, n in activation_intervals(c.problem, d, c.timeline(j, k), not placed_w(c.problem))
        ] + keeps[d]
        for layer, ends in c.made.items():  # a third decomposition: the next refresh's made before this one is used
            nbytes = decomposition_bytes(c.problem, d, layer)
            next_made = min(ends) + c.length(c.period(c.problem.costs.stage_of(layer)))
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


def _key(op: Op) -> tuple[int, int, int]:
    return op.stage_id, op.mb_id, op.pipe


def check_step_time(c: Context) -> None:
    """The step (the longest window over its period) within max_overhead of the reference step, besides the
    refresh step's taps (`tap_extra`, paid once per window), and as the plan claims."""
    periods = {t.period for t in c.plan.layers.values()}
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
