"""Planning's one budget: the time of a whole search, on wall seconds or CP-SAT's deterministic time (a plan repeats).

[Note: one budget] `Budget` is the one type that slices planning time. A whole search opens one; each candidate search
in it takes a part of what is left (`solving(shares)`, `part(f)`). Every view shares one tally, so time a candidate
leaves goes to the next, and work CP-SAT does not see (the greedy rule, step simulations) is charged on it too.

[Note: greedy charge] The greedy rule is charged by counts of its work (window items, `Packer.work`, tasks placed,
gaps scanned), each at its CPU seconds per unit times DTIME_PER_SECOND; it stops when its view runs out, except a
candidate's own first-fit plan, which runs to its end (charged, not cut: a short limit still plans).

[Note: deterministic budget] With `SolverConfig.deterministic` no decision reads the wall clock: CP-SAT runs one
seeded thread to `max_deterministic_time`, each call's limit is what is left in those units and it is charged its own
`deterministic_time`, so every share is a function of the problem and options alone.

[Note: calibrated budget] In a whole search's wall-clock mode CP-SAT calls stay deterministic, but a share converts at
the rate CP-SAT measured in this planning (`rate`), so it takes about its wall seconds; the clock never reads less
than the wall time since the search began and the wall cap at the limit ends it.

[Note: command budget] `fxkfac plan --time-limit T` bounds the command from the process's `Start`; the work around
the search is counted, not timed: imports (`charge_imports`), cost tables (`charge_costs`) and the work after the
search (`keeping(after_search(...))`, then `charge_output`). A wall-clock net (`WALL_CAP`) stops CP-SAT anyway;
when it ends a search the plan may differ from another run's, which is logged (`Budget.capped`).
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from fxkfac.planner.problem.problem import SolverConfig

log = logging.getLogger(__name__)

DTIME_PER_SECOND = 0.1
"""CP-SAT deterministic seconds per second of `SolverConfig.time_limit_s` ([Note: deterministic budget])."""
WALL_CAP = 4.0
"""A deterministic solve still stops CP-SAT at this many times its wall-clock limit (safety net)."""

# Deterministic seconds per unit of work outside CP-SAT (its CPU seconds times DTIME_PER_SECOND; docs/RESULTS.md).
GREEDY_DTIME_PER_TASK = 4e-7  # per task and APPLY slot first-fit places
GREEDY_DTIME_PER_SCAN = 5e-9  # per gap first-fit examines
WINDOW_DTIME_PER_ITEM = 1.3e-6  # per busy interval and task of a greedy window (a W task twice)
PACKING_DTIME_PER_UNIT = 4e-8  # per unit of the packing bound's `Packer.work`
SIMULATED_DTIME_PER_OP = 1e-6  # per op of a step simulated outside CP-SAT
IMPORT_DTIME_PER_MODULE = 8e-5  # per module a command imported ([Note: command budget])
COST_DTIME_PER_LAYER = 4e-6  # per layer of a cost table a command builds
SUMMARY_DTIME = 1e-3  # the plan's summary
ASSEMBLE_DTIME_PER_OP = 3e-5  # per op of a plain step: assembling the final plan
OUTPUT_DTIME_PER_OP = 1e-4  # per op of a plain step: each of --show, --trace and --export

CALIBRATION_WALL = 0.2
"""Wall seconds after CP-SAT's first call in a calibrated budget before its measured rate replaces DTIME_PER_SECOND."""
MIN_RATE = 0.01
"""The least rate a calibrated budget converts at (a machine so busy that CP-SAT barely ran)."""
MIN_SHARE = 0.1
"""Least time, in seconds of the limit, a share of the CP-SAT time left gives a search (`Budget.share`)."""
MIN_CALL = 0.05
"""Least time one CP-SAT call gets, in the clock's unit of the wall clock: enough to load a model and check a hint."""
OVERTIME = 3.0
"""Seconds past the limit a budget of each solve's limit gives greedy placement (half) and a refusal's suggestions."""
OVERTIME_SHARE = 0.25
"""Of a whole search's limit, the last part kept for what OVERTIME is for (within the limit)."""
CALIBRATED_OVERTIME_SHARE = 0.1
"""OVERTIME_SHARE of a calibrated budget, whose wall cap at the limit ends what runs past it anyway."""


@dataclass(frozen=True)
class Start:
    """When a command began (perf_counter) and the modules loaded then (None: imports are not charged)."""

    at: float
    modules: int | None = 0


def after_search(ops: int, outputs: int) -> float:
    """Deterministic seconds of a command's work after its search, by the `ops` of one plain step of its mesh."""
    return SUMMARY_DTIME + ops * (ASSEMBLE_DTIME_PER_OP + outputs * OUTPUT_DTIME_PER_OP)


@dataclass
class _Tally:
    """What every view of one budget shares: deterministic seconds `spent` and their parts, whether the wall net
    `capped` it, the modules counted, and a calibrated clock's CP-SAT time since its `first_call`."""

    spent: float = 0.0
    capped: bool = False
    greedy: float = 0.0
    greedy_tasks: int = 0
    simulated: float = 0.0
    solver_dtime: float = 0.0
    first_call: float | None = None
    calibrated: float = 0.0
    began: float = 0.0
    modules: int | None = None
    setup: float = 0.0
    output: float = 0.0


@dataclass(frozen=True)
class Budget:
    """One planning's time and a view of it, on the clock of `now()`: CP-SAT stops at `deadline`, planning gives up at
    `cutoff`, `end` is the whole CP-SAT end, `cap` the perf_counter wall net; `made` keeps every plan made."""

    deterministic: bool
    cap: float
    end: float
    overtime: float
    deadline: float
    cutoff: float
    limit: float = float("inf")
    tally: _Tally = field(default_factory=_Tally)
    made: dict[Any, Any] = field(default_factory=dict)
    calibrated: bool = False

    @staticmethod
    def of(config: SolverConfig, *, whole: bool = False, start: Start | None = None) -> Budget:
        """A budget of `config.time_limit_s`: CP-SAT to the limit, OVERTIME past it; `whole`: all within the limit
        from `start` (calibrated in the wall-clock mode)."""
        started = time.perf_counter() if start is None else start.at
        limit, calibrated = config.time_limit_s, whole and not config.deterministic
        deterministic = config.deterministic or calibrated
        overtime = limit * (CALIBRATED_OVERTIME_SHARE if calibrated else OVERTIME_SHARE) if whole else OVERTIME
        solving = limit - overtime if whole else limit
        cap = started + (limit if calibrated else WALL_CAP * limit if whole else WALL_CAP * (limit + OVERTIME))
        units = DTIME_PER_SECOND if deterministic else 1.0
        end = (0.0 if deterministic else started) + solving * units
        overtime *= units
        tally = _Tally(began=started, modules=None if start is None else start.modules)
        return Budget(deterministic, cap, end, overtime, end, end + overtime, limit * units, tally, {}, calibrated)

    @staticmethod
    def untimed(deterministic: bool = True) -> Budget:
        """A budget that never runs out (each solve takes its own): what it is charged is counted, nothing cut."""
        inf = float("inf")
        return Budget(deterministic, inf, inf, 0.0, inf, inf)

    def now(self) -> float:
        """The clock's reading, in its unit."""
        if self.calibrated:
            return max(self.tally.calibrated, (time.perf_counter() - self.tally.began) * DTIME_PER_SECOND)
        return self.tally.spent if self.deterministic else time.perf_counter()

    def rate(self) -> float:
        """Deterministic seconds per wall second: CP-SAT's measured one when calibrated, else DTIME_PER_SECOND."""
        first = self.tally.first_call
        wall = 0.0 if first is None else time.perf_counter() - first
        if not self.calibrated or wall < CALIBRATION_WALL:
            return DTIME_PER_SECOND
        return max(self.tally.solver_dtime / wall, MIN_RATE)

    def solver_limit(self, limit: float) -> float:
        """CP-SAT's deterministic limit for a call of `limit` in the clock's unit (`rate`)."""
        return limit * self.rate() / DTIME_PER_SECOND

    def units(self, seconds: float) -> float:
        """`seconds` of time limit in the clock's unit."""
        return seconds * DTIME_PER_SECOND if self.deterministic else seconds

    def charge_first_fit(self, tasks: int, scans: int) -> None:
        self._count("greedy", tasks * GREEDY_DTIME_PER_TASK + scans * GREEDY_DTIME_PER_SCAN)
        if self.deterministic:
            self.tally.greedy_tasks += tasks

    def charge_window(self, items: int) -> None:
        self._count("greedy", items * WINDOW_DTIME_PER_ITEM)

    def charge_packing(self, units: int) -> None:
        self._count("greedy", units * PACKING_DTIME_PER_UNIT)

    def charge_simulated(self, ops: int) -> None:
        self._count("simulated", ops * SIMULATED_DTIME_PER_OP)

    def charge_imports(self) -> None:
        """Count the modules imported since the last count (the first: since the command's `Start`)."""
        if self.tally.modules is None:
            return
        loaded = len(sys.modules)
        self._count("setup", max(0, loaded - self.tally.modules) * IMPORT_DTIME_PER_MODULE)
        self.tally.modules = max(loaded, self.tally.modules)

    def charge_costs(self, layers: int) -> None:
        self._count("setup", layers * COST_DTIME_PER_LAYER)

    def charge_output(self, dtime: float) -> None:
        self._count("output", dtime)

    def _count(self, part: Literal["greedy", "simulated", "setup", "output"], dtime: float) -> None:
        """Add `dtime` of work outside CP-SAT to the clock and the tally's `part` (the wall clock counts itself)."""
        if self.deterministic:
            self.tally.spent += dtime
            self.tally.calibrated += dtime
            setattr(self.tally, part, getattr(self.tally, part) + dtime)

    def charge(self, dtime: float, wall: float = 0.0) -> None:
        """Count the deterministic seconds one CP-SAT call of `wall` seconds spent."""
        if self.tally.first_call is None:
            self.tally.first_call = time.perf_counter() - wall
        self.tally.solver_dtime += dtime
        if self.deterministic:
            self.tally.spent += dtime
            self.tally.calibrated += dtime * DTIME_PER_SECOND / self.rate()

    def wall_left(self) -> float:
        """Wall seconds left before the safety cap."""
        return self.cap - time.perf_counter()

    def note_capped(self, what: str) -> None:
        """Log, once per planning, that the wall-clock safety net ended a deterministic search early."""
        if self.deterministic and not self.calibrated and not self.tally.capped:
            self.tally.capped = True
            log.warning(
                "planning hit its wall-clock safety cap (%s) before its deterministic budget: this "
                "plan may differ from another run's; a longer time_limit_s raises the cap",
                what,
            )

    @property
    def capped(self) -> bool:
        return self.tally.capped

    def solver_time(self) -> float:
        """Time CP-SAT has left in this view, in the clock's unit (<= 0: place greedily)."""
        return self.deadline - self.now()

    def left(self) -> float:
        """Time left in this view before planning gives up, in the clock's unit."""
        return self.cutoff - self.now()

    def out(self) -> bool:
        """Whether planning must give up now: at the cutoff, or past the wall-clock safety cap."""
        if self.now() >= self.cutoff:
            return True
        if self.wall_left() <= 0:
            self.note_capped("searching on")
            return True
        return False

    def over(self) -> bool:
        """Whether the time for solving is spent, greedy's half of the overtime past the end included."""
        return self.solving().out()

    # views: the same tally, other ends

    def later(self, deadline: float, cutoff: float | None = None) -> Budget:
        """The same planning with another deadline (and cutoff)."""
        return replace(self, deadline=deadline, cutoff=self.cutoff if cutoff is None else cutoff)

    def keeping(self, dtime: float) -> Budget:
        """This view with `dtime` deterministic seconds kept for the work after it (`after_search`)."""
        kept = self.units(dtime / DTIME_PER_SECOND)
        ends = {name: getattr(self, name) - kept for name in ("end", "deadline", "cutoff", "limit")}
        return replace(self, **ends, cap=self.cap - dtime / DTIME_PER_SECOND)

    def solving(self, shares: float = 1) -> Budget:
        """A candidate's view: an equal share of the CP-SAT time left among `shares`; greedy may go on half the
        overtime past the end."""
        now = self.now()
        deadline = now + max(0.0, self.end - now) / shares
        return self.later(deadline, max(deadline, self.end + self.overtime / 2))

    def part(self, fraction: float, *, search: bool = False) -> Budget:
        """The view whose end lies at `fraction` of the CP-SAT time left, the rest kept for what follows; `search`
        (the whole of one `plan` search): that fraction of the overtime and the limit too."""
        now = self.now()
        end = now + max(0.0, self.end - now) * fraction
        if not search:
            return replace(self, end=end, deadline=end, cutoff=end + max(0.0, self.cutoff - self.end))
        overtime = self.overtime * fraction
        cutoff = min(end + overtime, self.cutoff)  # never past the whole's
        return replace(self, end=end, deadline=end, overtime=overtime, cutoff=cutoff, limit=self.limit * fraction)

    def share(self, shares: int, *, keep: float = 0.0) -> float | None:
        """One of `shares` searches' share of the CP-SAT time left after `keep` of it (at least MIN_SHARE); None: none
        left."""
        left = self.solver_time()
        if left <= 0:
            return None
        return max(self.units(MIN_SHARE), left * (1 - keep) / shares)

    def suggesting(self) -> Budget:
        """A refusal's search for values that plan: to the overtime's end (or half of it from now, if later)."""
        until = max(self.end + self.overtime, self.now() + self.overtime / 2)
        return self.later(until, until)
