"""The least-step CP-SAT model of the joint choice ([Note: joint strategy] in planner/joint.py), and the option
literals it shares with the window model (planner/joint_cpsat.py): each layer's distribution options with their
seconds, one Boolean per option, a stage's slot length and a device's static bytes as linear expressions of them.

`least_step` chooses the free stages' distributions that make the least reference step
(`planner.joint.reference_step`) within every device's memory budget, then, at that step, the least decomposition
seconds on any one rank.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ortools.sat.python import cp_model

from fxkfac.planner.budget import MIN_CALL, Budget
from fxkfac.planner.cpsat import set_limits
from fxkfac.planner.joint import (
    apply_seconds,
    base_bytes,
    bcast_seconds,
    comm_slot_seconds,
    held_bytes,
    layer_options,
    share_seconds,
)
from fxkfac.planner.memory import activation_peak
from fxkfac.planner.problem import Problem, SolverConfig, copies_of_stage, stages_on_device
from fxkfac.planner.step_timeline import step_timeline
from fxkfac.planner.strategy import LayerDistribution, grad_workers

__all__ = ["Option", "options_of", "StepChoice", "least_step"]

NS = 1_000_000_000
"""Nanoseconds per second: the step models' unit (a step of seconds stays far inside CP-SAT's integers)."""

Ticks = Callable[[float], int]
"""Seconds to a model's integer unit (ticks of a window, rounded up; or nanoseconds)."""


@dataclass(frozen=True)
class Option:
    """One distribution a layer may take, with what it costs in seconds: its DECOMP's ranks (`workers`), the
    BCAST of each part within them (absent: one worker), the per-step work on each worker and the BCAST_PREC
    on every copy."""

    where: LayerDistribution
    workers: tuple[int, ...]
    bcast: Mapping[str, float]
    apply: float
    share: float

    @property
    def comm_opt(self) -> bool:
        """Whether it is COMM-OPT (its stage may then have one APPLY and no shared gradients)."""
        return self.where == LayerDistribution()


Options = Mapping[str, tuple[Option, ...]]
"""Every layer's options, by name."""


def options_of(problem: Problem, layer: str, free: bool) -> tuple[Option, ...]:
    """The options of `layer`: every KAISA distribution when `free`, else the problem's own."""
    copies = copies_of_stage(problem, problem.costs.stage_of(layer))
    chosen = layer_options(problem, layer) if free else (problem.where(layer),)
    out = []
    for where in chosen:
        workers = grad_workers(copies, where)
        parts = {p.part: bcast_seconds(problem, layer, p.part, where) for p in problem.costs.layer(layer).parts}
        out.append(
            Option(
                where,
                workers,
                parts if len(workers) > 1 else {},  # as the window has a BCAST task, however short
                apply_seconds(problem, layer),
                share_seconds(problem, layer, where),
            )
        )
    return tuple(out)


def ns(seconds: float) -> int:
    """`seconds` in nanoseconds, rounded."""
    return round(seconds * NS)


def literals(m: cp_model.CpModel, options: Options) -> dict[str, list[cp_model.IntVar]]:
    """One Boolean per option of every layer, exactly one true per layer."""
    lits = {}
    for name, opts in options.items():
        lits[name] = [m.new_bool_var(f"opt_{name}_{i}") for i in range(len(opts))]
        m.add_exactly_one(lits[name])
    return lits


def slot_need(
    m: cp_model.CpModel,
    stage: int,
    problem: Problem,
    lits: Mapping[str, list[cp_model.IntVar]],
    options: Options,
    unit: Ticks,
    name: str,
) -> tuple[cp_model.IntVar, int]:
    """(a variable at least the length of `stage`'s slot on each copy, its upper bound), in `unit`: the all-COMM-OPT
    slot when every layer is COMM-OPT, else the longest apply work on a copy and then every BCAST_PREC."""
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
    for c in copies_of_stage(problem, stage):
        m.add(lead >= sum(unit(o.apply) * x for n in layers for o, x in zip(options[n], lits[n]) if c in o.workers))
    need = m.new_int_var(1, top, f"need_{name}")
    m.add(need >= comm_slot).only_enforce_if(all_comm)
    m.add(need >= lead + sum(unit(o.share) * x for n in layers for o, x in zip(options[n], lits[n]))).only_enforce_if(
        ~all_comm
    )
    return need, top


def static_bytes(
    m: cp_model.CpModel, problem: Problem, device: int, lits: Mapping[str, list[cp_model.IntVar]], options: Options
) -> cp_model.LinearExprT:
    """`planner.memory.static_bytes` of `device` as a linear expression of the option literals."""
    kept, buffers = [], []
    for s in stages_on_device(problem, device):
        for x in problem.costs.stages[s].layers:
            for option, lit in zip(options[x.name], lits[x.name]):
                held, shared = held_bytes(problem, device, x.name, option.where)
                kept.append(held * lit)
                if shared:
                    buffers.append((shared, lit))
    largest = m.new_int_var(0, max((b for b, _ in buffers), default=0), f"shared_r{device}")
    for nbytes, lit in buffers:
        m.add(largest >= nbytes * lit)
    return base_bytes(problem, device) + sum(kept) + largest


@dataclass(frozen=True)
class StepChoice:
    """The least-step model's answer: the free layers' distributions and the reference step they make (seconds, as
    the model sums it)."""

    distributions: Mapping[str, LayerDistribution]
    step: float


def least_step(
    problem: Problem, free: frozenset[int], fixed_end: float, config: SolverConfig, meter: Budget, time_limit: float
) -> StepChoice | None:
    """The free stages' layer distributions that make the least reference step (`planner.joint.reference_step`:
    `fixed_end`, and each free stage's all-reduce end plus its slot) within every device's static bytes and
    activation peak; among those, the least decomposition seconds on any one rank (KAISA's balance, for the warm
    start's refresh). None when no option set meets the memory budget or none was found in time."""
    m = cp_model.CpModel()
    options = {
        x.name: options_of(problem, x.name, s in free)
        for s, stage in enumerate(problem.costs.stages)
        for x in stage.layers
    }
    lits = literals(m, options)
    timeline = step_timeline(problem)
    ends: list[tuple[int, cp_model.IntVar | int]] = [(ns(fixed_end), 0)]
    top = ns(fixed_end)
    for s in sorted(free):
        need, most = slot_need(m, s, problem, lits, options, ns, f"s{s}")
        release = ns(timeline.allreduce_end[copies_of_stage(problem, s)[0], s])
        ends.append((release, need))
        top = max(top, release + most)
    step = m.new_int_var(0, top, "step")
    for release, length in ends:
        m.add(step >= release + length)
    if problem.memory_budget is not None:
        for d in problem.devices:
            m.add(static_bytes(m, problem, d, lits, options) + activation_peak(problem, d) <= problem.memory_budget)
    m.minimize(step)
    solver = make_solver(config, meter, time_limit / 2)
    if solver.solve(m) not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        meter.charge(solver.deterministic_time)
        return None
    meter.charge(solver.deterministic_time)
    least = solver.value(step)
    m.add(step <= least)
    for x in lits.values():
        for lit in x:
            m.add_hint(lit, solver.boolean_value(lit))
    _minimize_decomp_load(m, problem, options, lits)
    balanced = make_solver(config, meter, time_limit / 2)
    if balanced.solve(m) in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        solver = balanced
    meter.charge(balanced.deterministic_time)
    chosen = {
        n: next(o.where for o, lit in zip(options[n], lits[n]) if solver.boolean_value(lit))
        for s in sorted(free)
        for n in (x.name for x in problem.costs.stages[s].layers)
    }
    return StepChoice(chosen, least / NS)


def _minimize_decomp_load(
    m: cp_model.CpModel, problem: Problem, options: Options, lits: Mapping[str, list[cp_model.IntVar]]
) -> None:
    """Make `m` minimize the most decomposition seconds (ns) any one rank takes under the chosen options (KAISA's
    balance: each layer's decomposition shared by its grad workers)."""
    load = m.new_int_var(0, sum(ns(x.inv) for stage in problem.costs.stages for x in stage.layers), "load")
    for d in problem.devices:
        m.add(
            load
            >= sum(
                ns(problem.costs.layer(n).inv / len(o.workers)) * lit
                for n, opts in options.items()
                for o, lit in zip(opts, lits[n])
                if d in o.workers
            )
        )
    m.minimize(load)


def make_solver(config: SolverConfig, meter: Budget, limit: float) -> cp_model.CpSolver:
    """A solver with the planner's limits for one call of `limit` in `meter`'s unit."""
    solver = cp_model.CpSolver()
    set_limits(solver.parameters, config, meter, max(meter.units(MIN_CALL), limit))
    return solver
