"""Checks of the per-rank programs: each rank's steps run the schedule's pipeline ops and the placed ops in time
order, every gradient is complete before it is read, and the programs, simulated, neither deadlock nor run slower
than planned."""

from __future__ import annotations

import math

from fxkfac.planner.errors import DeadlockError
from fxkfac.planner.ir import LAYER_TRANSFER_KINDS, PRECONDITIONER_KINDS, Op, OpKind
from fxkfac.planner.problem import StepBarrier, agreement_set, copies_of_stage, is_streamed
from fxkfac.planner.schedules import ZERO_BUBBLE_KINDS, weight_gradient_kind
from fxkfac.planner.simulate import simulate
from fxkfac.planner.step_timeline import fused_stats, stream_lead
from fxkfac.planner.validate.context import Context, collective_seconds, op_seconds, per_step
from fxkfac.planner.w_tasks import placed_w


def _placed_kinds(c: Context) -> frozenset[OpKind]:
    """The ops a program holds where its placements say: the preconditioner's, and a zero-bubble schedule's W's
    where plans place them ([Note: placed W] in planner/w_tasks.py)."""
    return PRECONDITIONER_KINDS | ({OpKind.BWD_W} if placed_w(c.problem) else set())


def _follows_w(c: Context, op: Op) -> bool:
    """Whether `op` is a no-op all-reduce (of a stage without copies) that follows its stage's placed W's wherever
    they are, not the schedule's position (`_check_w_order` checks it)."""
    return (
        op.kind is OpKind.ALLREDUCE_GRAD
        and placed_w(c.problem)
        and op.stage is not None
        and len(copies_of_stage(c.problem, op.stage)) == 1
    )


def _check_w_order(c: Context, device: int, j: int, ops: list[Op]) -> None:
    """Each stage's gradient all-reduce comes after every W of the stage in the step (the runtime refuses it while
    one waits)."""
    for i, op in enumerate(ops):
        later = [o for o in ops[i + 1 :] if o.kind is OpKind.BWD_W and o.stage == op.stage]
        if op.kind is OpKind.ALLREDUCE_GRAD and later:
            c.errors.append(f"r{device} step {j}: '{op}' comes before '{later[0]}' of its stage")


def check_programs(c: Context, run: bool) -> None:
    plan = c.plan
    placed_kinds = _placed_kinds(c)
    for d in c.problem.devices:
        prog = plan.programs.get(d)
        k = max(c.period(s) for s in range(c.problem.num_stages) if d in copies_of_stage(c.problem, s))
        length = _program_length(c, d, k)
        if prog is None or len(prog) != length:
            c.errors.append(f"r{d}: the program must have {length} steps")
            continue
        if any(_placed(c, d, prog[j]) != _placed(c, d, prog[j % k]) for j in range(k, length)):
            c.errors.append(f"r{d}: the program repeats its own {k} steps but for streamed layers' replicas")
        prog = prog[:k]
        for j, ops in enumerate(prog):
            want = [op for op, _, _ in c.timeline(j, k).ops[d] if op.kind not in placed_kinds and not _follows_w(c, op)]
            if [op for op in ops if op.kind not in placed_kinds and not _follows_w(c, op)] != want:
                c.errors.append(f"r{d} step {j}: the pipeline ops differ from the schedule's")
            moved = [op for op, _, _ in c.timeline(j, k).ops[d] if _follows_w(c, op)]
            if sorted(map(str, (op for op in ops if _follows_w(c, op)))) != sorted(map(str, moved)):
                c.errors.append(f"r{d} step {j}: the gradient all-reduces differ from the schedule's")
            _check_w_order(c, d, j, ops)
        times = {
            (p.step % k, str(p.op)): (p.start - c.length(k) * (p.step // k), p.end - c.length(k) * (p.step // k))
            for p in plan.placements
            if p.device == d
        }
        listed = [
            (j, str(op))
            for j, ops in enumerate(prog)
            for op in ops
            if op.kind in placed_kinds and not _fold(c, op) and not is_streamed(c.problem, d, op)
        ]
        _check_folds(c, d, prog)
        if sorted(listed) != sorted(times):
            c.errors.append(f"r{d}: the program's K-FAC ops differ from the placements")
            continue
        if any(a[0] == b[0] and times[a] > times[b] for a, b in zip(listed, listed[1:])):
            c.errors.append(f"r{d}: the program's K-FAC ops are not in time order")
        _check_interleaving(c, d, k, prog)
    if run:
        _check_runs(c)


def _program_length(c: Context, device: int, k: int) -> int:
    """The steps of the device's program: its stages' period, or where it helps a streamed stage the lcm of that and
    the owner's (its replicas arrive on the owner's period: planner/streaming.py `add_replicas`)."""
    streaming = c.problem.streaming
    if streaming is None or device not in streaming.ranks:
        return k
    return math.lcm(k, c.period(streaming.stage))


def _placed(c: Context, device: int, ops: list[Op]) -> list[Op]:
    """A step's ops but a streamed layer's (which `check_streaming` checks)."""
    return [op for op in ops if not is_streamed(c.problem, device, op)]


def _fold(c: Context, op: Op) -> bool:
    """Whether `op` folds a fused layer's capture (a STATS of a micro-batch of a fused layer): part of the refresh
    step's F/B, not placed work."""
    return op.kind is OpKind.STATS and op.mb is not None and op.layer in c.fused


def _check_folds(c: Context, device: int, prog: list[list[Op]]) -> None:
    """The refresh step (step 0) follows each BWD (a zero-bubble schedule's W) with exactly the STATS that fold its
    fused layers' statistics on this rank (`fused_stats`), and no other step folds any: without them the runtime
    has no statistic to sync or decompose."""
    anchor = weight_gradient_kind(c.problem.kind)
    for j, ops in enumerate(prog):
        for i, op in enumerate(ops):
            if not _fold(c, op) and not (j == 0 and op.kind is anchor):
                continue
            if op.kind is anchor:
                want = fused_stats(c.problem, c.fused, device, op)
                got = ops[i + 1 : i + 1 + len(want)]
                if got != want:
                    c.errors.append(f"r{device} step 0: '{op}' is not followed by the folds of its fused layers {want}")
            elif j != 0 or i == 0 or not (ops[i - 1].kind is anchor or _fold(c, ops[i - 1])):
                c.errors.append(f"r{device} step {j}: '{op}' is not right after a {anchor} of the refresh step")


def _check_interleaving(c: Context, device: int, k: int, prog: list[list[Op]]) -> None:
    """Within each step, a K-FAC op comes after every pipeline op that ended before it was placed and
    before every pipeline op that ends after its start (a RECV still waiting included); APPLY follows
    its stage's backwards and gradient all-reduce; OPT_STEP ends the step. The runtime executes the
    program in order, so a program that disagrees with its placements runs other semantics."""
    placed_kinds = _placed_kinds(c)
    starts = {(p.step % k, str(p.op)): p.start - c.base(p.step, k) for p in c.plan.placements if p.device == device}
    for j, ops in enumerate(prog):
        fixed = iter(c.timeline(j, k).ops[device])
        times: list[tuple[Op, float, float] | None] = []
        for op in ops:
            pipeline = op.kind not in placed_kinds and not _follows_w(c, op)
            nxt = (x for x in fixed if x[0].kind not in placed_kinds and not _follows_w(c, x[0]))
            times.append(next(nxt, None) if pipeline else None)
        for i, op in enumerate(ops):
            if op.kind is OpKind.OPT_STEP and i != len(ops) - 1:
                c.errors.append(f"r{device} step {j}: OPT_STEP is not the last op")
            if op.kind not in placed_kinds or _fold(c, op) or is_streamed(c.problem, device, op):
                continue  # a streamed layer's ops: check_streaming
            t = starts[(j, str(op))]
            for n, item in enumerate(times):
                if item is None or item[0].kind is OpKind.OPT_STEP:
                    continue  # OPT_STEP ends the step (the barrier): work placed in the stretch runs before it
                other, a, b = item
                before = b <= t + c.tol and a < t - c.tol
                if (n > i and before) or (n < i and b > t + c.tol):
                    c.errors.append(
                        f"r{device} step {j}: '{op}' (placed at {t:.6g} s) and "
                        f"'{other}' ({a:.6g}-{b:.6g} s)"
                        " are in the wrong order in the program"
                    )
            if per_step(op):
                _check_gradient_order(c, device, j, ops, i)


def _check_gradient_order(c: Context, device: int, j: int, ops: list[Op], i: int) -> None:
    """An APPLY or gradient STATS (ops[i]) comes after every BWD, BWD_W and ALLREDUCE_GRAD of its stage in the step
    (the gradient is complete); a gradient STATS also before its stage's APPLY (which overwrites the gradient)."""
    op = ops[i]
    gradient = (OpKind.BWD, OpKind.BWD_W, OpKind.ALLREDUCE_GRAD)
    after = [o for o in ops[i + 1 :] if o.stage == op.stage and o.kind in gradient]
    if after:
        c.errors.append(f"r{device} step {j}: '{op}' comes before '{after[0]}' of its stage")
    if op.kind is OpKind.STATS and not any(o.kind is OpKind.APPLY and o.stage == op.stage for o in ops[i + 1 :]):
        c.errors.append(f"r{device} step {j}: '{op}' does not come before the APPLY of its stage")


def _check_runs(c: Context) -> None:
    """Simulate the programs (ops in program order, as soon as possible): no deadlock, and the run is
    no slower than planned (the durations of a non-refresh step are used: exact when nothing is fused)."""
    stages = c.problem.costs.stages
    split = c.problem.kind in ZERO_BUBBLE_KINDS  # a BWD without its W, which runs apart

    def duration(rank: int, op: Op) -> float:
        if op.kind is OpKind.FWD:
            return stages[op.stage_id].fwd
        if op.kind is OpKind.BWD:
            again = stages[op.stage_id].fwd if c.problem.recomputes(op.stage_id) else 0.0  # activation checkpointing
            return stages[op.stage_id].bwd - (stages[op.stage_id].weight_grad if split else 0.0) + again
        if op.kind is OpKind.BWD_W:
            return stages[op.stage_id].weight_grad
        if op.kind is OpKind.ALLREDUCE_GRAD:
            return collective_seconds(c, op)
        if op.kind in LAYER_TRANSFER_KINDS or _fold(c, op):
            return 0.0
        return op_seconds(c, op) if op.kind in PRECONDITIONER_KINDS else 0.0

    periods = [len(p) for p in c.plan.programs.values()]
    steps = max(periods) * 2
    try:
        barrier = (
            None
            if c.problem.barrier is StepBarrier.WORLD
            else {d: agreement_set(c.problem, d) for d in c.problem.devices}
        )
        timeline = simulate(
            c.plan.programs, duration, steps=steps, barrier=barrier, lead=stream_lead(c.problem, duration)
        )
    except DeadlockError as e:
        c.errors.append(f"the programs deadlock: {e}")
        return
    if not c.fused:
        limit = c.plan.metrics.step_time * steps + max(c.length(k) for k in set(periods))
        if timeline.makespan > limit + c.tol * steps:
            c.errors.append(
                f"the simulated programs take {timeline.makespan:.6g} s for {steps} steps, over {limit:.6g}"
            )
