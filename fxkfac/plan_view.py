"""A plan as a timeline and a terminal view: planned per-device timeline, utilization, summary; torch-free.

[Note: planned timeline] The timeline is taken from the plan's placements, not from re-simulating
its programs: F/B come from the problem's simulated step (the refresh step with its fused curvature,
then plain steps), and every K-FAC op sits exactly where the planner put it (seconds after the
refresh window began), so the drawing shows the plan itself, to the planner's time grid
(`metrics.time_quantum`). A simulation of the programs would start each K-FAC op as soon as the op
before it ends, which is never later but not where the plan says. Windows repeat: an op placed in
the next window's early bubbles (step >= k) is drawn there and, one period earlier, in this window.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from rich.console import Group, RenderableType

from fxkfac.planner.plan import Plan, ns_stage_lines, ns_summary
from fxkfac.planner.problem import Capture, OpKind, PreconditionerKind, Problem
from fxkfac.planner.problem.costs import words_of
from fxkfac.planner.problem.problem import format_bytes, is_streamed
from fxkfac.planner.problem.step_timeline import (
    BUSY_KINDS,
    Interval,
    Timeline,
    plain_step_time,
    plain_utilization,
    static_bytes,
    step_begins,
    step_timeline,
    window_length,
)
from fxkfac.planner.search.choose import strategy_of
from fxkfac.show import render_summary, render_timeline

__all__ = ["PlannedView", "planned_view", "planned_utilization", "plan_rows", "summary_errors", "render_plan"]

_DRAWN_FIXED = frozenset({OpKind.FWD, OpKind.BWD, OpKind.BWD_W, OpKind.ALLREDUCE_GRAD})
_MIN_CELLS_PER_STEP = 20


@dataclass(frozen=True)
class PlannedView:
    """`steps` pipeline steps of a plan from a refresh step on, as a Timeline over [0, end) seconds."""

    timeline: Timeline
    steps: int
    end: float


def _periods(plan: Plan) -> dict[int, int]:
    """Refresh period k of each device (the period of the stages it holds)."""
    problem = plan.problem
    out: dict[int, int] = {}
    for s, stage in enumerate(problem.costs.stages):
        k = plan.layers[stage.layers[0].name].period if stage.layers else plan.metrics.refresh_steps[s]
        for d in problem.holders[s]:
            out[d] = max(out.get(d, 1), k)
    return out


@dataclass(frozen=True)
class _Steps:
    """Step timelines of a plan and the absolute start of each step of a window of k; every step ends
    with `stretch` idle seconds ([Note: stretch] in planner/plan/window.py)."""

    refresh: Timeline
    normal: Timeline
    stretch: float

    @property
    def other(self) -> float:
        return self.normal.length + self.stretch

    def length(self, k: int) -> float:
        return window_length(self.refresh.length, self.normal.length, self.stretch, k)

    def base(self, j: int, k: int) -> float:
        return step_begins(self.refresh.length, self.normal.length, self.stretch, j, k)

    def of(self, j: int, k: int) -> Timeline:
        return self.refresh if j % k == 0 else self.normal


def _steps(plan: Plan) -> _Steps:
    fused = frozenset(n for n, t in plan.layers.items() if t.capture is Capture.FUSED)
    stretch = float(getattr(plan.metrics, "stretch", 0.0))
    return _Steps(step_timeline(plan.problem, fused, refresh=True), step_timeline(plan.problem), stretch)


def _fixed(plan: Plan, steps: _Steps, device: int, k: int, count: int) -> list[Interval]:
    """The device's F/B, gradient all-reduces and (on a helper) streamed layers' APPLY over `count` steps; its
    weight gradients (W) too, unless the plan placed them as tasks (zero-bubble schedules), drawn with the other
    placements (`_kfac`)."""
    placed_w = any(p.device == device and p.op.kind is OpKind.BWD_W for p in plan.placements)
    drawn = _DRAWN_FIXED - {OpKind.BWD_W} if placed_w else _DRAWN_FIXED
    out = []
    for j in range(count):
        base = steps.base(j, k)
        for op, a, b in steps.of(j, k).ops[device]:
            streamed = op.kind is OpKind.APPLY and is_streamed(plan.problem, device, op)
            if op.kind in drawn or streamed:
                out.append(Interval(device, j, op, base + a, base + b))
    return out


def _kfac(plan: Plan, device: int, k: int, period: float, end: float) -> list[Interval]:
    """The device's placements repeated every `period` seconds, wherever they overlap [0, end). An op
    of the window before that ends within the time grid (`metrics.time_quantum`) after 0 ended before
    it: durations round up to the grid ([Note: time grid]), and no op spans a step boundary."""
    out = []
    grid = plan.metrics.time_quantum
    for p in plan.placements:
        if p.device != device:
            continue
        for n in range(-1, math.ceil(end / period) + 1):
            start, stop = p.start + n * period, p.end + n * period
            if stop > 0 and start < end and (start >= 0 or stop > grid) or (start == stop and 0 <= start < end):
                out.append(Interval(device, p.step + n * k, p.op, start, stop))
    return out


def planned_view(plan: Plan, steps: int | None = None) -> PlannedView:
    """The plan's timeline over `steps` steps from a refresh step (default: the longest period)."""
    periods = _periods(plan)
    count = max(periods.values()) if steps is None else steps
    if count < 1:
        raise ValueError(f"steps must be >= 1, got {count}")
    st = _steps(plan)
    k_view = max(periods.values())
    end = st.base(count, k_view) if count <= k_view else st.length(k_view) + (count - k_view) * st.other
    intervals: list[Interval] = []
    for d, k in sorted(periods.items()):
        intervals += _fixed(plan, st, d, k, count)
        intervals += _kfac(plan, d, k, st.length(k), end)
    ordered = tuple(sorted(intervals, key=lambda iv: (iv.start, iv.rank, str(iv.op))))
    return PlannedView(Timeline(ordered, tuple(sorted(periods)), count), count, end)


def planned_utilization(plan: Plan) -> dict[int, float]:
    """Per device: its utilization over its own refresh period, as drawn from the placements."""
    out = {}
    for d, k in sorted(_periods(plan).items()):
        view = planned_view(plan, k)
        out[d] = view.timeline.utilization(d, BUSY_KINDS, (0.0, view.end))
    return out


def _streamed(problem: Problem) -> str:
    """Which rank applies which stage's layers, fed during that stage's last backward (planner/problem/lowering.py)."""
    streaming = problem.streaming
    if streaming is None:
        return "none (every stage applies its own layers)"
    when = "at its backward's end (compiled)" if streaming.whole_backward else "during its last backward"
    where = ", ".join(f"{len(streaming.layers_of(h))} on r{h}" for h in streaming.ranks)
    return f"{len(streaming.layers)} layer(s) of stage {streaming.stage} applied ({where}), sent {when}"


def _recomputed(problem: Problem) -> str:
    """Which stages recompute their forward in their backward (`Problem.recompute`), and what that costs."""
    if not problem.recompute:
        return "off (every stage keeps its activations)"
    stages = problem.costs.stages
    added = " ".join(f"+{stages[s].fwd * 1e3:.2f} ms" for s in problem.recompute)
    listed = ", ".join(map(str, problem.recompute))
    return f"stages {listed} recompute their forward in each backward ({added} per micro-batch)"


def _per_stage(values: tuple[int | None, ...]) -> str:
    return " ".join("-" if v is None else str(v) for v in values)


_VERDICTS = {
    "OPTIMAL": "proven optimal",
    "FEASIBLE": "not proven optimal",
    "GREEDY": "first-fit's placement: CP-SAT, where it ran, found none better in the time limit",
}
"""What each solver status says about optimality, in words."""


def _ns_rows(plan: Plan) -> list[tuple[str, str]]:
    """A Muon plan's Newton-Schulz tasks per stage and the step time they add (planner/plan/plan.py)."""
    lines, n = ns_stage_lines(plan), plan.problem.apply_pieces
    cut = "one task per matrix" if n == 1 else f"each matrix's NS in {n} pieces by iterations (--decomp-pieces)"
    return [
        ("Newton-Schulz added", ns_summary(plan)),
        ("Newton-Schulz tasks", cut),
        ("Newton-Schulz per stage", lines[0]),
    ] + [("", line) for line in lines[1:]]


def plan_rows(plan: Plan) -> list[tuple[str, str]]:
    """The summary of a plan: schedule, solver, step time, utilization, refresh periods, memory; a Muon plan, which
    has no refresh, where each stage's Newton-Schulz ran instead of the refresh periods and decompositions."""
    p, m = plan.problem, plan.metrics
    costs = p.costs
    budget = "unlimited" if p.memory_budget is None else format_bytes(p.memory_budget)
    added = (m.step_time / m.step_time_baseline - 1) if m.step_time_baseline > 0 else 0.0
    name = words_of(costs).name
    rows = [
        ("model costs", f"{costs.source} ({costs.hardware}, micro-batch {costs.micro_batch_size})"),
        ("schedule", f"{p.schedule}  D={p.D} N={p.N} W={p.W}" + (f" v={p.v}" if p.v != 1 else "")),
        ("memory budget / max overhead", f"{budget} per device / {p.max_overhead * 100:.3g}%"),
        (
            "decompositions",
            "one task each"
            if p.decomp_pieces == 1
            else f"in {p.decomp_pieces} pieces each (KFACConfig.split_inverse or ShampooConfig.newton_pieces)",
        ),
        ("strategy across copies", strategy_of(plan)),
        ("streamed APPLY", _streamed(p)),
        ("activation checkpointing", _recomputed(p)),
        (
            "solver",
            f"{m.solver.status} ({_VERDICTS.get(m.solver.status, 'unknown status')}), "
            f"{m.solver.wall_time:.1f} s, gap to bound {m.solver.gap:.1%}",
        ),
        (
            "step time before -> after",
            f"{m.step_time_baseline * 1e3:.2f} ms -> {m.step_time * 1e3:.2f} ms "
            f"(+{added:.1%} over the plain pipeline; {name} reference {m.step_time_reference * 1e3:.2f} ms: the "
            "pipeline with the per-step work alone, what max overhead is measured against)",
        ),
        ("utilization before -> after", f"{m.utilization_baseline:.1%} -> {m.utilization:.1%}"),
        ("refresh steps per stage", _per_stage(m.refresh_steps)),
        ("  lower bound", _per_stage(m.lower_bound_steps)),
        ("  greedy (paper)", _per_stage(m.greedy_refresh_steps)),
        ("peak memory per device", "  ".join(f"r{d} {format_bytes(b)}" for d, b in m.peak_memory.items())),
    ]
    if costs.family is not PreconditionerKind.MUON:
        return rows
    refresh = {"decompositions", "refresh steps per stage", "  lower bound", "  greedy (paper)"}
    kept = [row for row in rows if row[0] not in refresh]
    at = next(i for i, row in enumerate(kept) if row[0] == "utilization before -> after") + 1
    return kept[:at] + _ns_rows(plan) + kept[at:]


def summary_errors(plan: Plan) -> list[str]:
    """Every number of `plan_rows` that the plan's problem and placements contradict (the validator checks
    the placements themselves, not these metrics): what `fxkfac show` refuses to draw."""
    p, m = plan.problem, plan.metrics
    errors = []
    periods = tuple(  # a stage without preconditioned layers has the period its metrics say
        max((plan.layers[x.name].period for x in stage.layers), default=k)
        for stage, k in zip(p.costs.stages, m.refresh_steps, strict=False)
    )
    if tuple(m.refresh_steps) != periods:
        errors.append(f"refresh steps per stage {list(m.refresh_steps)}, but its layers refresh every {list(periods)}")
    if any(not 1 <= b <= k for b, k in zip(m.lower_bound_steps, periods)) or len(m.lower_bound_steps) != len(periods):
        errors.append(f"lower bounds {list(m.lower_bound_steps)} are not between 1 and the refresh steps")
    for name, claimed, found in (
        ("step time before", m.step_time_baseline, plain_step_time(p)),
        ("K-FAC reference step time", m.step_time_reference, step_timeline(p).length),
        ("utilization", m.utilization, _mean(planned_utilization(plan).values())),
        ("utilization before", m.utilization_baseline, plain_utilization(p)),
    ):
        if abs(claimed - found) > 1e-6 * max(1.0, abs(found)) + m.time_quantum:
            errors.append(f"{name} {claimed:.6g}, but its problem and placements give {found:.6g}")
    if set(m.peak_memory) != set(p.devices) or any(m.peak_memory[d] < static_bytes(p, d) for d in p.devices):
        errors.append("peak memory per device is missing devices or below their parameters, gradients and factors")
    return errors


def _mean(values: Iterable[float]) -> float:
    items = list(values)
    return sum(items) / len(items)


def render_plan(plan: Plan, *, width: int = 80, title: str = "") -> RenderableType:
    """Summary table and the planned timeline, one row per device, fitted to `width` columns."""
    periods = _periods(plan)
    k = max(periods.values())
    fit = max(1, (width - 8) // _MIN_CELLS_PER_STEP)
    shown = min(k, fit)
    view = planned_view(plan, shown)
    what = f"all {k} steps of the refresh window" if shown == k else f"steps 1-{shown} of the {k}-step refresh window"
    ks = sorted(set(periods.values()))
    label = f"planned: {what} (step 1 refreshes; k = {', '.join(map(str, ks))})"
    if plan.problem.costs.family is PreconditionerKind.MUON:
        label = "planned: one step (Muon has no refresh: every step is this one)"
    timeline = render_timeline(
        view.timeline, width=width, title=label, window=(0.0, view.end), words=words_of(plan.problem.costs)
    )
    summary = render_summary(title or "fxkfac plan", plan_rows(plan))
    return Group(summary, timeline)
