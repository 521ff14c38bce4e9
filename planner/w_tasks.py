"""The zero-bubble schedules' W's as planner tasks (issue 37 item 3): placed by the window's solvers among the
preconditioner's work, instead of at the schedule's positions.

[Note: placed W] A W (OpKind.BWD_W, the weight-gradient half of a backward) depends on its own B alone and is
needed by its stage's gradient all-reduce, the step's update. It is flexible work with a release and a deadline,
as a deferred STATS is: in a window (planner/window.py) each W of each step becomes a `TaskKind.WGRAD` task on
its rank, released at its B's end, due by the start of its stage's ALLREDUCE_GRAD in the same step, holding its
layers' operands (`planner.memory.w_operand_bytes`) from its release until it ends (the window's memory model
counts them as it counts a deferred STATS's captures). Its length is its interval in the simulated step (the
refresh step's includes the fused layers' curvature, which runs with it), and the schedule's position (`home`)
is where first-fit puts it and CP-SAT's hint: the plain schedule is a valid placement, so a W moves only where
that leaves the DECOMP, APPLY and deferred STATS tasks more room. The F/B keep their simulated times: a W
moves only within its rank's idle time, so no step grows. A fused layer's decomposition waits for the refresh
step's W's of its stage (they fold its statistics). Plans place W's where `placed_w` holds: a zero-bubble
schedule without streaming (a streamed layer's hand-off follows the stage's last backward in the program).
"""

from __future__ import annotations

from collections.abc import Sequence

from fxkfac.planner.ir import Op, OpKind
from fxkfac.planner.memory import w_operand_bytes
from fxkfac.planner.problem import Problem
from fxkfac.planner.schedules import ZERO_BUBBLE_KINDS
from fxkfac.planner.step_timeline import StepTimeline
from fxkfac.planner.window import Grid, Task, TaskKind

__all__ = ["placed_w", "w_window", "w_tasks", "w_bounds"]


def placed_w(problem: Problem) -> bool:
    """Whether the problem's plans place its W's as tasks ([Note: placed W]): a zero-bubble schedule, no streaming."""
    return problem.kind in ZERO_BUBBLE_KINDS and problem.streaming is None


def w_bounds(step: StepTimeline, device: int, w: Op) -> tuple[float, float]:
    """(release, deadline) of W `w` on `device` in `step`, seconds from the step's start: the end of its B, and the
    start of its stage's ALLREDUCE_GRAD (the schedule's position lies between them)."""
    b = Op(OpKind.BWD, w.stage, w.mb, w.pipe)
    release = next(end for op, _, end in step.ops[device] if op == b)
    due = next(start for op, start, _ in step.ops[device] if op.kind is OpKind.ALLREDUCE_GRAD and op.stage == w.stage)
    return release, due


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
                        deadline=offsets[j] + max(grid.at(due), b),
                        home=offsets[j] + a,
                    )
                )
    return tasks
