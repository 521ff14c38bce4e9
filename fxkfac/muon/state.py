"""Per-parameter state of Muon: a matrix's momentum buffer, or AdamW's moments and step count for the others.

Every tensor is replaced, never mutated, so `RefreshState.snapshot` (a shallow copy) and the runtime's restore of
a skipped step see the state as it was. Muon has no refreshes: `active` and `pending` stay empty.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from fxkfac.errors import CheckpointError
from fxkfac.preconditioner import RefreshState

__all__ = ["MuonState"]

_TENSORS = ("momentum", "exp_avg", "exp_avg_sq")


class MuonState(RefreshState):
    """`momentum` of a Muon matrix; `exp_avg`, `exp_avg_sq` and `steps` of an AdamW parameter (None: no step yet)."""

    def __init__(self) -> None:
        super().__init__()
        self.momentum: Tensor | None = None
        self.exp_avg: Tensor | None = None
        self.exp_avg_sq: Tensor | None = None
        self.steps = 0

    def state_dict(self) -> dict[str, Any]:
        """``steps`` and the tensors present."""
        out: dict[str, Any] = {"steps": self.steps}
        out.update({k: getattr(self, k) for k in _TENSORS if getattr(self, k) is not None})
        return out

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore `state_dict` output; CheckpointError when a value is malformed."""
        steps = sd.get("steps")
        if (
            not isinstance(steps, int)
            or steps < 0
            or not all(isinstance(sd.get(k, None), (Tensor, type(None))) for k in _TENSORS)
        ):
            raise CheckpointError(
                f"a Muon parameter state needs an int 'steps' >= 0 and tensors {_TENSORS}, got {sorted(sd)}"
            )
        self.steps = steps
        for k in _TENSORS:
            setattr(self, k, sd.get(k))
