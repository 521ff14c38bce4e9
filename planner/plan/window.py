"""A stage group's refresh window: k steps on an integer time grid, their fixed F/B and activations, the per-step
APPLY slots and the refresh's tasks with releases and devices (solved: planner/plan/solution.py).

[Note: time grid] Ticks are whole 10^-e s (e <= 6, at most 10^7 a step) where every time is one, else
`SolverConfig.time_resolution` a step with times rounded and durations rounded up: a plan is off by at most one
tick, which the validator allows. A task lasts a tick or more; a no-tick all-reduce is an instant (t, t) in `fixed`.

[Note: stretch] With `Problem.max_overhead > 0` each step may be followed by `Window.stretch` idle ticks on every
device (F/B keep their times in their step); all groups share one stretch, found least by planner/search/greedy.py.

[Note: step barrier] Under `StepBarrier.WORLD` step j+1 begins at `offsets[j+1]` everywhere and each step's first
tick is blocked, so no task spans a boundary. Under `AGREEMENT_SET` a group's step j+1 may begin `leads[j+1]` ticks
early, once its devices end step j (`step_timeline.early_start`). Only CP-SAT at k = 1 runs a task past the window.

[Note: gradient parts] A part fed by the reduced gradient (Shampoo's and SOAP's L and R) takes its statistic every
step on every copy at the head of its stage's APPLY slot (`PrecSlot.ops`); its DECOMP follows the refresh step's
slot (`Task.after_slot`), the snapshot not counted in memory.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from functools import cached_property, lru_cache
from typing import TypeVar

from fxkfac.planner.problem.costs import PartCost
from fxkfac.planner.problem.ir import Op, OpKind
from fxkfac.planner.problem.problem import (
    Problem,
    StageGroup,
    is_streamed,
    returned,
    stages_on_device,
    streamed_stats,
)
from fxkfac.planner.problem.schedules import ZERO_BUBBLE_KINDS, capture_kind
from fxkfac.planner.problem.step_timeline import (
    STREAMED_TRANSFERS,
    Timeline,
    activation_intervals,
    early_start,
    prec_work,
    static_bytes,
    step_begins,
    step_timeline,
    stream_start,
    w_layer_ops,
    w_makes,
    w_operand_bytes,
    whole_decimal,
)
from fxkfac.planner.problem.strategy import keeps_statistics

Interval = tuple[int, int]
T = TypeVar("T")


class TaskKind(StrEnum):
    """A window task's work: CURV (statistics), SYNC and BCAST (collectives on all its devices at once), INV (a
    decomposition on one of its devices), WGRAD (a zero-bubble schedule's W: [Note: placed W])."""

    CURV = "curv"
    WGRAD = "wgrad"
    SYNC = "sync"
    INV = "inv"
    BCAST = "bcast"

    @property
    def collective(self) -> bool:
        return self in (TaskKind.SYNC, TaskKind.BCAST)


@dataclass(frozen=True)
class Task:
    """`ops` back to back for `ticks` on one of `devices` for the (layer, side) `factors`, holding keep_bytes from
    `release` to its end; after_slot: [Note: gradient parts]; deadline, home: [Note: placed W]."""

    name: str
    kind: TaskKind
    stage: int
    side: str
    ops: tuple[Op, ...]
    seconds: tuple[float, ...]
    ticks: int
    devices: tuple[int, ...]
    release: int
    factors: tuple[tuple[str, str], ...]
    keep_bytes: int = 0
    after_slot: bool = False
    deadline: int | None = None
    home: int | None = None


@dataclass(frozen=True)
class PrecSlot:
    """The per-step work (`prec_work`) of `stage` on `device` at window step `step`: `ops` back to back in
    [release, deadline), BCAST_PRECs `lead` seconds in on every copy at once; `reference`: the plain step's start."""

    device: int
    stage: int
    step: int
    release: int
    deadline: int
    reference: int
    ticks: int
    ops: tuple[Op, ...]
    durations: tuple[float, ...]
    lead: float = 0.0

    @property
    def shares(self) -> bool:
        """Whether it broadcasts preconditioned gradients (its stage's copies start their slots together)."""
        return any(op.kind is OpKind.BCAST_PREC for op in self.ops)

    @property
    def offsets(self) -> tuple[float, ...]:
        """Seconds from the slot's start to each op's start: its own ops from 0, its BCAST_PRECs from `lead`."""
        out, at = [], {False: 0.0, True: self.lead}
        for op, secs in zip(self.ops, self.durations):
            out.append(at[op.kind is OpKind.BCAST_PREC])
            at[op.kind is OpKind.BCAST_PREC] += secs
        return tuple(out)

    @property
    def seconds(self) -> float:
        """Seconds from the slot's start to its last op's end."""
        return max((a + d for a, d in zip(self.offsets, self.durations)), default=0.0)


@dataclass(frozen=True)
class Window:
    """k steps of one stage group (`build_window`) on a grid of `scale` ticks a second ([Note: time grid]: `at`
    rounds, `up` rounds up, `span` at least one tick); modulo its length, fixed[d] busy intervals, acts[d] (start,
    end, bytes)."""

    problem: Problem
    group: StageGroup
    k: int
    fused: frozenset[str]
    scale: float
    exact: bool
    stretch: int = 0
    stats_chunk: int = 1
    fixed: Mapping[int, tuple[Interval, ...]] = field(default_factory=dict)
    acts: Mapping[int, tuple[tuple[int, int, int], ...]] = field(default_factory=dict)
    tasks: tuple[Task, ...] = ()
    precs: tuple[PrecSlot, ...] = ()

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        """Each window step's start (0..k), the last the window's length ([Note: stretch])."""
        refresh, normal = self.at(self.steps[0].length), self.at(step_timeline(self.problem).length)
        return tuple(step_begins(refresh, normal, self.stretch, j, self.k) for j in range(self.k + 1))

    @cached_property
    def leads(self) -> tuple[int, ...]:
        """Ticks by which each window step may begin early ([Note: step barrier])."""
        steps, at = self.steps, self.at
        return tuple(
            at(st.length) - at(st.length - early_start(self.problem, st, self.group.devices))
            for st in steps[-1:] + steps[:-1]
        )

    @cached_property
    def capacity(self) -> dict[int, int | None]:
        """Bytes left per device over its static bytes (None: unlimited)."""
        budget = self.problem.memory_budget
        return {d: None if budget is None else budget - static_bytes(self.problem, d) for d in self.group.devices}

    @cached_property
    def _stream_use(self) -> tuple[int, ...]:
        """Per window step, when the first of the streamed stage's owners starts its last backward."""
        return tuple(o + self.at(stream_start(self.problem, st)) for o, st in zip(self.offsets, self.steps))

    def streamed_use(self, layer: str, u: int) -> int | None:
        """The tick by which a streamed layer's inverse is made for window step `u` to use it (else None)."""
        streaming = self.problem.streaming
        if streaming is None or layer not in streaming.layers:
            return None
        return self.length * (u // self.k) + self._stream_use[u % self.k]

    @property
    def length(self) -> int:
        return self.offsets[-1]

    def seconds(self, ticks: float) -> float:
        return ticks / self.scale

    def at(self, seconds: float) -> int:
        return round(seconds * self.scale)

    def up(self, seconds: float) -> int:
        return math.ceil(seconds * self.scale - 1e-6)

    def span(self, seconds: float) -> int:
        return max(1, self.up(seconds))

    def step_of(self, t: int) -> int:
        """The window step (0..2k-1) whose program holds an op starting at absolute tick t."""
        return next((j for j in range(2 * self.k - 1, 0, -1) if t >= self.step_start(j)), 0)

    def step_start(self, j: int) -> int:
        """Absolute tick at which window step j (0..2k) begins (on the whole group): its offset less its lead."""
        k = self.k
        return self.offsets[j % k] + self.offsets[k] * (j // k) - self.leads[j % k]

    @property
    def horizon(self) -> int:
        """The tick by which every task ends: the end of window step 2k-1."""
        return 2 * self.length - self.leads[0]

    def earliest(self, task: Task) -> int:
        return max(task.release, self.step_start(0))

    def slot(self, device: int, stage: int, step: int = 0) -> int:
        """The index in `precs` of stage's slot on `device` at window step `step` (the refresh step by default)."""
        return next(n for n, p in enumerate(self.precs) if (p.device, p.stage, p.step) == (device, stage, step))

    @cached_property
    def steps(self) -> tuple[Timeline, ...]:
        """The k steps' simulated timelines: step 0 the refresh step (grown by taps and fused curvature)."""
        normal = step_timeline(self.problem)
        return (step_timeline(self.problem, self.fused, refresh=True),) + (normal,) * (self.k - 1)

    def _wrap(self, j: int, start: float, end: float) -> list[Interval]:
        """[start, end) seconds of window step j, on the grid, modulo the window length."""
        return wrap(self.offsets[j] + self.at(start), self.offsets[j] + self.at(end), self.offsets[-1])

    def _device_work(self, device: int) -> tuple[tuple[Interval, ...], tuple[tuple[int, int, int], ...]]:
        """The device's busy ticks, merged (F/B, gradient all-reduces over copies, a streamed layer's APPLY on its
        helper and hand-off on its owner, every step's first tick), and its activations (start, end, bytes)."""
        problem, placed = self.problem, placed_w(self.problem)  # W's placed as tasks ([Note: placed W])
        busy: list[Interval] = []
        acts: list[tuple[int, int, int]] = []
        for j, st in enumerate(self.steps):
            for op, a, b in st.ops[device]:
                if (
                    op.kind in (OpKind.FWD, OpKind.BWD)
                    or (op.kind is OpKind.BWD_W and not placed)
                    or (op.kind is OpKind.ALLREDUCE_GRAD and len(problem.holders[op.stage_id]) > 1)
                    or (op.kind is OpKind.APPLY and is_streamed(problem, device, op))
                ):  # F/B, a collective (of no tick: an instant), a streamed layer's APPLY
                    busy += self._wrap(j, a, b)
                elif op.kind in STREAMED_TRANSFERS and op.layer is not None:  # the owner's hand-off; a message's CPU
                    layer = problem.costs.layer(op.layer)
                    own = {OpKind.SEND_LGRAD: layer.hand_off, OpKind.RECV_PGRAD: layer.take_back}.get(op.kind, 0.0)
                    work = own + problem.costs.message_cpu(op)  # a RECV's wait is idle; a bucket's fixed cost whole
                    busy += self._wrap(j, b - work, b) if work > 0 else []
            begin = self.step_start(j)
            busy += wrap(begin, begin + 1, self.offsets[-1])  # no task spans a boundary ([Note: step barrier])
            acts += [
                (s, e, n)
                for a, b, n in activation_intervals(problem, device, st, not placed)
                for s, e in self._wrap(j, a, b)
            ]
        return _merge(busy), tuple(acts)

    def _prec_slots(self) -> tuple[PrecSlot, ...]:
        """Every (device, stage, step)'s slot ([Note: gradient parts])."""
        problem, slots = self.problem, []
        lead = {
            s: max(
                sum(secs for op, secs in prec_work(problem, c, s) if op.kind is not OpKind.BCAST_PREC)
                for c in problem.holders[s]
            )
            for s in self.group.stages
        }
        for d in self.group.devices:
            for s in stages_on_device(problem, d):
                work = prec_work(problem, d, s)
                ops, durations = tuple(op for op, _ in work), tuple(secs for _, secs in work)
                lead_s = lead[s] if any(op.kind is OpKind.BCAST_PREC for op in ops) else 0.0
                seconds = PrecSlot(d, s, 0, 0, 0, 0, 0, ops, durations, lead_s).seconds
                for j, st in enumerate(self.steps):
                    release = self.offsets[j] + self.at(st.allreduce_end[d, s])
                    deadline = self.step_start(j + 1)  # APPLY ends before OPT_STEP ([Note: step barrier])
                    end = st.end_of(d, ops[-1]) if ops else st.allreduce_end[d, s]  # every layer streamed: no work
                    reference = max(release, self.offsets[j] + self.at(end - seconds))
                    # the reference's rounded ends, not its rounded-up length: the op after it starts at at(end)
                    ticks = min(max(1, self.at(end) - self.at(end - seconds)), deadline - release)
                    slots.append(PrecSlot(d, s, j, release, deadline, reference, ticks, ops, durations, lead_s))
        return tuple(slots)

    def _refresh_work(self, precs: tuple[PrecSlot, ...]) -> list[Task]:
        """The refresh's tasks: every deferred STATS, then per part its SYNC, DECOMP pieces and BCAST."""
        tasks = [task for s in self.group.stages for task in self._curv_tasks(s)]
        for s in self.group.stages:
            layers = self.problem.costs.stages[s].layers
            piece = max((p.decomp for x in layers for p in x.parts), default=0.0) / self.problem.decomp_pieces
            tasks += [task for x in layers for p in x.parts for task in self._refresh_tasks(s, x.name, p, piece, precs)]
        return tasks

    def _released_by(self, after: OpKind) -> OpKind:
        """The refresh step's fixed op kind whose end releases work on a capture taken `after` FWD or BWD: its maker
        (`capture_kind`), but B where W's are placed tasks, which precede that work (`w_makers`)."""
        made = capture_kind(self.problem.kind, after)
        return OpKind.BWD if made is OpKind.BWD_W and placed_w(self.problem) else made

    def _curv_tasks(self, stage: int) -> list[Task]:
        """Per copy of `stage` and F/B (or W) of the refresh step, STATS tasks of `stats_chunk` deferred (not fused)
        layers each, released by the op that makes their captures (`_released_by`)."""
        tasks, copies = [], self.problem.holders[stage]
        deferred = [x for x in self.problem.costs.stages[stage].layers if x.name not in self.fused]
        taken = {self._released_by(after): after for after in (OpKind.FWD, OpKind.BWD)}  # releasing op: its captures
        for d in copies:
            kept = [x for x in deferred if keeps_statistics(d, copies, self.problem.where(x.name))]
            for op, _, end in self.steps[0].fixed(d):
                after = taken.get(op.kind) if op.stage == stage else None  # the parts this op's end captures
                for side in dict.fromkeys(p.part for x in kept for p in x.parts if after and p.after is after):
                    for chunk in _chunks(kept, self.stats_chunk):
                        secs = tuple(x.part(side).stats for x in chunk)
                        ops = tuple(_stats_op(stage, op.mb, op.pipe, x.name, side) for x in chunk)
                        keep = sum(x.part(side).capture_bytes for x in chunk)
                        name = f"curv_{side}_s{stage}_m{op.mb}_p{op.pipe}_r{d}_{chunk[0].name}"
                        factors = tuple((x.name, side) for x in chunk)
                        span, release = self.span(sum(secs)), self.up(end)
                        tasks.append(
                            Task(name, TaskKind.CURV, stage, side, ops, secs, span, (d,), release, factors, keep)
                        )
        return tasks

    def _refresh_tasks(
        self, stage: int, layer: str, p: PartCost, piece: float, precs: tuple[PrecSlot, ...]
    ) -> list[Task]:
        """A part's refresh once its statistic is complete (`ready`): SYNC over the stage's copies (a captured part held
        more than once), DECOMP on its workers, BCAST to the others; `after_slot`: [Note: gradient parts].

        [Note: piece tasks] A decomposition is one INV task, or `Problem.decomp_pieces` DECOMP ops in as few tasks no
        longer than `piece` (the stage's longest decomposition's piece) as allows, dealt evenly and chained on one
        rank (`inv_chains`), as the runtime runs them."""
        problem, side, refresh = self.problem, p.part, self.steps[0]
        copies, workers, key = problem.holders[stage], problem.workers(layer), ((layer, p.part),)
        gradient = p.after is OpKind.ALLREDUCE_GRAD
        after_slot = gradient and not streamed_stats(problem, layer)  # a streamed one's: with the return
        ready = 0
        if gradient and not after_slot:
            ready = max(self.up(refresh.end_of(d, returned(problem, layer))) for d in copies)
        elif after_slot:
            ready = min(slot.release + slot.ticks for slot in precs if (slot.stage, slot.step) == (stage, 0))
        elif layer in self.fused:
            made = self._released_by(p.after)  # with the W; placed, its task ([Note: placed W])
            ready = max(
                self.up(e) for d in copies for op, _, e in refresh.fixed(d) if op.stage == stage and op.kind is made
            )

        def collective(kind: TaskKind, op: Op, devices: tuple[int, ...], release: int) -> Task:
            secs = problem.costs.collective_seconds(op, len(devices))
            return Task(
                f"{kind}_{side}_{layer}", kind, stage, side, (op,), (secs,), self.span(secs), devices, release, key
            )

        tasks = []
        if len(copies) > 1 and not gradient and not problem.where(layer).strategy.local_factors:
            tasks.append(collective(TaskKind.SYNC, Op(OpKind.SYNC_STATS, stage, layer=layer, part=side), copies, ready))
        pieces = problem.decomp_pieces
        share = p.decomp / pieces
        most = max(1, math.floor(piece / share + 1e-9)) if share > 0 else pieces  # pieces a task may hold
        for run in _chunks(range(pieces), most):
            name = f"inv_{side}_{layer}" if pieces == 1 else f"inv_{side}_{layer}_{run[0]}"
            ops = tuple(
                Op(OpKind.DECOMP, stage, layer=layer, part=side, piece=None if pieces == 1 else (i, pieces))
                for i in run
            )
            span, each = self.span(share * len(run)), (share,) * len(run)
            tasks.append(
                Task(name, TaskKind.INV, stage, side, ops, each, span, workers, ready, key, after_slot=after_slot)
            )
        if len(workers) > 1:
            group = None if workers == copies else workers
            op = Op(OpKind.BCAST, stage, layer=layer, part=side, root=workers[0], group=group)
            tasks.append(collective(TaskKind.BCAST, op, workers, 0))
        return tasks

    def _w_tasks(self) -> list[Task]:
        """The WGRAD task of every W of every window step ([Note: placed W]), a refresh step's with the fused parts it
        feeds as `factors`; per-layer W's are a task each where each spans a tick at home, else one task for all."""
        tasks = []
        for d in self.group.devices:
            for j, st in enumerate(self.steps):
                items = w_window(self.problem, st, d, self.fused if j == 0 else frozenset())
                for _, group in itertools.groupby(items, key=lambda item: (item[0].stage, item[0].mb, item[0].pipe)):
                    run = list(group)
                    whole = any(self.at(b) <= self.at(a) for _, a, b in run)
                    tasks += [self._w_task(d, j, w) for w in ([run] if whole else [[item] for item in run])]
        return tasks

    def _w_task(self, device: int, j: int, run: list[tuple[Op, float, float]]) -> Task:
        """The WGRAD task of the W's `run` back to back at home in window step j, from its B's end to its all-reduce."""
        ops, seconds = tuple(op for op, _, _ in run), tuple(b - a for _, a, b in run)
        start, end = run[0][1], run[-1][2]
        op, s, at, timeline = ops[0], ops[0].stage_id, self.at, self.steps[j].ops[device]
        b_op = Op(OpKind.BWD, op.stage, op.mb, op.pipe)
        release = self.offsets[j] + at(next(e for o, _, e in timeline if o == b_op))
        reduce = next(t for o, t, _ in timeline if o.kind is OpKind.ALLREDUCE_GRAD and o.stage == op.stage)
        shared = len(self.problem.holders[s]) > 1  # else a no-op all-reduce ([Note: placed W])
        due = self.offsets[j] + max(at(reduce), at(end)) if shared else self.offsets[j + 1]
        stage = self.problem.costs.stages[s]
        feeds = tuple(
            (x.name, p.part)
            for x in stage.layers
            if j == 0 and x.name in self.fused and any(w_makes(w, x.name) for w in ops)  # a per-layer W: its layer's
            for p in x.parts
            if p.after is OpKind.BWD
        )
        suffix = f"_{op.layer}" if len(ops) == 1 and op.layer else ""
        name = f"w_s{op.stage}_m{op.mb}_p{op.pipe}_r{device}_j{j}{suffix}"
        ticks, home = max(1, at(end) - at(start)), self.offsets[j] + at(start)
        keep = sum(w_operand_bytes(stage, w.layer) for w in ops)
        return Task(
            name, TaskKind.WGRAD, s, "", ops, seconds, ticks, (device,), release, feeds, keep, deadline=due, home=home
        )


def wrap(start: int, end: int, length: int) -> list[Interval]:
    """[start, end) taken modulo `length`, as pieces inside [0, length)."""
    if end - start >= length:
        return [(0, length)]
    s, e = start % length, start % length + (end - start)
    return [(s, e)] if e <= length else [(s, length), (0, e - length)]


def inv_chains(window: Window) -> list[list[int]]:
    """Per (layer, part), the indices of its INV tasks in piece order (one task when its decomposition is whole)."""
    chains: dict[tuple[str, str], list[int]] = {}
    for i, task in enumerate(window.tasks):
        if task.kind is TaskKind.INV:
            chains.setdefault(task.factors[0], []).append(i)
    return list(chains.values())


def warm_starts(window: Window) -> list[tuple[int, int]]:
    """Pairs (i, f): INV or BCAST task i is done (`done_by`) before the next refresh's first INV f of its layer, L
    later, starts from what i makes (`Problem.chains_refreshes`)."""
    if not window.problem.chains_refreshes:
        return []
    firsts: dict[str, list[int]] = {}
    for chain in inv_chains(window):
        firsts.setdefault(window.tasks[chain[0]].factors[0][0], []).append(chain[0])
    return [
        (i, f)
        for i, task in enumerate(window.tasks)
        if task.kind in (TaskKind.INV, TaskKind.BCAST)
        for f in firsts.get(task.factors[0][0], [])
    ]


def w_makers(window: Window) -> list[tuple[int, int]]:
    """Pairs (w, c): CURV task c reads an output-gradient capture that the refresh step's (home in step 0) W task w
    makes on its device, micro-batch and pipe (`w_makes`), so c starts once w ends ([Note: placed W])."""
    made: dict[tuple[int, int | None, int | None, int], list[tuple[int, Op]]] = {}
    for i, task in enumerate(window.tasks):
        if task.kind is TaskKind.WGRAD and task.home is not None and task.home < window.offsets[1]:
            for w in task.ops:
                made.setdefault((task.devices[0], w.stage, w.mb, w.pipe), []).append((i, w))
    if not made:
        return []
    pairs: dict[tuple[int, int], None] = {}
    stages = window.problem.costs.stages
    gradients = {(x.name, p.part) for s in stages for x in s.layers for p in x.parts if p.after is OpKind.BWD}
    for c, task in enumerate(window.tasks):
        if task.kind is not TaskKind.CURV or task.factors[0] not in gradients:
            continue
        for stats in task.ops:
            for i, w in made.get((task.devices[0], stats.stage, stats.mb, stats.pipe), []):
                if w_makes(w, stats.layer_name):
                    pairs[i, c] = None
    return list(pairs)


def done_by(task: Task) -> int:
    """Ticks after its start by which `task` is done for a warm start: an INV ends, a BCAST starts (in order)."""
    return task.ticks if task.kind is TaskKind.INV else 1


def free_gaps(busy: Iterable[Interval], length: int) -> list[Interval]:
    """The free [start, end) gaps of [0, length) between the `busy` intervals, in order."""
    gaps: list[Interval] = []
    at = 0
    for start, end in sorted(busy):
        if start > at:
            gaps.append((at, start))
        at = max(at, end)
    return gaps + [(at, length)] if at < length else gaps


def idle_regions(busy: Sequence[Interval], length: int) -> list[list[Interval]]:
    """A device's maximal idle spans in a window of `length` ticks, as pieces in [0, length) (two across its end)."""
    gaps = free_gaps(busy, length)
    if len(gaps) > 1 and gaps[0][0] == 0 and gaps[-1][1] == length:
        return [[gaps[-1], gaps[0]]] + [[g] for g in gaps[1:-1]]
    return [[g] for g in gaps]


def longest_gaps(window: Window) -> dict[int, int]:
    """Per device, the longest free stretch (ticks) between fixed work, cyclically, APPLY ignored."""
    regions = {d: idle_regions(busy, window.length) for d, busy in window.fixed.items()}
    return {d: max((sum(e - s for s, e in r) for r in rs), default=0) for d, rs in regions.items()}


def too_long(window: Window) -> list[str]:
    """Tasks longer than every bubble of their devices (no refresh period can place them)."""
    gaps = longest_gaps(window)
    out = []
    for task in window.tasks:
        room = max(gaps[d] for d in task.devices) if task.kind is TaskKind.INV else min(gaps[d] for d in task.devices)
        if task.ticks > room:
            out.append(
                f"{task.name} takes {window.seconds(task.ticks):.4g} s but the longest bubble on ranks "
                f"{list(task.devices)} is {window.seconds(room):.4g} s"
            )
    return out


def _merge(intervals: Iterable[Interval]) -> tuple[Interval, ...]:
    """The intervals merged, sorted; an instant (t, t) kept where no interval holds t inside."""
    out: list[list[int]] = []
    instants = []
    for s, e in sorted(intervals):
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
    durations it must hold exactly (a joint choice's options)."""
    refresh, normal = step_timeline(problem, fused, refresh=True), step_timeline(problem)
    costs, times = problem.costs, list(extra)
    for s in stages:
        times.append(costs.stages[s].prec)
        for x in costs.stages[s].layers:
            for p in x.parts:
                sync = Op(OpKind.SYNC_STATS, s, layer=x.name, part=p.part)
                bcast = Op(OpKind.BCAST, s, layer=x.name, part=p.part, root=0)
                n = len(problem.holders[s])
                times += [p.stats, p.decomp, costs.collective_seconds(sync, n), costs.collective_seconds(bcast, n)]
    for st, with_fused in ((refresh, fused), (normal, frozenset[str]())):
        times += [t for items in st.ops.values() for _, a, b in items for t in (a, b)]
        # the per-layer W's cut of each W's interval ([Note: per-layer W])
        times += [t for d in st.ops for _, a, b in w_window(problem, st, d, with_fused) for t in (a, b)]
    most = next((e for e in range(7) if normal.length * 10.0**e > 1e7), 7)
    e = whole_decimal((t for t in times if t > 0), most)
    return (10.0**e, True) if e is not None else (resolution / normal.length, False)


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
    """The window of `k` steps for `group` (step 0 the refresh step), each followed by `stretch` idle ticks; `scale`:
    a (ticks per second, exact) grid shared by several groups (else its own)."""
    if stretch < 0:
        raise AssertionError(f"negative stretch {stretch}")
    scale = scale if scale is not None else grid_scale(problem, group.stages, fused, resolution)
    w = Window(problem, group, k, fused, *scale, stretch, stats_chunk)
    work = {d: w._device_work(d) for d in group.devices}
    precs = w._prec_slots()
    tasks = (*w._refresh_work(precs), *w._w_tasks())
    return replace(
        w, fixed={d: x[0] for d, x in work.items()}, acts={d: x[1] for d, x in work.items()}, tasks=tasks, precs=precs
    )


@lru_cache(maxsize=1 << 16)
def _stats_op(stage: int, mb: int | None, pipe: int, layer: str, part: str) -> Op:
    """One micro-batch's STATS op, made (and checked) once for every window that places it."""
    return Op(OpKind.STATS, stage, mb, pipe, layer=layer, part=part)


def _chunks(items: Sequence[T], size: int) -> list[list[T]]:
    """`items` in consecutive runs of at most `size`, as even as their number allows (10 by 4: 3, 3, 4)."""
    n = len(items)
    runs = -(-n // size)
    bounds = [n * i // runs for i in range(runs + 1)] if runs else [0]
    return [list(items[a:b]) for a, b in zip(bounds, bounds[1:])]


# [Note: placed W] A zero-bubble schedule's W's (BWD_W) are `TaskKind.WGRAD` tasks on their rank, released at their
# B's end, due by their stage's ALLREDUCE_GRAD (with one copy, that no-op all-reduce: by the stage's slot), holding
# their operands (`w_operand_bytes`) until they end. First-fit puts each at its schedule position (`home`), which
# CP-SAT keeps while it searches period and stretch and frees only where that finds nothing. A fused layer's
# decomposition waits for its stage's refresh-step W's; a deferred STATS of an output gradient for the W making it
# (`w_makers`). W's are placed (`placed_w`) without streaming and with at most `MAX_W_TASKS` a window.


MAX_W_TASKS = 4096
"""The most W tasks (N x S x `Problem.max_period`, per layer for `w_by_layer`) for a problem to place W's: CP-SAT's
model grows with them (docs/ZERO_BUBBLE.md)."""


def placed_w(problem: Problem) -> bool:
    """Whether the problem's plans place its W's as tasks ([Note: placed W])."""
    few = problem.N * problem.num_stages * problem.max_period <= MAX_W_TASKS
    return problem.kind in ZERO_BUBBLE_KINDS and problem.streaming is None and few


def w_by_layer(problem: Problem) -> bool:
    """Whether placed W's are one per layer ([Note: per-layer W] in planner/problem/step_timeline.py): at most
    `MAX_W_TASKS` in the longest window (beyond it, one per stage)."""
    layers = sum(max(1, len(stage.layers)) for stage in problem.costs.stages)
    return placed_w(problem) and problem.N * layers * problem.max_period <= MAX_W_TASKS


def allreduce_after_w(problem: Problem, items: list[tuple[tuple[int, ...], Op]]) -> list[tuple[tuple[int, ...], Op]]:
    """One step's program items (sort key, op) with each one-copy stage's ALLREDUCE_GRAD keyed after its last placed
    W where that comes later: the runtime refuses an all-reduce while a W of its stage waits."""
    last: dict[int | None, tuple[int, ...]] = {}
    for key, op in items:
        if op.kind is OpKind.BWD_W:
            last[op.stage] = max(last.get(op.stage, key), key)
    out = []
    for key, op in items:
        if op.kind is OpKind.ALLREDUCE_GRAD and op.stage in last and len(problem.holders[op.stage_id]) == 1:
            key = max(key, (*last[op.stage][:3], 1 << 30))  # after the W's folds, which share its first 3 keys
        out.append((key, op))
    return out


def w_window(
    problem: Problem, step: Timeline, device: int, fused: frozenset[str] = frozenset()
) -> list[tuple[Op, float, float]]:
    """The device's W's of `step` that become tasks, with their home intervals (seconds), per layer where
    `w_by_layer` (`fused`: the layers whose curvature a refresh step's W's hold)."""
    if not placed_w(problem):
        return []
    ws = [(op, a, b) for op, a, b in step.fixed(device) if op.kind is OpKind.BWD_W]
    if not w_by_layer(problem):
        return ws
    return [item for op, a, b in ws for item in w_layer_ops(problem.costs.stages[op.stage_id], op, a, b, fused)]
