"""`fxkfac plan`: the planning problem of a command line, its memory budget, solving it, and what is printed."""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass, replace
from decimal import Decimal
from typing import TYPE_CHECKING

from rich.console import Console

from fxkfac.cli_args import AUTO, CliError, check_schedule, device, kind, memory_text
from fxkfac.cli_costs import cost_table
from fxkfac.cli_explain import explain, explain_choice, explain_comm, explain_ns, explain_plan_comm
from fxkfac.cli_schedule import AUTO_SCHEDULE, choose, render_choice
from fxkfac.cli_start import call_start
from fxkfac.cli_targets import factory, is_factory
from fxkfac.config import ActivationCheckpointing, CheckpointMode
from fxkfac.planner import Budget as TimeBudget
from fxkfac.planner import (
    CostTable,
    Distributions,
    Knob,
    Method,
    Overhead,
    PlanError,
    PlannerError,
    Problem,
    SearchOptions,
    SolverConfig,
    Suggestion,
    TimeLimit,
)
from fxkfac.planner import plan as plan_search
from fxkfac.planner.problem import PreconditionerKind
from fxkfac.planner.problem.costs import words_of
from fxkfac.planner.problem.hardware import HARDWARE, hardware
from fxkfac.planner.problem.step_timeline import plain_step_time
from fxkfac.planner.search import choose_recompute
from fxkfac.planner.search.budget import after_search
from fxkfac.planner.search.choose import least_overhead

if TYPE_CHECKING:
    from fxkfac.planner.plan import Plan
    from fxkfac.planner.search import BlockChoice


log = logging.getLogger(__name__)


class RefusedPlan(PlannerError):
    """The planner's refusal in the command line's words: the values it solved with as flags."""


class _Refusal(PlanError):
    """The planner's refusal with the memory budget it planned under, for the command line's words (`_refused`)."""

    def __init__(self, error: PlanError, budget: Budget) -> None:
        super().__init__(str(error), suggestions=error.suggestions)
        self.budget = budget


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


def problem_of(args: argparse.Namespace, costs: CostTable) -> Problem:
    """The planning problem the command line describes (the budget: `memory_budget`)."""
    period = {} if args.precondition_frequency is None else {"max_period": args.precondition_frequency}
    fingerprint = factory(args, check_schedule(args)).fingerprint if is_factory(args.target) else ""
    problem = Problem(
        args.schedule,
        args.stages,
        args.microbatches,
        costs,
        W=args.dp,
        v=args.virtual_stages,
        memory_budget=memory_budget(args, costs.hardware).bytes,
        max_overhead=args.max_overhead or 0.0,
        fingerprint=fingerprint,
        barrier=args.kl_clip_scope.barrier,
        decomp_pieces=args.decomp_pieces,
        warm_start=kind(args) is PreconditionerKind.SOAP,  # SOAP's QR basis starts from the previous one
        **period,
    )
    problem = problem if args.strategy is None else problem.with_strategy(args.strategy)
    return _with_checkpointing(problem, args.activation_checkpointing)


def _with_checkpointing(problem: Problem, checkpointing: ActivationCheckpointing) -> Problem:
    """--activation-checkpointing's stages recomputing (none under auto, which `_solved` chooses)."""
    missing = [s for s in checkpointing.stages if s >= problem.num_stages]
    if missing:
        raise CliError(f"--activation-checkpointing names stages {missing}; the plan has 0..{problem.num_stages - 1}")
    return replace(problem, recompute=checkpointing.stages)


def _flags(suggestion: Suggestion) -> str:
    """The command-line flags that set a suggestion's values (each read back to exactly that value)."""
    return " ".join(_flag(knob, value) for knob, value in suggestion.changes)


def _flag(knob: Knob, value: float | int) -> str:
    if knob is Knob.MAX_OVERHEAD:
        percent = Decimal(repr(value)) * 100
        return f"--max-overhead {format(percent.normalize(), 'f')}%"
    if knob is Knob.MEMORY_BUDGET:
        return f"--memory {memory_text(int(value))}"
    return f"--microbatches {value}"


def _refused(error: PlanError, budget: Budget, checkpointing: ActivationCheckpointing) -> RefusedPlan:
    """The planner's refusal with the flags of what it solved with (and activation checkpointing where it is off
    and the budget refused), and where the budget came from."""
    text = str(error)
    flags = [_flags(s) for s in error.suggestions]
    if budget.bytes is not None and checkpointing.mode is CheckpointMode.OFF and "memory budget" in text:
        flags.append("--activation-checkpointing auto")
    if flags:
        text += "; try " + " or ".join(flags)
    if budget.bytes is not None and budget.source != "--memory":
        text += f"; the memory budget is {budget.source}"
    return RefusedPlan(text)


def _costed(args: argparse.Namespace, S: int, budget: TimeBudget, max_dim: int | None = None) -> CostTable:
    """`cost_table`, its work and the modules it imported charged to the command's budget ([Note: command budget])."""
    table = cost_table(args, S, max_dim)
    budget.charge_costs(sum(len(stage.layers) for stage in table.stages))
    budget.charge_imports()
    return table


def _searches_block_size(args: argparse.Namespace) -> bool:
    """Whether the planner chooses Shampoo's/SOAP's block side: auto on a preset's analytic costs."""
    return (
        kind(args) in (PreconditionerKind.SHAMPOO, PreconditionerKind.SOAP)
        and args.max_preconditioner_dim == AUTO
        and args.costs is None
        and not is_factory(args.target)
    )


def _auto_block(args: argparse.Namespace, S: int, search: SearchOptions, budget: TimeBudget) -> BlockChoice:
    """The plan at the block side the planner chooses for a preset: each side a candidate of the command's search in
    its budget (`planner.search.plan_search.choose_block_size`)."""
    from fxkfac.planner.problem.analytic import largest_dim, preset
    from fxkfac.planner.search import block_candidates, choose_block_size

    candidates = block_candidates(largest_dim(preset(args.target)))
    auto = args.activation_checkpointing.mode is CheckpointMode.AUTO

    def problem(side: int | None) -> Problem:  # under --activation-checkpointing auto, its first choice at each side
        made = problem_of(args, _costed(args, S, budget, side))
        return choose_recompute(made) if auto else made

    return choose_block_size(problem, candidates, search, budget)


def _solved(args: argparse.Namespace, S: int, console: Console, budget: TimeBudget) -> Plan:
    """The plan of the command line at --max-overhead, or, without it, at the least max_overhead that places the
    work, 0 (the bubbles alone) where they hold it (`planner.Overhead.LEAST`, the API's default), said in one line;
    everything within `budget`, the command's --time-limit."""
    if args.max_overhead is not None or not _searches_block_size(args):
        plan = _solved_at(args, S, console, budget)
    else:  # the block-size search plans each side itself (planner/search/plan_search.py)
        plan, _ = least_overhead(lambda value: _solved_at(_at_overhead(args, value), S, console, budget))
    if args.max_overhead is None and plan.problem.max_overhead > 0:
        console.print(
            f"max overhead: the bubbles alone cannot hold the {words_of(plan.problem.costs).name} work; planned "
            f"with {_flag(Knob.MAX_OVERHEAD, plan.problem.max_overhead)}, the least the planner found that places it",
            markup=False,
        )
    return plan


def _at_overhead(args: argparse.Namespace, value: float) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "max_overhead": value})


def search_options(args: argparse.Namespace) -> SearchOptions:
    """How the command line asks the planner to search (`planner.plan`): --time-limit for the whole search
    (TimeLimit.WHOLE_SEARCH, the budget opened at the command's start), max_overhead by the API's rule unless
    --max-overhead is given (Overhead.LEAST: the bubbles alone, else the least growth that places the work)."""
    return SearchOptions(
        solver=SolverConfig(time_limit_s=args.time_limit, deterministic=not args.nondeterministic),
        method=Method(args.method),
        strategy=Distributions.CHOSEN if args.strategy is None else args.strategy,
        stream_apply=args.stream_apply,
        whole_backward=not args.eager,
        choose_recompute=args.activation_checkpointing.mode is CheckpointMode.AUTO,
        overhead=Overhead.LEAST if args.max_overhead is None else Overhead.STRICT,
        time_limit=TimeLimit.WHOLE_SEARCH,
    )


def _solved_at(args: argparse.Namespace, S: int, console: Console, budget: TimeBudget) -> Plan:
    """The plan of the command line (`planner.plan`, under --max-overhead's rule), or the one the block-size search
    finds at its max_overhead (its choice printed as one line, and with --explain every side tried). --explain
    prints the model before solving (it explains a refusal too), after the search when there is one. Raises the
    planner's refusal as a `_Refusal`."""
    search = search_options(args)
    if _searches_block_size(args):
        try:
            choice = _auto_block(args, S, search, budget)
        except PlanError as e:
            raise _Refusal(e, memory_budget(args, device(args))) from None
        console.print(f"max_preconditioner_dim auto: {choice.reason}", markup=False)
        if args.explain:
            explain(args, choice.plan.problem.costs, plain_step_time(choice.plan.problem), console)
            explain_choice(choice, console)
            explain_comm(choice.plan.problem, console)
            explain_plan_comm(choice.plan, console)
        return choice.plan
    costs = _costed(args, S, budget)
    problem = problem_of(args, costs)
    if args.explain:
        explain(args, costs, plain_step_time(problem), console)
        explain_comm(problem, console)
    try:
        plan = plan_search(problem, search, budget=budget)
    except PlanError as e:
        raise _Refusal(e, memory_budget(args, costs.hardware)) from None
    if args.explain:
        explain_plan_comm(plan, console)
        explain_ns(plan, console)
    return plan


def _auto_schedule(args: argparse.Namespace, console: Console, budget: TimeBudget) -> Plan:
    """--schedule auto: the planner's choice among the schedules of the mesh (fxkfac/cli_schedule.py), all of it
    within `budget` (the command's --time-limit), the table of what each planned and why the chosen one won printed
    above the plan."""
    search = search_options(args)
    try:
        choice = choose(args, lambda at, S: _costed(at, S, budget), problem_of, search, budget)
    except PlanError as e:
        raise _refused(e, memory_budget(args, device(args)), args.activation_checkpointing) from None
    console.print(render_choice(choice))
    return choice.plan


def run_plan(args: argparse.Namespace, console: Console) -> int:
    """`fxkfac plan`: cost the model, plan its preconditioner into the bubbles, and draw/export what was asked.

    Nothing is written unless planning succeeded (the export is atomic: Plan.save)."""
    from fxkfac.plan_view import planned_view, render_plan
    from fxkfac.show import chrome_trace

    start, source = getattr(args, "start", None) or call_start()  # --time-limit bounds the whole command
    if args.time_limit <= 0:
        raise CliError(f"--time-limit must be > 0 seconds, got {args.time_limit:g}")
    if args.decomp_pieces < 1:
        raise CliError(f"--decomp-pieces must be >= 1 (1: each decomposition one task), got {args.decomp_pieces}")
    whole = TimeBudget.of(search_options(args).solver, whole=True, start=start)
    whole.charge_imports()
    after = after_search(_plain_ops(args), _outputs(args))
    search = whole.keeping(after)
    if args.schedule == AUTO_SCHEDULE:
        plan = _auto_schedule(args, console, search)
    else:
        S = check_schedule(args)
        try:
            plan = _solved(args, S, console, search)
        except _Refusal as e:
            raise _refused(e, e.budget, args.activation_checkpointing) from None
    whole.charge_output(after)
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
    log.info(
        "fxkfac plan took %.2f s from %s (--time-limit %g s); deterministic seconds charged: %.4g of %.4g",
        time.perf_counter() - start.at,
        source,
        args.time_limit,
        whole.tally.spent,
        whole.limit,
    )
    return 0


def _outputs(args: argparse.Namespace) -> int:
    """How many of --show, --trace and --export the command asks for."""
    return int(args.show) + (args.trace is not None) + (args.export is not None)


def _plain_ops(args: argparse.Namespace) -> int:
    """The forward and backward ops of one plain step of the command's mesh: the count the work after its search is
    reserved and charged by (`planner.search.budget.after_search`)."""
    return 2 * args.stages * args.dp * args.microbatches
