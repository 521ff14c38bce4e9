"""The CP-SAT window model of the joint choice ([Note: joint strategy] in planner/joint.py): one stage group's
window with every layer's distribution options as literals (planner/joint_step.py has the options, their literals
and the least reference step).

The window model is planner/cpsat.py's (its task intervals, precedences, piece chains, memory cumulative and
symmetry breaking are reused) with the option literals added: DECOMP's rank implies an option holding it, each
option's BCAST is an optional interval over its column, each stage's slot is an interval whose length the
literals set (the stage's copies start it together when it broadcasts preconditioned gradients), and each
device's capacity is the budget less its static bytes as the literals make them. `solve_joint_group` runs it as
`planner.group_search.solve_group` runs its own: the least refresh period first (`least_period`: down from
first-fit's placement of the candidates, which is kept when CP-SAT finds none better), with the whole stretch
allowance, then the least stretch, then the least staleness.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from ortools.sat.python import cp_model

from fxkfac.planner.budget import MIN_CALL, Meter
from fxkfac.planner.cpsat import (
    CAP_SLACK,
    Vars,
    add_fixed,
    add_piece_chains,
    add_precedences,
    add_tasks,
    break_layer_symmetry,
    memory_items,
    modular,
    not_ready_flags,
)
from fxkfac.planner.greedy import greedy_window
from fxkfac.planner.group_search import least_period
from fxkfac.planner.joint import JointPlacement, reference_step, reference_ticks, window_at
from fxkfac.planner.joint_step import NS, Options, literals, make_solver, ns, options_of, slot_need, static_bytes
from fxkfac.planner.problem import Problem, SolverConfig, StageGroup, copies_of_stage
from fxkfac.planner.solution import GroupSolution, fits_memory, prec_steps_ready
from fxkfac.planner.step_timeline import step_timeline
from fxkfac.planner.stretch import stretch_lower_bound
from fxkfac.planner.window import Task, TaskKind, Window, inv_chains, too_long

__all__ = ["solve_joint_group"]

log = logging.getLogger(__name__)

Cap = Callable[[int], int]
"""The stretch (ticks per step) a window of k steps may have."""


@dataclass
class _Joint(Vars):
    """cpsat's variables, and the options': per layer its literals; per (layer, part) its BCAST's start, position,
    whether it has one, and its end; per stage its slot's ticks; per device the (ticks, literal) of each optional
    BCAST on it."""

    lits: dict[str, list[cp_model.IntVar]] = field(default_factory=dict)
    bcast: dict[tuple[str, str], tuple[cp_model.IntVar, cp_model.IntVar, cp_model.IntVar, cp_model.LinearExprT]] = \
        field(default_factory=dict)
    slot_ticks: dict[int, cp_model.IntVar] = field(default_factory=dict)
    bcast_load: dict[int, list[tuple[int, cp_model.IntVar]]] = field(default_factory=dict)


def _placed_tasks(w: Window, options: Options) -> tuple[Task, ...]:
    """The window's tasks other than BCAST (an option's, placed apart), each DECOMP on any rank an option allows."""
    out = []
    for task in w.tasks:
        if task.kind is TaskKind.BCAST:
            continue
        if task.kind is TaskKind.INV:
            ranks = {d for o in options[task.factors[0][0]] for d in o.workers}
            task = replace(task, devices=tuple(d for d in copies_of_stage(w.problem, task.stage) if d in ranks))
        out.append(task)
    return tuple(out)


def _add_choices(v: _Joint, w: Window, options: Options) -> None:
    """The option literals; a DECOMP runs only on a rank of its layer's chosen column."""
    v.lits = literals(v.model, options)
    for i, task in enumerate(w.tasks):
        if task.kind is TaskKind.INV:
            layer = task.factors[0][0]
            for d, present in v.present[i].items():
                allowed = [lit for o, lit in zip(options[layer], v.lits[layer]) if d in o.workers]
                v.model.add_bool_or([~present, *allowed])


def _add_bcasts(v: _Joint, w: Window, options: Options) -> None:
    """Per (layer, part), one start for the BCAST of whichever option is chosen and an optional interval on each rank
    of each option's column; after the part's DECOMP, before the next refresh's first DECOMP of the layer."""
    m, L = v.model, w.length
    chains = {w.tasks[c[0]].factors[0]: c for c in inv_chains(w)}
    firsts: dict[str, set[int]] = {}
    for (layer, _), chain in chains.items():
        firsts.setdefault(layer, set()).add(chain[0])
    for (layer, part), chain in chains.items():
        chosen = [(n, w.span(o.bcast[part]), o.workers, lit)
                  for n, (o, lit) in enumerate(zip(options[layer], v.lits[layer])) if part in o.bcast]
        if not chosen:
            continue
        name = f"bcast_{part}_{layer}"
        shortest = min(ticks for _, ticks, _, _ in chosen)
        start, pos, _ = modular(v, name, 0, w.horizon - shortest, shortest, L)
        has = m.new_bool_var(f"has_{name}")
        m.add(sum(lit for *_, lit in chosen) == has)
        for n, ticks, workers, lit in chosen:
            for d in workers:
                v.intervals_of_device[d].append(m.new_optional_fixed_size_interval_var(pos, ticks, lit,
                                                                                       f"{name}_o{n}_r{d}"))
                v.bcast_load.setdefault(d, []).append((ticks, lit))
            m.add(pos + ticks <= L).only_enforce_if(lit)
            m.add(start + ticks <= w.horizon).only_enforce_if(lit)
        m.add(start == 0).only_enforce_if(~has)
        m.add(start >= v.start[chain[-1]] + w.tasks[chain[-1]].ticks).only_enforce_if(has)
        for first in sorted(firsts[layer]):
            m.add(start + 1 <= v.start[first] + L).only_enforce_if(has)
        v.bcast[layer, part] = (start, pos, has, start + sum(ticks * lit for _, ticks, _, lit in chosen))


def _add_slots(v: _Joint, w: Window, options: Options, release_ns: Mapping[int, int]) -> None:
    """Every slot on its device, as long as its stage's options make it (clamped to the room between its release and
    deadline, as the window clamps its own); each stage's reference slot, from its all-reduce end (`release_ns`),
    ends where the window's step rounds to (so the chosen problem's reference step fits it); the copies start a
    slot that broadcasts preconditioned gradients together."""
    m, L = v.model, w.length
    tick_ns = NS / w.scale
    bound = ns((w.offsets[1] + 0.5) / w.scale) - min(1000, round(tick_ns / 4))
    starts: dict[int, cp_model.IntVar] = {}
    for s in w.group.stages:
        slots = [n for n, p in enumerate(w.precs) if p.stage == s]
        room = max(1, min(w.precs[n].deadline - w.precs[n].release for n in slots))
        need, _ = slot_need(m, s, w.problem, v.lits, options, w.up, f"s{s}")
        need_ns, _ = slot_need(m, s, w.problem, v.lits, options, ns, f"ns_s{s}")
        m.add(release_ns[s] + need_ns <= bound)
        ticks = m.new_int_var(1, room, f"slot_ticks_s{s}")
        m.add_min_equality(ticks, [need, room])
        v.slot_ticks[s] = ticks
        sharing = [lit for x in w.problem.costs.stages[s].layers for o, lit in zip(options[x.name], v.lits[x.name])
                   if not o.comm_opt]
        shares = m.new_bool_var(f"shares_s{s}")
        m.add_bool_or(sharing or [m.new_constant(0)]).only_enforce_if(shares)
        for lit in sharing:
            m.add_implication(lit, shares)
        first: dict[int, cp_model.IntVar] = {}
        for n in slots:
            slot = w.precs[n]
            name = f"prec_s{s}_r{slot.device}_j{slot.step}"
            start = m.new_int_var(slot.release, max(slot.release, slot.deadline - 1), f"start_{name}")
            pos = m.new_int_var(0, L - 1, f"pos_{name}")
            late = m.new_bool_var(f"late_{name}")
            m.add(start == pos + L * late)
            m.add(start + ticks <= slot.deadline)
            end = m.new_int_var(1, L, f"end_{name}")
            m.add(end == pos + ticks)
            v.intervals_of_device[slot.device].append(m.new_interval_var(pos, ticks, end, name))
            starts[n] = start
            if slot.step in first:
                m.add(start == first[slot.step]).only_enforce_if(shares)
            else:
                first[slot.step] = start
    v.prec = [starts[n] for n in range(len(w.precs))]


def _add_energy(v: _Joint, w: Window) -> None:
    """Redundant: the work each device runs (tasks, BCASTs of the chosen options, slots) fits the time the fixed work
    leaves it in the window (a linear bound the no-overlap implies, which proves a step too short at once)."""
    m = v.model
    for d in w.group.devices:
        load = []
        for i, task in enumerate(w.tasks):
            if d in task.devices:
                load.append(task.ticks * v.present[i][d] if task.kind is TaskKind.INV else task.ticks)
        load += [v.slot_ticks[p.stage] for p in w.precs if p.device == d]
        load += [ticks * lit for ticks, lit in v.bcast_load.get(d, [])]
        m.add(sum(load) <= w.length - sum(e - s for s, e in w.fixed[d]))


def _add_slot_releases(v: _Joint, w: Window) -> None:
    """A gradient-fed part's DECOMP starts after the refresh step's slot of its stage on its rank ([Note: gradient
    parts] in planner/window.py)."""
    for i, task in enumerate(w.tasks):
        if task.after_slot:
            for d, present in v.present[i].items():
                n = w.refresh_slot(d, task.stage)
                v.model.add(v.start[i] >= v.prec[n] + v.slot_ticks[task.stage]).only_enforce_if(present)


def _add_memory(v: _Joint, w: Window, options: Options) -> None:
    """Per device: activations and kept a/e within the budget less the static bytes the literals make."""
    budget = w.problem.memory_budget
    if budget is None:
        return
    unit = max(1, math.ceil(budget / 2**30))
    for d in w.group.devices:
        cap = v.model.new_int_var(0, budget // unit, f"cap_r{d}")
        v.model.add(unit * cap <= budget - static_bytes(v.model, w.problem, d, v.lits, options))
        v.model.add_cumulative(*memory_items(v, w, d, unit), cap)


def _add_staleness(v: _Joint, w: Window) -> list[cp_model.LiteralT]:
    """use_offset(layer) = number of the window's steps whose slot starts before its decompositions and their
    broadcasts are done (`planner.solution.use_offsets`); returns the negated 'ready by step j' flags."""
    m = v.model
    ready: dict[str, cp_model.IntVar] = {}
    for i, task in enumerate(w.tasks):
        if task.kind is TaskKind.INV:
            layer = task.factors[0][0]
            if layer not in ready:
                ready[layer] = m.new_int_var(0, 2 * w.horizon, f"ready_{layer}")
            m.add(ready[layer] >= v.start[i] + task.ticks)
    for (layer, _), (_, _, has, end) in v.bcast.items():
        m.add(ready[layer] >= end).only_enforce_if(has)
    return not_ready_flags(v, w, {layer: [at] for layer, at in ready.items()})


@dataclass(frozen=True)
class _Frame:
    """What one group's joint models share: every layer's options, each stage's all-reduce end (ns) and the grid."""

    options: Options
    release_ns: Mapping[int, int]
    scale: tuple[float, bool]
    aggregate: bool


def _build(w: Window, frame: _Frame, optimize: bool) -> tuple[_Joint, Window]:
    """The joint model of anchor window `w`, and the window of the tasks it places (BCAST apart, DECOMP widened)."""
    v = _Joint(cp_model.CpModel(), intervals_of_device={d: [] for d in w.group.devices})
    placed = replace(w, tasks=_placed_tasks(w, frame.options))
    add_fixed(v, placed)
    add_tasks(v, placed)
    add_precedences(v, placed)
    add_piece_chains(v, placed)
    _add_choices(v, placed, frame.options)
    _add_bcasts(v, placed, frame.options)
    _add_slots(v, placed, frame.options, frame.release_ns)
    _add_slot_releases(v, placed)
    _add_energy(v, placed)
    for intervals in v.intervals_of_device.values():
        v.model.add_no_overlap(intervals)
    _add_memory(v, placed, frame.options)
    break_layer_symmetry(v, placed)
    if optimize:
        v.model.minimize(sum(_add_staleness(v, placed)))
    return v, placed


def _hint(v: _Joint, w: Window, hint: JointPlacement, options: Options) -> None:
    """Warm-start every variable from `hint` (a placement in the same window)."""
    m, L = v.model, w.length
    for i, task in enumerate(w.tasks):
        at = hint.starts.get(task.name)
        if at is not None:
            m.add_hint(v.start[i], at)
            m.add_hint(v.pos[i], at % L)
            m.add_hint(v.late[i], at // L)
        for d, flag in v.present[i].items():
            m.add_hint(flag, hint.inv_devices.get(task.factors[0]) == d)
    for layer, lits in v.lits.items():
        for o, lit in zip(options[layer], lits):
            m.add_hint(lit, hint.choices.get(layer) == o.where)
    for (layer, part), (start, pos, has, _) in v.bcast.items():
        at = hint.starts.get(f"bcast_{part}_{layer}", 0)
        m.add_hint(has, f"bcast_{part}_{layer}" in hint.starts)
        m.add_hint(start, at)
        m.add_hint(pos, at % L)
    for n, prec_start in enumerate(hint.prec_starts):
        m.add_hint(v.prec[n], prec_start)


def _solve(w: Window, frame: _Frame, config: SolverConfig, limit: float, meter: Meter, hint: JointPlacement | None,
           optimize: bool) -> tuple[str, JointPlacement | None]:
    """One joint window within `limit` of `meter`'s clock, charged to it: (status, placement)."""
    if meter.deterministic and meter.wall_left() <= 0:
        meter.note_capped(f"joint stages {list(w.group.stages)} k={w.k} not searched")
        return "UNKNOWN", None
    v, placed = _build(w, frame, optimize)
    if hint is not None and hint.window.offsets == w.offsets:
        _hint(v, placed, hint, frame.options)
    budget = max(meter.units(MIN_CALL), limit)
    solver = make_solver(config, meter, budget)
    status = solver.solve(v.model)
    meter.charge(solver.deterministic_time)
    name = solver.status_name(status)
    if meter.deterministic and status not in (cp_model.OPTIMAL, cp_model.INFEASIBLE) \
            and solver.deterministic_time < budget * CAP_SLACK:
        meter.note_capped(f"joint stages {list(w.group.stages)} k={w.k}")
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return name, None
    return name, _extract(solver, v, placed, w, frame.options, name)


def _extract(solver: cp_model.CpSolver, v: _Joint, placed: Window, w: Window, options: Options,
             status: str) -> JointPlacement:
    """The solver's values as a joint placement in `w`."""
    choices = {layer: next(o.where for o, lit in zip(options[layer], lits) if solver.boolean_value(lit))
               for layer, lits in v.lits.items()}
    starts = {task.name: solver.value(v.start[i]) for i, task in enumerate(placed.tasks)}
    inv_devices: dict[tuple[str, str], int] = {}
    ready: dict[str, int] = {}
    for i, task in enumerate(placed.tasks):
        if task.kind is TaskKind.INV:
            inv_devices[task.factors[0]] = next(d for d, flag in v.present[i].items() if solver.boolean_value(flag))
            layer = task.factors[0][0]
            ready[layer] = max(ready.get(layer, 0), starts[task.name] + task.ticks)
    for (layer, part), (start, _, has, end) in v.bcast.items():
        if solver.boolean_value(has):
            starts[f"bcast_{part}_{layer}"] = solver.value(start)
            ready[layer] = max(ready[layer], solver.value(end))
    precs = tuple(solver.value(x) for x in v.prec)
    staleness = sum(prec_steps_ready(w, precs, w.problem.costs.stage_of(n), t) for n, t in ready.items())
    return JointPlacement(w, choices, starts, inv_devices, precs, {s: solver.value(t) for s, t in v.slot_ticks.items()},
                          status, staleness)


def _as_joint(solution: GroupSolution) -> JointPlacement:
    """A placement of the anchor problem's own window (first-fit's) as a joint placement of its distributions."""
    w = solution.window
    choices = {x.name: w.problem.where(x.name) for s in w.group.stages for x in w.problem.costs.stages[s].layers}
    starts = {task.name: t for task, t in zip(w.tasks, solution.starts)}
    inv_devices = {task.factors[0]: d for task, d in zip(w.tasks, solution.devices) if task.kind is TaskKind.INV}
    return JointPlacement(w, choices, starts, inv_devices, solution.prec_starts, {p.stage: p.ticks for p in w.precs},
                          "GREEDY", sum(solution.use_offset.values()))


def _lower_k(w: Window) -> int:
    """The least refresh period any option set allows: the curvature and decompositions (the same under every
    option) over the free time one step leaves the group's devices beside F/B and all-reduces."""
    work = sum(t.ticks for t in w.tasks if t.kind in (TaskKind.CURV, TaskKind.INV))
    free = sum(w.length - sum(e - s for s, e in w.fixed[d]) for d in w.group.devices) // w.k
    return max(1, math.ceil(work / free)) if free > 0 else w.problem.max_period + 1


@dataclass(frozen=True)
class _Group:
    """One group's joint search: the anchor problem (whose distributions stay on the stages not free), the
    problems whose first-fit placements are warm starts and fallbacks (the anchor's, then each forced strategy's on
    the group's free layers), the options, the grid and the most ticks a step of k steps may last."""

    anchor: Problem
    group: StageGroup
    candidates: tuple[tuple[Problem, int], ...]
    """Each with its reference step in ticks (`planner.joint.reference_step`, which needs no simulation)."""
    frame: _Frame
    cap: Cap

    def window(self, k: int, step: int) -> Window:
        """The anchor's window at period k with steps of `step` ticks (never shorter than its reference)."""
        w = window_at(self.anchor, self.group, k, step, self.frame.scale, aggregate=self.frame.aggregate)
        assert w is not None, "a joint step is never below the anchor's reference (the least one)"
        return w

    @property
    def base(self) -> int:
        """The anchor's reference step in ticks: the least step of any option set."""
        return reference_ticks(self.anchor, self.frame.scale)

    def most(self, k: int) -> int:
        """The longest step the window of k steps may have: the reference and the whole stretch allowance."""
        return self.base + self.cap(k)

    def first_fit(self, k: int, step: int, meter: Meter) -> JointPlacement | None:
        """First-fit of each candidate's distributions at period k with steps of `step` ticks: the first that places
        within the budget, as a joint placement."""
        for problem, reference in self.candidates:
            if reference > step:
                continue
            w = window_at(problem, self.group, k, step, self.frame.scale, aggregate=self.frame.aggregate)
            if w is None:
                continue
            meter.charge_greedy(len(w.tasks) + len(w.precs))
            solution = greedy_window(w)
            if solution is not None and fits_memory(solution):
                return _as_joint(solution)
        return None


def solve_joint_group(anchor: Problem, group: StageGroup, free: frozenset[int], candidates: Sequence[Problem],
                      scale: tuple[float, bool], cap: Cap, config: SolverConfig, time_limit: float, meter: Meter, *,
                      aggregate: bool) -> JointPlacement | None:
    """The group's layer distributions and placement at the least refresh period with the whole stretch `cap(k)`,
    then the least step, then the least staleness, within `time_limit` of `meter`'s clock. `anchor` has the least
    reference step (`least_step`) and keeps its distributions on the stages not `free`; first-fit of `candidates`
    (the anchor, then other distributions of the group's free layers) warm-starts the search and is kept where
    CP-SAT finds nothing better in time. None when nothing places it."""
    began = meter.now()
    timeline = step_timeline(anchor)
    release = {s: ns(timeline.allreduce_end[copies_of_stage(anchor, s)[0], s]) for s in group.stages}
    frame = _Frame({x.name: options_of(anchor, x.name, s in free) for s in group.stages
                    for x in anchor.costs.stages[s].layers}, release, scale, aggregate)
    ticks = [round(reference_step(anchor, free, dict(c.distributions)) * scale[0]) for c in candidates]
    g = _Group(anchor, group, ((anchor, reference_ticks(anchor, scale)), *zip(candidates, ticks)), frame, cap)
    if too_long(g.window(2, g.most(anchor.max_period))):
        return None
    lower = _lower_k(g.window(1, g.most(1)))
    fallback = next((f for k in range(lower, anchor.max_period + 1) if (f := g.first_fit(k, g.most(k), meter))), None)

    def probe(k: int, share: float) -> tuple[str, JointPlacement | None]:
        w = g.window(k, g.most(k))
        status, found = _solve(w, frame, config, share, meter, None, optimize=False)
        log.info("joint stages %s k=%d step=%d ticks: %s", list(group.stages), k, w.offsets[1], status)
        return status, found

    def left(fraction: float) -> float:
        return fraction * time_limit - (meter.now() - began)

    found, proven = least_period(probe, left, lower, anchor.max_period, fallback)
    if found is None:
        return None
    if found.step_ticks > g.base:
        found = _least_step(g, found, config, meter, began + time_limit)
    best = _least_stale(g, found, config, meter, left(1.0))
    return replace(best, k_lower_bound=proven)


def _least_step(g: _Group, found: JointPlacement, config: SolverConfig, meter: Meter,
                deadline: float) -> JointPlacement:
    """The shortest step at found's k: first-fit of the candidates bisected first (cheap), then CP-SAT feasibility
    probes below it, spending at most half the time left."""
    k = found.window.k
    lower = max(g.base + _least_stretch_bound(g.window(k, g.base), g.frame),
                _energy_bound(g, k, found.step_ticks, config, meter, (deadline - meter.now()) / 8))
    best = _bisect(lower, found, lambda step: ("UNKNOWN", g.first_fit(k, step, meter)))
    until = meter.now() + (deadline - meter.now()) * 3 / 4

    def probe(step: int) -> tuple[str, JointPlacement | None]:
        left = until - meter.now()
        if left <= 0:
            return "UNKNOWN", None
        return _solve(g.window(k, step), g.frame, config, left / max(1, math.ceil(math.log2(step - lower + 2))),
                      meter, None, optimize=False)

    if lower < best.step_ticks:  # the energy bound is often the answer (pure data parallelism): tried first
        _, at_bound = _solve(g.window(k, lower), g.frame, config, (until - meter.now()) / 3, meter, None,
                             optimize=False)
        best = at_bound or _bisect(lower + 1, best, probe)
    log.info("joint stages %s k=%d: least step %d ticks", list(g.group.stages), k, best.step_ticks)
    return best


def _energy_bound(g: _Group, k: int, upper: int, config: SolverConfig, meter: Meter, limit: float) -> int:
    """The least step (ticks) at which some option set's work, each DECOMP on one rank of its option, fits every
    device's time beside its fixed work in a window of k steps (`g.base` when none was proven in `limit`)."""
    w = g.window(k, upper)
    m = cp_model.CpModel()
    lits = literals(m, g.frame.options)
    step = m.new_int_var(g.base, upper, "step")
    load: dict[int, list[cp_model.LinearExprT]] = {d: [] for d in w.group.devices}
    for task in _placed_tasks(w, g.frame.options):
        if task.kind is not TaskKind.INV:
            for d in task.devices:
                load[d].append(task.ticks)
            continue
        layer = task.factors[0][0]
        on = {d: m.new_bool_var(f"on_{task.name}_r{d}") for d in task.devices}
        m.add_exactly_one(on.values())
        for d, flag in on.items():
            m.add_bool_or([~flag, *[lit for o, lit in zip(g.frame.options[layer], lits[layer]) if d in o.workers]])
            load[d].append(task.ticks * flag)
    for layer, opts in g.frame.options.items():
        for o, lit in zip(opts, lits[layer]):
            for secs in o.bcast.values():
                for d in o.workers:
                    load[d].append(w.span(secs) * lit)
    for s in w.group.stages:
        need, _ = slot_need(m, s, g.anchor, lits, g.frame.options, w.up, f"s{s}")
        for d in copies_of_stage(g.anchor, s):
            load[d] += [need] * k
    per_step = {d: sum(e - s for s, e in w.fixed[d]) // k for d in w.group.devices}
    for d, items in load.items():
        m.add(sum(items) <= k * (step - per_step[d]))
    m.minimize(step)
    solver = make_solver(config, meter, limit)
    status = solver.solve(m)
    meter.charge(solver.deterministic_time)
    return round(solver.best_objective_bound) if status in (cp_model.OPTIMAL, cp_model.FEASIBLE) else g.base


def _bisect(lower: int, found: JointPlacement,
            probe: Callable[[int], tuple[str, JointPlacement | None]]) -> JointPlacement:
    """The placement with the shortest step `probe` finds in [lower, found's step]."""
    lo, hi, best = lower, found.step_ticks, found
    while lo < hi:
        mid = (lo + hi) // 2
        _, solution = probe(mid)
        if solution is not None:
            hi, best = solution.step_ticks, solution
        else:
            lo = mid + 1
    return best


def _least_stretch_bound(w: Window, frame: _Frame) -> int:
    """Stretch ticks any option set needs at w's k (`planner.stretch.stretch_lower_bound` of the work every option
    has: curvature, SYNC_STATS, decompositions on any rank an option allows; slots and broadcasts as nothing)."""
    return stretch_lower_bound(replace(w, tasks=_placed_tasks(w, frame.options),
                                       precs=tuple(replace(p, ticks=0) for p in w.precs)))


def _least_stale(g: _Group, found: JointPlacement, config: SolverConfig, meter: Meter, left: float) -> JointPlacement:
    """Least staleness at found's k and step, warm-started by `found` (kept when the solver does worse)."""
    hint = found if config.use_greedy_hint or found.status != "GREEDY" else None
    status, best = _solve(g.window(found.window.k, found.step_ticks), g.frame, config, left, meter, hint,
                          optimize=True)
    if best is None or found.staleness < best.staleness:
        return found
    return replace(best, status="OPTIMAL" if status == "OPTIMAL" else "FEASIBLE")
