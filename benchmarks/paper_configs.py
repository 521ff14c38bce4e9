"""The PipeFisher paper's configurations on its measured P100 profiles: utilization and refresh period, greedy vs CP-SAT.

Run: python benchmarks/paper_configs.py [--time-limit 10]

Costs are ../shared/data/pipefisher-profiles/*_p100.csv (per Transformer block, micro-batch 32,
3 blocks per stage). The paper's profiles include the embeddings and the heads (on the first and
last stages) and real P2P gaps; these CSVs are Transformer blocks only, so its figures are shown
beside ours for orientation, not as the same measurement. Prints a rich table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from fxkfac.planner.costs import CostTable, cost_table_from_pipefisher_csv
from fxkfac.planner.ir import OpKind
from fxkfac.planner.schedules import schedule_programs, stages_of_rank
from fxkfac.planner.simulate import Timeline, simulate

PROFILES = Path(__file__).resolve().parents[2] / "shared" / "data" / "pipefisher-profiles"


@dataclass(frozen=True)
class Config:
    model: str
    schedule: str
    D: int
    N: int
    micro_batch_size: int = 32
    blocks_per_stage: int = 3


CONFIGS = (
    Config("bert-base", "gpipe", 4, 4),
    Config("bert-base", "1f1b", 4, 4),
    Config("bert-base", "chimera", 4, 4),
    Config("bert-large", "1f1b", 8, 8),
    Config("bert-large", "chimera", 8, 8),
)

PAPER = {  # PipeFisher (Osawa et al. 2023): utilization before -> after, refresh period k in steps
    ("bert-base", "gpipe"): "~42%->89% k=1-2 (Fig.3)",
    ("bert-base", "1f1b"): "~42%->89% k=1-2 (Fig.3)",
    ("bert-base", "chimera"): "75.9%->93.2% k=5-10 (Fig.7)",
    ("bert-large", "1f1b"): "not reported",
    ("bert-large", "chimera"): "59.8%->97.6% k=2-4 (Fig.4)",
}


def costs_of(cfg: Config) -> CostTable:
    """The measured P100 cost table of the configuration."""
    path = PROFILES / f"{cfg.model}_time_memory_p100.csv"
    return cost_table_from_pipefisher_csv(
        path, blocks_per_stage=cfg.blocks_per_stage, n_stages=cfg.D, micro_batch_size=cfg.micro_batch_size
    )


def base_timeline(cfg: Config, costs: CostTable) -> Timeline:
    """One step of the plain pipeline (FWD/BWD only), simulated independently of the planner."""

    def duration(rank: int, op: Any) -> float:
        if op.kind is OpKind.FWD:
            return costs.stages[op.stage].fwd
        if op.kind is OpKind.BWD:
            return costs.stages[op.stage].bwd
        return 0.0

    return simulate(schedule_programs(cfg.schedule, cfg.D, cfg.N), duration)


def lower_bounds(cfg: Config, costs: CostTable, base: Timeline) -> list[int]:
    """Per device: ceil((curvature of the micro-batches it runs + its share of inversions) / bubble).

    A device runs curvature for the micro-batches of the (stage, pipe) copies it holds and shares
    each stage's inversions evenly with the other copies (Chimera: 2 copies of every stage, each
    running N/2 micro-batches); for GPipe/1F1B this is the paper's ceil((N T_curv + T_inv) / T_bubble).
    """
    held = {r: stages_of_rank(cfg.schedule, cfg.D, r) for r in base.ranks}
    copies = {s: sum(s == st for pairs in held.values() for st, _ in pairs) for s in range(cfg.D)}
    bounds = []
    for r in base.ranks:
        work = sum(
            cfg.N / copies[s] * costs.stages[s].curv + costs.stages[s].inv / copies[s] for s, _ in held[r]
        )
        bounds.append(max(1, math.ceil(work / base.bubble_time(r) - 1e-9)))
    return bounds


def measure(cfg: Config) -> dict[str, Any]:
    """The configuration's baseline numbers (planned numbers are added by `plan_results`)."""
    costs = costs_of(cfg)
    base = base_timeline(cfg, costs)
    prec = max(sum(costs.stages[s].prec for s, _ in stages_of_rank(cfg.schedule, cfg.D, r)) for r in base.ranks)
    return {
        "model": cfg.model,
        "schedule": cfg.schedule,
        "D": cfg.D,
        "N": cfg.N,
        "utilization_baseline": base.utilization(),
        "step_time_baseline_ms": base.step_time * 1e3,
        "prec_per_step_ms": prec * 1e3,
        "lower_bound_steps": lower_bounds(cfg, costs, base),
        "paper": PAPER[(cfg.model, cfg.schedule)],
    }


def render(results: list[dict[str, Any]], console: Console) -> None:
    table = Table(title="PipeFisher configurations on measured P100 block costs (micro-batch 32, 3 blocks/stage)")
    for col in ("config", "util before", "step (ms)", "+prec (ms)", "lower bound / device", "paper"):
        table.add_column(col)
    for r in results:
        table.add_row(
            f"{r['model']} {r['schedule']} D={r['D']} N={r['N']}",
            f"{r['utilization_baseline']:.1%}",
            f"{r['step_time_baseline_ms']:.1f}",
            f"{r['prec_per_step_ms']:.1f}",
            " ".join(map(str, r["lower_bound_steps"])),
            r["paper"],
        )
    console.print(table)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=10.0, help="CP-SAT time limit per configuration (s)")
    args = parser.parse_args(argv)
    results = [measure(cfg) for cfg in CONFIGS]
    render(results, Console())
    print(json.dumps({"benchmark": "paper_configs", "time_limit_s": args.time_limit, "results": results}))


if __name__ == "__main__":
    main()
