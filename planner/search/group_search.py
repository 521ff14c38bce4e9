"""One stage group's plan: the least refresh period, then the least stretch, then the least staleness.

`least_period` is the period search of the one window model (planner/search/cpsat.py), with a group's distributions
fixed or chosen with the placement (`solve_joint_group`, [Note: joint strategy] in planner/search/cpsat.py: the least
period, then the least step, then the least staleness); `least_group_period` runs it with the distributions fixed, from
the lower bounds (planner/problem/step_timeline.py, planner/search/greedy.py) and first-fit's placement
(planner/search/greedy.py), within a share of the planner's clock (`planner.search.budget.Budget`); `refine_group` then
lowers the stretch and the staleness at that period. `solve` runs the first for every group before the second for any
(planner/search/attempt.py `_solve_groups`): refresh periods come first in how plans rank (`planner.plan.rank`).
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from fxkfac.planner.plan.solution import GroupSolution, fits_memory
from fxkfac.planner.plan.window import Window, too_long
from fxkfac.planner.problem.problem import Problem, SolverConfig, StageGroup, copies_of_stage
from fxkfac.planner.problem.step_timeline import step_timeline
from fxkfac.planner.search.budget import Budget
from fxkfac.planner.search.cpsat import (
    Frame,
    energy_bound,
    ns,
    options_of,
    placed_tasks,
    reference_step,
    reference_ticks,
    solve_window,
    window_at,
)
from fxkfac.planner.search.greedy import (
    Allowance,
    bisect_least,
    greedy_window,
    group_lower_bound,
    least_stretch,
    restretch,
    stretch_lower_bound,
    window_work,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Period:
    """A group's first pass (`least_group_period`): the least refresh period found (`found`, at the whole allowance
    of stretch), the least period not proven infeasible, first-fit's placement where it fits the memory budget, and
    the wall seconds the search took."""

    found: GroupSolution
    proven: int
    fallback: GroupSolution | None
    wall_s: float


def least_group_period(
    problem: Problem,
    group: StageGroup,
    fused: frozenset[str],
    config: SolverConfig,
    time_limit: float,
    meter: Budget,
    greedy: GroupSolution | None = None,
    *,
    stats_chunk: int = 1,
    min_k: int = 1,
    allowance: Allowance | None = None,
) -> Period | None:
    """The smallest refresh period >= min_k for `group` (from the lower bounds: `refresh_lower_bound`, then
    `packing_lower_bound`; never above greedy's) with the whole `allowance` of stretch, within `time_limit` of
    `meter`'s clock. None when no k up to max_period is found feasible in time (and no greedy). With a greedy
    plan the search descends from it ([Note: descending refresh search])."""
    began, wall = meter.now(), time.perf_counter()
    allowance = allowance if allowance is not None else Allowance(problem, fused, None)
    if greedy is not None and greedy.window.k < min_k:
        greedy = None
    fallback = greedy if greedy is not None and fits_memory(greedy) else None

    @functools.cache
    def window_at(k: int) -> Window:  # built once for the packing bound and the probe at the same k
        return allowance.whole(group, k, stats_chunk=stats_chunk, resolution=config.time_resolution)

    lower = group_lower_bound(allowance, group, window_at, min_k)

    def probe(k: int, share: float) -> tuple[str, GroupSolution | None]:
        hint = restretch(greedy, allowance.ticks(k)) if greedy is not None and greedy.window.k == k else None
        w = hint.window if hint is not None else window_at(k)
        status, found = solve_window(w, config, share, meter, hint if config.use_greedy_hint else None, optimize=False)
        log.info("stages %s k=%d stretch=%d: %s", list(group.stages), k, w.stretch, status)
        return status, found

    def left(fraction: float = 1.0) -> float:
        return fraction * time_limit - (meter.now() - began)

    found, proven = least_period(probe, left, lower, problem.max_period, fallback)
    return None if found is None else Period(found, proven, fallback, time.perf_counter() - wall)


def refine_group(
    period: Period, allowance: Allowance, config: SolverConfig, time_limit: float, meter: Budget
) -> GroupSolution | None:
    """The second pass at the period found: the least stretch, then the least staleness, within `time_limit` of
    `meter`'s clock; None when neither that placement nor first-fit's fits the memory budget."""
    began, wall = meter.now(), time.perf_counter()
    found, least = period.found, True
    if found.window.stretch > 0:
        found, least = _least_stretch(found, allowance, config, meter, began + time_limit)
    left = time_limit - (meter.now() - began)
    proven = least and period.proven == found.window.k
    best = within_budget(_least_stale(found, found.window, config, meter, left, proven), found, period.fallback)
    seconds = period.wall_s + time.perf_counter() - wall
    return None if best is None else _finish(best, best.status, period.proven, seconds)


def within_budget(*solutions: GroupSolution | None) -> GroupSolution | None:
    """The first of `solutions` that fits the memory budget with its third decompositions counted
    (`solution.remade_spans`, which CP-SAT's model does not count): after least staleness, CP-SAT's last, the one
    found before it, first-fit's; None when none does."""
    return next((s for s in solutions if s is not None and fits_memory(s)), None)


Probe = Callable[[int, float], tuple[str, GroupSolution | None]]
"""Solve a group's window at refresh period k within a share of the clock: (CP-SAT status, placement or None)."""
Left = Callable[[float], float]
"""The clock a search has left, of the given fraction of its time (1: all of it)."""


def least_period(
    probe: Probe, left: Left, lower: int, top: int, incumbent: GroupSolution | None
) -> tuple[GroupSolution | None, int]:
    """The least refresh period found feasible from `lower` (a lower bound) to `top`, and the least period not
    proven infeasible. Without an `incumbent` (first-fit's placement) the search climbs from `lower`; with one
    it climbs while each k is proven infeasible (cheap proofs, in a quarter of the time), then descends from
    the incumbent's period ([Note: descending refresh search]); one above `lower`, it only descends (the climb's
    one probe would be the descent's first, in a quarter of its time)."""
    if incumbent is None:
        return _ascend(probe, left, lower, top)
    if incumbent.window.k - lower <= 1:  # the climb would probe the one k the descent probes first
        return _descend(probe, left, lower, incumbent)
    proven, found = _climb(probe, left, PROOF_SHARE, lower, incumbent.window.k)
    if found is not None:
        return found, proven
    return _descend(probe, left, proven, incumbent)


PROOF_SHARE = 0.25
"""The part of a group's time the climb that proves small periods infeasible may take."""


def _ascend(probe: Probe, left: Left, lower: int, top: int) -> tuple[GroupSolution | None, int]:
    """The first k from `lower` up to `top` found feasible, each k given its share of the time left (an
    undecided small k must not take the time of the larger ones), and the least k not proven infeasible."""
    proven = lower
    for k in range(lower, top + 1):
        if left(1.0) <= 0:
            break
        status, found = probe(k, left(1.0) / (top - k + 1))
        if status == "INFEASIBLE" and proven == k:
            proven = k + 1
        if found is not None:
            return found, proven
    return None, proven


DESCENT_SHARE = 0.75
"""The part of a group's time the descent below first-fit's period may take; the rest minimizes staleness."""


def _descend(probe: Probe, left: Left, lower: int, incumbent: GroupSolution) -> tuple[GroupSolution, int]:
    """From the incumbent's k down: each k one less than the last found feasible, until one is not found; where
    that k is proven infeasible, the ks below it are checked from `lower` up, and all infeasible prove the found
    k least.

    [Note: descending refresh search]
    Near the least feasible k a window is tight and CP-SAT may need long to decide it; far above it a placement
    is found at once. Climbing from the lower bound spends the time on the undecidable ks and may end at
    first-fit's k (BERT-Base Chimera D=4 on the paper's profiles, stale scope, 4 pieces: 8 11 11 8 in 10 s,
    greedy 9 11 11 9, bound 7); descending from first-fit's plan keeps an incumbent and spends the time improving
    it (8 10 10 8). A k proven least needs every smaller k proven infeasible: the climb first proves what it can
    cheaply (it stops at the first k it cannot decide), and where the descent proves a k infeasible, the ks
    between the climb's last and that one are checked.
    """
    best, proven = incumbent, lower
    for k in range(incumbent.window.k - 1, lower - 1, -1):
        if left(DESCENT_SHARE) <= 0:
            break
        status, found = probe(k, left(DESCENT_SHARE))
        if found is not None:
            best = found
            continue
        if status == "INFEASIBLE" and _climb(probe, left, DESCENT_SHARE, lower, k)[0] == k:
            proven = k + 1
        break
    if best.window.k == lower:
        proven = lower
    return best, proven


def _climb(probe: Probe, left: Left, share: float, lower: int, top: int) -> tuple[int, GroupSolution | None]:
    """Up from `lower` below `top` while each period is proven infeasible, within `share` of the time: the first
    period not proven infeasible (`top` when all below it are), and its placement where one was found there."""
    for k in range(lower, top):
        if left(share) <= 0:
            return k, None
        status, found = probe(k, left(share) / (top - k))
        if found is not None or status != "INFEASIBLE":
            return k, found
    return top, None


def refine_stretch(
    found: GroupSolution, allowance: Allowance, config: SolverConfig, meter: Budget, time_limit: float
) -> tuple[GroupSolution, bool]:
    """The least stretch at found's k (bisected, CP-SAT feasibility, within `time_limit` of `meter`'s
    clock), and whether it is proven least; `allowance` gives the grid (for errors that say what
    max_overhead to ask for)."""
    return _least_stretch(found, allowance, config, meter, meter.now() + 2 * time_limit)


def _least_stretch(
    found: GroupSolution, allowance: Allowance, config: SolverConfig, meter: Budget, deadline: float
) -> tuple[GroupSolution, bool]:
    """Bisect the least stretch at found's k, spending at most half the time left (to `deadline` on
    `meter`'s clock) on the probes."""
    w = found.window
    until = meter.now() + (deadline - meter.now()) / 2

    def probe(stretch: int) -> tuple[str, GroupSolution | None]:
        window = allowance.window(w.group, w.k, stretch, stats_chunk=w.stats_chunk, resolution=config.time_resolution)
        if too_long(window):
            return "INFEASIBLE", None
        left = until - meter.now()
        if left <= 0:
            return "UNKNOWN", None
        return solve_window(window, config, left / max(1, math.ceil(math.log2(stretch + 2))), meter, optimize=False)

    best, least = least_stretch(found, probe, stretch_lower_bound(w))
    log.info(
        "stages %s k=%d: least stretch %d ticks (%s)",
        list(w.group.stages),
        w.k,
        best.window.stretch,
        "proven" if least else "not proven",
    )
    return best, least


def _least_stale(
    found: GroupSolution,
    w: Window,
    config: SolverConfig,
    meter: Budget,
    left: float,
    proven: bool,
    frame: Frame | None = None,
) -> GroupSolution:
    """Minimize staleness in `w`, the window of found's k and step (with `frame`, choosing the distributions too),
    within `left` of `meter`'s clock, warm-started by `found` (kept when the solver does worse); its status says
    whether it is proven optimal: the least staleness where the k and step are `proven` least. Nothing stale: no
    solve (its answer is found's)."""
    if found.staleness == 0:
        return replace(found, status="OPTIMAL" if proven else "FEASIBLE")
    hint = found if config.use_greedy_hint or found.method != "greedy" else None
    status, best = solve_window(w, config, left, meter, hint, frame=frame)
    if best is None or found.staleness < best.staleness:
        best = found
    optimal = proven and (status == "OPTIMAL" or best.staleness == 0)
    return replace(best, status="OPTIMAL" if optimal else "FEASIBLE")


def _finish(solution: GroupSolution, status: str, proven: int, wall_s: float) -> GroupSolution:
    """The group's solution with its status, proven lower bound on k and the wall seconds its search took."""
    return replace(solution, status=status, k_lower_bound=proven, wall_time=wall_s)


Cap = Callable[[int], int]
"""The stretch (ticks per step) a window of k steps may have."""


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
    """Each with its reference step in ticks (`planner.search.cpsat.reference_step`, which needs no simulation)."""
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

    def first_fit(self, k: int, step: int, meter: Budget) -> GroupSolution | None:
        """First-fit of each candidate's distributions at period k with steps of `step` ticks: the first that places
        within the budget."""
        for problem, reference in self.candidates:
            if reference > step:
                continue
            w = window_at(problem, self.group, k, step, self.frame.scale, stats_chunk=self.frame.stats_chunk)
            if w is None:
                continue
            solution = greedy_window(w, meter)
            if solution is not None and fits_memory(solution):
                return solution
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
) -> GroupSolution | None:
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

    def probe(k: int, share: float) -> tuple[str, GroupSolution | None]:
        w = g.window(k, g.most(k))
        status, found = solve_window(w, config, share, meter, optimize=False, frame=frame)
        log.info("joint stages %s k=%d step=%d ticks: %s", list(group.stages), k, w.offsets[1], status)
        return status, found

    def left(fraction: float) -> float:
        return fraction * time_limit - (meter.now() - began)

    found, proven = least_period(probe, left, lower, anchor.max_period, fallback)
    if found is None:
        return None
    if found.step_ticks > g.base:
        found = _least_step(g, found, config, meter, began + time_limit)
    best = _least_stale(
        found, g.window(found.window.k, found.step_ticks), config, meter, left(1.0), proven == found.window.k, g.frame
    )
    return replace(best, k_lower_bound=proven)


def _least_step(g: _Group, found: GroupSolution, config: SolverConfig, meter: Budget, deadline: float) -> GroupSolution:
    """The shortest step at found's k: first-fit of the candidates bisected first (cheap per probe, but each builds
    a window per candidate: at most half the time left), then CP-SAT feasibility probes below it, spending at most
    three quarters of the time left then."""
    k = found.window.k
    energy = energy_bound(g.window(k, found.step_ticks), g.frame, g.base, config, meter, (deadline - meter.now()) / 8)
    lower = max(g.base + _least_stretch_bound(g.window(k, g.base), g.frame), energy)
    cheap_until = meter.now() + (deadline - meter.now()) / 2

    def cheap(step: int) -> tuple[str, GroupSolution | None]:
        return "UNKNOWN", (g.first_fit(k, step, meter) if meter.now() < cheap_until else None)

    best = bisect_least(lower, found, cheap, _step_ticks)[0]
    until = meter.now() + (deadline - meter.now()) * 3 / 4

    def probe(step: int) -> tuple[str, GroupSolution | None]:
        left = until - meter.now()
        if left <= 0:
            return "UNKNOWN", None
        share = left / max(1, math.ceil(math.log2(step - lower + 2)))
        return solve_window(g.window(k, step), config, share, meter, optimize=False, frame=g.frame)

    if lower < best.step_ticks:  # the energy bound is often the answer (pure data parallelism): tried first
        share = (until - meter.now()) / 3
        _, at_bound = solve_window(g.window(k, lower), config, share, meter, optimize=False, frame=g.frame)
        best = at_bound or bisect_least(lower + 1, best, probe, _step_ticks)[0]
    log.info("joint stages %s k=%d: least step %d ticks", list(g.group.stages), k, best.step_ticks)
    return best


def _least_stretch_bound(w: Window, frame: Frame) -> int:
    """Stretch ticks any option set needs at w's k (`planner.search.greedy.stretch_lower_bound` of the work every option
    has: curvature, SYNC_STATS, decompositions on any rank an option allows; slots and broadcasts as nothing)."""
    return stretch_lower_bound(
        replace(w, tasks=placed_tasks(w, frame.options), precs=tuple(replace(p, ticks=0) for p in w.precs))
    )


def _step_ticks(placement: GroupSolution) -> int:
    return placement.step_ticks
