"""The base of every fxkfac error, the planner's errors and ConfigError (`fxkfac.errors` re-exports them)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class PlannerError(Exception):
    """Base of every fxkfac error (named FxkfacError in `fxkfac.errors`)."""


class ConfigError(PlannerError, ValueError):
    """An argument or configuration value is invalid."""


class Knob(Enum):
    """A setting a refused plan may be made with instead; the value is the Problem field it sets."""

    MAX_OVERHEAD = "max_overhead"
    MEMORY_BUDGET = "memory_budget"
    MICROBATCHES = "N"


@dataclass(frozen=True)
class Suggestion:
    """Values of one knob, or a few (`changes`), the planner solved the refused problem with; `least`: proven least."""

    changes: tuple[tuple[Knob, float | int], ...]
    least: bool = False

    def fields(self) -> dict[str, float | int]:
        """The changes as Problem fields, for dataclasses.replace(problem, **suggestion.fields())."""
        return {knob.value: value for knob, value in self.changes}


class PlanError(PlannerError):
    """A plan could not be made or is not valid; `suggestions`: values that solved the problem, best first."""

    def __init__(self, message: str, *, suggestions: tuple[Suggestion, ...] = ()) -> None:
        super().__init__(message)
        self.suggestions = suggestions

    @property
    def max_overhead(self) -> float | None:
        """The max_overhead of the first suggestion changing it alone (plan="auto" relaxes to it), or None."""
        relaxed = [s for s in self.suggestions if {knob for knob, _ in s.changes} == {Knob.MAX_OVERHEAD}]
        return float(relaxed[0].changes[0][1]) if relaxed else None


class PlanFormatError(PlanError):
    """A plan file is corrupt, truncated, or of an unknown schema version."""


class PlanMismatchError(PlanError):
    """A plan was made for another graph, mesh or schedule than the one in use."""


class InfeasibleBudgetError(PlanError):
    """No placement fits the memory budget; `needed_bytes` is the least that would."""

    def __init__(
        self, message: str, needed_bytes: int | None = None, *, suggestions: tuple[Suggestion, ...] = ()
    ) -> None:
        super().__init__(message, suggestions=suggestions)
        self.needed_bytes = needed_bytes


class ScheduleError(PlanError, ValueError):
    """A pipeline schedule was asked for with stages/micro-batches/virtual stages it cannot run."""


class DeadlockError(PlanError):
    """Simulated programs stop making progress: some rank waits for an op that never comes."""


class CostModelError(PlannerError, ValueError):
    """A cost input (cost table, profile CSV, hardware spec, model preset) is invalid or unknown."""
