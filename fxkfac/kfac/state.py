"""LayerState: a K-FAC layer's running factors and its pending/active inverses."""

from __future__ import annotations

import torch
from torch import Tensor

from fxkfac.errors import CheckpointError, ConfigError
from fxkfac.kfac.inverse import Inverse
from fxkfac.preconditioner import RefreshState

__all__ = ["LayerState"]


class LayerState(RefreshState):
    """K-FAC state of one layer, independent of graphs and ranks: the running factors ``A`` and ``B`` (folded by
    the runtime from each refresh's mean) and the pending/active `Inverse`s made from them (`RefreshState`)."""

    def __init__(self, a_dim: int | None = None, b_dim: int | None = None) -> None:
        super().__init__()
        self.a_dim = a_dim
        self.b_dim = b_dim
        self.A: Tensor | None = None
        self.B: Tensor | None = None

    def state_dict(self) -> dict[str, Tensor | int]:
        """Plain tensors and ints; the caller prefixes the keys with the layer's name."""
        out: dict[str, Tensor | int] = {"refreshes": self.refreshes, "pending_count": len(self.pending)}
        for key in ("A", "B"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        if self.active is not None:
            out.update({f"active.{k}": v for k, v in self.active.to_dict().items()})
        for i, (at, inv) in enumerate(self.pending):
            out[f"pending.{i}.step"] = at
            out.update({f"pending.{i}.{k}": v for k, v in inv.to_dict().items()})
        return out

    def load_state_dict(self, sd: dict[str, Tensor | int]) -> None:
        """Restore from `state_dict` output; CheckpointError names what is missing or malformed."""
        try:
            refreshes, pending_count = int(sd["refreshes"]), int(sd["pending_count"])
            tensors = {
                k: None if v is None else _check_square(v, self.a_dim if k == "A" else self.b_dim, k)
                for k, v in ((k, sd.get(k)) for k in ("A", "B"))
            }
            active = _inverse_at(sd, "active.")
            pending = [(int(sd[f"pending.{i}.step"]), _inverse_at(sd, f"pending.{i}.")) for i in range(pending_count)]
        except (KeyError, ValueError, TypeError) as exc:
            raise CheckpointError(
                f"K-FAC layer state is incomplete or malformed ({exc!r}); "
                "the checkpoint is corrupt or was written for another model"
            ) from exc
        if any(inv is None for _, inv in pending):
            raise CheckpointError("K-FAC layer state lists a pending inverse whose tensors are missing")
        self.A, self.B = tensors["A"], tensors["B"]
        self.refreshes = refreshes
        self.active, self.pending = active, [(s, inv) for s, inv in pending if inv is not None]  # all, checked above


def _inverse_at(sd: dict[str, Tensor | int], prefix: str) -> Inverse | None:
    """The Inverse stored under ``prefix`` (its keys minus the prefix), or None when there is none."""
    part = {k[len(prefix) :]: v for k, v in sd.items() if k.startswith(prefix) and k[len(prefix) :] != "step"}
    # A checkpoint's values are taken as stored: from_dict checks the keys, a non-tensor fails where it is used.
    return Inverse.from_dict(part) if part else None  # type: ignore[arg-type]  # see above


def _check_square(t: Tensor | int, dim: int | None, what: str) -> Tensor:
    """A factor is a square matrix, of side ``dim`` when the layer's width is known; returns it."""
    if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[0] != t.shape[1]:
        raise ConfigError(f"factor {what} must be a square matrix, got {getattr(t, 'shape', type(t))}")
    if dim is not None and t.shape[0] != dim:
        raise ConfigError(f"factor {what} has side {t.shape[0]}, this layer's is {dim}")
    return t
