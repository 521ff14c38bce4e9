"""Per-parameter state of Shampoo and SOAP: step count, running L and R, per-step tensors, and roots or bases.

Every tensor is replaced, never mutated, so `RefreshState.snapshot` (a shallow copy) and the runtime's restore
of a skipped step see the state as it was. Checkpoints hold tensors and ints under flat keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from torch import Tensor

from fxkfac.errors import CheckpointError
from fxkfac.preconditioner import RefreshState

__all__ = ["Sides", "BlockState", "ShampooState", "SOAPState"]


@dataclass(frozen=True, slots=True)
class Sides:
    """A parameter's preconditioner: per part a flat tensor in the layout of that part's statistic (Shampoo:
    inverse roots, SOAP: eigenbases; empty for a trivial part)."""

    L: Tensor
    R: Tensor


class BlockState(RefreshState):
    """What Shampoo and SOAP share: `folds` (per part, the steps folded: t + 1 after step t's fold, whichever
    part a plan folds first), the running factors `L` and `R` (flat, see fxkfac/shampoo/layout.py), and the
    `Sides` pending and active. `sizes`: the flat sizes of L and R (also those of a `Sides` part); `view`: the
    shape of the other tensors (checked on load)."""

    TENSORS: ClassVar[tuple[str, ...]] = ("L", "R")

    def __init__(self, sizes: tuple[int, int], view: tuple[int, ...]) -> None:
        super().__init__()
        self.shapes = {k: view for k in self.TENSORS} | {"L": (sizes[0],), "R": (sizes[1],)}
        self.folds = {"L": 0, "R": 0}
        self.L: Tensor | None = None
        self.R: Tensor | None = None

    @property
    def count(self) -> int:
        """Steps seen (t + 1 during step t's preconditioning, which follows both folds)."""
        return self.folds["L"]

    def state_dict(self) -> dict[str, Any]:
        """``refreshes``, ``folds.L/R``, the tensors present, ``active.L/R`` and ``pending.<i>.step/L/R``."""
        out: dict[str, Any] = {
            "refreshes": self.refreshes,
            "folds.L": self.folds["L"],
            "folds.R": self.folds["R"],
            "pending_count": len(self.pending),
        }
        out.update({k: getattr(self, k) for k in self.TENSORS if getattr(self, k) is not None})
        if self.active is not None:
            out.update({"active.L": self.active.L, "active.R": self.active.R})
        for i, (at, sides) in enumerate(self.pending):
            out.update({f"pending.{i}.step": at, f"pending.{i}.L": sides.L, f"pending.{i}.R": sides.R})
        return out

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore `state_dict` output; CheckpointError names the missing or malformed entry."""
        try:
            counts = [int(sd[k]) for k in ("refreshes", "folds.L", "folds.R", "pending_count")]
            tensors = {k: self._tensor(sd, k, k) for k in self.TENSORS if sd.get(k) is not None}
            active = self._sides(sd, "active.") if "active.L" in sd else None
            pending = [(int(sd[f"pending.{i}.step"]), self._sides(sd, f"pending.{i}.")) for i in range(counts[3])]
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(
                f"{type(self).__name__} is incomplete or malformed ({exc!r}); the checkpoint is "
                "corrupt or was written for another model or configuration"
            ) from exc
        self.refreshes, self.folds = counts[0], {"L": counts[1], "R": counts[2]}
        for k in self.TENSORS:
            setattr(self, k, tensors.get(k))
        self.active, self.pending = active, pending

    def _tensor(self, sd: Mapping[str, Any], key: str, kind: str) -> Tensor:
        """sd[key], checked to be a tensor of the shape of `kind`."""
        value = sd[key]
        if not isinstance(value, Tensor) or tuple(value.shape) != self.shapes[kind]:
            got = getattr(value, "shape", value)
            raise ValueError(f"{key} must be a tensor of shape {self.shapes[kind]}, got {got!r}")
        return value

    def _sides(self, sd: Mapping[str, Any], prefix: str) -> Sides:
        return Sides(self._tensor(sd, prefix + "L", "L"), self._tensor(sd, prefix + "R", "R"))


class ShampooState(BlockState):
    """Shampoo's state: also the graft accumulator, the filtered gradient and the momentum (view-shaped; None
    until first used or when the option is off). `active`: the inverse roots in use."""

    TENSORS = ("L", "R", "graft", "filtered", "momentum")

    def __init__(self, sizes: tuple[int, int], view: tuple[int, ...]) -> None:
        super().__init__(sizes, view)
        self.graft: Tensor | None = None
        self.filtered: Tensor | None = None
        self.momentum: Tensor | None = None


class SOAPState(BlockState):
    """SOAP's state: also Adam's moments in the rotated basis (view-shaped). `active`: the eigenbases in use;
    `moments_basis`: the bases the moments are expressed in (None: the identity). It equals `active` between
    steps (each step's preconditioning rotates the moments into the active bases), so it is not saved."""

    TENSORS = ("L", "R", "exp_avg", "exp_avg_sq")

    def __init__(self, sizes: tuple[int, int], view: tuple[int, ...]) -> None:
        super().__init__(sizes, view)
        self.exp_avg: Tensor | None = None
        self.exp_avg_sq: Tensor | None = None
        self.moments_basis: Sides | None = None

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """As `BlockState`, with the moments in the active bases."""
        super().load_state_dict(sd)
        self.moments_basis = self.active
