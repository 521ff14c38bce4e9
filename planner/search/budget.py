"""Planning's one budget: the time of a whole search, on wall seconds or CP-SAT's deterministic time (a plan repeats).

[Note: one budget] `Budget` is the one type that slices planning time. A whole search (`planner.plan`) opens one;
every search in it is a candidate taking a part of what is left (`solving(shares)`: an equal share among those still
to run; `part(f)`: a fraction, the rest kept for what follows). Every view shares one tally, so time a candidate
leaves goes to the next, and work CP-SAT does not see (the greedy rule, step simulations) is charged on it too.

[Note: greedy charge] The greedy rule (planner/search/greedy.py) is charged by counts of its work (window items,
`Packer.work`, tasks placed and gaps scanned), each at its CPU seconds per unit times DTIME_PER_SECOND (fitted on
every schedule; docs/RESULTS.md). It stops when its view runs out (`left`): the paper's first-fit raises PlanError,
the packing bound returns the period it reached (still a bound), a stretch bisection keeps what it found; a
candidate's own first-fit plan runs to its end (charged, not cut: a short limit still plans).

[Note: deterministic budget] With `SolverConfig.deterministic` (the default) no planning decision reads the wall
clock: CP-SAT runs one seeded thread (cpsat's `_FEW_WORKER_SUBSOLVERS`) and stops at `max_deterministic_time`; each
call's limit is what the search has left in those units and what it spent is the solver's own `deterministic_time`,
so every share and every "time is up" is a function of the problem and options alone. Greedy placement is charged by
count ([Note: greedy charge]): uncharged, rounds of fusing ran on for 25 s at a 1 s limit. `DTIME_PER_SECOND`
converts the API's wall seconds to about a lightly loaded machine's rate.

[Note: calibrated budget] A whole search's wall-clock mode (`SolverConfig(deterministic=False)`): CP-SAT calls stay
as in the deterministic mode, but a share L is converted at the rate CP-SAT measured in this planning (`rate`) rather
than DTIME_PER_SECOND, so the CP-SAT part takes about its wall seconds; the clock never reads less than the wall time
since the search began and the wall cap at the limit ends it. The plan then depends on the machine's speed.

[Note: command budget] `fxkfac plan --time-limit T` bounds the whole command from the process's start (a `Start`:
fxkfac/cli_start.py; `fxkfac.cli.main(argv)` in a running process counts from the call, no imports). The work around
the search is counted, not timed, so the deterministic mode stays deterministic: modules imported (`charge_imports`),
cost tables built (`charge_costs`), and the work after the search (the plan's assembly, summary and outputs), which
the search leaves as a reserve (`keeping(after_search(...))`) and which is then charged (`charge_output`). Rates are
CPU seconds per unit times DTIME_PER_SECOND; uncounted, the imports alone put a 5 s command past T + 10%.

A wall-clock safety net stays: CP-SAT calls also stop at `WALL_CAP` times the limit (plus OVERTIME) after planning
began. When it ends a search the plan may differ from another run's, which is logged (`Budget.capped`).
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

# The charges below are deterministic seconds per unit of work: its CPU seconds times DTIME_PER_SECOND.
GREEDY_DTIME_PER_TASK = 4e-7
"""Per task and APPLY slot of each window first-fit places, besides its scans ([Note: greedy charge])."""

GREEDY_DTIME_PER_SCAN = 5e-9
"""Per gap first-fit examines (a busy interval read, a gap scanned for a start or a split)."""

WINDOW_DTIME_PER_ITEM = 1.3e-6
"""Per item of a window the greedy rule builds: each busy interval of its devices and each task, a W task twice (it
reads its stage's ops to find its bounds)."""

PACKING_DTIME_PER_UNIT = 4e-8
"""Per unit of the packing bound's work (`Packer.work`: a lookup, a table cell, a placement of APPLY slots tried)."""

SIMULATED_DTIME_PER_OP = 1e-6
"""Per op of each step a search simulates outside CP-SAT (the streaming and distribution choices)."""

IMPORT_DTIME_PER_MODULE = 8e-5
"""Per module a command imported, the interpreter's start and its exit included ([Note: command budget])."""

COST_DTIME_PER_LAYER = 4e-6
"""Per layer of each cost table a command builds (a preset's analytic table or a profile)."""

SUMMARY_DTIME = 1e-3
"""Reserved and charged for the plan's summary (rich's table drawn)."""

ASSEMBLE_DTIME_PER_OP = 3e-5
"""Reserved and charged per forward or backward op of one plain step of the mesh for assembling the plan the search
ends with (`planner.search.attempt.assemble`, which the search does not charge)."""

OUTPUT_DTIME_PER_OP = 1e-4
"""Reserved and charged per forward or backward op of one plain step of the mesh for each of --show, --trace and
--export (the longest refresh period's timeline drawn or written; the programs written)."""

CALIBRATION_WALL = 0.2
"""Wall seconds after CP-SAT's first call in a calibrated budget before its measured rate replaces DTIME_PER_SECOND."""

MIN_RATE = 0.01
"""The least rate a calibrated budget converts at (a machine so busy that CP-SAT barely ran)."""

MIN_SHARE = 0.1
"""Least time, in seconds of the limit, a share of the CP-SAT time left gives a search (`Budget.share`)."""

MIN_CALL = 0.05
"""Least time one CP-SAT call gets, in the budget's unit of the wall clock (seconds; converted when
deterministic): enough to load a model and check a hint."""

OVERTIME = 3.0
"""Seconds planning may run past SolverConfig.time_limit_s when the limit is each solve's: greedy placement once
CP-SAT's time is up (fusing curvature to fit a memory budget) may take half; a refusal then solves with the values
it would suggest until OVERTIME past the limit. Under a whole search's limit (`Budget.whole`) the same phases lie
within the limit instead (OVERTIME_SHARE of it)."""

OVERTIME_SHARE = 0.25
"""Of a whole search's limit (`Budget.whole`), the last part kept for greedy placement past CP-SAT's time (half of
it) and a refusal's suggestions (all of it)."""

CALIBRATED_OVERTIME_SHARE = 0.1
"""OVERTIME_SHARE of a calibrated budget, whose wall cap at the limit ends what runs past it anyway."""


@dataclass(frozen=True)
class Start:
    """When a command began, on the perf_counter clock, and the modules loaded then that are not its own (None:
    imports are not charged; [Note: command budget])."""

    at: float
    modules: int | None = 0


def after_search(ops: int, outputs: int) -> float:
    """Deterministic seconds the work after a command's search takes, by the `ops` forward and backward ops of one
    plain step of its mesh: the last plan's assembly, the summary, and `outputs` timelines drawn or files written."""
    return SUMMARY_DTIME + ops * (ASSEMBLE_DTIME_PER_OP + outputs * OUTPUT_DTIME_PER_OP)


@dataclass
class _Tally:
    """What every view of one budget shares: the deterministic seconds `spent` and, of them, what the greedy rule's
    work (`greedy`; its first-fit tasks and slots in `greedy_tasks`), step simulations (`simulated`), a command's
    imports and cost tables (`setup`) and the work after its search (`output`) were charged; whether the wall net
    ended it (`capped`); the modules counted so far (None: imports are not charged). A calibrated budget's clock
    ([Note: calibrated budget]) reads CP-SAT's deterministic seconds (`solver_dtime`) since its `first_call`
    (perf_counter) and counts each at its call's rate (`calibrated`), never below the wall time since `began`."""

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
    """The time of one whole planning and a view of it ([Note: one budget]), on the clock of `now()` (wall seconds, or
    deterministic seconds spent): `deadline`, when CP-SAT stops (greedy placement goes on); `cutoff`, when planning
    gives up; `end`, the whole search's CP-SAT end. `cap`: the perf_counter time past which CP-SAT gets no more wall
    time. `made`: the plans made in this planning, by (problem, method), so a retry takes no more time."""

    deterministic: bool
    cap: float
    end: float
    overtime: float
    deadline: float
    cutoff: float
    limit: float = float("inf")
    """The whole time limit in the clock's unit, for a search that takes a fixed fraction of it (not of a part)."""
    tally: _Tally = field(default_factory=_Tally)
    made: dict[Any, Any] = field(default_factory=dict)
    calibrated: bool = False
    """Deterministic CP-SAT calls on a whole search's wall-clock budget ([Note: calibrated budget])."""

    @staticmethod
    def of(config: SolverConfig, *, whole: bool = False, start: Start | None = None) -> Budget:
        """A fresh budget of `config.time_limit_s`: CP-SAT until the limit, the rest OVERTIME past it; with `whole` (a
        whole search's) all within the limit from `start` (now when None; [Note: command budget]), CP-SAT ending
        OVERTIME_SHARE of it earlier, and in the wall-clock mode calibrated ([Note: calibrated budget])."""
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
        """A budget that never runs out: the search around solves that each take a budget of their own
        (`planner.plan`'s TimeLimit.EACH_SOLVE); what it is charged is counted, nothing is cut."""
        inf = float("inf")
        return Budget(deterministic, inf, inf, 0.0, inf, inf)

    # the clock

    def now(self) -> float:
        """The clock's reading, in its unit."""
        if self.calibrated:
            return max(self.tally.calibrated, (time.perf_counter() - self.tally.began) * DTIME_PER_SECOND)
        return self.tally.spent if self.deterministic else time.perf_counter()

    def rate(self) -> float:
        """Deterministic seconds per wall second: CP-SAT's since its first call in a calibrated budget (once
        CALIBRATION_WALL has passed), else DTIME_PER_SECOND."""
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
        """Count one first-fit placement of `tasks` tasks and APPLY slots that examined `scans` gaps."""
        self._count("greedy", tasks * GREEDY_DTIME_PER_TASK + scans * GREEDY_DTIME_PER_SCAN)
        if self.deterministic:
            self.tally.greedy_tasks += tasks

    def charge_window(self, items: int) -> None:
        """Count building one window of `items` for the greedy rule."""
        self._count("greedy", items * WINDOW_DTIME_PER_ITEM)

    def charge_packing(self, units: int) -> None:
        """Count `units` of the packing bound's work (lookups, table cells, slot choices)."""
        self._count("greedy", units * PACKING_DTIME_PER_UNIT)

    def charge_simulated(self, ops: int) -> None:
        """Count one simulated step of `ops` ops run outside CP-SAT."""
        self._count("simulated", ops * SIMULATED_DTIME_PER_OP)

    def charge_imports(self) -> None:
        """Count the modules imported since the last count (the first: since the command's `Start`)."""
        if self.tally.modules is None:
            return
        loaded = len(sys.modules)
        self._count("setup", max(0, loaded - self.tally.modules) * IMPORT_DTIME_PER_MODULE)
        self.tally.modules = max(loaded, self.tally.modules)

    def charge_costs(self, layers: int) -> None:
        """Count building one cost table of `layers` layers."""
        self._count("setup", layers * COST_DTIME_PER_LAYER)

    def charge_output(self, dtime: float) -> None:
        """Count the work after the search, `after_search`'s count of it."""
        self._count("output", dtime)

    def _count(self, part: Literal["greedy", "simulated", "setup", "output"], dtime: float) -> None:
        """Add `dtime` deterministic seconds of work outside CP-SAT to the clock and to the tally's `part`; the
        wall-clock mode's clock counts itself."""
        if self.deterministic:
            self.tally.spent += dtime
            self.tally.calibrated += dtime
            setattr(self.tally, part, getattr(self.tally, part) + dtime)

    def keeping(self, dtime: float) -> Budget:
        """This view with `dtime` deterministic seconds kept for the work after it (`after_search`): its end, cutoff,
        limit and wall cap that much earlier."""
        kept = self.units(dtime / DTIME_PER_SECOND)
        return replace(
            self,
            end=self.end - kept,
            deadline=self.deadline - kept,
            cutoff=self.cutoff - kept,
            limit=self.limit - kept,
            cap=self.cap - dtime / DTIME_PER_SECOND,
        )

    def charge(self, dtime: float, wall: float = 0.0) -> None:
        """Count the deterministic seconds one CP-SAT call of `wall` seconds spent (the wall clock counts itself)."""
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
        """Whether the wall-clock safety net ended a search of this planning."""
        return self.tally.capped

    # this view's time

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

    def later(self, deadline: float, cutoff: float | None = None) -> Budget:
        """The same planning with another deadline (and cutoff)."""
        return replace(self, deadline=deadline, cutoff=self.cutoff if cutoff is None else cutoff)

    # parts of the whole

    def solving(self, shares: float = 1) -> Budget:
        """One candidate's view: an equal share of the CP-SAT time left among the `shares` candidates still to run;
        greedy placement may go on until half the overtime past the end."""
        now = self.now()
        deadline = now + max(0.0, self.end - now) / shares
        return self.later(deadline, max(deadline, self.end + self.overtime / 2))

    def part(self, fraction: float) -> Budget:
        """A candidate's part of the whole that keeps the rest for what follows: the view whose end (and so every
        share taken of it) lies at `fraction` of the CP-SAT time left, its cutoff as far past it as this view's is
        past its end (`part(1)` is the same time as this view); what it leaves unspent stays in the whole."""
        now = self.now()
        end = now + max(0.0, self.end - now) * fraction
        return replace(self, end=end, deadline=end, cutoff=end + max(0.0, self.cutoff - self.end))

    def search_part(self, fraction: float) -> Budget:
        """`part(fraction)` as the whole of one `plan` search (a schedule candidate's): that fraction of this view's
        overtime (greedy placement past CP-SAT's time, a refusal's suggestions) and of its limit (the streaming choice's
        STREAM_CHOICE_PART) too, which each of many searches would otherwise take whole."""
        part = self.part(fraction)
        overtime = self.overtime * fraction
        cutoff = min(part.end + overtime, self.cutoff)  # never past the whole's: a late part has only what is left
        return replace(part, overtime=overtime, cutoff=cutoff, limit=self.limit * fraction)

    def share(self, shares: int, *, keep: float = 0.0) -> float | None:
        """One of `shares` searches' share of the CP-SAT time left, in the clock's unit, after `keep` of it is kept
        for what follows them (at least MIN_SHARE seconds' worth); None when none is left."""
        left = self.solver_time()
        if left <= 0:
            return None
        return max(self.units(MIN_SHARE), left * (1 - keep) / shares)

    def over(self) -> bool:
        """Whether the time for solving is spent, greedy's half of the overtime past the end included."""
        return self.solving().out()

    def suggesting(self) -> Budget:
        """The view of a refusal's search for values that plan: until the overtime past the end (or half of it
        from now, when an uninterrupted greedy placement ran past that)."""
        until = max(self.end + self.overtime, self.now() + self.overtime / 2)
        return self.later(until, until)
