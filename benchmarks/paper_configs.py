"""The PipeFisher paper's configurations on its measured P100 profiles: utilization and refresh, greedy vs CP-SAT.

Run: python benchmarks/paper_configs.py [--time-limit 10] [--max-overhead 0] [--decomp-pieces 1] [--barrier world]
    [--layers block] [--stream-apply keep-refresh] [--strategy auto] [--costs 'paper:{model}/p100']
    [--configs all|paper|zero-bubble]

Besides the paper's configurations (GPipe, 1F1B, Chimera) the zero-bubble schedules ZB-H1 and ZB-V on the same
models (`ZERO_BUBBLE_CONFIGS`): a BWD is the input-gradient half of the profiled backward and its W the other
half, which the schedules defer into what would be bubbles, so less is left for K-FAC.

Costs are the profiles shipped as paper:<model>/p100 (planner/data/pipefisher_profiles/; per
Transformer block, micro-batch 32, 3 blocks per stage); --costs names other per-block profiles, {model} standing
for the configuration's model (e.g. 'gpu:{model}/h200', measured by benchmarks/gpu_check.py).
The paper's profiles include the embeddings and the heads (on the first and last stages) and real P2P gaps;
these CSVs are Transformer blocks only, so its figures are shown beside ours for orientation, not as the same
measurement. With --layers sublayer each block is its attention and its feed-forward, with --layers linear its
six Linears (the layers K-FAC preconditions: tasks as fine as the paper's code runs them), sharing the block's
measured costs by their shapes (`planner.problem.profiles.ProfileLayers`). Prints a rich table and one JSON line.

Per configuration: the plain pipeline (simulated here, independently of the planner), then
planner.plan (one search, one time limit) with the paper's greedy rule and with CP-SAT (each stage's copies sharing the
work as the planner chooses, as `fxkfac plan` does, unless --strategy forces one; no memory budget; the given
max_overhead; with --decomp-pieces n every inversion is n tasks of 1/n of its profiled time, the planner's
model of `KFACConfig.split_inverse`; with --barrier agreement-set a step ends with no world barrier, the plan
of `KFACConfig.kl_clip_scope` stage or stale). Checked and printed: CP-SAT reaches the planner's lower bound on every
stage, never refreshes less often than greedy, strictly more often somewhere; with max_overhead 0 the planned
step is the plain pipeline plus preconditioning (the reference K-FAC step).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

from fxkfac.cli_args import enum_option, strategy_arg
from fxkfac.cli_costs import stage_blocks
from fxkfac.planner import CostTable, Distributions, Method, PlanError, SearchOptions, TimeLimit
from fxkfac.planner import plan as plan_search
from fxkfac.planner.plan import Plan
from fxkfac.planner.problem import OpKind, Problem, ProfileLayers, SolverConfig, StepBarrier, Strategy, load_cost_table
from fxkfac.planner.problem.lowering import rank_programs
from fxkfac.planner.problem.schedules import ZERO_BUBBLE_KINDS, num_stages, stages_of_rank
from fxkfac.planner.problem.step_timeline import Timeline, simulate
from fxkfac.planner.search import StreamApply
from fxkfac.planner.search.choose import strategy_of


@dataclass(frozen=True)
class Config:
    model: str
    schedule: str
    D: int
    N: int
    micro_batch_size: int = 32
    blocks_per_stage: int = 3
    """Blocks per rank: a schedule of v stages per rank cuts them over its v stages (`stage_blocks`)."""
    v: int = 1


CONFIGS = (
    Config("bert-base", "gpipe", 4, 4),
    Config("bert-base", "1f1b", 4, 4),
    Config("bert-base", "chimera", 4, 4),
    Config("bert-large", "1f1b", 8, 8),
    Config("bert-large", "chimera", 8, 8),
)
"""The paper's configurations (also the planner's golden set, benchmarks/planner_golden.py)."""

ZERO_BUBBLE_CONFIGS = (
    Config("bert-base", "zb-h1", 4, 4),
    Config("bert-base", "zb-v", 4, 4, v=2),
    Config("bert-large", "zb-h1", 8, 8),
    Config("bert-large", "zb-v", 8, 8, v=2),
)
"""The same models on the zero-bubble schedules (issue 37): ZB-H1 at 1F1B's cut, ZB-V with each rank's 3 blocks
cut 2 + 1 over its two stages; the W takes half of each backward (the profiles do not split it)."""

SETS = {"paper": CONFIGS, "zero-bubble": ZERO_BUBBLE_CONFIGS, "all": CONFIGS + ZERO_BUBBLE_CONFIGS}
"""--configs: which configurations to plan."""

PAPER_COSTS = "paper:{model}/p100"
"""The block costs planned by default: the PipeFisher paper's P100 profiles ({model}: the configuration's)."""

PAPER = {  # PipeFisher (Osawa et al. 2023): utilization before -> after, refresh period k in steps
    ("bert-base", "gpipe"): "~42%->89% k=1-2 (Fig.3)",
    ("bert-base", "1f1b"): "~42%->89% k=1-2 (Fig.3)",
    ("bert-base", "chimera"): "75.9%->93.2% k=5-10 (Fig.7)",
    ("bert-large", "1f1b"): "not reported",
    ("bert-large", "chimera"): "59.8%->97.6% k=2-4 (Fig.4)",
    **{(c.model, c.schedule): "not in the paper" for c in ZERO_BUBBLE_CONFIGS},
}


def costs_of(cfg: Config, layers: ProfileLayers = ProfileLayers.BLOCK, costs: str = PAPER_COSTS) -> CostTable:
    """The measured cost table of the configuration from the per-block profile `costs` names (`{model}` the
    configuration's model; default the P100 profile shipped with fxkfac), one K-FAC layer per block, sublayer or
    Linear (`layers`)."""
    S = num_stages(cfg.schedule, cfg.D, cfg.v)
    return load_cost_table(
        costs.format(model=cfg.model),
        blocks_per_stage=stage_blocks(cfg.model, cfg.blocks_per_stage * cfg.D, cfg.D, S),
        micro_batch_size=cfg.micro_batch_size,
        layers=layers,
    )


def base_timeline(cfg: Config, costs: CostTable) -> Timeline:
    """One step of the plain pipeline (F/B timed, transfers instant; a zero-bubble schedule's BWD less its W, half
    the backward), simulated independently of the planner."""
    split = cfg.schedule in ZERO_BUBBLE_KINDS

    def duration(rank: int, op: Any) -> float:
        if op.kind is OpKind.FWD:
            return costs.stages[op.stage].fwd
        if op.kind is OpKind.BWD:
            return costs.stages[op.stage].bwd / (2 if split else 1)
        if op.kind is OpKind.BWD_W:
            return costs.stages[op.stage].bwd / 2
        return 0.0

    return simulate(rank_programs(cfg.schedule, cfg.D, cfg.N, 1, v=cfg.v), duration)


def lower_bounds(cfg: Config, costs: CostTable, base: Timeline) -> list[int]:
    """Per device: ceil((curvature of the micro-batches it runs + its share of inversions) / bubble).

    A device runs curvature for the micro-batches of the (stage, pipe) copies it holds and shares
    each stage's inversions evenly with the other copies (Chimera: 2 copies of every stage, each
    running N/2 micro-batches); for GPipe/1F1B this is the paper's ceil((N T_curv + T_inv) / T_bubble).
    """
    held = {r: stages_of_rank(cfg.schedule, cfg.D, r, v=cfg.v) for r in base.ranks}
    S = num_stages(cfg.schedule, cfg.D, cfg.v)
    copies = {s: sum(s == st for pairs in held.values() for st, _ in pairs) for s in range(S)}
    bounds = []
    for r in base.ranks:
        work = sum(cfg.N / copies[s] * costs.stages[s].curv + costs.stages[s].inv / copies[s] for s, _ in held[r])
        bounds.append(max(1, math.ceil(work / (base.length - base.busy(r)) - 1e-9)))
    return bounds


def baseline(cfg: Config, source: str = PAPER_COSTS) -> dict[str, Any]:
    """The configuration's plain-pipeline numbers on the block costs `source` names, simulated independently of
    the planner."""
    costs = costs_of(cfg, costs=source)
    base = base_timeline(cfg, costs)
    prec = max(
        sum(costs.stages[s].prec for s, _ in stages_of_rank(cfg.schedule, cfg.D, r, v=cfg.v)) for r in base.ranks
    )
    return {
        "model": cfg.model,
        "schedule": cfg.schedule,
        "D": cfg.D,
        "N": cfg.N,
        "v": cfg.v,
        "utilization_baseline": base.utilization(),
        "step_time_baseline_ms": base.length * 1e3,
        "prec_per_step_ms": prec * 1e3,
        "lower_bound_per_device": lower_bounds(cfg, costs, base),
        "paper": PAPER[(cfg.model, cfg.schedule)],
    }


def planned(
    cfg: Config,
    method: str,
    time_limit: float,
    max_overhead: float,
    pieces: int = 1,
    barrier: StepBarrier = StepBarrier.WORLD,
    stream: StreamApply = StreamApply.KEEP_REFRESH,
    layers: ProfileLayers = ProfileLayers.BLOCK,
    strategy: Strategy | None = None,
    source: str = PAPER_COSTS,
) -> dict[str, Any]:
    """One planner run on the block costs `source` names (the first stage's APPLY streamed as `stream` says; K-FAC
    layers per block, sublayer or Linear, `layers`; every layer under `strategy`, or, when None, the distributions
    the planner chooses as `fxkfac plan` does): its metrics, or the reason there is no plan."""
    costs = costs_of(cfg, layers, source)
    problem = Problem(
        cfg.schedule, cfg.D, cfg.N, costs, v=cfg.v, max_overhead=max_overhead, decomp_pieces=pieces, barrier=barrier
    )
    search = SearchOptions(
        solver=SolverConfig(time_limit_s=time_limit),
        method=Method(method),
        strategy=Distributions.CHOSEN if strategy is None else strategy,
        stream_apply=stream,
        whole_backward=False,  # eager stages, as the paper ran them
        time_limit=TimeLimit.EACH_SOLVE,  # each placement the whole limit, as the golden set recorded the table
    )
    try:
        plan = plan_search(problem, search)
    except PlanError as e:
        return {"method": method, "error": str(e).splitlines()[0]}
    return _metrics(method, plan)


def _metrics(method: str, plan: Plan) -> dict[str, Any]:
    m = plan.metrics
    return {
        "method": method,
        "strategy": strategy_of(plan),
        "utilization_before": m.utilization_baseline,
        "utilization_after": m.utilization,
        "refresh_steps": list(m.refresh_steps),
        "lower_bound_steps": list(m.lower_bound_steps),
        "step_time_baseline_ms": m.step_time_baseline * 1e3,
        "step_time_ms": m.step_time * 1e3,
        "step_time_reference_ms": m.step_time_reference * 1e3,
        "added_step_ms": (m.step_time - m.step_time_baseline) * 1e3,
        "status": m.solver.status,
        "wall_time_s": m.solver.wall_time,
        "streamed": None if plan.problem.streaming is None else plan.problem.streaming.to_dict(),
    }


def checks(results: list[dict[str, Any]], max_overhead: float) -> dict[str, Any]:
    """The targets: CP-SAT at the lower bound, never above greedy, strictly below it somewhere, and with
    max_overhead 0 a step of exactly the plain pipeline plus preconditioning."""
    at_bound, not_worse, better, step_ok = [], [], [], []
    for r in results:
        name = f"{r['model']} {r['schedule']}"
        g, c = r["greedy"], r["cpsat"]
        if "error" in c:
            at_bound.append((name, False))
            continue
        at_bound.append((name, c["refresh_steps"] == c["lower_bound_steps"]))
        if max_overhead == 0:
            step_ok.append((name, math.isclose(c["step_time_ms"], c["step_time_reference_ms"], rel_tol=1e-6)))
        if "error" not in g:
            not_worse.append((name, all(a <= b for a, b in zip(c["refresh_steps"], g["refresh_steps"]))))
            better.append((name, any(a < b for a, b in zip(c["refresh_steps"], g["refresh_steps"]))))
        else:
            better.append((name, True))  # a plan where greedy has none
    return {
        "cpsat_at_lower_bound": {n: ok for n, ok in at_bound},
        "cpsat_never_worse_than_greedy": all(ok for _, ok in not_worse),
        "cpsat_strictly_better_somewhere": any(ok for _, ok in better),
        "step_is_plain_plus_prec": {n: ok for n, ok in step_ok} if max_overhead == 0 else "n/a (max_overhead > 0)",
    }


def _steps(values: list[int]) -> str:
    return " ".join(map(str, values))


def render(
    results: list[dict[str, Any]],
    max_overhead: float,
    pieces: int,
    barrier: StepBarrier,
    layers: ProfileLayers,
    console: Console,
    source: str = PAPER_COSTS,
) -> None:
    table = Table(
        title=f"PipeFisher configurations on measured block costs {source} (micro-batch 32, 3 blocks/stage, "
        f"K-FAC layer: {layers.value}, max_overhead {max_overhead:g}, inversions in {pieces} piece(s), "
        f"step barrier {barrier})"
    )
    for col in (
        "config",
        "method",
        "strategy",
        "util before -> after",
        "refresh steps / stage",
        "lower bound / stage",
        "+step ms (%)",
        "streamed",
        "status, s",
        "paper",
    ):
        table.add_column(col)
    for r in results:
        config = f"{r['model']} {r['schedule']} D={r['D']} N={r['N']}" + (f" v={r['v']}" if r["v"] != 1 else "")
        for method in ("greedy", "cpsat"):
            m = r[method]
            if "error" in m:
                table.add_row(
                    config if method == "greedy" else "",
                    method,
                    "",
                    "no plan",
                    m["error"][:60],
                    "",
                    "",
                    "",
                    "",
                    r["paper"] if method == "greedy" else "",
                )
                continue
            streamed = m["streamed"]
            added = m["added_step_ms"]
            table.add_row(
                config if method == "greedy" else "",
                method,
                m["strategy"],
                f"{m['utilization_before']:.1%} -> {m['utilization_after']:.1%}",
                _steps(m["refresh_steps"]),
                _steps(m["lower_bound_steps"]),
                f"{added:.1f} ({added / m['step_time_baseline_ms']:.1%})",
                "-"
                if streamed is None
                else f"{len(streamed['layers'])} -> " + ",".join(f"r{h}" for h in dict.fromkeys(streamed["helpers"])),
                f"{m['status']}, {m['wall_time_s']:.1f}",
                r["paper"] if method == "greedy" else "",
            )
    console.print(table)


def plan_configs(
    configs: Sequence[Config] = CONFIGS,
    source: str = PAPER_COSTS,
    *,
    time_limit: float = 10.0,
    max_overhead: float = 0.0,
    pieces: int = 1,
    barrier: StepBarrier = StepBarrier.WORLD,
    stream: StreamApply = StreamApply.KEEP_REFRESH,
    layers: ProfileLayers = ProfileLayers.BLOCK,
    strategy: Strategy | None = None,
) -> list[dict[str, Any]]:
    """Each configuration's plain pipeline (`baseline`) and its greedy and CP-SAT plans (`planned`) on the block
    costs `source` names."""
    results = []
    for cfg in configs:
        row = baseline(cfg, source)
        for method in ("greedy", "cpsat"):
            row[method] = planned(
                cfg, method, time_limit, max_overhead, pieces, barrier, stream, layers, strategy, source
            )
        results.append(row)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=10.0, help="CP-SAT time limit per configuration (s)")
    parser.add_argument("--max-overhead", type=float, default=0.0, help="allowed step growth (fraction)")
    parser.add_argument("--decomp-pieces", type=int, default=1, help="tasks per inversion (KFACConfig.split_inverse)")
    enum_option(
        parser,
        "--barrier",
        StepBarrier.WORLD,
        "what a step's end waits for: world (KL-clip scope global), agreement-set (stage, stale)",
    )
    enum_option(
        parser,
        "--stream-apply",
        StreamApply.KEEP_REFRESH,
        "when the first stage's APPLY streams to idle ranks: keep-refresh (where it costs no refresh), "
        "shortest-step (wherever it shortens the step), off",
    )
    enum_option(
        parser,
        "--layers",
        ProfileLayers.BLOCK,
        "one K-FAC layer per Transformer block (the profiles' granularity), per sublayer (attention, feed-forward)"
        " or per Linear (K-FAC's)",
    )
    parser.add_argument(
        "--strategy",
        type=strategy_arg,
        default=None,
        help="how the copies of a stage (Chimera's two pipelines) share each layer's work: comm-opt, mem-opt, "
        "hybrid:F, dp-kfac, or auto (default: the planner chooses, as fxkfac plan does)",
    )
    parser.add_argument(
        "--costs",
        default=PAPER_COSTS,
        help="the per-block profile of each configuration, {model} its model: paper:{model}/<hw>, "
        "gpu:{model}/<device> or a profile file path (default %(default)s)",
    )
    parser.add_argument(
        "--configs",
        choices=sorted(SETS),
        default="all",
        help="the paper's configurations, the zero-bubble ones, or all (default)",
    )
    args = parser.parse_args(argv)
    results = plan_configs(
        SETS[args.configs],
        args.costs,
        time_limit=args.time_limit,
        max_overhead=args.max_overhead,
        pieces=args.decomp_pieces,
        barrier=args.barrier,
        stream=args.stream_apply,
        layers=args.layers,
        strategy=args.strategy,
    )
    render(results, args.max_overhead, args.decomp_pieces, args.barrier, args.layers, Console(width=200), args.costs)
    verdict = checks(results, args.max_overhead)
    Console(width=200).print(verdict)
    print(
        json.dumps(
            {
                "benchmark": "paper_configs",
                "costs": args.costs,
                "time_limit_s": args.time_limit,
                "max_overhead": args.max_overhead,
                "decomp_pieces": args.decomp_pieces,
                "barrier": str(args.barrier),
                "stream_apply": args.stream_apply,
                "layers": args.layers.value,
                "strategy": "auto" if args.strategy is None else str(args.strategy),
                "results": results,
                "checks": verdict,
            }
        )
    )


if __name__ == "__main__":
    main()
