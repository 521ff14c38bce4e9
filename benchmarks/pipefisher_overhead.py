"""PipeFisher's step-time overhead over the plain pipeline, against naive K-FAC, 2 ranks, 1 thread each.

Four or five variants train the same model on the same mini-batches with the same schedule, side by side in
one run (rounds interleaved, so drift in machine load hits all alike):

(a) the plain pipeline with AdamW (``preconditioner=None``);
(b) PipeFisher: ``plan="auto"``, every rank profiles the split model and CP-SAT places curvature and
    inversion into the pipeline's bubbles;
(c) naive K-FAC: curvature and inversion every step, on the critical path
    (`fxkfac.planner.problem.lowering.naive_programs`, refresh period 1);
(d) K-FAC+skip: the naive programs, refreshing only every k steps, k = the period (b)'s plan chose
    for the layer;
(e) where (b)'s plan streams the first stage's APPLY to another rank (docs/STREAMED_APPLY.md): the plan of (b)'s
    profiled costs with every APPLY on its stage's rank (`PlanOptions(stream_apply=StreamApply.OFF)`), so b/e is what
    streaming saves;
(f) with ``--schedule zb-h1``: PipeFisher planned on 1F1B, so that K-FAC planned on ZB-H1 (b) stands beside plain
    ZB-H1 (a) and K-FAC planned on 1F1B (f), step times and refresh periods side by side.

The paper's claim (PipeFisher, Table 3: about 6.5% over the pipeline) is b/a <= 1.10 and b < d < c.
Each round times one block per variant, the fewest whole common refresh periods of that variant's own layers
that make at least --block steps (`block_steps`: (a) and (c) --block steps, (b) and (d) whole cycles of (b)'s
periods, (f) of its own), so variants with different periods need not share one long block; the step time
is the median over rounds of the block's mean (a refresh step and the steps between weigh as they do in training).
Utilization per rank is measured from the recorded timeline (time in F, B, STATS, DECOMP and APPLY over
the step span, waiting counts as idle) and printed beside the plan's prediction (its own timeline:
the op placements at their planned, profiled costs).

Model size: the embedded BERT-style MLM (`fxkfac.models`) on the stdlib corpus, by default hidden
128, FFN 512, 4 blocks, 64 tokens, micro-batches of 16 sequences (1024 rows per Linear). At that
size one CPU thread spends ~10 ms per stage F, curvature of one micro-batch costs about as much as
its F+B (the 512-wide FFN factors: rows x 512^2), and inverting a 513x513 factor ~10 ms, so K-FAC
work is ~1.5x the pipeline's compute per refresh, what the bubbles (1/(N+1) of the step at D=2)
must absorb over a few steps, while the per-step preconditioning (two d^3 products per layer) stays
a few percent of the step, as in the paper. Smaller widths make interpreter overhead dominate;
larger ones make a run take many minutes on 2 cores.

With ``--model gpt2`` the model is Hugging Face's GPT2LMHeadModel of the same sizes (from a config, no download)
trained as a causal LM on the same corpus (next byte). With ``--schedule chimera`` the two pipelines of D = 2 ranks
leave no bubble (planned utilization 1.00): every K-FAC op lies on the critical path and the plan stretches the step
to hold it, so the run measures what the planner does without a bubble, not PipeFisher's gain (D >= 4 ranks would
share the 2 cores here, which makes their timings meaningless).

Run: python benchmarks/pipefisher_overhead.py [--model bert] [--schedule 1f1b|gpipe|chimera|zb-h1] [--hidden 128]
[--ffn 512] [--rounds 5] [--block 10]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import fxkfac
from fxkfac.config import PROFILE_MARGIN, KFACConfig, PipelineOptions, PlanOptions
from fxkfac.data import Objective, lm_data, stdlib_corpus
from fxkfac.launch import free_port
from fxkfac.models import ByteGPT2Config, TinyBertConfig, TinyBertMLM, mlm_loss, next_byte_loss
from fxkfac.plan_view import planned_utilization, planned_view
from fxkfac.planner.problem import LayerTiming, OpKind
from fxkfac.planner.problem.step_timeline import step_timeline
from fxkfac.planner.search import StreamApply
from fxkfac.runtime.timeline import Event, as_timeline, utilization
from fxkfac.runtime.trainer import Trainer
from fxkfac.show import chrome_trace

__all__ = ["main"]

D = 2
NAMES = {
    "a": "pipeline + AdamW",
    "b": "PipeFisher (plan=auto)",
    "c": "naive K-FAC (every step)",
    "d": "K-FAC+skip (plan's period)",
    "e": "PipeFisher, APPLY not streamed",
    "f": "PipeFisher on 1F1B (plan=auto)",
}
BUSY = ("FWD", "BWD", "BWD_W", "STATS", "DECOMP", "APPLY")
WAIT = "WAIT"
"""The column of the time ops spend waiting for peers (`Event.wait_ns`)."""
KFAC = KFACConfig(damping=1e-3, factor_decay=0.95, kl_clip=1e-3)


def _optimizer(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def _model(args: argparse.Namespace) -> TinyBertMLM:
    torch.manual_seed(0)
    return TinyBertMLM(
        TinyBertConfig(hidden=args.hidden, ffn=args.ffn, layers=args.layers, heads=args.heads, max_len=args.seq)
    )


def _gpt2(args: argparse.Namespace) -> nn.Module:
    """The embedded byte-level GPT-2 (fxkfac.models.ByteGPT2Config) at the run's sizes."""
    torch.manual_seed(0)
    return ByteGPT2Config(
        hidden=args.hidden, heads=args.heads, ffn=args.ffn, layers=args.layers, max_len=args.seq
    ).build()


def _batches(args: argparse.Namespace, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The run's mini-batches: masked windows for BERT, next-byte windows for GPT-2."""
    objective = Objective.NEXT_BYTE if args.model == "gpt2" else Objective.MASKED
    data = lm_data(objective, stdlib_corpus()[0], seq_len=args.seq, seed=0)
    return [data.batch(args.batch) for _ in range(count)]


def _compile(
    args: argparse.Namespace,
    example: torch.Tensor,
    kfac: KFACConfig | None,
    plan: str | None,
    *,
    layer_timing: Mapping[str, LayerTiming] | None = None,
    plan_options: PlanOptions = PlanOptions(),
    schedule: str | None = None,
) -> Trainer:
    """One variant on the (D, 1) mesh, alike but for K-FAC and its plan (and `schedule`, None: the run's): eager
    stages, AdamW, timeline recorded."""
    model, loss_fn = (_gpt2(args), next_byte_loss) if args.model == "gpt2" else (_model(args), mlm_loss)
    return fxkfac.compile(
        model,
        (D, 1),
        plan,
        example_inputs=(example,),
        loss_fn=loss_fn,
        optimizer=_optimizer,
        preconditioner=kfac,
        schedule=schedule or args.schedule,
        microbatches=args.microbatches,
        backend=None,
        layer_timing=layer_timing,
        plan_options=plan_options,
        pipeline=PipelineOptions(record_timeline=True, timeout=600.0),
    )


def _build(args: argparse.Namespace, example: torch.Tensor) -> dict[str, Trainer]:
    """The four trainers (collective: every rank builds them in the same order)."""
    plain = _compile(args, example, None, None)
    options = PlanOptions(time_limit_s=args.time_limit, kfac_margin=args.kfac_margin, strategy=args.strategy)
    auto = _compile(args, example, KFAC, "auto", plan_options=options)
    every = {n: LayerTiming(1, 0, 0, KFAC.capture) for n in auto.plan.layers}
    skip = {n: LayerTiming(t.period, 0, 0, KFAC.capture) for n, t in auto.plan.layers.items()}
    naive = _compile(args, example, KFAC, None, layer_timing=every)
    skipping = _compile(args, example, KFAC, None, layer_timing=skip)
    trainers = {"a": plain, "b": auto, "c": naive, "d": skipping}
    if auto.plan.problem.streaming is not None:  # (e): (b)'s costs planned with every APPLY on its stage's rank
        own = PlanOptions(costs=auto.plan.problem.costs, time_limit_s=args.time_limit, stream_apply=StreamApply.OFF)
        trainers["e"] = _compile(args, example, KFAC, "auto", plan_options=own)
    if args.schedule == "zb-h1":  # (f): K-FAC planned on the schedule ZB-H1 replaces
        trainers["f"] = _compile(args, example, KFAC, "auto", plan_options=options, schedule="1f1b")
    return trainers


def block_steps(periods: list[int], least: int) -> int:
    """A variant's block: the fewest whole common refresh periods of its layers (`periods`) that make at least
    `least` steps, so every layer refreshes as often in the block as in training."""
    cycle = math.lcm(*periods)
    return cycle * math.ceil(least / cycle)


def _periods(trainer: Trainer) -> list[int]:
    """The distinct refresh periods of a variant's layers ([1] without a preconditioner)."""
    return sorted({t.period for t in trainer.timings.values()}) or [1]


def _block(trainer: Trainer, batches: list[tuple[torch.Tensor, torch.Tensor]], steps: int) -> float:
    """Mean seconds per step over `steps` steps, between two barriers."""
    dist.barrier()
    start = time.perf_counter()
    for i in range(steps):
        x, y = batches[(trainer.steps + i) % len(batches)]
        trainer.step(x, y)
    dist.barrier()
    return (time.perf_counter() - start) / steps


def timed_rounds(
    trainers: Mapping[str, Trainer],
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    blocks: Mapping[str, int],
    rounds: int,
    warmup: int,
) -> tuple[dict[str, list[float]], dict[str, list[Event]]]:
    """Warm each variant up for `warmup` of its blocks (`blocks`: steps per block), then time `rounds` interleaved
    rounds of one block each (seconds per step; drifting load hits every variant alike); with each variant's
    timeline of the timed steps, gathered from every rank."""
    for v, trainer in trainers.items():
        _block(trainer, batches, blocks[v] * warmup)
        trainer.timeline.clear()
    times: dict[str, list[float]] = {v: [] for v in trainers}
    for _ in range(rounds):
        for v, trainer in trainers.items():
            times[v].append(_block(trainer, batches, blocks[v]))
    return times, {v: _gather(t.timeline.events) for v, t in trainers.items()}


def init_worker(rank: int, port: int) -> None:
    """One rank of a benchmark: one thread, gloo over 127.0.0.1 with the other D - 1."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=D, timeout=timedelta(seconds=600)
    )


def _gather(events: list[Event]) -> list[Event]:
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, events)
    return [e for part in parts for e in part]


def _kind_seconds(events: list[Event], steps: int) -> dict[int, dict[str, float]]:
    """Per rank, seconds per step spent in each instruction kind besides waiting for peers, and (WAIT) waiting
    for peers in any of them (measured): a receive, a collective its reader settles, the step-end sum."""
    out: dict[int, dict[str, float]] = {}
    for e in events:
        row = out.setdefault(e.rank, {})
        row[e.kind] = row.get(e.kind, 0.0) + (e.end_ns - e.start_ns - e.wait_ns) / 1e9 / steps
        row[WAIT] = row.get(WAIT, 0.0) + e.wait_ns / 1e9 / steps
    return out


def _kind_cpu_seconds(events: list[Event], steps: int) -> dict[int, dict[str, float]]:
    """Per rank, the CPU seconds per step each instruction kind's thread took (`Event.cpu_ns`): the wall time
    without the share other processes took of the cores, which is what the profile measures (`profiler.clock`)."""
    out: dict[int, dict[str, float]] = {}
    for e in events:
        row = out.setdefault(e.rank, {})
        row[e.kind] = row.get(e.kind, 0.0) + e.cpu_ns / 1e9 / steps
    return out


def _planned(trainer: Trainer) -> dict[str, Any]:
    """The plan's prediction, per rank: its own timeline (`fxkfac.plan_view.planned_view`: F/B of the simulated
    step, every preconditioner op where the plan placed it, at the cost it planned) over its longest period, and
    the plain pipeline's step (`step_timeline` without APPLY)."""
    plan = trainer.plan
    view = planned_view(plan)
    plain = step_timeline(plan.problem, with_prec=False)
    kinds = [OpKind(x) for x in BUSY]
    timeline = view.timeline
    kind_s = {
        r: {
            kind.value: sum(iv.end - iv.start for iv in timeline.of_rank(r) if iv.op.kind is kind) / view.steps
            for kind in kinds
        }
        for r in timeline.ranks
    }
    plain_busy = {r: sum(b - a for op, a, b in plain.ops[r] if op.kind in kinds) for r in plain.ops}
    return {
        "utilization": planned_utilization(plan),
        "utilization_plain": {r: busy / plain.length for r, busy in plain_busy.items()},
        "step_s": view.end / view.steps,
        "plain_step_s": plain.length,
        "kind_s": kind_s,
        "metrics_utilization": plan.metrics.utilization,
        "refresh_steps": list(plan.metrics.refresh_steps),
        "solver": plan.metrics.solver.status,
    }


def _measure(
    args: argparse.Namespace,
    trainers: Mapping[str, Trainer],
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    blocks: Mapping[str, int],
) -> dict[str, Any]:
    """Warm up, then time interleaved rounds of each variant's block (`blocks`: steps); gather each variant's
    timeline of the timed steps."""
    times, events = timed_rounds(trainers, batches, blocks, args.rounds, args.warmup_blocks)
    return {
        "times": times,
        "events": events,
        "utilization": {v: utilization(events[v], BUSY) for v in ("a", "b")},
        "kind_s": {v: _kind_seconds(events[v], args.rounds * blocks[v]) for v in trainers},
        "kind_cpu_s": {v: _kind_cpu_seconds(events[v], args.rounds * blocks[v]) for v in trainers},
    }


def _worker(rank: int, args: argparse.Namespace, port: int, out_path: str) -> None:
    init_worker(rank, port)
    batches = _batches(args, 8)
    built = time.perf_counter()
    trainers = _build(args, batches[0][0])
    build_s = time.perf_counter() - built
    periods = {v: _periods(t) for v, t in trainers.items()}
    blocks = {v: block_steps(ps, args.block) for v, ps in periods.items()}
    load_before = os.getloadavg()[0]
    result = _measure(args, trainers, batches, blocks)
    if rank == 0:
        if args.save_plan:
            trainers["b"].plan.save(args.save_plan)
        if args.trace_dir:
            for v, events in result["events"].items():
                chrome_trace(as_timeline(events), os.path.join(args.trace_dir, f"pipefisher_overhead_{v}.json"))
        planned = _planned(trainers["b"])
        summary = {v: statistics.median(result["times"][v]) for v in trainers}
        streaming = trainers["b"].plan.problem.streaming
        row = {
            "step_s": summary,
            "rounds_s": result["times"],
            "ratio_to_a": {v: summary[v] / summary["a"] for v in trainers},
            "noise": {v: _noise(result["times"][v]) for v in trainers},
            "streaming": None if streaming is None else streaming.to_dict(),
            "utilization_measured": result["utilization"],
            "planned": planned,
            "kind_s": result["kind_s"],
            "kind_cpu_s": result["kind_cpu_s"],
            "block_steps": blocks,
            "build_s": build_s,
            "periods": sorted({p for v in ("b", "f") if v in periods for p in periods[v]}),
            "periods_by_variant": periods,
            "loadavg_1min": [load_before, os.getloadavg()[0]],
        }
        with open(out_path, "w") as f:
            json.dump(row, f)
    dist.destroy_process_group()


def spawn_and_report(
    worker: Callable[..., None], report: Callable[[dict[str, Any], argparse.Namespace], None], args: argparse.Namespace
) -> None:
    """Run ``worker(rank, args, port, out_path)`` on D local processes, then `report` the row rank 0 wrote."""
    port = free_port()
    out_path = os.path.join(tempfile.mkdtemp(), "row.json")
    mp.spawn(worker, args=(args, port, out_path), nprocs=D, join=True)
    with open(out_path) as f:
        report(json.load(f), args)


def _fmt_ranks(values: Mapping[Any, float]) -> str:
    return ", ".join(f"{values[k]:.2f}" for k in sorted(values, key=int))


def print_time_split(console: Any, row: dict[str, Any], kinds: tuple[str, ...]) -> None:
    """The table of where each variant's step time goes (ms per step and rank, `row["kind_s"]`) and the machine's
    load before/after timing (`row["loadavg"]`), as the per-family overhead benchmarks print them."""
    from rich.table import Table

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


def _noise(rounds: list[float]) -> float:
    """How far a variant's rounds spread: half of max - min, over their median."""
    return (max(rounds) - min(rounds)) / 2 / statistics.median(rounds)


def _report(row: dict[str, Any], args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=140)
    planned = row["planned"]
    model = "GPT-2 LM" if args.model == "gpt2" else "BERT-MLM"
    title = (
        f"PipeFisher overhead ({args.schedule}, D={D}, N={args.microbatches}, {model} h{args.hidden} "
        f"ffn{args.ffn} x{args.layers}, batch {args.batch}x{args.seq}, 1 thread/rank; refresh period "
        f"{row['periods']}, {args.rounds} rounds of each variant's block)"
    )
    table = Table(title=title)
    for col in (
        "variant",
        "s/step (median of rounds, ± half their spread)",
        "ratio to (a)",
        "refresh periods",
        "block (steps)",
        "utilization measured (r0, r1)",
        "utilization planned (r0, r1)",
    ):
        table.add_column(col)
    plan_util = {"a": planned["utilization_plain"], "b": planned["utilization"]}
    for v in row["step_s"]:
        measured = row["utilization_measured"].get(v)
        table.add_row(
            f"({v}) {NAMES[v]}",
            f"{row['step_s'][v]:.4f} ±{row['noise'][v]:.1%}",
            f"{row['ratio_to_a'][v]:.3f}",
            " ".join(map(str, row["periods_by_variant"][v])) if v != "a" else "-",
            str(row["block_steps"][v]),
            _fmt_ranks(measured) if measured else "-",
            _fmt_ranks(plan_util[v]) if v in plan_util else "-",
        )
    console.print(table)
    kinds = ("FWD", "BWD", "BWD_W", "STATS", "DECOMP", "APPLY", "OPT_STEP", "SYNC_STATS", "BCAST", WAIT)
    where = Table(
        title="where a step's time goes, ms per step and rank (measured wall time / its thread's CPU time, waits for "
        "peers in any op apart as WAIT; (b) planned in brackets)"
    )
    where.add_column("variant / rank")
    for k in kinds:
        where.add_column(k)
    for v in row["step_s"]:
        for r, secs in sorted(row["kind_s"][v].items(), key=lambda item: int(item[0])):
            plan = planned["kind_s"].get(r, planned["kind_s"].get(int(r), {})) if v == "b" else {}
            cpu = row["kind_cpu_s"][v][r]
            where.add_row(
                f"({v}) r{r}",
                *(
                    f"{secs.get(k, 0) * 1e3:.1f}"
                    + (f"/{cpu[k] * 1e3:.1f}" if k in cpu else "")
                    + (f" [{plan[k] * 1e3:.1f}]" if k in plan else "")
                    for k in kinds
                ),
            )
    console.print(where)
    b_a, b, c, d = row["ratio_to_a"]["b"], row["step_s"]["b"], row["step_s"]["c"], row["step_s"]["d"]
    console.print(
        f"machine load (1-min average) before/after timing: {row['loadavg_1min'][0]:.1f} / "
        f"{row['loadavg_1min'][1]:.1f} on {os.cpu_count()} cores",
        markup=False,
    )
    console.print(
        f"targets: b/a = {b_a:.3f} (rounds of a ±{row['noise']['a']:.1%}, of b ±{row['noise']['b']:.1%}) <= 1.10: "
        f"{b_a <= 1.10}; b < d < c: {b < d < c}; plan predicts "
        f"{planned['step_s'] / planned['plain_step_s']:.3f} ({planned['solver']})",
        markup=False,
    )
    if "f" in row["step_s"]:
        periods = row["periods_by_variant"]
        console.print(
            f"K-FAC on {args.schedule} (b) {row['step_s']['b']:.4f} s/step, refresh periods {periods['b']}; plain "
            f"{args.schedule} (a) {row['step_s']['a']:.4f}; K-FAC on 1F1B (f) {row['step_s']['f']:.4f}, refresh "
            f"periods {periods['f']}: f/b = {row['step_s']['f'] / row['step_s']['b']:.3f}",
            markup=False,
        )
    if "e" in row["step_s"]:
        streaming = row["streaming"]
        helpers = ", ".join(f"r{h}" for h in dict.fromkeys(streaming["helpers"]))
        console.print(
            f"streamed: {len(streaming['layers'])} layer(s) of stage {streaming['stage']} applied on {helpers}; "
            f"b/e = {row['step_s']['b'] / row['step_s']['e']:.3f} (rounds of e "
            f"±{row['noise']['e']:.1%}), e/a = {row['ratio_to_a']['e']:.3f}",
            markup=False,
        )
    print(json.dumps({"benchmark": "pipefisher_overhead", "args": vars(args), **row}))


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The schedule, the TinyBert model and the rounds both overhead benchmarks run (`_model`, `spawn_and_report`)."""
    parser.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b", "chimera", "zb-h1"))
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=64, help="global mini-batch (sequences)")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)


def main() -> None:
    """Spawn the two ranks, then print the table and the JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(parser)
    parser.add_argument(
        "--model",
        default="bert",
        choices=("bert", "gpt2"),
        help="the embedded BERT-style MLM, or Hugging Face GPT-2 as a causal LM",
    )
    parser.add_argument(
        "--block",
        type=int,
        default=10,
        help="steps per variant per round, rounded up to whole common refresh periods of the variant's layers",
    )
    parser.add_argument("--warmup-blocks", type=int, default=1)
    parser.add_argument("--time-limit", type=float, default=10.0, help="CP-SAT time limit (s)")
    parser.add_argument(
        "--kfac-margin",
        type=float,
        default=PROFILE_MARGIN,
        help="profiled K-FAC times are planned this much longer (PlanOptions.kfac_margin)",
    )
    parser.add_argument(
        "--strategy",
        default="auto",
        help="how (b)'s stage copies share each layer's work: auto (the planner chooses), comm-opt, "
        "mem-opt, hybrid:F (grad-worker fraction), dp-kfac",
    )
    parser.add_argument("--save-plan", default=None, help="write (b)'s plan JSON here")
    parser.add_argument(
        "--trace-dir", default=None, help="write each variant's measured Chrome trace here (made if missing)"
    )
    args = parser.parse_args()
    if args.trace_dir:  # made before the run, so a bad path fails now and not after minutes of timing
        os.makedirs(args.trace_dir, exist_ok=True)
    spawn_and_report(_worker, _report, args)


if __name__ == "__main__":
    main()
