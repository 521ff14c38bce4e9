"""`fxkfac plan --explain`: the performance model, the collectives and the block sides tried, with these numbers."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from rich.console import Console

from fxkfac.planner.problem import CostTable, OpKind, PreconditionerKind, Problem
from fxkfac.planner.problem.costs import WORDS

if TYPE_CHECKING:
    from fxkfac.planner.plan import Plan
    from fxkfac.planner.search import BlockChoice


def _stage_means(costs: CostTable) -> dict[str, float]:
    """Per-stage means of the table, as values of the performance model's symbols."""
    n = len(costs.stages)
    mean = lambda f: sum(f(s) for s in costs.stages) / n  # noqa: E731
    return {
        "T_f": mean(lambda s: s.fwd),
        "T_b": mean(lambda s: s.bwd),
        "T_curv": mean(lambda s: s.stats_after(OpKind.FWD, OpKind.BWD)),
        "T_gstat": mean(lambda s: s.stats_after(OpKind.ALLREDUCE_GRAD)),
        "T_inv": mean(lambda s: s.inv),
        "T_prec": mean(lambda s: s.prec),
        "M_theta": mean(lambda s: s.param_bytes),
        "M_act": mean(lambda s: s.act_bytes),
        "M_err_peak": mean(lambda s: s.peak_err_bytes),
        "M_curv": mean(lambda s: s.factor_bytes),
        "M_inv": mean(lambda s: s.factor_bytes),
        "M_err_save": mean(lambda s: s.deferred_bytes),
    }


_MUON_MODEL = (
    "Muon's work (no statistics, no refresh): T_ns, each stage's Newton-Schulz of its matrices at every step, after "
    "the stage's last backward and gradient all-reduce, before the optimizer step. It fits the stage's tail bubble "
    "where the slack allows (on 1F1B stage s has about s*(T_f + T_b) before its next forward); the rest is streamed "
    "to ranks idle at the step's end, or shared by the stage's copies (mem-opt)."
)


def _slowest_stage(costs: CostTable) -> dict[str, float]:
    """The slowest stage's forward and backward (the pace of a pipeline of unequal stages)."""
    slowest = max(costs.stages, key=lambda s: s.fwd + s.bwd)
    return {"T_f": slowest.fwd, "T_b": slowest.bwd}


def explain(args: argparse.Namespace, costs: CostTable, simulated: float, console: Console) -> None:
    """The performance model with these costs, and how its T_pipe relates to the simulated step time
    (`simulated`, the step time before preconditioning that the plan's summary shows); the simulated step alone for
    a zero-bubble schedule."""
    from fxkfac.planner.problem.analytic import evaluate, explain_perf_model, perf_model, pipe_gap
    from fxkfac.planner.problem.problem import format_bytes
    from fxkfac.planner.problem.schedules import ZERO_BUBBLE_KINDS

    if args.schedule in ZERO_BUBBLE_KINDS:
        console.print(
            f"{args.schedule}: the paper's performance model has no closed form for a zero-bubble schedule (its W's "
            f"fill the bubbles); the simulated step before preconditioning is {simulated * 1e3:.2f} ms",
            markup=False,
        )
        return
    muon = costs.family is PreconditionerKind.MUON
    model = perf_model(args.schedule)
    values = {"D": args.stages, "N": args.microbatches, "v": args.virtual_stages, **_stage_means(costs)}
    if muon:  # no refresh: the model's statistics, decompositions and refresh ratio are all zero
        console.print(_MUON_MODEL, markup=False, highlight=False)
    else:
        console.print(explain_perf_model(args.schedule, WORDS[costs.family]), markup=False, highlight=False)
    console.print(f"With these costs (stage means, {costs.source}):", markup=False)
    for name in ("T_pipe", "T_bubble") if muon else ("T_pipe", "T_bubble", "T_kfac"):
        console.print(f"  {name} = {evaluate(getattr(model, name), values) * 1e3:.2f} ms", markup=False)
    if muon:
        ns = [s.prec for s in costs.stages]
        console.print(f"  T_ns = {values['T_prec'] * 1e3:.2f} ms (stages {min(ns) * 1e3:.2f} to {max(ns) * 1e3:.2f})")
    for name in ("M_pipe",) if muon else ("M_pipe", "M_kfac"):
        console.print(f"  {name} = {format_bytes(evaluate(getattr(model, name), values))}", markup=False)
    if not muon:
        console.print(f"  ratio = {evaluate(model.ratio, values):.2f} steps per refresh", markup=False)
    slowest = evaluate(model.T_pipe, {**values, **_slowest_stage(costs)})
    console.print(pipe_gap(evaluate(model.T_pipe, values), slowest, simulated, WORDS[costs.family]), markup=False)


def explain_comm(problem: Problem, console: Console) -> None:
    """The cost table's comm model, and what each stage's collectives cost: the gradient all-reduce at every
    step, SYNC_STATS and BCAST at every refresh."""
    from fxkfac.planner.problem.hardware import describe
    from fxkfac.planner.problem.step_timeline import stage_comm

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
    from fxkfac.planner.problem.step_timeline import stage_comm

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


def explain_ns(plan: Plan, console: Console) -> None:
    """A Muon plan's Newton-Schulz tasks (planner/plan/plan.py): every APPLY with its rank, where it runs and
    when in the step, then the step time they add against Muon on the critical path; nothing for another family."""
    from fxkfac.planner.plan import ns_summary, ns_tasks

    if plan.problem.costs.family is not PreconditionerKind.MUON:
        return
    console.print("Newton-Schulz tasks of the step (ms from the step's start):", markup=False)
    for t in ns_tasks(plan):
        what = t.layers[0] if len(t.layers) == 1 else f"all {len(t.layers)} matrices"
        what += f" piece {t.piece[0]}/{t.piece[1]}" if t.piece is not None else ""
        sends = f", sends {t.transfer * 1e3:.2f} ms" if t.transfer else ""
        console.print(
            f"  s{t.stage} {what}: r{t.rank} {t.where.value}, {t.start * 1e3:.2f} -> {t.end * 1e3:.2f}{sends}",
            markup=False,
            highlight=False,
        )
    console.print(f"Newton-Schulz adds {ns_summary(plan)}", markup=False, highlight=False)


def explain_choice(choice: BlockChoice, console: Console) -> None:
    """Why the block side is what it is: every side tried, largest first, and what it came to."""
    console.print("Block sides tried (max_preconditioner_dim auto), largest first:", markup=False)
    for side, outcome in choice.tried:
        console.print(f"  {side}: {outcome}", markup=False)
