"""The `fxkfac` console script: `fxkfac plan` (cost, plan, draw, export) and `fxkfac show`."""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
from pathlib import Path
from typing import NoReturn, Sequence

from rich.console import Console

from fxkfac.planner.costs import CostTable, is_profile, load_cost_table
from fxkfac.planner.errors import PlanFormatError, PlannerError
from fxkfac.planner.problem import Problem, SolverConfig
from fxkfac.planner.schedules import ScheduleKind, num_stages, validate_schedule_args

__all__ = ["main", "build_parser", "parse_bytes", "parse_fraction"]

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class CliError(PlannerError):
    """Bad command-line input; printed as one line."""


def parse_bytes(text: str) -> int:
    """'16GiB', '512 MiB', '1.5e9', '8GB' -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise CliError(f"cannot read the memory size {text!r}; write e.g. 16GiB, 512MiB, 8GB or 1.5e9")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def parse_fraction(text: str) -> float:
    """'5%' -> 0.05, '0.05' -> 0.05."""
    body = text.strip()
    try:
        value = float(body[:-1]) / 100 if body.endswith("%") else float(body)
    except ValueError:
        raise CliError(f"cannot read the overhead {text!r}; write e.g. 5% or 0.05") from None
    if value < 0:
        raise CliError(f"the overhead must be >= 0, got {text!r}")
    return value


def _arg_type(parse):  # type: ignore[no-untyped-def]
    """An argparse type that reports a CliError's message as the usage error."""

    def convert(text: str):  # type: ignore[no-untyped-def]
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
    parser = _Parser(prog="fxkfac", description="Plan K-FAC work into pipeline bubbles; draw plans.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    plan = sub.add_parser("plan", help="cost a model, plan K-FAC into the schedule's bubbles, draw or export it")
    plan.add_argument("target", help="a preset (bert-base, bert-large, gpt2, opt-125m, opt-350m, t5-base) "
                                     "or path.py:factory returning (model, example_inputs)")
    plan.add_argument("--stages", "-D", type=int, required=True, help="pipeline stages D (pp ranks)")
    plan.add_argument("--microbatches", "-N", type=int, required=True, help="micro-batches N per replica")
    plan.add_argument("--schedule", choices=[k.value for k in ScheduleKind], default="1f1b")
    plan.add_argument("--dp", type=int, default=1, help="data-parallel replicas W")
    plan.add_argument("--virtual-stages", "-v", type=int, default=1, help="stages per rank (interleaved)")
    plan.add_argument("--hardware", default="p100", help="p100, v100, a100, h100 or cpu (analytic costs)")
    plan.add_argument("--costs", type=Path, help="a cost table (.json), a PipeFisher profile (.csv), or a shipped "
                                                 "one of the paper: paper:<model>/<hardware>, e.g. paper:bert-base/p100")
    plan.add_argument("--micro-batch-size", type=int, default=32)
    plan.add_argument("--seq-len", type=int, help="sequence length (default: the preset's)")
    plan.add_argument("--memory", type=_arg_type(parse_bytes), help="memory budget per device, e.g. 16GiB")
    plan.add_argument("--max-overhead", type=_arg_type(parse_fraction), default=0.0, help="allowed step-time growth, e.g. 5%%")
    plan.add_argument("--time-limit", type=float, default=10.0, help="solver time limit in seconds")
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


def cost_table(args: argparse.Namespace, S: int) -> CostTable:
    """The cost table the plan uses: --costs file, a preset's analytic model, or a captured factory."""
    if args.costs is not None:
        if is_profile(args.costs):
            blocks = _blocks(args.target)
            if blocks % S:
                raise CliError(f"{args.target} has {blocks} blocks, not divisible into {S} stages; pick another -D")
            table = load_cost_table(args.costs, blocks_per_stage=blocks // S, n_stages=S,
                                    micro_batch_size=args.micro_batch_size)
        else:
            table = load_cost_table(args.costs)
    elif ":" in args.target and args.target.split(":", 1)[0].endswith(".py"):
        table = _factory_costs(args, S)
    else:
        from fxkfac.planner.analytic import analytic_cost_table

        table = analytic_cost_table(args.target, S, args.micro_batch_size, args.seq_len, args.hardware)
    if len(table.stages) != S:
        raise CliError(f"the cost table has {len(table.stages)} stages but the schedule needs {S}")
    return table


def _factory_costs(args: argparse.Namespace, S: int) -> CostTable:
    """Capture the model a `path.py:factory` makes (this path imports torch) and cost its layers."""
    path_text, factory_name = args.target.split(":", 1)
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
    from fxkfac.capture import capture
    from fxkfac.config import KFACConfig
    from fxkfac.planner.analytic import analytic_cost_table
    from fxkfac.planner.presets import model_spec_from_layers

    layers = capture(*made, KFACConfig()).layers  # the K-FAC layers fxkfac.compile finds by default
    if len(layers) < S:
        raise CliError(f"{path}:{factory_name}() makes a model with {len(layers)} K-FAC layers (Linear/Conv2d "
                       f"that the default KFACConfig keeps), fewer than the {S} stages asked for; use fewer stages")
    bounds = [round(i * len(layers) / S) for i in range(S + 1)]
    spec_stages = [[(x.name, x.d_in, x.d_out, x.tokens_per_sample, x.bias is not None)
                    for x in layers[bounds[i]:bounds[i + 1]]] for i in range(S)]
    model_spec = model_spec_from_layers(spec_stages, name=f"{path.stem}.{factory_name}")
    return analytic_cost_table(model_spec, [range(i, i + 1) for i in range(S)], args.micro_batch_size, 1,
                               args.hardware)


def _stage_means(costs: CostTable) -> dict[str, float]:
    """Per-stage means of the table, as values of the performance model's symbols."""
    n = len(costs.stages)
    mean = lambda f: sum(f(s) for s in costs.stages) / n  # noqa: E731
    return {"T_f": mean(lambda s: s.fwd), "T_b": mean(lambda s: s.bwd), "T_curv": mean(lambda s: s.curv),
            "T_inv": mean(lambda s: s.inv), "T_prec": mean(lambda s: s.prec),
            "M_theta": mean(lambda s: s.param_bytes), "M_act": mean(lambda s: s.act_bytes),
            "M_err_peak": mean(lambda s: s.peak_err_bytes), "M_curv": mean(lambda s: s.factor_bytes),
            "M_inv": mean(lambda s: s.factor_bytes), "M_err_save": mean(lambda s: s.deferred_bytes)}


def _explain(args: argparse.Namespace, costs: CostTable, console: Console) -> None:
    from fxkfac.planner.perf_model import evaluate, explain, perf_model
    from fxkfac.show import format_bytes

    console.print(explain(args.schedule), markup=False, highlight=False)
    model = perf_model(args.schedule)
    values = {"D": args.stages, "N": args.microbatches, "v": args.virtual_stages, **_stage_means(costs)}
    console.print(f"With these costs (stage means, {costs.source}):", markup=False)
    for name in ("T_pipe", "T_bubble", "T_kfac"):
        console.print(f"  {name} = {evaluate(getattr(model, name), values) * 1e3:.2f} ms", markup=False)
    for name in ("M_pipe", "M_kfac"):
        console.print(f"  {name} = {format_bytes(evaluate(getattr(model, name), values))}", markup=False)
    console.print(f"  ratio = {evaluate(model.ratio, values):.2f} steps per refresh", markup=False)


def problem_of(args: argparse.Namespace, costs: CostTable) -> Problem:
    """The planning problem the command line describes."""
    return Problem(args.schedule, args.stages, args.microbatches, costs, W=args.dp, v=args.virtual_stages,
                   memory_budget=args.memory, max_overhead=args.max_overhead)


def run_plan(args: argparse.Namespace, console: Console) -> int:
    """`fxkfac plan`: cost the model, plan K-FAC into the bubbles, and draw/export what was asked.

    Nothing is written unless planning succeeded (the export is atomic: Plan.save)."""
    from fxkfac.plan_view import planned_view, render_plan
    from fxkfac.planner.plan import solve
    from fxkfac.show import chrome_trace

    S = _check(args)
    if args.time_limit <= 0:
        raise CliError(f"--time-limit must be > 0 seconds, got {args.time_limit:g}")
    costs = cost_table(args, S)
    problem = problem_of(args, costs)
    plan = solve(problem, SolverConfig(time_limit_s=args.time_limit), method=args.method)
    if args.explain:
        _explain(args, costs, console)
    if args.show:
        console.print(render_plan(plan, width=console.width, title=f"fxkfac plan {args.target} ({args.method})"))
    else:
        from fxkfac.plan_view import plan_rows
        from fxkfac.show import render_summary

        console.print(render_summary(f"fxkfac plan {args.target} ({args.method})", plan_rows(plan)))
    if args.export is not None:
        plan.save(args.export)
        console.print(f"wrote {args.export}", markup=False)
    if args.trace is not None:
        chrome_trace(planned_view(plan).timeline, args.trace)
        console.print(f"wrote {args.trace}", markup=False)
    return 0


def run_show(args: argparse.Namespace, console: Console) -> int:
    """`fxkfac show`: draw a saved plan (validated on load), and a measured trace below it."""
    from fxkfac.plan_view import busy_utilization, planned_utilization, render_plan
    from fxkfac.planner.plan import Plan
    from fxkfac.show import render_summary, render_timeline, timeline_from_trace

    plan = Plan.load(args.plan)
    measured = None
    if args.measured is not None:
        measured = timeline_from_trace(_read_json(args.measured, "trace"))
    console.print(render_plan(plan, width=console.width, title=f"fxkfac show {args.plan}"))
    if measured is None:
        return 0
    console.print(render_timeline(measured, width=console.width, title=f"measured: {args.measured}"))
    planned = planned_utilization(plan)
    ran = busy_utilization(measured, 0.0, measured.makespan)
    rows = [(f"r{r}", f"{planned[r]:.1%}" if r in planned else "-", f"{ran[r]:.1%}" if r in ran else "-")
            for r in sorted(set(planned) | set(ran))]
    console.print(render_summary("utilization per rank: planned | measured",
                                 [(name, f"{a} | {b}") for name, a, b in rows]))
    return 0


def _read_json(path: Path, what: str) -> object:
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
