"""The planner's CP-SAT models (the only ortools user) and its one solver call (`_solve`): `_build` places a window's
tasks (planner.plan.window) modulo its length L, NoOverlap per device beside the fixed work, a cumulative per device for
activations and kept a/e; `solve_window` finds any placement or the least staleness.

[Note: joint strategy] The model gets every layer's options (KAISA distributions) and chooses them while it places:
one Boolean per option (a forced strategy: one option, the constant 1). Options move the fixed work only on
`timeline_stages` (Chimera's first stage per device, interleaved's first chunk), which keep one option set per solve;
elsewhere only the step's end (`reference_step`). `least_step` finds the least step within static memory; each group
is placed at it plus the stretch, then `transfer`red into `Problem.with_distributions(...)`'s own window.

[Note: no twin intervals] A model never holds two equal interval constraints (`constant_interval`): OR-Tools 9.15's
presolve merges twins and may raise `IndexError: raw_hash_map<>::at` instead of INFEASIBLE (test_cpsat_twins.py).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace
from fractions import Fraction
from functools import lru_cache
from typing import Any

from ortools.sat.python import cp_model

from fxkfac.planner.plan.solution import GroupSolution, fits_memory, use_offsets
from fxkfac.planner.plan.window import (
    Task,
    TaskKind,
    Window,
    build_window,
    done_by,
    inv_chains,
    w_makers,
    warm_starts,
)
from fxkfac.planner.problem.ir import Op, OpKind
from fxkfac.planner.problem.problem import (
    Problem,
    SolveProgress,
    SolverConfig,
    StageGroup,
    stages_on_device,
)
from fxkfac.planner.problem.step_timeline import (
    activation_peak,
    base_programs,
    gradient_stats,
    held_bytes,
    step_timeline,
)
from fxkfac.planner.problem.strategy import LayerDistribution, Strategy, StrategyKind, grad_workers, receivers
from fxkfac.planner.search.budget import MIN_CALL, Budget

_FIXED = frozenset({OpKind.FWD, OpKind.BWD, OpKind.BWD_W, OpKind.ALLREDUCE_GRAD})


NS = 1_000_000_000
"""Nanoseconds per second: the step models' unit."""

Ticks = Callable[[float], int]
"""Seconds to a model's integer unit (window ticks, rounded up; or nanoseconds)."""


@dataclass(frozen=True)
class Option:
    """One distribution of a layer: its DECOMP's ranks, each part's BCAST among them (none with one worker), the
    per-step work on each worker (gradient STATS and APPLY) and the BCAST_PREC on every copy (seconds)."""

    where: LayerDistribution
    workers: tuple[int, ...]
    bcast: Mapping[str, float]
    apply: float
    share: float

    @property
    def comm_opt(self) -> bool:
        return self.where == LayerDistribution()

    @staticmethod
    def of(problem: Problem, layer: str, where: LayerDistribution) -> Option:
        """`layer` distributed as `where`."""
        stage, cost = problem.costs.stage_of(layer), problem.costs.layer(layer)
        copies = problem.holders[stage]
        workers = grad_workers(copies, where)
        group = None if workers == copies else workers
        bcast = {  # as the window has a BCAST task, however short; none with one worker
            p.part: problem.costs.collective_seconds(
                Op(OpKind.BCAST, stage, layer=layer, part=p.part, root=workers[0], group=group), len(workers)
            )
            for p in cost.parts
            if len(workers) > 1
        }
        apply = sum(p.stats for p in cost.parts if p.after is OpKind.ALLREDUCE_GRAD) + cost.prec
        share = 0.0
        if rows := receivers(copies, where):
            root, row = rows[0]
            op = Op(OpKind.BCAST_PREC, stage, root=root, layer=layer, group=None if row == copies else row)
            share = problem.costs.collective_seconds(op, len(row))
        return Option(where, workers, bcast, apply, share)


Options = Mapping[str, tuple[Option, ...]]
"""Every layer's options, by name."""

Literals = Mapping[str, list[cp_model.IntVar]]
"""One Boolean per option of every layer, by name."""

Solved = tuple[str, GroupSolution | None]
"""A CP-SAT status and the placement found, if any."""


def options_of(problem: Problem, stages: Iterable[int], free: Collection[int]) -> dict[str, tuple[Option, ...]]:
    """The options of every layer of `stages`: every KAISA distribution on the `free` stages, else the problem's own."""
    return {
        x.name: tuple(
            Option.of(problem, x.name, where)
            for where in (layer_options(problem, x.name) if s in free else (problem.where(x.name),))
        )
        for s in stages
        for x in problem.costs.stages[s].layers
    }


def ns(seconds: float) -> int:
    """`seconds` in nanoseconds, rounded."""
    return round(seconds * NS)


def layer_options(problem: Problem, layer: str) -> tuple[LayerDistribution, ...]:
    """Every KAISA distribution of `layer` over its stage's H copies: COMM-OPT, HYBRID per grad-worker count dividing
    H and column, MEM-OPT per column; COMM-OPT alone for a streamed layer."""
    H = len(problem.holders[problem.costs.stage_of(layer)])
    out = [LayerDistribution()]
    if problem.streaming is not None and layer in problem.streaming.layers:
        return tuple(out)
    for g in (g for g in range(H - 1, 0, -1) if H % g == 0):  # grad workers per column
        strategy = Strategy(StrategyKind.MEM_OPT) if g == 1 else Strategy(StrategyKind.HYBRID, Fraction(g, H))
        out += [LayerDistribution(strategy, column) for column in range(H // g)]
    return tuple(out)


@lru_cache(maxsize=64)
def timeline_stages(problem: Problem) -> frozenset[int]:
    """Stages whose slot precedes an F/B or all-reduce on a copy: their distribution moves the fixed work."""
    out = set()
    for ops in base_programs(problem).values():
        for i, op in enumerate(ops):
            if op.kind is OpKind.ALLREDUCE_GRAD and any(o.kind in _FIXED for o in ops[i + 1 :]):
                assert op.stage is not None, "the schedules' ALLREDUCE_GRAD names its stage"
                out.add(op.stage)
    return frozenset(out)


def comm_slot_seconds(problem: Problem, stage: int) -> float:
    """Seconds of the stage's slot when every layer is COMM-OPT: all gradient STATS, one APPLY."""
    cost = problem.costs.stages[stage]
    return sum(secs for _, secs in gradient_stats(cost, stage)) + cost.prec


def step_fixed_end(problem: Problem, free: frozenset[int]) -> float:
    """The end of the reference step's work but the `free` stages' slots."""
    step = step_timeline(problem)
    return max(
        (
            end
            for items in step.ops.values()
            for op, _, end in items
            if op.kind is not OpKind.OPT_STEP and not (op.stage in free and op.kind not in _FIXED)
        ),
        default=0.0,
    )


def reference_step(problem: Problem, free: frozenset[int], distributions: Mapping[str, LayerDistribution]) -> float:
    """L(P) of [Note: joint strategy]: the reference step with the `free` stages' layers as `distributions`."""
    step = step_timeline(problem)
    end = step_fixed_end(problem, free)
    for s in sorted(free):
        layers = problem.costs.stages[s].layers
        chosen = [Option.of(problem, x.name, distributions.get(x.name, LayerDistribution())) for x in layers]
        if all(o.comm_opt for o in chosen):
            slot = comm_slot_seconds(problem, s)
        else:
            work = [sum(o.apply for o in chosen if c in o.workers) for c in problem.holders[s]]
            slot = max(work) + sum(o.share for o in chosen)
        end = max(end, step.allreduce_end[problem.holders[s][0], s] + slot)
    return end


def reference_ticks(problem: Problem, scale: tuple[float, bool]) -> int:
    """`problem`'s reference step on the grid `scale` (nothing fused)."""
    return round(step_timeline(problem).length * scale[0])


def window_at(
    problem: Problem, group: StageGroup, k: int, step: int, scale: tuple[float, bool], *, stats_chunk: int
) -> Window | None:
    """`problem`'s window of `group` at period k with steps of `step` ticks; None below its reference step."""
    stretch = step - reference_ticks(problem, scale)
    if stretch < 0:
        return None
    return build_window(problem, group, k, stats_chunk=stats_chunk, stretch=stretch, scale=scale)


def transfer(placement: GroupSolution, problem: Problem) -> GroupSolution | None:
    """`placement` as a solution of `problem`'s (the chosen distributions') own window with steps as long; None when
    that window differs or a third decomposition breaks the budget: the caller then plans `problem` itself."""
    w = placement.window
    target = window_at(problem, w.group, w.k, placement.step_ticks, (w.scale, w.exact), stats_chunk=w.stats_chunk)
    if target is None:
        return None
    slot_ticks = {p.stage: p.ticks for p in w.precs} | dict(placement.slot_ticks)
    slots = [[(p.device, p.stage, p.step, p.release, p.deadline) for p in x.precs] for x in (w, target)]
    frame = [(x.offsets, x.leads, x.fixed, x.acts) for x in (w, target)]
    if frame[0] != frame[1] or slots[0] != slots[1] or any(p.ticks > slot_ticks[p.stage] for p in target.precs):
        return None
    named, inv_devices = placement.named_starts(), placement.inv_devices()
    starts, devices = [], []
    for task in target.tasks:
        at = named.get(task.name)
        device = inv_devices.get(task.factors[0]) if task.kind in (TaskKind.INV, TaskKind.BCAST) else task.devices[0]
        if at is None or device is None or device not in task.devices:
            return None
        starts.append(at)
        devices.append(device)
    chosen, precs, lower = tuple(starts), placement.prec_starts, placement.k_lower_bound
    offsets = use_offsets(target, chosen, precs)
    solution = GroupSolution(target, chosen, tuple(devices), precs, offsets, "cpsat", placement.status, lower)
    return solution if fits_memory(solution) else None  # a third decomposition over the budget: planned apart


_FEW_WORKER_SUBSOLVERS = ("quick_restart_no_lp", "default_lp")
"""With few workers quick_restart_no_lp first: it places Chimera windows where default_lp alone finds none in time."""

FEASIBILITY_PROBING_LEVEL = 0
"""CP-SAT's presolve probing (default 2) for a fixed-strategy feasibility probe, whose budget probing spent first."""


@dataclass
class Vars:
    """The model, its variables by task and slot, the option literals and, where a layer chooses, each (layer, part)'s
    BCAST (start, pos, has, end), its stage's slot ticks and each device's optional BCASTs."""

    model: cp_model.CpModel
    start: list[cp_model.IntVar] = field(default_factory=list)
    pos: list[cp_model.IntVar] = field(default_factory=list)
    late: list[cp_model.IntVar] = field(default_factory=list)
    present: list[dict[int, cp_model.IntVar]] = field(default_factory=list)
    prec: list[cp_model.IntVar] = field(default_factory=list)
    intervals_of_device: dict[int, list[cp_model.IntervalVar]] = field(default_factory=dict)
    lits: dict[str, list[cp_model.IntVar]] = field(default_factory=dict)
    bcast: dict[tuple[str, str], tuple[cp_model.IntVar, cp_model.IntVar, cp_model.IntVar, cp_model.LinearExprT]] = (
        field(default_factory=dict)
    )
    slot_ticks: dict[int, cp_model.IntVar] = field(default_factory=dict)
    bcast_load: dict[int, list[tuple[int, cp_model.IntVar]]] = field(default_factory=dict)
    constant: dict[tuple[int, int], cp_model.IntervalVar] = field(default_factory=dict)


def constant_interval(v: Vars, start: int, size: int) -> cp_model.IntervalVar:
    """The one interval [start, start + size) all devices share ([Note: no twin intervals])."""
    if (start, size) not in v.constant:
        v.constant[start, size] = v.model.new_fixed_size_interval_var(start, size, f"fixed_{start}_{size}")
    return v.constant[start, size]


def modular(
    v: Vars, name: str, lo: int, hi: int, ticks: int, length: int, wraps: bool = False
) -> tuple[cp_model.IntVar, ...]:
    """(start, pos, late) of a start in [lo, hi] whose interval lies in one window (or may pass its end: `wraps`)."""
    m = v.model
    start = m.new_int_var(lo, max(lo, hi), f"start_{name}")
    pos = m.new_int_var(0, length - (1 if wraps else ticks), f"pos_{name}")
    late = m.new_bool_var(f"late_{name}")
    m.add(start == pos + length * late)
    return start, pos, late


def add_tasks(v: Vars, w: Window, free_w: bool = True) -> None:
    """Every task on its device(s); at k = 1 with a lead ([Note: step barrier] in planner/plan/window.py) laid at pos
    and pos - L (no-overlap modulo L). `free_w` False: each W at its schedule position ([Note: placed W])."""
    L = w.length
    wraps = w.k == 1 and w.leads[0] > 0
    for task in w.tasks:
        lo = w.earliest(task)
        due = w.horizon if task.deadline is None else task.deadline  # a W's: its stage's update
        if task.kind is TaskKind.WGRAD and not free_w and task.home is not None:
            lo, due = task.home, task.home + task.ticks  # where the schedule runs it
        start, pos, late = modular(v, task.name, lo, due - task.ticks, task.ticks, L, wraps)
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
            v.model.add_exactly_one(present.values())
        else:
            ivs = [v.model.new_fixed_size_interval_var(at, task.ticks, task.name) for at in laid]
            for d in task.devices:
                v.intervals_of_device[d] += ivs
        v.present.append(present)


def add_precedences(v: Vars, w: Window) -> None:
    """Per factor curvature (or its W), sync, decomposition, broadcast in order, done before the next refresh (L later)
    needs the buffers; a deferred curvature after its W (`w_makers`); pieces in order on one rank; `warm_starts`."""
    L, m = w.length, v.model
    by_factor: dict[tuple[str, str], dict[TaskKind, list[int]]] = {}
    for i, task in enumerate(w.tasks):
        for f in task.factors:
            by_factor.setdefault(f, {}).setdefault(task.kind, []).append(i)
        if task.kind is TaskKind.CURV:
            m.add(v.start[i] + task.ticks <= task.release + L)
    for kinds in by_factor.values():
        chain = [kinds[k] for k in TaskKind if k in kinds]  # curv, sync, inv, bcast
        for before, after in zip(chain, chain[1:]):
            for b in before:
                for a in after:
                    m.add(v.start[a] >= v.start[b] + w.tasks[b].ticks)
        first, last = kinds[TaskKind.INV][0], kinds[TaskKind.INV][-1]
        for c in kinds.get(TaskKind.CURV, []) + kinds.get(TaskKind.WGRAD, []):  # a W folds a fused part's
            m.add(v.start[last] + w.tasks[last].ticks <= v.start[c] + L)
        for b in kinds.get(TaskKind.BCAST, []):
            m.add(v.start[b] + 1 <= v.start[first] + L)
    for i, c in w_makers(w):
        m.add(v.start[c] >= v.start[i] + w.tasks[i].ticks)
    for pieces in inv_chains(w):
        for p, q in zip(pieces, pieces[1:]):
            m.add(v.start[q] >= v.start[p] + w.tasks[p].ticks)
            for d, present in v.present[p].items():
                m.add(v.present[q][d] == present)
    for i, warmed in warm_starts(w):
        m.add(v.start[i] + done_by(w.tasks[i]) <= v.start[warmed] + L)


def chooses(options: Options, layers: Iterable[str]) -> bool:
    """Whether any of `layers` has several options (the model chooses its distribution)."""
    return any(len(options[n]) > 1 for n in layers)


def stages_choose(w: Window, options: Options, stages: Iterable[int]) -> bool:
    """Whether any layer of `stages` has several options."""
    return chooses(options, (x.name for s in stages for x in w.problem.costs.stages[s].layers))


def placed_tasks(w: Window, options: Options) -> tuple[Task, ...]:
    """The window's tasks but a choosing layer's BCASTs (placed per option), each DECOMP on any rank an option has."""
    out = []
    for task in w.tasks:
        if task.kind is TaskKind.BCAST and chooses(options, [task.factors[0][0]]):
            continue
        if task.kind is TaskKind.INV:
            ranks = {d for o in options[task.factors[0][0]] for d in o.workers}
            task = replace(task, devices=tuple(d for d in w.problem.holders[task.stage] if d in ranks))
        out.append(task)
    return tuple(out)


def _add_choices(v: Vars, w: Window, options: Options) -> None:
    """The option literals: a DECOMP only on a rank of its chosen column; per (layer, part) one start of the chosen
    BCAST, an optional interval per option on its ranks, after the part's DECOMP, before the next refresh's first."""
    m, L = v.model, w.length
    v.lits = literals(m, options) if chooses(options, options) else {}
    for i, task in enumerate(w.tasks):
        if task.kind is TaskKind.INV and chooses(options, [task.factors[0][0]]):
            layer = task.factors[0][0]
            for d, present in v.present[i].items():
                m.add_bool_or([~present, *[lit for o, lit in zip(options[layer], v.lits[layer]) if d in o.workers]])
    chains = {w.tasks[c[0]].factors[0]: c for c in inv_chains(w)}
    for (layer, part), chain in chains.items():
        if not chooses(options, [layer]):
            continue  # its BCAST is the window's task
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
            interval = m.new_optional_fixed_size_interval_var(pos, ticks, lit, f"{name}_o{n}")
            for d in workers:
                v.intervals_of_device[d].append(interval)
                v.bcast_load.setdefault(d, []).append((ticks, lit))
            m.add(pos + ticks <= L).only_enforce_if(lit)
            m.add(start + ticks <= w.horizon).only_enforce_if(lit)
        m.add(start == 0).only_enforce_if(~has)
        m.add(start >= v.start[chain[-1]] + w.tasks[chain[-1]].ticks).only_enforce_if(has)
        for first in sorted({c[0] for (x, _), c in chains.items() if x == layer}):
            m.add(start + 1 <= v.start[first] + L).only_enforce_if(has)
        v.bcast[layer, part] = (start, pos, has, start + sum(ticks * lit for _, ticks, _, lit in chosen))


def _add_slots(v: Vars, w: Window, options: Options) -> None:
    """Every slot on its device: the window's own where its stage's options are fixed (an empty one no interval), else
    as long as the options make it within its room and the step; copies start a sharing slot together."""
    m, L, timeline = v.model, w.length, step_timeline(w.problem)
    bound = ns((w.offsets[1] + 0.5) / w.scale) - min(1000, round(NS / w.scale / 4))
    starts: dict[int, cp_model.IntVar] = {}
    chosen = [s for s in w.group.stages if stages_choose(w, options, [s])]
    fixed: dict[tuple[int, int], cp_model.IntVar] = {}
    for n, slot in enumerate(w.precs):
        if slot.stage in chosen:
            continue
        name = f"prec_s{slot.stage}_r{slot.device}_j{slot.step}"
        start, pos, _ = modular(v, name, slot.release, slot.deadline - slot.ticks, slot.ticks, L)
        starts[n] = start
        if slot.ticks > 0:
            v.intervals_of_device[slot.device].append(m.new_fixed_size_interval_var(pos, slot.ticks, name))
        if slot.shares and fixed.setdefault((slot.stage, slot.step), start) is not start:
            m.add(start == fixed[slot.stage, slot.step])
    for s in chosen:
        slots = [n for n, p in enumerate(w.precs) if p.stage == s]
        room = max(1, min(w.precs[n].deadline - w.precs[n].release for n in slots))
        need, _ = slot_need(m, s, w.problem, v.lits, options, w.up, f"s{s}")
        need_ns, _ = slot_need(m, s, w.problem, v.lits, options, ns, f"ns_s{s}")
        m.add(ns(timeline.allreduce_end[w.problem.holders[s][0], s]) + need_ns <= bound)
        ticks = m.new_int_var(1, room, f"slot_ticks_s{s}")
        m.add_min_equality(ticks, [need, room])
        v.slot_ticks[s] = ticks
        layers = [x.name for x in w.problem.costs.stages[s].layers]
        sharing = [lit for n in layers for o, lit in zip(options[n], v.lits[n]) if not o.comm_opt]
        shares = m.new_bool_var(f"shares_s{s}")
        m.add_bool_or(sharing or [m.new_constant(0)]).only_enforce_if(shares)
        for lit in sharing:
            m.add_implication(lit, shares)
        first: dict[int, cp_model.IntVar] = {}
        for n in slots:
            slot = w.precs[n]
            name = f"prec_s{s}_r{slot.device}_j{slot.step}"
            start, pos, _ = modular(v, name, slot.release, slot.deadline - 1, 1, L)
            m.add(start + ticks <= slot.deadline)
            end = m.new_int_var(1, L, f"end_{name}")
            m.add(end == pos + ticks)
            v.intervals_of_device[slot.device].append(m.new_interval_var(pos, ticks, end, name))
            starts[n] = start
            if first.setdefault(slot.step, start) is not start:
                m.add(start == first[slot.step]).only_enforce_if(shares)
    v.prec = [starts[n] for n in range(len(w.precs))]


def _add_energy(v: Vars, w: Window) -> None:
    """Redundant: each device's work fits the time its fixed work leaves (proves a step too short at once)."""
    m = v.model
    for d in w.group.devices:
        load = []
        for i, task in enumerate(w.tasks):
            if d in task.devices:
                load.append(task.ticks * v.present[i][d] if task.kind is TaskKind.INV else task.ticks)
        load += [v.slot_ticks.get(p.stage, p.ticks) for p in w.precs if p.device == d]
        load += [ticks * lit for ticks, lit in v.bcast_load.get(d, [])]
        m.add(sum(load) <= w.length - sum(e - s for s, e in w.fixed[d]))


def _add_slot_order(v: Vars, w: Window) -> None:
    """A gradient-fed part's DECOMP after its refresh-step slot ([Note: gradient parts] in planner/plan/window.py); a
    W before its stage's slot of its step on its rank ([Note: placed W])."""
    for i, task in enumerate(w.tasks):
        if task.after_slot:
            for d, present in v.present[i].items():
                n = w.slot(d, task.stage)
                ticks = v.slot_ticks.get(task.stage, w.precs[n].ticks)
                v.model.add(v.start[i] >= v.prec[n] + ticks).only_enforce_if(present)
    for i, task in enumerate(w.tasks):
        if task.kind is TaskKind.WGRAD and task.home is not None:
            n = w.slot(task.devices[0], task.stage, w.step_of(task.home))
            v.model.add(v.start[i] + task.ticks <= v.prec[n])


def _add_memory(v: Vars, w: Window, options: Options) -> None:
    """Per device, activations and the a/e kept by deferred curvature (or a W) within its capacity (the budget less
    static bytes, which its layers' options move), in units that keep the largest capacity within 2**30."""
    budget, m, L = w.problem.memory_budget, v.model, w.length
    top = max((c for c in w.capacity.values() if c is not None), default=None)
    if top is None or budget is None:
        return
    unit = max(1, math.ceil(top / 2**30))
    for d in w.group.devices:
        cap: int | cp_model.IntVar = max(0, (w.capacity[d] or 0) // unit)
        if stages_choose(w, options, stages_on_device(w.problem, d)):
            cap = m.new_int_var(0, budget // unit, f"cap_r{d}")
            m.add(unit * cap <= budget - static_bytes(m, w.problem, d, v.lits, options))
        intervals = [constant_interval(v, s, e - s) for s, e, _ in w.acts[d]]
        demands = [math.ceil(nbytes / unit) for _, _, nbytes in w.acts[d]]
        for i, task in enumerate(w.tasks):
            if task.kind not in (TaskKind.CURV, TaskKind.WGRAD) or task.devices[0] != d or task.keep_bytes == 0:
                continue
            t0 = task.release % L
            held = m.new_int_var(task.ticks, L, f"held_{task.name}")
            m.add(held == v.start[i] + task.ticks - task.release)
            first = m.new_int_var(0, L - t0, f"keep1_{task.name}")
            second = m.new_int_var(0, L, f"keep2_{task.name}")
            m.add_min_equality(first, [held, L - t0])
            m.add_max_equality(second, [held - (L - t0), 0])
            intervals.append(m.new_interval_var(t0, first, t0 + first, f"keep_{task.name}"))
            intervals.append(m.new_interval_var(0, second, second, f"keep_wrap_{task.name}"))
            demands += [math.ceil(task.keep_bytes / unit)] * 2
        m.add_cumulative(intervals, demands, cap)


def _add_staleness(v: Vars, w: Window, options: Options) -> list[cp_model.LiteralT]:
    """The negated flags 'layer ready by its slot in step j' (of 2k, monotone), whose sum is the use offsets; a layer
    with several options is ready at one variable after its chosen BCASTs."""
    m = v.model
    ends: dict[str, list[cp_model.LinearExprT]] = {}
    for i, task in enumerate(w.tasks):
        if task.kind not in (TaskKind.INV, TaskKind.BCAST):
            continue
        if not chooses(options, [task.factors[0][0]]):
            for layer, _ in task.factors:
                ends.setdefault(layer, []).append(v.start[i] + task.ticks)
            continue
        layer = task.factors[0][0]
        if layer not in ends:
            ends[layer] = [m.new_int_var(0, 2 * w.horizon, f"ready_{layer}")]
        m.add(ends[layer][0] >= v.start[i] + task.ticks)
    for (layer, _), (_, _, has, end) in v.bcast.items():
        m.add(ends[layer][0] >= end).only_enforce_if(has)
    k, L = w.k, w.length
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
    """Interchangeable layers of a stage (equal costs) start their first part's decompositions in layer order."""
    first = {x.name: x.parts[0].part for s in w.group.stages for x in w.problem.costs.stages[s].layers if x.parts}
    inv_a = {
        task.factors[0][0]: i
        for i, task in enumerate(w.tasks)
        if task.kind is TaskKind.INV and task.side == first[task.factors[0][0]]
    }
    for s in w.group.stages:
        layers = w.problem.costs.stages[s].layers
        for a, b in zip(layers, layers[1:]):
            same = (a.parts, a.prec, a.name in w.fused) == (b.parts, b.prec, b.name in w.fused)
            if same and a.name in inv_a and b.name in inv_a:
                v.model.add(v.start[inv_a[a.name]] <= v.start[inv_a[b.name]])


def _build(
    w: Window, options: Options, optimize: bool, break_symmetry: bool = True, *, free_w: bool = True
) -> tuple[Vars, Window]:
    """The window's model with each layer's `options` (`optimize`: least staleness) and the window it places."""
    v = Vars(cp_model.CpModel(), intervals_of_device={d: [] for d in w.group.devices})
    placed = replace(w, tasks=placed_tasks(w, options))
    for d in placed.group.devices:  # the fixed work: F/B, gradient all-reduces, step boundaries
        for s, e in placed.fixed[d]:
            v.intervals_of_device[d].append(constant_interval(v, s, e - s))
    add_tasks(v, placed, free_w=free_w)
    add_precedences(v, placed)
    _add_choices(v, placed, options)
    _add_slots(v, placed, options)
    _add_slot_order(v, placed)
    if chooses(options, options):
        _add_energy(v, placed)
    for intervals in v.intervals_of_device.values():
        v.model.add_no_overlap(intervals)
    _add_memory(v, placed, options)
    if break_symmetry:
        break_layer_symmetry(v, placed)
    if optimize:
        v.model.minimize(sum(_add_staleness(v, placed, options)))
    return v, placed


def _hint(v: Vars, w: Window, hint: GroupSolution, options: Options) -> None:
    """Warm-start every variable from `hint` (a placement in a window of the same steps), by task name."""
    m, L = v.model, w.length
    named, inv_devices = hint.named_starts(), hint.inv_devices()
    for i, task in enumerate(w.tasks):
        at = named.get(task.name)
        if at is not None:
            m.add_hint(v.start[i], at)
            m.add_hint(v.pos[i], at % L)
            m.add_hint(v.late[i], at // L)
        for d, flag in v.present[i].items():
            m.add_hint(flag, inv_devices.get(task.factors[0]) == d)
    for layer, lits in v.lits.items():
        if chooses(options, [layer]):
            for o, lit in zip(options[layer], lits):
                m.add_hint(lit, hint.choice(layer) == o.where)
    for (layer, part), (start, pos, has, _) in v.bcast.items():
        at = named.get(f"bcast_{part}_{layer}", 0)
        m.add_hint(has, f"bcast_{part}_{layer}" in named)
        m.add_hint(start, at)
        m.add_hint(pos, at % L)
    for n, prec_start in enumerate(hint.prec_starts):
        m.add_hint(v.prec[n], prec_start)


def solve_window(
    w: Window,
    config: SolverConfig,
    time_limit: float,
    meter: Budget,
    hint: GroupSolution | None = None,
    *,
    optimize: bool = True,
    options: Options,
) -> Solved:
    """(status, solution) of one window with each layer's `options` (`optimize`: least staleness, else any placement)
    within `time_limit` of `meter`'s clock; a feasibility search frees the W's only where placed ones fail."""
    joint = chooses(options, options)
    fixed = [p for p in w.precs if not stages_choose(w, options, [p.stage])]
    longer = any(t.ticks > w.length for t in placed_tasks(w, options))
    if longer or any(p.deadline - p.release < p.ticks for p in fixed):
        return "INFEASIBLE", None
    where = f"{'joint ' if joint else ''}stages {list(w.group.stages)} k={w.k}"
    if meter.deterministic and meter.wall_left() <= 0:
        meter.note_capped(f"{where} not searched")
        return "UNKNOWN", None
    limit = max(meter.units(MIN_CALL), time_limit)
    label = f"stages {list(w.group.stages)} k={w.k}" + (f" stretch={w.stretch}" if w.stretch else "")
    placed_w = not optimize and any(t.kind is TaskKind.WGRAD for t in w.tasks)
    for free_w in (False, True) if placed_w else (True,):  # W's at the schedule's positions first
        v, placed = _build(w, options, optimize, free_w=free_w)
        if hint is not None and hint.window.offsets == w.offsets:
            _hint(v, placed, hint, options)
        reporter = _Reporter(config.progress, label, optimize) if config.progress is not None else None
        probing = None if optimize or joint else FEASIBILITY_PROBING_LEVEL
        solver, code = _solve(v.model, config, meter, limit, probing=probing, reporter=reporter)
        status = solver.status_name(code)
        unproven = status not in ("OPTIMAL", "INFEASIBLE")
        if meter.deterministic and unproven and solver.deterministic_time < limit * CAP_SLACK:
            meter.note_capped(where)
        if status != "INFEASIBLE":
            break
    found = status in ("OPTIMAL", "FEASIBLE")
    return status, _extract(solver, v, placed, options, status) if found else None


def _extract(solver: cp_model.CpSolver, v: Vars, w: Window, options: Options, status: str) -> GroupSolution:
    """The solver's values as a solution of `w`, with the options chosen (a BCAST on its DECOMP's rank)."""
    starts = tuple(solver.value(x) for x in v.start)
    devices = [
        next((d for d, f in v.present[i].items() if solver.boolean_value(f)), t.devices[0])
        for i, t in enumerate(w.tasks)
    ]
    inv_device = {task.factors[0]: devices[i] for i, task in enumerate(w.tasks) if task.kind is TaskKind.INV}
    devices = [inv_device[t.factors[0]] if t.kind is TaskKind.BCAST else d for t, d in zip(w.tasks, devices)]
    precs = tuple(solver.value(x) for x in v.prec)
    choices = choices_of(solver, options, v.lits)
    chosen_bcasts = [(key, start, end) for key, (start, _, has, end) in v.bcast.items() if solver.boolean_value(has)]
    offsets = use_offsets(w, starts, precs, {layer: solver.value(end) for (layer, _), _, end in chosen_bcasts})
    bcasts = {key: solver.value(start) for key, start, _ in chosen_bcasts}
    slots = {s: solver.value(t) for s, t in v.slot_ticks.items()}
    found = (starts, tuple(devices), precs, offsets)
    return GroupSolution(w, *found, "cpsat", status, 1, solver.wall_time, choices, bcasts, slots)


class _Reporter(cp_model.CpSolverSolutionCallback):
    """Passes each placement, better bound and final status of one CP-SAT call to `SolverConfig.progress`."""

    def __init__(self, report: Callable[[SolveProgress], None], window: str, optimize: bool) -> None:
        super().__init__()
        self.report, self.window, self.optimize = report, window, optimize
        self.objective: float | None = None
        self.began = time.perf_counter()

    def on_solution_callback(self) -> None:
        if self.optimize:
            self.objective = self.objective_value
        self.send("FEASIBLE", self.best_objective_bound if self.optimize else None)

    def on_bound(self, bound: float) -> None:
        self.send("FEASIBLE" if self.objective is not None else "UNKNOWN", bound)

    def send(self, status: str, bound: float | None, done: bool = False) -> None:
        self.report(SolveProgress(self.window, status, self.objective, bound, time.perf_counter() - self.began, done))


CAP_SLACK = 0.99
"""A deterministic search that stopped unproven below this fraction of its budget was stopped by the wall cap."""


def _solve(
    model: cp_model.CpModel,
    config: SolverConfig,
    meter: Budget,
    limit: float,
    *,
    probing: int | None = None,
    reporter: _Reporter | None = None,
) -> tuple[cp_model.CpSolver, Any]:
    """The one CP-SAT call, for `limit` of `meter`'s unit, charged to it: (solver, status). Deterministic: one thread
    running the few-worker portfolio, stopped by max_deterministic_time, the wall cap as a net."""
    solver = cp_model.CpSolver()
    params, limit = solver.parameters, max(meter.units(MIN_CALL), limit)
    params.random_seed = config.seed
    params.num_workers = 1 if meter.deterministic else config.num_workers
    if params.num_workers <= 2:
        params.subsolvers.extend(_FEW_WORKER_SUBSOLVERS)
    if meter.deterministic:
        params.max_deterministic_time = meter.solver_limit(limit)
        params.max_time_in_seconds = max(MIN_CALL, meter.wall_left())
    else:
        params.max_time_in_seconds = limit
    if probing is not None:
        params.cp_model_probing_level = probing
    if reporter is not None and reporter.optimize:
        solver.best_bound_callback = reporter.on_bound
    status = solver.solve(model, reporter)
    meter.charge(solver.deterministic_time, solver.wall_time)
    if reporter is not None:
        found = reporter.optimize and status in (cp_model.OPTIMAL, cp_model.FEASIBLE)
        reporter.objective = solver.objective_value if found else None
        reporter.send(solver.status_name(status), solver.best_objective_bound if found else None, done=True)
    return solver, status


def energy_bound(w: Window, options: Options, base: int, config: SolverConfig, meter: Budget, limit: float) -> int:
    """The least step (ticks, from `base`) at which some option set's work fits every device's free time in w's k
    steps (`base` when none was proven in time)."""
    k, upper = w.k, w.offsets[1]
    m = cp_model.CpModel()
    lits = literals(m, options)
    step = m.new_int_var(base, upper, "step")
    load: dict[int, list[cp_model.LinearExprT]] = {d: [] for d in w.group.devices}
    for task in placed_tasks(w, options):
        if task.kind is not TaskKind.INV:
            for d in task.devices:
                load[d].append(task.ticks)
            continue
        layer = task.factors[0][0]
        on = {d: m.new_bool_var(f"on_{task.name}_r{d}") for d in task.devices}
        m.add_exactly_one(on.values())
        for d, flag in on.items():
            m.add_bool_or([~flag, *[lit for o, lit in zip(options[layer], lits[layer]) if d in o.workers]])
            load[d].append(task.ticks * flag)
    for layer, opts in options.items():
        for o, lit in zip(opts, lits[layer] if len(opts) > 1 else ()):  # a layer's one option: its BCAST a task
            for secs in o.bcast.values():
                for d in o.workers:
                    load[d].append(w.span(secs) * lit)
    for s in w.group.stages:
        need, _ = slot_need(m, s, w.problem, lits, options, w.up, f"s{s}")
        for d in w.problem.holders[s]:
            load[d] += [need] * k
    for d, items in load.items():  # the fixed work's ticks per step off each step
        m.add(sum(items) <= k * (step - sum(e - s for s, e in w.fixed[d]) // k))
    m.minimize(step)
    solver, status = _solve(m, config, meter, limit)
    return round(solver.best_objective_bound) if status in (cp_model.OPTIMAL, cp_model.FEASIBLE) else base


def choices_of(solver: cp_model.CpSolver, options: Options, lits: Literals) -> dict[str, LayerDistribution]:
    """Each layer's distribution the solver's literals chose."""
    return {n: next(o.where for o, x in zip(options[n], xs) if solver.boolean_value(x)) for n, xs in lits.items()}


def literals(m: cp_model.CpModel, options: Options) -> dict[str, list[cp_model.IntVar]]:
    """One Boolean per option of every layer, exactly one true per layer (a layer's one option: the constant 1)."""
    lits = {}
    for name, opts in options.items():
        lits[name] = (
            [m.new_bool_var(f"opt_{name}_{i}") for i in range(len(opts))] if len(opts) > 1 else [m.new_constant(1)]
        )
        if len(opts) > 1:
            m.add_exactly_one(lits[name])
    return lits


def slot_need(
    m: cp_model.CpModel, stage: int, problem: Problem, lits: Literals, options: Options, unit: Ticks, name: str
) -> tuple[cp_model.IntVar, int]:
    """(a variable at least `stage`'s slot on each copy, its bound) in `unit`: the all-COMM-OPT slot, else the
    longest apply work on a copy and then every BCAST_PREC."""
    layers = [x.name for x in problem.costs.stages[stage].layers]
    comm = [lits[n][i] for n in layers for i, o in enumerate(options[n]) if o.comm_opt]
    all_comm = m.new_bool_var(f"allcomm_{name}")
    if len(comm) == len(layers):
        m.add_bool_and(comm).only_enforce_if(all_comm)
        m.add_bool_or([all_comm, *[~x for x in comm]])
    else:
        m.add(all_comm == 0)
    comm_slot = unit(comm_slot_seconds(problem, stage))
    top = comm_slot + sum(max(unit(o.apply) + unit(o.share) for o in options[n]) for n in layers) + 1
    lead = m.new_int_var(0, top, f"lead_{name}")
    for c in problem.holders[stage]:
        m.add(lead >= sum(unit(o.apply) * x for n in layers for o, x in zip(options[n], lits[n]) if c in o.workers))
    need = m.new_int_var(1, top, f"need_{name}")
    m.add(need >= comm_slot).only_enforce_if(all_comm)
    shared = sum(unit(o.share) * x for n in layers for o, x in zip(options[n], lits[n]))
    m.add(need >= lead + shared).only_enforce_if(~all_comm)
    return need, top


def static_bytes(
    m: cp_model.CpModel, problem: Problem, device: int, lits: Literals, options: Options
) -> cp_model.LinearExprT:
    """`step_timeline.static_bytes` of `device` as a linear expression of the option literals."""
    stages = stages_on_device(problem, device)
    base = sum(2 * problem.costs.stages[s].param_bytes for s in stages)
    base += max((problem.costs.stages[s].peak_err_bytes for s in stages), default=0)
    kept, buffers = [], []
    for layer in (x.name for s in stages for x in problem.costs.stages[s].layers):
        for option, lit in zip(options[layer], lits[layer]):
            held, shared = held_bytes(problem, device, layer, option.where)
            kept.append(held * lit)
            if shared:
                buffers.append((shared, lit))
    largest = m.new_int_var(0, max((b for b, _ in buffers), default=0), f"shared_r{device}")
    for nbytes, lit in buffers:
        m.add(largest >= nbytes * lit)
    return base + sum(kept) + largest


def least_step(
    problem: Problem, free: frozenset[int], config: SolverConfig, meter: Budget, time_limit: float
) -> dict[str, LayerDistribution] | None:
    """The free stages' distributions of least reference step within memory, then of least DECOMP seconds on any
    rank (KAISA's balance); None when none meets the budget or none was found in time."""
    m, timeline, top = cp_model.CpModel(), step_timeline(problem), ns(step_fixed_end(problem, free))
    options = options_of(problem, range(problem.num_stages), free)
    lits = literals(m, options)
    ends: list[cp_model.LinearExprT] = [top]
    for s in sorted(free):
        need, most = slot_need(m, s, problem, lits, options, ns, f"s{s}")
        release = ns(timeline.allreduce_end[problem.holders[s][0], s])
        ends.append(release + need)
        top = max(top, release + most)
    step = m.new_int_var(0, top, "step")
    for end in ends:
        m.add(step >= end)
    if problem.memory_budget is not None:
        for d in problem.devices:
            m.add(static_bytes(m, problem, d, lits, options) + activation_peak(problem, d) <= problem.memory_budget)
    m.minimize(step)
    solver, status = _solve(m, config, meter, time_limit / 2)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    least = solver.value(step)
    m.add(step <= least)
    for lit in (x for xs in lits.values() for x in xs):
        m.add_hint(lit, solver.boolean_value(lit))
    load = m.new_int_var(0, sum(ns(x.inv) for x in problem.costs.layers), "load")
    shares = [
        (o.workers, ns(problem.costs.layer(n).inv / len(o.workers)) * lit)
        for n in options
        for o, lit in zip(options[n], lits[n])
    ]
    for d in problem.devices:  # decomposition ns on rank d: each layer's shared by its grad workers
        m.add(load >= sum(work for workers, work in shares if d in workers))
    m.minimize(load)
    balanced, status = _solve(m, config, meter, time_limit / 2)
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        solver = balanced
    return {n: where for n, where in choices_of(solver, options, lits).items() if problem.costs.stage_of(n) in free}
