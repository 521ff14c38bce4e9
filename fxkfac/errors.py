"""The exceptions fxkfac raises: one hierarchy, each message says what to do."""

from __future__ import annotations

__all__ = [
    "FxkfacError",
    "CaptureError",
    "ConfigError",
    "PlanError",
    "PlanFormatError",
    "PlanMismatchError",
    "InfeasibleBudgetError",
    "PipelineError",
    "PipelineTimeoutError",
    "CheckpointError",
    "NonFiniteError",
    "CostModelError",
]

from fxkfac.planner.problem import (  # the planner is torch-free; its errors are ours too
    ConfigError,
    CostModelError,
    InfeasibleBudgetError,
    PlanError,
    PlanFormatError,
    PlanMismatchError,
)
from fxkfac.planner.problem import (
    PlannerError as FxkfacError,
)


class CaptureError(FxkfacError):
    """The model could not be captured (exported) or its inputs do not fit it."""


class PipelineError(FxkfacError):
    """A pipelined run failed on some rank."""


class PipelineTimeoutError(PipelineError):
    """A rank waited past the configured timeout (a peer died or stalled)."""


class CheckpointError(FxkfacError):
    """A checkpoint is missing, corrupt, or made for another model, mesh or plan."""


class NonFiniteError(FxkfacError):
    """Loss or gradients stayed non-finite for too many consecutive steps."""
