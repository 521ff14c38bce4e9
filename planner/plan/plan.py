"""Plans as data (programs, timings, placements, metrics; JSON read back by planner/validate/plan_file.py) and
where a Muon plan runs each matrix's Newton-Schulz, for the views."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

from fxkfac.planner.problem.ir import LayerTiming, Op, OpKind, Placement, Program, format_program, parse_program
from fxkfac.planner.problem.problem import Problem, stages_on_device
from fxkfac.planner.problem.step_timeline import plain_step_time, step_timeline
from fxkfac.planner.problem.strategy import LayerDistribution

SCHEMA_VERSION = 3
"""Version of the plan JSON (a newer file asks to upgrade fxkfac, an older one to re-plan); 3: start-up steps."""


@dataclass(frozen=True)
class SolverStats:
    """How the plan was found: status (OPTIMAL, FEASIBLE, GREEDY), wall time (not compared), objective (sums of
    periods and use offsets), gap."""

    status: str
    wall_time: float = field(compare=False)
    objective: tuple[int, int]
    gap: float


@dataclass(frozen=True)
class PlanMetrics:
    """What a plan achieves: utilization, refresh periods and bounds, step times (plain, planned, APPLY after the
    all-reduce), peak memory per device, greedy periods, time grid (s) and stretch (s; 0 left out of the JSON)."""

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
    """A placement of the preconditioner's work: per rank one program step per step of its period, layer timings,
    placed ops, metrics, and `startup[rank]`, steps run once before `programs` (`lowering.startup_programs`)."""

    problem: Problem
    programs: Mapping[int, Program]
    layers: Mapping[str, LayerTiming]
    placements: tuple[Placement, ...]
    metrics: PlanMetrics
    fingerprint: str
    schema_version: int = SCHEMA_VERSION
    startup: Mapping[int, Program] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able form (programs in the IR's text format, a string per step)."""
        metrics = asdict(self.metrics) | {"peak_memory": {str(d): b for d, b in self.metrics.peak_memory.items()}}
        if not self.metrics.stretch:
            del metrics["stretch"]
        return {
            "schema_version": self.schema_version,
            "fingerprint": self.fingerprint,
            "problem": self.problem.to_dict(),
            "programs": _programs_dict(self.programs),
            "startup": _programs_dict(self.startup),
            "layers": {name: asdict(t) for name, t in self.layers.items()},
            "placements": [p.to_dict() for p in self.placements],
            "metrics": metrics,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        """Inverse of `to_dict`; KeyError, TypeError or ValueError where `data` is malformed (`parse_plan` checks)."""
        m = _tupled(data["metrics"])  # its lists are tuples, its solver SolverStats, its ranks ints
        peak_memory = {int(d): b for d, b in m["peak_memory"].items()}
        return cls(
            Problem.from_dict(data["problem"]),
            _programs_of(data["programs"]),
            {name: LayerTiming(**t) for name, t in data["layers"].items()},
            tuple(Placement.from_dict(p) for p in data["placements"]),
            PlanMetrics(**{**m, "solver": SolverStats(**_tupled(m["solver"])), "peak_memory": peak_memory}),
            data["fingerprint"],
            data["schema_version"],
            _programs_of(data["startup"]),
        )

    def to_json(self, *, indent: int | None = 1) -> str:
        """JSON text; `planner.validate.plan_file.parse_plan` reads it back."""
        return json.dumps(self.to_dict(), indent=indent)

    def save(self, path: str | Path) -> None:
        """Write the JSON atomically: to a temporary file of this process in the same folder, then os.replace."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(self.to_json())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)


def _programs_dict(programs: Mapping[int, Program]) -> dict[str, list[str]]:
    return {str(r): [format_program([step]) for step in prog] for r, prog in programs.items()}


def _programs_of(data: Mapping[str, Any]) -> dict[int, Program]:
    return {int(r): [parse_program(text)[0] if text.strip() else [] for text in steps] for r, steps in data.items()}


def _tupled(data: Mapping[str, Any]) -> dict[str, Any]:
    return {key: tuple(value) if isinstance(value, list) else value for key, value in data.items()}


def rank(plan: Plan) -> tuple[int, float, int, float]:
    """How plans of one problem compare, the least first: refresh periods' sum, step, peak memory, reference step."""
    m = plan.metrics
    return (sum(m.refresh_steps), m.step_time, max(m.peak_memory.values(), default=0), m.step_time_reference)


class NSWhere(StrEnum):
    """Where a Newton-Schulz task runs: on each copy, on a streaming helper, or on one copy that broadcasts it."""

    OWN = "own"
    STREAMED = "streamed"
    SHARED = "shared"


@dataclass(frozen=True, slots=True)
class NSTask:
    """One APPLY (or piece) of a Muon plan's step: where and when (s) it runs, and its streamed sends' seconds."""

    stage: int
    layers: tuple[str, ...]
    rank: int
    where: NSWhere
    start: float
    end: float
    transfer: float = 0.0
    piece: tuple[int, int] | None = None


def ns_tasks(plan: Plan) -> list[NSTask]:
    """Every APPLY of the plan's step, by rank and start; an APPLY naming no layer covers all its stage's."""
    problem, out = plan.problem, []
    for rank, ops in step_timeline(problem).ops.items():
        for op, start, end in ops:
            if op.kind is not OpKind.APPLY or op.stage is None:
                continue
            layers = problem.costs.stages[op.stage].layers
            names = (op.layer,) if op.layer is not None else tuple(x.name for x in layers)
            shared = op.layer is not None and problem.where(op.layer) != LayerDistribution()
            where = NSWhere.SHARED if shared else NSWhere.OWN
            where = where if op.stage in stages_on_device(problem, rank) else NSWhere.STREAMED
            transfer = 0.0
            if where is NSWhere.STREAMED and op.layer is not None and (op.piece is None or op.piece[0] == 0):
                transfer = sum(
                    problem.costs.collective_seconds(Op(kind, op.stage, peer=rank, layer=op.layer), 2)
                    for kind in (OpKind.SEND_LGRAD, OpKind.SEND_PGRAD)  # the gradient there and back
                )
            out.append(NSTask(op.stage, names, rank, where, start, end, transfer, op.piece))
    return sorted(out, key=lambda t: (t.stage, t.start, t.rank))


def critical_path_step(problem: Problem) -> float:
    """The step with every stage orthogonalizing its own matrices on every copy: Muon as torch.optim.Muon runs."""
    return step_timeline(replace(problem, streaming=None, distributions=())).length


def ns_stage_lines(plan: Plan) -> list[str]:
    """Per stage: its units' APPLY seconds, who ran them, and when the last ended against the plain step's end."""
    problem, tasks, lines = plan.problem, ns_tasks(plan), []
    plain = plain_step_time(problem)
    for s, stage in enumerate(problem.costs.stages):
        mine = [t for t in tasks if t.stage == s]
        if not mine:
            continue
        parts = []
        for where in sorted({t.where for t in mine}, key=list(NSWhere).index):
            placed = [t for t in mine if t.where is where]
            ranks = " ".join(f"r{r}" for r in sorted({t.rank for t in placed}))
            count = len({n for t in placed for n in t.layers})
            busy = sum(t.end - t.start for t in placed) * 1e3
            sends = sum(t.transfer for t in placed) * 1e3
            text = f"{count} {where.value} on {ranks} ({busy:.1f} ms"
            parts.append(text + (f", sends {sends:.1f} ms)" if sends else ")"))
        last = max(t.end for t in mine)
        early = (plain - last) * 1e3
        verdict = f"hidden, ends {early:.1f} ms before" if last <= plain else f"+{-early:.1f} ms past"
        head = f"s{s}: {len(stage.layers)} units, APPLY {stage.prec * 1e3:.1f} ms: "
        lines.append(head + "; ".join(parts) + f"; {verdict} the plain step's end")
    return lines


def ns_summary(plan: Plan) -> str:
    """The step time Muon adds as planned, against Muon on the critical path."""
    m, problem = plan.metrics, plan.problem
    plain = plain_step_time(problem)
    critical = critical_path_step(problem)
    return (
        f"+{(m.step_time - plain) * 1e3:.2f} ms (+{m.step_time / plain - 1:.1%}) over the plain pipeline; on the "
        f"critical path (each stage its own matrices after its last backward) +{(critical - plain) * 1e3:.2f} ms "
        f"(+{critical / plain - 1:.1%})"
    )
