"""A window's solution and what it says: placements, use offsets, memory peaks, each refresh op's first step."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from fxkfac.planner.plan.window import TaskKind, Window, wrap
from fxkfac.planner.problem.ir import LayerTiming, Op, OpKind, Placement
from fxkfac.planner.problem.lowering import made_refreshes, replica_born
from fxkfac.planner.problem.problem import Problem
from fxkfac.planner.problem.step_timeline import decomposition_bytes, peak_level, static_bytes
from fxkfac.planner.problem.strategy import LayerDistribution

Born = dict[int, dict[Op, int]]
"""Per device, each op's first window step (`planner.problem.lowering.startup_programs`)."""


@dataclass(frozen=True)
class GroupSolution:
    """One window's solution: task starts (ticks) and devices, APPLY starts, use offsets, how it was found, and a
    joint solve's choices ([Note: joint strategy] in planner/search/cpsat.py)."""

    window: Window
    starts: tuple[int, ...]
    devices: tuple[int, ...]
    prec_starts: tuple[int, ...]
    use_offset: Mapping[str, int]
    method: str
    status: str
    k_lower_bound: int
    wall_time: float = field(default=0.0, compare=False)
    choices: Mapping[str, LayerDistribution] = field(default_factory=dict)
    bcasts: Mapping[tuple[str, str], int] = field(default_factory=dict)
    slot_ticks: Mapping[int, int] = field(default_factory=dict)

    @property
    def step_ticks(self) -> int:
        """Ticks of the window's first step, its stretch included."""
        return self.window.offsets[1]

    @property
    def staleness(self) -> int:
        return sum(self.use_offset.values())

    def named_starts(self) -> dict[str, int]:
        """Every placed task's start by name, each chosen broadcast's as its BCAST task's name."""
        named = {task.name: t for task, t in zip(self.window.tasks, self.starts)}
        return named | {f"bcast_{part}_{layer}": t for (layer, part), t in self.bcasts.items()}

    def inv_devices(self) -> dict[tuple[str, str], int]:
        """The rank decomposing each (layer, part)."""
        return {task.factors[0]: d for task, d in zip(self.window.tasks, self.devices) if task.kind is TaskKind.INV}

    def choice(self, layer: str) -> LayerDistribution:
        return self.choices[layer] if layer in self.choices else self.window.problem.where(layer)

    def distributions(self) -> dict[str, LayerDistribution]:
        """Every layer of the window's stage group with its distribution."""
        stages = self.window.problem.costs.stages
        return {x.name: self.choice(x.name) for s in self.window.group.stages for x in stages[s].layers}


def all_placed(solutions: Iterable[GroupSolution | None]) -> list[GroupSolution] | None:
    """Every group's solution, or None when any group found none."""
    placed = list(solutions)
    return None if any(s is None for s in placed) else [s for s in placed if s is not None]


def use_offsets(
    window: Window, starts: tuple[int, ...], prec_starts: tuple[int, ...], later: Mapping[str, int] | None = None
) -> dict[str, int]:
    """Per layer, the first window step u (0..2k) whose APPLY starts on every copy after its decompositions and
    broadcasts (and `later`: the ends of a joint solve's chosen broadcasts) end."""
    ready: dict[str, int] = dict(later or {})
    for task, start in zip(window.tasks, starts):
        if task.kind in (TaskKind.INV, TaskKind.BCAST):
            for layer, _ in task.factors:
                ready[layer] = max(ready.get(layer, 0), start + task.ticks)
    k, L = window.k, window.length
    out = {}
    for layer, t in ready.items():
        stage, out[layer] = window.problem.costs.stage_of(layer), 2 * k + 1
        for u in range(2 * k + 1):
            streamed = window.streamed_use(layer, u)
            slots = [i for i, p in enumerate(window.precs) if p.stage == stage and p.step == u % k]
            if all((streamed if streamed is not None else L * (u // k) + prec_starts[i]) >= t for i in slots):
                out[layer] = u
                break
    return out


def remade_spans(solution: GroupSolution, device: int) -> list[tuple[int, int, int]]:
    """(start, end, bytes) on `device` of each layer's third decomposition (`static_bytes` counts two): from its next
    refresh's first DECOMP end until the device's APPLY first uses this one, where that is later."""
    w = solution.window
    k, L = w.k, w.length
    first: dict[str, int] = {}  # each layer's first DECOMP or BCAST op's end
    for task, start in zip(w.tasks, solution.starts):
        if task.kind in (TaskKind.INV, TaskKind.BCAST):
            layer = task.factors[0][0]
            first[layer] = min(first.get(layer, start + task.ticks), start + math.ceil(task.seconds[0] * w.scale))
    out = []
    for layer, made in first.items():
        nbytes = decomposition_bytes(w.problem, device, layer)
        stage, u = w.problem.costs.stage_of(layer), solution.use_offset[layer]
        used = L * (u // k) + max(
            (
                solution.prec_starts[i] + math.ceil(at * w.scale)
                for i, p in enumerate(w.precs)
                if (p.device, p.stage, p.step) == (device, stage, u % k)
                for op, at in zip(p.ops, p.offsets)
                if op.kind is OpKind.APPLY and op.layer in (None, layer)
            ),
            default=0,
        )
        if nbytes and made + L < used:
            out += [(s, e, nbytes) for s, e in wrap(made + L, used, L)]
    return out


def placements_of(solution: GroupSolution) -> list[Placement]:
    """The solution's ops with device, window step and seconds (collectives on every member, a task's back to back)."""
    w = solution.window
    out: list[Placement] = []
    for task, start, device in zip(w.tasks, solution.starts, solution.devices):
        members = task.devices if task.kind.collective else (device,)
        step, begin = w.step_of(start), w.seconds(start)
        for member in members:
            for op, secs, t in zip(task.ops, task.seconds, itertools.accumulate(task.seconds, initial=begin)):
                placed = replace(op, root=device) if task.kind is TaskKind.BCAST else op  # from where it was decomposed
                out.append(Placement(placed, member, step, t, t + secs))
    for slot, start in zip(w.precs, solution.prec_starts):
        out += [
            Placement(op, slot.device, slot.step, w.seconds(start) + at, w.seconds(start) + at + secs)
            for op, secs, at in zip(slot.ops, slot.durations, slot.offsets)
        ]
    return out


def peak_bytes(solution: GroupSolution, device: int) -> int:
    """Static bytes plus the peak of activations, kept a/e, W operands and third decompositions on `device`."""
    window = solution.window
    kept = [
        (s, e, task.keep_bytes)
        for task, start in zip(window.tasks, solution.starts)
        if task.kind in (TaskKind.CURV, TaskKind.WGRAD) and task.devices[0] == device and task.keep_bytes
        for s, e in wrap(task.release, start + task.ticks, window.length)
    ]
    spans = [*window.acts[device], *kept, *remade_spans(solution, device)]
    return static_bytes(window.problem, device) + peak_level(spans)


def fits_memory(solution: GroupSolution) -> bool:
    """Whether the solution stays within the memory budget on every device of its group."""
    w = solution.window
    budget = w.problem.memory_budget
    return budget is None or all(peak_bytes(solution, d) <= budget for d in w.group.devices)


_REFRESH_KINDS = frozenset({OpKind.STATS, OpKind.SYNC_STATS, OpKind.DECOMP, OpKind.BCAST})


def plan_born(problem: Problem, placements: Iterable[Placement], timings: Mapping[str, LayerTiming]) -> Born:
    """`born_steps` of a plan's placements and each streamed layer's replica transfers (`replica_born`)."""
    placed = list(placements)
    born = born_steps(placed)
    if problem.streaming is not None:
        sender = problem.stream_owners[0]
        made = made_refreshes(problem.streaming, placed, timings, sender)
        for rank, ops in replica_born(problem.streaming, sender, made).items():
            born.setdefault(rank, {}).update(ops)
    return born


def born_steps(placements: Iterable[Placement]) -> Born:
    """Per device, each refresh op's latest window step (`startup_programs`); per-step ops run from step 0."""
    born: Born = {}
    for p in placements:
        if p.op.kind in _REFRESH_KINDS and not (p.op.kind is OpKind.STATS and p.op.mb is None):
            mine = born.setdefault(p.device, {})
            mine[p.op] = max(mine.get(p.op, 0), p.step)
    return born
