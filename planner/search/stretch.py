"""Idle time appended to every step when bubbles are too short ([Note: stretch] in planner/plan/window.py).

The allowance says how many ticks a window of k steps may add per step; `restretch` moves a solution
to a longer stretch (so every stage group of a plan shares one); `stretch_lower_bound` is what any
placement needs, and `least_stretch` bisects the stretch at a refresh period with a solver's probe
(`bisect_least`, which the joint choice's least step runs too).
Feasibility only grows with the stretch (`restretch` turns a placement into one with more), which is
what makes the bisection exact.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass

from fxkfac.planner.plan.solution import GroupSolution, use_offsets
from fxkfac.planner.plan.window import TaskKind, Window
from fxkfac.planner.problem.problem import Problem, SolverConfig, StageGroup
from fxkfac.planner.problem.step_timeline import stretch_allowance
from fxkfac.planner.search.window_build import build_window, grid_scale

__all__ = ["Allowance", "allowance", "restretch", "stretch_lower_bound", "least_stretch", "bisect_least", "Probe"]

Probe = Callable[[int], tuple[str, GroupSolution | None]]
"""A solver at one stretch (ticks): (status name, solution or None); "INFEASIBLE" means proven."""


@dataclass(frozen=True)
class Allowance:
    """The stretch a problem allows: `ticks(k)` per step at refresh period k, on the grid `scale`
    shared by every stage group. `scale` None: stretching is off, and windows keep their groups' own
    grids (exactly the plans made without stretching)."""

    problem: Problem
    fused: frozenset[str]
    scale: tuple[float, bool] | None

    @property
    def enabled(self) -> bool:
        """Whether the step may stretch at all."""
        return self.scale is not None

    def ticks(self, k: int) -> int:
        """The most idle ticks per step at refresh period k (0 when off)."""
        if self.scale is None:
            return 0
        return max(0, math.floor(stretch_allowance(self.problem, self.fused, k) * self.scale[0] + 1e-6))

    def window(self, group: StageGroup, k: int, stretch: int, *, stats_chunk: int, resolution: int) -> Window:
        """The window of `group` at period k with `stretch` ticks per step on this allowance's grid."""
        return build_window(
            self.problem,
            group,
            k,
            self.fused,
            stats_chunk=stats_chunk,
            resolution=resolution,
            stretch=stretch,
            scale=self.scale,
        )

    def whole(self, group: StageGroup, k: int, *, stats_chunk: int, resolution: int) -> Window:
        """The window of `group` at period k with the whole allowance of stretch (`ticks(k)`): what a period search
        solves."""
        return self.window(group, k, self.ticks(k), stats_chunk=stats_chunk, resolution=resolution)


def allowance(problem: Problem, fused: frozenset[str], config: SolverConfig) -> Allowance:
    """The allowance of `problem` with `fused` layers: on when config.stretch and max_overhead > 0,
    on one grid for all stages (so that the groups' stretches are the same seconds)."""
    if not (config.stretch and problem.max_overhead > 0):
        return Allowance(problem, fused, None)
    return Allowance(problem, fused, grid_scale(problem, range(problem.num_stages), fused, config.time_resolution))


def restretch(solution: GroupSolution, stretch: int) -> GroupSolution:
    """The same placement in a window with `stretch` >= the solution's ticks per step: every start in
    window step j moves j * (added ticks) later, so each op keeps its place inside its step (an op in a
    step's idle tail stays at the head of the longer tail). Order, overlaps, memory and use offsets are
    unchanged, so a valid solution stays valid."""
    w = solution.window
    delta = stretch - w.stretch
    if delta == 0:
        return solution
    if delta < 0:
        raise AssertionError(f"restretch only lengthens: {w.stretch} -> {stretch}")
    new = build_window(
        w.problem, w.group, w.k, w.fused, stats_chunk=w.stats_chunk, stretch=stretch, scale=(w.scale, w.exact)
    )
    bounds = [w.step_start(w.group.devices[0], j) for j in range(2 * w.k + 1)]  # where each step begins

    def move(t: int) -> int:
        return t + max(0, bisect_right(bounds, t) - 1) * delta

    starts = tuple(move(t) for t in solution.starts)
    precs = tuple(move(t) for t in solution.prec_starts)
    return GroupSolution(
        new,
        starts,
        solution.devices,
        precs,
        use_offsets(new, starts, precs),
        solution.method,
        solution.status,
        solution.k_lower_bound,
        solution.wall_time,
    )


def _boundary_gaps(window: Window, device: int) -> tuple[int, int]:
    """(longest free stretch away from step boundaries, longest free stretch across one) of `device`
    in `window`; only the second grows with the stretch."""
    busy, L = window.fixed[device], window.length
    ends = [e for _, e in busy]
    across = 0
    bounds = [window.step_start(device, j) % L for j in range(window.k)]  # each blocked boundary tick
    for b in bounds:
        if any(s < b < e for s, e in busy):
            continue
        before = max((e for e in ends if e <= b), default=ends[-1] - L)
        after = min((s for s, _ in busy if s >= b), default=busy[0][0] + L)
        across = max(across, after - before)
    inside = 0
    for (_, e1), (s2, _) in zip(busy, busy[1:] + ((busy[0][0] + L, 0),)):
        if not any(e1 <= b <= s2 or e1 <= b + L <= s2 for b in bounds):
            inside = max(inside, s2 - e1)
    return inside, across


def stretch_lower_bound(window: Window) -> int:
    """Ticks per step any placement of `window`'s work needs (computed at the window's stretch, valid
    for every stretch): each task must fit one free stretch of its device(s), and all the work (tasks
    and APPLY) must fit the free time of the window's devices."""
    x, k, n = window.stretch, window.k, len(window.group.devices)
    gaps = {d: _boundary_gaps(window, d) for d in window.group.devices}
    need = 0
    for task in window.tasks:
        per_device = [0 if task.ticks <= gaps[d][0] else task.ticks - (gaps[d][1] - x) for d in task.devices]
        need = max(need, min(per_device) if task.kind is TaskKind.INV else max(per_device))
    work = sum(t.ticks * (len(t.devices) if t.kind.collective else 1) for t in window.tasks)
    work += sum(p.ticks for p in window.precs)
    free = n * window.length - sum(e - s for d in window.group.devices for s, e in window.fixed[d])
    return max(need, x + math.ceil((work - free) / (k * n)), 0)


def least_stretch(found: GroupSolution, probe: Probe, lower: int) -> tuple[GroupSolution, bool]:
    """Bisect the stretch in [lower, found's]: the solution with the least stretch `probe` finds, and
    whether it is proven least (every smaller stretch probed was INFEASIBLE or below `lower`)."""
    return bisect_least(max(0, lower), found, probe, lambda solution: solution.window.stretch)


def bisect_least(
    lower: int, found: GroupSolution, probe: Probe, size: Callable[[GroupSolution], int]
) -> tuple[GroupSolution, bool]:
    """The placement of least `size` (ticks of stretch, or of a whole step) `probe` finds in [lower, found's], by
    bisection (exact where feasibility only grows with the size), and whether it is proven least (every smaller size
    probed was INFEASIBLE)."""
    lo, hi, best, proven = lower, size(found), found, True
    while lo < hi:
        mid = (lo + hi) // 2
        status, solution = probe(mid)
        if solution is not None:
            hi, best = size(solution), solution
        else:
            proven = proven and status == "INFEASIBLE"
            lo = mid + 1
    return best, proven
