"""One stage group's placement search: the least refresh period, then the least width at it (the stretch with the
distributions fixed, the step with them chosen: [Note: joint strategy] in planner/search/cpsat.py), then the least
staleness. A forced strategy is the joint model with one option per layer (`options_of` no stage free): one search over
a `Shape`, every group's period before any refinement with the distributions fixed (`planner.search.attempt`)."""

from __future__ import annotations

import functools
import logging
import math
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
    Probe,
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


def _clock(meter: Budget, time_limit: float, began: float) -> Left:
    """What is left of `time_limit` on `meter`'s clock from `began`, of a fraction of it."""
    return lambda fraction: fraction * time_limit - (meter.now() - began)


@dataclass(frozen=True)
class Shape:
    """One group's search space: each layer's options, the least and most period, first-fit's placement within the
    budget, the window probed at period k (and its warm start), the least width at found's k by a deadline (best,
    proven), and the window staleness is minimized in (None: found's own, checked with third decompositions)."""

    group: StageGroup
    options: Options
    lower: int
    top: int
    fallback: GroupSolution | None
    at: Callable[[int], tuple[Window, GroupSolution | None]]
    narrow: Callable[[GroupSolution, float], tuple[GroupSolution, bool]]
    anchor: Callable[[GroupSolution], Window] | None = None


@dataclass(frozen=True)
class Period:
    """A group's first pass: its shape, the least period found (whole width) and the least not proven infeasible."""

    shape: Shape
    found: GroupSolution
    proven: int


def fixed_shape(
    allowance: Allowance,
    group: StageGroup,
    config: SolverConfig,
    meter: Budget,
    greedy: GroupSolution | None = None,
    *,
    stats_chunk: int = 1,
    min_k: int = 1,
) -> Shape:
    """`group`'s shape with its distributions fixed: windows of the whole stretch allowance at periods >= min_k,
    first-fit's `greedy` warm-starting the probe at its k; the least stretch by `least_stretch_at`."""
    if greedy is not None and greedy.window.k < min_k:
        greedy = None

    @functools.cache
    def window_of(k: int) -> Window:  # built once for the packing bound and the probe at the same k
        return allowance.window(group, k, stats_chunk=stats_chunk, resolution=config.time_resolution)

    def at(k: int) -> tuple[Window, GroupSolution | None]:
        if greedy is None or greedy.window.k != k:
            return window_of(k), None
        hint = restretch(greedy, allowance.ticks(k))  # first-fit's placement in the probe's window
        return hint.window, hint

    def narrow(found: GroupSolution, deadline: float) -> tuple[GroupSolution, bool]:
        if found.window.stretch <= 0:
            return found, True
        return least_stretch_at(found, allowance, config, meter, deadline)

    own, lower = options_of(allowance.problem, group.stages, ()), group_lower_bound(allowance, group, window_of, min_k)
    return Shape(group, own, lower, allowance.problem.max_period, within_budget(greedy), at, narrow)


def least_group_period(
    shape: Shape, config: SolverConfig, time_limit: float, meter: Budget, began: float | None = None
) -> Period | None:
    """The least refresh period of `shape` with the whole width within `time_limit` of `meter`'s clock from `began`
    (now when None), and the least not proven infeasible: climbing from its bound; with first-fit's placement (its
    `fallback`), climbing while each k is proven infeasible (in PROOF_SHARE of the time), then descending from its k
    ([Note: descending refresh search]); None when none is found in time."""
    left = _clock(meter, time_limit, meter.now() if began is None else began)
    lower, incumbent = shape.lower, shape.fallback

    def probe(k: int, share: float) -> Solved:
        w, hint = shape.at(k)
        status, found = solve_window(w, config, share, meter, hint, optimize=False, options=shape.options)
        log.info("stages %s k=%d width %d ticks: %s", list(shape.group.stages), k, w.offsets[1], status)
        return status, found

    if incumbent is None:
        found, proven = _climb(probe, left, 1.0, lower, shape.top + 1, give_up=False)
    elif incumbent.window.k - lower <= 1:  # the climb would probe the one k the descent probes first
        found, proven = _descend(probe, left, lower, incumbent)
    else:
        found, proven = _climb(probe, left, PROOF_SHARE, lower, incumbent.window.k)
        if found is None:
            found, proven = _descend(probe, left, proven, incumbent)
    return None if found is None else Period(shape, found, proven)


def refine_group(
    period: Period, config: SolverConfig, time_limit: float, meter: Budget, began: float | None = None
) -> GroupSolution | None:
    """The least width, then the least staleness, at the period found within `time_limit` of `meter`'s clock from
    `began` (now when None); None when neither that placement nor first-fit's fits the memory budget."""
    began, shape = meter.now() if began is None else began, period.shape
    found, least = shape.narrow(period.found, began + time_limit)
    left = time_limit - (meter.now() - began)
    proven = least and period.proven == found.window.k
    w = found.window if shape.anchor is None else shape.anchor(found)
    stale = _least_stale(found, w, config, meter, left, proven, shape.options)
    best = stale if shape.anchor is not None else within_budget(stale, found, shape.fallback)
    if best is None:
        return None
    return replace(best, k_lower_bound=period.proven)


def within_budget(*solutions: GroupSolution | None) -> GroupSolution | None:
    """The first of `solutions` within the memory budget with third decompositions counted (CP-SAT's model does not)."""
    return next((s for s in solutions if s is not None and fits_memory(s)), None)


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

    [Note: descending refresh search] Near the least feasible k CP-SAT may need long to decide a tight window; far
    above it a placement is found at once. Descending keeps an incumbent and spends the time improving it."""
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

    def window_of(stretch: int) -> Window | None:
        window = allowance.window(w.group, w.k, stretch, stats_chunk=w.stats_chunk, resolution=config.time_resolution)
        return None if too_long(window) else window

    probe = _width_probe(window_of, 0, until, config, meter, options_of(w.problem, w.group.stages, ()))
    best, least = bisect_least(stretch_lower_bound(w), found, probe)
    proof = "proven" if least else "not proven"
    log.info("stages %s k=%d: least stretch %d ticks (%s)", list(w.group.stages), w.k, best.window.stretch, proof)
    return best, least


def _width_probe(
    at: Callable[[int], Window | None], base: int, until: float, config: SolverConfig, meter: Budget, options: Options
) -> Probe:
    """A CP-SAT feasibility probe of the window `at` a width (None: a task fits no gap) in the time left to `until`, a
    share by the bisection's depth above `base` (the stretch and the step descents share it)."""

    def probe(width: int) -> Solved:
        w = at(width)
        if w is None:
            return "INFEASIBLE", None
        left = until - meter.now()
        if left <= 0:
            return "UNKNOWN", None
        share = left / max(1, math.ceil(math.log2(width - base + 2)))
        return solve_window(w, config, share, meter, optimize=False, options=options)

    return probe


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

    def shape(self, config: SolverConfig, meter: Budget) -> Shape | None:
        """The joint search's shape: windows of the whole step cap, first-fit of the candidates as its fallback, the
        least step by `_least_step`, staleness in the anchor's window; None where some work fits no step."""
        anchor = self.anchor
        if too_long(self.window(2, self.most(anchor.max_period))):
            return None
        w = self.window(1, self.most(1))  # the least period any option set allows: all work over one step's free time
        free = sum(w.length - sum(e - s for s, e in w.fixed[d]) for d in w.group.devices) // w.k
        lower = max(1, math.ceil(window_work(w) / free)) if free > 0 else anchor.max_period + 1
        first = (self.first_fit(k, self.most(k), meter) for k in range(lower, anchor.max_period + 1))
        fallback = next((f for f in first if f is not None), None)

        def narrow(found: GroupSolution, deadline: float) -> tuple[GroupSolution, bool]:
            if found.step_ticks <= self.base:
                return found, True
            return _least_step(self, found, config, meter, deadline), True

        def stale(found: GroupSolution) -> Window:
            return self.window(found.window.k, found.step_ticks)

        def at(k: int) -> tuple[Window, GroupSolution | None]:
            return self.window(k, self.most(k)), None

        return Shape(self.group, self.options, lower, anchor.max_period, fallback, at, narrow, stale)


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
    """Each group's distributions and placement on the grid `scale`, warm-started by first-fit of each `forced`
    strategy on its free layers, the time to `deadline` shared by the groups left; None when one is not placed.
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
        time_limit, began = max(0.0, deadline - meter.now()) / (len(groups) - n), meter.now()
        shape = g.shape(config, meter)
        period = None if shape is None else least_group_period(shape, config, time_limit, meter, began)
        if shape is None or period is None:
            log.info("joint choice: stages %s not placed", list(group.stages))
            return None
        placement = refine_group(period, config, time_limit, meter, began)
        assert placement is not None, "the joint choice keeps what it found"
        placements.append(placement)
    return placements


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
    probe = _width_probe(functools.partial(g.window, k), lower, until, config, meter, g.options)
    if lower < best.step_ticks:
        share = (until - meter.now()) / 3
        _, at_bound = solve_window(g.window(k, lower), config, share, meter, optimize=False, options=g.options)
        best = at_bound or bisect_least(lower + 1, best, probe, lambda s: s.step_ticks)[0]
    log.info("joint stages %s k=%d: least step %d ticks", list(g.group.stages), k, best.step_ticks)
    return best
