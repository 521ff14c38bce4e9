"""How far `plan="auto"`'s plans move between profiles of one model: the planned refresh periods of `--runs` runs.

Each run is a fresh launch of the demo's 2 local ranks (gloo, one thread each, as `fxkfac demo` launches them) that
calls `fxkfac.compile(..., plan="auto")`, so both ranks profile the stages (fxkfac/profiler.py) and rank 0 solves
with the same PlanOptions every time; only the profile differs. Five separate processes rather than five profiles in
one: a user's runs each start cold, and a process that profiled before would profile warm.

``--model demo`` (the default) is `fxkfac demo`'s planning exactly: its TinyBert MLM, data, DemoConfig sizes
(2 stages 1F1B, 4 micro-batches of 32 sequences of 64 tokens), K-FAC settings and PlanOptions (time limit 10 s,
max_overhead None). So one run answers issue 15 ("five profiles of the same model give planned refresh periods
that differ by at most one step") and issue 14 ("the spread of the planned refresh periods over 5 runs of
`fxkfac demo`'s planning"). ``--model gpt2`` plans examples/plan_factory.py's tiny GPT-2 (2 blocks, hidden 64)
on `--gpt2-batch` sequences of 32 tokens with the same options.

Printed: the planned refresh period of each stage in each run and their spread (max - min), the max_overhead
each plan needed, and the profiled stage times behind them (each the fastest of its repeats, with the slowest,
on `fxkfac.profiler.clock()`: the CPU time of the rank's one thread); then one JSON line. The load average
(`uptime`) is recorded before and after each run: on a shared machine the profiles, and so the plans, move with
the load.

Run: python benchmarks/profile_spread.py [--runs 5] [--model demo|gpt2] [--time-limit 10]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time
from pathlib import Path
from typing import Any

from fxkfac.demo import DEMO_KFAC, DemoConfig
from fxkfac.launch import RankContext, launch
from fxkfac.planner.plan import Plan
from fxkfac.planner.problem import StageCost
from fxkfac.planner.validate import parse_plan

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
GPT2_SEQ = 32


def _demo_model(cfg: DemoConfig) -> tuple[Any, Any]:
    """`fxkfac demo`'s model and first training batch (as its ranks build them for the PipeFisher run)."""
    import torch

    from fxkfac.data import MaskedLMData, stdlib_corpus
    from fxkfac.models import TinyBertMLM

    train, _ = stdlib_corpus(cfg.corpus_bytes)
    data = MaskedLMData(train, seq_len=cfg.seq_len, seed=cfg.seed)
    torch.manual_seed(cfg.seed)
    model = TinyBertMLM(cfg.model)
    return model, data.batch(cfg.batch_size)[0]


def _gpt2_model(batch: int) -> tuple[Any, Any]:
    """examples/plan_factory.py's tiny GPT-2 with `batch` random sequences of `GPT2_SEQ` tokens."""
    import torch

    spec = importlib.util.spec_from_file_location("plan_factory", EXAMPLES / "plan_factory.py")
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"{EXAMPLES / 'plan_factory.py'} is missing")
    factory = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(factory)
    torch.manual_seed(0)
    model, _ = factory.gpt2()
    return model, torch.randint(0, model.config.vocab_size, (batch, GPT2_SEQ))


def _unused_loss(output: Any, target: Any) -> Any:
    raise AssertionError("planning does not train: the loss is never called")


def _plan_once(ctx: RankContext, model_name: str, gpt2_batch: int, time_limit: float) -> tuple[str, float] | None:
    """Compile with plan="auto" as `fxkfac demo` does; rank 0 returns the plan's JSON and the compile's seconds."""
    import fxkfac
    from fxkfac.config import PipelineOptions, PlanOptions

    cfg = DemoConfig()
    model, inputs = _demo_model(cfg) if model_name == "demo" else _gpt2_model(gpt2_batch)
    began = time.perf_counter()
    trainer = fxkfac.compile(
        model,
        (cfg.stages, cfg.dp),
        "auto",
        example_inputs=(inputs,),
        loss_fn=_unused_loss,
        preconditioner=DEMO_KFAC,
        schedule=cfg.schedule,
        microbatches=cfg.microbatches,
        backend=None,
        pipeline=PipelineOptions(timeout=cfg.timeout_s),
        plan_options=PlanOptions(time_limit_s=time_limit, max_overhead=cfg.plan_max_overhead),
    )
    seconds = time.perf_counter() - began
    if ctx.rank != 0 or trainer.plan is None:
        return None
    return trainer.plan.to_json(indent=None), seconds


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def _stage_row(stage: StageCost) -> dict[str, Any]:
    """A profiled stage's times in seconds, as the JSON line carries them."""

    def ends(spread: Any) -> list[float] | None:
        return None if spread is None else [spread.low, spread.high]

    return {
        "fwd": stage.fwd,
        "fwd_spread": ends(stage.fwd_spread),
        "bwd": stage.bwd,
        "bwd_spread": ends(stage.bwd_spread),
        "curv": stage.curv,
        "inv": stage.inv,
        "prec": stage.prec,
    }


def _run_row(plan: Plan, seconds: float) -> dict[str, Any]:
    """What one run planned, and from which profile (K-FAC times as planned: times the margin)."""
    m = plan.metrics
    return {
        "refresh_steps": list(m.refresh_steps),
        "max_overhead": plan.problem.max_overhead,
        "step_time": m.step_time,
        "step_time_baseline": m.step_time_baseline,
        "solver": m.solver.status,
        "compile_s": seconds,
        "stages": [_stage_row(s) for s in plan.problem.costs.stages],
    }


def _report(rows: list[dict[str, Any]], args: argparse.Namespace, uptime: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=150)
    n_stages = len(rows[0]["refresh_steps"])
    spread = [
        max(r["refresh_steps"][s] for r in rows) - min(r["refresh_steps"][s] for r in rows) for s in range(n_stages)
    ]
    plans = Table(
        title=f"plan='auto' of {args.model!r}, {args.runs} runs (a fresh launch and profile each): "
        "planned refresh period per stage"
    )
    for col in [
        "run",
        *(f"stage {s} period" for s in range(n_stages)),
        "max_overhead",
        "step ms (plain)",
        "solver",
        "compile s",
    ]:
        plans.add_column(col)
    for i, r in enumerate(rows):
        plans.add_row(
            str(i),
            *map(str, r["refresh_steps"]),
            f"{r['max_overhead']:.4g}",
            f"{_ms(r['step_time'])} ({_ms(r['step_time_baseline'])})",
            r["solver"],
            f"{r['compile_s']:.1f}",
        )
    plans.add_row("spread (max-min)", *map(str, spread), "", "", "", "", style="bold")
    console.print(plans)
    times = Table(
        title="profiled stage times, ms: the fastest repeat (planned with) \\[fastest-slowest]; K-FAC "
        "times as planned (x margin)"
    )
    for col in ["run", *(f"stage {s} {what}" for s in range(n_stages) for what in ("fwd", "bwd", "curv/inv/prec"))]:
        times.add_column(col)
    for i, r in enumerate(rows):
        cells = []
        for st in r["stages"]:
            for key in ("fwd", "bwd"):
                ends = st[f"{key}_spread"]
                cells.append(_ms(st[key]) + ("" if ends is None else f" [{_ms(ends[0])}-{_ms(ends[1])}]"))
            cells.append(f"{_ms(st['curv'])}/{_ms(st['inv'])}/{_ms(st['prec'])}")
        times.add_row(str(i), *cells)
    console.print(times)
    within = max(spread) <= 1
    console.print(
        f"largest spread of a stage's planned period: {max(spread)} step(s): "
        f"{'within' if within else 'NOT within'} one step",
        markup=False,
    )
    console.print(f"uptime before/after: {uptime[0]} / {uptime[-1]} ({os.cpu_count()} cores)", markup=False)
    print(
        json.dumps(
            {
                "benchmark": "profile_spread",
                "args": vars(args),
                "uptime": uptime,
                "cores": os.cpu_count(),
                "runs": rows,
                "period_spread": spread,
                "within_one_step": within,
            }
        )
    )


def _uptime() -> str:
    return os.popen("uptime").read().strip()


def main() -> None:
    """Launch `--runs` plannings one after another, then print the tables and the JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--model", choices=("demo", "gpt2"), default="demo")
    parser.add_argument("--gpt2-batch", type=int, default=16, help="GPT-2 sequences per step (4 micro-batches)")
    parser.add_argument(
        "--time-limit",
        type=float,
        default=DemoConfig().plan_time_limit_s,
        help="PlanOptions.time_limit_s (the demo's by default)",
    )
    args = parser.parse_args()
    cfg = DemoConfig()
    uptime = [_uptime()]
    rows = []
    for i in range(args.runs):
        made = launch(_plan_once, cfg.world, args.model, args.gpt2_batch, args.time_limit, timeout=cfg.timeout_s)[0]
        if made is None:
            raise AssertionError("rank 0 made no plan")
        rows.append(_run_row(parse_plan(made[0]), made[1]))
        uptime.append(_uptime())
        print(f"run {i}: refresh periods {rows[-1]['refresh_steps']} ({uptime[-1]})", flush=True)
    _report(rows, args, uptime)


if __name__ == "__main__":
    main()
