"""The zero-bubble schedules' W's as planner tasks (issue 37 item 3): placed by the window's solvers among the
preconditioner's work, instead of at the schedule's positions.

[Note: placed W] A W (OpKind.BWD_W, the weight-gradient half of a backward) depends on its own B alone and is
needed by its stage's gradient all-reduce, the step's update. It is flexible work with a release and a deadline,
as a deferred STATS is: in a window (planner/window.py) each W of each step becomes a `TaskKind.WGRAD` task on
its rank, released at its B's end, due by its stage's update in the same step (the start of its ALLREDUCE_GRAD
where the stage has copies; else its per-step slot, the no-op all-reduce following the last W: `shared`), holding its
layers' operands (`planner.memory.w_operand_bytes`) from its release until it ends (the window's memory model
counts them as it counts a deferred STATS's captures). Its length is its interval in the simulated step (the
refresh step's includes the fused layers' curvature, which runs with it). The schedule's position (`home`) is where
first-fit puts it and where CP-SAT keeps it while it searches for any placement (the refresh period and the stretch
are searched so, as with W's fixed: free W's made those searches slower, and some found a longer period), freeing
them only where that search proves there is none (a period that only moved W's make room for); CP-SAT's
least-staleness solve then moves the W's, from that placement, where that leaves the DECOMP, APPLY and deferred
STATS tasks more room (a placement it finds worse is not kept). The F/B keep their simulated times: a W moves only
within its rank's idle time, so no step grows. A fused layer's decomposition waits for the refresh step's W's of
its stage (they fold its statistics). Plans place W's where `placed_w` holds: a zero-bubble schedule without
streaming (a streamed layer's hand-off follows the stage's last backward in the program) whose windows hold at most
`MAX_W_TASKS` of them.
"""

from __future__ import annotations

from collections.abc import Sequence

from fxkfac.planner.ir import Op, OpKind
from fxkfac.planner.memory import w_operand_bytes
from fxkfac.planner.problem import Problem, copies_of_stage
from fxkfac.planner.schedules import ZERO_BUBBLE_KINDS
from fxkfac.planner.step_timeline import StepTimeline
from fxkfac.planner.window import Grid, Task, TaskKind

__all__ = ["MAX_W_TASKS", "placed_w", "shared", "w_window", "w_tasks", "w_bounds", "allreduce_after_w"]


MAX_W_TASKS = 4096
"""The most W tasks a problem's longest window may hold (N micro-batches x S stages x `Problem.max_period` steps)
for its plans to place W's: beyond it they stay at the schedule's places. CP-SAT's model grows with them: BERT-Large
ZB-H1 D=8 N=32 on the paper's profiles (8192) took 14 s of CP-SAT where W's at their places took 3.6 s, and refreshed
stages 4 and 5 a step later (18 16 against 17 15); ZB-V D=8 N=8 (4096) plans better with them."""


def placed_w(problem: Problem) -> bool:
    """Whether the problem's plans place its W's as tasks ([Note: placed W]): a zero-bubble schedule, no streaming,
    at most `MAX_W_TASKS` W's in its longest window."""
    few = problem.N * problem.num_stages * problem.max_period <= MAX_W_TASKS
    return problem.kind in ZERO_BUBBLE_KINDS and problem.streaming is None and few


def shared(problem: Problem, stage: int) -> bool:
    """Whether `stage`'s gradient all-reduce is a collective (the stage has copies): its W's are due by its start,
    a fixed time of the step; with one copy it is a no-op that follows the stage's last W wherever it is placed, and
    the W's are due by the stage's per-step slot (its gradient STATS and APPLY, which read the gradient)."""
    return len(copies_of_stage(problem, stage)) > 1


def w_bounds(step: StepTimeline, device: int, w: Op) -> tuple[float, float]:
    """(release, due) of W `w` on `device` in `step`, seconds from the step's start: the end of its B, and the
    start of its stage's ALLREDUCE_GRAD (the schedule's position lies between them)."""
    b = Op(OpKind.BWD, w.stage, w.mb, w.pipe)
    release = next(end for op, _, end in step.ops[device] if op == b)
    due = next(start for op, start, _ in step.ops[device] if op.kind is OpKind.ALLREDUCE_GRAD and op.stage == w.stage)
    return release, due


def allreduce_after_w(problem: Problem, items: list[tuple[tuple[int, ...], Op]]) -> list[tuple[tuple[int, ...], Op]]:
    """One step's program items (sort key, op) with each one-copy stage's ALLREDUCE_GRAD keyed right after the
    stage's last placed W where that W comes later (`shared`): the runtime refuses an all-reduce while a W of its
    stage waits."""
    last: dict[int | None, tuple[int, ...]] = {}
    for key, op in items:
        if op.kind is OpKind.BWD_W:
            last[op.stage] = max(last.get(op.stage, key), key)
    out = []
    for key, op in items:
        if op.kind is OpKind.ALLREDUCE_GRAD and op.stage in last and not shared(problem, op.stage_id):
            key = max(key, (*last[op.stage][:3], 1 << 30))  # after the W's folds, which share its first 3 keys
        out.append((key, op))
    return out


def w_window(problem: Problem, step: StepTimeline, device: int, grid: Grid) -> list[tuple[Op, int, int]]:
    """The device's W's of `step` that become tasks, each with its home interval in ticks from the step's start."""
    if not placed_w(problem):
        return []
    return [(op, grid.at(a), grid.at(b)) for op, a, b in step.fixed(device) if op.kind is OpKind.BWD_W]


def w_tasks(
    problem: Problem,
    devices: Sequence[int],
    steps: Sequence[StepTimeline],
    offsets: Sequence[int],
    grid: Grid,
    fused: frozenset[str] = frozenset(),
) -> list[Task]:
    """The WGRAD task of every W of every window step on `devices` ([Note: placed W]); the refresh step's (j = 0)
    list, as `factors`, the fused parts their curvature feeds: those parts' decompositions follow them."""
    tasks = []
    for d in devices:
        for j, st in enumerate(steps):
            for op, a, b in w_window(problem, st, d, grid):
                release, due = w_bounds(st, d, op)
                deadline = offsets[j] + max(grid.at(due), b) if shared(problem, op.stage_id) else offsets[j + 1]
                stage = problem.costs.stages[op.stage_id]
                feeds = tuple(
                    (x.name, p.part) for x in stage.layers if x.name in fused for p in x.parts if p.after is OpKind.BWD
                )
                tasks.append(
                    Task(
                        f"w_s{op.stage}_m{op.mb}_p{op.pipe}_r{d}_j{j}",
                        TaskKind.WGRAD,
                        op.stage_id,
                        "",
                        (op,),
                        (next(y - x for o, x, y in st.fixed(d) if o == op),),
                        max(1, b - a),
                        (d,),
                        offsets[j] + grid.at(release),
                        feeds if j == 0 else (),
                        w_operand_bytes(stage),
                        deadline=deadline,
                        home=offsets[j] + a,
                    )
                )
    return tasks
