"""The greedy rule is charged to the budget by the work it does ([Note: greedy charge]), a count that repeats."""

from __future__ import annotations

import pytest

from fxkfac.planner.plan.window import Window
from fxkfac.planner.problem.errors import PlanError
from fxkfac.planner.problem.problem import SolverConfig, stage_groups
from fxkfac.planner.search.budget import GREEDY_DTIME_PER_SCAN, GREEDY_DTIME_PER_TASK, Budget
from fxkfac.planner.search.greedy import Allowance, allowance, greedy_group, greedy_window
from tests.planner.kfac_cases import problem

CONFIG = SolverConfig(time_limit_s=1.0)
PROBLEM = problem("1f1b", 4, 4, curv=0.25, inv=1.5, layers=3)
GROUP = stage_groups(PROBLEM)[0]


def _window(k: int) -> Window:
    return allowance(PROBLEM, frozenset(), CONFIG).window(GROUP, k, stats_chunk=1, resolution=CONFIG.time_resolution)


def _first_fit_charge(window: Window) -> float:
    meter = Budget.of(CONFIG)
    greedy_window(window, meter)
    return meter.tally.greedy


def test_first_fits_charge_grows_with_the_gaps_it_scans() -> None:
    """Windows of 2 and 8 steps hold the same tasks; the longer has four times the busy intervals and more gaps to
    scan, and is charged for them, by a count: the same window is charged the same every time."""
    short, long = _window(2), _window(8)
    assert len(long.tasks) == len(short.tasks)
    charges = {w.k: _first_fit_charge(w) for w in (short, long)}
    assert charges == {w.k: _first_fit_charge(w) for w in (short, long)}
    scans = {
        w.k: (charges[w.k] - (len(w.tasks) + len(w.precs)) * GREEDY_DTIME_PER_TASK) / GREEDY_DTIME_PER_SCAN
        for w in (short, long)
    }
    for w in (short, long):  # every busy interval read once at least, besides the gaps scanned for each task
        assert scans[w.k] >= sum(len(busy) for busy in w.fixed.values()) + len(w.tasks) - 1e-6
    assert scans[8] > scans[2] + sum(len(busy) for busy in long.fixed.values()) - sum(map(len, short.fixed.values()))
    assert charges[8] > charges[2]


def test_the_greedy_rule_charges_its_windows_and_bound_and_stops_when_its_time_is_up() -> None:
    """greedy_group's charge holds more than its placements' (the windows it built and its packing bound); a view
    whose time is spent gets no placement, but a PlanError that says so."""
    meter = Budget.of(CONFIG)
    placed = greedy_group(Allowance(PROBLEM, frozenset(), None), GROUP, meter=meter, resolution=CONFIG.time_resolution)
    assert meter.tally.greedy > _first_fit_charge(placed.window) > 0
    spent = Budget.of(CONFIG)
    spent.charge(spent.cutoff + 1.0)
    with pytest.raises(PlanError, match="time limit ran out while the greedy rule placed"):
        greedy_group(Allowance(PROBLEM, frozenset(), None), GROUP, meter=spent, resolution=CONFIG.time_resolution)
