"""A lower bound on a group's refresh period that counts the idle time no whole task fits in.

`planner.step_timeline.refresh_lower_bound` pours the refresh's work into the bubbles like a fluid. Tasks are
not fluid: a statistic or a decomposition piece runs whole, inside one bubble, so a 20 ms bubble takes one
12.8 ms statistic and loses the rest when no shorter task exists. Here every bubble of a window holds at most
the longest sum of task lengths that fits in it (`Packer`), the per-step APPLY slots taken where they leave the
most of that, and a period whose bubbles cannot hold its refresh's work that way has no placement. On the
PipeFisher paper's BERT-Base Chimera D=4 profiles this raises the bound from 7 to 8 steps.

A collective (the statistics' all-reduce, a decomposition's broadcast) holds every device it runs on at once, so it
counts as one task of its length on each of them (issue 38: on the README snippet's 2 x 2 mesh the statistics'
all-reduces are 70% of the refresh's device time; without them the bound read 3 5 where CP-SAT proves 9 14).

Every simplification enlarges what a window may hold, so the bound stays valid: releases, memory and the
collectives' simultaneity are ignored, tasks may go to any device of the group, and a task may repeat without
limit.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Sequence

from fxkfac.planner.problem import StageGroup
from fxkfac.planner.step_timeline import refresh_lower_bound
from fxkfac.planner.stretch import Allowance
from fxkfac.planner.window import Interval, PrecSlot, Task, TaskKind, Window, wrap

__all__ = [
    "Packer",
    "idle_regions",
    "window_capacity",
    "window_work",
    "device_loads",
    "packing_lower_bound",
    "group_lower_bound",
]

UNITS_PER_STEP = 2000
"""The packing table's resolution: a step of the window is this many of its units (task lengths round down to
them, bubble lengths up, so the table only over-counts what fits)."""

MAX_CHOICES = 4096
"""The most placements of the APPLY slots that share bubbles one bound tries; beyond it those bubbles count their
idle time less the slots' (still an upper bound)."""


class Packer:
    """The most ticks of tasks (lengths `sizes`, each usable any number of times) that fit in a bubble."""

    def __init__(self, sizes: Iterable[int], unit: int) -> None:
        if unit < 1:
            raise ValueError(f"a packing unit is at least one tick, got {unit}")
        self.unit = unit
        by_weight: dict[int, int] = {}
        for size in sizes:
            if size > 0:
                weight = size // unit
                by_weight[weight] = max(by_weight.get(weight, 0), size)
        self.free = 0 in by_weight
        """Some task is shorter than a unit: every bubble counts as full."""
        self.items = sorted(by_weight.items())
        self._best = [0]

    def packable(self, length: int) -> int:
        """An upper bound on the ticks of whole tasks that fit in `length` ticks (exact when task lengths are
        whole units)."""
        if length <= 0 or not self.items:
            return 0
        if self.free:
            return length
        units = -(-length // self.unit)
        best = self._best
        while len(best) <= units:
            n = len(best)
            best.append(max([best[n - 1]] + [best[n - w] + v for w, v in self.items if w <= n]))
        return min(length, best[units])


def idle_regions(fixed: Sequence[Interval], length: int) -> list[list[Interval]]:
    """The maximal idle spans of a device over a window of `length` ticks, each as its pieces in [0, length):
    one piece, or two where a span runs over the window's end into its start (tasks wrap modulo the window)."""
    gaps: list[Interval] = []
    at = 0
    for start, end in sorted(fixed):
        if start > at:
            gaps.append((at, start))
        at = max(at, end)
    if at < length:
        gaps.append((at, length))
    if len(gaps) > 1 and gaps[0][0] == 0 and gaps[-1][1] == length:
        return [[gaps[-1], gaps[0]]] + [[g] for g in gaps[1:-1]]
    return [[g] for g in gaps]


def _span(region: Sequence[Interval]) -> int:
    return sum(end - start for start, end in region)


def _meets(region: Sequence[Interval], allowed: Sequence[Interval]) -> bool:
    return any(a < d and c < b for a, b in region for c, d in allowed)


def _device_capacity(window: Window, device: int, packer: Packer) -> int:
    """The most task ticks the device's bubbles may hold, its APPLY slots placed where they cost the least."""
    homes = tuple(  # W's where the schedule runs them: the bound is of the search, which keeps them there
        wrap(t.home, t.home + t.ticks, window.length)[0]
        for t in window.tasks
        if t.kind is TaskKind.WGRAD and t.home is not None and t.devices[0] == device
    )
    regions = idle_regions(window.fixed[device] + homes, window.length)
    slots = [s for s in window.precs if s.device == device and s.ticks > 0]
    candidates = [
        [i for i, r in enumerate(regions) if _span(r) >= slot.ticks and _meets(r, _allowed(slot, window.length))]
        for slot in slots
    ]
    total, seen = 0, set()
    for component in _components(candidates):
        members = {i for j in component for i in candidates[j]}
        seen |= members
        chosen = [slots[j] for j in component], [candidates[j] for j in component]
        total += _best_placement(regions, members, *chosen, packer)
    return total + sum(packer.packable(_span(r)) for i, r in enumerate(regions) if i not in seen)


def _allowed(slot: PrecSlot, length: int) -> list[Interval]:
    return wrap(slot.release, max(slot.deadline, slot.release + slot.ticks), length)


def _components(candidates: Sequence[Sequence[int]]) -> list[list[int]]:
    """The slots in groups that share no candidate bubble with another group."""
    groups: list[tuple[set[int], list[int]]] = []
    for j, regions in enumerate(candidates):
        joined = [g for g in groups if g[0] & set(regions)]
        merged = (set(regions).union(*(g[0] for g in joined)), [x for g in joined for x in g[1]] + [j])
        groups = [g for g in groups if g not in joined] + [merged]
    return sorted(sorted(slots) for _, slots in groups)


def _best_placement(
    regions: Sequence[Sequence[Interval]],
    members: set[int],
    slots: Sequence[PrecSlot],
    candidates: Sequence[Sequence[int]],
    packer: Packer,
) -> int:
    """The most task ticks of the bubbles `members` with `slots` each in one of its candidates (a slot set flush
    against its bubble's end leaves one piece, which holds at least what any split of it holds)."""
    spans = {i: _span(regions[i]) for i in members}
    loose = min(
        sum(packer.packable(s) for s in spans.values()),
        sum(spans.values()) - sum(s.ticks for s in slots),
    )
    if not all(candidates) or math.prod(len(c) for c in candidates) > MAX_CHOICES:
        return max(0, loose)
    best = 0
    for choice in itertools.product(*candidates):
        load = dict.fromkeys(members, 0)
        for slot, i in zip(slots, choice):
            load[i] += slot.ticks
        if all(load[i] <= spans[i] for i in members):
            best = max(best, sum(packer.packable(spans[i] - load[i]) for i in members))
    return best


def _bubble_tasks(window: Window) -> list[Task]:
    """The refresh's computations that bubbles must hold: its statistics and decomposition pieces."""
    return [t for t in window.tasks if t.kind in (TaskKind.CURV, TaskKind.INV)]


def window_work(window: Window) -> int:
    """Ticks of the refresh's computations that bubbles must hold (`_bubble_tasks`), the same under every
    distribution of a layer."""
    return sum(t.ticks for t in _bubble_tasks(window))


def device_loads(window: Window) -> list[int]:
    """The ticks each task holds a device for: a computation one, a collective one on each of its devices (a W none:
    it holds its place, `_device_capacity`)."""
    return [
        t.ticks
        for t in window.tasks
        if t.kind is not TaskKind.WGRAD
        for _ in (t.devices if t.kind.collective else (0,))
    ]


def window_capacity(window: Window, packer: Packer) -> int:
    """The most of that work the window's bubbles may hold, over every device of the group."""
    return sum(_device_capacity(window, d, packer) for d in window.group.devices)


def packing_lower_bound(window_at: Callable[[int], Window], lower: int, top: int) -> int:
    """The least refresh period from `lower` to `top` whose window (`window_at(k)`, the one a search solves) may
    hold its refresh's computations whole, and all its tasks with them (`device_loads`: collectives on each of
    their devices; each a necessary condition, counted apart: short collectives would let the bubbles count as
    full to the computations); `top + 1` when none may. No period from `lower` below it has a placement in its
    window."""
    packers: tuple[Packer, Packer] | None = None
    for k in range(lower, top + 1):
        window = window_at(k)
        loads = device_loads(window)
        if packers is None:
            unit = max(1, window.offsets[1] // UNITS_PER_STEP)
            packers = Packer((t.ticks for t in _bubble_tasks(window)), unit), Packer(loads, unit)
        computations, every = packers
        if window_work(window) <= window_capacity(window, computations) and sum(loads) <= window_capacity(
            window, every
        ):
            return k
    return top + 1


def group_lower_bound(
    allowance: Allowance, group: StageGroup, window_at: Callable[[int], Window], min_k: int = 1
) -> int:
    """The least refresh period `group` may have in `window_at`'s windows: the fluid bound (`refresh_lower_bound` of
    the allowance's problem and fused layers, at least `min_k`) raised by whole tasks (`packing_lower_bound`);
    max_period + 1 when no period up to it may hold the work."""
    problem = allowance.problem
    fluid = max(min_k, refresh_lower_bound(problem, group, allowance.fused, stretch=allowance.enabled))
    return packing_lower_bound(window_at, fluid, problem.max_period)
