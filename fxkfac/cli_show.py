"""`fxkfac show`: a saved plan drawn (validated), and a measured run's trace below it with utilization per rank."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.console import Console

from fxkfac.cli_args import CliError
from fxkfac.planner.problem import PlanFormatError
from fxkfac.planner.problem.costs import words_of
from fxkfac.planner.validate import load_plan


def run_show(args: argparse.Namespace, console: Console) -> int:
    """`fxkfac show`: draw a saved plan (validated on load, its summary checked against its placements),
    and a measured trace below it."""
    from fxkfac.plan_view import planned_utilization, render_plan, summary_errors
    from fxkfac.planner.problem.step_timeline import BUSY_KINDS
    from fxkfac.show import render_summary, render_timeline, timeline_from_trace

    plan = load_plan(args.plan)
    wrong = summary_errors(plan)
    if wrong:
        raise PlanFormatError(
            f"plan file {args.plan}: its summary contradicts its placements: {'; '.join(wrong)}; "
            "make the plan again (fxkfac plan ... --export)"
        )
    measured = None
    if args.measured is not None:
        measured = timeline_from_trace(_read_json(args.measured, "trace"))
    console.print(render_plan(plan, width=console.width, title=f"fxkfac show {args.plan}"))
    if measured is None:
        return 0
    console.print(
        render_timeline(
            measured, width=console.width, title=f"measured: {args.measured}", words=words_of(plan.problem.costs)
        )
    )
    planned = planned_utilization(plan)
    ran = {r: measured.utilization(r, BUSY_KINDS, (0.0, measured.length)) for r in measured.ranks}
    rows = [
        (f"r{r}", f"{planned[r]:.1%}" if r in planned else "-", f"{ran[r]:.1%}" if r in ran else "-")
        for r in sorted(set(planned) | set(ran))
    ]
    console.print(
        render_summary("utilization per rank: planned | measured", [(name, f"{a} | {b}") for name, a, b in rows])
    )
    return 0


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except OSError as e:
        raise CliError(f"cannot read the {what} {path}: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PlanFormatError(f"the {what} {path} is not valid JSON (corrupt or truncated?): {e}") from None
