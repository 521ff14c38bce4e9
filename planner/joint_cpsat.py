"""The CP-SAT window model of the joint choice ([Note: joint strategy] in planner/joint.py): one stage group's
window with every layer's distribution options as literals (planner/joint_step.py has the options, their literals
and the least reference step).

The window model is planner/cpsat.py's (its task intervals, precedences, piece chains, memory cumulative and
symmetry breaking are reused) with the option literals added: DECOMP's rank implies an option holding it, each
option's BCAST is an optional interval over its column, each stage's slot is an interval whose length the
literals set (the stage's copies start it together when it broadcasts preconditioned gradients), and each
device's capacity is the budget less its static bytes as the literals make them. planner/joint_search.py runs it
(`solve_window`) as planner/group_search.py runs cpsat's; `energy_bound` is the least step any option set's work
allows.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from ortools.sat.python import cp_model

from fxkfac.planner.budget import MIN_CALL, Budget
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
from fxkfac.planner.joint import JointPlacement
from fxkfac.planner.joint_step import NS, Options, literals, make_solver, ns, slot_need, static_bytes
from fxkfac.planner.problem import SolverConfig, copies_of_stage
from fxkfac.planner.solution import prec_steps_ready
from fxkfac.planner.window import Task, TaskKind, Window, inv_chains

__all__ = ["Frame", "energy_bound", "placed_tasks", "solve_window"]


@dataclass
class _Joint(Vars):
    """cpsat's variables, and the options': per layer its literals; per (layer, part) its BCAST's start, position,
    whether it has one, and its end; per stage its slot's ticks; per device the (ticks, literal) of each optional
    BCAST on it."""

    lits: dict[str, list[cp_model.IntVar]] = field(default_factory=dict)
    bcast: dict[tuple[str, str], tuple[cp_model.IntVar, cp_model.IntVar, cp_model.IntVar, cp_model.LinearExprT]] = (
        field(default_factory=dict)
    )
    slot_ticks: dict[int, cp_model.IntVar] = field(default_factory=dict)
    bcast_load: dict[int, list[tuple[int, cp_model.IntVar]]] = field(default_factory=dict)


def placed_tasks(w: Window, options: Options) -> tuple[Task, ...]:
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
        chosen = [
            (n, w.span(o.bcast[part]), o.workers, lit)
            for n, (o, lit) in enumerate(zip(options[layer], v.lits[layer]))
            if part in o.bcast
        ]
        if not chosen:
            continue
        name = f"bcast_{part}_{layer}"
        shortest = min(ticks for _, ticks, _, _ in chosen)
        start, pos, _ = modular(v, name, 0, w.horizon - shortest, shortest, L)
        has = m.new_bool_var(f"has_{name}")
        m.add(sum(lit for *_, lit in chosen) == has)
        for n, ticks, workers, lit in chosen:
            for d in workers:
                v.intervals_of_device[d].append(
                    m.new_optional_fixed_size_interval_var(pos, ticks, lit, f"{name}_o{n}_r{d}")
                )
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
        sharing = [
            lit
            for x in w.problem.costs.stages[s].layers
            for o, lit in zip(options[x.name], v.lits[x.name])
            if not o.comm_opt
        ]
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
class Frame:
    """What one group's joint models share: every layer's options, each stage's all-reduce end (ns) and the grid."""

    options: Options
    release_ns: Mapping[int, int]
    scale: tuple[float, bool]
    stats_chunk: int


def _build(w: Window, frame: Frame, optimize: bool) -> tuple[_Joint, Window]:
    """The joint model of anchor window `w`, and the window of the tasks it places (BCAST apart, DECOMP widened)."""
    v = _Joint(cp_model.CpModel(), intervals_of_device={d: [] for d in w.group.devices})
    placed = replace(w, tasks=placed_tasks(w, frame.options))
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


def solve_window(
    w: Window,
    frame: Frame,
    config: SolverConfig,
    limit: float,
    meter: Budget,
    hint: JointPlacement | None,
    optimize: bool,
) -> tuple[str, JointPlacement | None]:
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
    if (
        meter.deterministic
        and status not in (cp_model.OPTIMAL, cp_model.INFEASIBLE)
        and solver.deterministic_time < budget * CAP_SLACK
    ):
        meter.note_capped(f"joint stages {list(w.group.stages)} k={w.k}")
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return name, None
    return name, _extract(solver, v, placed, w, frame.options, name)


def _extract(
    solver: cp_model.CpSolver, v: _Joint, placed: Window, w: Window, options: Options, status: str
) -> JointPlacement:
    """The solver's values as a joint placement in `w`."""
    choices = {
        layer: next(o.where for o, lit in zip(options[layer], lits) if solver.boolean_value(lit))
        for layer, lits in v.lits.items()
    }
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
    staleness = sum(prec_steps_ready(w, precs, n, t) for n, t in ready.items())
    return JointPlacement(
        w, choices, starts, inv_devices, precs, {s: solver.value(t) for s, t in v.slot_ticks.items()}, status, staleness
    )


def energy_bound(w: Window, frame: Frame, base: int, config: SolverConfig, meter: Budget, limit: float) -> int:
    """The least step (ticks) at which some option set's work, each DECOMP on one rank of its option, fits every
    device's time beside its fixed work in w's k steps, at least `base` and at most w's step (`base` when none was
    proven in `limit`)."""
    k, upper = w.k, w.offsets[1]
    m = cp_model.CpModel()
    lits = literals(m, frame.options)
    step = m.new_int_var(base, upper, "step")
    load: dict[int, list[cp_model.LinearExprT]] = {d: [] for d in w.group.devices}
    for task in placed_tasks(w, frame.options):
        if task.kind is not TaskKind.INV:
            for d in task.devices:
                load[d].append(task.ticks)
            continue
        layer = task.factors[0][0]
        on = {d: m.new_bool_var(f"on_{task.name}_r{d}") for d in task.devices}
        m.add_exactly_one(on.values())
        for d, flag in on.items():
            m.add_bool_or([~flag, *[lit for o, lit in zip(frame.options[layer], lits[layer]) if d in o.workers]])
            load[d].append(task.ticks * flag)
    for layer, opts in frame.options.items():
        for o, lit in zip(opts, lits[layer]):
            for secs in o.bcast.values():
                for d in o.workers:
                    load[d].append(w.span(secs) * lit)
    for s in w.group.stages:
        need, _ = slot_need(m, s, w.problem, lits, frame.options, w.up, f"s{s}")
        for d in copies_of_stage(w.problem, s):
            load[d] += [need] * k
    per_step = {d: sum(e - s for s, e in w.fixed[d]) // k for d in w.group.devices}
    for d, items in load.items():
        m.add(sum(items) <= k * (step - per_step[d]))
    m.minimize(step)
    solver = make_solver(config, meter, limit)
    status = solver.solve(m)
    meter.charge(solver.deterministic_time)
    return round(solver.best_objective_bound) if status in (cp_model.OPTIMAL, cp_model.FEASIBLE) else base
