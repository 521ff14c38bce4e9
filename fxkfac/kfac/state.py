"""LayerState: a layer's running factors, the accumulators of the current refresh, and pending/active inverses."""

from __future__ import annotations

import torch
from torch import Tensor

from fxkfac.config import KFACConfig
from fxkfac.errors import CheckpointError, ConfigError
from fxkfac.kfac.factors import running_average
from fxkfac.kfac.inverse import Inverse, invert

__all__ = ["LayerState"]


class LayerState:
    """K-FAC state of one layer, independent of graphs and ranks.

    Life of a refresh: `add_a` / `add_b` once per micro-batch (or with ``count`` for a sum that was
    all-reduced), then `finish_refresh` folds the mean into the running factors ``A`` and ``B``.
    The inverse computed from them is `set_pending` with the global step from which it is used, and
    `activate` at the start of each step's preconditioning promotes it to `active`. Several inverses
    may be pending at once (refresh windows that overlap, ``use_offset > period``); each is used from
    its own step on and replaced by the next.
    """

    def __init__(self, a_dim: int | None = None, b_dim: int | None = None) -> None:
        self.a_dim = a_dim
        self.b_dim = b_dim
        self.A: Tensor | None = None
        self.B: Tensor | None = None
        self.a_sum: Tensor | None = None
        self.b_sum: Tensor | None = None
        self.a_count = 0
        self.b_count = 0
        self.refreshes = 0
        self.active: Inverse | None = None
        self.pending: list[tuple[int, Inverse]] = []

    def add_a(self, a_factor: Tensor, count: int = 1) -> None:
        """Accumulate ``A_m`` (or a sum of ``count`` of them) into the current refresh."""
        _check_square(a_factor, self.a_dim, "A")
        self.a_sum = a_factor.clone() if self.a_sum is None else self.a_sum + a_factor
        self.a_count += count

    def add_b(self, b_factor: Tensor, count: int = 1) -> None:
        """Accumulate ``B_m`` (or a sum of ``count`` of them) into the current refresh."""
        _check_square(b_factor, self.b_dim, "B")
        self.b_sum = b_factor.clone() if self.b_sum is None else self.b_sum + b_factor
        self.b_count += count

    def finish_refresh(self, decay: float) -> None:
        """``A <- running_average(A, a_sum / a_count, decay)`` (and B), then clear the accumulators."""
        if self.a_sum is None or self.b_sum is None:
            raise AssertionError("finish_refresh() without any A_m and B_m accumulated since the last refresh")
        self.A = running_average(self.A, self.a_sum / self.a_count, decay)
        self.B = running_average(self.B, self.b_sum / self.b_count, decay)
        self.a_sum = self.b_sum = None
        self.a_count = self.b_count = 0
        self.refreshes += 1

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

    def invert_pending(self, cfg: KFACConfig, active_from: int, name: str = "") -> Inverse | None:
        """Invert the running factors with ``cfg``'s damping, method and retries, and queue the result.

        On failure `invert` falls back to the newest inverse, which is not queued again. Returns what
        `invert` returned.
        """
        if self.A is None or self.B is None:
            raise AssertionError(f"invert_pending() for {name or 'a layer'} before its first finish_refresh()")
        inverse = invert(self.A, self.B, damping=cfg.damping, method=cfg.inverse, pi_damping=cfg.pi_damping,
                         max_retries=cfg.max_cholesky_retries, previous=self.latest, name=name)
        self.set_pending(inverse, active_from)
        return inverse

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
        out: dict[str, Tensor | int] = {"refreshes": self.refreshes, "a_count": self.a_count,
                                        "b_count": self.b_count, "pending_count": len(self.pending)}
        for key in ("A", "B", "a_sum", "b_sum"):
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
            refreshes, a_count, b_count = int(sd["refreshes"]), int(sd["a_count"]), int(sd["b_count"])
            pending_count = int(sd["pending_count"])
            tensors = {k: sd.get(k) for k in ("A", "B", "a_sum", "b_sum")}
            for k, v in tensors.items():
                if v is not None:
                    _check_square(v, self.a_dim if k.lower().startswith("a") else self.b_dim, k)
            active = _inverse_at(sd, "active.")
            pending = [(int(sd[f"pending.{i}.step"]), _inverse_at(sd, f"pending.{i}.")) for i in range(pending_count)]
        except (KeyError, ValueError, TypeError) as exc:
            raise CheckpointError(f"K-FAC layer state is incomplete or malformed ({exc!r}); "
                                  "the checkpoint is corrupt or was written for another model") from exc
        if any(inv is None for _, inv in pending):
            raise CheckpointError("K-FAC layer state lists a pending inverse whose tensors are missing")
        self.A, self.B, self.a_sum, self.b_sum = (tensors[k] for k in ("A", "B", "a_sum", "b_sum"))
        self.refreshes, self.a_count, self.b_count = refreshes, a_count, b_count
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
