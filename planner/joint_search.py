"""The joint choice's search over one stage group ([Note: joint strategy] in planner/joint.py): the least refresh
period first (`planner.group_search.least_period`: down from first-fit's placement of the candidates, which is kept
when CP-SAT finds none better), with the whole stretch allowance, then the least step, then the least staleness;
each probe a joint window model of planner/joint_cpsat.py."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from fxkfac.planner.budget import Budget
from fxkfac.planner.greedy import greedy_window
from fxkfac.planner.group_search import least_period
from fxkfac.planner.joint import JointPlacement, reference_step, reference_ticks, window_at
from fxkfac.planner.joint_cpsat import Frame, energy_bound, placed_tasks, solve_window
from fxkfac.planner.joint_step import ns, options_of
from fxkfac.planner.packing_bound import window_work
from fxkfac.planner.problem import Problem, SolverConfig, StageGroup, copies_of_stage
from fxkfac.planner.solution import GroupSolution, fits_memory
from fxkfac.planner.step_timeline import step_timeline
from fxkfac.planner.stretch import bisect_least, stretch_lower_bound
from fxkfac.planner.window import TaskKind, Window, too_long

__all__ = ["solve_joint_group"]

log = logging.getLogger(__name__)

Cap = Callable[[int], int]
"""The stretch (ticks per step) a window of k steps may have."""


def _as_joint(solution: GroupSolution) -> JointPlacement:
    """A placement of the anchor problem's own window (first-fit's) as a joint placement of its distributions."""
    w = solution.window
    choices = {x.name: w.problem.where(x.name) for s in w.group.stages for x in w.problem.costs.stages[s].layers}
    starts = {task.name: t for task, t in zip(w.tasks, solution.starts)}
    inv_devices = {task.factors[0]: d for task, d in zip(w.tasks, solution.devices) if task.kind is TaskKind.INV}
    return JointPlacement(
        w,
        choices,
        starts,
        inv_devices,
        solution.prec_starts,
        {p.stage: p.ticks for p in w.precs},
        "GREEDY",
        sum(solution.use_offset.values()),
    )


def _lower_k(w: Window) -> int:
    """The least refresh period any option set allows: the curvature and decompositions (the same under every
    option) over the free time one step leaves the group's devices beside F/B and all-reduces."""
    work = window_work(w)
    free = sum(w.length - sum(e - s for s, e in w.fixed[d]) for d in w.group.devices) // w.k
    return max(1, math.ceil(work / free)) if free > 0 else w.problem.max_period + 1


@dataclass(frozen=True)
class _Group:
    """One group's joint search: the anchor problem (whose distributions stay on the stages not free), the
    problems whose first-fit placements are warm starts and fallbacks (the anchor's, then each forced strategy's on
    the group's free layers), the options, the grid and the most ticks a step of k steps may last."""

    anchor: Problem
    group: StageGroup
    candidates: tuple[tuple[Problem, int], ...]
    """Each with its reference step in ticks (`planner.joint.reference_step`, which needs no simulation)."""
    frame: Frame
    cap: Cap

    def window(self, k: int, step: int) -> Window:
        """The anchor's window at period k with steps of `step` ticks (never shorter than its reference)."""
        w = window_at(self.anchor, self.group, k, step, self.frame.scale, stats_chunk=self.frame.stats_chunk)
        assert w is not None, "a joint step is never below the anchor's reference (the least one)"
        return w

    @property
    def base(self) -> int:
        """The anchor's reference step in ticks: the least step of any option set."""
        return reference_ticks(self.anchor, self.frame.scale)

    def most(self, k: int) -> int:
        """The longest step the window of k steps may have: the reference and the whole stretch allowance."""
        return self.base + self.cap(k)

    def first_fit(self, k: int, step: int, meter: Budget) -> JointPlacement | None:
        """First-fit of each candidate's distributions at period k with steps of `step` ticks: the first that places
        within the budget, as a joint placement."""
        for problem, reference in self.candidates:
            if reference > step:
                continue
            w = window_at(problem, self.group, k, step, self.frame.scale, stats_chunk=self.frame.stats_chunk)
            if w is None:
                continue
            meter.charge_greedy(len(w.tasks) + len(w.precs))
            solution = greedy_window(w)
            if solution is not None and fits_memory(solution):
                return _as_joint(solution)
        return None


def solve_joint_group(
    anchor: Problem,
    group: StageGroup,
    free: frozenset[int],
    candidates: Sequence[Problem],
    scale: tuple[float, bool],
    cap: Cap,
    config: SolverConfig,
    time_limit: float,
    meter: Budget,
    *,
    stats_chunk: int,
) -> JointPlacement | None:
    """The group's layer distributions and placement at the least refresh period with the whole stretch `cap(k)`,
    then the least step, then the least staleness, within `time_limit` of `meter`'s clock. `anchor` has the least
    reference step (`least_step`) and keeps its distributions on the stages not `free`; first-fit of `candidates`
    (the anchor, then other distributions of the group's free layers) warm-starts the search and is kept where
    CP-SAT finds nothing better in time. None when nothing places it."""
    began = meter.now()
    timeline = step_timeline(anchor)
    release = {s: ns(timeline.allreduce_end[copies_of_stage(anchor, s)[0], s]) for s in group.stages}
    frame = Frame(
        {x.name: options_of(anchor, x.name, s in free) for s in group.stages for x in anchor.costs.stages[s].layers},
        release,
        scale,
        stats_chunk,
    )
    ticks = [round(reference_step(anchor, free, dict(c.distributions)) * scale[0]) for c in candidates]
    g = _Group(anchor, group, ((anchor, reference_ticks(anchor, scale)), *zip(candidates, ticks)), frame, cap)
    if too_long(g.window(2, g.most(anchor.max_period))):
        return None
    lower = _lower_k(g.window(1, g.most(1)))
    fallback = next((f for k in range(lower, anchor.max_period + 1) if (f := g.first_fit(k, g.most(k), meter))), None)

    def probe(k: int, share: float) -> tuple[str, JointPlacement | None]:
        w = g.window(k, g.most(k))
        status, found = solve_window(w, frame, config, share, meter, None, optimize=False)
        log.info("joint stages %s k=%d step=%d ticks: %s", list(group.stages), k, w.offsets[1], status)
        return status, found

    def left(fraction: float) -> float:
        return fraction * time_limit - (meter.now() - began)

    found, proven = least_period(probe, left, lower, anchor.max_period, fallback)
    if found is None:
        return None
    if found.step_ticks > g.base:
        found = _least_step(g, found, config, meter, began + time_limit)
    best = _least_stale(g, found, config, meter, left(1.0))
    return replace(best, k_lower_bound=proven)


def _least_step(
    g: _Group, found: JointPlacement, config: SolverConfig, meter: Budget, deadline: float
) -> JointPlacement:
    """The shortest step at found's k: first-fit of the candidates bisected first (cheap per probe, but each builds
    a window per candidate: at most half the time left), then CP-SAT feasibility probes below it, spending at most
    three quarters of the time left then."""
    k = found.window.k
    energy = energy_bound(g.window(k, found.step_ticks), g.frame, g.base, config, meter, (deadline - meter.now()) / 8)
    lower = max(g.base + _least_stretch_bound(g.window(k, g.base), g.frame), energy)
    cheap_until = meter.now() + (deadline - meter.now()) / 2

    def cheap(step: int) -> tuple[str, JointPlacement | None]:
        return "UNKNOWN", (g.first_fit(k, step, meter) if meter.now() < cheap_until else None)

    best = bisect_least(lower, found, cheap, _step_ticks)[0]
    until = meter.now() + (deadline - meter.now()) * 3 / 4

    def probe(step: int) -> tuple[str, JointPlacement | None]:
        left = until - meter.now()
        if left <= 0:
            return "UNKNOWN", None
        return solve_window(
            g.window(k, step),
            g.frame,
            config,
            left / max(1, math.ceil(math.log2(step - lower + 2))),
            meter,
            None,
            optimize=False,
        )

    if lower < best.step_ticks:  # the energy bound is often the answer (pure data parallelism): tried first
        _, at_bound = solve_window(
            g.window(k, lower), g.frame, config, (until - meter.now()) / 3, meter, None, optimize=False
        )
        best = at_bound or bisect_least(lower + 1, best, probe, _step_ticks)[0]
    log.info("joint stages %s k=%d: least step %d ticks", list(g.group.stages), k, best.step_ticks)
    return best


def _least_stretch_bound(w: Window, frame: Frame) -> int:
    """Stretch ticks any option set needs at w's k (`planner.stretch.stretch_lower_bound` of the work every option
    has: curvature, SYNC_STATS, decompositions on any rank an option allows; slots and broadcasts as nothing)."""
    return stretch_lower_bound(
        replace(w, tasks=placed_tasks(w, frame.options), precs=tuple(replace(p, ticks=0) for p in w.precs))
    )


def _least_stale(g: _Group, found: JointPlacement, config: SolverConfig, meter: Budget, left: float) -> JointPlacement:
    """Least staleness at found's k and step, warm-started by `found` (kept when the solver does worse)."""
    hint = found if config.use_greedy_hint or found.status != "GREEDY" else None
    status, best = solve_window(
        g.window(found.window.k, found.step_ticks), g.frame, config, left, meter, hint, optimize=True
    )
    if best is None or found.staleness < best.staleness:
        return found
    return replace(best, status="OPTIMAL" if status == "OPTIMAL" else "FEASIBLE")


def _step_ticks(placement: JointPlacement) -> int:
    return placement.step_ticks
