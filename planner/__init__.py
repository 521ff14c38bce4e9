"""fxkfac.planner: pure-Python planning of a preconditioner's work into pipeline bubbles (no torch, no front).

Describe the pipeline and its costs as a `Problem` and how to search as `SearchOptions`: `plan(problem, options)`
returns a `Plan` (or raises a `PlanError` naming what would plan), `check_plan` validates one independently, and the
plan-file functions read one back. The sub-packages problem, plan, search and validate each export their own surface,
re-exported here; their modules stay importable for what is not planning (cost tables, schedules, the timeline)."""

from fxkfac.planner.plan import *  # noqa: F403 (each sub-package's __all__ is the front door's)
from fxkfac.planner.plan import __all__ as _plan
from fxkfac.planner.problem import *  # noqa: F403
from fxkfac.planner.problem import __all__ as _problem
from fxkfac.planner.search import *  # noqa: F403
from fxkfac.planner.search import __all__ as _search
from fxkfac.planner.validate import *  # noqa: F403
from fxkfac.planner.validate import __all__ as _validate

__all__ = [*_problem, *_plan, *_search, *_validate]
