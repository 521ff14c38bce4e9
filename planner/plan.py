"""Plans: per-rank programs with K-FAC work in the bubbles, metrics, JSON files, and `solve()`.

`solve(problem, config, method)` is the planner's single entry point: it refuses a budget below the
least memory any plan needs, solves every stage group (greedy, then CP-SAT warm-started by it),
fuses the curvature of the layers that do not fit the budget deferred (largest kept bytes first,
when max_overhead allows the time they add), gives every group the same stretch of the step (the
largest any group needs, [Note: stretch] in planner/window.py), and assembles the Plan.

[Note: time limit] One planning, every solve and retry of it, runs in one `TimeBox`: CP-SAT stops
config.time_limit_s after the box opened (several solves in one box, such as the strategy candidates of
planner/choose.py, each get an equal share of what is left); greedy placement (and fusing by greedy's
memory excess) goes on until at most OVERTIME / 2 past that. A refusal then searches, until OVERTIME
past the limit, for values of max_overhead, the memory budget or N that plan the same problem, and
names only those it has solved with (`PlanError.suggestions`); the box keeps every plan it made, so
planning again at a suggested value takes no more time. With config.deterministic (the default) these
times are on CP-SAT's deterministic clock, converted from seconds ([Note: deterministic budget] in
planner/budget.py), so the same problem and options give the same plan, or the same refusal, on any
load; `SolverStats.wall_time` is then the only field of a plan that differs between runs.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from decimal import ROUND_CEILING, Decimal
from enum import StrEnum
from pathlib import Path
from typing import Any

from fxkfac.planner.budget import Meter, meter
from fxkfac.planner.costs import LayerCost
from fxkfac.planner.errors import (
    InfeasibleBudgetError,
    Knob,
    PlanError,
    PlanFormatError,
    PlanMismatchError,
    ScheduleError,
    Suggestion,
)
from fxkfac.planner.ir import LayerTiming, Op, OpKind, Program, format_program, parse_program
from fxkfac.planner.lowering import startup_programs
from fxkfac.planner.preconditioners import words_of
from fxkfac.planner.problem import (
    Problem,
    SolverConfig,
    StageGroup,
    copies_of_stage,
    format_bytes,
    min_memory_bytes,
    plain_step_time,
    plain_utilization,
    refresh_lower_bound,
    stage_groups,
    step_timeline,
)
from fxkfac.planner.simulate import BUSY_KINDS, utilization
from fxkfac.planner.stretch import Allowance, allowance, restretch
from fxkfac.planner.window import (
    GroupSolution,
    Placement,
    TaskKind,
    Window,
    born_steps,
    fits_memory,
    grid_scale,
    longest_gaps,
    peak_bytes,
    placements_of,
    too_long,
)

__all__ = ["SCHEMA_VERSION", "OVERTIME", "Method", "SolverStats", "PlanMetrics", "Plan", "TimeBox", "solve",
           "aggregates", "assemble"]

SCHEMA_VERSION = 3
"""Version of the plan JSON layout; a newer file asks the user to upgrade fxkfac, an older one to re-plan.
2: every step ends with a barrier (the KL-clip and loss all-reduces), so no K-FAC task spans a step boundary.
3: the plan holds its start-up steps (`Plan.startup`), so it lists every op every rank runs. Its problem may name
its step barrier (`Problem.barrier`, absent: world): under agreement-set a task may begin a step before the step's
world start, once the rank's agreement set has ended the step before ([Note: step barrier] in planner/window.py)."""

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SolverStats:
    """How the plan was found: status (OPTIMAL: every refresh period proven minimal and staleness
    optimal; FEASIBLE; GREEDY: the greedy plan was kept), wall time (s), objective (sum of refresh
    periods over stages, sum of use offsets) and gap (of the refresh periods to the proven bounds).
    wall_time measures this machine at that moment: it is left out of equality (`Plan ==`), and it is
    the one field whose JSON differs between two deterministic solves of one problem."""

    status: str
    wall_time: float = field(compare=False)
    objective: tuple[int, int]
    gap: float


@dataclass(frozen=True)
class PlanMetrics:
    """What a plan achieves: utilization before/after (busy / device time, mean over devices),
    refresh period and lower bound per stage, step times (plain pipeline, with preconditioning as
    planned, the reference with APPLY after the all-reduce), peak memory per device, the greedy
    periods, `time_quantum`: the planner's time grid in seconds (see [Note: time grid]), and
    `stretch`: the idle seconds appended to every step ([Note: stretch]; left out of the JSON when 0,
    so files from before it load as 0)."""

    utilization_baseline: float
    utilization: float
    refresh_steps: tuple[int, ...]
    step_time_baseline: float
    step_time: float
    step_time_reference: float
    peak_memory: Mapping[int, int]
    lower_bound_steps: tuple[int, ...]
    solver: SolverStats
    greedy_refresh_steps: tuple[int | None, ...]
    time_quantum: float
    stretch: float = 0.0


@dataclass(frozen=True)
class Plan:
    """A placement of K-FAC work: per global rank one op list per step of its period, when each layer
    refreshes (`layers`), where every K-FAC op runs (`placements`), and the metrics.

    `startup[rank]` lists the rank's first steps, which run once before its steady `programs` take
    over (global step t runs `startup[rank][t]` while t is in range, else `programs[rank][t % period]`):
    see `planner.lowering.startup_programs`. Together they are every op a rank executes."""

    problem: Problem
    programs: Mapping[int, Program]
    layers: Mapping[str, LayerTiming]
    placements: tuple[Placement, ...]
    metrics: PlanMetrics
    fingerprint: str
    schema_version: int = SCHEMA_VERSION
    startup: Mapping[int, Program] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able form (programs in the IR's text format, one string per step)."""
        metrics = asdict(self.metrics)
        metrics["peak_memory"] = {str(d): b for d, b in self.metrics.peak_memory.items()}
        if not self.metrics.stretch:
            del metrics["stretch"]
        return {"schema_version": self.schema_version, "fingerprint": self.fingerprint,
                "problem": self.problem.to_dict(),
                "programs": _programs_dict(self.programs), "startup": _programs_dict(self.startup),
                "layers": {name: _timing_dict(t) for name, t in self.layers.items()},
                "placements": [p.to_dict() for p in self.placements], "metrics": metrics}

    def to_json(self, *, indent: int | None = 1) -> str:
        """JSON text; `from_json` reads it back to an equal plan."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Parse `to_json` output; raises PlanFormatError for corrupt, truncated or newer files."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanFormatError(f"the plan file is not valid JSON (corrupt or truncated?): {e}") from e
        return _plan_from_dict(data)

    def save(self, path: str | Path) -> None:
        """Write the JSON atomically (a temporary file in the same folder, then os.replace)."""
        path = Path(path)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent or ".")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(self.to_json())
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; a plan is shared like any file
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def read(cls, path: str | Path) -> Plan:
        """Read and parse a plan file, not yet validated against its problem (see `load`); errors name the file."""
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise PlanFormatError(f"cannot read the plan file {path}: {e}") from e
        try:
            return cls.from_json(text)
        except PlanFormatError as e:
            raise PlanFormatError(f"plan file {path}: {e}") from e

    @classmethod
    def load(cls, path: str | Path, *, expect_fingerprint: str | None = None) -> Plan:
        """Read and validate a plan; PlanMismatchError when made for another graph."""
        from fxkfac.planner.validate import check_plan

        plan = cls.read(path)
        if expect_fingerprint is not None and plan.fingerprint != expect_fingerprint:
            raise PlanMismatchError(f"{path} was made for graph {plan.fingerprint!r}, not {expect_fingerprint!r}; "
                                    "make a new plan for this model, mesh and schedule (fxkfac plan ... --export)")
        try:
            check_plan(plan.problem, plan)
        except PlanError as e:
            raise PlanError(f"plan file {path}: {e}") from e
        return plan


def _programs_dict(programs: Mapping[int, Program]) -> dict[str, list[str]]:
    """Programs in the IR's text format, one string per step."""
    return {str(r): [format_program([step]) for step in prog] for r, prog in programs.items()}


def _programs_of(data: Mapping[str, Any]) -> dict[int, Program]:
    """Inverse of `_programs_dict`."""
    return {int(r): [parse_program(text)[0] if text.strip() else [] for text in steps] for r, steps in data.items()}


def _timing_dict(t: LayerTiming) -> dict[str, Any]:
    return {"period": t.period, "curv_step": t.curv_step, "use_offset": t.use_offset, "capture": t.capture}


def _plan_from_dict(data: Any) -> Plan:
    from fxkfac.planner.plan_check import check_structure

    if not isinstance(data, dict):
        raise PlanFormatError(f"a plan must be a JSON object, got {type(data).__name__}")
    version = data.get("schema_version")
    if type(version) is int and version > SCHEMA_VERSION:  # not bool: true is not a version
        raise PlanFormatError(f"the plan has schema_version {version}, newer than this fxkfac reads "
                              f"({SCHEMA_VERSION}); upgrade fxkfac to load it")
    if type(version) is int and 1 <= version < SCHEMA_VERSION:
        raise PlanFormatError(f"the plan has schema_version {version}, older than this fxkfac's ({SCHEMA_VERSION}): "
                              "it may place K-FAC work across a step's closing barrier (version 1) or lack its "
                              "start-up steps (version 2); re-plan it (fxkfac plan ... --export plan.json, or "
                              "plan='auto')")
    if type(version) is not int or version != SCHEMA_VERSION:
        raise PlanFormatError(f"unknown plan schema_version {version!r} (expected {SCHEMA_VERSION})")
    try:
        m = data["metrics"]
        solver = SolverStats(m["solver"]["status"], m["solver"]["wall_time"], tuple(m["solver"]["objective"]),
                             m["solver"]["gap"])
        metrics = PlanMetrics(**{**m, "solver": solver, "refresh_steps": tuple(m["refresh_steps"]),
                                 "lower_bound_steps": tuple(m["lower_bound_steps"]),
                                 "greedy_refresh_steps": tuple(m["greedy_refresh_steps"]),
                                 "peak_memory": {int(d): b for d, b in m["peak_memory"].items()}})
        programs = _programs_of(data["programs"])
        layers = {name: LayerTiming(**t) for name, t in data["layers"].items()}
        placements = tuple(Placement.from_dict(p) for p in data["placements"])
        problem = Problem.from_dict(data["problem"])
        plan = Plan(problem, programs, layers, placements, metrics, data["fingerprint"], version,
                    _programs_of(data["startup"]))
        check_structure(plan)
        return plan
    except PlanFormatError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
        raise PlanFormatError(f"the plan file is malformed (missing or bad entry: {e})") from e


class Method(StrEnum):
    """How the K-FAC work is placed: CP-SAT (least refresh periods, then staleness; warm-started by
    greedy, whose plan it keeps when it finds none better) or the PipeFisher paper's greedy first-fit."""

    CPSAT = "cpsat"
    GREEDY = "greedy"


OVERTIME = 3.0
"""Seconds planning may run past SolverConfig.time_limit_s: greedy placement once CP-SAT's time is up
(fusing curvature to fit a memory budget) may take half; a refusal then solves with the values it would
suggest until OVERTIME past the limit. A single greedy placement is not interrupted, so a planning ends
within time_limit_s + OVERTIME plus at most that."""


@dataclass(frozen=True)
class _Clock:
    """`deadline`: when CP-SAT stops (greedy placement goes on); `cutoff`: when planning gives up; both
    on `meter`'s clock (wall seconds, or deterministic seconds: planner/budget.py)."""

    meter: Meter
    deadline: float
    cutoff: float
    made: dict[tuple[Problem, Method], Plan] = field(default_factory=dict)
    """Plans made on this clock's planning (its TimeBox's), by problem and method."""

    def solver_time(self) -> float:
        """Time CP-SAT has left, in the meter's unit (<= 0: place greedily)."""
        return self.deadline - self.meter.now()

    def left(self) -> float:
        """Time left before planning gives up, in the meter's unit."""
        return self.cutoff - self.meter.now()

    def out(self) -> bool:
        """Whether planning must give up now: at the cutoff, or past the meter's wall-clock safety cap."""
        if self.meter.now() >= self.cutoff:
            return True
        if self.meter.wall_left() <= 0:
            self.meter.note_capped("searching on")
            return True
        return False

    def later(self, deadline: float, cutoff: float | None = None) -> _Clock:
        """The same meter with another deadline (and cutoff)."""
        return _Clock(self.meter, deadline, self.cutoff if cutoff is None else cutoff, self.made)


class TimeBox:
    """The clock of one whole planning, all its solves and retries ([Note: time limit]): CP-SAT time ends
    config.time_limit_s after it opened, everything else OVERTIME after that; it keeps the plans it made."""

    def __init__(self, config: SolverConfig) -> None:
        self.meter = meter(config.deterministic, config.time_limit_s, OVERTIME)
        self.end = self.meter.now() + self.meter.units(config.time_limit_s)
        self.overtime = self.meter.units(OVERTIME)
        self.made: dict[tuple[Problem, Method], Plan] = {}

    def solving(self, shares: int = 1) -> _Clock:
        """One solve's clock: an equal share of the CP-SAT time left among the `shares` solves still to run;
        greedy placement may go on until OVERTIME / 2 past the box's end."""
        now = self.meter.now()
        deadline = now + max(0.0, self.end - now) / shares
        return _Clock(self.meter, deadline, max(deadline, self.end + self.overtime / 2), self.made)

    def over(self) -> bool:
        """Whether the time for solving is spent, greedy's OVERTIME / 2 past the limit included."""
        return self.solving().out()

    def suggesting(self) -> _Clock:
        """The clock of a refusal's search for values that plan: until OVERTIME past the end (or half of it
        from now, when an uninterrupted greedy placement ran past that)."""
        until = max(self.end + self.overtime, self.meter.now() + self.overtime / 2)
        return _Clock(self.meter, until, until, self.made)


class _Refused(Exception):
    """A refusal before suggestions: the error for the user, the knobs that may lift it (searched in
    this order), and the layers fused by then."""

    def __init__(self, error: PlanError, knobs: tuple[Knob, ...], fused: frozenset[str] = frozenset()) -> None:
        super().__init__(str(error))
        self.error, self.knobs, self.fused = error, knobs, fused


def aggregates(problem: Problem, group: StageGroup, config: SolverConfig, allowed: Allowance) -> bool:
    """Whether `solve` places the group's curvature as one STATS task per F/B (`_aggregate`): for a distribution
    choice made beside `solve` (planner/choose.py), which places the same tasks."""
    return _aggregate(problem, group, config, allowed)


def assemble(problem: Problem, solutions: Sequence[GroupSolution], greedy: list[GroupSolution | None],
             allowed: Allowance, wall: float) -> Plan:
    """The plan of one solution per stage group, nothing fused, assembled as `solve` assembles its own (`greedy`:
    the paper's rule per group, for the metrics): the entry of a distribution choice made beside `solve`
    (planner/choose.py), whose solutions are of `problem`'s own windows."""
    placed: list[GroupSolution | None] = list(solutions)
    return _assemble(problem, _Attempt(_same_stretch(placed), greedy, allowed), frozenset(), wall)


def _aggregate(problem: Problem, group: StageGroup, config: SolverConfig, allowed: Allowance) -> bool:
    """One STATS task per F/B for all layers when the group has many (config.aggregate decides when set),
    unless such a task is longer than every bubble the allowance leaves (per-layer tasks may still fit)."""
    if config.aggregate is not None:
        return config.aggregate
    per_layer = sum(len(copies_of_stage(problem, s)) * 2 * problem.N * len(problem.costs.stages[s].layers)
                    for s in group.stages)
    if per_layer <= config.aggregate_above:
        return False
    window = allowed.window(group, 2, allowed.ticks(problem.max_period), aggregate=True,
                            resolution=config.time_resolution)
    gaps = longest_gaps(window)
    return all(t.ticks <= gaps[t.devices[0]] for t in window.tasks if t.kind is TaskKind.CURV)


def _overhead_period(problem: Problem, fused: frozenset[str]) -> int:
    """The least common period that amortizes the fused refresh step's extra time within max_overhead."""
    if not fused:
        return 1
    extra = step_timeline(problem, fused).length - step_timeline(problem).length
    if extra <= 1e-12:
        return 1
    allowed = problem.max_overhead * step_timeline(problem).length
    if allowed <= 0:
        return problem.max_period + 1
    return max(1, math.ceil(extra / allowed - 1e-9))


@dataclass
class _Attempt:
    """Solutions per group for one set of fused layers (None where no k worked)."""

    solutions: list[GroupSolution | None]
    greedy: list[GroupSolution | None]
    allowance: Allowance


def _solve_groups(problem: Problem, fused: frozenset[str], config: SolverConfig, method: Method,
                  min_k: int, clock: _Clock) -> _Attempt:
    """Every stage group's solution at refresh periods >= min_k: greedy, then CP-SAT warm-started by it
    while the clock leaves CP-SAT time (greedy's alone after that, where it fits the budget)."""
    from fxkfac.planner.greedy import greedy_group

    groups = stage_groups(problem)
    solutions: list[GroupSolution | None] = []
    greedy: list[GroupSolution | None] = []
    allowed = allowance(problem, fused, config)
    for n, group in enumerate(groups):
        aggregate = _aggregate(problem, group, config, allowed)
        long = too_long(allowed.window(group, max(2, min_k), allowed.ticks(problem.max_period), aggregate=aggregate,
                                       resolution=config.time_resolution))
        if long:
            raise _Refused(PlanError(
                f"some {words_of(problem.costs).name} work cannot fit any bubble, whatever the refresh period"
                + (f", even with the step stretched by max_overhead={problem.max_overhead:g}"
                   if allowed.enabled else "")
                + ": " + "; ".join(long[:5])
                + ("" if config.stretch else ". Stretching the step is off (SolverConfig.stretch=False)")),
                (Knob.MAX_OVERHEAD, Knob.MICROBATCHES) if config.stretch else (Knob.MICROBATCHES,), fused)
        lower = refresh_lower_bound(problem, group, fused, stretch=allowed.enabled)
        if lower > problem.max_period:
            raise _Refused(PlanError(
                f"the {words_of(problem.costs).name} work of stages {list(group.stages)} is more than the idle time "
                f"of {problem.max_period} steps holds" + (f", even with the step stretched by max_overhead="
                                                          f"{problem.max_overhead:g}" if allowed.enabled else "")),
                (Knob.MAX_OVERHEAD, Knob.MICROBATCHES) if config.stretch else (Knob.MICROBATCHES,), fused)
        try:
            g = greedy_group(problem, group, fused, aggregate=aggregate, resolution=config.time_resolution,
                             min_k=min_k, allowance=allowed, meter=clock.meter)
        except PlanError:
            g = None
        greedy.append(g)
        left = clock.solver_time()
        if method is Method.GREEDY or left <= 0:
            solutions.append(g if g is not None and fits_memory(g) else None)
            continue
        from fxkfac.planner.cpsat import solve_group

        if problem.memory_budget is not None:
            left /= 2  # leave time for the rounds that fuse more curvature if this one finds no fit
        share = max(clock.meter.units(0.1), left / (len(groups) - n))
        solutions.append(solve_group(problem, group, fused, config, share, clock.meter, g, aggregate=aggregate,
                                     min_k=min_k, allowance=allowed))
    return _Attempt(_same_stretch(solutions), greedy, allowed)


def _same_stretch(solutions: list[GroupSolution | None]) -> list[GroupSolution | None]:
    """Every group at the largest stretch any needs: the step is one for all ranks ([Note: stretch]).
    A group moved to a longer stretch keeps its staleness, which the longer one might better: no
    longer proven optimal (unless it is 0)."""
    if not all(solutions):
        return solutions
    stretch = max(s.window.stretch for s in solutions)  # type: ignore[union-attr]  # all() above: none is None
    out: list[GroupSolution | None] = []
    for s in solutions:
        moved = restretch(s, stretch)  # type: ignore[arg-type]  # all() above: none is None
        if moved is not s and moved.status == "OPTIMAL" and any(moved.use_offset.values()):
            moved = replace(moved, status="FEASIBLE")
        out.append(moved)
    return out


def _overhead_estimate(problem: Problem, fused: frozenset[str], config: SolverConfig, method: Method,
                       until: _Clock) -> tuple[float | None, bool]:
    """The max_overhead that stretching the step needs at the longest refresh period (rounded up to 3
    digits), and whether it is proven least (CP-SAT refines greedy's stretch while time is left); None
    when stretching is off or no stretch up to 10 reference steps places the work."""
    from fxkfac.planner.greedy import greedy_overhead

    if not config.stretch:
        return None, False
    grid = Allowance(problem, fused, grid_scale(problem, range(problem.num_stages), fused, config.time_resolution))
    upper, proven = 0, True
    for group in stage_groups(problem):
        low, found = greedy_overhead(problem, group, grid, aggregate=_aggregate(problem, group, config, grid),
                                     resolution=config.time_resolution, meter=until.meter)
        if found is None:
            return None, False
        least = found.window.stretch <= low
        left = until.left()
        if method is Method.CPSAT and not least and left > 0:
            from fxkfac.planner.cpsat import refine_stretch

            found, least = refine_stretch(found, grid, config, until.meter,
                                          min(until.meter.units(min(5.0, config.time_limit_s)), left / 2))
        upper, proven = max(upper, found.window.stretch), proven and least
    need = _overhead(problem, fused, problem.max_period, upper, grid)
    return (_sig_up(need) if need > 0 else None), proven


def _overhead(problem: Problem, fused: frozenset[str], k: int, ticks: int, grid: Allowance) -> float:
    """max_overhead that a stretch of `ticks` per step at period k needs, fused curvature included."""
    normal = step_timeline(problem).length
    return (ticks / grid.scale[0] + (step_timeline(problem, fused).length - normal) / k) / normal  # type: ignore[index]  # the allowance has a grid


def _sig_up(x: float, digits: int = 3) -> float:
    """`x` > 0 rounded up to `digits` significant digits: a value to type that is never short (its
    shortest decimal text is what `f"{x:g}"` prints and float() reads back)."""
    quantum = Decimal(1).scaleb(math.floor(math.log10(x)) - digits + 1)
    return float((Decimal(repr(x)) / quantum).to_integral_value(rounding=ROUND_CEILING) * quantum)


_BYTE_UNITS = ((1 << 30), (1 << 20), (1 << 10))


def _bytes_up(n: float) -> int:
    """`n` bytes rounded up to two decimals of GiB, MiB or KiB (whole bytes below 1 KiB), as the CLI
    reads '84.47GiB': int(float('84.47') * 2**30)."""
    for unit in _BYTE_UNITS:
        if n >= unit:
            hundredths = math.ceil(n * 100 / unit - 1e-6)
            while int(float(f"{hundredths / 100:.2f}") * unit) < n:
                hundredths += 1
            return int(float(f"{hundredths / 100:.2f}") * unit)
    return math.ceil(n)


def _next_fused(problem: Problem, attempt: _Attempt, fused: frozenset[str], *,
                by_excess: bool) -> frozenset[str] | None:
    """Fuse more layers (largest kept bytes first) in every group that found no plan: one, or with
    `by_excess` as many as the greedy placement's bytes over the budget call for (a layer saves at most
    its a and e of every micro-batch, so this never fuses more than that placement needs); None if none
    is left."""
    groups = stage_groups(problem)
    more = set(fused)
    for group, solution, first in zip(groups, attempt.solutions, attempt.greedy):
        if solution is not None:
            continue
        candidates = sorted((x for s in group.stages for x in problem.costs.stages[s].layers
                             if x.name not in fused and _captures(x)),
                            key=lambda x: (x.capture_bytes, x.name), reverse=True)
        if not candidates:
            return None
        excess = _excess(problem, first) if by_excess and first is not None else 0
        saved = 0
        for x in candidates:
            more.add(x.name)
            saved += x.capture_bytes * problem.N * 2  # both Chimera pipelines at most
            if saved >= excess:
                break
    return frozenset(more)


def _captures(layer: LayerCost) -> bool:
    """Whether the layer has a part fed by a capture of its F/B (only those can be fused; a gradient-fed part
    keeps nothing per micro-batch)."""
    return any(p.after is not OpKind.ALLREDUCE_GRAD for p in layer.parts)


def _excess(problem: Problem, solution: GroupSolution) -> int:
    """Bytes the solution's worst device holds over the memory budget."""
    budget = problem.memory_budget or 0
    return max(peak_bytes(solution.window, solution.starts, d) - budget for d in solution.window.group.devices)


def solve(problem: Problem, config: SolverConfig = SolverConfig(), method: Method | str = Method.CPSAT, *,
          box: TimeBox | None = None, shares: int = 1, suggest: bool = True) -> Plan:
    """Plan the K-FAC work of `problem` (Method.CPSAT: optimal placement warm-started by greedy; GREEDY:
    the paper's rule, fusing curvature by its excess over a memory budget) within config.time_limit_s plus OVERTIME, or within `box` (a planning that solves
    several problems: this one gets 1/`shares` of the solver time left). Raises InfeasibleBudgetError when
    the memory budget cannot be met and PlanError when the work cannot be placed within problem.max_period
    steps; unless `suggest` is False, the error's message and `suggestions` name values of max_overhead, the
    budget or N that the planner has solved this problem with (the rest unchanged), or say that none was
    found in time."""
    how = _method(method)
    box = box or TimeBox(config)
    made = box.made.get((problem, how))
    if made is not None:
        return made  # solved in this box already: while searching for the value a refusal names
    try:
        plan = _attempt(problem, config, how, box.solving(shares), time.perf_counter())
    except _Refused as refused:
        if not suggest:
            raise refused.error from None
        raise _suggesting(refused, problem, config, how, box.suggesting()) from None
    box.made[(problem, how)] = plan
    return plan


def _method(method: Method | str) -> Method:
    try:
        return Method(method)
    except ValueError:
        raise PlanError(f"unknown planning method {method!r}; use 'cpsat' or 'greedy'") from None


def _attempt(problem: Problem, config: SolverConfig, method: Method, clock: _Clock, began: float) -> Plan:
    """One planning run as `solve` describes it, without suggestions: _Refused when it makes no plan.
    With CP-SAT and a budget, greedy placement fusing by its memory excess runs first: quick, and its
    plan is kept when CP-SAT's own rounds of fusing (fewer layers fused) find none before the deadline."""
    _check_budget(problem)
    if method is Method.GREEDY or problem.memory_budget is None or clock.solver_time() <= 0:
        return _placed(problem, config, method, clock, began)
    try:
        fallback = _placed(problem, config, method, clock.later(clock.meter.now()), began)
    except _Refused:
        return _placed(problem, config, method, clock, began)
    try:
        return _placed(problem, config, method, clock.later(clock.deadline, clock.deadline), began)
    except _Refused:
        solver = replace(fallback.metrics.solver, wall_time=time.perf_counter() - began)  # CP-SAT's time too
        return replace(fallback, metrics=replace(fallback.metrics, solver=solver))


def _placed(problem: Problem, config: SolverConfig, method: Method, clock: _Clock, began: float) -> Plan:
    """Place the work, fusing more curvature each round that misses the budget (one layer per group
    while CP-SAT has time; as many as greedy's excess calls for after that, and always with the greedy method,
    whose rounds are not timed) until every group is placed."""
    fused: frozenset[str] = frozenset()
    while True:
        min_k = _overhead_period(problem, fused)
        if min_k > problem.max_period:
            raise _Refused(_fusing_refused(problem, fused), (Knob.MEMORY_BUDGET, Knob.MAX_OVERHEAD), fused)
        attempt = _solve_groups(problem, fused, config, method, min_k, clock)
        while fused and all(attempt.solutions) and len({s.window.k for s in attempt.solutions}) > 1:  # type: ignore[union-attr]  # all() first
            common = max(s.window.k for s in attempt.solutions)  # type: ignore[union-attr]  # all() above
            attempt = _solve_groups(problem, fused, config, method, common, clock)
        if all(attempt.solutions):
            return _assemble(problem, attempt, fused, time.perf_counter() - began)
        if problem.memory_budget is None or _short_of_time(attempt, fused):
            raise _unplaced(problem, attempt, fused, config, method)
        greedy = method is Method.GREEDY
        nxt = _next_fused(problem, attempt, fused, by_excess=greedy or clock.solver_time() <= 0)
        if nxt is None or (clock.out() and not greedy):
            bad = [g.stages for g, s in zip(stage_groups(problem), attempt.solutions) if s is None]
            why = "even with all their curvature fused" if nxt is None else (
                f"before the time limit ({config.time_limit_s:g} s + {OVERTIME / 2:g} s) ran out, "
                f"{len(fused)} layers fused")
            raise _Refused(InfeasibleBudgetError(
                f"no placement of stages {bad} within the memory budget {format_bytes(problem.memory_budget)} "
                f"per device was found {why}"), (Knob.MEMORY_BUDGET, Knob.MAX_OVERHEAD), fused)
        log.info("fusing curvature of %s to fit the memory budget", sorted(nxt - fused))
        fused = nxt


def _short_of_time(attempt: _Attempt, fused: frozenset[str]) -> bool:
    """Whether a group is unplaced for want of time, not memory: before any fusing, greedy (which ignores the
    budget) placed it nowhere either, and fusing only lengthens F/B. Its refusal then names max_overhead or N,
    not the memory budget (pure data parallelism at max_overhead 0 has no bubble to fill)."""
    return not fused and any(s is None and g is None for s, g in zip(attempt.solutions, attempt.greedy))


def _unplaced(problem: Problem, attempt: _Attempt, fused: frozenset[str], config: SolverConfig,
              method: Method) -> _Refused:
    """The refusal when some group has no placement for want of bubble time (no budget, or greedy placed it
    nowhere before any fusing)."""
    bad = [g.stages for g, s in zip(stage_groups(problem), attempt.solutions) if s is None]
    timed = f", or the time limit ({config.time_limit_s:g} s) was" if method is Method.CPSAT else ""
    return _Refused(PlanError(f"no placement of the {words_of(problem.costs).name} work of stages {bad} within "
                              f"{problem.max_period} steps "
                              f"({method.value}{_stretched(problem, config)}): the bubbles are too short{timed}"),
                    (Knob.MAX_OVERHEAD, Knob.MICROBATCHES), fused)


def _stretched(problem: Problem, config: SolverConfig) -> str:
    return f", the step stretched by up to max_overhead={problem.max_overhead:g}" \
        if config.stretch and problem.max_overhead > 0 else ""


def _check_budget(problem: Problem) -> None:
    if problem.memory_budget is None:
        return
    need = min_memory_bytes(problem)
    if problem.memory_budget < need:
        raise _Refused(InfeasibleBudgetError(
            f"memory budget {problem.memory_budget} bytes ({format_bytes(problem.memory_budget)}) per device is below "
            f"the least any plan needs: {need} bytes ({format_bytes(need)}) = parameters and gradients, factors and "
            "inverses, the optimizer state of the preconditioned layers, and the activation peak with all curvature "
            "fused (which max_overhead must pay for)",
            need), (Knob.MEMORY_BUDGET,))


def _fusing_refused(problem: Problem, fused: frozenset[str]) -> InfeasibleBudgetError:
    extra = step_timeline(problem, fused).length - step_timeline(problem).length
    names = sorted(fused)
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return InfeasibleBudgetError(
        f"the memory budget {format_bytes(problem.memory_budget or 0)} per device does not fit the a and e kept "
        f"for deferred curvature; fusing the curvature of {len(names)} layers ({shown}) adds {extra:.4g} s to each "
        f"refresh step, more than max_overhead={problem.max_overhead:g} allows within {problem.max_period} steps")


# Suggestions: each refusal searches the knobs that may lift it, upward from the refused value, and
# names only values it has solved the problem with (everything else unchanged).


def _suggesting(refused: _Refused, problem: Problem, config: SolverConfig, method: Method,
                until: _Clock) -> PlanError:
    """The refusal's error with the values that plan, searched until `until`: each knob alone; where
    none does and a budget is set, max_overhead and the budget together; then more micro-batches."""
    found: list[Suggestion] = []
    searched: list[str] = []
    stages: list[tuple[Knob, ...]] = [(knob,) for knob in refused.knobs if knob is not Knob.MICROBATCHES]
    if problem.memory_budget is not None and {Knob.MAX_OVERHEAD, Knob.MEMORY_BUDGET} & set(refused.knobs):
        stages.append((Knob.MAX_OVERHEAD, Knob.MEMORY_BUDGET))
    if Knob.MICROBATCHES in refused.knobs:
        stages.append((Knob.MICROBATCHES,))
    for knobs in stages:
        if until.out() or (len(knobs) > 1 or knobs == (Knob.MICROBATCHES,)) and found:
            break
        searched.append(_SEARCHED[knobs].format(N=4 * problem.N))
        search = _search_together if len(knobs) > 1 else _SEARCHES[knobs[0]]
        suggestion = search(problem, refused.fused, config, method, until)
        if suggestion is not None:
            found.append(suggestion)
    text = f"{refused.error}. {_suggestion_text(problem, config, found, searched, until.out())}"
    error = refused.error
    if isinstance(error, InfeasibleBudgetError):
        return InfeasibleBudgetError(text, error.needed_bytes, suggestions=tuple(found))
    return PlanError(text, suggestions=tuple(found))


def _suggestion_text(problem: Problem, config: SolverConfig, found: list[Suggestion], searched: list[str],
                     timed_out: bool) -> str:
    if found:
        return "Solved with: " + "; or ".join(_describe(problem, s) for s in found)
    if timed_out:
        return (f"Nothing that plans it was found before the time ran out ({config.time_limit_s:g} s + "
                f"{OVERTIME:g} s): "
                f"searched {'; '.join(searched) or 'nothing'}; a longer time limit searches further")
    return f"Nothing plans it: no {'; no '.join(searched)}"


_SEARCHED = {(Knob.MAX_OVERHEAD,): "max_overhead below 10",
             (Knob.MEMORY_BUDGET,): "memory budget from the peak of a plan made without one",
             (Knob.MAX_OVERHEAD, Knob.MEMORY_BUDGET): "max_overhead with a memory budget",
             (Knob.MICROBATCHES,): "number of micro-batches from 1 to {N}"}
"""What each search tries, for the message that says none of it plans."""


def _describe(problem: Problem, s: Suggestion) -> str:
    """A suggestion in words: every value as `field=value`."""
    words = []
    for knob, value in s.changes:
        if knob is Knob.MAX_OVERHEAD:
            words.append(f"max_overhead={value:g}")
        elif knob is Knob.MEMORY_BUDGET:
            words.append(f"memory_budget={value} bytes ({format_bytes(value)})")
        else:
            words.append(f"N={value} micro-batches (of the same size)")
    text = " with ".join(words)
    if s.least:
        text += (", the least max_overhead that places it (rounded up to 3 digits; refresh every "
                 f"{problem.max_period} steps)")
    if [knob for knob, _ in s.changes] == [Knob.MEMORY_BUDGET]:
        text += f" at max_overhead={problem.max_overhead:g}"
    return text


def _plans(problem: Problem, config: SolverConfig, method: Method, until: _Clock, *, thorough: bool = False) -> bool:
    """Whether `solve` makes a plan of `problem`: with greedy placement first (CP-SAT's first pass, whose
    plan it keeps), then, `thorough` and with method CP-SAT, with CP-SAT itself within the time left."""
    return _plan_or_none(problem, config, method, until, thorough=thorough) is not None


def _plan_or_none(problem: Problem, config: SolverConfig, method: Method, until: _Clock, *,
                  thorough: bool = False) -> Plan | None:
    made = until.made.get((problem, method))
    if made is not None:
        return made
    now = until.meter.now()
    tries = [now] + ([min(until.cutoff, now + until.meter.units(config.time_limit_s))]
                     if thorough and method is Method.CPSAT else [])
    for deadline in tries:
        if until.out():
            return None
        try:
            plan = _attempt(problem, config, method, until.later(deadline), time.perf_counter())
        except _Refused:
            continue
        until.made[(problem, method)] = plan
        return plan
    return None


def _search_overhead(problem: Problem, fused: frozenset[str], config: SolverConfig, method: Method,
                     until: _Clock) -> Suggestion | None:
    """A max_overhead that plans: from greedy's stretch estimate doubling, checked by greedy placement (then,
    with CP-SAT, by CP-SAT itself); then, while time is left, CP-SAT's least stretch (checked by CP-SAT,
    named least where proven) or a few bisection probes below it."""
    estimate, proven = _overhead_estimate(problem, fused, config, Method.GREEDY, until)
    ladder = _ladder(max(estimate or 0.0, problem.max_overhead * 1.01, 1e-4), problem.max_overhead)
    for thorough in (False, True) if method is Method.CPSAT else (False,):
        failed = problem.max_overhead
        for candidate in ladder:
            if _plans(replace(problem, max_overhead=candidate), config, method, until, thorough=thorough):
                break
            if until.out():
                return None
            failed = candidate
        else:
            continue
        break
    else:
        return None
    if proven and candidate == estimate:
        return Suggestion(((Knob.MAX_OVERHEAD, candidate),), least=True)
    if method is Method.CPSAT:
        least, proven = _overhead_estimate(problem, fused, config, method, until)
        if least is not None and failed < least < candidate and \
                _plans(replace(problem, max_overhead=least), config, method, until, thorough=True):
            return Suggestion(((Knob.MAX_OVERHEAD, least),), least=proven)
    return Suggestion(((Knob.MAX_OVERHEAD, _bisect_down(problem, config, method, until, failed, candidate)),))


def _ladder(start: float, above: float) -> list[float]:
    """max_overhead values to try: `start` doubling, 3 significant digits, above `above` and below 10."""
    values, x = [], _sig_up(start)
    while x < 10:
        if x > above:
            values.append(x)
        x = _sig_up(x * 2)
    return values


def _bisect_down(problem: Problem, config: SolverConfig, method: Method, until: _Clock, failed: float,
                 works: float) -> float:
    """A smaller max_overhead than `works` that still plans (a few probes between it and `failed`)."""
    for _ in range(4):
        middle = _sig_up((failed + works) / 2)
        if not failed < middle < works:
            break
        if _plans(replace(problem, max_overhead=middle), config, method, until):
            works = middle
        elif until.out():
            break
        else:
            failed = middle
    return works


def _search_memory(problem: Problem, fused: frozenset[str], config: SolverConfig, method: Method,
                   until: _Clock) -> Suggestion | None:
    """A memory budget that plans at the problem's max_overhead: the peak of the plan made without a
    budget, rounded up (raised by a quarter while it does not plan)."""
    free = _plan_or_none(replace(problem, memory_budget=None), config, method, until)
    if free is None:
        return None
    budget = _bytes_up(max(max(free.metrics.peak_memory.values()), min_memory_bytes(problem),
                           (problem.memory_budget or 0) + 1))
    for _ in range(4):
        if _plans(replace(problem, memory_budget=budget), config, method, until):
            return Suggestion(((Knob.MEMORY_BUDGET, budget),))
        budget = _bytes_up(budget * 1.25)
    return None


def _search_microbatches(problem: Problem, fused: frozenset[str], config: SolverConfig, method: Method,
                         until: _Clock) -> Suggestion | None:
    """The nearest N (valid for the schedule) that plans: fewer first (less curvature per step for the
    same bubbles), then more, up to 4 times this one."""
    for n in [*range(problem.N - 1, 0, -1), *range(problem.N + 1, 4 * problem.N + 1)]:
        try:
            candidate = replace(problem, N=n)
        except ScheduleError:
            continue
        if _plans(candidate, config, method, until):
            return Suggestion(((Knob.MICROBATCHES, n),))
        if until.out():
            return None
    return None


def _search_together(problem: Problem, fused: frozenset[str], config: SolverConfig, method: Method,
                     until: _Clock) -> Suggestion | None:
    """A max_overhead that plans without the budget, and a budget that plans at it."""
    overhead = _search_overhead(replace(problem, memory_budget=None), frozenset(), config, method, until)
    if overhead is None:
        return None
    value = overhead.fields()["max_overhead"]
    memory = _search_memory(replace(problem, max_overhead=value), fused, config, method, until)
    return None if memory is None else Suggestion(((Knob.MAX_OVERHEAD, value),) + memory.changes)


_SEARCHES = {Knob.MAX_OVERHEAD: _search_overhead, Knob.MEMORY_BUDGET: _search_memory,
             Knob.MICROBATCHES: _search_microbatches}


_PLACED_KINDS = frozenset({OpKind.STATS, OpKind.APPLY, OpKind.BCAST_PREC, OpKind.OPT_STEP})
"""Ops of the reference step that a plan places itself (the per-step slot: gradient STATS, APPLY, BCAST_PREC) or
appends (OPT_STEP)."""


def _program(problem: Problem, w: Window, device: int, placed: list[Placement]) -> Program:
    """The device's ops per step of the period, in time order: an op placed in a bubble goes after
    every fixed op that ends by its start (so a RECV still waiting stays after it). Compared in
    ticks: in seconds, float rounding could put a APPLY before the backward it follows."""
    steps: list[list[tuple[tuple[int, int, int], Op]]] = [[] for _ in range(w.k)]
    timelines = [step_timeline(problem, w.fused)] + [step_timeline(problem)] * (w.k - 1)
    for j, st in enumerate(timelines):
        for seq, (op, _, end) in enumerate(st.ops[device]):
            if op.kind not in _PLACED_KINDS:
                steps[j].append(((w.offsets[j] + round(end * w.scale), 0, seq), op))
    for n, p in enumerate(sorted(placed, key=lambda p: (p.start, p.end))):
        steps[p.step % w.k].append(((round(p.start * w.scale) - w.length * (p.step // w.k), 1, n), p.op))
    return [[op for _, op in sorted(items, key=lambda item: item[0])] + [Op(OpKind.OPT_STEP)] for items in steps]


def _utilization(problem: Problem, w: Window, placed: list[Placement], device: int) -> float:
    """The device's planned utilization: its F/B and placed work over the window."""
    timelines = [step_timeline(problem, w.fused)] + [step_timeline(problem)] * (w.k - 1)
    busy = sum(b - a for st in timelines for _, a, b in st.fixed(device))
    busy += sum(p.end - p.start for p in placed if p.device == device and p.op.kind in BUSY_KINDS)
    return utilization(busy, w.seconds(w.length))


def _assemble(problem: Problem, attempt: _Attempt, fused: frozenset[str], wall: float) -> Plan:
    groups = stage_groups(problem)
    programs: dict[int, Program] = {}
    layers: dict[str, LayerTiming] = {}
    placements: list[Placement] = []
    peak: dict[int, int] = {}
    per_device: dict[int, float] = {}
    refresh, bound = [0] * problem.num_stages, [0] * problem.num_stages
    greedy_k: list[int | None] = [None] * problem.num_stages
    for group, sol, g in zip(groups, attempt.solutions, attempt.greedy):
        assert sol is not None
        w, placed = sol.window, placements_of(sol)
        placements += placed
        for d in group.devices:
            programs[d] = _program(problem, w, d, [p for p in placed if p.device == d])
            peak[d] = peak_bytes(w, sol.starts, d)
            per_device[d] = _utilization(problem, w, placed, d)
        for s in group.stages:
            lower = refresh_lower_bound(problem, group, fused, stretch=attempt.allowance.enabled)
            refresh[s], bound[s] = w.k, max(sol.k_lower_bound, lower)
            greedy_k[s] = g.window.k if g is not None else None
            for x in problem.costs.stages[s].layers:
                layers[x.name] = LayerTiming(w.k, 0, sol.use_offset[x.name], "fused" if x.name in fused else "deferred")
    sols = [s for s in attempt.solutions if s is not None]
    statuses = {s.status for s in sols}
    status = "GREEDY" if all(s.method == "greedy" for s in sols) else \
        "OPTIMAL" if statuses == {"OPTIMAL"} else "FEASIBLE"
    stats = SolverStats(status, wall, (sum(refresh), sum(t.use_offset for t in layers.values())),
                        (sum(refresh) - sum(bound)) / max(1, sum(refresh)))
    metrics = PlanMetrics(
        utilization_baseline=plain_utilization(problem), utilization=sum(per_device.values()) / len(per_device),
        refresh_steps=tuple(refresh), step_time_baseline=plain_step_time(problem),
        step_time=max(s.window.seconds(s.window.length) / s.window.k for s in sols),
        step_time_reference=step_timeline(problem).length, peak_memory=dict(sorted(peak.items())),
        lower_bound_steps=tuple(bound), solver=stats, greedy_refresh_steps=tuple(greedy_k),
        time_quantum=0.0 if all(s.window.exact for s in sols) else max(s.window.tick for s in sols),
        stretch=max(s.window.seconds(s.window.stretch) for s in sols))
    programs = dict(sorted(programs.items()))
    return Plan(problem, programs, layers, tuple(placements), metrics, problem.fingerprint,
                startup=startup_programs(programs, born_steps(placements)))

