"""The CP-SAT model that places K-FAC work into the bubbles of a k-step window (the only ortools user).

One stage group at a time (groups share no device, so they are independent), at one refresh period k and
stretch (planner/group_search.py chooses which): `_build` makes a modulo-scheduling model of the window
(planner.window): every task is an interval at position `pos` in [0, L) with `late` telling whether it runs in
the next window's early bubbles (absolute start = pos + late*L); NoOverlap per device with the fixed F/B work;
optional intervals choose the inversion's device; a cumulative per device holds activations and the a/e kept
by deferred curvature under the budget. `solve_window` finds any placement (feasibility) or the least
staleness, the sum of use offsets. The model stays inside this module: solutions come out as
`planner.solution.GroupSolution`. Every call runs within a share of the planner's clock (`planner.budget.Budget`:
CP-SAT's deterministic time by default, so its stopping points, and the plan, do not depend on the machine's
load) and is charged to it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ortools.sat.python import cp_model

from fxkfac.planner.budget import MIN_CALL, Budget
from fxkfac.planner.costs import LayerCost
from fxkfac.planner.problem import SolveProgress, SolverConfig
from fxkfac.planner.solution import GroupSolution, use_offsets
from fxkfac.planner.window import TaskKind, Window, done_by, inv_chains, warm_starts

__all__ = ["solve_window", "set_limits"]

log = logging.getLogger(__name__)

_FEW_WORKER_SUBSOLVERS = ("quick_restart_no_lp", "default_lp")
"""With 2 workers CP-SAT runs one full-problem subsolver (default_lp), which often finds no window
placement within seconds where quick_restart_no_lp (in the 8-worker portfolio) finds one in well under
a second (benchmarks/paper_configs.py, Chimera), and proves the least staleness 5x sooner
(benchmarks/planner_scaling.py, D=8): with few workers, it comes first."""


FEASIBILITY_PROBING_LEVEL = 0
"""CP-SAT's presolve probing (`cp_model_probing_level`; its default, 2, probes every Boolean) when a window solve only
looks for a placement (a period search's probe), where it spent the probe's share of the budget before any search:
`fxkfac plan bert-large -D 8 -N 8 --schedule chimera --costs paper:bert-large/p100 --kl-clip-scope stale
--profile-layers sublayer --decomp-pieces 4` spent 17.0 s in CP-SAT (61 calls; one probe given 0.005 deterministic
s took 0.37 s of wall time with probing, 0.07-0.11 s without) and kept an unstreamed plan, +1.8% a step; without probing
in the probes 8.9 s (41 calls) and a plan streamed at the bound, +0.9%. The small Chimera case of
tests/planner/test_cpsat.py reaches its bound in 1 s only without. Solves that optimize keep it, as it shortens their
proofs (planner_scaling's D=8 optimal in 2.5 s, 4.0 s with no probing anywhere), and so do the joint models
(planner/joint_cpsat.py), whose layer options are Booleans (without it a joint 1F1B plan stretched its step 2.1%
where forcing MEM-OPT stretched 1.3%, tests/planner/test_joint_strategy.py)."""


@dataclass
class Vars:
    """The model and its variables, by task index / APPLY slot index."""

    model: cp_model.CpModel
    start: list[cp_model.IntVar] = field(default_factory=list)
    pos: list[cp_model.IntVar] = field(default_factory=list)
    late: list[cp_model.IntVar] = field(default_factory=list)
    present: list[dict[int, cp_model.IntVar]] = field(default_factory=list)
    prec: list[cp_model.IntVar] = field(default_factory=list)
    intervals_of_device: dict[int, list[cp_model.IntervalVar]] = field(default_factory=dict)


def modular(
    v: Vars, name: str, lo: int, hi: int, ticks: int, length: int, wraps: bool = False
) -> tuple[cp_model.IntVar, ...]:
    """An absolute start in [lo, hi] that lies, with its length, inside one window, or with `wraps` may run past its
    end into the next: (start, pos, late)."""
    m = v.model
    start = m.new_int_var(lo, max(lo, hi), f"start_{name}")
    pos = m.new_int_var(0, length - (1 if wraps else ticks), f"pos_{name}")
    late = m.new_bool_var(f"late_{name}")
    m.add(start == pos + length * late)
    return start, pos, late


def add_tasks(v: Vars, w: Window) -> None:
    """Every task on its device(s). At refresh period 1, where the window's end is no step boundary of the group
    (`Window.leads`[0] > 0, [Note: step barrier] in planner/window.py), a task may run past it: its interval is laid
    twice, at pos and at pos - L, so that no-overlap within [-L, 2L) is no-overlap modulo L (every other interval
    lies in [0, L)). At k >= 2 the window's inner boundaries already join each step's idle, and the doubled intervals
    slowed the search more than they helped (BERT-Large Chimera D=8: refresh 4-6 with them, 4-5 without)."""
    L = w.length
    wraps = w.k == 1 and w.leads[0] > 0
    for task in w.tasks:
        lo = (
            max(w.earliest(task, d) for d in task.devices)
            if task.kind is not TaskKind.INV
            else min(w.earliest(task, d) for d in task.devices)
        )
        start, pos, late = modular(v, task.name, lo, w.horizon - task.ticks, task.ticks, L, wraps)
        laid = (pos, pos - L) if wraps else (pos,)
        v.start.append(start)
        v.pos.append(pos)
        v.late.append(late)
        present: dict[int, cp_model.IntVar] = {}
        if task.kind is TaskKind.INV:
            for d in task.devices:
                present[d] = v.model.new_bool_var(f"on_r{d}_{task.name}")
                v.intervals_of_device[d] += [
                    v.model.new_optional_fixed_size_interval_var(at, task.ticks, present[d], f"{task.name}_r{d}")
                    for at in laid
                ]
                v.model.add(start >= w.earliest(task, d)).only_enforce_if(present[d])
            v.model.add_exactly_one(present.values())
        else:
            ivs = [v.model.new_fixed_size_interval_var(at, task.ticks, task.name) for at in laid]
            for d in task.devices:
                v.intervals_of_device[d] += ivs
        v.present.append(present)


def add_precedences(v: Vars, w: Window) -> None:
    """sync after every curvature of its factor, inversion after sync (or curvature), broadcast after
    inversion; the next refresh (L later) must find the factor's buffers free and its a/e consumed."""
    L, m = w.length, v.model
    by_factor: dict[tuple[str, str], dict[TaskKind, list[int]]] = {}
    for i, task in enumerate(w.tasks):
        for f in task.factors:
            by_factor.setdefault(f, {}).setdefault(task.kind, []).append(i)
    for i, task in enumerate(w.tasks):
        if task.kind is TaskKind.CURV:
            m.add(v.start[i] + task.ticks <= task.release + L)
    for kinds in by_factor.values():
        chain = [kinds[k] for k in TaskKind if k in kinds]  # curv, sync, inv, bcast
        for before, after in zip(chain, chain[1:]):
            for b in before:
                for a in after:
                    m.add(v.start[a] >= v.start[b] + w.tasks[b].ticks)
        first, last = kinds[TaskKind.INV][0], kinds[TaskKind.INV][-1]
        for c in kinds.get(TaskKind.CURV, []):
            m.add(v.start[last] + w.tasks[last].ticks <= v.start[c] + L)
        for b in kinds.get(TaskKind.BCAST, []):
            m.add(v.start[b] + 1 <= v.start[first] + L)


def add_piece_chains(v: Vars, w: Window) -> None:
    """The pieces of one decomposition run in order on one rank (its carry lives there), and a refresh that the
    next one warm-starts from is made and broadcast before that one's first decomposition starts (`warm_starts`)."""
    m = v.model
    for chain in inv_chains(w):
        for a, b in zip(chain, chain[1:]):
            m.add(v.start[b] >= v.start[a] + w.tasks[a].ticks)
            for d, present in v.present[a].items():
                m.add(v.present[b][d] == present)
    for i, f in warm_starts(w):
        m.add(v.start[i] + done_by(w.tasks[i]) <= v.start[f] + w.length)


def _add_precs(v: Vars, w: Window) -> None:
    """Every APPLY slot on its device; the slots of one stage and step that broadcast preconditioned gradients
    start together on every copy (`PrecSlot.shares`). An empty slot (every layer of its stage streamed to helpers)
    runs nothing and holds no interval: CP-SAT's no-overlap takes an empty interval for a point no other interval
    may hold inside, so at its reference place, inside the next step's early F/B, it made the window infeasible."""
    first: dict[tuple[int, int], int] = {}
    for n, slot in enumerate(w.precs):
        name = f"prec_s{slot.stage}_r{slot.device}_j{slot.step}"
        start, pos, _ = modular(v, name, slot.release, slot.deadline - slot.ticks, slot.ticks, w.length)
        v.prec.append(start)
        if slot.ticks > 0:
            v.intervals_of_device[slot.device].append(v.model.new_fixed_size_interval_var(pos, slot.ticks, name))
        if slot.shares:
            m = first.setdefault((slot.stage, slot.step), n)
            if m != n:
                v.model.add(start == v.prec[m])


def _add_slot_releases(v: Vars, w: Window) -> None:
    """A decomposition of a gradient-fed part starts after the refresh step's APPLY slot of its stage on the
    device it runs on, whose STATS snapshot its statistic ([Note: gradient parts] in planner/window.py)."""
    for i, task in enumerate(w.tasks):
        if task.after_slot:
            for d, present in v.present[i].items():
                n = w.refresh_slot(d, task.stage)
                v.model.add(v.start[i] >= v.prec[n] + w.precs[n].ticks).only_enforce_if(present)


def _add_memory(v: Vars, w: Window) -> None:
    """Per device: activations (fixed) + a/e kept from F/B end to the curvature's end <= capacity."""
    caps = [c for c in w.capacity.values() if c is not None]
    if not caps:
        return
    unit = max(1, math.ceil(max(caps) / 2**30))
    for d in w.group.devices:
        cap = w.capacity[d]
        if cap is not None:
            v.model.add_cumulative(*memory_items(v, w, d, unit), max(0, cap // unit))


def memory_items(v: Vars, w: Window, d: int, unit: int) -> tuple[list[cp_model.IntervalVar], list[int]]:
    """Device d's memory users besides its static bytes, as intervals and demands in `unit` bytes (rounded up):
    the activations (fixed), and the a/e each deferred curvature keeps from its F/B's end to its own end."""
    L, m = w.length, v.model
    intervals, demands = [], []
    for s, e, nbytes in w.acts[d]:
        intervals.append(m.new_fixed_size_interval_var(s, e - s, f"act_r{d}_{s}"))
        demands.append(math.ceil(nbytes / unit))
    for i, task in enumerate(w.tasks):
        if task.kind is not TaskKind.CURV or task.devices[0] != d or task.keep_bytes == 0:
            continue
        t0 = task.release % L
        room = L - t0
        held = m.new_int_var(task.ticks, L, f"held_{task.name}")
        m.add(held == v.start[i] + task.ticks - task.release)
        first = m.new_int_var(0, room, f"keep1_{task.name}")
        second = m.new_int_var(0, L, f"keep2_{task.name}")
        m.add_min_equality(first, [held, room])
        m.add_max_equality(second, [held - room, 0])
        intervals.append(m.new_interval_var(t0, first, t0 + first, f"keep_{task.name}"))
        intervals.append(m.new_interval_var(0, second, second, f"keep_wrap_{task.name}"))
        demands += [math.ceil(task.keep_bytes / unit)] * 2
    return intervals, demands


def _add_staleness(v: Vars, w: Window) -> list[cp_model.LiteralT]:
    """use_offset(layer) = number of the window's steps whose APPLY comes before the inverse is ready."""
    ends: dict[str, list[cp_model.LinearExprT]] = {}
    for i, task in enumerate(w.tasks):
        if task.kind in (TaskKind.INV, TaskKind.BCAST):
            for layer, _ in task.factors:
                ends.setdefault(layer, []).append(v.start[i] + task.ticks)
    return not_ready_flags(v, w, ends)


def not_ready_flags(v: Vars, w: Window, ends: Mapping[str, Sequence[cp_model.LinearExprT]]) -> list[cp_model.LiteralT]:
    """Per layer and window step j (of 2k), a flag 'every one of `ends` is done by the layer's slot in step j',
    monotone in j; returns the negated flags, whose sum is the window's use offsets (the staleness objective)."""
    m, k, L = v.model, w.k, w.length
    not_ready: list[cp_model.LiteralT] = []
    for layer, items in ends.items():
        stage = w.problem.costs.stage_of(layer)
        flags = [m.new_bool_var(f"ready_{layer}_j{j}") for j in range(2 * k)]
        for j, flag in enumerate(flags):
            for n, slot in enumerate(w.precs):
                if slot.stage == stage and slot.step == j % k:
                    streamed = w.streamed_use(layer, j)
                    for end in items:
                        limit = streamed if streamed is not None else v.prec[n] + L * (j // k)
                        m.add(end <= limit).only_enforce_if(flag)
            if j + 1 < len(flags):
                m.add_implication(flag, flags[j + 1])
        not_ready += [~flag for flag in flags]
    return not_ready


def break_layer_symmetry(v: Vars, w: Window) -> None:
    """Layers of one stage with equal costs (BERT's blocks; q, k, v) are interchangeable: relabeling all
    their tasks maps a placement to an equally good one, so the decompositions of their first part start in layer
    order."""
    first = {x.name: x.parts[0].part for s in w.group.stages for x in w.problem.costs.stages[s].layers}
    inv_a = {
        task.factors[0][0]: i
        for i, task in enumerate(w.tasks)
        if task.kind is TaskKind.INV and task.side == first[task.factors[0][0]]
    }
    for s in w.group.stages:
        layers = w.problem.costs.stages[s].layers
        for a, b in zip(layers, layers[1:]):
            if a.name in inv_a and b.name in inv_a and _interchangeable(a, b, w.fused):
                v.model.add(v.start[inv_a[a.name]] <= v.start[inv_a[b.name]])


def _interchangeable(a: LayerCost, b: LayerCost, fused: frozenset[str]) -> bool:
    def key(x: LayerCost) -> tuple[object, ...]:
        return (x.parts, x.prec, x.name in fused)

    return key(a) == key(b)


def add_fixed(v: Vars, w: Window) -> None:
    """The window's fixed work (F/B, the gradient all-reduce, step boundaries) as fixed intervals per device."""
    for d in w.group.devices:
        for s, e in w.fixed[d]:
            v.intervals_of_device[d].append(v.model.new_fixed_size_interval_var(s, e - s, f"fixed_r{d}_{s}"))


def _build(w: Window, optimize: bool, break_symmetry: bool = True) -> Vars:
    """The window's CP-SAT model: every constraint of a valid placement, and (`break_symmetry`) an order among
    interchangeable layers that prunes relabeled twins; `optimize`: with the staleness objective."""
    v = Vars(cp_model.CpModel(), intervals_of_device={d: [] for d in w.group.devices})
    add_fixed(v, w)
    add_tasks(v, w)
    add_precedences(v, w)
    add_piece_chains(v, w)
    _add_precs(v, w)
    _add_slot_releases(v, w)
    for intervals in v.intervals_of_device.values():
        v.model.add_no_overlap(intervals)
    _add_memory(v, w)
    if break_symmetry:
        break_layer_symmetry(v, w)
    if optimize:
        v.model.minimize(sum(_add_staleness(v, w)))
    return v


def _hint(v: Vars, w: Window, hint: GroupSolution) -> None:
    L = w.length
    for i, (start, device) in enumerate(zip(hint.starts, hint.devices)):
        v.model.add_hint(v.start[i], start)
        v.model.add_hint(v.pos[i], start % L)
        v.model.add_hint(v.late[i], start // L)
        for d, flag in v.present[i].items():
            v.model.add_hint(flag, d == device)
    for n, start in enumerate(hint.prec_starts):
        v.model.add_hint(v.prec[n], start)


def solve_window(
    w: Window,
    config: SolverConfig,
    time_limit: float,
    meter: Budget,
    hint: GroupSolution | None = None,
    *,
    optimize: bool = True,
) -> tuple[str, GroupSolution | None]:
    """Solve one window (optimize: least staleness, else any feasible placement) within `time_limit` of
    `meter`'s clock, charged to it: (status, solution)."""
    if any(t.ticks > w.length for t in w.tasks) or any(p.deadline - p.release < p.ticks for p in w.precs):
        return "INFEASIBLE", None
    if meter.deterministic and meter.wall_left() <= 0:
        meter.note_capped(f"stages {list(w.group.stages)} k={w.k} not searched")
        return "UNKNOWN", None
    v = _build(w, optimize)
    if hint is not None and hint.window.k == w.k:
        _hint(v, w, hint)
    solver = cp_model.CpSolver()
    limit = max(meter.units(MIN_CALL), time_limit)
    set_limits(solver.parameters, config, meter, limit)
    if not optimize:
        solver.parameters.cp_model_probing_level = FEASIBILITY_PROBING_LEVEL
    reporter = _Reporter(config.progress, w, optimize) if config.progress is not None else None
    if reporter is not None and optimize:
        solver.best_bound_callback = reporter.on_bound
    status = solver.solve(v.model, reporter)
    meter.charge(solver.deterministic_time)
    name = solver.status_name(status)
    if reporter is not None:
        reporter.finish(solver, name)
    if (
        meter.deterministic
        and status not in (cp_model.OPTIMAL, cp_model.INFEASIBLE)
        and solver.deterministic_time < limit * CAP_SLACK
    ):
        meter.note_capped(f"stages {list(w.group.stages)} k={w.k}")
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return name, None
    starts = tuple(solver.value(x) for x in v.start)
    devices = []
    for i, task in enumerate(w.tasks):
        chosen = [d for d, flag in v.present[i].items() if solver.boolean_value(flag)]
        devices.append(chosen[0] if chosen else task.devices[0])
    _root_broadcasts(w, devices)
    precs = tuple(solver.value(x) for x in v.prec)
    solution = GroupSolution(
        w, starts, tuple(devices), precs, use_offsets(w, starts, precs), "cpsat", name, 1, solver.wall_time
    )
    return name, solution


class _Reporter(cp_model.CpSolverSolutionCallback):
    """Passes what one CP-SAT call finds to `SolverConfig.progress`: each placement (with its staleness and the
    bound when optimizing), each better bound, then the call's status. It only observes the search."""

    def __init__(self, report: Callable[[SolveProgress], None], w: Window, optimize: bool) -> None:
        super().__init__()
        self.report, self.optimize = report, optimize
        self.window = f"stages {list(w.group.stages)} k={w.k}" + (f" stretch={w.stretch}" if w.stretch else "")
        self.objective: float | None = None
        self.began = time.perf_counter()

    def on_solution_callback(self) -> None:
        if self.optimize:
            self.objective = self.objective_value
        self._send("FEASIBLE", self.objective, self.best_objective_bound if self.optimize else None, False)

    def on_bound(self, bound: float) -> None:
        """CP-SAT proved a better lower bound on the staleness (UNKNOWN: before any placement is found)."""
        self._send("FEASIBLE" if self.objective is not None else "UNKNOWN", self.objective, bound, False)

    def finish(self, solver: cp_model.CpSolver, status: str) -> None:
        """The call's end: its status, and with a placement found its staleness and bound."""
        found = self.optimize and status in ("OPTIMAL", "FEASIBLE")
        self._send(
            status, solver.objective_value if found else None, solver.best_objective_bound if found else None, True
        )

    def _send(self, status: str, objective: float | None, bound: float | None, done: bool) -> None:
        self.report(SolveProgress(self.window, status, objective, bound, time.perf_counter() - self.began, done))


CAP_SLACK = 0.99
"""A deterministic search that stopped unproven below this fraction of its budget was stopped by the wall cap."""


def set_limits(params: Any, config: SolverConfig, meter: Budget, limit: float) -> None:
    """CP-SAT's limits, workers and seed for one call of `limit` in the meter's unit. Deterministic: one
    thread running the few-worker portfolio in turn (CP-SAT's sequential loop; 2 threads are
    deterministic only with interleave_search, which spent more deterministic and wall time for worse
    placements on BERT-Base Chimera), stopped by max_deterministic_time, with the wall cap as a net."""
    params.random_seed = config.seed
    if meter.deterministic:
        params.max_deterministic_time = limit
        params.max_time_in_seconds = max(MIN_CALL, meter.wall_left())
        params.num_workers = 1
        params.subsolvers.extend(_FEW_WORKER_SUBSOLVERS)
        return
    params.max_time_in_seconds = limit
    params.num_workers = config.num_workers
    if config.num_workers <= 2:
        params.subsolvers.extend(_FEW_WORKER_SUBSOLVERS)


def _root_broadcasts(w: Window, devices: list[int]) -> None:
    """A broadcast's device is the root: the device of its factor's inversion."""
    inv_device = {task.factors[0]: devices[i] for i, task in enumerate(w.tasks) if task.kind is TaskKind.INV}
    for i, task in enumerate(w.tasks):
        if task.kind is TaskKind.BCAST:
            devices[i] = inv_device[task.factors[0]]
