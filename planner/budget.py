"""Planning's clock: wall seconds, or CP-SAT's deterministic time so that a plan repeats on any load.

[Note: deterministic budget] With `SolverConfig.deterministic` (the default) no planning decision reads
the wall clock. CP-SAT runs one thread (its sequential loop over `_FEW_WORKER_SUBSOLVERS`, with a fixed
`random_seed`) and stops at `max_deterministic_time`, a weighted count of its operations; the budget of
each call is what the whole solve has left in those units, and what a call spent is the solver's own
`deterministic_time`, so every share and every "time is up" between phases is a function of the problem
and the options alone. Greedy placement, which CP-SAT does not see, is charged by count: each window it
places costs GREEDY_DTIME_PER_TASK per task (without it, rounds of fusing curvature ran on for 25 s at a
1 s limit, as no CP-SAT time passed).

`time_limit_s` (and `OVERTIME`) are wall seconds in the API; `DTIME_PER_SECOND` converts them. Measured
on the 2-core development machine (ortools 9.15), whole solves at a 10 s limit (1.0 deterministic
second), deterministic seconds spent (CP-SAT and greedy charges) per wall second:

    problem                               load ~1               load ~3-4 (CP-SAT's only)
    chimera D=4 N=4 W=2 (tests' sizes)    1.00 in 9.3-10.6 s    1.00 in 11.5-12.1 s
    bert-base 1f1b D=4 p100               0.74 in 6.0-6.1 s     0.73 in 7.3-7.4 s
    bert-base chimera D=4 p100, mo 0.1    0.60 in 5.6 s         0.50 in 6.8-10.0 s

so 0.1 per second keeps about the old wall time on a lightly loaded machine (the wall-clock mode finds
the same refresh periods on these three); at load ~8 single window solves ran at 0.02-0.05 per second,
so a loaded machine takes longer for the same plan.

A wall-clock safety net stays: CP-SAT calls also stop at `WALL_CAP` times the time limit (plus
OVERTIME) after planning began. When that net, and not the deterministic budget, ends a search, the
plan may differ from another run's; it is logged as a warning (`Meter.capped` says so).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

__all__ = ["DTIME_PER_SECOND", "WALL_CAP", "GREEDY_DTIME_PER_TASK", "MIN_CALL", "Meter", "meter"]

log = logging.getLogger(__name__)

DTIME_PER_SECOND = 0.1
"""CP-SAT deterministic seconds per second of `SolverConfig.time_limit_s` (see the module note)."""

WALL_CAP = 4.0
"""A deterministic solve still stops CP-SAT at this many times its wall-clock limit (safety net)."""

GREEDY_DTIME_PER_TASK = 1e-5
"""Deterministic seconds charged per task of each window first-fit places: building and placing a window
took 100-150 us per task (GPT-2 on 4 A100s under a memory budget: 102,608 tasks in 15 s of greedy
placement, load average 2.5), i.e. 1e-5 deterministic seconds at DTIME_PER_SECOND."""

MIN_CALL = 0.05
"""Least time one CP-SAT call gets, in the meter's unit of the wall clock (seconds; converted when
deterministic): enough to load a model and check a hint."""


@dataclass
class Meter:
    """Where planning is on its clock: `now()` is wall seconds (time.perf_counter) or, `deterministic`,
    the deterministic seconds CP-SAT has spent so far (`charge`). `cap` is the perf_counter time past which
    CP-SAT gets no more wall time, whatever the deterministic budget says."""

    deterministic: bool
    cap: float
    spent: float = 0.0
    capped: bool = False

    def now(self) -> float:
        """The clock's reading, in its unit."""
        return self.spent if self.deterministic else time.perf_counter()

    def units(self, seconds: float) -> float:
        """`seconds` of time limit in the clock's unit."""
        return seconds * DTIME_PER_SECOND if self.deterministic else seconds

    def charge_greedy(self, tasks: int) -> None:
        """Count one first-fit placement of a window of `tasks` tasks and APPLY slots (GREEDY_DTIME_PER_TASK each)."""
        if self.deterministic:
            self.spent += tasks * GREEDY_DTIME_PER_TASK

    def charge(self, dtime: float) -> None:
        """Count the deterministic seconds one CP-SAT call spent (the wall clock counts itself)."""
        if self.deterministic:
            self.spent += dtime

    def wall_left(self) -> float:
        """Wall seconds left before the safety cap."""
        return self.cap - time.perf_counter()

    def note_capped(self, what: str) -> None:
        """Log, once per solve, that the wall-clock safety net ended a deterministic search early."""
        if self.deterministic and not self.capped:
            self.capped = True
            log.warning(
                "planning hit its wall-clock safety cap (%s) before its deterministic budget: this "
                "plan may differ from another run's; a longer time_limit_s raises the cap",
                what,
            )


def meter(deterministic: bool, time_limit_s: float, overtime: float) -> Meter:
    """A fresh clock for one `solve`: the wall cap is WALL_CAP times (time limit + overtime) from now."""
    return Meter(deterministic, time.perf_counter() + WALL_CAP * (time_limit_s + overtime))
