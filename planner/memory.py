"""Memory accounting of a problem: what each device holds all step, its activations in flight, and their peak."""

from __future__ import annotations

from collections.abc import Iterable

from fxkfac.planner.costs import StageCost
from fxkfac.planner.ir import OpKind
from fxkfac.planner.problem import Problem, copies_of_stage, stages_on_device, streamed_stats
from fxkfac.planner.step_timeline import StepTimeline, step_timeline
from fxkfac.planner.strategy import holding

__all__ = [
    "static_bytes",
    "decomposition_bytes",
    "activation_intervals",
    "peak_level",
    "w_operand_bytes",
    "activation_peak",
    "min_memory_bytes",
]


def static_bytes(problem: Problem, device: int) -> int:
    """Memory held all step on `device`: parameters and gradients (2x); of each layer, the statistics, two
    decompositions (each as large as the statistics: the active one and the next, which a refresh makes beside
    it and which waits until it is used, `LayerTiming.use_offset` steps after the refresh, across step ends
    when that is later) and the optimizer state besides them (`LayerCost.state_bytes`: grafting, momentum,
    Adam moments) where the device keeps them (`planner.strategy.holding`); and two transients, each counted
    once: the largest error peak of one backward, and the largest buffer of a layer's gradient whose
    preconditioned gradient the device broadcasts or receives (BCAST_PREC packs one layer at a time and frees
    the buffer after it; the received gradient replaces the layer's own, so nothing is kept across steps).
    Measured against the runtime in tests/test_strategy_memory.py: an upper bound, met where every layer's
    next decomposition is made before any is used (a critical-path refresh); a plan that staggers them holds
    less. A plan whose next refresh makes a decomposition before this one is used holds a third while it
    waits: a placement's peak adds it (`planner.solution.remade_spans`)."""
    stages = stages_on_device(problem, device)
    total = shared = 0
    for s in stages:
        cost, copies = problem.costs.stages[s], copies_of_stage(problem, s)
        total += 2 * cost.param_bytes
        for x in cost.layers:
            gradient_fed = all(p.after is OpKind.ALLREDUCE_GRAD for p in x.parts)
            held = holding(device, copies, problem.where(x.name), gradient_fed)
            total += x.factor_bytes * (held.statistics + 2 * held.decompositions) + x.state_bytes * held.decompositions
            shared = max(shared, x.gradient_bytes * held.shares_gradient)
    return (
        total
        + shared
        + max((problem.costs.stages[s].peak_err_bytes for s in stages), default=0)
        + _streamed_bytes(problem, device)
    )


def _streamed_bytes(problem: Problem, device: int) -> int:
    """What streaming adds (planner/streaming.py): on each owner, the buffers its streamed layers' preconditioned
    gradients land in (posted when the step begins); on a helper, for each layer it preconditions, the gradients
    received from every owner, their preconditioned sum and two decompositions (active and next) of its replica, and
    of a unit whose statistics it folds (`streamed_stats`) those statistics and its optimizer state."""
    streaming = problem.streaming
    if streaming is None:
        return 0
    if device in problem.stream_owners:
        return sum(problem.costs.layer(n).gradient_bytes for n in streaming.layers)
    layers = [problem.costs.layer(n) for n in streaming.layers_of(device)]
    gradients = sum(x.gradient_bytes for x in layers)
    kept = sum(x.factor_bytes + x.state_bytes for x in layers if streamed_stats(problem, x.name))
    return (len(problem.stream_owners) + 1) * gradients + 2 * sum(x.factor_bytes for x in layers) + kept


def decomposition_bytes(problem: Problem, device: int, layer: str) -> int:
    """Bytes of one decomposition of `layer` on `device` (as large as its statistics), 0 where the device keeps
    none (`planner.strategy.holding`)."""
    x = problem.costs.layer(layer)
    gradient_fed = all(p.after is OpKind.ALLREDUCE_GRAD for p in x.parts)
    copies = copies_of_stage(problem, problem.costs.stage_of(layer))
    if device not in copies or not holding(device, copies, problem.where(layer), gradient_fed).decompositions:
        return 0
    return x.factor_bytes


def activation_intervals(
    problem: Problem, device: int, step: StepTimeline, w_operands: bool = True
) -> list[tuple[float, float, int]]:
    """(start, end, bytes) of each micro-batch's activations on `device`: from F start to B end; for a stage that
    recomputes (`Problem.recompute`), its boundary from F start to B end and its activations, made again, over its
    B alone. A zero-bubble schedule's deferred W keeps its layers' operands (`w_operand_bytes`) from its B's end
    until it ends (`w_operands` False: not listed, where W's are placed tasks that hold them, planner/w_tasks.py)."""
    starts: dict[tuple[int | None, int | None, int], float] = {}
    b_ends: dict[tuple[int | None, int | None, int], float] = {}
    out = []
    for op, start, end in step.ops[device]:
        key = (op.stage, op.mb, op.pipe)
        if op.kind is OpKind.FWD:
            starts[key] = start
        elif op.kind is OpKind.BWD_W and w_operands:
            out.append((b_ends[key], end, w_operand_bytes(problem.costs.stages[op.stage_id])))
        elif op.kind is OpKind.BWD:
            b_ends[key] = end
            cost = problem.costs.stages[op.stage_id]
            if problem.recomputes(op.stage_id):
                out += [(starts[key], end, cost.boundary_bytes), (start, end, cost.act_bytes)]
            else:
                out.append((starts[key], end, cost.act_bytes))
    return out


def w_operand_bytes(stage: StageCost) -> int:
    """Bytes one micro-batch's deferred W keeps of the stage: each layer's input and output gradient, of which
    dW = Gᵀ A is made (the deferred captures of its K-FAC parts, `PartCost.capture_bytes`, are those tensors);
    the stage's activations where its layers capture none (a table without K-FAC parts)."""
    captured = sum(p.capture_bytes for x in stage.layers for p in x.parts if p.after is not OpKind.ALLREDUCE_GRAD)
    return captured if captured else stage.act_bytes


def peak_level(spans: Iterable[tuple[float, float, int]]) -> int:
    """The most bytes held at once by (start, end, bytes) spans, each held over [start, end) (a span that ends when
    another starts is released first): the one memory sweep of the planner, its window and the validator."""
    events = sorted(event for start, end, nbytes in spans for event in ((start, nbytes), (end, -nbytes)))
    level = peak = 0
    for _, delta in events:
        level += delta
        peak = max(peak, level)
    return peak


def activation_peak(problem: Problem, device: int, fused: frozenset[str] = frozenset()) -> int:
    """The peak of activations in flight on `device` over one step."""
    return peak_level(activation_intervals(problem, device, step_timeline(problem, fused)))


def min_memory_bytes(problem: Problem) -> int:
    """The least per-device memory any plan needs: static bytes plus the activation peak with every
    layer's curvature fused (nothing kept for later)."""
    fused = frozenset(problem.costs.layer_names)
    return max(static_bytes(problem, d) + activation_peak(problem, d, fused) for d in problem.devices)
