"""The `fxkfac` console script: its argument parser and commands (`plan`: cli_plan.py, `show`: cli_show.py, `demo`:
cli_demo.py)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn, TypeVar

from rich.console import Console

from fxkfac.cli_args import (
    AUTO,
    MICRO_BATCH_SIZE,
    CliError,
    checkpointing_arg,
    enum_option,
    parse_block_size,
    parse_bytes,
    parse_fraction,
    positive,
    strategy_arg,
)
from fxkfac.cli_plan import run_plan
from fxkfac.cli_schedule import AUTO_SCHEDULE
from fxkfac.cli_show import run_show
from fxkfac.cli_start import call_start, process_start
from fxkfac.config import ActivationCheckpointing, KLClipScope
from fxkfac.planner.problem import PlannerError, PreconditionerKind, ProfileLayers, ScheduleKind
from fxkfac.planner.search import StreamApply

__all__ = ["main", "build_parser"]

T = TypeVar("T")


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
    """The argparse parser of `fxkfac` (subcommands plan, show and demo)."""
    parser = _Parser(
        prog="fxkfac",
        description="Plan a preconditioner's work (K-FAC, Shampoo, SOAP) into pipeline bubbles; draw plans.",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    plan = sub.add_parser(
        "plan", help="cost a model, plan its preconditioner into the schedule's bubbles, draw or export it"
    )
    _add_plan_problem(plan)
    _add_plan_costs(plan)
    _add_plan_solver(plan)
    _add_show(sub.add_parser("show", help="draw a saved plan (validated), and a measured run below it"))
    _add_demo(sub.add_parser("demo", help="train the embedded BERT-style MLM with PipeFisher and with AdamW, compare"))
    return parser


def _add_plan_problem(plan: argparse.ArgumentParser) -> None:
    """`fxkfac plan`'s target, schedule and preconditioner."""
    plan.add_argument(
        "target",
        help="a preset (bert-base, bert-large, gpt2, opt-125m, opt-350m, t5-base) "
        "or path.py:factory returning (model, example_inputs)",
    )
    plan.add_argument("--stages", "-D", type=int, default=4, help="pipeline stages D (pp ranks; default 4)")
    plan.add_argument("--microbatches", "-N", type=int, default=4, help="micro-batches N per replica (default 4)")
    plan.add_argument(
        "--preconditioner",
        choices=[k.value for k in PreconditionerKind],
        default=PreconditionerKind.KFAC.value,
        help="the family planned: kfac (layers' curvature), shampoo or soap (every parameter), muon (Newton-Schulz "
        "of every hidden matrix at every step)",
    )
    plan.add_argument(
        "--max-preconditioner-dim",
        type=_arg_type(parse_block_size),
        default=AUTO,
        help="Shampoo/SOAP block side b, or auto (default): the largest side whose plan fits the bubbles",
    )
    plan.add_argument(
        "--precondition-frequency",
        type=_arg_type(positive),
        help="refresh at least every F steps: the longest refresh period the planner may choose "
        "(default 32; it picks the shortest that fits)",
    )
    plan.add_argument(
        "--schedule",
        choices=[k.value for k in ScheduleKind] + [AUTO_SCHEDULE],
        default="1f1b",
        help="the pipeline schedule, or auto: the planner's choice, the least step at the freshest curvature among "
        "the schedules -D and -N allow (a table says what each planned and why)",
    )
    plan.add_argument("--dp", type=int, default=1, help="data-parallel replicas W")
    plan.add_argument(
        "--virtual-stages", "-v", type=int, default=1, help="stages per rank (interleaved, zb-1p; zb-v: 2)"
    )


def _add_plan_costs(plan: argparse.ArgumentParser) -> None:
    """`fxkfac plan`'s costs, memory budget, overhead and the run's settings the plan depends on."""
    plan.add_argument(
        "--hardware",
        help="p100 (default), v100, a100, h100 or cpu: the analytic costs' device, "
        "whose memory is the default --memory",
    )
    plan.add_argument(
        "--costs",
        type=Path,
        help="a cost table (.json), a PipeFisher profile (.csv), a shipped one of the paper: "
        "paper:<model>/<hardware>, e.g. paper:bert-base/p100, or a per-block GPU profile (.json, or shipped: "
        "gpu:<model>/<device>, measured by benchmarks/gpu_check.py)",
    )
    enum_option(
        plan,
        "--profile-layers",
        ProfileLayers.BLOCK,
        "a PipeFisher profile's K-FAC layer: each Transformer block (the profile's own rows), its attention "
        "and feed-forward, or each Linear, sharing the block's costs by their shapes (smaller tasks, gradients "
        "final earlier, more to place)",
    )
    plan.add_argument(
        "--micro-batch-size",
        type=int,
        default=None,
        help=f"samples per micro-batch (default {MICRO_BATCH_SIZE}; a factory's: its example inputs' "
        "batch over N x W, as fxkfac.compile splits it)",
    )
    plan.add_argument("--seq-len", type=int, help="sequence length (default: the preset's)")
    plan.add_argument(
        "--memory",
        type=_arg_type(parse_bytes),
        help="memory budget per device, e.g. 16GiB (default: the device's memory, where known)",
    )
    plan.add_argument(
        "--max-overhead",
        type=_arg_type(parse_fraction),
        default=None,
        help="allowed step-time growth, e.g. 5%%, 0 for the bubbles alone (default: the bubbles alone where they hold "
        "the work, else the least growth that places it, as plan='auto')",
    )
    enum_option(
        plan,
        "--kl-clip-scope",
        KLClipScope.GLOBAL,
        "the run's KFACConfig.kl_clip_scope: global ends every step with a world barrier; stage "
        "and stale with one over each agreement set, so bubbles join across the step's end",
    )
    plan.add_argument(
        "--decomp-pieces",
        type=int,
        default=1,
        help="pieces per decomposition: the run's KFACConfig.split_inverse pieces (K-FAC) or "
        "ShampooConfig.newton_pieces (Shampoo), each the longest decomposition's placed in a bubble of its own, "
        "a smaller one's pieces together where they fit one piece's time (default 1: one task, exact inversion); "
        "Muon: pieces of each matrix's Newton-Schulz, by iterations (at most 5)",
    )
    plan.add_argument(
        "--strategy",
        type=_arg_type(strategy_arg),
        default=None,
        help="how the copies of a stage share each layer's work: comm-opt, mem-opt, hybrid:F (KAISA's "
        "grad-worker fraction, e.g. hybrid:0.5) or dp-kfac (local factors) on every layer; "
        "default auto: the planner chooses",
    )
    enum_option(
        plan,
        "--stream-apply",
        StreamApply.KEEP_REFRESH,
        "when ranks idle at the step's end apply the first stage's layers beside it: keep-refresh (default) "
        "where that shortens the step and costs no refresh, shortest-step wherever it shortens the step "
        "(Chimera too, refreshing less often), off never (PlanOptions.stream_apply)",
    )
    plan.add_argument(
        "--activation-checkpointing",
        type=_arg_type(checkpointing_arg),
        default=ActivationCheckpointing(),
        help="which stages recompute their forward in their backward, keeping only their inputs per micro-batch "
        "in flight: off (default), stage indices (0,2), or auto: the planner chooses the stages that fit the "
        "memory budget with the shortest step (PipelineOptions.activation_checkpointing)",
    )
    plan.add_argument(
        "--eager",
        action="store_true",
        help="plan for stages run eagerly (compile(backend=None)), whose backward makes each layer's gradient as "
        "it reaches it, so the first stage's APPLY streams during it; default: compiled stages (compile's default "
        "backend), whose backward makes every gradient at its end",
    )


def _add_plan_solver(plan: argparse.ArgumentParser) -> None:
    """`fxkfac plan`'s solver, and what it draws, prints and writes."""
    plan.add_argument(
        "--nondeterministic",
        action="store_true",
        help="budget the command in wall-clock seconds: each CP-SAT call (one seeded thread) gets the deterministic "
        "time its share is worth at the rate CP-SAT ran so far (a slower or busier machine may plan differently); "
        "default: deterministic time, the same plan under any load",
    )
    plan.add_argument(
        "--time-limit",
        type=float,
        default=10.0,
        help="seconds for the whole planning (a refusal may take 3 s more to check what it suggests)",
    )
    plan.add_argument(
        "--method",
        choices=["cpsat", "greedy"],
        default="cpsat",
        help="cpsat (optimal placement) or greedy (the paper's first-fit)",
    )
    plan.add_argument("--show", action="store_true", help="draw the plan, one row per device")
    plan.add_argument("--explain", action="store_true", help="print the performance model with these numbers")
    plan.add_argument("--export", type=Path, help="write the plan as JSON")
    plan.add_argument("--trace", type=Path, help="write a Chrome/Perfetto trace of the planned period")


def _add_show(show: argparse.ArgumentParser) -> None:
    show.add_argument("plan", type=Path)
    show.add_argument("--measured", type=Path, help="a Chrome trace recorded by the runtime, drawn below")


def _add_demo(demo: argparse.ArgumentParser) -> None:
    demo.add_argument("--stages", "-D", type=int, default=2, help="pipeline stages (local processes per replica)")
    demo.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    demo.add_argument("--schedule", choices=[k.value for k in ScheduleKind], default="1f1b")
    demo.add_argument("--microbatches", "-N", type=int, default=4, help="micro-batches per replica")
    demo.add_argument("--steps", type=int, help="optimizer steps per run (default 200)")
    demo.add_argument("--seconds", type=float, help="train each run for this wall time instead of --steps")


def _run_demo(args: argparse.Namespace, console: Console) -> int:
    from fxkfac.cli_demo import main as demo_main  # imports torch: only when asked

    return demo_main(args, console)


_COMMANDS = {"plan": run_plan, "show": run_show, "demo": _run_demo}


def _one_line(error: BaseException) -> str:
    return "; ".join(line.strip() for line in str(error).splitlines() if line.strip())


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit status."""
    start = process_start() if argv is None else call_start()  # the console script's budget opens at its start
    args = build_parser().parse_args(argv, argparse.Namespace(start=start))
    console = Console()
    try:
        return _COMMANDS[args.command](args, console)
    except (PlannerError, OSError) as e:
        print(f"fxkfac: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fxkfac: interrupted", file=sys.stderr)
        return 130
