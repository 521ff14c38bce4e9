"""Throughput of fxkfac's pipeline runtime vs torch.distributed.pipelining (GPipe, 1F1B, ZB-H1, ZB-V), 2 ranks,
1 thread each.

Both run the same stage GraphModules (fxkfac's split of the same captured model), the same
micro-batches and the same SGD step, side by side in one run (alternating rounds). Throughput is that of steps run
back to back between two barriers, as a training loop runs them (the ratio: torch's seconds per step over fxkfac's,
the median of the rounds' ratios, with their least and greatest); the step latency ratio is the same of each step
timed between barriers (from an empty pipeline, every rank's end waited for: it also charges what the last rank does
after the pipeline drains, which back-to-back steps overlap with the next step's start). fxkfac is timed without its
per-op recorder, as torch's side has none; one recorded pass of per-step-barrier steps after the rounds gives the
bubble columns. ZB-H1 runs against torch's
ScheduleInterleavedZeroBubble with one stage per rank (its order is ZB-H1's), ZB-V against ScheduleZBVZeroBubble;
torch's side runs eagerly (it refuses compiled stages for a split backward), fxkfac's eagerly and, with
--compiled, with every stage's forward, B and W compiled by inductor (its own column). Also prints
fxkfac's measured bubble fraction per rank (time outside F, B and W over the step's span) against the
schedule's: the planner's simulation of the same program with the measured mean op durations (F, B, W, sends,
the optimizer step; each message arriving the measured link latency after its send, `_latency`) and of each
measured step with its own durations (`_theory_per_step`), and the closed form
(D-1)/(N+D-1) (1F1B's F and B alone), and each schedule's throughput
against fxkfac's own 1F1B. The CPU columns are the CPU time of each rank's thread per step (median) and torch's
summed over ranks against fxkfac's: what each runtime costs, which the host's load barely moves (wall-clock
ratios on a loaded host mostly measure who was preempted). "descheduled" is the part of the step spans each rank
spent neither running nor waiting for its peer in the transport (preempted by other processes, or blocked inside
gloo's send; `timeline.descheduled`): on a loaded host the measured bubble exceeds the simulated one by about
that much. The tail columns (`_tail`, from the recorded pass) are where fxkfac's step differs from torch's: from
the last F/B/W to the step's end (the NaN/Inf verdict and the step-end sum before the update), OPT_STEP's CPU, and
the time between the first F and the first B (the last stage's receives posted there, on the critical path).

Run: python benchmarks/pipeline_vs_torch.py [--width 512] [--depth 8] [--batch 128] [--microbatches 4]
    [--step-agreement world|copies] [--schedules gpipe,1f1b,zb-h1,zb-v] [--compiled]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import fxkfac
from fxkfac.config import PipelineOptions, StepAgreement
from fxkfac.launch import free_port
from fxkfac.planner.problem import Op, OpKind
from fxkfac.planner.problem.lowering import rank_programs
from fxkfac.planner.problem.step_timeline import simulate
from fxkfac.runtime.timeline import descheduled, utilization
from fxkfac.runtime.trainer import Trainer

D = 2
BUSY = ("FWD", "BWD", "BWD_W")  # OPT_STEP holds the world sum of the NaN/Inf flag: it waits for the peer


def make_model(width: int, depth: int, classes: int = 10) -> nn.Module:
    """A deep MLP: `depth` blocks of Linear + GELU, then a classifier."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)]
    return nn.Sequential(*blocks, nn.Linear(width, classes))


class _Unwrap(nn.Module):
    """A stage GraphModule returning a single tensor instead of a 1-tuple (torch pipelining passes tensors)."""

    def __init__(self, gm: nn.Module) -> None:
        super().__init__()
        self.gm = gm

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        out = self.gm(*args)
        return out[0] if len(out) == 1 else out


def _torch_runner(trainer: Trainer, schedule: str, N: int):
    """torch's schedule over the stages this rank holds in fxkfac's run (ZB-V: stage r and 2D-1-r)."""
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
    )

    held = sorted(s for s, _ in trainer.runners)
    stages = trainer.spec.split.stages
    modules = [_Unwrap(copy.deepcopy(stages[s].gm)) for s in held]
    pipeline = [PipelineStage(m, s, len(stages), torch.device("cpu")) for m, s in zip(modules, held, strict=True)]
    loss = lambda out, y: F.cross_entropy(out, y)  # noqa: E731
    if schedule in ("gpipe", "1f1b"):
        sched = (ScheduleGPipe if schedule == "gpipe" else Schedule1F1B)(pipeline[0], N, loss_fn=loss)
    else:
        sched = (ScheduleZBVZeroBubble if schedule == "zb-v" else ScheduleInterleavedZeroBubble)(pipeline, N, loss)
    opt = torch.optim.SGD([p for m in modules for p in m.parameters()], lr=0.01)
    first, last = 0 in held, len(stages) - 1 in held

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        sched.step(*((x,) if first else ()), **({"target": y, "losses": []} if last else {}))
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _time(step, batch, warmup: int, iters: int, cpu: list[float]) -> list[float]:
    """Wall seconds of each step, between barriers (a step's latency from an empty pipeline, its end waited for on
    every rank); appends the CPU seconds this rank's thread took in each to `cpu` (what a step costs the rank
    whatever else the host runs: compute and the runtime's own work, not its waits nor gloo's threads)."""
    x, y = batch
    for _ in range(warmup):
        step(x, y)
    times = []
    for _ in range(iters):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.thread_time()
        step(x, y)
        c1 = time.thread_time()
        dist.barrier()
        times.append(time.perf_counter() - t0)
        cpu.append(c1 - c0)
    return times


def _throughput(step, batch, warmup: int, iters: int) -> float:
    """Wall seconds per step of `iters` steps run back to back between two barriers, as a training loop runs them:
    a step's first micro-batches start while the last rank still ends the step before (its update, the step-end
    sum), which per-step barriers (`_time`) serialize."""
    x, y = batch
    for _ in range(warmup):
        step(x, y)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        step(x, y)
    dist.barrier()
    return (time.perf_counter() - t0) / iters


def _latency(events) -> float:
    """The link's latency as the runtime met it: the median over receives that were posted before their send ended of
    the receive's end less the send's end (a send returns once gloo has its data; the receiver then waits for
    the bytes and its wake-up), in seconds."""
    sends, late = {}, []
    for e in events:
        op = Op.parse(e.op)
        if op.kind in (OpKind.SEND_ACT, OpKind.SEND_GRAD):
            sends[(e.step, op.kind, op.stage, op.pipe, op.mb)] = e
    for e in events:
        op = Op.parse(e.op)
        if op.kind not in (OpKind.RECV_ACT, OpKind.RECV_GRAD) or op.stage is None:
            continue
        kind, stage = (
            (OpKind.SEND_ACT, op.stage - 1) if op.kind is OpKind.RECV_ACT else (OpKind.SEND_GRAD, op.stage + 1)
        )
        send = sends.get((e.step, kind, stage, op.pipe, op.mb))
        if send is not None and e.start_ns < send.end_ns:
            late.append(max(0.0, (e.end_ns - send.end_ns) / 1e9))  # a send can return after its receive ended
    return statistics.median(late) if late else 0.0


def _theory(schedule: str, N: int, v: int, events) -> dict[int, float]:
    """Bubble per rank of the planner's simulation of this program with the measured mean op durations: F and B
    per stage, every other op's own time (a send's call, the gradient all-reduce, and OPT_STEP's work: per step
    the least time over ranks, the rank that arrived last having waited for nobody); receives take none (the
    simulation computes their waits, each message arriving `_latency` after its send ends). What the measured
    bubble has beyond this is the runtime's own overhead."""
    mean: dict[tuple[int, str, int | None], list[float]] = {}
    opt: dict[int, list[float]] = {}
    for e in events:
        kind, seconds = e.kind, (e.end_ns - e.start_ns) / 1e9
        if kind == "OPT_STEP":
            opt.setdefault(e.step, []).append(seconds)
            continue
        stage = int(e.op.split()[1][1:]) if kind in BUSY else None
        mean.setdefault((e.rank, kind, stage), []).append(seconds)
    avg = {k: statistics.fmean(v) for k, v in mean.items()}
    opt_step = statistics.fmean(min(v) for v in opt.values())

    def duration(rank: int, op) -> float:
        if op.kind is OpKind.OPT_STEP:
            return opt_step
        if op.kind in (OpKind.RECV_ACT, OpKind.RECV_GRAD):
            return 0.0
        stage = op.stage if op.kind.value in BUSY else None
        return avg.get((rank, op.kind.value, stage), 0.0)

    tl = simulate(rank_programs(schedule, D, N, 1, v=v), duration, comm=_latency(events))
    return {r: 1.0 - tl.utilization(r, kinds=tuple(OpKind(k) for k in BUSY)) for r in range(D)}


def _theory_per_step(schedule: str, N: int, v: int, events) -> dict[int, float]:
    """Bubble per rank of the simulation of each measured step with that step's own op durations (as `_theory`'s,
    op by op), idle time summed over the steps against their simulated spans: unlike the simulation of the mean
    durations, what a loaded host's uneven op times cost the schedule (a late op delays its peer; the mean hides
    it) is in here too, so what the measured bubble has beyond this is the runtime's own gaps."""
    steps: dict[int, list] = {}
    for e in events:
        steps.setdefault(e.step, []).append(e)
    programs, comm = rank_programs(schedule, D, N, 1, v=v), _latency(events)
    idle, span = dict.fromkeys(range(D), 0.0), 0.0
    for evs in steps.values():
        took = {(e.rank, e.op): (e.end_ns - e.start_ns) / 1e9 for e in evs}
        opt_step = min(t for (_, op), t in took.items() if op == "OPT_STEP")

        def duration(rank: int, op, took=took, opt_step=opt_step) -> float:
            if op.kind is OpKind.OPT_STEP:
                return opt_step
            if op.kind in (OpKind.RECV_ACT, OpKind.RECV_GRAD):
                return 0.0
            return took.get((rank, str(op)), 0.0)

        tl = simulate(programs, duration, comm=comm)
        span += tl.length
        for r in range(D):
            idle[r] += tl.length * (1.0 - tl.utilization(r, kinds=tuple(OpKind(k) for k in BUSY)))
    return {r: idle[r] / span for r in range(D)}


def _tail(events) -> dict[str, dict[int, float]]:
    """Per rank, medians over the recorded steps in seconds: "tail", from the step's last F, B or W to its last op's
    end (OPT_STEP: the NaN/Inf verdict, the step-end sum, the update; what torch's schedule ends with is its update
    alone); "opt_cpu", OPT_STEP's CPU time (`Event.cpu_ns`); "f_to_b", from the step's first F to its first B
    (the last stage: what runs between them, receives posted, is on the pipeline's critical path)."""
    out: dict[str, dict[int, list[float]]] = {"tail": {}, "opt_cpu": {}, "f_to_b": {}}
    steps: dict[tuple[int, int], list] = {}
    for e in events:
        steps.setdefault((e.rank, e.step), []).append(e)
    for (rank, _), evs in steps.items():
        busy = [e for e in evs if e.kind in BUSY]
        if busy:
            out["tail"].setdefault(rank, []).append((max(e.end_ns for e in evs) - max(e.end_ns for e in busy)) / 1e9)
        out["opt_cpu"].setdefault(rank, []).extend(e.cpu_ns / 1e9 for e in evs if e.kind == "OPT_STEP")
        fwd = min((e for e in evs if e.kind == "FWD"), key=lambda e: e.start_ns, default=None)
        bwd = min((e for e in evs if e.kind == "BWD"), key=lambda e: e.start_ns, default=None)
        if fwd is not None and bwd is not None:
            out["f_to_b"].setdefault(rank, []).append((bwd.start_ns - fwd.end_ns) / 1e9)
    return {k: {r: statistics.median(v) for r, v in sorted(by.items()) if v} for k, by in out.items()}


def _virtual(schedule: str) -> int:
    """Stages per rank: two in ZB-V's V, one otherwise."""
    return 2 if schedule == "zb-v" else 1


def _fxkfac_trainer(
    args: argparse.Namespace, schedule: str, example: torch.Tensor, backend: str | None = None
) -> Trainer:
    """fxkfac's plain pipeline (no K-FAC, SGD; eager stages or compiled under `backend`), recording its timeline for
    the bubble columns."""
    return fxkfac.compile(
        make_model(args.width, args.depth),
        (D, 1),
        None,
        example_inputs=(example,),
        loss_fn=lambda out, y: F.cross_entropy(out, y),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.01),
        preconditioner=None,
        schedule=schedule,
        microbatches=args.microbatches,
        backend=backend,
        pipeline=PipelineOptions(
            record_timeline=True,
            step_agreement=StepAgreement(args.step_agreement),
            virtual_stages=_virtual(schedule),
        ),
    )


def _worker(rank: int, args: argparse.Namespace, port: int, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=D, timeout=timedelta(seconds=120)
    )
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(args.batch, args.width, generator=g), torch.randint(0, 10, (args.batch,), generator=g))
    rows = []
    for schedule in args.schedules.split(","):
        trainer = _fxkfac_trainer(args, schedule, batch[0])
        compiled = _fxkfac_trainer(args, schedule, batch[0], "inductor") if args.compiled else None
        theirs_step = _torch_runner(trainer, schedule, args.microbatches)
        run: dict[str, list[float]] = {"fxkfac": [], "torch": [], "compiled": []}
        each: dict[str, list[float]] = {"fxkfac": [], "torch": []}
        cpu: dict[str, list[float]] = {"fxkfac": [], "torch": []}
        trainer.timeline.enabled = False  # timed as torch's side is: without the per-op recorder
        for warm in (trainer.step, theirs_step):  # an untimed round first: each side's first steps run slower
            _throughput(warm, batch, args.warmup, args.iters)
        for _ in range(args.rounds):  # alternate so that drift in machine load hits both
            run["fxkfac"].append(_throughput(trainer.step, batch, args.warmup, args.iters))
            run["torch"].append(_throughput(theirs_step, batch, args.warmup, args.iters))
            if compiled is not None:
                compiled.timeline.enabled = False
                run["compiled"].append(_throughput(compiled.step, batch, args.warmup, args.iters))
            each["fxkfac"].append(statistics.median(_time(trainer.step, batch, 0, args.iters, cpu["fxkfac"])))
            each["torch"].append(statistics.median(_time(theirs_step, batch, 0, args.iters, cpu["torch"])))
        trainer.timeline.enabled = True  # the bubble columns: one recorded pass of per-step-barrier steps
        trainer.timeline.clear()
        _time(trainer.step, batch, 0, args.iters * args.rounds, [])
        cpu_medians = [None] * D
        dist.all_gather_object(cpu_medians, {k: statistics.median(v) for k, v in cpu.items() if v})
        events = [e for e in trainer.timeline.events]
        gathered = [None] * D
        dist.all_gather_object(gathered, events)
        events = [e for part in gathered for e in part]
        measured = {r: 1.0 - u for r, u in utilization(events, BUSY).items()}
        ratios = [t / f for t, f in zip(run["torch"], run["fxkfac"], strict=True)]
        step_ratios = [t / f for t, f in zip(each["torch"], each["fxkfac"], strict=True)]
        rows.append(
            {
                "schedule": schedule,
                "fxkfac_step_s": statistics.median(run["fxkfac"]),
                "fxkfac_compiled_step_s": statistics.median(run["compiled"]) if run["compiled"] else None,
                "torch_step_s": statistics.median(run["torch"]),
                "ratio": statistics.median(ratios),
                "ratio_rounds": ratios,
                "step_ratio": statistics.median(step_ratios),
                "step_ratio_rounds": step_ratios,
                "cpu_s": {side: [m[side] for m in cpu_medians] for side in cpu_medians[0]},
                "cpu_ratio": sum(m["torch"] for m in cpu_medians) / sum(m["fxkfac"] for m in cpu_medians),
                "bubble_measured": measured,
                "bubble_sim": _theory(schedule, args.microbatches, _virtual(schedule), events),
                "bubble_sim_steps": _theory_per_step(schedule, args.microbatches, _virtual(schedule), events),
                "bubble_formula": (D - 1) / (args.microbatches + D - 1),
                "latency_s": _latency(events),
                "descheduled": descheduled(events),
                **_tail(events),
            }
        )
    base = next((r["fxkfac_step_s"] for r in rows if r["schedule"] == "1f1b"), None)
    for r in rows:
        r["vs_fxkfac_1f1b"] = base / r["fxkfac_step_s"] if base is not None else None
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def _report(rows: list[dict], args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"fxkfac vs torch.distributed.pipelining (D={D}, N={args.microbatches}, "
        f"MLP {args.depth}x{args.width}, batch {args.batch}, 1 thread/rank, step agreement "
        f"{args.step_agreement})"
    )
    for col in (
        "schedule",
        "fxkfac s/step",
        "fxkfac compiled s/step",
        "torch s/step",
        "throughput ratio (rounds min-max)",
        "step latency ratio (rounds min-max)",
        "CPU ms/step fxkfac (r0, r1)",
        "CPU ms/step torch (r0, r1)",
        "CPU ratio",
        "vs fxkfac 1F1B",
        "bubble measured (r0, r1)",
        "bubble simulated (r0, r1)",
        "bubble simulated per step (r0, r1)",
        "descheduled (r0, r1)",
        "tail after last F/B/W ms (r0, r1)",
        "OPT_STEP CPU ms (r0, r1)",
        "first F end to first B us (r0, r1)",
        "link latency us",
        "(D-1)/(N+D-1)",
    ):
        table.add_column(col)
    for r in rows:
        fmt = lambda d: ", ".join(f"{d[k]:.3f}" for k in sorted(d, key=int))  # noqa: E731
        table.add_row(
            r["schedule"],
            f"{r['fxkfac_step_s']:.4f}",
            "-" if r["fxkfac_compiled_step_s"] is None else f"{r['fxkfac_compiled_step_s']:.4f}",
            f"{r['torch_step_s']:.4f}",
            f"{r['ratio']:.3f} ({min(r['ratio_rounds']):.3f}-{max(r['ratio_rounds']):.3f})",
            f"{r['step_ratio']:.3f} ({min(r['step_ratio_rounds']):.3f}-{max(r['step_ratio_rounds']):.3f})",
            ", ".join(f"{1e3 * v:.2f}" for v in r["cpu_s"]["fxkfac"]),
            ", ".join(f"{1e3 * v:.2f}" for v in r["cpu_s"]["torch"]),
            f"{r['cpu_ratio']:.3f}",
            "-" if r["vs_fxkfac_1f1b"] is None else f"{r['vs_fxkfac_1f1b']:.3f}",
            fmt(r["bubble_measured"]),
            fmt(r["bubble_sim"]),
            fmt(r["bubble_sim_steps"]),
            fmt(r["descheduled"]),
            ", ".join(f"{1e3 * r['tail'][k]:.3f}" for k in sorted(r["tail"], key=int)),
            ", ".join(f"{1e3 * r['opt_cpu'][k]:.3f}" for k in sorted(r["opt_cpu"], key=int)),
            ", ".join(f"{1e6 * r['f_to_b'][k]:.0f}" for k in sorted(r["f_to_b"], key=int)),
            f"{1e6 * r['latency_s']:.0f}",
            f"{r['bubble_formula']:.3f}",
        )
    Console(width=280).print(table)
    print(json.dumps({"benchmark": "pipeline_vs_torch", "args": vars(args), "results": rows}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--schedules", default="gpipe,1f1b,zb-h1,zb-v", help="comma-separated schedules to run")
    parser.add_argument(
        "--compiled", action="store_true", help="also time fxkfac with its stages compiled by inductor (own column)"
    )
    parser.add_argument(
        "--step-agreement",
        choices=[a.value for a in StepAgreement],
        default="world",
        help="world: a world sum of the NaN/Inf flag and the loss ends every fxkfac step; "
        "copies: each stage decides alone and the loss is summed in flight (torch's schedule "
        "checks nothing and sums no loss)",
    )
    args = parser.parse_args()
    port = free_port()
    out_path = os.path.join(tempfile.mkdtemp(), "rows.json")
    mp.spawn(_worker, args=(args, port, out_path), nprocs=D, join=True)
    with open(out_path) as f:
        _report(json.load(f), args)


if __name__ == "__main__":
    main()
