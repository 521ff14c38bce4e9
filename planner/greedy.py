"""The PipeFisher paper's greedy first-fit of K-FAC work into bubbles: the baseline and warm start.

As in pipe-fisher's `assign_workloads_to_bubbles` (notes/anchors.md §1): per device, tasks in
priority order (curvature A, curvature B, sync, inversion; broadcasts after their inversion) go into
the first gap between pipeline ops where `duration * 1.05` fits, after their dependencies; when
something does not fit the window grows by one pipeline step and everything is placed again. The
number of steps is the refresh period. Each stage's inversions go to its copies by a fixed partition,
longest first to the least loaded (the paper's round robin by layer where layers cost the same), APPLY stays
right after the gradient all-reduce, and memory is not considered (the paper's rule; the planner validates
the result). Where the problem allows a stretch ([Note: stretch] in planner/window.py), each k is tried with
the whole allowance and the least stretch first-fit still places everything with is then bisected (first-fit
is not monotone in the stretch, so that one is feasible, not proven least).
"""

from __future__ import annotations

import functools
import math
import time

from fxkfac.planner.budget import Budget
from fxkfac.planner.errors import PlanError
from fxkfac.planner.lowering import Assignment, assign_decompositions
from fxkfac.planner.packing_bound import group_lower_bound
from fxkfac.planner.preconditioners import words_of
from fxkfac.planner.problem import Problem, StageGroup
from fxkfac.planner.solution import GroupSolution, use_offsets
from fxkfac.planner.step_timeline import step_timeline
from fxkfac.planner.stretch import Allowance, least_stretch, stretch_lower_bound
from fxkfac.planner.window import Task, TaskKind, Window, done_by, warm_starts

__all__ = ["MARGIN", "greedy_group", "greedy_window", "greedy_overhead"]

MARGIN = 0.05
"""pipe-fisher's margin_ratio: a task needs duration * (1 + MARGIN) of free gap."""

_ORDER = {kind: n for n, kind in enumerate(TaskKind)}
"""Priority of a task kind (then a layer's parts in their order: K-FAC's curvature A, B, sync A, B, ...)."""


class _Gaps:
    """Free time of one device inside [0, length) as sorted [start, end) gaps."""

    def __init__(self, busy: tuple[tuple[int, int], ...], length: int) -> None:
        self.gaps: list[list[int]] = []
        cursor = 0
        for s, e in sorted(busy):
            if s > cursor:
                self.gaps.append([cursor, s])
            cursor = max(cursor, e)
        if cursor < length:
            self.gaps.append([cursor, length])

    def first_fit(self, earliest: int, need: int) -> int | None:
        """The earliest start >= `earliest` with `need` free ticks, or None."""
        for s, e in self.gaps:
            t = max(s, earliest)
            if t + need <= e:
                return t
        return None

    def occupy(self, start: int, ticks: int) -> None:
        """Mark [start, start + ticks) busy (it lies inside one gap)."""
        for i, (s, e) in enumerate(self.gaps):
            if s <= start and start + ticks <= e:
                pieces = [[s, start]] if start > s else []
                pieces += [[start + ticks, e]] if start + ticks < e else []
                self.gaps[i : i + 1] = pieces
                return
        raise AssertionError(f"[{start}, {start + ticks}) is not free")


def _fit_together(gaps: list[_Gaps], earliest: int, need: int) -> int | None:
    """The earliest start where every device in `gaps` has `need` free ticks at once."""
    t = earliest
    while True:
        fits = [g.first_fit(t, need) for g in gaps]
        starts = [s for s in fits if s is not None]
        if len(starts) < len(fits):
            return None
        latest = max(starts)
        if latest == t:
            return t
        t = latest


def _inv_devices(window: Window) -> dict[tuple[str, str], int]:
    """The device of each factor's decomposition: a stage's factors dealt over their grad workers longest first, each
    to the least loaded (`Assignment.LPT`). The paper deals its blocks round robin by layer, which is the same
    where every layer costs the same (its profiles' Transformer blocks); where they differ (an attention and a
    feed-forward, 16x its decomposition seconds) round robin by layer sent every feed-forward to one copy."""
    seconds: dict[tuple[str, str], float] = {}
    dealt: dict[tuple[int, tuple[int, ...]], list[tuple[str, str]]] = {}
    for task in window.tasks:
        if task.kind is TaskKind.INV:
            key = task.factors[0]
            if key not in seconds:
                dealt.setdefault((task.stage, task.devices), []).append(key)
            seconds[key] = seconds.get(key, 0.0) + sum(task.seconds)
    out: dict[tuple[str, str], int] = {}
    for (_, devices), factors in dealt.items():
        out |= assign_decompositions(factors, devices, Assignment.LPT, seconds)
    return out


def _slot_release(window: Window, task: Task, device: int) -> int:
    """For a decomposition of a gradient-fed part, the end of its stage's refresh-step APPLY slot on `device`
    (where greedy leaves it: the reference place); 0 for other tasks."""
    if not task.after_slot:
        return 0
    slot = window.precs[window.refresh_slot(device, task.stage)]
    return slot.reference + slot.ticks


def greedy_window(window: Window) -> GroupSolution | None:
    """Place every task of `window` first-fit in priority order; None when something does not fit."""
    gaps = {
        d: _Gaps(
            window.fixed[d]
            + tuple((p.reference, p.reference + p.ticks) for p in window.precs if p.device == d and p.ticks > 0),
            window.length,
        )
        for d in window.group.devices
    }
    rank = {
        p.part: j
        for s in window.group.stages
        for x in window.problem.costs.stages[s].layers
        for j, p in enumerate(x.parts)
    }
    starts, devices = [0] * len(window.tasks), [0] * len(window.tasks)
    done: dict[tuple[str, str], int] = {}  # factor -> end of its latest placed task
    for i, task in enumerate(window.tasks):  # the W's first, where the schedule runs them ([Note: placed W])
        if task.kind is TaskKind.WGRAD:
            assert task.home is not None and task.deadline is not None, "a W task has a home and a deadline"
            gap = gaps[task.devices[0]]
            start = (
                task.home
                if gap.first_fit(task.home, task.ticks) == task.home
                else gap.first_fit(task.release, task.ticks)
            )
            if start is None or start + task.ticks > task.deadline:
                return None
            gap.occupy(start, task.ticks)
            starts[i], devices[i] = start, task.devices[0]
            for f in task.factors:
                done[f] = max(done.get(f, 0), start + task.ticks)
    order = sorted(
        (i for i, task in enumerate(window.tasks) if task.kind is not TaskKind.WGRAD),
        key=lambda i: (_ORDER[window.tasks[i].kind], rank[window.tasks[i].side], window.tasks[i].release, i),
    )
    inv_device = _inv_devices(window)
    for i in order:
        task = window.tasks[i]
        key = task.factors[0]
        after = 0 if task.kind is TaskKind.CURV else max((done.get(f, 0) for f in task.factors), default=0)
        members = [inv_device[key]] if task.kind is TaskKind.INV else list(task.devices)
        earliest = max([after, _slot_release(window, task, members[0])] + [window.earliest(task, d) for d in members])
        need = math.ceil(task.ticks * (1 + MARGIN))
        start = _fit_together([gaps[d] for d in members], earliest, need)
        if start is None:
            return None
        for d in members:
            gaps[d].occupy(start, task.ticks)
        starts[i] = start
        devices[i] = members[0] if task.kind is not TaskKind.BCAST else inv_device[key]
        for f in task.factors:
            done[f] = max(done.get(f, 0), start + task.ticks)
    if any(starts[i] + done_by(window.tasks[i]) > starts[f] + window.length for i, f in warm_starts(window)):
        return None  # a refresh not made before the next one warm-starts from it
    precs = tuple(p.reference for p in window.precs)
    offsets = use_offsets(window, tuple(starts), precs)
    return GroupSolution(window, tuple(starts), tuple(devices), precs, offsets, "greedy", "FEASIBLE", 1)


def _first_fit(window: Window, meter: Budget | None) -> GroupSolution | None:
    """`greedy_window`, its work charged to `meter` (by the window's size: [Note: deterministic budget])."""
    if meter is not None:
        meter.charge_greedy(len(window.tasks) + len(window.precs))
    return greedy_window(window)


def greedy_group(
    problem: Problem,
    group: StageGroup,
    fused: frozenset[str] = frozenset(),
    *,
    stats_chunk: int = 1,
    resolution: int = 100_000,
    min_k: int = 1,
    allowance: Allowance | None = None,
    meter: Budget | None = None,
) -> GroupSolution:
    """The paper's rule for one stage group: the smallest k >= min_k (up to problem.max_period) where
    first-fit places everything, with the whole `allowance` of stretch, then the least stretch found;
    each placement tried is charged to `meter`. Periods below the group's lower bound (`group_lower_bound`,
    kept as the solution's `k_lower_bound`) have no placement and are not tried. Raises PlanError when no k
    does (a task longer than every bubble)."""
    began = time.perf_counter()
    allowance = allowance if allowance is not None else Allowance(problem, fused, None)

    @functools.cache
    def window_at(k: int) -> Window:
        return allowance.whole(group, k, stats_chunk=stats_chunk, resolution=resolution)

    lower = group_lower_bound(allowance, group, window_at, min_k)
    for k in range(lower, problem.max_period + 1):
        cap = allowance.ticks(k)
        window = window_at(k)
        solution = _first_fit(window, meter)
        if solution is not None:
            if cap > 0:
                solution = _least_stretch(
                    solution, stretch_lower_bound(window), allowance, stats_chunk, resolution, meter
                )
            return GroupSolution(
                solution.window,
                solution.starts,
                solution.devices,
                solution.prec_starts,
                solution.use_offset,
                "greedy",
                "FEASIBLE",
                lower,
                time.perf_counter() - began,
            )
    raise PlanError(
        f"the greedy rule cannot place the {words_of(problem.costs).name} work of stages {list(group.stages)} within "
        f"{problem.max_period} steps: some curvature or inversion is longer than every bubble; "
        "raise max_period or max_overhead, split the layer, or allow fused curvature"
    )


def _least_stretch(
    found: GroupSolution, lower: int, allowance: Allowance, stats_chunk: int, resolution: int, meter: Budget | None
) -> GroupSolution:
    """Bisect with first-fit between `lower` and found's stretch (the least one it finds)."""
    w = found.window

    def probe(stretch: int) -> tuple[str, GroupSolution | None]:
        solution = _first_fit(
            allowance.window(w.group, w.k, stretch, stats_chunk=stats_chunk, resolution=resolution), meter
        )
        return ("FEASIBLE", solution) if solution is not None else ("UNKNOWN", None)

    return least_stretch(found, probe, lower)[0]


def greedy_overhead(
    problem: Problem,
    group: StageGroup,
    allowance: Allowance,
    *,
    stats_chunk: int = 1,
    resolution: int = 100_000,
    limit: float = 10.0,
    meter: Budget | None = None,
) -> tuple[int, GroupSolution | None]:
    """The stretch the group's work needs at the longest refresh period (problem.max_period), whatever
    max_overhead says: (ticks any plan needs, the first-fit solution with the least stretch found, or
    None when no stretch up to `limit` reference steps places it). For errors that tell the user what
    max_overhead to ask for; `allowance` gives the grid (its own ticks are not used)."""
    scale = allowance.scale
    if scale is None:
        raise AssertionError("greedy_overhead needs an allowance with a grid")
    k = problem.max_period
    most = math.floor(limit * step_timeline(problem).length * scale[0])

    def window(ticks: int) -> Window:
        return allowance.window(group, k, ticks, stats_chunk=stats_chunk, resolution=resolution)

    lower = stretch_lower_bound(window(0))
    failed, ticks = lower - 1, lower
    while ticks <= most:
        found = _first_fit(window(ticks), meter)
        if found is not None:
            return lower, _least_stretch(found, failed + 1, allowance, stats_chunk, resolution, meter)
        failed, ticks = ticks, max(ticks + 1, math.ceil(ticks * 1.25))
    return lower, None
