"""A stage's decompositions made in pieces (`Problem.decomp_pieces`) are placed in tasks no longer than one piece of
its longest decomposition ([Note: piece tasks] in planner/plan/window.py): the longest keeps a task per piece, a
small one runs all its pieces in one task, on one rank, in order."""

from __future__ import annotations

from fxkfac.planner.plan.window import TaskKind, Window, build_window
from fxkfac.planner.problem.ir import OpKind
from fxkfac.planner.problem.problem import Problem, SolverConfig, StepBarrier, stage_groups
from fxkfac.planner.problem.profiles import ProfileLayers, load_cost_table
from fxkfac.planner.search.attempt import solve
from fxkfac.planner.validate import validate

PIECES = 4


def _problem() -> Problem:
    costs = load_cost_table(
        "paper:bert-base/p100", blocks_per_stage=3, n_stages=4, micro_batch_size=32, layers=ProfileLayers.LINEAR
    )
    return Problem("1f1b", 4, 4, costs, decomp_pieces=PIECES, barrier=StepBarrier.AGREEMENT_SET)


def test_each_decomposition_takes_the_fewest_tasks_no_longer_than_a_piece_of_the_longest() -> None:
    problem = _problem()
    window = build_window(problem, stage_groups(problem)[0], 3)
    longest = max(p.decomp for x in problem.costs.stages[0].layers for p in x.parts)
    for x in problem.costs.stages[0].layers:
        for p in x.parts:
            tasks = [t for t in window.tasks if t.kind is TaskKind.INV and t.factors == ((x.name, p.part),)]
            ops = [op for t in tasks for op in t.ops]
            assert [op.piece for op in ops] == [(i, PIECES) for i in range(PIECES)]  # every piece, in order
            assert all(sum(t.seconds) <= longest / PIECES * (1 + 1e-9) for t in tasks)  # none outlasts a piece
            # the fewest: no two tasks' pieces would fit one task
            assert all(
                sum(a.seconds) + sum(b.seconds) > longest / PIECES * (1 + 1e-9) for a, b in zip(tasks, tasks[1:])
            )
            assert abs(sum(sum(t.seconds) for t in tasks) - p.decomp) <= 1e-12
    counts = {len([t for t in window.tasks if t.kind is TaskKind.INV and t.factors == f]) for f in _factors(window)}
    assert counts == {1, PIECES}  # the d-wide factors whole, the 4d-wide ones in 4


def _factors(window: Window) -> set[tuple[tuple[str, str], ...]]:
    return {t.factors for t in window.tasks if t.kind is TaskKind.INV}


def test_a_plan_runs_every_piece_of_a_small_decomposition_back_to_back_on_one_rank() -> None:
    problem = _problem()
    plan = solve(problem, SolverConfig(time_limit_s=2.0), "greedy")
    assert validate(problem, plan) == []
    longest = max(p.decomp for x in problem.costs.stages[0].layers for p in x.parts)
    small = next(
        (x.name, p.part) for x in problem.costs.stages[0].layers for p in x.parts if p.decomp <= longest / PIECES
    )
    pieces = sorted(
        (p for p in plan.placements if p.op.kind is OpKind.DECOMP and (p.op.layer, p.op.part) == small),
        key=lambda p: p.op.piece or (0, 1),
    )
    assert len(pieces) == PIECES and len({p.device for p in pieces}) == 1
    for a, b in zip(pieces, pieces[1:]):
        assert abs(b.start - a.end) <= 1e-9  # back to back
