"""Shampoo's decompositions across a stage's data-parallel replicas: the CP-SAT plan against Distributed Shampoo's
own placement (Alg. 3, greedy largest-first) and against round-robin, from the analytic cost model (no torch).

For each preset, hardware and data-parallel size W (pipeline: --schedule, D stages, N micro-batches), on one
Shampoo cost table (`planner.problem.analytic.analytic_cost_table`, eigh roots, blocks of side --block) and with the
same refresh period per stage in every variant:

(a) round-robin   Shampoo on the critical path (`planner.problem.lowering.naive_programs`): at a refresh step each rank
                  decomposes its share of its stage's blocks after the gradient all-reduce, broadcasts them, then
                  applies; the stage's (layer, part) decompositions dealt to its W holders in turn;
(b) Alg. 3        the same programs with the decompositions dealt by Distributed Shampoo's Alg. 3 (largest
                  first, each to the least-loaded holder; `Assignment.LPT`): the paper's own placement (its
                  data-parallel setting has no pipeline, so no bubbles to use);
(c) CP-SAT        the plan (`planner.plan`): decompositions in the bubbles, each on the holder the solver
                  picks, at the least refresh period per stage it can prove or find within --time-limit.

The refresh period: by default the plan's own periods per stage, which (a) and (b) then use too; `--period F`
makes (a) and (b) refresh every F steps and lets the plan refresh every F steps or more often
(`Problem.max_period = F`; its periods are shown). Every variant also folds L and R and applies the
preconditioner at every step on the critical path (the statistics and APPLY are the same work in all three).

Per-step time: the programs simulated (`planner.problem.step_timeline`) with this script's own op durations
(`duration_of`: F/B, statistics, decompositions and APPLY from the cost table; the collectives the programs run, the
gradient all-reduce, BCAST of roots from their grad worker, SYNC_STATS and BCAST_PREC where a strategy has them, priced
by the table's alpha-beta comm model `CostTable.collective_seconds` over the ranks they name; point-to-point
transfers take no time, as in the planner) over a whole number of refresh periods, makespan / steps (every step
ends with a barrier, so this is the steady average; ops run as soon as they can, so a plan that stretches the step
runs faster here than its own `metrics.step_time`, shown beside it, which counts the stretch as idle time). The
timing is this script's, not the planner's (no validator or window): a cross-check of the plan; only the
`no-refresh` column is the planner's own step (`step_timeline`), for reference.
`coll/step`: the most collective seconds any rank's program holds per step. Balance: the largest
decomposition seconds any rank runs per refresh of its stage, Alg. 3's own metric, read off each variant's
programs; `bound` is the least any assignment can reach, max over stages of max(stage total / W, largest block).
No memory budget: Shampoo's parts keep nothing per micro-batch, so where a decomposition runs does not change the
peak (each configuration needs 4.4 GiB (bert-base) or 11.1 GiB (bert-large) per device at block 512).

Run: python benchmarks/shampoo_balance.py [--models bert-base bert-large] [--hardware a100 p100] [--dp 2 4]
     [--block 512 | auto] [--period F] [--time-limit 5]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from fxkfac.planner import CostTable, Distributions, PlanError, SearchOptions, StreamApply, TimeLimit
from fxkfac.planner import plan as plan_search
from fxkfac.planner.plan import Plan
from fxkfac.planner.problem import Capture, LayerTiming, Op, OpKind, PreconditionerKind, Problem, Program, SolverConfig
from fxkfac.planner.problem.ir import COLLECTIVE_KINDS
from fxkfac.planner.problem.lowering import Assignment, decomposition_seconds, naive_programs, ranks_of_stages
from fxkfac.planner.problem.step_timeline import simulate, step_timeline

__all__ = [
    "main",
    "duration_of",
    "per_step_seconds",
    "collective_seconds_per_step",
    "decomp_seconds_per_refresh",
    "critical_path_programs",
]

PARTS = ("L", "R")
"""Shampoo's parts of every parameter (a 1-D parameter's R decomposes nothing: 0 s in the table here)."""


def _stage(op: Op) -> int:
    """The stage `op` names; every op priced here names one."""
    if op.stage is None:
        raise ValueError(f"'{op}' names no stage, so its cost is unknown")
    return op.stage


def _compute_seconds(costs: CostTable) -> dict[OpKind, Callable[[Op], float]]:
    """Seconds of each computing op kind from the table: F/B and the stage-wide APPLY from its stage, a layer's
    APPLY from its layer, STATS and DECOMP (each piece its share) from their part (a part the table lacks, a 1-D
    parameter's R, takes 0 s)."""
    stages = costs.stages
    layers = {x.name: x for stage in stages for x in stage.layers}
    parts = {(x.name, p.part): p for x in layers.values() for p in x.parts}

    def stats(op: Op) -> float:
        part = parts.get((str(op.layer), str(op.part)))
        return 0.0 if part is None else part.stats

    def decomp(op: Op) -> float:
        part = parts.get((str(op.layer), str(op.part)))
        return 0.0 if part is None else part.decomp / (1 if op.piece is None else op.piece[1])

    def apply(op: Op) -> float:
        return stages[_stage(op)].prec if op.layer is None else layers[op.layer].prec

    return {
        OpKind.FWD: lambda op: stages[_stage(op)].fwd,
        OpKind.BWD: lambda op: stages[_stage(op)].bwd,
        OpKind.STATS: stats,
        OpKind.DECOMP: decomp,
        OpKind.APPLY: apply,
    }


def duration_of(problem: Problem) -> Callable[[int, Op], float]:
    """Op durations of `problem`'s programs: computing ops from its cost table (`_compute_seconds`), collectives
    (ALLREDUCE_GRAD, SYNC_STATS, BCAST, BCAST_PREC) by the table's comm model over the ranks they name, else every
    copy of their stage (`CostTable.collective_seconds`); transfers and OPT_STEP take none, as in the planner."""
    costs = problem.costs
    compute = _compute_seconds(costs)
    copies = ranks_of_stages(problem.schedule, problem.D, problem.W, problem.v)

    def duration(rank: int, op: Op) -> float:
        if op.kind in COLLECTIVE_KINDS:
            return costs.collective_seconds(op, len(op.group or copies[_stage(op)]))
        seconds = compute.get(op.kind)
        return 0.0 if seconds is None else seconds(op)

    return duration


def collective_seconds_per_step(programs: Mapping[int, Program], duration: Callable[[int, Op], float]) -> float:
    """The most collective seconds any rank's program runs per step (their own length: waiting not counted)."""
    return max(
        sum(duration(r, op) for step in prog for op in step if op.kind in COLLECTIVE_KINDS) / len(prog)
        for r, prog in programs.items()
    )


def per_step_seconds(programs: Mapping[int, Program], duration: Callable[[int, Op], float]) -> float:
    """The steady per-step time: the programs simulated over the lcm of their periods, makespan / steps."""
    steps = math.lcm(*(len(p) for p in programs.values()))
    return simulate(programs, duration, steps=steps).length / steps


def decomp_seconds_per_refresh(
    programs: Mapping[int, Program], duration: Callable[[int, Op], float], period: Mapping[int, int]
) -> dict[int, float]:
    """Per rank, the decomposition seconds it runs per refresh of its stage (`period[rank]` steps apart): the
    DECOMP seconds of its whole program, times the refreshes the program holds."""
    return {
        r: sum(duration(r, op) for step in prog for op in step if op.kind is OpKind.DECOMP) * period[r] / len(prog)
        for r, prog in programs.items()
    }


def critical_path_programs(problem: Problem, periods: Mapping[int, int], assignment: Assignment) -> dict[int, Program]:
    """Shampoo on the critical path (`naive_programs`) with stage s refreshing every `periods[s]` steps and its
    decompositions dealt by `assignment` (LPT by the table's decomposition seconds)."""
    costs = problem.costs
    stage_layers = {s: [x.name for x in stage.layers] for s, stage in enumerate(costs.stages)}
    timings = {
        name: LayerTiming(periods[s], 0, 0, Capture.DEFERRED) for s, names in stage_layers.items() for name in names
    }
    seconds = {**{(name, part): 0.0 for name in costs.layer_names for part in PARTS}, **decomposition_seconds(costs)}
    return naive_programs(
        problem.schedule,
        problem.D,
        problem.N,
        problem.W,
        timings,
        stage_layers,
        v=problem.v,
        parts=PARTS,
        gradient_parts=frozenset(PARTS),
        assignment=assignment,
        seconds=seconds,
    )


def _bound(problem: Problem) -> float:
    """The least largest per-rank decomposition seconds per refresh any assignment reaches: max over stages of
    max(the stage's decomposition seconds / its holders, its largest decomposition)."""
    holders = ranks_of_stages(problem.schedule, problem.D, problem.W, problem.v)
    out = 0.0
    for s, stage in enumerate(problem.costs.stages):
        decomps = [p.decomp for x in stage.layers for p in x.parts]
        out = max(out, sum(decomps) / len(holders[s]), max(decomps, default=0.0))
    return out


@dataclass(frozen=True)
class _Config:
    model: str
    hardware: str
    W: int


def _table(args: argparse.Namespace, config: _Config, block: int | None) -> CostTable:
    from fxkfac.planner.problem.analytic import analytic_cost_table

    return analytic_cost_table(
        config.model,
        args.stages,
        args.micro_batch_size,
        None,
        config.hardware,
        kind=PreconditionerKind.SHAMPOO,
        max_dim=block,
    )


def _problem(args: argparse.Namespace, config: _Config, costs: CostTable) -> Problem:
    extra = {} if args.period is None else {"max_period": args.period}
    return Problem(
        args.schedule, args.stages, args.microbatches, costs, W=config.W, max_overhead=args.max_overhead, **extra
    )


def _plan(args: argparse.Namespace, config: _Config, solver: SolverConfig) -> tuple[Plan, int | None]:
    """The CP-SAT plan and its block side (--block, or the one `choose_block_size` picks)."""
    search = SearchOptions(solver, strategy=Distributions.GIVEN, stream_apply=StreamApply.OFF)
    if args.block != "auto":
        block = int(args.block)
        return plan_search(_problem(args, config, _table(args, config, block)), search), block
    from fxkfac.planner.problem.analytic import largest_dim, preset
    from fxkfac.planner.search import block_candidates, choose_block_size

    choice = choose_block_size(
        lambda side: _problem(args, config, _table(args, config, side)),
        block_candidates(largest_dim(preset(config.model))),
        replace(search, time_limit=TimeLimit.EACH_SOLVE),  # each side the whole limit, as recorded
    )
    return choice.plan, choice.max_dim


def _row(args: argparse.Namespace, config: _Config, solver: SolverConfig) -> dict[str, Any]:
    """One configuration's numbers; where the planner refuses, its reason, and (a), (b) only with --period."""
    began = time.perf_counter()
    refusal = None
    try:
        plan, block = _plan(args, config, solver)
        problem = plan.problem
    except PlanError as e:
        if args.block == "auto":
            raise
        plan, block, refusal = None, int(args.block), str(e)
        problem = _problem(args, config, _table(args, config, block))
    costs = problem.costs
    duration = duration_of(problem)
    row: dict[str, Any] = {
        "model": config.model,
        "hardware": config.hardware,
        "W": config.W,
        "block": block,
        "units_per_stage": [len(s.layers) for s in costs.stages],
        "refused": refusal,
        "no_refresh_step_s": step_timeline(problem).length,
        "decomp_bound_s": _bound(problem),
    }
    variants: dict[str, Mapping[int, Program]] = {}
    refresh_of: dict[str, Mapping[int, int]] = {}
    if plan is not None:
        plan_periods = {s: plan.layers[stage.layers[0].name].period for s, stage in enumerate(costs.stages)}
        row.update(
            plan_periods=[plan_periods[s] for s in sorted(plan_periods)],
            solver=plan.metrics.solver.status,
            solver_s=plan.metrics.solver.wall_time,
            plan_step_s=plan.metrics.step_time,
            stretch_s=plan.metrics.stretch,
        )
        variants["cpsat"] = plan.programs
        refresh_of["cpsat"] = {r: len(prog) for r, prog in plan.programs.items()}
    if plan is not None or args.period is not None:
        periods = dict.fromkeys(range(len(costs.stages)), args.period) if args.period is not None else plan_periods
        holders = ranks_of_stages(problem.schedule, problem.D, problem.W, problem.v)
        period_of_rank = {r: periods[s] for s, ranks in holders.items() for r in ranks}
        row["periods"] = [periods[s] for s in sorted(periods)]
        for name, assignment in (("round_robin", Assignment.ROUND_ROBIN), ("alg3", Assignment.LPT)):
            variants[name] = critical_path_programs(problem, periods, assignment)
            refresh_of[name] = period_of_rank
    step = {v: per_step_seconds(progs, duration) for v, progs in variants.items()}
    load = {
        v: max(decomp_seconds_per_refresh(progs, duration, refresh_of[v]).values()) for v, progs in variants.items()
    }
    collectives = {v: collective_seconds_per_step(progs, duration) for v, progs in variants.items()}
    row.update(step_s=step, decomp_max_s=load, collective_s=collectives, wall_s=time.perf_counter() - began)
    if "alg3" in step:
        row.update(
            step_ratio_to_alg3={v: t / step["alg3"] for v, t in step.items()},
            decomp_ratio_to_alg3={v: x / load["alg3"] for v, x in load.items()},
        )
    return row


def _report(rows: Sequence[dict[str, Any]], args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=220)
    periods = (
        "the plan's periods (a, b use them)"
        if args.period is None
        else f"(a), (b) every {args.period} steps; (c) the plan's, <= {args.period}"
    )
    table = Table(
        title=f"Shampoo decompositions across replicas: {args.schedule} D={args.stages} "
        f"N={args.microbatches}, block {args.block}, micro-batch {args.micro_batch_size}, "
        f"max_overhead {args.max_overhead:g}, CP-SAT {args.time_limit:g} s; refresh: {periods}"
    )
    for col in (
        "model",
        "hw",
        "W",
        "block",
        "periods",
        "solver",
        "no-refresh ms",
        "(a) RR ms",
        "(b) Alg.3 ms",
        "(c) CP-SAT ms",
        "(c) plan's metric",
        "a/b",
        "c/b",
        "coll/step ms: (b)",
        "(c)",
        "max decomp/rank/refresh ms: (a)",
        "(b)",
        "(c)",
        "bound",
        "a/b",
        "c/b",
    ):
        table.add_column(col, justify="right" if col not in ("model", "hw", "solver") else "left")

    def ms(values: Mapping[str, float], v: str, digits: int) -> str:
        return f"{values[v] * 1e3:.{digits}f}" if v in values else "-"

    def ratio(r: Mapping[str, Any], key: str, v: str, digits: int) -> str:
        return f"{r[key][v]:.{digits}f}" if key in r and v in r[key] else "-"

    for r in rows:
        step, load = r["step_s"], r["decomp_max_s"]
        periods = " ".join(map(str, r.get("periods", [])))
        if args.period is not None and "plan_periods" in r:
            periods += f" (plan {' '.join(map(str, r['plan_periods']))})"
        table.add_row(
            r["model"],
            r["hardware"],
            str(r["W"]),
            str(r["block"]),
            periods or "-",
            r.get("solver", "refused"),
            f"{r['no_refresh_step_s'] * 1e3:.2f}",
            *(ms(step, v, 2) for v in ("round_robin", "alg3", "cpsat")),
            f"{r['plan_step_s'] * 1e3:.2f}" if "plan_step_s" in r else "-",
            ratio(r, "step_ratio_to_alg3", "round_robin", 4),
            ratio(r, "step_ratio_to_alg3", "cpsat", 4),
            *(ms(r["collective_s"], v, 2) for v in ("alg3", "cpsat")),
            *(ms(load, v, 1) for v in ("round_robin", "alg3", "cpsat")),
            f"{r['decomp_bound_s'] * 1e3:.1f}",
            ratio(r, "decomp_ratio_to_alg3", "round_robin", 3),
            ratio(r, "decomp_ratio_to_alg3", "cpsat", 3),
        )
    console.print(table)
    compared = [r for r in rows if "cpsat" in r["step_s"] and "alg3" in r["step_s"]]
    beats = sum(r["step_s"]["cpsat"] <= r["step_s"]["alg3"] * (1 + 1e-9) for r in compared)
    console.print(
        f"CP-SAT per-step time <= Alg. 3's in {beats} of {len(compared)} configurations compared", markup=False
    )
    if compared:
        console.print(
            "plan's own step-time metric vs its simulation: max |diff| "
            f"{max(abs(r['plan_step_s'] - r['step_s']['cpsat']) for r in compared) * 1e3:.3g} ms",
            markup=False,
        )
    for r in rows:
        if r["refused"]:
            console.print(f"{r['model']} {r['hardware']} W={r['W']}: the planner refused: {r['refused']}", markup=False)
    print(json.dumps({"benchmark": "shampoo_balance", "args": vars(args), "rows": list(rows)}))


def main(argv: Sequence[str] | None = None) -> None:
    """Plan and simulate every configuration, then print the table and one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["bert-base", "bert-large"])
    parser.add_argument("--hardware", nargs="+", default=["a100", "p100"])
    parser.add_argument("--dp", nargs="+", type=int, default=[2, 4], help="data-parallel sizes W")
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--stages", "-D", type=int, default=4)
    parser.add_argument("--microbatches", "-N", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=32)
    parser.add_argument(
        "--block",
        default="512",
        help="Shampoo's block side (max_preconditioner_dim), or 'auto': the planner's choice per "
        "configuration (slower: it solves each candidate side)",
    )
    parser.add_argument(
        "--period",
        type=int,
        default=None,
        help="refresh every F steps in (a), (b) and at most F in (c); default: the plan's periods",
    )
    parser.add_argument("--max-overhead", type=float, default=0.0)
    parser.add_argument("--time-limit", type=float, default=5.0, help="CP-SAT time limit (s) per plan")
    args = parser.parse_args(argv)
    if args.block != "auto" and not args.block.isdigit():
        parser.error(f"--block takes a positive int or 'auto', got {args.block!r}")
    solver = SolverConfig(time_limit_s=args.time_limit)
    rows = [_row(args, _Config(model, hw, W), solver) for model in args.models for hw in args.hardware for W in args.dp]
    _report(rows, args)


if __name__ == "__main__":
    main()
