"""A Plan built from one solution per stage group: one assembly, shared by `solve` and planner/choose.py."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from fxkfac.planner.ir import Capture, LayerTiming, Op, OpKind, Placement, Program
from fxkfac.planner.lowering import startup_programs
from fxkfac.planner.plan import Plan, PlanMetrics, SolverStats
from fxkfac.planner.problem import Problem, is_streamed, stage_groups
from fxkfac.planner.schedules import weight_gradient_kind
from fxkfac.planner.simulate import BUSY_KINDS, utilization
from fxkfac.planner.solution import GroupSolution, all_placed, peak_bytes, placements_of, plan_born
from fxkfac.planner.step_timeline import (
    fused_stats,
    plain_step_time,
    plain_utilization,
    refresh_lower_bound,
    step_timeline,
)
from fxkfac.planner.streaming import add_replicas, made_refreshes
from fxkfac.planner.stretch import Allowance, restretch
from fxkfac.planner.w_tasks import allreduce_after_w, placed_w
from fxkfac.planner.window import Window

__all__ = ["Attempt", "assemble", "assemble_attempt", "same_stretch"]


@dataclass
class Attempt:
    """Solutions per group for one set of fused layers (None where no k worked)."""

    solutions: list[GroupSolution | None]
    greedy: list[GroupSolution | None]
    allowance: Allowance


def same_stretch(solutions: list[GroupSolution | None]) -> list[GroupSolution | None]:
    """Every group at the largest stretch any needs: the step is one for all ranks ([Note: stretch] in
    planner/window.py). A group moved to a longer stretch keeps its staleness, which the longer one might
    better: no longer proven optimal (unless it is 0)."""
    placed = all_placed(solutions)
    if placed is None:
        return solutions
    stretch = max(s.window.stretch for s in placed)
    out: list[GroupSolution | None] = []
    for s in placed:
        moved = restretch(s, stretch)
        if moved is not s and moved.status == "OPTIMAL" and any(moved.use_offset.values()):
            moved = replace(moved, status="FEASIBLE")
        out.append(moved)
    return out


def assemble(
    problem: Problem,
    solutions: Sequence[GroupSolution],
    greedy: list[GroupSolution | None],
    allowed: Allowance,
    wall: float,
) -> Plan:
    """The plan of one solution per stage group, nothing fused, assembled as `solve` assembles its own (`greedy`:
    the paper's rule per group, for the metrics): the entry of a distribution choice made beside `solve`
    (planner/choose.py), whose solutions are of `problem`'s own windows."""
    placed: list[GroupSolution | None] = list(solutions)
    return assemble_attempt(problem, Attempt(same_stretch(placed), greedy, allowed), frozenset(), wall)


_PLACED_KINDS = frozenset({OpKind.STATS, OpKind.APPLY, OpKind.BCAST_PREC, OpKind.OPT_STEP})
"""Ops of the reference step that a plan places itself (the per-step slot: gradient STATS, APPLY, BCAST_PREC) or
appends (OPT_STEP)."""


def _program(problem: Problem, w: Window, device: int, placed: list[Placement]) -> Program:
    """The device's ops per step of the period, in time order: an op placed in a bubble goes after
    every fixed op that ends by its start (so a RECV still waiting stays after it), and at the refresh step each
    BWD (a zero-bubble schedule's W) is followed by the STATS folding its fused layers' statistics (`fused_stats`).
    Compared in ticks: in seconds, float rounding could put a APPLY before the backward it follows."""
    steps: list[list[tuple[tuple[int, ...], Op]]] = [[] for _ in range(w.k)]
    timelines = [step_timeline(problem, w.fused, refresh=True)] + [step_timeline(problem)] * (w.k - 1)
    tasks = placed_w(problem)  # the W's are placed ops ([Note: placed W] in planner/w_tasks.py)
    for j, st in enumerate(timelines):
        for seq, (op, _, end) in enumerate(st.ops[device]):
            if tasks and op.kind is OpKind.BWD_W:
                continue
            if op.kind not in _PLACED_KINDS or is_streamed(problem, device, op):
                at = w.offsets[j] + round(end * w.scale)
                steps[j].append(((at, 0, seq), op))
                if j == 0 and op.kind is weight_gradient_kind(problem.kind) and w.fused:
                    folds = fused_stats(problem, w.fused, device, op)
                    steps[j].extend(((at, 0, seq, i), fold) for i, fold in enumerate(folds))
    for n, p in enumerate(sorted(placed, key=lambda p: (p.start, p.end))):
        at = round(p.start * w.scale) - w.length * (p.step // w.k)
        steps[p.step % w.k].append(((at, 1, n), p.op))
        if p.step == 0 and p.op.kind is OpKind.BWD_W and w.fused:
            steps[0].extend(((at, 1, n, i), fold) for i, fold in enumerate(fused_stats(problem, w.fused, device, p.op)))
    steps = [allreduce_after_w(problem, items) for items in steps] if tasks else steps
    return [[op for _, op in sorted(items, key=lambda item: item[0])] + [Op(OpKind.OPT_STEP)] for items in steps]


def _utilization(problem: Problem, w: Window, placed: list[Placement], device: int) -> float:
    """The device's planned utilization: its F/B, placed work and (a helper's) streamed APPLYs over the window."""
    timelines = [step_timeline(problem, w.fused, refresh=True)] + [step_timeline(problem)] * (w.k - 1)
    busy = sum(b - a for st in timelines for _, a, b in st.fixed(device))
    busy += sum(
        b - a
        for st in timelines
        for op, a, b in st.ops[device]
        if is_streamed(problem, device, op) and op.kind is OpKind.APPLY
    )
    busy += sum(  # a placed W is in the F/B above
        p.end - p.start
        for p in placed
        if p.device == device and p.op.kind in BUSY_KINDS and p.op.kind is not OpKind.BWD_W
    )
    return utilization(busy, w.seconds(w.length))


def _solver_stats(
    sols: list[GroupSolution], wall: float, refresh: list[int], bound: list[int], layers: Mapping[str, LayerTiming]
) -> SolverStats:
    """How the groups were solved: GREEDY when first-fit placed them all, OPTIMAL when CP-SAT proved every group,
    else FEASIBLE; the objective (refresh steps, staleness) and its gap to the lower bounds."""
    statuses = {s.status for s in sols}
    status = (
        "GREEDY" if all(s.method == "greedy" for s in sols) else "OPTIMAL" if statuses == {"OPTIMAL"} else "FEASIBLE"
    )
    objective = (sum(refresh), sum(t.use_offset for t in layers.values()))
    return SolverStats(status, wall, objective, (sum(refresh) - sum(bound)) / max(1, sum(refresh)))


def assemble_attempt(problem: Problem, attempt: Attempt, fused: frozenset[str], wall: float) -> Plan:
    """The plan of an attempt that placed every group, `fused` layers' curvature fused: programs, layer timings,
    placements and metrics (`wall`: seconds the planning took)."""
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
            peak[d] = peak_bytes(sol, d)
            per_device[d] = _utilization(problem, w, placed, d)
        for s in group.stages:
            lower = refresh_lower_bound(problem, group, fused, stretch=attempt.allowance.enabled)
            refresh[s], bound[s] = w.k, min(w.k, max(sol.k_lower_bound, lower))  # a bound past a plan bounds another
            greedy_k[s] = g.window.k if g is not None else None
            for x in problem.costs.stages[s].layers:
                layers[x.name] = LayerTiming(
                    w.k, 0, sol.use_offset.get(x.name, 0), Capture.FUSED if x.name in fused else Capture.DEFERRED
                )
    sols = [s for s in attempt.solutions if s is not None]
    stats = _solver_stats(sols, wall, refresh, bound, layers)
    metrics = PlanMetrics(
        utilization_baseline=plain_utilization(problem),
        utilization=sum(per_device.values()) / len(per_device),
        refresh_steps=tuple(refresh),
        step_time_baseline=plain_step_time(problem),
        step_time=max(s.window.seconds(s.window.length) / s.window.k for s in sols),
        step_time_reference=step_timeline(problem).length,
        peak_memory=dict(sorted(peak.items())),
        lower_bound_steps=tuple(bound),
        solver=stats,
        greedy_refresh_steps=tuple(greedy_k),
        time_quantum=0.0 if all(s.window.exact for s in sols) else max(s.window.tick for s in sols),
        stretch=max(s.window.seconds(s.window.stretch) for s in sols),
    )
    if problem.streaming is not None:
        sender = problem.stream_owners[0]
        made = made_refreshes(problem.streaming, placements, layers, sender)
        programs = add_replicas(programs, problem.streaming, sender, made)
    programs = dict(sorted(programs.items()))
    return Plan(
        problem,
        programs,
        layers,
        tuple(placements),
        metrics,
        problem.fingerprint,
        startup=startup_programs(programs, plan_born(problem, placements, layers)),
    )
