"""The `fxkfac` console script: `fxkfac plan` (cost, plan, draw, export) and `fxkfac show`."""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NoReturn, TypeVar

from rich.console import Console

from fxkfac.config import KLClipScope
from fxkfac.planner.choose import solve_with_strategy
from fxkfac.planner.costs import CostTable, StageCost, is_profile, load_cost_table
from fxkfac.planner.errors import ConfigError, Knob, PlanError, PlanFormatError, PlannerError, Suggestion
from fxkfac.planner.hardware import HARDWARE, hardware
from fxkfac.planner.ir import OpKind
from fxkfac.planner.preconditioners import WORDS, PreconditionerKind, kind_of, words_of
from fxkfac.planner.problem import Problem, SolverConfig, StepBarrier, plain_step_time
from fxkfac.planner.schedules import ScheduleKind, num_stages, validate_schedule_args
from fxkfac.planner.strategy import Strategy, parse_strategy

if TYPE_CHECKING:
    from fxkfac.planner.block_size import BlockChoice
    from fxkfac.planner.plan import Plan

__all__ = ["main", "build_parser", "parse_bytes", "parse_fraction", "parse_block_size", "AUTO"]

AUTO: Literal["auto"] = "auto"
"""--max-preconditioner-dim auto: the planner chooses the block side (planner.block_size.choose_block_size)."""

T = TypeVar("T")

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class CliError(PlannerError):
    """Bad command-line input; printed as one line."""


class RefusedPlan(PlannerError):
    """The planner's refusal in the command line's words: the values it solved with as flags."""


def parse_bytes(text: str) -> int:
    """'16GiB', '512 MiB', '1.5e9', '8GB' -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise CliError(f"cannot read the memory size {text!r}; write e.g. 16GiB, 512MiB, 8GB or 1.5e9")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def parse_fraction(text: str) -> float:
    """'5%' -> 0.05, '0.05' -> 0.05 (decimal arithmetic: '5.23%' is exactly the float 0.0523, the value a
    refusal names)."""
    body = text.strip()
    try:
        value = float(Decimal(body[:-1]) / 100 if body.endswith("%") else Decimal(body))
    except InvalidOperation:
        raise CliError(f"cannot read the overhead {text!r}; write e.g. 5% or 0.05") from None
    if value < 0:
        raise CliError(f"the overhead must be >= 0, got {text!r}")
    return value


def parse_block_size(text: str) -> int | Literal["auto"]:
    """'auto' or a block side >= 1 ('1024')."""
    body = text.strip().lower()
    if body == AUTO:
        return AUTO
    if not body.isdigit() or int(body) < 1:
        raise CliError(f"cannot read the block size {text!r}; write a side >= 1 such as 1024, or auto")
    return int(body)


def _positive(text: str) -> int:
    """An int >= 1 ('50')."""
    if not text.strip().isdigit() or int(text) < 1:
        raise CliError(f"expected a whole number >= 1, got {text!r}")
    return int(text)


def _arg_type(parse: Callable[[str], T]) -> Callable[[str], T]:
    """An argparse type that reports a CliError's message as the usage error."""

    def convert(text: str) -> T:
        try:
            return parse(text)
        except CliError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = parse.__name__
    return convert


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"fxkfac: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of `fxkfac` (subcommands plan and show)."""
    parser = _Parser(prog="fxkfac", description="Plan a preconditioner's work (K-FAC, Shampoo, SOAP) into pipeline "
                                                "bubbles; draw plans.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    plan = sub.add_parser("plan", help="cost a model, plan its preconditioner into the schedule's bubbles, draw or "
                                       "export it")
    plan.add_argument("target", help="a preset (bert-base, bert-large, gpt2, opt-125m, opt-350m, t5-base) "
                                     "or path.py:factory returning (model, example_inputs)")
    plan.add_argument("--stages", "-D", type=int, default=4, help="pipeline stages D (pp ranks; default 4)")
    plan.add_argument("--microbatches", "-N", type=int, default=4, help="micro-batches N per replica (default 4)")
    plan.add_argument("--preconditioner", choices=[k.value for k in PreconditionerKind],
                      default=PreconditionerKind.KFAC.value,
                      help="the family planned: kfac (layers' curvature), shampoo or soap (every parameter)")
    plan.add_argument("--max-preconditioner-dim", type=_arg_type(parse_block_size), default=AUTO,
                      help="Shampoo/SOAP block side b, or auto (default): the largest side whose plan fits the bubbles")
    plan.add_argument("--precondition-frequency", type=_arg_type(_positive),
                      help="refresh at least every F steps: the longest refresh period the planner may choose "
                           "(default 32; it picks the shortest that fits)")
    plan.add_argument("--schedule", choices=[k.value for k in ScheduleKind], default="1f1b")
    plan.add_argument("--dp", type=int, default=1, help="data-parallel replicas W")
    plan.add_argument("--virtual-stages", "-v", type=int, default=1, help="stages per rank (interleaved)")
    plan.add_argument("--hardware", help="p100 (default), v100, a100, h100 or cpu: the analytic costs' device, "
                                         "whose memory is the default --memory")
    plan.add_argument("--costs", type=Path,
                      help="a cost table (.json), a PipeFisher profile (.csv), or a shipped one of the paper: "
                           "paper:<model>/<hardware>, e.g. paper:bert-base/p100")
    plan.add_argument("--micro-batch-size", type=int, default=None,
                      help=f"samples per micro-batch (default {MICRO_BATCH_SIZE}; a factory's: its example inputs' "
                           "batch over N x W, as fxkfac.compile splits it)")
    plan.add_argument("--seq-len", type=int, help="sequence length (default: the preset's)")
    plan.add_argument("--memory", type=_arg_type(parse_bytes),
                      help="memory budget per device, e.g. 16GiB (default: the device's memory, where known)")
    plan.add_argument("--max-overhead", type=_arg_type(parse_fraction), default=0.0,
                      help="allowed step-time growth, e.g. 5%%")
    plan.add_argument("--kl-clip-scope", type=KLClipScope, choices=list(KLClipScope), default=KLClipScope.GLOBAL,
                      help="the run's KFACConfig.kl_clip_scope: global ends every step with a world barrier; stage "
                           "and stale with one over each agreement set, so bubbles join across the step's end")
    plan.add_argument("--decomp-pieces", type=int, default=1,
                      help="tasks per decomposition: the run's KFACConfig.split_inverse pieces (K-FAC) or "
                           "ShampooConfig.newton_pieces (Shampoo), each placed in a bubble of its own (default 1: "
                           "one task, exact inversion)")
    plan.add_argument("--strategy", type=_arg_type(_strategy_arg), default=None,
                      help="how the copies of a stage share each layer's work: comm-opt, mem-opt, hybrid:F (KAISA's "
                           "grad-worker fraction, e.g. hybrid:0.5) or dp-kfac (local factors) on every layer; "
                           "default auto: the planner chooses")
    plan.add_argument("--nondeterministic", action="store_true",
                      help="budget CP-SAT in wall-clock seconds on 2 threads (a slower or busier machine may plan "
                           "differently); default: deterministic time, the same plan under any load")
    plan.add_argument("--time-limit", type=float, default=10.0,
                      help="seconds for the whole planning (a refusal may take 3 s more to check what it suggests)")
    plan.add_argument("--method", choices=["cpsat", "greedy"], default="cpsat",
                      help="cpsat (optimal placement) or greedy (the paper's first-fit)")
    plan.add_argument("--show", action="store_true", help="draw the plan, one row per device")
    plan.add_argument("--explain", action="store_true", help="print the performance model with these numbers")
    plan.add_argument("--export", type=Path, help="write the plan as JSON")
    plan.add_argument("--trace", type=Path, help="write a Chrome/Perfetto trace of the planned period")
    show = sub.add_parser("show", help="draw a saved plan (validated), and a measured run below it")
    show.add_argument("plan", type=Path)
    show.add_argument("--measured", type=Path, help="a Chrome trace recorded by the runtime, drawn below")
    demo = sub.add_parser("demo", help="train the embedded BERT-style MLM with PipeFisher and with AdamW, compare")
    demo.add_argument("--stages", "-D", type=int, default=2, help="pipeline stages (local processes per replica)")
    demo.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    demo.add_argument("--schedule", choices=[k.value for k in ScheduleKind], default="1f1b")
    demo.add_argument("--microbatches", "-N", type=int, default=4, help="micro-batches per replica")
    demo.add_argument("--steps", type=int, help="optimizer steps per run (default 200)")
    demo.add_argument("--seconds", type=float, help="train each run for this wall time instead of --steps")
    return parser


def _blocks(target: str) -> int:
    from fxkfac.planner.presets import preset

    return len(preset(target).blocks)


def _kind(args: argparse.Namespace) -> PreconditionerKind:
    return PreconditionerKind(args.preconditioner)


def _is_factory(target: str) -> bool:
    return ":" in target and target.split(":", 1)[0].endswith(".py")


def cost_table(args: argparse.Namespace, S: int, max_dim: int | None = None) -> CostTable:
    """The cost table the plan uses: --costs file, a preset's analytic model (Shampoo/SOAP: with blocks of side
    `max_dim`, None for none, when --max-preconditioner-dim is auto), or a captured factory (K-FAC)."""
    kind = _kind(args)
    if kind is not PreconditionerKind.KFAC:
        _check_gradient_family(args, kind)
    elif args.max_preconditioner_dim != AUTO:
        raise CliError("--max-preconditioner-dim sets Shampoo's and SOAP's blocks; K-FAC has none (pass "
                       "--preconditioner shampoo or soap, or drop it)")
    if args.costs is not None:
        if is_profile(args.costs):
            blocks = _blocks(args.target)
            if blocks % S:
                raise CliError(f"{args.target} has {blocks} blocks, not divisible into {S} stages; pick another -D")
            table = load_cost_table(args.costs, blocks_per_stage=blocks // S, n_stages=S,
                                    micro_batch_size=_micro_batch_size(args))
        else:
            table = load_cost_table(args.costs)
        if kind_of(table) is not kind:
            raise CliError(f"{args.costs} is a cost table of {WORDS[kind_of(table)].name}, not of "
                           f"{WORDS[kind].name}; pass --preconditioner {kind_of(table).value}")
    elif _is_factory(args.target):
        table = _factory(args, S).costs
    elif kind is PreconditionerKind.KFAC:
        from fxkfac.planner.analytic import analytic_cost_table

        table = analytic_cost_table(args.target, S, _micro_batch_size(args), args.seq_len, _device(args))
    else:
        from fxkfac.planner.shampoo_costs import gradient_cost_table

        side = max_dim if args.max_preconditioner_dim == AUTO else args.max_preconditioner_dim
        table = gradient_cost_table(args.target, S, _micro_batch_size(args), args.seq_len, _device(args), kind=kind,
                                    max_dim=side)
    if len(table.stages) != S:
        raise CliError(f"the cost table has {len(table.stages)} stages but the schedule needs {S}")
    return table


def _check_gradient_family(args: argparse.Namespace, kind: PreconditionerKind) -> None:
    """What Shampoo/SOAP plan: a preset's analytic costs, or a .json cost table of their parameters (whose
    blocks it fixes); a K-FAC profile or a factory target (costed as K-FAC layers) is refused."""
    name = WORDS[kind].name
    if _is_factory(args.target) and args.costs is None:
        raise CliError(f"--preconditioner {kind.value}: a factory target is costed as K-FAC layers only; plan "
                       f"{name} on a preset (analytic costs of every parameter) or pass --costs TABLE.json "
                       f"(a {name} cost table, e.g. profiled by plan='auto')")
    if args.costs is not None and is_profile(args.costs):
        raise CliError(f"--costs {args.costs} is a K-FAC per-block profile; {name} plans with a preset's analytic "
                       f"costs or a {name} cost table (.json)")
    if args.costs is not None and args.max_preconditioner_dim != AUTO:
        raise CliError(f"--costs {args.costs} fixes the blocks of every parameter; drop --max-preconditioner-dim")


@dataclass(frozen=True)
class _Factory:
    """A `path.py:factory` target prepared as `fxkfac.compile` prepares it: its cost table and the fingerprint
    compile computes for the same model, example inputs and mesh (so its exported plan loads there)."""

    costs: CostTable
    fingerprint: str


def _factory(args: argparse.Namespace, S: int) -> _Factory:
    """Import, call and prepare the factory of `args.target` (once per command line: capturing is slow)."""
    key = (args.target, args.schedule, args.stages, args.dp, args.microbatches, args.virtual_stages,
           args.micro_batch_size, _device(args))
    if key not in _FACTORIES:
        _FACTORIES[key] = _prepare_factory(args, S)
    return _FACTORIES[key]


_FACTORIES: dict[tuple[object, ...], _Factory] = {}


def _prepare_factory(args: argparse.Namespace, S: int) -> _Factory:
    """Capture the model a `path.py:factory` makes (this path imports torch), split it into stages as compile
    does, and cost each stage's K-FAC layers with the analytic model."""
    model, example = _call_factory(args.target)
    from torch import nn

    from fxkfac.compile_api import prepare
    from fxkfac.config import KFACConfig
    from fxkfac.kfac.family import KFACFamily
    from fxkfac.planner.analytic import analytic_cost_table
    from fxkfac.planner.presets import model_spec_from_layers
    from fxkfac.planner.schedules import ScheduleKind

    N, W = args.microbatches, args.dp
    if not isinstance(model, nn.Module):
        raise CliError(f"{args.target} must return (model, example_inputs) with an nn.Module model, got "
                       f"{type(model).__name__}")
    try:
        prepared = prepare(model, example, KFACFamily(KFACConfig()), kind=ScheduleKind(args.schedule),
                           D=args.stages, W=W, N=N, v=args.virtual_stages)
    except ConfigError as e:
        raise CliError(f"{args.target}: {e}") from None
    micro = prepared.batch // (N * W)
    if args.micro_batch_size not in (None, micro):
        raise CliError(f"{args.target}'s example inputs hold {prepared.batch} samples, {micro} per micro-batch at "
                       f"N={N}, W={W}; --micro-batch-size {args.micro_batch_size} differs (drop it: a factory's "
                       "example is the global mini-batch, as fxkfac.compile takes it)")
    layers = {x.name: x for x in prepared.captured.layers}  # the K-FAC layers fxkfac.compile finds by default
    stages = [[layers[name] for name in prepared.stage_layers.get(s, [])] for s in range(S)]
    empty = [s for s, names in enumerate(stages) if not names]
    if empty:
        raise CliError(f"{args.target} splits into {S} stages with no K-FAC layer (Linear/Conv2d that the default "
                       f"KFACConfig keeps) on stages {empty}; use fewer stages")
    spec = model_spec_from_layers([[(x.name, x.d_in, x.d_out, x.tokens_per_sample, x.bias is not None) for x in st]
                                   for st in stages], name=args.target.split(":", 1)[1])
    costs = analytic_cost_table(spec, [range(i, i + 1) for i in range(S)], micro, 1, _device(args))
    return _Factory(costs, prepared.target.fingerprint)


def _call_factory(target: str) -> tuple[object, object]:
    """Import `path.py` and call its `factory`: (model, example_inputs), or a CliError saying what went wrong."""
    path_text, factory_name = target.split(":", 1)
    path = Path(path_text)
    if not path.is_file():
        raise CliError(f"no file {path} (TARGET path.py:factory)")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        raise CliError(f"cannot import {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # the user's file: report what it raised, in one line
        raise CliError(f"importing {path} failed: {type(e).__name__}: {e}") from None
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise CliError(f"{path} has no callable {factory_name!r}")
    try:
        made = factory()
    except Exception as e:
        raise CliError(f"{path}:{factory_name}() failed: {type(e).__name__}: {e}") from None
    if not (isinstance(made, tuple) and len(made) == 2):
        raise CliError(f"{factory_name}() must return (model, example_inputs)")
    return made


MICRO_BATCH_SIZE = 32
"""Samples per micro-batch of a preset or a PipeFisher profile when --micro-batch-size is not given (the paper's)."""


def _micro_batch_size(args: argparse.Namespace) -> int:
    """--micro-batch-size, else MICRO_BATCH_SIZE."""
    return args.micro_batch_size or MICRO_BATCH_SIZE


def _device(args: argparse.Namespace) -> str:
    """The device the analytic costs are for."""
    return args.hardware or "p100"


@dataclass(frozen=True)
class Budget:
    """The memory budget per device (None: unlimited) and where it comes from, in words."""

    bytes: int | None
    source: str


def memory_budget(args: argparse.Namespace, device: str) -> Budget:
    """--memory, else the memory of the device the costs are for (--hardware, or `device`: a cost table's
    hardware), else none: a plan never needs more than the device has unless asked to."""
    if args.memory is not None:
        return Budget(args.memory, "--memory")
    name = (args.hardware or device).lower()
    if name not in HARDWARE:
        return Budget(None, f"unlimited: the cost table's hardware {device!r} is not a known device")
    return Budget(hardware(name).memory_bytes, f"the {name}'s device memory (--memory sets another)")


def _stage_means(costs: CostTable) -> dict[str, float]:
    """Per-stage means of the table, as values of the performance model's symbols."""
    n = len(costs.stages)
    mean = lambda f: sum(f(s) for s in costs.stages) / n  # noqa: E731

    def stats(stage: StageCost, from_gradient: bool) -> float:
        gradient = OpKind.ALLREDUCE_GRAD
        return sum(p.stats for x in stage.layers for p in x.parts if (p.after is gradient) == from_gradient)

    return {"T_f": mean(lambda s: s.fwd), "T_b": mean(lambda s: s.bwd), "T_curv": mean(lambda s: stats(s, False)),
            "T_gstat": mean(lambda s: stats(s, True)),
            "T_inv": mean(lambda s: s.inv), "T_prec": mean(lambda s: s.prec),
            "M_theta": mean(lambda s: s.param_bytes), "M_act": mean(lambda s: s.act_bytes),
            "M_err_peak": mean(lambda s: s.peak_err_bytes), "M_curv": mean(lambda s: s.factor_bytes),
            "M_inv": mean(lambda s: s.factor_bytes), "M_err_save": mean(lambda s: s.deferred_bytes)}


def _slowest_stage(costs: CostTable) -> dict[str, float]:
    """The slowest stage's forward and backward (the pace of a pipeline of unequal stages)."""
    slowest = max(costs.stages, key=lambda s: s.fwd + s.bwd)
    return {"T_f": slowest.fwd, "T_b": slowest.bwd}


def _explain(args: argparse.Namespace, costs: CostTable, simulated: float, console: Console) -> None:
    """The performance model with these costs, and how its T_pipe relates to the simulated step time
    (`simulated`, the step time before preconditioning that the plan's summary shows)."""
    from fxkfac.planner.perf_model import evaluate, explain, perf_model, pipe_gap
    from fxkfac.planner.problem import format_bytes

    console.print(explain(args.schedule, WORDS[kind_of(costs)]), markup=False, highlight=False)
    model = perf_model(args.schedule)
    values = {"D": args.stages, "N": args.microbatches, "v": args.virtual_stages, **_stage_means(costs)}
    console.print(f"With these costs (stage means, {costs.source}):", markup=False)
    for name in ("T_pipe", "T_bubble", "T_kfac"):
        console.print(f"  {name} = {evaluate(getattr(model, name), values) * 1e3:.2f} ms", markup=False)
    for name in ("M_pipe", "M_kfac"):
        console.print(f"  {name} = {format_bytes(evaluate(getattr(model, name), values))}", markup=False)
    console.print(f"  ratio = {evaluate(model.ratio, values):.2f} steps per refresh", markup=False)
    slowest = evaluate(model.T_pipe, {**values, **_slowest_stage(costs)})
    console.print(pipe_gap(evaluate(model.T_pipe, values), slowest, simulated, WORDS[kind_of(costs)]), markup=False)


def _explain_comm(problem: Problem, console: Console) -> None:
    """The cost table's comm model, and what each stage's collectives cost: the gradient all-reduce at every
    step, SYNC_STATS and BCAST at every refresh."""
    from fxkfac.planner.comm import describe
    from fxkfac.planner.problem import stage_comm

    for line in describe(problem.costs.comm):
        console.print(line, markup=False, highlight=False)
    console.print("Collectives per stage (over its copies):", markup=False)
    for s in range(problem.num_stages):
        c = stage_comm(problem, s)
        console.print(f"  s{s}: {c.group} ranks, gradient all-reduce {c.allreduce * 1e3:.3f} ms per step, "
                      f"SYNC_STATS + BCAST {(c.sync + c.bcast) * 1e3:.3f} ms per refresh"
                      + (f", preconditioned-gradient broadcasts {c.share * 1e3:.3f} ms per step" if c.share else ""),
                      markup=False,
                      highlight=False)


def _explain_plan_comm(plan: Plan, console: Console) -> None:
    """The plan's collective seconds per step: each stage's all-reduce plus its refresh collectives over its
    refresh period."""
    from fxkfac.planner.problem import stage_comm

    problem = plan.problem
    per_stage = []
    for s in range(problem.num_stages):
        layers = problem.costs.stages[s].layers
        period = plan.layers[layers[0].name].period if layers else 1
        per_stage.append(stage_comm(problem, s).per_step(period))
    shown = "  ".join(f"s{s} {t * 1e3:.3f}" for s, t in enumerate(per_stage))
    console.print(f"Collectives of the plan per step (ms, at each stage's refresh period): {shown}; "
                  f"{sum(per_stage) * 1e3:.3f} in all", markup=False, highlight=False)


def problem_of(args: argparse.Namespace, costs: CostTable) -> Problem:
    """The planning problem the command line describes (the budget: `memory_budget`)."""
    period = {} if args.precondition_frequency is None else {"max_period": args.precondition_frequency}
    fingerprint = _factory(args, _check(args)).fingerprint if _is_factory(args.target) else ""
    problem = Problem(args.schedule, args.stages, args.microbatches, costs, W=args.dp, v=args.virtual_stages,
                      memory_budget=memory_budget(args, costs.hardware).bytes, max_overhead=args.max_overhead,
                      fingerprint=fingerprint, barrier=_barrier(args.kl_clip_scope),
                      decomp_pieces=args.decomp_pieces, **period)
    return problem if args.strategy is None else problem.with_strategy(args.strategy)


def _barrier(scope: KLClipScope) -> StepBarrier:
    """--kl-clip-scope's step barrier (as `fxkfac.autoplan.barrier_of`, which would import torch here)."""
    return StepBarrier.WORLD if scope is KLClipScope.GLOBAL else StepBarrier.AGREEMENT_SET


def _strategy_arg(text: str) -> Strategy | None:
    """--strategy's value: a Strategy, or None for auto."""
    try:
        return None if text.strip().lower() == "auto" else parse_strategy(text)
    except ConfigError as e:
        raise CliError(str(e)) from None


def _flags(suggestion: Suggestion) -> str:
    """The command-line flags that set a suggestion's values (each read back to exactly that value)."""
    return " ".join(_flag(knob, value) for knob, value in suggestion.changes)


def _flag(knob: Knob, value: float | int) -> str:
    if knob is Knob.MAX_OVERHEAD:
        percent = Decimal(repr(value)) * 100
        return f"--max-overhead {format(percent.normalize(), 'f')}%"
    if knob is Knob.MEMORY_BUDGET:
        return f"--memory {_memory_text(int(value))}"
    return f"--microbatches {value}"


def _memory_text(n: int) -> str:
    """Bytes as '84.46GiB' where parse_bytes reads that back to exactly `n`, else the plain number."""
    for unit in ("GiB", "MiB", "KiB"):
        text = f"{n / _UNITS[unit.lower()]:.2f}{unit}"
        if n >= _UNITS[unit.lower()] and parse_bytes(text) == n:
            return text
    return str(n)


def _refused(error: PlanError, budget: Budget) -> RefusedPlan:
    """The planner's refusal with the flags of what it solved with, and where the budget came from."""
    text = str(error)
    if error.suggestions:
        text += "; try " + " or ".join(_flags(s) for s in error.suggestions)
    if budget.bytes is not None and budget.source != "--memory":
        text += f"; the memory budget is {budget.source}"
    return RefusedPlan(text)


def _searches_block_size(args: argparse.Namespace) -> bool:
    """Whether the planner chooses Shampoo's/SOAP's block side: auto on a preset's analytic costs."""
    return (_kind(args) is not PreconditionerKind.KFAC and args.max_preconditioner_dim == AUTO and args.costs is None
            and not _is_factory(args.target))


def _auto_block(args: argparse.Namespace, S: int, config: SolverConfig) -> BlockChoice:
    """The plan at the block side the planner chooses (`planner.block_size.choose_block_size`) for a preset."""
    from fxkfac.planner.block_size import block_candidates, choose_block_size
    from fxkfac.planner.presets import preset
    from fxkfac.planner.shampoo_costs import largest_dim

    candidates = block_candidates(largest_dim(preset(args.target)))
    return choose_block_size(lambda side: problem_of(args, cost_table(args, S, side)), candidates, config,
                             args.method)


def _explain_choice(choice: BlockChoice, console: Console) -> None:
    """Why the block side is what it is: every side tried, largest first, and what it came to."""
    console.print("Block sides tried (max_preconditioner_dim auto), largest first:", markup=False)
    for side, outcome in choice.tried:
        console.print(f"  {side}: {outcome}", markup=False)


def _solved(args: argparse.Namespace, S: int, console: Console) -> Plan:
    """The plan of the command line: solved, or found by the block-size search (its choice printed as one
    line, and with --explain every side tried). --explain prints the model before solving (it explains a
    refusal too), after the search when there is one."""
    from fxkfac.planner.solve import solve

    config = SolverConfig(time_limit_s=args.time_limit, deterministic=not args.nondeterministic)
    if _searches_block_size(args):
        try:
            choice = _auto_block(args, S, config)
        except PlanError as e:
            raise _refused(e, memory_budget(args, _device(args))) from None
        console.print(f"max_preconditioner_dim auto: {choice.reason}", markup=False)
        if args.explain:
            _explain(args, choice.plan.problem.costs, plain_step_time(choice.plan.problem), console)
            _explain_choice(choice, console)
            _explain_comm(choice.plan.problem, console)
            _explain_plan_comm(choice.plan, console)
        return choice.plan
    costs = cost_table(args, S)
    problem = problem_of(args, costs)
    if args.explain:
        _explain(args, costs, plain_step_time(problem), console)
        _explain_comm(problem, console)
    try:  # a forced --strategy is in the problem already (problem_of); without one the planner chooses
        plan = solve(problem, config, method=args.method) if args.strategy is not None else \
            solve_with_strategy(problem, None, config, method=args.method)
    except PlanError as e:
        raise _refused(e, memory_budget(args, costs.hardware)) from None
    if args.explain:
        _explain_plan_comm(plan, console)
    return plan


def run_plan(args: argparse.Namespace, console: Console) -> int:
    """`fxkfac plan`: cost the model, plan its preconditioner into the bubbles, and draw/export what was asked.

    Nothing is written unless planning succeeded (the export is atomic: Plan.save)."""
    from fxkfac.plan_view import planned_view, render_plan
    from fxkfac.show import chrome_trace

    S = _check(args)
    if args.time_limit <= 0:
        raise CliError(f"--time-limit must be > 0 seconds, got {args.time_limit:g}")
    if args.decomp_pieces < 1:
        raise CliError(f"--decomp-pieces must be >= 1 (1: each decomposition one task), got {args.decomp_pieces}")
    plan = _solved(args, S, console)
    budget = memory_budget(args, plan.problem.costs.hardware)
    title = f"fxkfac plan {args.target} ({args.method}, time limit {args.time_limit:g} s)"
    if args.show:
        console.print(render_plan(plan, width=console.width, title=title))
    else:
        from fxkfac.plan_view import plan_rows
        from fxkfac.show import render_summary

        console.print(render_summary(title, plan_rows(plan)))
    if budget.bytes is not None and budget.source != "--memory":
        console.print(f"memory budget: {budget.source}", markup=False)
    if args.export is not None:
        plan.save(args.export)
        console.print(f"wrote {args.export}", markup=False)
    if args.trace is not None:
        chrome_trace(planned_view(plan).timeline, args.trace, words_of(plan.problem.costs))
        console.print(f"wrote {args.trace}", markup=False)
    return 0


def run_show(args: argparse.Namespace, console: Console) -> int:
    """`fxkfac show`: draw a saved plan (validated on load, its summary checked against its placements),
    and a measured trace below it."""
    from fxkfac.plan_view import planned_utilization, render_plan, summary_errors
    from fxkfac.planner.plan import Plan
    from fxkfac.planner.simulate import BUSY_KINDS
    from fxkfac.show import render_summary, render_timeline, timeline_from_trace

    plan = Plan.load(args.plan)
    wrong = summary_errors(plan)
    if wrong:
        raise PlanFormatError(f"plan file {args.plan}: its summary contradicts its placements: {'; '.join(wrong)}; "
                              "make the plan again (fxkfac plan ... --export)")
    measured = None
    if args.measured is not None:
        measured = timeline_from_trace(_read_json(args.measured, "trace"))
    console.print(render_plan(plan, width=console.width, title=f"fxkfac show {args.plan}"))
    if measured is None:
        return 0
    console.print(render_timeline(measured, width=console.width, title=f"measured: {args.measured}",
                                  words=words_of(plan.problem.costs)))
    planned = planned_utilization(plan)
    ran = {r: measured.utilization(r, BUSY_KINDS, (0.0, measured.makespan)) for r in measured.ranks}
    rows = [(f"r{r}", f"{planned[r]:.1%}" if r in planned else "-", f"{ran[r]:.1%}" if r in ran else "-")
            for r in sorted(set(planned) | set(ran))]
    console.print(render_summary("utilization per rank: planned | measured",
                                 [(name, f"{a} | {b}") for name, a, b in rows]))
    return 0


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except OSError as e:
        raise CliError(f"cannot read the {what} {path}: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PlanFormatError(f"the {what} {path} is not valid JSON (corrupt or truncated?): {e}") from None


def _run_demo(args: argparse.Namespace, console: Console) -> int:
    from fxkfac.demo import main as demo_main  # imports torch: only when asked

    return demo_main(args, console)


_COMMANDS = {"plan": run_plan, "show": run_show, "demo": _run_demo}


def _one_line(error: BaseException) -> str:
    return "; ".join(line.strip() for line in str(error).splitlines() if line.strip())


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    console = Console()
    try:
        return _COMMANDS[args.command](args, console)
    except (PlannerError, OSError) as e:
        print(f"fxkfac: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fxkfac: interrupted", file=sys.stderr)
        return 130


def _check(args: argparse.Namespace) -> int:
    """Validate the schedule arguments; the number of (virtual) stages."""
    validate_schedule_args(args.schedule, args.stages, args.microbatches, args.virtual_stages)
    if args.dp < 1:
        raise CliError(f"--dp must be >= 1, got {args.dp}")
    return num_stages(args.schedule, args.stages, args.virtual_stages)
