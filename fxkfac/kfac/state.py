"""LayerState: a layer's running factors, the accumulators of the current refresh, and pending/active inverses."""

from __future__ import annotations

import torch
from torch import Tensor

from fxkfac.errors import CheckpointError, ConfigError
from fxkfac.kfac.inverse import Inverse

__all__ = ["LayerState"]


class LayerState:
    """K-FAC state of one layer, independent of graphs and ranks.

    The K-FAC runtime (fxkfac/runtime/kfac_ops.py) folds each refresh's mean factors into the running
    factors ``A`` and ``B``. The inverse computed from them is `set_pending` with the global step from which it is used, and
    `activate` at the start of each step's preconditioning promotes it to `active`. Several inverses
    may be pending at once (refresh windows that overlap, ``use_offset > period``); each is used from
    its own step on and replaced by the next.
    """

    def __init__(self, a_dim: int | None = None, b_dim: int | None = None) -> None:
        self.a_dim = a_dim
        self.b_dim = b_dim
        self.A: Tensor | None = None
        self.B: Tensor | None = None
        self.refreshes = 0
        self.active: Inverse | None = None
        self.pending: list[tuple[int, Inverse]] = []

    @property
    def latest(self) -> Inverse | None:
        """The newest inverse, pending or active: what a failed inversion falls back to."""
        return self.pending[-1][1] if self.pending else self.active

    def set_pending(self, inverse: Inverse | None, active_from: int) -> None:
        """Queue ``inverse`` to become active at global step ``active_from``.

        None, or the newest inverse itself (what `invert` returns when it falls back), is no news:
        nothing is queued, and what is pending keeps its own activation step.
        """
        if inverse is None or inverse is self.latest:
            return
        if self.pending and active_from < self.pending[-1][0]:
            raise AssertionError(
                f"inverse activation steps must not decrease: {active_from} after {self.pending[-1][0]}"
            )
        self.pending.append((active_from, inverse))

    def activate(self, step: int) -> bool:
        """Promote the newest pending inverse whose activation step is ``<= step``; True if `active` changed."""
        due = [i for i, (at, _) in enumerate(self.pending) if at <= step]
        if not due:
            return False
        self.active = self.pending[due[-1]][1]
        self.pending = self.pending[due[-1] + 1 :]
        return True

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
            tensors = {k: sd.get(k) for k in ("A", "B")}
            for k, v in tensors.items():
                if v is not None:
                    _check_square(v, self.a_dim if k == "A" else self.b_dim, k)
            active = _inverse_at(sd, "active.")
            pending = [(int(sd[f"pending.{i}.step"]), _inverse_at(sd, f"pending.{i}.")) for i in range(pending_count)]
        except (KeyError, ValueError, TypeError) as exc:
            raise CheckpointError(f"K-FAC layer state is incomplete or malformed ({exc!r}); "
                                  "the checkpoint is corrupt or was written for another model") from exc
        if any(inv is None for _, inv in pending):
            raise CheckpointError("K-FAC layer state lists a pending inverse whose tensors are missing")
        self.A, self.B = tensors["A"], tensors["B"]
        self.refreshes = refreshes
        self.active, self.pending = active, pending


def _inverse_at(sd: dict[str, Tensor | int], prefix: str) -> Inverse | None:
    """The Inverse stored under ``prefix`` (its keys minus the prefix), or None when there is none."""
    part = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix) and k[len(prefix):] != "step"}
    return Inverse.from_dict(part) if part else None


def _check_square(t: Tensor, dim: int | None, what: str) -> None:
    """A factor is a square matrix, of side ``dim`` when the layer's width is known."""
    if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[0] != t.shape[1]:
        raise ConfigError(f"factor {what} must be a square matrix, got {getattr(t, 'shape', type(t))}")
    if dim is not None and t.shape[0] != dim:
        raise ConfigError(f"factor {what} has side {t.shape[0]}, this layer's is {dim}")
