"""A refresh window of k steps on an integer time grid and the K-FAC tasks in it (built by planner/window_build.py;
their placements, once solved: planner/solution.py).

[Note: time grid] Times become integer ticks. When every op time and duration of the problem is a
whole number of 10^-e seconds (e <= 6, at most 10^7 ticks per step) the grid is exact; otherwise a
step is `SolverConfig.time_resolution` ticks, fixed times round to the nearest tick and task
durations round up, so a plan is off by at most one tick (`Window.tick` seconds) anywhere; the
validator allows that much. The collectives SYNC_STATS and BCAST last what the cost table's comm model
(`CostTable.collective_seconds`, planner/comm.py) says, and at least one tick on every member, so that even a
free one (no comm model, or a group of one) never falls inside another op; the gradient all-reduce's
interval of the step timeline is blocked where the stage has copies, and where it takes no tick (no comm model) the
instant, an empty interval (t, t) of `Window.fixed`, which no task or slot may span but either may end or start at
(one copy's all-reduce is a no-op, which nothing need keep clear). An APPLY slot spans its
reference position's rounded ends (`planner.window_build`), so the reference step fits its own grid.

[Note: stretch] With `Problem.max_overhead > 0` the planner may append `Window.stretch` idle ticks to
the end of every step of the window, on every device: the runtime ends each step with a global loss
all-reduce, so steps are synchronous and work placed there delays the next step on every rank. Step j
then starts at `offsets[j] = sum over i < j of (length of step i + stretch)`; the F/B work keeps its
times inside its step. Every stage group of a plan uses the same stretch (the step is one for all
ranks), on one time grid. The added step time (stretch, plus what fused curvature adds per step) is
at most `max_overhead` times the reference step; planner/stretch.py searches the least stretch.

[Note: step barrier] Under `StepBarrier.WORLD` every step ends with collectives over all ranks (the
KL-clip's <P, G> in OPT_STEP and the loss all-reduce), so step j+1 begins at `offsets[j+1]` on every device,
also on one whose first F/B comes later. An op placed in such a device's early bubble belongs to step j+1's
program (it runs after the barrier, while the device waits for its first input); APPLY of step j ends by
`offsets[j+1]` (before OPT_STEP); and the first tick of every step is blocked on every device, so no task
spans a boundary (it would hold the barrier up on every rank).
Under `StepBarrier.AGREEMENT_SET` (KL-clip scope stage or stale) OPT_STEP waits only for the rank's agreement
set, the devices of its stage group, so the group's step j+1 may begin `Window.leads[j+1]` ticks before
`offsets[j+1]`: once the last of its devices has ended step j's F/B, all-reduces and (reference) APPLY
(`planner.step_timeline.early_start`). The boundary, its blocked tick and APPLY's deadline move there; the idle
after it belongs to step j+1 and joins the device's idle before its first F/B of step j+1 (in WORLD the
boundary cut it in two). F/B keep their times: the planner does so only where a steady run without the world
barrier repeats the one-step timeline (`planner.step_timeline.steps_overlap`; else leads are 0, WORLD's step).
A task may run past the window's own end (the refresh step's world start) only in CP-SAT at k = 1 (planner/cpsat.py
`add_tasks`); at k >= 2 CP-SAT, and greedy always, keep each task inside [0, L), so there the joined idle is used at
the k-1 boundaries inside the window.

[Note: gradient parts] A part fed by the reduced gradient (`PartCost.after` ALLREDUCE_GRAD: Shampoo's and
SOAP's L and R) takes its statistic at *every* step, on every copy of its stage (each folds the same
reduced gradient, so there is no SYNC_STATS), after the stage's gradient all-reduce and before its APPLY
(which overwrites the gradient). That work is per step like APPLY, so it is modelled as APPLY is: the
stage's gradient STATS run back to back at the head of its APPLY slot (`PrecSlot.ops`: STATS of every
layer and part, then APPLY; the slot's ticks cover them all), which CP-SAT places inside [gradient ready,
step end), in the end-of-step bubble; the reference step (`planner.step_timeline.reference_programs`) runs them
right after the all-reduce, as it runs APPLY, so max_overhead is measured against a step that holds them.
A refresh snapshots the statistic at the refresh step's STATS, so the part's DECOMP task (and its BCAST)
is released by the refresh step's slot of its stage on the device that decomposes it (`Task.after_slot`:
a precedence on the slot's start in CP-SAT, the slot's reference place in greedy); it may run in any
later bubble, like K-FAC's deferred inversions. The snapshot the runtime keeps until DECOMP is, like
K-FAC's statistic sums in flight, not counted in memory; `LayerCost.state_bytes` (optimizer state held
for the whole run) is, in `planner.memory.static_bytes`. Layers mixing captured and gradient parts plan
each part by its own rule (not tuned for them, but correct). Known cost: where a device holds several
stages with copies (Chimera, interleaved with W > 1) the reference step runs the second stage's all-reduce right
after the first stage's slot; where that all-reduce takes time, CP-SAT may not move the slot across it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from fxkfac.planner.ir import Op, OpKind
from fxkfac.planner.problem import Problem, StageGroup

__all__ = [
    "TaskKind",
    "Task",
    "PrecSlot",
    "Window",
    "Grid",
    "wrap",
    "step_start_tick",
    "inv_chains",
    "warm_starts",
    "done_by",
    "longest_gaps",
    "too_long",
]

Interval = tuple[int, int]


class TaskKind(StrEnum):
    """What a window task does: CURV (statistics of captures, on its device after `release`: the end of its
    F/B), SYNC and BCAST (collectives on every device of the task at once), INV (a decomposition, on exactly
    one of the task's devices), WGRAD (a zero-bubble schedule's W, on its rank between its B and its stage's
    all-reduce: [Note: placed W] in planner/w_tasks.py)."""

    CURV = "curv"
    WGRAD = "wgrad"
    SYNC = "sync"
    INV = "inv"
    BCAST = "bcast"

    @property
    def collective(self) -> bool:
        """Whether the task runs on every one of its devices at once."""
        return self in (TaskKind.SYNC, TaskKind.BCAST)


@dataclass(frozen=True)
class Task:
    """One piece of K-FAC work: ops run back to back for `ticks` on one of `devices` (see `TaskKind`).

    `factors` are the (layer, side) pairs it serves; keep_bytes is held from `release` until the task ends
    (deferred). after_slot: an INV of a part fed by the reduced gradient, which starts after the refresh
    step's APPLY slot of its stage on the device that runs it ([Note: gradient parts]). deadline: the tick by which
    a WGRAD task ends; home: where the schedule runs it ([Note: placed W] in planner/w_tasks.py).
    """

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
    """The per-step preconditioner work of `stage` on `device` at window step `step` (`planner.step_timeline.prec_work`:
    gradient STATS, APPLY, BCAST_PREC): `ops` run for `durations` seconds within [release, deadline) (absolute
    ticks), back to back, except that the broadcasts of preconditioned gradients begin `lead` seconds after
    the slot starts, on every copy of the stage at once (`lead`: the longest work before them on any copy; the
    copies' slots start together); `reference` is where the plain K-FAC step puts them (right after the
    all-reduce)."""

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
        """Whether the slot broadcasts preconditioned gradients (its stage's copies start their slots together)."""
        return any(op.kind is OpKind.BCAST_PREC for op in self.ops)

    @property
    def offsets(self) -> tuple[float, ...]:
        """Seconds from the slot's start to each op's start."""
        out, t, shared = [], 0.0, self.lead
        for op, secs in zip(self.ops, self.durations):
            if op.kind is OpKind.BCAST_PREC:
                out.append(shared)
                shared += secs
            else:
                out.append(t)
                t += secs
        return tuple(out)

    @property
    def seconds(self) -> float:
        """Seconds from the slot's start to the end of its last op."""
        return max((a + d for a, d in zip(self.offsets, self.durations)), default=0.0)


@dataclass(frozen=True)
class Window:
    """k steps of the pipeline for one stage group, fixed work wrapped modulo the window length.

    fixed[d]: merged busy intervals of F/B in [0, length), and instants (t, t) no work may span; acts[d]:
    (start, end, bytes) activation pieces; capacity[d]: bytes left for activations and kept a/e (None:
    unlimited); offsets[j]: start of step j (offsets[k] == length); leads[j]: ticks by which step j begins
    before offsets[j] on the group's devices ([Note: step barrier]). Tasks of a refresh may run until 2*length
    (the next window's early bubbles): their occupation is taken modulo `length`. stretch: idle ticks appended to
    every step ([Note: stretch]); stats_chunk: at most this many consecutive layers per STATS task (1: a task a
    layer; `SolverConfig.stats_chunk`).
    """

    problem: Problem
    group: StageGroup
    k: int
    fused: frozenset[str]
    scale: float
    exact: bool
    offsets: tuple[int, ...]
    fixed: Mapping[int, tuple[Interval, ...]]
    acts: Mapping[int, tuple[tuple[int, int, int], ...]]
    capacity: Mapping[int, int | None]
    tasks: tuple[Task, ...]
    precs: tuple[PrecSlot, ...]
    leads: tuple[int, ...]
    stretch: int = 0
    stats_chunk: int = 1
    stream_use: tuple[int, ...] = ()
    """Per step of the window, the tick at which the streamed stage's owner starts its last backward (empty without
    streaming): a streamed layer's inverse must be made by then to reach its helper, which applies it during that
    backward (planner/streaming.py)."""

    def streamed_use(self, layer: str, u: int) -> int | None:
        """For a streamed layer, the tick by which its inverse must be made for window step `u` (0..2k) to use it:
        its owner's last backward's start there; None for any other layer (its stage's APPLY slot start)."""
        streaming = self.problem.streaming
        if streaming is None or layer not in streaming.layers:
            return None
        return self.length * (u // self.k) + self.stream_use[u % self.k]

    @property
    def length(self) -> int:
        """L, the window length in ticks."""
        return self.offsets[-1]

    @property
    def tick(self) -> float:
        """Seconds per tick."""
        return 1.0 / self.scale

    def seconds(self, ticks: float) -> float:
        """Ticks to seconds."""
        return ticks / self.scale

    def up(self, seconds: float) -> int:
        """`seconds` in whole ticks, rounded up as task durations are ([Note: time grid])."""
        return Grid(self.scale).up(seconds)

    def span(self, seconds: float) -> int:
        """The ticks of a task of `seconds`: rounded up, at least one ([Note: time grid])."""
        return Grid(self.scale).span(seconds)

    def step_of(self, device: int, t: int) -> int:
        """The window step (0..2k-1) whose program holds an op starting at absolute tick t on device: steps
        begin at their offsets less their leads ([Note: step barrier])."""
        for j in range(2 * self.k - 1, 0, -1):
            if t >= self.step_start(device, j):
                return j
        return 0

    def step_start(self, device: int, j: int) -> int:
        """Absolute tick at which window step j (0..2k) begins on `device` (the same on every device of the
        group)."""
        return step_start_tick(self.offsets, self.leads, j)

    @property
    def horizon(self) -> int:
        """The tick by which every task ends: the end of window step 2k-1 (the next window's last step)."""
        return 2 * self.length - self.leads[0]

    def earliest(self, task: Task, device: int) -> int:
        """The earliest start of `task` on `device`: its release, and not before the refresh step
        began there (so every op sits in a step of the refresh's own window)."""
        return max(task.release, self.step_start(device, 0))

    def refresh_slot(self, device: int, stage: int) -> int:
        """The index in `precs` of stage's APPLY slot on `device` at the refresh step (window step 0)."""
        return next(n for n, p in enumerate(self.precs) if (p.device, p.stage, p.step) == (device, stage, 0))


def wrap(start: int, end: int, length: int) -> list[Interval]:
    """[start, end) taken modulo `length`, as pieces inside [0, length)."""
    if end - start >= length:
        return [(0, length)]
    s, e = start % length, start % length + (end - start)
    return [(s, e)] if e <= length else [(s, length), (0, e - length)]


@dataclass
class Grid:
    """`scale` ticks per second ([Note: time grid]): fixed times round to the nearest tick, durations up."""

    scale: float

    def at(self, t: float) -> int:
        """A fixed time `t` (seconds) at its nearest tick."""
        return round(t * self.scale)

    def up(self, t: float) -> int:
        """`t` seconds in whole ticks, rounded up."""
        return math.ceil(t * self.scale - 1e-6)

    def span(self, d: float) -> int:
        """The ticks of a task of `d` seconds: rounded up, at least one."""
        return max(1, self.up(d))


def step_start_tick(offsets: Sequence[int], leads: Sequence[int], j: int) -> int:
    """Absolute tick at which window step j (0..2k) begins on a group's devices: its offset in its window, less its
    lead ([Note: step barrier])."""
    k = len(leads)
    return offsets[j % k] + offsets[k] * (j // k) - leads[j % k]


def inv_chains(window: Window) -> list[list[int]]:
    """Per (layer, part), the indices of its INV tasks in piece order (one task when its decomposition is whole)."""
    chains: dict[tuple[str, str], list[int]] = {}
    for i, task in enumerate(window.tasks):
        if task.kind is TaskKind.INV:
            chains.setdefault(task.factors[0], []).append(i)
    return list(chains.values())


def warm_starts(window: Window) -> list[tuple[int, int]]:
    """Pairs (i, f): INV or BCAST task i of a refresh is done (an INV ends, a BCAST starts: collectives keep their
    order) before the next refresh's first INV f of its layer starts, L later, because f starts from the
    preconditioner i makes (`Problem.chains_refreshes`)."""
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


def done_by(task: Task) -> int:
    """Ticks after its start by which `task` is done for a warm start that follows it (`warm_starts`)."""
    return task.ticks if task.kind is TaskKind.INV else 1


def longest_gaps(window: Window) -> dict[int, int]:
    """Per device, the longest free stretch (ticks) between fixed work, cyclically, APPLY ignored."""
    out = {}
    for d, busy in window.fixed.items():
        if not busy:
            out[d] = window.length
            continue
        gaps = [s2 - e1 for (_, e1), (s2, _) in zip(busy, busy[1:])]
        gaps.append(window.length - busy[-1][1] + busy[0][0])
        out[d] = max(gaps)
    return out


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
