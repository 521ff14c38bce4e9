"""One stage group's plan: the least refresh period, then the least stretch, then the least staleness.

`least_period` is the period search both window models run (planner/cpsat.py for a group's fixed distributions,
planner/joint_search.py for the joint choice); `least_group_period` runs it on the CP-SAT window model, from the
lower bounds (planner/step_timeline.py, planner/packing_bound.py) and first-fit's placement (planner/greedy.py),
within a share of the planner's clock (`planner.budget.Budget`); `refine_group` then lowers the stretch and the
staleness at that period. `solve` runs the first for every group before the second for any
(planner/attempt.py `_solve_groups`): refresh periods come first in how plans rank (`planner.plan.rank`).
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol, TypeVar

from fxkfac.planner.budget import Budget
from fxkfac.planner.cpsat import solve_window
from fxkfac.planner.packing_bound import group_lower_bound
from fxkfac.planner.problem import Problem, SolverConfig, StageGroup
from fxkfac.planner.solution import GroupSolution, fits_memory
from fxkfac.planner.stretch import Allowance, least_stretch, restretch, stretch_lower_bound
from fxkfac.planner.window import Window, too_long

__all__ = ["Period", "least_group_period", "refine_group", "least_period", "refine_stretch"]

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
    best = within_budget(_least_stale(found, config, meter, left, period.proven, least), found, period.fallback)
    seconds = period.wall_s + time.perf_counter() - wall
    return None if best is None else _finish(best, best.status, period.proven, seconds)


def within_budget(*solutions: GroupSolution | None) -> GroupSolution | None:
    """The first of `solutions` that fits the memory budget with its third decompositions counted
    (`solution.remade_spans`, which CP-SAT's model does not count): after least staleness, CP-SAT's last, the one
    found before it, first-fit's; None when none does."""
    return next((s for s in solutions if s is not None and fits_memory(s)), None)


class _Placed(Protocol):
    """A placement of either window model (GroupSolution, JointPlacement): the search reads only its window."""

    @property
    def window(self) -> Window: ...


S = TypeVar("S", bound=_Placed)

Probe = Callable[[int, float], tuple[str, S | None]]
"""Solve a group's window at refresh period k within a share of the clock: (CP-SAT status, placement or None)."""
Left = Callable[[float], float]
"""The clock a search has left, of the given fraction of its time (1: all of it)."""


def least_period(probe: Probe[S], left: Left, lower: int, top: int, incumbent: S | None) -> tuple[S | None, int]:
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


def _ascend(probe: Probe[S], left: Left, lower: int, top: int) -> tuple[S | None, int]:
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


def _descend(probe: Probe[S], left: Left, lower: int, incumbent: S) -> tuple[S, int]:
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


def _climb(probe: Probe[S], left: Left, share: float, lower: int, top: int) -> tuple[int, S | None]:
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
    found: GroupSolution, config: SolverConfig, meter: Budget, left: float, proven: int, stretch_proven: bool = True
) -> GroupSolution:
    """Minimize staleness at the found k and stretch within `left` of `meter`'s clock, warm-started by
    `found` (kept when the solver does worse); its status says whether it is proven optimal."""
    hint = found if config.use_greedy_hint or found.method != "greedy" else None
    status, best = solve_window(found.window, config, left, meter, hint)
    if best is None or _staleness(found) < _staleness(best):
        best = found
    optimal = stretch_proven and proven == found.window.k and (status == "OPTIMAL" or _staleness(best) == 0)
    return replace(best, status="OPTIMAL" if optimal else "FEASIBLE")


def _staleness(solution: GroupSolution) -> int:
    return sum(solution.use_offset.values())


def _finish(solution: GroupSolution, status: str, proven: int, wall_s: float) -> GroupSolution:
    """The group's solution with its status, proven lower bound on k and the wall seconds its search took."""
    return replace(solution, status=status, k_lower_bound=proven, wall_time=wall_s)
