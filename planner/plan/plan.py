"""Plans as data: per-rank programs, layer timings, placements, metrics, written as JSON (one schema; read back,
checked, by planner/validate/plan_file.py)."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fxkfac.planner.problem.ir import LayerTiming, Placement, Program, format_program
from fxkfac.planner.problem.problem import Problem

__all__ = ["SCHEMA_VERSION", "SolverStats", "PlanMetrics", "Plan", "rank"]


SCHEMA_VERSION = 3
"""Version of the plan JSON layout; a newer file asks the user to upgrade fxkfac, an older one to re-plan.
2: every step ends with a barrier (the KL-clip and loss all-reduces), so no K-FAC task spans a step boundary.
3: the plan holds its start-up steps (`Plan.startup`), so it lists every op every rank runs. Its problem may name
its step barrier (`Problem.barrier`, absent: world): under agreement-set a task may begin a step before the step's
world start, once the rank's agreement set has ended the step before ([Note: step barrier] in
planner/plan/window.py)."""


@dataclass(frozen=True)
class SolverStats:
    """How the plan was found: status (OPTIMAL: every refresh period proven minimal and staleness
    optimal; FEASIBLE; GREEDY: the greedy plan was kept), wall time (s), objective (sum of refresh
    periods over stages, sum of use offsets) and gap (of the refresh periods to the proven bounds).
    wall_time measures this machine at that moment: it is left out of equality (`Plan ==`), and it is
    the one field whose JSON differs between two deterministic solves of one problem."""

    status: str
    wall_time: float = field(compare=False)
    objective: tuple[int, int]
    gap: float


@dataclass(frozen=True)
class PlanMetrics:
    """What a plan achieves: utilization before/after (busy / device time, mean over devices),
    refresh period and lower bound per stage, step times (plain pipeline, with preconditioning as
    planned, the reference with APPLY after the all-reduce), peak memory per device, the greedy
    periods, `time_quantum`: the planner's time grid in seconds (see [Note: time grid] in planner/plan/window.py),
    and `stretch`: the idle seconds appended to every step ([Note: stretch] in planner/plan/window.py; left out of
    the JSON when 0, so files from before it load as 0)."""

    utilization_baseline: float
    utilization: float
    refresh_steps: tuple[int, ...]
    step_time_baseline: float
    step_time: float
    step_time_reference: float
    peak_memory: Mapping[int, int]
    lower_bound_steps: tuple[int, ...]
    solver: SolverStats
    greedy_refresh_steps: tuple[int | None, ...]
    time_quantum: float
    stretch: float = 0.0


@dataclass(frozen=True)
class Plan:
    """A placement of K-FAC work: per global rank one op list per step of its period, when each layer
    refreshes (`layers`), where every K-FAC op runs (`placements`), and the metrics.

    `startup[rank]` lists the rank's first steps, which run once before its steady `programs` take
    over (global step t runs `startup[rank][t]` while t is in range, else `programs[rank][t % period]`):
    see `planner.lowering.startup_programs`. Together they are every op a rank executes."""

    problem: Problem
    programs: Mapping[int, Program]
    layers: Mapping[str, LayerTiming]
    placements: tuple[Placement, ...]
    metrics: PlanMetrics
    fingerprint: str
    schema_version: int = SCHEMA_VERSION
    startup: Mapping[int, Program] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able form (programs in the IR's text format, one string per step)."""
        metrics = asdict(self.metrics)
        metrics["peak_memory"] = {str(d): b for d, b in self.metrics.peak_memory.items()}
        if not self.metrics.stretch:
            del metrics["stretch"]
        return {
            "schema_version": self.schema_version,
            "fingerprint": self.fingerprint,
            "problem": self.problem.to_dict(),
            "programs": _programs_dict(self.programs),
            "startup": _programs_dict(self.startup),
            "layers": {name: _timing_dict(t) for name, t in self.layers.items()},
            "placements": [p.to_dict() for p in self.placements],
            "metrics": metrics,
        }

    def to_json(self, *, indent: int | None = 1) -> str:
        """JSON text; `planner.plan_file.parse_plan` reads it back to an equal plan."""
        return json.dumps(self.to_dict(), indent=indent)

    def save(self, path: str | Path) -> None:
        """Write the JSON atomically (a temporary file in the same folder, then os.replace)."""
        path = Path(path)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent or ".")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(self.to_json())
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; a plan is shared like any file
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def _programs_dict(programs: Mapping[int, Program]) -> dict[str, list[str]]:
    """Programs in the IR's text format, one string per step."""
    return {str(r): [format_program([step]) for step in prog] for r, prog in programs.items()}


def _timing_dict(t: LayerTiming) -> dict[str, Any]:
    return {"period": t.period, "curv_step": t.curv_step, "use_offset": t.use_offset, "capture": t.capture}


def rank(plan: Plan) -> tuple[int, float, int, float]:
    """How plans of one problem compare, the least first: the sum of refresh periods (within the allowance fresher
    curvature comes first), then the step time (the stretch used), then the peak memory, then the reference step."""
    m = plan.metrics
    return (sum(m.refresh_steps), m.step_time, max(m.peak_memory.values(), default=0), m.step_time_reference)
