"""One simulated step of the pipeline per problem (the reference step, its programs, collectives and bubbles)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import TypeVar

from fxkfac.planner.apply_pieces import cut_apply, piece_share
from fxkfac.planner.costs import StageCost
from fxkfac.planner.ir import LAYER_SENDS, Op, OpKind
from fxkfac.planner.lowering import add_send_recv, capture_stats, expand_dp, step_applies
from fxkfac.planner.problem import (
    Problem,
    StageGroup,
    StepBarrier,
    agreement_set,
    copies_of_stage,
    stages_on_device,
    streamed_seconds,
    streamed_stats,
)
from fxkfac.planner.schedules import ZERO_BUBBLE_KINDS, schedule_programs, weight_gradient_kind
from fxkfac.planner.simulate import Timeline, simulate, utilization
from fxkfac.planner.strategy import keeps_statistics
from fxkfac.planner.streaming import ready, stream_step

__all__ = [
    "StepTimeline",
    "base_programs",
    "gradient_stats",
    "prec_work",
    "apply_seconds",
    "reference_programs",
    "gradient_allreduce_seconds",
    "StageComm",
    "stage_comm",
    "step_timeline",
    "plain_step_time",
    "plain_utilization",
    "steps_overlap",
    "window_length",
    "step_begins",
    "early_start",
    "slot_seconds",
    "stretch_allowance",
    "tap_extra",
    "fused_extra",
    "fused_stats",
    "refresh_lower_bound",
    "group_load",
    "stream_lead",
    "stream_start",
]

_FIXED_KINDS = frozenset({OpKind.FWD, OpKind.BWD, OpKind.BWD_W})
_NOT_BUBBLE = frozenset({OpKind.APPLY, OpKind.STATS, OpKind.BCAST_PREC, OpKind.ALLREDUCE_GRAD})
"""Ops besides F/B during which a window places no preconditioner work (the per-step slot's work, and the
gradient all-reduce: planner/window_build.py `build_window`)."""


@dataclass(frozen=True)
class StepTimeline:
    """One step of the pipeline, per device: fixed F/B intervals and the points the K-FAC work uses.

    ops: (op, start, end) of every op of the step in program order (RECV intervals include waits; with
    preconditioning, each stage's gradient STATS and APPLY right after its all-reduce);
    allreduce_end[(device, stage)]: end of ALLREDUCE_GRAD(stage); length: the step time.
    """

    ops: Mapping[int, tuple[tuple[Op, float, float], ...]]
    allreduce_end: Mapping[tuple[int, int], float]
    length: float

    def fixed(self, device: int) -> list[tuple[Op, float, float]]:
        """The device's F/B ops with their times."""
        return [item for item in self.ops[device] if item[0].kind in _FIXED_KINDS]

    def end_of(self, device: int, op: Op) -> float:
        """End time of `op` on `device` (AssertionError when absent)."""
        for item, _, end in self.ops[device]:
            if item == op:
                return end
        raise AssertionError(f"{op} is not on device {device}")


@lru_cache(maxsize=64)
def base_programs(problem: Problem) -> dict[int, list[Op]]:
    """Per global rank, one step of the plain pipeline with its transfers and collectives."""
    kind, D, v = problem.kind, problem.D, problem.v
    return expand_dp(add_send_recv(schedule_programs(kind, D, problem.N, v=v), kind, D, v), problem.W)


def gradient_stats(stage: StageCost, index: int) -> list[tuple[Op, float]]:
    """The STATS ops (with their seconds) of stage `index`'s parts fed by the reduced gradient, in the order every
    step runs them: layer by layer, each layer's parts in their order, right before the stage's APPLY."""
    return [
        (Op(OpKind.STATS, index, layer=x.name, part=p.part), p.stats)
        for x in stage.layers
        for p in x.parts
        if p.after is OpKind.ALLREDUCE_GRAD
    ]


def prec_work(problem: Problem, device: int, stage: int) -> list[tuple[Op, float]]:
    """The per-step preconditioner work of `stage` on `device` in the order it runs, with seconds: the gradient
    statistics of the layers it keeps, then APPLY(stage) where every layer is COMM-OPT; otherwise APPLY of each
    layer it is a grad worker of, then the BCAST_PREC of each layer along its row (planner/strategy.py)."""
    copies = copies_of_stage(problem, stage)
    cost = problem.costs.stages[stage]
    work = [
        (op, secs)
        for op, secs in gradient_stats(cost, stage)
        if op.layer is not None and device in problem.workers(op.layer) and not streamed_stats(problem, op.layer)
    ]
    names, streaming = [x.name for x in cost.layers], problem.streaming
    shares: list[Op] = []
    pieces = problem.apply_pieces
    if streaming is not None and streaming.stage == stage:  # the helper applies the streamed layers
        kept = [Op(OpKind.APPLY, stage, layer=n) for n in names if n not in streaming.layers]
        applies = [piece for op in kept for piece in cut_apply(op, pieces)]
    else:
        applies, shares = step_applies(device, stage, names, copies, dict(problem.distributions), pieces=pieces)
    work += [(op, cost.prec if op.layer is None else apply_seconds(problem, op)) for op in applies]
    return work + [(op, problem.costs.collective_seconds(op, len(op.group or copies))) for op in shares]


def apply_seconds(problem: Problem, op: Op) -> float:
    """Seconds of one layer's APPLY, or of its piece (`planner.apply_pieces.piece_share`)."""
    return problem.costs.layer(op.layer_name).prec * piece_share(op.piece)


@lru_cache(maxsize=64)
def reference_programs(problem: Problem) -> dict[int, list[Op]]:
    """The base programs with the stage's per-step preconditioner work (`prec_work`) right after each
    ALLREDUCE_GRAD(s): the paper's K-FAC step (per-step work on the critical path, refresh work nowhere)."""
    out = {}
    for rank, ops in base_programs(problem).items():
        body: list[Op] = []
        for op in ops:
            body.append(op)
            if op.kind is OpKind.ALLREDUCE_GRAD:
                s = op.stage
                assert s is not None, "the schedules' ALLREDUCE_GRAD names its stage"
                body += [work for work, _ in prec_work(problem, rank, s)]
        out[rank] = body
    if problem.streaming is not None:
        out = stream_step(out, problem.streaming, problem.stream_owners, problem.apply_pieces)
    return out


def gradient_allreduce_seconds(problem: Problem, stage: int) -> float:
    """Seconds of ALLREDUCE_GRAD(stage): the stage's gradients all-reduced over its copies (`CostTable.comm`)."""
    return problem.costs.collective_seconds(Op(OpKind.ALLREDUCE_GRAD, stage), len(copies_of_stage(problem, stage)))


@dataclass(frozen=True)
class StageComm:
    """What one stage's collectives cost over its `group` copies (seconds, the cost table's comm model): the
    gradient all-reduce and the broadcasts of preconditioned gradients (`share`, strategies other than
    COMM-OPT) at every step, and the SYNC_STATS and BCAST of all its parts at every refresh, each over the ranks
    its layer's strategy names."""

    group: int
    allreduce: float
    sync: float
    bcast: float
    share: float = 0.0

    def per_step(self, period: int) -> float:
        """Seconds of collectives per step when the stage refreshes every `period` steps."""
        return self.allreduce + self.share + (self.sync + self.bcast) / period


def stage_comm(problem: Problem, stage: int) -> StageComm:
    """The collectives of `stage` priced as the step timeline and the window price them."""
    copies = copies_of_stage(problem, stage)
    if len(copies) == 1:
        return StageComm(1, 0.0, 0.0, 0.0)
    price = problem.costs.collective_seconds
    sync = bcast = 0.0
    for x in problem.costs.stages[stage].layers:
        workers, local = problem.workers(x.name), problem.where(x.name).strategy.local_factors
        for p in x.parts:
            if p.after is not OpKind.ALLREDUCE_GRAD and not local:
                sync += price(Op(OpKind.SYNC_STATS, stage, layer=x.name, part=p.part), len(copies))
            if len(workers) > 1:
                bcast += price(Op(OpKind.BCAST, stage, layer=x.name, part=p.part, root=workers[0]), len(workers))
    share = max(sum(secs for op, secs in prec_work(problem, d, stage) if op.kind is OpKind.BCAST_PREC) for d in copies)
    return StageComm(len(copies), gradient_allreduce_seconds(problem, stage), sync, bcast, share)


def _duration(problem: Problem, fused: frozenset[str], refresh: bool) -> Callable[[int, Op], float]:
    """Op durations in seconds: F/B from the costs (at a refresh step, plus the taps and fused curvature; a BWD of a
    stage that recomputes, plus its FWD, which it runs again as it ran), the gradient all-reduce (the comm model),
    gradient statistics, APPLY, a streamed layer's hand-off on its owner (`LayerCost.hand_off` in its SEND_LGRAD, which
    the backward's gradient hooks run, `LayerCost.take_back` in its RECV_PGRAD); nothing else (the transfers and
    OPT_STEP take no time). A zero-bubble schedule's BWD
    is the backward less its W (`StageCost.weight_grad`), and the fused output-gradient curvature runs with the W,
    which holds the operands it is made of."""
    stages = problem.costs.stages
    allreduce = [gradient_allreduce_seconds(problem, s) for s in range(len(stages))]
    stats = {(op.layer, op.part): secs for s, stage in enumerate(stages) for op, secs in gradient_stats(stage, s)}

    fwd = [s.fwd + (s.tap_fwd if refresh else 0.0) + s.fused_curvature(fused, OpKind.FWD) for s in stages]
    split = problem.kind in ZERO_BUBBLE_KINDS
    wgrad = [s.weight_grad + s.fused_curvature(fused, OpKind.BWD) if split else 0.0 for s in stages]
    bwd = [
        s.bwd + (s.tap_bwd if refresh else 0.0) + (-s.weight_grad if split else s.fused_curvature(fused, OpKind.BWD))
        for s in stages
    ]
    bwd = [b + (fwd[s] if problem.recomputes(s) else 0.0) for s, b in enumerate(bwd)]  # the same forward again
    per_step = {
        (d, op): secs
        for d in problem.devices
        for s in stages_on_device(problem, d)
        for op, secs in prec_work(problem, d, s)
    }

    def duration(rank: int, op: Op) -> float:
        if op.kind is OpKind.FWD:
            return fwd[op.stage_id]
        if op.kind is OpKind.BWD:
            return bwd[op.stage_id]
        if op.kind is OpKind.BWD_W:
            return wgrad[op.stage_id]
        if op.kind in (OpKind.APPLY, OpKind.BCAST_PREC):
            streamed = (rank, op) not in per_step and op.kind is OpKind.APPLY and op.layer is not None
            return streamed_seconds(problem, op) if streamed else per_step[rank, op]
        if op.kind is OpKind.STATS:
            return stats[op.layer, op.part]
        if op.kind is OpKind.ALLREDUCE_GRAD and op.stage is not None:
            return allreduce[op.stage]
        if op.kind in (OpKind.SEND_LGRAD, OpKind.RECV_PGRAD) and op.layer is not None:  # the owner's hand-off
            layer = problem.costs.layer(op.layer)
            return layer.hand_off if op.kind is OpKind.SEND_LGRAD else layer.take_back
        return 0.0

    return duration


def stream_lead(problem: Problem, duration: Callable[[int, Op], float]) -> Callable[[int, Op], float] | None:
    """How long before its send op a streamed layer's message arrives (`simulate`'s lead): a gradient leaves when
    the backward (a zero-bubble schedule's W) makes it final (`planner.streaming.ready`), the part of the stage's
    backward (its `duration`) after that before the SEND_LGRAD; every streamed message then takes its transfer
    (`CostTable.collective_seconds` of two ranks, 0 without a comm model), which the lead subtracts. None without
    streaming."""
    streaming = problem.streaming
    if streaming is None:
        return None
    fractions = ready(streaming, problem.costs.stages[streaming.stage])
    made_by = weight_gradient_kind(problem.kind)  # the op whose end makes the gradients: a zero-bubble one's W
    bwd, fwd = Op(made_by, streaming.stage, 0), Op(OpKind.FWD, streaming.stage, 0)
    again = made_by is OpKind.BWD and problem.recomputes(streaming.stage)  # the recomputed forward runs first

    def lead(rank: int, op: Op) -> float:
        if op.kind not in LAYER_SENDS or op.layer is None:
            return 0.0
        transfer = problem.costs.collective_seconds(op, 2)
        backward = duration(rank, bwd) - (duration(rank, fwd) if again else 0.0)
        early = (1.0 - fractions[op.layer]) * backward if op.kind is OpKind.SEND_LGRAD else 0.0
        return early - transfer

    return lead


@lru_cache(maxsize=256)
def step_timeline(
    problem: Problem, fused: frozenset[str] = frozenset(), with_prec: bool = True, *, refresh: bool = False
) -> StepTimeline:
    """One simulated step (plain or with APPLY; `refresh`: a refresh step, whose F/B also tap the captured layers
    (`StageCost.tap_fwd`) and hold the fused layers' curvature): the step a steady run repeats.

    Every step ends with OPT_STEP, a barrier over all ranks (the runtime's KL-clip and non-finite
    all-reduce; the simulator runs it as one), so the next step begins with every rank idle and no
    message in flight: a run repeats this step every `length` seconds, whatever the costs
    (tests/planner/test_step_timeline.py checks it against multi-step simulations). Under
    `StepBarrier.AGREEMENT_SET` this is still the step's timeline, a world barrier's: the planner uses it only
    where a steady run without the world barrier repeats it (`steps_overlap`); an agreement set may then begin
    its next step early (`early_start`), which changes no F/B time.
    """
    programs = reference_programs(problem) if with_prec else base_programs(problem)
    duration = _duration(problem, fused, refresh)
    one = simulate(programs, duration, steps=1, lead=stream_lead(problem, duration))
    return _step_from(one, one.makespan)


def _step_from(timeline: Timeline, length: float) -> StepTimeline:
    ops: dict[int, tuple[tuple[Op, float, float], ...]] = {}
    allreduce: dict[tuple[int, int], float] = {}
    for rank in timeline.ranks:
        items = tuple((iv.op, iv.start, iv.end) for iv in timeline.of_rank(rank))
        ops[rank] = items
        for op, _, end in items:
            if op.kind is OpKind.ALLREDUCE_GRAD:
                allreduce[rank, op.stage_id] = end
    return StepTimeline(ops, allreduce, length)


def plain_step_time(problem: Problem) -> float:
    """T0: the step time of the plain pipeline (no K-FAC)."""
    return step_timeline(problem, frozenset(), False).length


def plain_utilization(problem: Problem) -> float:
    """The plain pipeline's utilization (no K-FAC): its F/B over every device's step."""
    base = step_timeline(problem, frozenset(), False)
    busy = sum(sum(b - a for _, a, b in base.fixed(d)) for d in problem.devices)
    return utilization(busy, base.length * len(problem.devices))


@lru_cache(maxsize=64)
def steps_overlap(problem: Problem) -> bool:
    """Whether, with each OPT_STEP synchronizing only its agreement set, some op of a steady run ends at another time
    than the one-step timeline repeated every `length` seconds says (a later step overlapping an earlier one):
    checked over 3 simulated steps, plain and refresh-step (every layer's curvature fused) durations alike.
    The window models a step by the one-step timeline, so there the planner keeps the world barrier's step."""
    if problem.barrier is StepBarrier.WORLD:
        return False
    programs = reference_programs(problem)
    barrier = {d: agreement_set(problem, d) for d in problem.devices}
    for fused, refresh in ((frozenset(), False), (frozenset(problem.costs.layer_names), True)):
        one = step_timeline(problem, fused, refresh=refresh)
        run = simulate(programs, _duration(problem, fused, refresh), steps=3, barrier=barrier)
        want = {
            (d, j, n): j * one.length + end
            for d, items in one.ops.items()
            for j in range(3)
            for n, (_, _, end) in enumerate(items)
        }
        seen: dict[tuple[int, int], int] = {}
        for iv in sorted(run.intervals, key=lambda iv: (iv.rank, iv.step, iv.start, iv.end)):
            n = seen[iv.rank, iv.step] = seen.get((iv.rank, iv.step), -1) + 1
            if iv.op.kind is not OpKind.OPT_STEP and abs(iv.end - want[iv.rank, iv.step, n]) > 1e-9 * one.length:
                return True
    return False


Time = TypeVar("Time", int, float)


def window_length(refresh: Time, normal: Time, stretch: Time, k: int) -> Time:
    """The length of a window of k steps: the refresh step lasts `refresh`, the others `normal`, each followed by
    `stretch` idle time ([Note: stretch] in planner/window.py); in ticks or seconds."""
    return refresh + (k - 1) * normal + k * stretch


def step_begins(refresh: Time, normal: Time, stretch: Time, j: int, k: int) -> Time:
    """Where window step j begins after the start of window step 0 (j >= k: a later window, which repeats it),
    before any lead ([Note: step barrier] in planner/window.py): the one step start of the window, the plan's view
    and the validator."""
    within = j % k
    start = 0 if within == 0 else refresh + (within - 1) * normal
    return start + within * stretch + window_length(refresh, normal, stretch, k) * (j // k)


def early_start(problem: Problem, step: StepTimeline, devices: Iterable[int]) -> float:
    """Seconds before the end of `step` at which the step after it may begin on `devices` (an agreement set): once
    each of them has ended its F/B and all-reduces and then run its per-step slots back to back (`slot_seconds`:
    where a plan may put them, not just where the reference step does); 0 under `StepBarrier.WORLD` or where steps
    overlap (`steps_overlap`)."""
    if problem.barrier is StepBarrier.WORLD or steps_overlap(problem):
        return 0.0
    last = max(
        (
            max((end for op, _, end in step.ops[d] if op.kind not in _SLOT_KINDS), default=0.0)
            + sum(slot_seconds(problem, d, s) for s in stages_on_device(problem, d))
        )
        for d in devices
    )
    return max(0.0, step.length - last)


_SLOT_KINDS = frozenset({OpKind.APPLY, OpKind.STATS, OpKind.BCAST_PREC, OpKind.OPT_STEP})
"""Ops of a step's end that are no fixed work (the per-step slot, which a plan places, and OPT_STEP)."""


def slot_seconds(problem: Problem, device: int, stage: int) -> float:
    """Seconds of `stage`'s per-step slot on `device` (`prec_work`), its broadcasts of preconditioned gradients
    starting together on every copy, after the longest work before them on any copy."""
    work = prec_work(problem, device, stage)
    shares = [secs for op, secs in work if op.kind is OpKind.BCAST_PREC]
    if not shares:
        return sum(secs for _, secs in work)
    before = max(
        sum(secs for op, secs in prec_work(problem, c, stage) if op.kind is not OpKind.BCAST_PREC)
        for c in copies_of_stage(problem, stage)
    )
    return before + sum(shares)


def stream_start(problem: Problem, step: StepTimeline) -> float:
    """When, in `step`, the first of the streamed stage's owners starts its last backward (or W, in a zero-bubble
    schedule): a streamed layer's refresh must be made by then to reach its helper in time (`Window.stream_use`)."""
    assert problem.streaming is not None, "only a streaming problem has a streamed stage"
    s = problem.streaming.stage
    return min(
        max(a for op, a, _ in step.ops[owner] if op.kind in (OpKind.BWD, OpKind.BWD_W) and op.stage == s)
        for owner in problem.stream_owners
    )


def tap_extra(problem: Problem) -> float:
    """Seconds the refresh step's taps (`StageCost.tap_fwd`) add to a step: the price of refreshing at all, which
    a plan pays once per refresh period and max_overhead does not count (as it does not count APPLY)."""
    return step_timeline(problem, refresh=True).length - step_timeline(problem).length


def fused_stats(problem: Problem, fused: frozenset[str], rank: int, bwd: Op) -> list[Op]:
    """The STATS a refresh step runs right after `bwd` on `rank` to fold the `fused` layers' statistics, made
    inside that micro-batch's F/B (`capture_stats`; a zero-bubble schedule's `bwd` is the W,
    `weight_gradient_kind`); they take no time of their own (`StageCost.fused_curvature` prices the curvature in the
    F/B or W)."""
    if bwd.stage is None:
        raise AssertionError(f"'{bwd}' names no stage")
    parts = {
        x.name: [p.part for p in x.parts if p.after is not OpKind.ALLREDUCE_GRAD]
        for x in problem.costs.stages[bwd.stage].layers
        if x.name in fused
    }
    where = {name: problem.where(name) for name in parts}
    return capture_stats(bwd, rank, parts, copies_of_stage(problem, bwd.stage), where)


def fused_extra(problem: Problem, fused: frozenset[str]) -> float:
    """Seconds the `fused` layers' curvature adds to the refresh step: what fusing costs, against max_overhead."""
    return step_timeline(problem, fused, refresh=True).length - step_timeline(problem, refresh=True).length


def stretch_allowance(problem: Problem, fused: frozenset[str], k: int) -> float:
    """Seconds of idle time the planner may append to every step at refresh period k: max_overhead of
    the reference step, less what the refresh step's fused curvature adds per step of the window."""
    normal = step_timeline(problem).length
    return max(0.0, problem.max_overhead * normal - fused_extra(problem, fused) / k)


def refresh_lower_bound(
    problem: Problem, group: StageGroup, fused: frozenset[str] = frozenset(), stretch: bool = False
) -> int:
    """ceil(K-FAC work of the group / its bubble time per step): curvature of every micro-batch on
    every copy that keeps the layer's statistics (unfused layers) plus all inversions, over the idle time of
    the reference step (whose F/B, per-step preconditioner work and gradient all-reduces are busy).

    stretch: the idle time appended to every step within max_overhead (`stretch_allowance`) counts as
    bubble on every device of the group: the least k whose k steps hold the work.
    """
    work, bubble = group_load(problem, group, fused)
    if work <= 0:
        return 1
    if stretch:
        for k in range(1, problem.max_period + 1):
            if work <= k * (bubble + len(group.devices) * stretch_allowance(problem, fused, k)) * (1 + 1e-9):
                return k
        return problem.max_period + 1
    if bubble <= 1e-9 * step_timeline(problem, fused).length * len(group.devices):  # none but float rounding
        return problem.max_period + 1
    return min(problem.max_period + 1, max(1, math.ceil(work / bubble - 1e-9)))


def group_load(problem: Problem, group: StageGroup, fused: frozenset[str] = frozenset()) -> tuple[float, float]:
    """(seconds of K-FAC work of one refresh, seconds of bubble per step) of the group's devices: the curvature of
    every micro-batch on every copy that keeps the layer's statistics (unfused layers) plus all inversions, and the
    idle time of the reference step (whose F/B, per-step preconditioner work and gradient all-reduces are busy)."""
    step = step_timeline(problem, fused)
    work = 0.0
    for device in group.devices:
        for op, _, _ in step.fixed(device):
            assert op.stage is not None, "F/B name their stage"
            copies = copies_of_stage(problem, op.stage)
            work += sum(
                p.stats
                for x in problem.costs.stages[op.stage].layers
                if x.name not in fused and keeps_statistics(device, copies, problem.where(x.name))
                for p in x.parts
                if p.after is op.kind
            )
    work += sum(problem.costs.stages[s].inv for s in group.stages)
    busy = sum(
        end - start
        for d in group.devices
        for op, start, end in step.ops[d]
        if op.kind in _FIXED_KINDS or op.kind in _NOT_BUBBLE
    )
    return work, step.length * len(group.devices) - busy
