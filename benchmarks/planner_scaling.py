"""Planner wall time and optimality gap as the pipeline grows: 1F1B, D in {4, 8, 16, 32, 64}, N = D.

Run: python benchmarks/planner_scaling.py [--time-limit 60] [--depths 4 8 16 32 64]

Costs: the measured BERT-Large P100 block costs (the shipped profile paper:bert-large/p100,
micro-batch 32), 3 blocks per stage, so the model is 3*D blocks deep (the CSV's per-block costs
repeated: a BERT-Large-like model scaled in depth with the pipeline).
Per D: the paper's greedy rule and CP-SAT (planner.plan, every layer COMM-OPT, the given time limit, 2 workers),
CP-SAT's status, the gap of its refresh periods to the per-stage lower bounds, and the independent
validator's verdict on the CP-SAT plan. Targets: D=8 solved to optimality in under 10 s; D=64 a plan
the validator accepts within 60 s. Prints a rich table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from fxkfac.planner import Distributions, Method, PlanError, Problem, SearchOptions, SolverConfig, StreamApply
from fxkfac.planner import plan as plan_search
from fxkfac.planner.problem import load_cost_table
from fxkfac.planner.validate import validate

PROFILE = "paper:bert-large/p100"
BLOCKS_PER_STAGE = 3


def problem_of(D: int) -> Problem:
    """1F1B over D stages of 3 BERT-Large blocks, N = D micro-batches of 32."""
    costs = load_cost_table(PROFILE, blocks_per_stage=BLOCKS_PER_STAGE, n_stages=D, micro_batch_size=32)
    return Problem("1f1b", D, D, costs)


def _search(time_limit: float, method: Method) -> SearchOptions:
    """`solve` as it was: the problem's own distributions (every layer COMM-OPT), no streaming."""
    return SearchOptions(
        SolverConfig(time_limit_s=time_limit), method, Distributions.GIVEN, stream_apply=StreamApply.OFF
    )


def run(D: int, time_limit: float) -> dict[str, Any]:
    """Greedy and CP-SAT on depth D, with the validator's verdict and time on the CP-SAT plan."""
    problem = problem_of(D)
    out: dict[str, Any] = {"D": D, "N": D, "time_limit_s": time_limit}
    began = time.perf_counter()
    try:
        greedy = plan_search(problem, _search(time_limit, Method.GREEDY))
        out["greedy_wall_s"] = time.perf_counter() - began
        out["greedy_refresh_sum"] = sum(greedy.metrics.refresh_steps)
    except PlanError as e:
        out["greedy_error"] = str(e).splitlines()[0]
    began = time.perf_counter()
    try:
        made = plan_search(problem, _search(time_limit, Method.CPSAT))
    except PlanError as e:
        out["cpsat_error"] = str(e).splitlines()[0]
        return out
    out["cpsat_wall_s"] = time.perf_counter() - began
    m = made.metrics
    out.update(
        cpsat_status=m.solver.status,
        cpsat_refresh_sum=sum(m.refresh_steps),
        lower_bound_sum=sum(m.lower_bound_steps),
        gap=m.solver.gap,
        refresh_min_max=[min(m.refresh_steps), max(m.refresh_steps)],
        utilization=[m.utilization_baseline, m.utilization],
    )
    began = time.perf_counter()
    errors = validate(problem, made)
    out["validator_s"] = time.perf_counter() - began
    out["valid"] = not errors
    if errors:
        out["validator_first_error"] = errors[0]
    return out


def render(results: list[dict[str, Any]], console: Console) -> None:
    table = Table(title=f"Planner scaling: 1F1B, N = D, BERT-Large P100 blocks x{BLOCKS_PER_STAGE} per stage")
    for col in (
        "D",
        "greedy s",
        "greedy sum k",
        "CP-SAT s",
        "status",
        "sum k / bound",
        "gap",
        "k min-max",
        "util before -> after",
        "valid (validator s)",
    ):
        table.add_column(col)
    for r in results:
        if "cpsat_error" in r:
            table.add_row(
                str(r["D"]),
                f"{r.get('greedy_wall_s', 0):.2f}",
                str(r.get("greedy_refresh_sum", "-")),
                "no plan",
                r["cpsat_error"][:50],
                "",
                "",
                "",
                "",
                "",
            )
            continue
        before, after = r["utilization"]
        table.add_row(
            str(r["D"]),
            f"{r.get('greedy_wall_s', float('nan')):.2f}",
            str(r.get("greedy_refresh_sum", "-")),
            f"{r['cpsat_wall_s']:.1f}",
            r["cpsat_status"],
            f"{r['cpsat_refresh_sum']} / {r['lower_bound_sum']}",
            f"{r['gap']:.1%}",
            "-".join(map(str, r["refresh_min_max"])),
            f"{before:.1%} -> {after:.1%}",
            f"{'yes' if r['valid'] else 'NO'} ({r['validator_s']:.1f})",
        )
    console.print(table)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=60.0, help="solver time limit per depth (s)")
    parser.add_argument("--depths", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    args = parser.parse_args(argv)
    results = [run(D, args.time_limit) for D in args.depths]
    render(results, Console(width=160))
    targets = {r["D"]: r for r in results}
    verdict = {
        "D=8 optimal under 10 s": bool(
            8 in targets and targets[8].get("cpsat_status") == "OPTIMAL" and targets[8]["cpsat_wall_s"] < 10
        ),
        "D=64 valid within 60 s": bool(
            64 in targets and targets[64].get("valid") and targets[64]["cpsat_wall_s"] <= 60
        ),
    }
    Console(width=160).print(verdict)
    print(json.dumps({"benchmark": "planner_scaling", "results": results, "targets": verdict}))


if __name__ == "__main__":
    main()
