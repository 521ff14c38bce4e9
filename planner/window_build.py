"""A stage group's refresh window built from its problem: the time grid's scale ([Note: time grid] in
planner/window.py), the fixed F/B and activations of k simulated steps, the per-step APPLY slots and the refresh's
tasks (statistics, synchronization, decomposition in pieces, broadcast) with their releases and devices."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import replace
from functools import lru_cache

from fxkfac.planner.costs import LayerCost
from fxkfac.planner.ir import Op, OpKind
from fxkfac.planner.memory import activation_intervals, static_bytes
from fxkfac.planner.problem import (
    Problem,
    StageGroup,
    copies_of_stage,
    is_streamed,
    returned,
    stages_on_device,
    streamed_stats,
)
from fxkfac.planner.schedules import weight_gradient_kind
from fxkfac.planner.step_timeline import (
    StepTimeline,
    early_start,
    prec_work,
    step_begins,
    step_timeline,
    stream_start,
)
from fxkfac.planner.strategy import keeps_statistics
from fxkfac.planner.window import Grid, Interval, PrecSlot, Task, TaskKind, Window, step_start_tick, wrap

__all__ = ["build_window", "grid_scale"]


def _scale(times: Iterable[float], period: float, resolution: int) -> tuple[float, bool]:
    """The exact grid's ticks per second, 10^e for the least e that makes every time whole (up to float error, 1e-9
    of it: a relative 1e-6 took 519687.5 ticks for whole), or `resolution` ticks per period and False."""
    values = [t for t in times if t > 0]
    for e in range(7):
        m = 10.0**e
        if period * m > 1e7:
            break
        if all(abs(t * m - round(t * m)) <= 1e-9 * max(1.0, t * m) for t in values):
            return m, True
    return resolution / period, False


def _merge(intervals: Iterable[Interval]) -> tuple[Interval, ...]:
    """The intervals merged, sorted; an empty one (t, t), an instant no work may span, kept where no interval holds t
    inside (CP-SAT's no-overlap, first-fit's gaps and the packing bound's idle regions all split at it)."""
    out: list[list[int]] = []
    instants = []
    for s, e in sorted(intervals):
        if e < s:
            continue
        if e == s:
            instants.append(s)
        elif out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    kept = [(t, t) for t in dict.fromkeys(instants) if not any(s < t < e for s, e in out)]
    return tuple(sorted([(s, e) for s, e in out] + kept))


def grid_scale(
    problem: Problem, stages: Iterable[int], fused: frozenset[str], resolution: int, extra: Iterable[float] = ()
) -> tuple[float, bool]:
    """Ticks per second for windows of `stages` and whether the grid is exact ([Note: time grid]); `extra`: more
    durations it must hold exactly (the options of a joint choice, planner/joint.py)."""
    refresh, normal = step_timeline(problem, fused, refresh=True), step_timeline(problem)
    stages = list(stages)
    layers = [x for s in stages for x in problem.costs.stages[s].layers]
    durations = [t for x in layers for p in x.parts for t in (p.stats, p.decomp)]
    durations += [problem.costs.stages[s].prec for s in stages]
    durations += [
        problem.costs.collective_seconds(op, len(copies_of_stage(problem, s)))
        for s in stages
        for x in problem.costs.stages[s].layers
        for p in x.parts
        for op in (
            Op(OpKind.SYNC_STATS, s, layer=x.name, part=p.part),
            Op(OpKind.BCAST, s, layer=x.name, part=p.part, root=0),
        )
    ]
    times = [t for st in (refresh, normal) for items in st.ops.values() for _, a, b in items for t in (a, b)]
    return _scale(times + durations + list(extra), normal.length, resolution)


def build_window(
    problem: Problem,
    group: StageGroup,
    k: int,
    fused: frozenset[str] = frozenset(),
    *,
    stats_chunk: int = 1,
    resolution: int = 100_000,
    stretch: int = 0,
    scale: tuple[float, bool] | None = None,
) -> Window:
    """The window of `k` steps for `group` (step 0 is the refresh step, F/B grown by taps and fused curvature),
    each step followed by `stretch` idle ticks; `scale`: a (ticks per second, exact) grid to use instead
    of the group's own (`grid_scale`), so that windows of several groups share one."""
    if stretch < 0:
        raise AssertionError(f"negative stretch {stretch}")
    refresh, normal = step_timeline(problem, fused, refresh=True), step_timeline(problem)
    ticks_per_s, exact = scale if scale is not None else grid_scale(problem, group.stages, fused, resolution)
    grid = Grid(ticks_per_s)
    steps = [refresh] + [normal] * (k - 1)
    offsets = [step_begins(grid.at(refresh.length), grid.at(normal.length), stretch, j, k) for j in range(k + 1)]
    leads = tuple(
        grid.at(steps[j - 1].length) - grid.at(steps[j - 1].length - early_start(problem, steps[j - 1], group.devices))
        for j in range(k)
    )
    fixed, acts, capacity = {}, {}, {}
    for d in group.devices:
        fixed[d], acts[d] = _device_work(problem, d, steps, offsets, leads, grid)
        budget = problem.memory_budget
        capacity[d] = None if budget is None else budget - static_bytes(problem, d)
    precs = _prec_slots(problem, group, steps, offsets, leads, grid)
    tasks = _tasks(problem, group, refresh, fused, stats_chunk, grid, precs)
    return Window(
        problem,
        group,
        k,
        fused,
        ticks_per_s,
        exact,
        tuple(offsets),
        fixed,
        acts,
        capacity,
        tasks,
        precs,
        leads,
        stretch,
        stats_chunk,
        _stream_use(problem, steps, offsets, grid),
    )


def _stream_use(problem: Problem, steps: Sequence[StepTimeline], offsets: Sequence[int], grid: Grid) -> tuple[int, ...]:
    """Per step, the tick at which the first of the streamed stage's owners starts its last backward
    (`Window.stream_use`)."""
    streaming = problem.streaming
    if streaming is None:
        return ()
    return tuple(offsets[j] + grid.at(stream_start(problem, st)) for j, st in enumerate(steps))


def _device_work(
    problem: Problem,
    device: int,
    steps: Sequence[StepTimeline],
    offsets: Sequence[int],
    leads: Sequence[int],
    grid: Grid,
) -> tuple[tuple[Interval, ...], tuple[tuple[int, int, int], ...]]:
    """The device's busy ticks over the window (F/B, each gradient all-reduce over copies, an instant where it takes
    no tick, a streamed layer's APPLY on its helper and hand-off on its owner, the first tick of every step) merged,
    and its activation pieces (start, end, bytes), all modulo the window."""
    length = offsets[-1]
    busy: list[Interval] = []
    pieces: list[tuple[int, int, int]] = []
    for j, st in enumerate(steps):
        off = offsets[j]
        for _op, a, b in st.fixed(device):
            busy += wrap(off + grid.at(a), off + grid.at(b), length)
        for op, a, b in st.ops[device]:
            if (
                op.kind is OpKind.ALLREDUCE_GRAD
                and op.stage is not None
                and len(copies_of_stage(problem, op.stage)) > 1
            ):
                # a collective: its interval, or where it takes no tick the instant no work may span (one copy's
                # is a no-op)
                start, end = off + grid.at(a), off + grid.at(b)
                busy += wrap(start, end, length) if end > start else [(end % length, end % length)]
            elif op.kind is OpKind.APPLY and is_streamed(problem, device, op):  # the helper's APPLY of a streamed layer
                busy += wrap(off + grid.at(a), off + grid.at(b), length)
            elif op.kind in (OpKind.SEND_LGRAD, OpKind.RECV_PGRAD) and op.layer is not None:  # the owner's hand-off
                layer = problem.costs.layer(op.layer)
                work = layer.hand_off if op.kind is OpKind.SEND_LGRAD else layer.take_back  # a RECV's wait is idle
                if work > 0:
                    busy += wrap(off + grid.at(b - work), off + grid.at(b), length)
        begin = step_start_tick(offsets, leads, j)
        busy += wrap(begin, begin + 1, length)  # no task spans a boundary ([Note: step barrier])
        for a, b, nbytes in activation_intervals(problem, device, st):
            pieces += [(s, e, nbytes) for s, e in wrap(off + grid.at(a), off + grid.at(b), length)]
    return _merge(busy), tuple(pieces)


def _prec_slots(
    problem: Problem,
    group: StageGroup,
    steps: list[StepTimeline],
    offsets: list[int],
    leads: tuple[int, ...],
    grid: Grid,
) -> tuple[PrecSlot, ...]:
    """Every (device, stage, step)'s slot: the stage's gradient STATS, then its APPLY ([Note: gradient parts])."""
    slots = []
    lead = {
        s: max(
            sum(secs for op, secs in prec_work(problem, c, s) if op.kind is not OpKind.BCAST_PREC)
            for c in copies_of_stage(problem, s)
        )
        for s in group.stages
    }
    for d in group.devices:
        for s in stages_on_device(problem, d):
            work = prec_work(problem, d, s)
            ops, durations = tuple(op for op, _ in work), tuple(secs for _, secs in work)
            shape = PrecSlot(d, s, 0, 0, 0, 0, 0, ops, durations, lead[s])
            lead_s = shape.lead if shape.shares else 0.0
            seconds = replace(shape, lead=lead_s).seconds
            for j, st in enumerate(steps):
                release = offsets[j] + grid.at(st.allreduce_end[d, s])
                deadline = step_start_tick(offsets, leads, j + 1)  # before OPT_STEP ([Note: step barrier])
                end = st.end_of(d, ops[-1]) if ops else st.allreduce_end[d, s]  # every layer streamed: no work
                reference = offsets[j] + grid.at(end - seconds)
                # the reference's rounded ends, not its rounded-up length: the op after it starts at grid.at(end)
                ticks = min(max(1, grid.at(end) - grid.at(end - seconds)), deadline - release)
                slots.append(
                    PrecSlot(d, s, j, release, deadline, max(release, reference), ticks, ops, durations, lead_s)
                )
    return tuple(slots)


def _parts_after(layers: Iterable[LayerCost], kind: OpKind) -> list[str]:
    """The parts of `layers` whose capture the end of a `kind` op (FWD or BWD) makes, in the layers' order."""
    return list(dict.fromkeys(p.part for x in layers for p in x.parts if p.after is kind))


@lru_cache(maxsize=1 << 16)
def _stats_op(stage: int, mb: int | None, pipe: int, layer: str, part: str) -> Op:
    """One micro-batch's STATS op, made (and checked) once for every window that places it."""
    return Op(OpKind.STATS, stage, mb, pipe, layer=layer, part=part)


def _chunks(layers: Sequence[LayerCost], size: int) -> list[list[LayerCost]]:
    """`layers` in consecutive runs of at most `size`, as even as their number allows (10 by 4: 3, 3, 4)."""
    n = len(layers)
    runs = -(-n // size)
    bounds = [n * i // runs for i in range(runs + 1)] if runs else [0]
    return [list(layers[a:b]) for a, b in zip(bounds, bounds[1:])]


def _curv_tasks(
    problem: Problem, stage: int, refresh: StepTimeline, deferred: list[LayerCost], stats_chunk: int, grid: Grid
) -> list[Task]:
    tasks = []
    copies = copies_of_stage(problem, stage)
    for d in copies:
        kept = [x for x in deferred if keeps_statistics(d, copies, problem.where(x.name))]
        for op, _, end in refresh.fixed(d):
            if op.stage != stage:
                continue
            chunks = _chunks(kept, stats_chunk)
            for side in _parts_after(kept, op.kind):
                for chunk in chunks:
                    if not chunk:
                        continue
                    secs = tuple(x.part(side).stats for x in chunk)
                    ops = tuple(_stats_op(stage, op.mb, op.pipe, x.name, side) for x in chunk)
                    keep = sum(x.part(side).capture_bytes for x in chunk)
                    tasks.append(
                        Task(
                            f"curv_{side}_s{stage}_m{op.mb}_p{op.pipe}_r{d}_{chunk[0].name}",
                            TaskKind.CURV,
                            stage,
                            side,
                            ops,
                            secs,
                            grid.span(sum(secs)),
                            (d,),
                            grid.up(end),
                            tuple((x.name, side) for x in chunk),
                            keep,
                        )
                    )
    return tasks


def _tasks(
    problem: Problem,
    group: StageGroup,
    refresh: StepTimeline,
    fused: frozenset[str],
    stats_chunk: int,
    grid: Grid,
    precs: tuple[PrecSlot, ...],
) -> tuple[Task, ...]:
    tasks: list[Task] = []
    for s in group.stages:
        layers = problem.costs.stages[s].layers
        tasks += _curv_tasks(problem, s, refresh, [x for x in layers if x.name not in fused], stats_chunk, grid)
    for s in group.stages:
        copies = copies_of_stage(problem, s)
        piece = _piece_seconds(problem, s)
        for x in problem.costs.stages[s].layers:
            for p in x.parts:
                if p.after is OpKind.ALLREDUCE_GRAD and streamed_stats(problem, x.name):
                    ready = max(grid.up(refresh.end_of(d, returned(problem, x.name))) for d in copies)
                    tasks += _refresh_tasks(problem, s, x.name, p.part, p.decomp, piece, ready, True, grid, False)
                    continue
                if p.after is OpKind.ALLREDUCE_GRAD:
                    ready = min(slot.release + slot.ticks for slot in precs if (slot.stage, slot.step) == (s, 0))
                    tasks += _refresh_tasks(problem, s, x.name, p.part, p.decomp, piece, ready, True, grid)
                    continue
                ready = 0
                if x.name in fused:
                    made = weight_gradient_kind(problem.kind) if p.after is OpKind.BWD else p.after  # with the W
                    ready = max(
                        grid.up(e) for d in copies for op, _, e in refresh.fixed(d) if op.stage == s and op.kind is made
                    )
                tasks += _refresh_tasks(problem, s, x.name, p.part, p.decomp, piece, ready, False, grid)
    return tuple(tasks)


def _piece_seconds(problem: Problem, stage: int) -> float:
    """The longest a DECOMP task of the stage lasts: one piece (`Problem.decomp_pieces`) of its longest
    decomposition."""
    longest = max((p.decomp for x in problem.costs.stages[stage].layers for p in x.parts), default=0.0)
    return longest / problem.decomp_pieces


def _refresh_tasks(
    problem: Problem,
    stage: int,
    layer: str,
    side: str,
    decomp: float,
    piece: float,
    ready: int,
    gradient: bool,
    grid: Grid,
    after_slot: bool | None = None,
) -> list[Task]:
    """A part's refresh after its statistics: SYNC over the stage's copies (a captured part held more than once),
    DECOMP on one copy, BCAST to the others, the collectives priced by the cost table's comm model (at least one
    tick, [Note: time grid]); `ready`: the earliest tick the statistic is complete anywhere; `gradient`: the part
    is fed by the reduced gradient ([Note: gradient parts]), and its DECOMP follows the refresh step's slot unless
    `after_slot` is False (a streamed unit's statistics land with its helper's return, `ready`); `piece`: the longest
    a DECOMP task lasts (`_piece_seconds`)."""
    copies, workers = copies_of_stage(problem, stage), problem.workers(layer)
    key = ((layer, side),)
    tasks = []
    if len(copies) > 1 and not gradient and not problem.where(layer).strategy.local_factors:
        op = Op(OpKind.SYNC_STATS, stage, layer=layer, part=side)
        secs = problem.costs.collective_seconds(op, len(copies))
        tasks.append(
            Task(
                f"sync_{side}_{layer}", TaskKind.SYNC, stage, side, (op,), (secs,), grid.span(secs), copies, ready, key
            )
        )
    slot = gradient if after_slot is None else after_slot
    tasks += _decomp_tasks(problem.decomp_pieces, piece, stage, layer, side, decomp, workers, ready, slot, grid)
    if len(workers) > 1:
        op = Op(
            OpKind.BCAST, stage, layer=layer, part=side, root=workers[0], group=None if workers == copies else workers
        )
        secs = problem.costs.collective_seconds(op, len(workers))
        tasks.append(
            Task(f"bcast_{side}_{layer}", TaskKind.BCAST, stage, side, (op,), (secs,), grid.span(secs), workers, 0, key)
        )
    return tasks


def _decomp_tasks(
    pieces: int,
    piece: float,
    stage: int,
    layer: str,
    side: str,
    decomp: float,
    workers: tuple[int, ...],
    ready: int,
    gradient: bool,
    grid: Grid,
) -> list[Task]:
    """A part's decomposition as one INV task, or made in `pieces` DECOMP ops ("DECOMP s A i/n layer") of
    ``decomp / pieces`` seconds each, run back to back in tasks no longer than `piece` (each as few as that allows,
    the pieces dealt evenly), which the solvers chain in order on one rank (`inv_chains`).

    [Note: piece tasks] The pieces exist so that no task outlasts the bubbles; a stage's small decompositions need
    fewer tasks than its largest. Per Linear, a Transformer block's 4d-wide factors take 64 times the d-wide ones'
    decomposition: cut in the same 4 pieces, the d-wide ones made 288 of BERT-Large 1F1B's 432 tasks a stage, and
    CP-SAT found the streamed plan at the bound only with 30 s; as one task each, within 10 s. The runtime runs the
    same pieces; a task only keeps them adjacent on one rank."""
    share = decomp / pieces
    most = max(1, math.floor(piece / share + 1e-9)) if share > 0 else pieces  # pieces a task may hold
    runs = math.ceil(pieces / most)
    bounds = [pieces * i // runs for i in range(runs + 1)]
    whole = pieces == 1
    return [
        Task(
            f"inv_{side}_{layer}" if whole else f"inv_{side}_{layer}_{a}",
            TaskKind.INV,
            stage,
            side,
            tuple(
                Op(OpKind.DECOMP, stage, layer=layer, part=side, piece=None if whole else (i, pieces))
                for i in range(a, b)
            ),
            (share,) * (b - a),
            grid.span(share * (b - a)),
            workers,
            ready,
            ((layer, side),),
            after_slot=gradient,
        )
        for a, b in zip(bounds, bounds[1:])
    ]
