"""One layer's refresh in flight on one rank, and its checkpoint form.

A refresh opened at step t gathers the statistic of each part over the step's micro-batches, folds it into the
running state, decomposes each part (made here, in pieces, or received by broadcast) and then queues the
layer's new preconditioner ([Note: refresh semantics in the runtime] in fxkfac/runtime/preconditioning.py).
Checkpoints keep open records, so a run killed mid-refresh resumes it exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from fxkfac.preconditioner import Family, PiecewiseFamily, RefreshState

__all__ = ["RefreshRecord"]


@dataclass
class RefreshRecord:
    """One refresh of one layer in flight: statistic sums and counts per part, which parts are folded, the
    decompositions of the parts (one per part, made here or received by broadcast), and for gradient-fed
    parts the state as folded at the refresh step (what DECOMP decomposes, whenever it runs)."""

    step: int
    sums: dict[str, Tensor] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    folded: set[str] = field(default_factory=set)
    halves: dict[str, Any] = field(default_factory=dict)
    snapshots: dict[str, RefreshState] = field(default_factory=dict)
    carries: dict[str, tuple[int, Any]] = field(default_factory=dict)
    """Per part whose decomposition runs in pieces: (pieces done, the carry they hand on)."""

    def copy(self) -> RefreshRecord:
        """A copy whose containers later handlers do not change."""
        return RefreshRecord(
            self.step,
            dict(self.sums),
            dict(self.counts),
            set(self.folded),
            dict(self.halves),
            dict(self.snapshots),
            dict(self.carries),
        )

    def to_state(self, family: Family) -> dict[str, Any]:
        """The record as checkpoint data (tensors and plain values); `from_state` reads it back."""
        return {
            "step": self.step,
            "sums": dict(self.sums),
            "counts": dict(self.counts),
            "folded": sorted(self.folded),
            "halves": {part: family.half_to_state(h) for part, h in self.halves.items()},
            "snapshots": {part: snap.state_dict() for part, snap in self.snapshots.items()},
            "carries": {part: [done, _carry_state(family, c)] for part, (done, c) in self.carries.items()},
        }

    @classmethod
    def from_state(
        cls, saved: Mapping[str, Any], family: Family, new_state: Callable[[], RefreshState]
    ) -> RefreshRecord:
        """The record `to_state` wrote; `new_state` makes the layer's empty state a snapshot loads into. Raises
        KeyError, TypeError, ValueError or AttributeError when `saved` is malformed."""

        def snapshot(data: Any) -> RefreshState:
            state = new_state()
            state.load_state_dict(dict(data))
            return state

        return cls(
            int(saved["step"]),
            dict(saved["sums"]),
            {k: int(v) for k, v in saved["counts"].items()},
            set(saved["folded"]),
            {k: family.half_from_state(h) for k, h in saved["halves"].items()},
            {k: snapshot(v) for k, v in saved.get("snapshots", {}).items()},
            {k: (int(done), _carry_from(family, c)) for k, (done, c) in saved.get("carries", {}).items()},
        )


def _carry_state(family: Family, carry: Any) -> Any:
    """A piecewise decomposition's carry for a checkpoint (only a PiecewiseFamily makes carries)."""
    assert isinstance(family, PiecewiseFamily), "carries come from a PiecewiseFamily"
    return family.carry_to_state(carry)


def _carry_from(family: Family, saved: Any) -> Any:
    """Inverse of `_carry_state`; ValueError when this family makes no pieces."""
    if not isinstance(family, PiecewiseFamily):
        raise ValueError(f"the {family.name} family runs no decomposition in pieces")
    return family.carry_from_state(saved)
