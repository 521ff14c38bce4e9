"""Plans: per-rank programs with K-FAC work in the bubbles, metrics, JSON files, and `solve()`.

`solve(problem, config, method)` is the planner's single entry point: it refuses a budget below the
least memory any plan needs, solves every stage group (greedy, then CP-SAT warm-started by it),
fuses the curvature of the layers that do not fit the budget deferred (largest kept bytes first,
when max_overhead allows the time they add), gives every group the same stretch of the step (the
largest any group needs, [Note: stretch] in planner/window.py), and assembles the Plan.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

from fxkfac.planner.errors import InfeasibleBudgetError, PlanError, PlanFormatError, PlanMismatchError
from fxkfac.planner.ir import LayerTiming, Op, OpKind, Program, format_program, parse_program
from fxkfac.planner.lowering import startup_programs
from fxkfac.planner.problem import (
    Problem,
    SolverConfig,
    StageGroup,
    copies_of_stage,
    format_bytes,
    min_memory_bytes,
    plain_step_time,
    refresh_lower_bound,
    stage_groups,
    step_timeline,
)
from fxkfac.planner.stretch import Allowance, allowance, restretch
from fxkfac.planner.window import (
    GroupSolution,
    Placement,
    born_steps,
    Window,
    fits_memory,
    grid_scale,
    longest_gaps,
    peak_bytes,
    placements_of,
    too_long,
)

__all__ = ["SCHEMA_VERSION", "SolverStats", "PlanMetrics", "Plan", "solve"]

SCHEMA_VERSION = 3
"""Version of the plan JSON layout; a newer file asks the user to upgrade fxkfac, an older one to re-plan.
2: every step ends with a barrier (the KL-clip and loss all-reduces), so no K-FAC task spans a step boundary.
3: the plan holds its start-up steps (`Plan.startup`), so it lists every op every rank runs."""

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SolverStats:
    """How the plan was found: status (OPTIMAL: every refresh period proven minimal and staleness
    optimal; FEASIBLE; GREEDY: the greedy plan was kept), wall time (s), objective (sum of refresh
    periods over stages, sum of use offsets) and gap (of the refresh periods to the proven bounds)."""

    status: str
    wall_time: float
    objective: tuple[int, int]
    gap: float


@dataclass(frozen=True)
class PlanMetrics:
    """What a plan achieves: utilization before/after (busy / device time, mean over devices),
    refresh period and lower bound per stage, step times (plain pipeline, with preconditioning as
    planned, the reference with PREC after the all-reduce), peak memory per device, the greedy
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
        """Read and parse a plan file, not yet validated against its problem (see `load`)."""
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise PlanFormatError(f"cannot read the plan file {path}: {e}") from e
        return cls.from_json(text)

    @classmethod
    def load(cls, path: str | Path, *, expect_fingerprint: str | None = None) -> Plan:
        """Read and validate a plan; PlanMismatchError when made for another graph."""
        from fxkfac.planner.validate import check_plan

        plan = cls.read(path)
        if expect_fingerprint is not None and plan.fingerprint != expect_fingerprint:
            raise PlanMismatchError(f"{path} was made for graph {plan.fingerprint!r}, not {expect_fingerprint!r}; "
                                    "make a new plan for this model, mesh and schedule (fxkfac plan ... --export)")
        check_plan(plan.problem, plan)
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


def _aggregate(problem: Problem, group: StageGroup, config: SolverConfig, allowed: Allowance) -> bool:
    """One CURV task per F/B for all layers when the group has many (config.aggregate decides when set),
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
    return all(t.ticks <= gaps[t.devices[0]] for t in window.tasks if t.kind == "curv")


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


def _solve_groups(problem: Problem, fused: frozenset[str], config: SolverConfig, method: str,
                  min_k: int, deadline: float) -> _Attempt:
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
            raise PlanError("some K-FAC work cannot fit any bubble, whatever the refresh period"
                            + (f", even with the step stretched by max_overhead={problem.max_overhead:g}"
                               if allowed.enabled else "") + ": " + "; ".join(long[:5]) + ". "
                            + _overhead_hint(problem, fused, config, method) + "; or use more micro-batches or stages "
                            "(longer bubbles), or split the layer")
        try:
            g = greedy_group(problem, group, fused, aggregate=aggregate, resolution=config.time_resolution,
                             min_k=min_k, allowance=allowed)
        except PlanError:
            g = None
        greedy.append(g)
        if method == "greedy":
            solutions.append(g if g is not None and fits_memory(g) else None)
            continue
        from fxkfac.planner.cpsat import solve_group

        share = max(0.1, (deadline - time.perf_counter()) / (len(groups) - n))
        solutions.append(solve_group(problem, group, fused, config, share, g, aggregate=aggregate, min_k=min_k,
                                     allowance=allowed))
    return _Attempt(_same_stretch(solutions), greedy, allowed)


def _same_stretch(solutions: list[GroupSolution | None]) -> list[GroupSolution | None]:
    """Every group at the largest stretch any needs: the step is one for all ranks ([Note: stretch]).
    A group moved to a longer stretch keeps its staleness, which the longer one might better: no
    longer proven optimal (unless it is 0)."""
    if not all(solutions):
        return solutions
    stretch = max(s.window.stretch for s in solutions)  # type: ignore[union-attr]
    out: list[GroupSolution | None] = []
    for s in solutions:
        moved = restretch(s, stretch)  # type: ignore[arg-type]
        if moved is not s and moved.status == "OPTIMAL" and any(moved.use_offset.values()):
            moved = replace(moved, status="FEASIBLE")
        out.append(moved)
    return out


def _overhead_hint(problem: Problem, fused: frozenset[str], config: SolverConfig, method: str = "cpsat") -> str:
    """What max_overhead would place the work by stretching the step (the least, where the solver
    proves it within a few seconds), for error messages."""
    from fxkfac.planner.greedy import greedy_overhead

    if not config.stretch:
        return "Stretching the step is off (SolverConfig.stretch=False)"
    grid = Allowance(problem, fused, grid_scale(problem, range(problem.num_stages), fused, config.time_resolution))
    k = problem.max_period
    lower = upper = 0
    proven = True
    for group in stage_groups(problem):
        low, found = greedy_overhead(problem, group, grid, aggregate=_aggregate(problem, group, config, grid),
                                     resolution=config.time_resolution)
        if found is None:
            return ("Raising max_overhead cannot help: no stretch up to 10 reference steps places the work "
                    f"(it needs at least {_up(_overhead(problem, fused, k, low, grid))})")
        least = found.window.stretch <= low
        if method == "cpsat" and not least:
            from fxkfac.planner.cpsat import refine_stretch

            found, least = refine_stretch(found, grid, config, min(5.0, config.time_limit_s))
        lower, upper, proven = max(lower, low), max(upper, found.window.stretch), proven and least
    need = _up(_overhead(problem, fused, k, upper, grid))
    where = f"(refresh every {k} steps, the longest max_period allows)"
    if need <= problem.max_overhead:
        return (f"max_overhead={problem.max_overhead:g} is enough ({need} places it {where}) but the {method} "
                "search did not find a placement: raise SolverConfig.time_limit_s (or use method 'cpsat')")
    if proven:
        return f"The least max_overhead that places it is {need} {where}"
    return (f"Raise max_overhead to {need}, which places it {where}; less than "
            f"{_up(_overhead(problem, fused, k, lower, grid))} cannot")


def _overhead(problem: Problem, fused: frozenset[str], k: int, ticks: int, grid: Allowance) -> float:
    """max_overhead that a stretch of `ticks` per step at period k needs, fused curvature included."""
    normal = step_timeline(problem).length
    return (ticks / grid.scale[0] + (step_timeline(problem, fused).length - normal) / k) / normal  # type: ignore[index]


def _up(fraction: float) -> float:
    """A fraction rounded up to 4 decimals (a value to type that is never short)."""
    return math.ceil(fraction * 1e4 - 1e-9) / 1e4


def _next_fused(problem: Problem, attempt: _Attempt, fused: frozenset[str]) -> frozenset[str] | None:
    """Fuse one more layer (largest kept bytes) in every group that found no plan; None if none is left."""
    groups = stage_groups(problem)
    more = set(fused)
    for group, solution in zip(groups, attempt.solutions):
        if solution is not None:
            continue
        candidates = [x for s in group.stages for x in problem.costs.stages[s].layers if x.name not in fused]
        if not candidates:
            return None
        more.add(max(candidates, key=lambda x: (x.a_bytes + x.e_bytes, x.name)).name)
    return frozenset(more)


def solve(problem: Problem, config: SolverConfig = SolverConfig(), method: str = "cpsat") -> Plan:
    """Plan the K-FAC work of `problem` ("cpsat": optimal placement warm-started by greedy; "greedy":
    the paper's rule). Raises InfeasibleBudgetError when the budget is below what any plan needs, and
    PlanError when some work cannot be placed within problem.max_period steps."""
    if method not in ("cpsat", "greedy"):
        raise PlanError(f"unknown planning method {method!r}; use 'cpsat' or 'greedy'")
    began = time.perf_counter()
    _check_budget(problem)
    fused: frozenset[str] = frozenset()
    deadline = began + config.time_limit_s
    while True:
        min_k = _overhead_period(problem, fused)
        if min_k > problem.max_period:
            raise _fusing_refused(problem, fused)
        attempt = _solve_groups(problem, fused, config, method, min_k, deadline)
        while fused and all(attempt.solutions) and len({s.window.k for s in attempt.solutions}) > 1:  # type: ignore[union-attr]
            common = max(s.window.k for s in attempt.solutions)  # type: ignore[union-attr]
            attempt = _solve_groups(problem, fused, config, method, common, deadline)
        if all(attempt.solutions):
            break
        if problem.memory_budget is None or method == "greedy":
            bad = [g.stages for g, s in zip(stage_groups(problem), attempt.solutions) if s is None]
            raise PlanError(f"no placement of the K-FAC work of stages {bad} within {problem.max_period} steps "
                            f"({method}{_stretched(problem, config)}): the bubbles are too short, or the time limit "
                            f"({config.time_limit_s:g} s) was. {_overhead_hint(problem, fused, config, method)}")
        nxt = _next_fused(problem, attempt, fused)
        if nxt is None:
            bad = [g.stages for g, s in zip(stage_groups(problem), attempt.solutions) if s is None]
            raise PlanError(f"no placement found for stages {bad} even with all their curvature fused: the time "
                            f"limit ({config.time_limit_s:g} s) ran out; raise SolverConfig.time_limit_s")
        log.info("fusing curvature of %s to fit the memory budget", sorted(nxt - fused))
        fused = nxt
    return _assemble(problem, attempt, fused, time.perf_counter() - began)


def _stretched(problem: Problem, config: SolverConfig) -> str:
    return f", the step stretched by up to max_overhead={problem.max_overhead:g}" \
        if config.stretch and problem.max_overhead > 0 else ""


def _check_budget(problem: Problem) -> None:
    if problem.memory_budget is None:
        return
    need = min_memory_bytes(problem)
    if problem.memory_budget < need:
        raise InfeasibleBudgetError(
            f"memory budget {problem.memory_budget} bytes ({format_bytes(problem.memory_budget)}) per device is below "
            f"the least any plan needs: {need} bytes ({format_bytes(need)}) = parameters and gradients, factors and "
            "inverses, and the activation peak with all curvature fused; raise the budget or use more stages",
            need)


def _fusing_refused(problem: Problem, fused: frozenset[str]) -> InfeasibleBudgetError:
    extra = step_timeline(problem, fused).length - step_timeline(problem).length
    return InfeasibleBudgetError(
        f"the memory budget {format_bytes(problem.memory_budget or 0)} does not fit the a/e kept by deferred "
        f"curvature; fusing {sorted(fused)} adds {extra:.4g} s to each refresh step, more than max_overhead="
        f"{problem.max_overhead:g} allows within {problem.max_period} steps; raise max_overhead (e.g. "
        f"{extra / (problem.max_period * step_timeline(problem).length):.2%}) or the memory budget", None)


def _program(problem: Problem, w: Window, device: int, placed: list[Placement]) -> Program:
    """The device's ops per step of the period, in time order: an op placed in a bubble goes after
    every fixed op that ends by its start (so a RECV still waiting stays after it). Compared in
    ticks: in seconds, float rounding could put a PREC before the backward it follows."""
    steps: list[list[tuple[tuple[int, int, int], Op]]] = [[] for _ in range(w.k)]
    timelines = [step_timeline(problem, w.fused)] + [step_timeline(problem)] * (w.k - 1)
    for j, st in enumerate(timelines):
        for seq, (op, _, end) in enumerate(st.ops[device]):
            if op.kind not in (OpKind.PREC, OpKind.OPT_STEP):
                steps[j].append(((w.offsets[j] + round(end * w.scale), 0, seq), op))
    for n, p in enumerate(sorted(placed, key=lambda p: (p.start, p.end))):
        steps[p.step % w.k].append(((round(p.start * w.scale) - w.length * (p.step // w.k), 1, n), p.op))
    return [[op for _, op in sorted(items, key=lambda item: item[0])] + [Op(OpKind.OPT_STEP)] for items in steps]


def _utilization(problem: Problem, w: Window, placed: list[Placement], device: int) -> float:
    timelines = [step_timeline(problem, w.fused)] + [step_timeline(problem)] * (w.k - 1)
    busy = sum(b - a for st in timelines for _, a, b in st.fixed(device))
    busy += sum(p.end - p.start for p in placed if p.device == device and p.op.kind in (OpKind.CURV, OpKind.INV, OpKind.PREC))
    return busy / w.seconds(w.length)


def _assemble(problem: Problem, attempt: _Attempt, fused: frozenset[str], wall: float) -> Plan:
    groups = stage_groups(problem)
    programs: dict[int, Program] = {}
    layers: dict[str, LayerTiming] = {}
    placements: list[Placement] = []
    peak: dict[int, int] = {}
    utilization: dict[int, float] = {}
    refresh, bound, greedy_k = [0] * problem.num_stages, [0] * problem.num_stages, [None] * problem.num_stages
    for group, sol, g in zip(groups, attempt.solutions, attempt.greedy):
        assert sol is not None
        w, placed = sol.window, placements_of(sol)
        placements += placed
        for d in group.devices:
            programs[d] = _program(problem, w, d, [p for p in placed if p.device == d])
            peak[d] = peak_bytes(w, sol.starts, d)
            utilization[d] = _utilization(problem, w, placed, d)
        for s in group.stages:
            lower = refresh_lower_bound(problem, group, fused, stretch=attempt.allowance.enabled)
            refresh[s], bound[s] = w.k, max(sol.k_lower_bound, lower)
            greedy_k[s] = g.window.k if g is not None else None  # type: ignore[call-overload]
            for x in problem.costs.stages[s].layers:
                layers[x.name] = LayerTiming(w.k, 0, sol.use_offset[x.name], "fused" if x.name in fused else "deferred")
    sols = [s for s in attempt.solutions if s is not None]
    statuses = {s.status for s in sols}
    status = "GREEDY" if all(s.method == "greedy" for s in sols) else "OPTIMAL" if statuses == {"OPTIMAL"} else "FEASIBLE"
    base = step_timeline(problem, frozenset(), False)
    stats = SolverStats(status, wall, (sum(refresh), sum(t.use_offset for t in layers.values())),
                        (sum(refresh) - sum(bound)) / max(1, sum(refresh)))
    metrics = PlanMetrics(
        utilization_baseline=sum(sum(b - a for _, a, b in base.fixed(d)) for d in problem.devices)
        / (base.length * len(problem.devices)),
        utilization=sum(utilization.values()) / len(utilization),
        refresh_steps=tuple(refresh), step_time_baseline=plain_step_time(problem),
        step_time=max(s.window.seconds(s.window.length) / s.window.k for s in sols),
        step_time_reference=step_timeline(problem).length, peak_memory=dict(sorted(peak.items())),
        lower_bound_steps=tuple(bound), solver=stats, greedy_refresh_steps=tuple(greedy_k),
        time_quantum=0.0 if all(s.window.exact for s in sols) else max(s.window.tick for s in sols),
        stretch=max(s.window.seconds(s.window.stretch) for s in sols))
    programs = dict(sorted(programs.items()))
    return Plan(problem, programs, layers, tuple(placements), metrics, problem.fingerprint,
                startup=startup_programs(programs, born_steps(placements)))

