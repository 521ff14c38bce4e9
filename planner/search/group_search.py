"""One stage group's placement: the least refresh period, then the least stretch (or step), then the least staleness,
with the distributions fixed (`least_group_period` for every group, as periods rank first, then `refine_group`) or
chosen with the placement (`joint_placements`, [Note: joint strategy] in planner/search/cpsat.py)."""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from fxkfac.planner.plan.solution import GroupSolution, fits_memory
from fxkfac.planner.plan.window import Window, too_long
from fxkfac.planner.problem.problem import Problem, SolverConfig, StageGroup, stage_groups
from fxkfac.planner.search.budget import Budget
from fxkfac.planner.search.cpsat import (
    Options,
    Solved,
    energy_bound,
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
    first_fits,
    greedy_window,
    group_lower_bound,
    restretch,
    stretch_lower_bound,
    window_work,
)

log = logging.getLogger(__name__)

PeriodProbe = Callable[[int, float], Solved]
"""Solve a group's window at refresh period k within a share of the clock: (CP-SAT status, placement or None)."""
Left = Callable[[float], float]
"""The clock a search has left, of the given fraction of its time (1: all of it)."""


def _clock(meter: Budget, time_limit: float) -> Left:
    """What is left of `time_limit` on `meter`'s clock from now, of a fraction of it."""
    began = meter.now()
    return lambda fraction: fraction * time_limit - (meter.now() - began)


@dataclass(frozen=True)
class Period:
    """A group's first pass: the least period found (whole stretch allowance), the least not proven infeasible,
    first-fit's placement where it fits the memory budget, and the wall seconds spent."""

    found: GroupSolution
    proven: int
    fallback: GroupSolution | None
    wall_s: float


def least_group_period(
    allowance: Allowance,
    group: StageGroup,
    config: SolverConfig,
    time_limit: float,
    meter: Budget,
    greedy: GroupSolution | None = None,
    *,
    stats_chunk: int = 1,
    min_k: int = 1,
) -> Period | None:
    """The least refresh period >= min_k of `group` with the whole stretch allowance (from its lower bounds, descending
    from first-fit's `greedy`) within `time_limit` of `meter`'s clock; None when none is found in time."""
    left, wall = _clock(meter, time_limit), time.perf_counter()
    if greedy is not None and greedy.window.k < min_k:
        greedy = None
    fallback = greedy if greedy is not None and fits_memory(greedy) else None

    @functools.cache
    def window_of(k: int) -> Window:  # built once for the packing bound and the probe at the same k
        return allowance.window(group, k, stats_chunk=stats_chunk, resolution=config.time_resolution)

    lower = group_lower_bound(allowance, group, window_of, min_k)

    def probe(k: int, share: float) -> Solved:
        hint = restretch(greedy, allowance.ticks(k)) if greedy is not None and greedy.window.k == k else None
        w = hint.window if hint is not None else window_of(k)
        status, found = solve_window(w, config, share, meter, hint, optimize=False, options=own_options(w))
        log.info("stages %s k=%d stretch=%d: %s", list(group.stages), k, w.stretch, status)
        return status, found

    found, proven = least_period(probe, left, lower, allowance.problem.max_period, fallback)
    return None if found is None else Period(found, proven, fallback, time.perf_counter() - wall)


def refine_group(
    period: Period, allowance: Allowance, config: SolverConfig, time_limit: float, meter: Budget
) -> GroupSolution | None:
    """The least stretch, then the least staleness, at the period found within `time_limit` of `meter`'s clock; None
    when neither that placement nor first-fit's fits the memory budget."""
    began, wall = meter.now(), time.perf_counter()
    found, least = period.found, True
    if found.window.stretch > 0:
        found, least = least_stretch_at(found, allowance, config, meter, began + time_limit)
    left = time_limit - (meter.now() - began)
    proven = least and period.proven == found.window.k
    stale = _least_stale(found, found.window, config, meter, left, proven, own_options(found.window))
    best = within_budget(stale, found, period.fallback)
    if best is None:
        return None
    return replace(best, k_lower_bound=period.proven, wall_time=period.wall_s + time.perf_counter() - wall)


def own_options(w: Window) -> Options:
    """Each layer of w's group with its problem's own distribution as its one option (the forced strategy)."""
    return options_of(w.problem, w.group.stages, ())


def within_budget(*solutions: GroupSolution | None) -> GroupSolution | None:
    """The first of `solutions` within the memory budget with third decompositions counted (CP-SAT's model does not)."""
    return next((s for s in solutions if s is not None and fits_memory(s)), None)


def least_period(
    probe: PeriodProbe, left: Left, lower: int, top: int, incumbent: GroupSolution | None
) -> tuple[GroupSolution | None, int]:
    """The least period found feasible in [`lower`, `top`] and the least not proven infeasible: climbing from `lower`;
    with first-fit's `incumbent`, climbing while each k is proven infeasible (within PROOF_SHARE of the time), then
    descending from its k ([Note: descending refresh search])."""
    if incumbent is None:
        return _climb(probe, left, 1.0, lower, top + 1, give_up=False)
    if incumbent.window.k - lower <= 1:  # the climb would probe the one k the descent probes first
        return _descend(probe, left, lower, incumbent)
    found, proven = _climb(probe, left, PROOF_SHARE, lower, incumbent.window.k)
    if found is not None:
        return found, proven
    return _descend(probe, left, proven, incumbent)


PROOF_SHARE = 0.25
"""The part of a group's time the climb that proves small periods infeasible may take."""
DESCENT_SHARE = 0.75
"""The part of a group's time the descent below first-fit's period may take; the rest minimizes staleness."""


def _climb(
    probe: PeriodProbe, left: Left, share: float, lower: int, end: int, *, give_up: bool = True
) -> tuple[GroupSolution | None, int]:
    """The first k in [`lower`, `end`) found feasible, each an equal part of `share` of the time left among the ks to
    go, and the least k not proven infeasible; `give_up`: stop at a k not proven infeasible."""
    proven = lower
    for k in range(lower, end):
        if left(share) <= 0:
            break
        status, found = probe(k, left(share) / (end - k))
        if status == "INFEASIBLE" and proven == k:
            proven = k + 1
        if found is not None or (give_up and status != "INFEASIBLE"):
            return found, proven
    return None, proven


def _descend(probe: PeriodProbe, left: Left, lower: int, incumbent: GroupSolution) -> tuple[GroupSolution, int]:
    """From the incumbent's k down until one is not found; where that one is proven infeasible, the ks below it are
    checked from `lower` up, all infeasible proving the found k least.

    [Note: descending refresh search] Near the least feasible k a window is tight and CP-SAT may need long to decide
    it; far above it a placement is found at once. Climbing from the bound spends the time on undecidable ks and may
    end at first-fit's k; descending keeps an incumbent and spends the time improving it.
    """
    best, proven = incumbent, lower
    for k in range(incumbent.window.k - 1, lower - 1, -1):
        if left(DESCENT_SHARE) <= 0:
            break
        status, found = probe(k, left(DESCENT_SHARE))
        if found is not None:
            best = found
            continue
        if status == "INFEASIBLE" and _climb(probe, left, DESCENT_SHARE, lower, k)[1] == k:
            proven = k + 1
        break
    if best.window.k == lower:
        proven = lower
    return best, proven


def least_stretch_at(
    found: GroupSolution, allowance: Allowance, config: SolverConfig, meter: Budget, deadline: float
) -> tuple[GroupSolution, bool]:
    """The least stretch at found's k by CP-SAT feasibility probes in half the time to `deadline`, and whether it is
    proven least."""
    w = found.window
    until = meter.now() + (deadline - meter.now()) / 2

    def probe(stretch: int) -> Solved:
        window = allowance.window(w.group, w.k, stretch, stats_chunk=w.stats_chunk, resolution=config.time_resolution)
        if too_long(window):
            return "INFEASIBLE", None
        left = until - meter.now()
        if left <= 0:
            return "UNKNOWN", None
        share = left / max(1, math.ceil(math.log2(stretch + 2)))
        return solve_window(window, config, share, meter, optimize=False, options=own_options(window))

    best, least = bisect_least(stretch_lower_bound(w), found, probe)
    proof = "proven" if least else "not proven"
    log.info("stages %s k=%d: least stretch %d ticks (%s)", list(w.group.stages), w.k, best.window.stretch, proof)
    return best, least


def _least_stale(
    found: GroupSolution,
    w: Window,
    config: SolverConfig,
    meter: Budget,
    left: float,
    proven: bool,
    options: Options,
) -> GroupSolution:
    """The least staleness in `w` (with each layer's `options`) within `left`, warm-started by `found`
    (kept where the solver does worse); OPTIMAL where proven and found's k and step are `proven`."""
    if found.staleness == 0:
        return replace(found, status="OPTIMAL" if proven else "FEASIBLE")
    status, best = solve_window(w, config, left, meter, found, options=options)
    if best is None or found.staleness < best.staleness:
        best = found
    optimal = proven and (status == "OPTIMAL" or best.staleness == 0)
    return replace(best, status="OPTIMAL" if optimal else "FEASIBLE")


@dataclass(frozen=True)
class _Group:
    """One group's joint search: the anchor problem and every layer's options, the problems whose first-fit warm-starts
    it (the anchor first, each with its reference step in ticks), the grid, the STATS chunk and the stretch cap by k."""

    anchor: Problem
    group: StageGroup
    options: Options
    candidates: tuple[tuple[Problem, int], ...]
    scale: tuple[float, bool]
    stats_chunk: int
    cap: Callable[[int], int]

    def window(self, k: int, step: int) -> Window:
        """The anchor's window at period k with steps of `step` ticks."""
        w = window_at(self.anchor, self.group, k, step, self.scale, stats_chunk=self.stats_chunk)
        assert w is not None, "a joint step is never below the anchor's reference (the least one)"
        return w

    def probe(self, k: int, step: int, config: SolverConfig, share: float, meter: Budget) -> Solved:
        """A feasibility probe of the anchor's window at period k with steps of `step` ticks."""
        return solve_window(self.window(k, step), config, share, meter, optimize=False, options=self.options)

    @property
    def base(self) -> int:
        """The anchor's reference step in ticks: the least step of any option set."""
        return self.candidates[0][1]

    def most(self, k: int) -> int:
        """The longest step a window of k steps may have."""
        return self.base + self.cap(k)

    def first_fit(self, k: int, step: int, meter: Budget) -> GroupSolution | None:
        """First-fit of the candidates at period k and `step` ticks: the first within the memory budget."""
        for problem, reference in self.candidates:
            if reference > step:
                continue
            w = window_at(problem, self.group, k, step, self.scale, stats_chunk=self.stats_chunk)
            solution = None if w is None else greedy_window(w, meter)
            if solution is not None and fits_memory(solution):
                return solution
        return None


def joint_placements(
    anchor: Problem,
    free: frozenset[int],
    forced: Sequence[Problem],
    scale: tuple[float, bool],
    allowed: Allowance,
    chunk_of: Callable[[StageGroup], int],
    config: SolverConfig,
    meter: Budget,
    deadline: float,
) -> list[GroupSolution] | None:
    """Each group's distributions and placement (`_joint_group`) on the grid `scale`, warm-started by first-fit of each
    `forced` strategy on its free layers, the time to `deadline` shared by the groups left; None when one is not placed.
    `anchor` has the least reference step and keeps its distributions on the stages not `free`."""
    groups = stage_groups(anchor)
    placements = []
    for n, group in enumerate(groups):
        names = [x.name for s in group.stages if s in free for x in anchor.costs.stages[s].layers]
        candidates = [
            anchor.with_distributions({**dict(anchor.distributions), **{m: f.where(m) for m in names}}) for f in forced
        ]
        ticks = [round(reference_step(anchor, free, dict(c.distributions)) * scale[0]) for c in candidates]
        first = ((anchor, reference_ticks(anchor, scale)), *zip(candidates, ticks))
        g = _Group(anchor, group, options_of(anchor, group.stages, free), first, scale, chunk_of(group), allowed.ticks)
        placement = _joint_group(g, config, max(0.0, deadline - meter.now()) / (len(groups) - n), meter)
        if placement is None:
            log.info("joint choice: stages %s not placed", list(group.stages))
            return None
        placements.append(placement)
    return placements


def _joint_group(g: _Group, config: SolverConfig, time_limit: float, meter: Budget) -> GroupSolution | None:
    """The least period with the whole stretch `g.cap(k)`, then the least step and staleness within `time_limit`;
    first-fit of the candidates warm-starts it, kept where CP-SAT finds nothing better (None: nothing places it)."""
    began, left, anchor = meter.now(), _clock(meter, time_limit), g.anchor
    if too_long(g.window(2, g.most(anchor.max_period))):
        return None
    lower = _lower_k(g.window(1, g.most(1)))
    fallback = next((f for k in range(lower, anchor.max_period + 1) if (f := g.first_fit(k, g.most(k), meter))), None)

    def probe(k: int, share: float) -> Solved:
        w = g.window(k, g.most(k))
        status, found = solve_window(w, config, share, meter, optimize=False, options=g.options)
        log.info("joint stages %s k=%d step=%d ticks: %s", list(g.group.stages), k, w.offsets[1], status)
        return status, found

    found, proven = least_period(probe, left, lower, anchor.max_period, fallback)
    if found is None:
        return None
    if found.step_ticks > g.base:
        found = _least_step(g, found, config, meter, began + time_limit)
    w = g.window(found.window.k, found.step_ticks)
    best = _least_stale(found, w, config, meter, left(1.0), proven == found.window.k, g.options)
    return replace(best, k_lower_bound=proven)


def _lower_k(w: Window) -> int:
    """The least period any option set allows: the work every option has over the free time one step leaves."""
    work = window_work(w)
    free = sum(w.length - sum(e - s for s, e in w.fixed[d]) for d in w.group.devices) // w.k
    return max(1, math.ceil(work / free)) if free > 0 else w.problem.max_period + 1


def _least_step(g: _Group, found: GroupSolution, config: SolverConfig, meter: Budget, deadline: float) -> GroupSolution:
    """The shortest step at found's k: first-fit of the candidates bisected in half the time left, then CP-SAT
    feasibility probes (the energy bound first: often the answer) in three quarters of what is left then."""
    k = found.window.k
    energy = energy_bound(g.window(k, found.step_ticks), g.options, g.base, config, meter, (deadline - meter.now()) / 8)
    work = g.window(k, g.base)  # stretch any option set needs: slots and broadcasts as nothing
    work = replace(work, tasks=placed_tasks(work, g.options), precs=tuple(replace(p, ticks=0) for p in work.precs))
    lower = max(g.base + stretch_lower_bound(work), energy)
    cheap_until = meter.now() + (deadline - meter.now()) / 2
    cheap = first_fits(lambda step: g.first_fit(k, step, meter), meter.later(cheap_until, cheap_until))
    best = bisect_least(lower, found, cheap, lambda s: s.step_ticks)[0]
    until = meter.now() + (deadline - meter.now()) * 3 / 4

    def probe(step: int) -> Solved:
        left = until - meter.now()
        if left <= 0:
            return "UNKNOWN", None
        return g.probe(k, step, config, left / max(1, math.ceil(math.log2(step - lower + 2))), meter)

    if lower < best.step_ticks:
        _, at_bound = g.probe(k, lower, config, (until - meter.now()) / 3, meter)
        best = at_bound or bisect_least(lower + 1, best, probe, lambda s: s.step_ticks)[0]
    log.info("joint stages %s k=%d: least step %d ticks", list(g.group.stages), k, best.step_ticks)
    return best
