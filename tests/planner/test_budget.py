"""A command's budget opens at its start and counts the work around its search ([Note: command budget]); the clock is
injected, so nothing here reads the wall time."""

from __future__ import annotations

import types

import pytest

from fxkfac.planner.problem.problem import SolverConfig
from fxkfac.planner.search import budget as budget_module
from fxkfac.planner.search.budget import (
    CALIBRATED_OVERTIME_SHARE,
    COST_DTIME_PER_LAYER,
    DTIME_PER_SECOND,
    IMPORT_DTIME_PER_MODULE,
    OVERTIME_SHARE,
    Budget,
    Start,
    after_search,
)

T = 5.0
DETERMINISTIC = SolverConfig(time_limit_s=T)
WALL = SolverConfig(time_limit_s=T, deterministic=False)


class Clock:
    """perf_counter's stand-in: a time that moves only when told."""

    def __init__(self, now: float) -> None:
        self.now = now

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock(1000.0)
    monkeypatch.setattr(budget_module, "time", clock)
    return clock


def _modules(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    monkeypatch.setattr(budget_module, "sys", types.SimpleNamespace(modules=dict.fromkeys(range(n))))


def test_a_command_budget_charges_its_imports_by_count(clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    """From the process's start every module loaded is charged once, then only those loaded since; an in-process call
    charges none. The count, not the clock, decides: the same count on a slower clock charges the same."""
    spent = []
    for late in (0.0, 30.0):  # the budget opens 0 or 30 wall seconds after the process started
        _modules(monkeypatch, 700)
        whole = Budget.of(DETERMINISTIC, whole=True, start=Start(clock.now - late))
        whole.charge_imports()
        whole.charge_imports()  # nothing new
        _modules(monkeypatch, 1170)  # the analytic costs' imports, with the first cost table
        whole.charge_costs(147)
        whole.charge_imports()
        spent.append(whole.tally.spent)
        assert whole.tally.setup == whole.tally.spent
    assert spent[0] == spent[1] == pytest.approx(1170 * IMPORT_DTIME_PER_MODULE + 147 * COST_DTIME_PER_LAYER)
    called = Budget.of(DETERMINISTIC, whole=True, start=Start(clock.now, None))
    called.charge_imports()
    assert called.tally.spent == 0.0


def test_the_search_keeps_a_reserve_for_the_work_after_it(clock: Clock) -> None:
    """`keeping(r)` is the search's view: every end of it r earlier (its wall cap r's seconds earlier); what it spends
    is the whole's, and the work after it, charged by its count, ends within the whole's limit when the search used
    all its view allowed."""
    whole = Budget.of(DETERMINISTIC, whole=True, start=Start(clock.now))
    reserve = after_search(ops=128, outputs=2)
    search = whole.keeping(reserve)
    assert search.limit == pytest.approx(whole.limit - reserve)
    assert search.cutoff == pytest.approx(whole.cutoff - reserve) and search.end == pytest.approx(whole.end - reserve)
    assert search.cap == pytest.approx(whole.cap - reserve / DTIME_PER_SECOND)
    search.charge(search.cutoff)  # the search ran to its cutoff
    assert search.out() and not whole.out()
    whole.charge_output(reserve)
    assert whole.tally.output == reserve and whole.tally.spent == pytest.approx(whole.limit)
    assert after_search(ops=128, outputs=0) < reserve  # the summary alone keeps less than a timeline drawn too


def test_the_wall_clock_net_counts_from_the_command_start(clock: Clock) -> None:
    """A command that began 2 s before its budget opened (Python's start, its imports): in the wall-clock mode the
    clock already reads those 2 s and the cap lies at T from the start; in the deterministic mode the net lies
    WALL_CAP x T from the start and the clock reads only what was charged."""
    start = Start(clock.now - 2.0)
    calibrated = Budget.of(WALL, whole=True, start=start)
    assert calibrated.now() == pytest.approx(2.0 * DTIME_PER_SECOND)
    assert calibrated.wall_left() == pytest.approx(T - 2.0)
    assert calibrated.solver_time() == pytest.approx((T * (1 - CALIBRATED_OVERTIME_SHARE) - 2.0) * DTIME_PER_SECOND)
    deterministic = Budget.of(DETERMINISTIC, whole=True, start=start)
    assert deterministic.now() == 0.0
    assert deterministic.wall_left() == pytest.approx(budget_module.WALL_CAP * T - 2.0)
    assert deterministic.solver_time() == pytest.approx(T * (1 - OVERTIME_SHARE) * DTIME_PER_SECOND)
    clock.now += 1000.0  # a loaded machine: the deterministic clock does not move, only the net is past
    assert deterministic.solver_time() == pytest.approx(T * (1 - OVERTIME_SHARE) * DTIME_PER_SECOND)
    assert deterministic.wall_left() < 0
