"""The preconditioner interface: what a second-order family declares so that the runtime runs its refreshes.

A family preconditions the gradients of layers found in the graph. Each layer has *parts* (K-FAC: the
input-side factor A and the output-side factor B); a refresh of a layer accumulates, per micro-batch, a
statistic of each part from a capture of the layer (`Source`), folds the mean into the running statistic,
decomposes each part (possibly on another rank, then broadcast), combines the parts into the layer's new
preconditioner, and applies it to the gradients from a later step on. The runtime
(fxkfac/runtime/preconditioning.py) owns the refresh records, collectives, staleness and checkpoints of
that life cycle; a family owns only the math. K-FAC (fxkfac/kfac/family.py) is the first family; a new one
is a class with these methods, with no edit to the interpreter, the runtime or the planner's solver.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Mapping, MutableMapping, Sequence
from enum import StrEnum
from typing import Any, Protocol

from torch import Tensor

from fxkfac.passes.layers import KFACLayer

__all__ = ["Source", "RefreshState", "Family"]


class Source(StrEnum):
    """Which capture of a layer feeds a part's statistic: its input (after FWD) or its output gradient (after BWD)."""

    INPUT = "a"
    OUTPUT_GRAD = "e"


class RefreshState(ABC):
    """The part of a layer's state every family shares: refresh count, active and pending preconditioners.

    A combined preconditioner is `set_pending` with the global step from which it is used; `activate` at
    the start of each step's preconditioning promotes the newest due one. Several may be pending at once
    (refresh windows that overlap); each is used from its own step on and replaced by the next.
    """

    def __init__(self) -> None:
        self.refreshes = 0
        self.active: Any = None
        self.pending: list[tuple[int, Any]] = []

    @property
    def latest(self) -> Any:
        """The newest preconditioner, pending or active: what a failed decomposition falls back to."""
        return self.pending[-1][1] if self.pending else self.active

    def set_pending(self, value: Any, active_from: int) -> None:
        """Queue `value` to become active at global step `active_from`; None or the newest itself is no news."""
        if value is None or value is self.latest:
            return
        if self.pending and active_from < self.pending[-1][0]:
            raise AssertionError(f"activation steps must not decrease: {active_from} after {self.pending[-1][0]}")
        self.pending.append((active_from, value))

    def activate(self, step: int) -> bool:
        """Promote the newest pending preconditioner due at `step`; True if `active` changed."""
        due = [i for i, (at, _) in enumerate(self.pending) if at <= step]
        if not due:
            return False
        self.active = self.pending[due[-1]][1]
        self.pending = self.pending[due[-1] + 1 :]
        return True

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Tensors and ints of the state (the caller prefixes the keys with the layer's name)."""

    @abstractmethod
    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore `state_dict` output; CheckpointError names what is missing or malformed."""

    def snapshot(self) -> RefreshState:
        """A copy that later folds and activations of this state do not change (tensors are replaced, not mutated)."""
        out = copy.copy(self)
        out.pending = list(self.pending)
        return out


class Family(Protocol):
    """The math of one preconditioner family (see the module doc). Parts are single capital letters."""

    name: str
    parts: tuple[str, ...]
    kl_clip: float | None
    """kappa of the KL-clip over all layers (None: no clipping)."""
    stats_dtype: str
    """dtype of statistics and of their broadcast buffers."""
    refresh_every: int
    """The refresh period of every layer when no plan or layer timing sets it."""
    capture: str
    """The capture mode ("fused" | "deferred") when no plan or layer timing sets it."""

    def source(self, part: str) -> Source:
        """The capture that feeds `part`."""
        ...

    def new_state(self, layer: KFACLayer) -> RefreshState:
        """A layer's empty state."""
        ...

    def stats_shape(self, layer: KFACLayer, part: str) -> tuple[int, ...]:
        """Shape of the statistic of `part` (what SYNC all-reduces)."""
        ...

    def statistic(self, layer: KFACLayer, part: str, mode: str, raw: Tensor, n: int) -> Tensor:
        """One micro-batch's statistic of `part` from its capture (`mode`: the tap's "fused" or "deferred";
        `n`: samples in the global mini-batch)."""
        ...

    def fold(self, state: RefreshState, part: str, mean: Tensor) -> None:
        """Fold a refresh's mean statistic of `part` into the running statistic in `state`."""
        ...

    def decompose(self, layer: KFACLayer, state: RefreshState, part: str) -> Any:
        """The decomposition of `part`'s running statistic, None when it failed (ValueError: not ready)."""
        ...

    def pack(self, layer: KFACLayer, part: str, half: Any) -> Tensor:
        """A decomposition (or None) as one flat tensor of a size fixed per (layer, part), for a broadcast."""
        ...

    def unpack(self, layer: KFACLayer, part: str, flat: Tensor) -> Any:
        """Inverse of `pack`."""
        ...

    def combine(self, layer: KFACLayer, state: RefreshState, halves: Mapping[str, Any]) -> Any:
        """The layer's preconditioner from the decompositions of all its parts (None: keep the previous)."""
        ...

    def precondition(self, layers: Sequence[KFACLayer], grads: MutableMapping[str, Tensor],
                     states: Mapping[str, RefreshState]) -> Tensor:
        """Precondition `grads` (parameter FQN -> gradient) of `layers` in place; returns sum <P, G> (float64)."""
        ...

    def scale(self, layers: Sequence[KFACLayer], grads: MutableMapping[str, Tensor], nu: float) -> None:
        """Multiply the layers' gradients by the KL-clip factor `nu` in place."""
        ...

    def half_to_state(self, half: Any) -> dict[str, Any] | None:
        """A decomposition as tensors and strings for a checkpoint."""
        ...

    def half_from_state(self, saved: Any) -> Any:
        """Inverse of `half_to_state` (ValueError when malformed)."""
        ...
