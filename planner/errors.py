"""Planner exceptions; `fxkfac.errors` re-exports them under the common base."""

from __future__ import annotations

__all__ = [
    "PlannerError",
    "PlanError",
    "PlanFormatError",
    "PlanMismatchError",
    "InfeasibleBudgetError",
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
