"""Planner exceptions; `fxkfac.errors` re-exports them under the common base."""

from __future__ import annotations

__all__ = [
    "PlannerError",
    "PlanError",
    "PlanFormatError",
    "PlanMismatchError",
    "InfeasibleBudgetError",
    "ScheduleError",
    "DeadlockError",
    "CostModelError",
]


class PlannerError(Exception):
    """Base of every fxkfac error (named FxkfacError in `fxkfac.errors`)."""


class PlanError(PlannerError):
    """A plan could not be made, or a plan is not valid for its problem."""


class PlanFormatError(PlanError):
    """A plan file is corrupt, truncated, or of an unknown schema version."""


class PlanMismatchError(PlanError):
    """A plan was made for another graph, mesh or schedule than the one in use."""


class InfeasibleBudgetError(PlanError):
    """No placement fits the memory budget; `needed_bytes` is the least that would."""

    def __init__(self, message: str, needed_bytes: int | None = None) -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes


class ScheduleError(PlanError, ValueError):
    """A pipeline schedule was asked for with stages/micro-batches/virtual stages it cannot run."""


class DeadlockError(PlanError):
    """Simulated programs stop making progress: some rank waits for an op that never comes."""


class CostModelError(PlannerError, ValueError):
    """A cost input (cost table, profile CSV, hardware spec, model preset) is invalid or unknown."""
