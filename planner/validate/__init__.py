"""The independent validator and plan files read back: `validate`/`check_plan` check a plan against its problem in
seconds, sharing no code with the search; `load_plan` reads a plan file, checks its shape and validates it.
Imports planner.problem and planner.plan, never the search."""

from fxkfac.planner.validate.checks import check_plan, validate
from fxkfac.planner.validate.plan_file import check_structure, load_plan, parse_plan, read_plan

__all__ = ["check_plan", "check_structure", "load_plan", "parse_plan", "read_plan", "validate"]
