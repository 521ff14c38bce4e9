"""Shampoo's and SOAP's step time with their refreshes in the bubbles against the plain pipeline and against
the same refreshes on the critical path, 2 ranks, 1 thread each.

Variants train the same TinyBertMLM on the same mini-batches with the same schedule, side by side in one
launch (blocks of steps interleaved round by round, so drift in machine load hits all alike):

(plain)          the plain pipeline with AdamW (no preconditioner);
(F in bubbles)   family F (Shampoo, SOAP) with plan="auto": rank 0 profiles, CP-SAT places each refresh's
                 decompositions (Shampoo's inverse roots, SOAP's eigenbases) into the bubbles and chooses
                 the refresh period per stage, and streams stage 0's per-step work (statistics folds and APPLY)
                 to the other rank where that costs no refresh (docs/STREAMED_APPLY.md, "Stateful units");
(F unstreamed)   the same with PlanOptions(stream_apply=OFF): stage 0's per-step work on its own rank;
(F critical)     F with plan=None at the plan's own refresh period per parameter: every decomposition runs
                 in its refresh step before APPLY, on the critical path (`naive_programs`);
(F critical/f)   F with plan=None at its configured precondition_frequency (Shampoo as usually run).

Every variant also folds the statistics L, R of every parameter every step and preconditions every step
(APPLY): that per-step work is on the critical path in all of them but for what (F in bubbles) streams. The
step time is the median over rounds of a block's mean (a block is a whole number of the variant's refresh
periods, at least --block steps).
Target: (F in bubbles) / (plain) <= 1.05. Utilization per rank is measured from the recorded timeline
and, for the planned variants, predicted by the plan (its programs simulated with the profiled costs).
Helpers shared with benchmarks/pipefisher_overhead.py (block timing, timeline gathering, the plan's
prediction) are imported from it; the families' hyperparameters from benchmarks/preconditioner_convergence.py.

Run: python benchmarks/shampoo_overhead.py [--families Shampoo SOAP] [--hidden 128] [--ffn 512] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from pipefisher_overhead import (
    BUSY,
    D,
    _fmt_ranks,
    _kind_seconds,
    _model,
    _periods,
    _planned,
    add_run_arguments,
    block_steps,
    init_worker,
    print_time_split,
    spawn_and_report,
    timed_rounds,
)
from preconditioner_convergence import family_config

import fxkfac
from fxkfac.config import PipelineOptions, PlanOptions
from fxkfac.data import MaskedLMData, stdlib_corpus
from fxkfac.models import mlm_loss
from fxkfac.planner.problem import LayerTiming
from fxkfac.planner.search import StreamApply
from fxkfac.runtime.timeline import utilization
from fxkfac.runtime.trainer import Trainer

__all__ = ["main"]

FAMILIES = ("Shampoo", "SOAP")
TARGET = 1.05


def _compile(
    args: argparse.Namespace,
    example: torch.Tensor,
    cfg: Any,
    plan: str | None,
    layer_timing: dict[str, LayerTiming] | None = None,
    stream_apply: StreamApply = StreamApply.KEEP_REFRESH,
) -> Trainer:
    """One variant on the (D, 1) mesh: eager stages, timeline recorded; the family's base optimizer (plain SGD for
    Shampoo/SOAP, which make the whole direction), AdamW for the plain pipeline."""
    lr = 1e-3
    optimizer = (lambda ps: torch.optim.AdamW(ps, lr=lr)) if cfg is None else (lambda ps: torch.optim.SGD(ps, lr=lr))
    return fxkfac.compile(
        _model(args),
        (D, 1),
        plan,
        example_inputs=(example,),
        loss_fn=mlm_loss,
        optimizer=optimizer,
        preconditioner=cfg,
        schedule=args.schedule,
        microbatches=args.microbatches,
        backend=None,
        layer_timing=layer_timing,
        plan_options=PlanOptions(time_limit_s=args.time_limit, stream_apply=stream_apply),
        pipeline=PipelineOptions(record_timeline=True, timeout=600.0),
    )


class _CPUTimed:
    """A trainer whose steps' process CPU time on this rank (gloo's threads included) is recorded: on a loaded host
    the CPU a step costs each rank compares variants side by side where their wall time does not."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer, self.cpu = trainer, list[float]()

    def step(self, x: torch.Tensor, y: torch.Tensor) -> Any:
        start = time.process_time()
        out = self.trainer.step(x, y)
        self.cpu.append(time.process_time() - start)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.trainer, name)


def _cpu_per_step(timed: dict[str, _CPUTimed], steps: dict[str, int]) -> dict[str, list[float]]:
    """Each variant's CPU seconds per step per rank over its last `steps` (the timed rounds), gathered on every rank."""
    mine = {v: statistics.fmean(t.cpu[-steps[v] :]) for v, t in timed.items()}
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return {v: [part[v] for part in parts] for v in timed}


def _build(args: argparse.Namespace, example: torch.Tensor) -> dict[str, Trainer]:
    """Every variant's trainer (collective: every rank builds them in the same order)."""
    trainers = {"plain": _compile(args, example, None, None)}
    for family in args.families:
        cfg = family_config(family)
        auto = _compile(args, example, cfg, "auto")
        at_plan = {n: LayerTiming(t.period, 0, 0, t.capture) for n, t in auto.plan.layers.items()}
        trainers[f"{family} in bubbles"] = auto
        trainers[f"{family} unstreamed"] = _compile(args, example, cfg, "auto", stream_apply=StreamApply.OFF)
        trainers[f"{family} critical"] = _compile(args, example, cfg, None, at_plan)
        trainers[f"{family} critical/f"] = _compile(args, example, cfg, None)
    return trainers


def _worker(rank: int, args: argparse.Namespace, port: int, out_path: str) -> None:
    init_worker(rank, port)
    data = MaskedLMData(stdlib_corpus()[0], seq_len=args.seq, seed=0)
    batches = [data.batch(args.batch) for _ in range(8)]
    built = time.perf_counter()
    trainers = _build(args, batches[0][0])
    build_s = time.perf_counter() - built
    periods = {v: _periods(t) for v, t in trainers.items()}
    blocks = {v: block_steps(ps, args.block) for v, ps in periods.items()}
    load_before = os.getloadavg()
    timed = {v: _CPUTimed(t) for v, t in trainers.items()}
    times, events = timed_rounds(timed, batches, blocks, args.rounds, args.warmup_blocks)  # type: ignore[arg-type]  # a Trainer's step, timed
    cpu = _cpu_per_step(timed, {v: args.rounds * b for v, b in blocks.items()})
    if rank == 0:
        step_s = {v: statistics.median(ts) for v, ts in times.items()}
        planned = {v: _planned(t) for v, t in trainers.items() if v.endswith(("in bubbles", "unstreamed"))}
        row = {
            "step_s": step_s,
            "rounds_s": times,
            "ratio_to_plain": {v: s / step_s["plain"] for v, s in step_s.items()},
            "cpu_s": cpu,
            "cpu_ratio_to_plain": {v: [c / p for c, p in zip(cs, cpu["plain"], strict=True)] for v, cs in cpu.items()},
            "utilization_measured": {v: utilization(e, BUSY) for v, e in events.items()},
            "kind_s": {v: _kind_seconds(e, args.rounds * blocks[v]) for v, e in events.items()},
            "planned": planned,
            "periods": periods,
            "block_steps": blocks,
            "build_s": build_s,
            "loadavg": [list(load_before), list(os.getloadavg())],
        }
        with open(out_path, "w") as f:
            json.dump(row, f)
    dist.destroy_process_group()


def _report(row: dict[str, Any], args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=150)
    title = (
        f"Shampoo/SOAP step time ({args.schedule}, D={D}, N={args.microbatches}, BERT-MLM h{args.hidden} "
        f"ffn{args.ffn} x{args.layers}, batch {args.batch}x{args.seq}, 1 thread/rank; {args.rounds} rounds "
        f"of >= {args.block} steps per variant)"
    )
    table = Table(title=title)
    for col in (
        "variant",
        "refresh period",
        "block",
        "s/step (median of rounds)",
        "ratio to plain",
        "utilization measured (r0, r1)",
        "planned (r0, r1)",
        "plan's step / plain",
        "CPU ms/step (r0, r1)",
        "CPU / plain (r0, r1)",
        "plan's busy / plain (r0, r1)",
    ):
        table.add_column(col)
    for v, s in row["step_s"].items():
        plan = row["planned"].get(v)
        table.add_row(
            v,
            " ".join(map(str, row["periods"][v])) if v != "plain" else "-",
            str(row["block_steps"][v]),
            f"{s:.4f}",
            f"{row['ratio_to_plain'][v]:.3f}",
            _fmt_ranks(row["utilization_measured"][v]),
            _fmt_ranks(plan["utilization"]) if plan else "-",
            f"{plan['step_s'] / plan['plain_step_s']:.3f}" if plan else "-",
            ", ".join(f"{1e3 * c:.1f}" for c in row["cpu_s"][v]),
            ", ".join(f"{c:.3f}" for c in row["cpu_ratio_to_plain"][v]),
            _fmt_ranks(_busy_ratio(plan)) if plan else "-",
        )
    console.print(table)
    kinds = ("FWD", "BWD", "STATS", "DECOMP", "APPLY", "OPT_STEP", "RECV_ACT", "RECV_GRAD", "BCAST")
    print_time_split(console, row, kinds)
    for family in args.families:
        r = row["ratio_to_plain"]
        b, c, u = r[f"{family} in bubbles"], r[f"{family} critical"], r[f"{family} unstreamed"]
        console.print(
            f"{family}: in bubbles / plain = {b:.3f} (target <= {TARGET}: {b <= TARGET}); unstreamed / plain = "
            f"{u:.3f}; critical path at the plan's period / plain = {c:.3f}; in bubbles < critical: {b < c}",
            markup=False,
        )
    print(json.dumps({"benchmark": "shampoo_overhead", "args": vars(args), **row}))


def _busy_ratio(plan: dict[str, Any]) -> dict[str, float]:
    """The plan's busy seconds per rank (utilization x step) over the plain pipeline's: what the CPU / plain column
    measures."""
    step, plain = plan["step_s"], plan["plain_step_s"]
    return {r: u * step / (plan["utilization_plain"][r] * plain) for r, u in plan["utilization"].items()}


def main() -> None:
    """Spawn the two ranks, then print the table and the JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    add_run_arguments(parser)
    parser.add_argument(
        "--block",
        type=int,
        default=10,
        help="steps per variant per round, rounded up to whole refresh periods of the variant",
    )
    parser.add_argument("--warmup-blocks", type=int, default=1)
    parser.add_argument("--time-limit", type=float, default=10.0, help="CP-SAT time limit (s)")
    spawn_and_report(_worker, _report, parser.parse_args())


if __name__ == "__main__":
    main()
