"""`fxkfac plan --explain`: the performance model, the collectives and the block sides tried, with these numbers."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from rich.console import Console

from fxkfac.planner.costs import CostTable, StageCost
from fxkfac.planner.ir import OpKind
from fxkfac.planner.preconditioners import WORDS, kind_of
from fxkfac.planner.problem import Problem

if TYPE_CHECKING:
    from fxkfac.planner.block_size import BlockChoice
    from fxkfac.planner.plan import Plan


def _stage_means(costs: CostTable) -> dict[str, float]:
    """Per-stage means of the table, as values of the performance model's symbols."""
    n = len(costs.stages)
    mean = lambda f: sum(f(s) for s in costs.stages) / n  # noqa: E731

    def stats(stage: StageCost, from_gradient: bool) -> float:
        gradient = OpKind.ALLREDUCE_GRAD
        return sum(p.stats for x in stage.layers for p in x.parts if (p.after is gradient) == from_gradient)

    return {
        "T_f": mean(lambda s: s.fwd),
        "T_b": mean(lambda s: s.bwd),
        "T_curv": mean(lambda s: stats(s, False)),
        "T_gstat": mean(lambda s: stats(s, True)),
        "T_inv": mean(lambda s: s.inv),
        "T_prec": mean(lambda s: s.prec),
        "M_theta": mean(lambda s: s.param_bytes),
        "M_act": mean(lambda s: s.act_bytes),
        "M_err_peak": mean(lambda s: s.peak_err_bytes),
        "M_curv": mean(lambda s: s.factor_bytes),
        "M_inv": mean(lambda s: s.factor_bytes),
        "M_err_save": mean(lambda s: s.deferred_bytes),
    }


def _slowest_stage(costs: CostTable) -> dict[str, float]:
    """The slowest stage's forward and backward (the pace of a pipeline of unequal stages)."""
    slowest = max(costs.stages, key=lambda s: s.fwd + s.bwd)
    return {"T_f": slowest.fwd, "T_b": slowest.bwd}


def explain(args: argparse.Namespace, costs: CostTable, simulated: float, console: Console) -> None:
    """The performance model with these costs, and how its T_pipe relates to the simulated step time
    (`simulated`, the step time before preconditioning that the plan's summary shows); the simulated step alone for
    a zero-bubble schedule."""
    from fxkfac.planner.perf_model import evaluate, perf_model, pipe_gap
    from fxkfac.planner.perf_model import explain as model_text
    from fxkfac.planner.problem import format_bytes
    from fxkfac.planner.schedules import ZERO_BUBBLE_KINDS

    if args.schedule in ZERO_BUBBLE_KINDS:
        console.print(
            f"{args.schedule}: the paper's performance model has no closed form for a zero-bubble schedule (its W's "
            f"fill the bubbles); the simulated step before preconditioning is {simulated * 1e3:.2f} ms",
            markup=False,
        )
        return
    console.print(model_text(args.schedule, WORDS[kind_of(costs)]), markup=False, highlight=False)
    model = perf_model(args.schedule)
    values = {"D": args.stages, "N": args.microbatches, "v": args.virtual_stages, **_stage_means(costs)}
    console.print(f"With these costs (stage means, {costs.source}):", markup=False)
    for name in ("T_pipe", "T_bubble", "T_kfac"):
        console.print(f"  {name} = {evaluate(getattr(model, name), values) * 1e3:.2f} ms", markup=False)
    for name in ("M_pipe", "M_kfac"):
        console.print(f"  {name} = {format_bytes(evaluate(getattr(model, name), values))}", markup=False)
    console.print(f"  ratio = {evaluate(model.ratio, values):.2f} steps per refresh", markup=False)
    slowest = evaluate(model.T_pipe, {**values, **_slowest_stage(costs)})
    console.print(pipe_gap(evaluate(model.T_pipe, values), slowest, simulated, WORDS[kind_of(costs)]), markup=False)


def explain_comm(problem: Problem, console: Console) -> None:
    """The cost table's comm model, and what each stage's collectives cost: the gradient all-reduce at every
    step, SYNC_STATS and BCAST at every refresh."""
    from fxkfac.planner.comm import describe
    from fxkfac.planner.step_timeline import stage_comm

    for line in describe(problem.costs.comm):
        console.print(line, markup=False, highlight=False)
    console.print("Collectives per stage (over its copies):", markup=False)
    for s in range(problem.num_stages):
        c = stage_comm(problem, s)
        console.print(
            f"  s{s}: {c.group} ranks, gradient all-reduce {c.allreduce * 1e3:.3f} ms per step, "
            f"SYNC_STATS + BCAST {(c.sync + c.bcast) * 1e3:.3f} ms per refresh"
            + (f", preconditioned-gradient broadcasts {c.share * 1e3:.3f} ms per step" if c.share else ""),
            markup=False,
            highlight=False,
        )


def explain_plan_comm(plan: Plan, console: Console) -> None:
    """The plan's collective seconds per step: each stage's all-reduce plus its refresh collectives over its
    refresh period."""
    from fxkfac.planner.step_timeline import stage_comm

    problem = plan.problem
    per_stage = []
    for s in range(problem.num_stages):
        layers = problem.costs.stages[s].layers
        period = plan.layers[layers[0].name].period if layers else 1
        per_stage.append(stage_comm(problem, s).per_step(period))
    shown = "  ".join(f"s{s} {t * 1e3:.3f}" for s, t in enumerate(per_stage))
    console.print(
        f"Collectives of the plan per step (ms, at each stage's refresh period): {shown}; "
        f"{sum(per_stage) * 1e3:.3f} in all (priced as holding their ranks; at run time each runs in "
        "flight until the first op that reads its result)",
        markup=False,
        highlight=False,
    )


def explain_choice(choice: BlockChoice, console: Console) -> None:
    """Why the block side is what it is: every side tried, largest first, and what it came to."""
    console.print("Block sides tried (max_preconditioner_dim auto), largest first:", markup=False)
    for side, outcome in choice.tried:
        console.print(f"  {side}: {outcome}", markup=False)
