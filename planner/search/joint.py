"""The data of the joint choice: every layer's distribution options, what each costs, and the window they share.

[Note: joint strategy] With the strategy left to the planner, CP-SAT chooses each layer's distribution
(planner/problem/strategy.py: COMM-OPT, HYBRID with each grad-worker count that divides the copies, MEM-OPT, each with
every column; DP-KFAC never, a different algorithm only the user may ask for) in the same model that places the
refresh work (planner/search/cpsat.py with a `Frame`), where the option of a layer is a Boolean literal:
- its DECOMP runs on one rank of the chosen column (one INV task whose device literal implies an option holding
  that rank); its BCAST is one optional interval per option with several grad workers, over that option's
  column, of that group size's price; SYNC_STATS and the curvature are the same under every KAISA option;
- each stage's per-step slot lasts a linear function of the literals: every copy's gradient STATS and APPLY of
  the layers it works on, the longest of those on any copy, then every BCAST_PREC (each copy is in one row of
  every layer that is not COMM-OPT); the stage's single APPLY where every layer is COMM-OPT;
- each device's memory is `planner.memory.static_bytes` as a linear expression of the literals (statistics,
  two decompositions and the optimizer state where it keeps them, the largest shared-gradient buffer) under
  the cumulative of activations and kept a/e.

The step timeline is what the literals cannot move inside a window of fixed F/B work, so it is fixed per
option set:
- a stage whose slot, in the reference step (`planner.step_timeline.reference_programs`), precedes an F/B or a
  gradient all-reduce on one of its copies (Chimera's first stage of each device, the first chunk of
  interleaved; `timeline_stages`) moves that work with its distribution: such stages keep one option set per
  joint solve, the strategies of `planner.choose.candidate_strategies` in turn (an enumeration, stated as
  such), and CP-SAT chooses per layer on every other stage;
- every other stage's slot comes after all fixed work of its copies, so its options change only where the
  step ends: the reference step of an option set P is L(P) = the latest of the fixed work's end and each
  stage's all-reduce end plus its slot (`reference_step`), exactly the simulated step. CP-SAT first finds the
  least L over the option sets that meet the static memory (`planner.cpsat.least_step`), which is
  the plan's step time at max_overhead 0; then every stage group is placed at that step length Λ (plus the
  stretch max_overhead allows, [Note: stretch] in planner/plan/window.py) with its literals free, each slot within
  [its all-reduce end, step end). A window of k steps of length Λ is the same for every option set whose
  reference step fits Λ: the plan's reference step is its own option set's L (the validator's), and its
  max_overhead is measured against that L, as for a forced strategy; L is never below the least one, so the
  stretch a plan uses is within what its own reference allows.
The chosen distributions become `Problem.with_distributions(...)`; each group's placement is moved into that
problem's own windows (`transfer`, which checks they are the same windows) and assembled as `solve` assembles
its own: lowering, validator, simulator and runtime see a plan like any other.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from fractions import Fraction
from functools import lru_cache

from fxkfac.planner.plan.solution import GroupSolution, fits_memory, use_offsets
from fxkfac.planner.plan.window import TaskKind, Window
from fxkfac.planner.problem.costs import LayerCost
from fxkfac.planner.problem.ir import Op, OpKind
from fxkfac.planner.problem.problem import Problem, StageGroup, copies_of_stage, stages_on_device
from fxkfac.planner.problem.step_timeline import base_programs, gradient_stats, step_timeline
from fxkfac.planner.problem.strategy import LayerDistribution, Strategy, StrategyKind, grad_workers, holding, receivers
from fxkfac.planner.search.window_build import build_window

__all__ = [
    "Option",
    "Options",
    "options_of",
    "ns",
    "layer_options",
    "timeline_stages",
    "apply_seconds",
    "share_seconds",
    "bcast_seconds",
    "comm_slot_seconds",
    "held_bytes",
    "base_bytes",
    "reference_step",
    "step_fixed_end",
    "anchor_window",
    "restretch_joint",
    "reference_ticks",
    "window_at",
    "transfer",
]

_FIXED = frozenset({OpKind.FWD, OpKind.BWD, OpKind.BWD_W, OpKind.ALLREDUCE_GRAD})


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


def layer_options(problem: Problem, layer: str) -> tuple[LayerDistribution, ...]:
    """Every KAISA distribution of `layer` over its stage's copies: COMM-OPT, HYBRID per grad-worker count g
    (1 < g < H, g divides H) with each of its H / g columns, MEM-OPT with each of its H columns; COMM-OPT alone
    on a stage with one copy, and for a streamed layer (its helper's result replaces every copy's gradient)."""
    H = len(copies_of_stage(problem, problem.costs.stage_of(layer)))
    out = [LayerDistribution()]
    if problem.streaming is not None and layer in problem.streaming.layers:
        return tuple(out)
    for g in range(H - 1, 0, -1):
        if H % g or H == 1:
            continue
        strategy = Strategy(StrategyKind.MEM_OPT) if g == 1 else Strategy(StrategyKind.HYBRID, Fraction(g, H))
        out += [LayerDistribution(strategy, column) for column in range(H // g)]
    return tuple(out)


@lru_cache(maxsize=64)
def timeline_stages(problem: Problem) -> frozenset[int]:
    """Stages whose per-step slot precedes, in the reference step, an F/B or gradient all-reduce on one of their
    copies: their distribution moves the step's fixed work (see [Note: joint strategy])."""
    out = set()
    for ops in base_programs(problem).values():
        for i, op in enumerate(ops):
            if op.kind is OpKind.ALLREDUCE_GRAD and any(o.kind in _FIXED for o in ops[i + 1 :]):
                assert op.stage is not None, "the schedules' ALLREDUCE_GRAD names its stage"
                out.add(op.stage)
    return frozenset(out)


def _gradient_seconds(problem: Problem, layer: LayerCost) -> float:
    """Seconds of the layer's gradient STATS at every step on each of its grad workers."""
    stage = problem.costs.stage_of(layer.name)
    return sum(secs for op, secs in gradient_stats(problem.costs.stages[stage], stage) if op.layer == layer.name)


def apply_seconds(problem: Problem, layer: str) -> float:
    """Seconds of `layer`'s per-step work on each of its grad workers in a stage that is not all COMM-OPT:
    its gradient STATS and its own APPLY."""
    x = problem.costs.layer(layer)
    return _gradient_seconds(problem, x) + x.prec


def comm_slot_seconds(problem: Problem, stage: int) -> float:
    """Seconds of the stage's slot on every copy when every layer is COMM-OPT: all gradient STATS, one APPLY."""
    cost = problem.costs.stages[stage]
    return sum(secs for _, secs in gradient_stats(cost, stage)) + cost.prec


def share_seconds(problem: Problem, layer: str, where: LayerDistribution) -> float:
    """Seconds of `layer`'s BCAST_PREC on every copy of its stage under `where` (each copy is in one row; 0
    under COMM-OPT)."""
    stage = problem.costs.stage_of(layer)
    copies = copies_of_stage(problem, stage)
    rows = receivers(copies, where)
    if not rows:
        return 0.0
    root, row = rows[0]
    op = Op(OpKind.BCAST_PREC, stage, root=root, layer=layer, group=None if row == copies else row)
    return problem.costs.collective_seconds(op, len(row))


def bcast_seconds(problem: Problem, layer: str, part: str, where: LayerDistribution) -> float:
    """Seconds of the BCAST of `layer`'s `part` decomposition within its column under `where` (0: one worker)."""
    stage = problem.costs.stage_of(layer)
    copies = copies_of_stage(problem, stage)
    workers = grad_workers(copies, where)
    if len(workers) == 1:
        return 0.0
    op = Op(OpKind.BCAST, stage, layer=layer, part=part, root=workers[0], group=None if workers == copies else workers)
    return problem.costs.collective_seconds(op, len(workers))


def _gradient_fed(layer: LayerCost) -> bool:
    return all(p.after is OpKind.ALLREDUCE_GRAD for p in layer.parts)


def held_bytes(problem: Problem, device: int, layer: str, where: LayerDistribution) -> tuple[int, int]:
    """(bytes `device` keeps of `layer` across steps, its shared-gradient buffer) under `where`: the terms of
    `planner.memory.static_bytes`."""
    x = problem.costs.layer(layer)
    copies = copies_of_stage(problem, problem.costs.stage_of(layer))
    held = holding(device, copies, where, _gradient_fed(x))
    kept = x.factor_bytes * (held.statistics + 2 * held.decompositions) + x.state_bytes * held.decompositions
    return kept, x.gradient_bytes * held.shares_gradient


def base_bytes(problem: Problem, device: int) -> int:
    """What `planner.memory.static_bytes` counts on `device` whatever the distributions: parameters and gradients
    (twice) and the largest error peak of one backward."""
    stages = stages_on_device(problem, device)
    return sum(2 * problem.costs.stages[s].param_bytes for s in stages) + max(
        (problem.costs.stages[s].peak_err_bytes for s in stages), default=0
    )


def step_fixed_end(problem: Problem, free: frozenset[int]) -> float:
    """The end of the reference step's work other than the slots of the `free` stages (which come last on every
    copy): F/B, all-reduces and the other stages' slots, as the problem's own distributions make them."""
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
    """L(P) of [Note: joint strategy]: the reference step of `problem` with the `free` stages' layers distributed
    as `distributions` (the others as in `problem`), from the fixed end and the free slots' sums alone."""
    step = step_timeline(problem)
    end = step_fixed_end(problem, free)
    for s in sorted(free):
        names = [x.name for x in problem.costs.stages[s].layers]
        where = {n: distributions.get(n, LayerDistribution()) for n in names}
        released = step.allreduce_end[copies_of_stage(problem, s)[0], s]
        end = max(end, released + slot_seconds_of(problem, s, where))
    return end


def slot_seconds_of(problem: Problem, stage: int, where: Mapping[str, LayerDistribution]) -> float:
    """Seconds of `stage`'s slot on each copy with its layers distributed as `where` (see [Note: joint
    strategy]): its all-COMM-OPT APPLY, or the longest apply work on a copy and then every BCAST_PREC."""
    if all(w == LayerDistribution() for w in where.values()):
        return comm_slot_seconds(problem, stage)
    copies = copies_of_stage(problem, stage)
    lead = max(sum(apply_seconds(problem, n) for n, w in where.items() if c in grad_workers(copies, w)) for c in copies)
    return lead + sum(share_seconds(problem, n, w) for n, w in where.items())


def anchor_window(
    problem: Problem, group: StageGroup, k: int, stretch: int, scale: tuple[float, bool], *, stats_chunk: int
) -> Window:
    """The window of `group` at period k with `stretch` idle ticks per step on the grid `scale`, nothing fused."""
    return build_window(problem, group, k, stats_chunk=stats_chunk, stretch=stretch, scale=scale)


def restretch_joint(placement: GroupSolution, step: int) -> GroupSolution:
    """`placement` (of a window with nothing fused) in a window of the same problem whose steps last `step` >= its
    own ticks: every start in window step j moves j times the added ticks later (as `planner.stretch.restretch`:
    each op keeps its place inside its step, so it stays valid)."""
    w = placement.window
    before = placement.step_ticks
    delta = step - before
    if delta == 0:
        return placement
    if delta < 0:
        raise AssertionError(f"restretch_joint only lengthens: {before} -> {step} ticks per step")
    new = anchor_window(w.problem, w.group, w.k, w.stretch + delta, (w.scale, w.exact), stats_chunk=w.stats_chunk)
    tasks = {task.name: task for task in new.tasks}

    def move(t: int) -> int:
        return t + (t // before) * delta

    return replace(
        placement,
        window=replace(new, tasks=tuple(replace(tasks[t.name], devices=t.devices) for t in w.tasks)),
        starts=tuple(move(t) for t in placement.starts),
        prec_starts=tuple(move(t) for t in placement.prec_starts),
        bcasts={name: move(t) for name, t in placement.bcasts.items()},
    )


def reference_ticks(problem: Problem, scale: tuple[float, bool]) -> int:
    """`problem`'s reference step on the grid `scale`: its windows' steps without stretch (nothing fused)."""
    return round(step_timeline(problem).length * scale[0])


def window_at(
    problem: Problem, group: StageGroup, k: int, step: int, scale: tuple[float, bool], *, stats_chunk: int
) -> Window | None:
    """`problem`'s window of `group` at period k whose steps last `step` ticks (its reference and a stretch); None
    when its reference step is longer."""
    stretch = step - reference_ticks(problem, scale)
    return None if stretch < 0 else anchor_window(problem, group, k, stretch, scale, stats_chunk=stats_chunk)


def transfer(placement: GroupSolution, problem: Problem) -> GroupSolution | None:
    """`placement` (a joint solve's, or first-fit's of a candidate) as a solution of `problem`'s own window of the
    group (`problem` has the chosen distributions), its stretch what makes its steps as long as the placement's;
    None when that window is not the placement's (other fixed work, activations, releases or deadlines, a task or
    slot longer than the one placed), or when it holds a third decomposition over the memory budget
    (`planner.solution.remade_spans`): the caller then plans `problem` itself."""
    w = placement.window
    target = window_at(problem, w.group, w.k, placement.step_ticks, (w.scale, w.exact), stats_chunk=w.stats_chunk)
    slot_ticks = {p.stage: p.ticks for p in w.precs} | dict(placement.slot_ticks)
    if target is None or not _same_frame(w, target) or any(p.ticks > slot_ticks[p.stage] for p in target.precs):
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
    chosen = tuple(starts)
    solution = GroupSolution(
        target,
        chosen,
        tuple(devices),
        placement.prec_starts,
        use_offsets(target, chosen, placement.prec_starts),
        "cpsat",
        placement.status,
        placement.k_lower_bound,
    )
    return solution if fits_memory(solution) else None  # a third decomposition over the budget: planned apart


def _same_frame(a: Window, b: Window) -> bool:
    """Whether windows `a` and `b` have the same steps, fixed work, activations and slots' places (release,
    deadline), so that a placement in one is a placement in the other."""
    slots = [(p.device, p.stage, p.step, p.release, p.deadline) for p in a.precs]
    return (a.offsets, a.leads, a.fixed, a.acts) == (b.offsets, b.leads, b.fixed, b.acts) and slots == [
        (p.device, p.stage, p.step, p.release, p.deadline) for p in b.precs
    ]
