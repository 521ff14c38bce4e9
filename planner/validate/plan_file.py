"""Plan files read back: parsed, structure-checked (planner/validate/plan_check.py) and, on `load_plan`, validated
against their own problem (planner/validate/). Writing is `Plan.save`; this module sits above the plan and its
checks."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fxkfac.planner.plan.plan import SCHEMA_VERSION, Plan, PlanMetrics, SolverStats
from fxkfac.planner.problem.errors import PlanError, PlanFormatError, PlanMismatchError
from fxkfac.planner.problem.ir import LayerTiming, Placement, Program, parse_program
from fxkfac.planner.problem.problem import Problem
from fxkfac.planner.validate import check_plan
from fxkfac.planner.validate.plan_check import check_structure

__all__ = ["parse_plan", "read_plan", "load_plan"]


def parse_plan(text: str) -> Plan:
    """Parse `Plan.to_json` output; raises PlanFormatError for corrupt, truncated, malformed or newer files."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise PlanFormatError(f"the plan file is not valid JSON (corrupt or truncated?): {e}") from e
    return _plan_from_dict(data)


def read_plan(path: str | Path) -> Plan:
    """Read and parse a plan file, not yet validated against its problem (see `load_plan`); errors name the file."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise PlanFormatError(f"cannot read the plan file {path}: {e}") from e
    try:
        return parse_plan(text)
    except PlanFormatError as e:
        raise PlanFormatError(f"plan file {path}: {e}") from e


def load_plan(path: str | Path, *, expect_fingerprint: str | None = None) -> Plan:
    """Read and validate a plan; PlanMismatchError when made for another graph."""
    plan = read_plan(path)
    if expect_fingerprint is not None and plan.fingerprint != expect_fingerprint:
        raise PlanMismatchError(
            f"{path} was made for graph {plan.fingerprint!r}, not {expect_fingerprint!r}; "
            "make a new plan for this model, mesh and schedule (fxkfac plan ... --export)"
        )
    try:
        check_plan(plan.problem, plan)
    except PlanError as e:
        raise PlanError(f"plan file {path}: {e}") from e
    return plan


def _programs_of(data: Mapping[str, Any]) -> dict[int, Program]:
    """Inverse of `_programs_dict`."""
    return {int(r): [parse_program(text)[0] if text.strip() else [] for text in steps] for r, steps in data.items()}


def _plan_from_dict(data: Any) -> Plan:
    """The plan `data` describes (the JSON object of `Plan.to_dict`), structure-checked."""
    if not isinstance(data, dict):
        raise PlanFormatError(f"a plan must be a JSON object, got {type(data).__name__}")
    version = data.get("schema_version")
    if type(version) is int and version > SCHEMA_VERSION:  # not bool: true is not a version
        raise PlanFormatError(
            f"the plan has schema_version {version}, newer than this fxkfac reads "
            f"({SCHEMA_VERSION}); upgrade fxkfac to load it"
        )
    if type(version) is int and 1 <= version < SCHEMA_VERSION:
        raise PlanFormatError(
            f"the plan has schema_version {version}, older than this fxkfac's ({SCHEMA_VERSION}): "
            "it may place K-FAC work across a step's closing barrier (version 1) or lack its "
            "start-up steps (version 2); re-plan it (fxkfac plan ... --export plan.json, or "
            "plan='auto')"
        )
    if type(version) is not int or version != SCHEMA_VERSION:
        raise PlanFormatError(f"unknown plan schema_version {version!r} (expected {SCHEMA_VERSION})")
    try:
        m = data["metrics"]
        solver = SolverStats(
            m["solver"]["status"], m["solver"]["wall_time"], tuple(m["solver"]["objective"]), m["solver"]["gap"]
        )
        metrics = PlanMetrics(
            **{
                **m,
                "solver": solver,
                "refresh_steps": tuple(m["refresh_steps"]),
                "lower_bound_steps": tuple(m["lower_bound_steps"]),
                "greedy_refresh_steps": tuple(m["greedy_refresh_steps"]),
                "peak_memory": {int(d): b for d, b in m["peak_memory"].items()},
            }
        )
        programs = _programs_of(data["programs"])
        layers = {name: LayerTiming(**t) for name, t in data["layers"].items()}
        placements = tuple(Placement.from_dict(p) for p in data["placements"])
        problem = Problem.from_dict(data["problem"])
        plan = Plan(
            problem, programs, layers, placements, metrics, data["fingerprint"], version, _programs_of(data["startup"])
        )
        check_structure(plan)
        return plan
    except PlanFormatError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
        raise PlanFormatError(f"the plan file is malformed (missing or bad entry: {e})") from e
