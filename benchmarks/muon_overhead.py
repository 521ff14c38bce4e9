"""Muon's step time against the plain pipeline: its Newton-Schulz placed by the planner, or on the critical path,
2 ranks, 1 thread each.

Variants train the same TinyBertMLM on the same mini-batches with the same schedule, side by side in one launch (blocks
of steps interleaved round by round, so drift in machine load hits all alike):

(plain)          the plain pipeline with AdamW (no preconditioner);
(Muon planned)   fxkfac Muon with plan="auto": rank 0 profiles each unit's APPLY (momentum, Newton-Schulz), the
                 planner places it in the stage's own slack or streams it to an idle rank (in pieces where one is
                 longer than any bubble);
(Muon critical)  Muon with plan=None: each stage orthogonalizes its own matrices after its last backward and its
                 gradient all-reduce, before its optimizer step, as torch.optim.Muon in a pipeline would.

Embeddings, the output head and 1-D parameters step by AdamW in both Muon variants (fxkfac/muon/family.py). The step
time is the median over rounds of a block's mean. Targets (issue 35): planned / plain <= 1.05, and planned below
critical by at least half of Muon's added time (critical - plain). The planned variant needs the planner's Muon
costs (`PreconditionerKind.MUON`); `--variants plain critical` measures the other two without it.

Run: python benchmarks/muon_overhead.py [--variants plain planned critical] [--schedule 1f1b] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from pipefisher_overhead import (
    BUSY,
    D,
    _block,
    _fmt_ranks,
    _gather,
    _kind_seconds,
    _model,
    add_run_arguments,
    spawn_and_report,
)

import fxkfac
from fxkfac.config import PipelineOptions, PlanOptions
from fxkfac.data import MaskedLMData, stdlib_corpus
from fxkfac.models import mlm_loss
from fxkfac.muon import LrAdjust, MuonConfig
from fxkfac.runtime.timeline import utilization
from fxkfac.runtime.trainer import Trainer

__all__ = ["main"]

VARIANTS = {"plain": "plain", "planned": "Muon planned", "critical": "Muon critical"}
TARGET = 1.05
MUON = MuonConfig(adjust_lr_fn=LrAdjust.MATCH_RMS_ADAMW)
"""Moonlight's setting: Muon reuses AdamW's learning rate and weight decay."""
LR = 1e-3


def _compile(args: argparse.Namespace, example: torch.Tensor, variant: str) -> Trainer:
    """One variant on the (D, 1) mesh: eager stages, timeline recorded; AdamW for the plain pipeline, plain SGD (the
    base optimizer of a family that makes the whole direction) for Muon."""
    plain = variant == "plain"
    return fxkfac.compile(
        _model(args),
        (D, 1),
        "auto" if variant == "planned" else None,
        example_inputs=(example,),
        loss_fn=mlm_loss,
        optimizer=(lambda ps: torch.optim.AdamW(ps, lr=LR)) if plain else (lambda ps: torch.optim.SGD(ps, lr=LR)),
        preconditioner=None if plain else MUON,
        schedule=args.schedule,
        microbatches=args.microbatches,
        backend=None,
        plan_options=PlanOptions(time_limit_s=args.time_limit),
        pipeline=PipelineOptions(record_timeline=True, timeout=600.0),
    )


def _worker(rank: int, args: argparse.Namespace, port: int, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=D, timeout=timedelta(seconds=600)
    )
    data = MaskedLMData(stdlib_corpus()[0], seq_len=args.seq, seed=0)
    batches = [data.batch(args.batch) for _ in range(8)]
    built = time.perf_counter()
    trainers = {VARIANTS[v]: _compile(args, batches[0][0], v) for v in args.variants}
    build_s = time.perf_counter() - built
    load_before = os.getloadavg()
    for trainer in trainers.values():
        _block(trainer, batches, args.block * args.warmup_blocks)
        trainer.timeline.clear()
    times: dict[str, list[float]] = {v: [] for v in trainers}
    for _ in range(args.rounds):
        for v, trainer in trainers.items():
            times[v].append(_block(trainer, batches, args.block))
    events = {v: _gather(t.timeline.events) for v, t in trainers.items()}
    if rank == 0:
        step_s = {v: statistics.median(ts) for v, ts in times.items()}
        base = step_s.get("plain")
        row = {
            "step_s": step_s,
            "rounds_s": times,
            "ratio_to_plain": {v: s / base for v, s in step_s.items()} if base else {},
            "utilization_measured": {v: utilization(e, BUSY) for v, e in events.items()},
            "kind_s": {v: _kind_seconds(e, args.rounds * args.block) for v, e in events.items()},
            "build_s": build_s,
            "loadavg": [list(load_before), list(os.getloadavg())],
        }
        with open(out_path, "w") as f:
            json.dump(row, f)
    dist.destroy_process_group()


def _verdict(ratio: dict[str, float]) -> str | None:
    """The targets' check, when the three variants ran."""
    if not {"Muon planned", "Muon critical"} <= set(ratio):
        return None
    planned, critical = ratio["Muon planned"], ratio["Muon critical"]
    halved = planned <= 1.0 + (critical - 1.0) / 2
    return (
        f"Muon planned / plain = {planned:.3f} (target <= {TARGET}: {planned <= TARGET}); critical / plain = "
        f"{critical:.3f}; planned saves at least half of Muon's added time: {halved}"
    )


def _report(row: dict[str, Any], args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=150)
    title = (
        f"Muon step time ({args.schedule}, D={D}, N={args.microbatches}, BERT-MLM h{args.hidden} ffn{args.ffn} "
        f"x{args.layers}, batch {args.batch}x{args.seq}, 1 thread/rank; {args.rounds} rounds of {args.block} steps)"
    )
    table = Table(title=title)
    for col in ("variant", "s/step (median of rounds)", "ratio to plain", "utilization measured (r0, r1)"):
        table.add_column(col)
    for v, s in row["step_s"].items():
        ratio = row["ratio_to_plain"].get(v)
        table.add_row(
            v, f"{s:.4f}", "-" if ratio is None else f"{ratio:.3f}", _fmt_ranks(row["utilization_measured"][v])
        )
    console.print(table)
    kinds = ("FWD", "BWD", "APPLY", "OPT_STEP", "RECV_ACT", "RECV_GRAD", "SEND_LGRAD", "RECV_PGRAD", "WAIT")
    where = Table(title="where a step's time goes, ms per step and rank (measured)")
    where.add_column("variant / rank")
    for k in kinds:
        where.add_column(k)
    for v, per_rank in row["kind_s"].items():
        for r, secs in sorted(per_rank.items(), key=lambda item: int(item[0])):
            where.add_row(f"{v} r{r}", *(f"{secs.get(k, 0) * 1e3:.1f}" for k in kinds))
    console.print(where)
    (l1, _, _), (l2, _, _) = row["loadavg"]
    console.print(
        f"machine load (1-min average) before/after timing: {l1:.1f} / {l2:.1f} on {os.cpu_count()} cores "
        "(the benchmark itself keeps 2 busy)",
        markup=False,
    )
    verdict = _verdict(row["ratio_to_plain"])
    if verdict:
        console.print(verdict, markup=False)
    print(json.dumps({"benchmark": "muon_overhead", "args": vars(args), **row}))


def main() -> None:
    """Spawn the two ranks, then print the table and the JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    add_run_arguments(parser)
    parser.add_argument("--block", type=int, default=10, help="steps per variant per round")
    parser.add_argument("--warmup-blocks", type=int, default=1)
    parser.add_argument("--time-limit", type=float, default=10.0, help="CP-SAT time limit (s)")
    spawn_and_report(_worker, _report, parser.parse_args())


if __name__ == "__main__":
    main()
