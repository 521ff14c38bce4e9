"""The preconditioner interface: what a second-order family declares so that the runtime runs its refreshes.

A family preconditions the gradients of *units* it finds in the captured graph (K-FAC: Linear/Conv2d
layers; Shampoo and SOAP: parameters). Each unit has *parts* (K-FAC: the input-side factor A and the
output-side factor B; Shampoo: the row and column statistics L and R). A part's statistic comes from a
capture of the layer (`Source.INPUT`, `Source.OUTPUT_GRAD`: accumulated per micro-batch at refresh steps,
summed over the stage's copies, then folded) or from the unit's complete gradient (`Source.GRADIENT`:
folded at every step, after the stage's gradient all-reduce and before its APPLY). A refresh decomposes
each part as folded at its refresh step (possibly on another rank, then broadcast), combines the parts into
the unit's new preconditioner, and applies it to the gradients from a later step on. The runtime
(fxkfac/runtime/preconditioning.py) owns the refresh records, collectives, staleness and checkpoints of
that life cycle; a family owns only the math. K-FAC (fxkfac/kfac/family.py) is the first family; a new one
is a class with these methods, with no edit to the interpreter, the runtime or the planner's solver.
"""

from __future__ import annotations

import copy
import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from enum import StrEnum
from typing import Any, Protocol, cast, runtime_checkable

import torch
from torch import Tensor, fx

from fxkfac.config import KFACConfig, KLClipScope
from fxkfac.passes.layers import KFACLayer
from fxkfac.planner.problem import Capture, LayerCost

__all__ = [
    "Source",
    "RefreshState",
    "Family",
    "PiecewiseFamily",
    "SplitApplyFamily",
    "SteppedFamily",
    "gradient_parts",
    "direction_dot",
    "fold_gradient",
]


class Source(StrEnum):
    """What feeds a part's statistic: a layer's input (after FWD), its output gradient (after BWD), or the
    unit's complete gradient (every step, after the stage's gradient all-reduce)."""

    INPUT = "a"
    OUTPUT_GRAD = "e"
    GRADIENT = "g"


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

    def with_preconditioners_of(self, live: RefreshState) -> RefreshState:
        """This snapshot's statistics with `live`'s active and pending preconditioners: a refresh decomposes what
        was folded at its step, warm-started (SOAP's QR basis, split inversions) from the layer's newest
        preconditioner when its DECOMP runs, as on one device, however late the plan runs it."""
        out = self.snapshot()
        out.active, out.pending = live.active, list(live.pending)
        return out


class Family(Protocol):
    """The math of one preconditioner family (see the module doc). Parts are single capital letters.

    A *unit* is the family's own object naming what it preconditions (`unit.name` is unique in the model;
    K-FAC: `KFACLayer`); the runtime hands units back to the family's methods and reads only their names.
    """

    name: str
    parts: tuple[str, ...]
    kl_clip: float | None
    """kappa of the KL-clip over all layers (None: no clipping)."""
    kl_clip_scope: KLClipScope
    """Over which layers the KL-clip's sum runs, and so which ranks a step's end waits for (`KLClipScope.barrier`:
    what the planner prices). K-FAC's option; a family that clips nothing ends its steps GLOBAL."""
    layer_config: KFACConfig
    """Which Linear/Conv2d layers capture finds: the units of a family that preconditions layers, and the layer tags
    the stage split carries for every family (K-FAC: its own config; others: the default KFACConfig())."""
    stats_dtype: str
    """dtype of statistics and of their broadcast buffers."""
    refresh_every: int
    """The refresh period of every layer when no plan or layer timing sets it."""
    capture: Capture
    """The capture mode when no plan or layer timing sets it (unused by GRADIENT parts)."""
    refresh_phase: int
    """Refreshes happen at steps t with ``t % refresh_every == refresh_phase`` when no plan sets the timing."""
    max_period: int | None
    """The longest refresh period a plan may give a unit (Shampoo/SOAP: precondition_frequency, which the user
    asks for; K-FAC: None, the planner chooses as PipeFisher does)."""
    warm_start: bool
    """True when a decomposition starts from the unit's newest preconditioner (SOAP's QR basis, K-FAC's split
    inverse): a plan then makes and broadcasts each refresh before the next one's first DECOMP starts, so that
    start is the previous refresh's, as on one device (`Problem.warm_start`)."""
    full_direction: bool
    """True when `precondition` yields the whole update direction (Shampoo, SOAP: grafting, momentum and weight
    decay included), so the base optimizer must be plain SGD; False when the base optimizer adds its own."""

    def units(self, gm: fx.GraphModule, layers: Sequence[KFACLayer]) -> list[Any]:
        """The units this family preconditions in the captured graph `gm` (whose K-FAC layers are `layers`)."""
        ...

    def source(self, part: str) -> Source:
        """The capture that feeds `part`."""
        ...

    def new_state(self, unit: Any) -> RefreshState:
        """A unit's empty state."""
        ...

    def stats_shape(self, unit: Any, part: str) -> tuple[int, ...]:
        """Shape of the statistic of `part` (what SYNC all-reduces; GRADIENT parts are never synced)."""
        ...

    def statistic(self, unit: Any, part: str, mode: Capture | None, raw: Tensor, n: int) -> Tensor:
        """The statistic of `part`: for a captured part, one micro-batch's from its capture `raw` (`mode`: how the
        tap took it); for a GRADIENT part, the step's from `raw`, the unit's parameter with its complete `.grad`
        (`mode` None). `n`: samples in the global mini-batch."""
        ...

    def fold(self, state: RefreshState, part: str, mean: Tensor) -> None:
        """Fold a refresh's mean statistic of `part` (a GRADIENT part: the step's) into the running statistic in
        `state`, replacing its tensors (never mutating them: `RefreshState.snapshot` relies on it)."""
        ...

    def decompose(self, unit: Any, state: RefreshState, part: str) -> Any:
        """The decomposition of `part`'s running statistic in `state` (for a GRADIENT part, a snapshot taken at
        its refresh step), None when it failed or is not wanted yet (ValueError: not ready)."""
        ...

    def pack(self, unit: Any, part: str, half: Any) -> Tensor:
        """A decomposition (or None) as one flat tensor of a size fixed per (unit, part), for a broadcast."""
        ...

    def unpack(self, unit: Any, part: str, flat: Tensor) -> Any:
        """Inverse of `pack`."""
        ...

    def combine(self, unit: Any, state: RefreshState, halves: Mapping[str, Any]) -> Any:
        """The unit's preconditioner from the decompositions of all its parts (None: keep the previous)."""
        ...

    def precondition(
        self,
        units: Sequence[Any],
        grads: MutableMapping[str, Tensor],
        states: Mapping[str, RefreshState],
        params: Mapping[str, Tensor],
    ) -> Tensor:
        """Turn `grads` (parameter FQN -> gradient) of `units` in place into the direction the base optimizer
        steps along (`params`: the parameters by FQN, read-only); returns sum <P, G> (float64; `direction_dot`: 0
        for a family without a KL-clip)."""
        ...

    def clip_scale(self, dot_sum: float, lr: float) -> float:
        """nu, the KL-clip factor of a clip group's gradients, from the group's sum <P, G> at learning rate `lr`
        (1.0: no clipping; what the step's end hands to `scale`)."""
        ...

    def scale(self, units: Sequence[Any], grads: MutableMapping[str, Tensor], nu: float) -> None:
        """Multiply the units' gradients by the KL-clip factor `nu` in place."""
        ...

    def params_of(self, unit: Any) -> tuple[str, ...]:
        """The parameter FQNs whose gradients `precondition` turns into the unit's direction (what a grad worker
        broadcasts to the copies that do not precondition the unit)."""
        ...

    def unit_cost(self, units: Mapping[str, Any], params: Mapping[str, Tensor]) -> Callable[[str, int], LayerCost]:
        """How `plan="auto"` times one unit (`fxkfac.profiler.UnitCost`: unit name, rows of one micro-batch ->
        its LayerCost), given the units and the model's parameters by name; ConfigError when the family cannot be
        profiled (the user then passes `PlanOptions(costs=...)`)."""
        ...

    def half_to_state(self, half: Any) -> dict[str, Any] | None:
        """A decomposition as tensors and strings for a checkpoint."""
        ...

    def half_from_state(self, saved: Any) -> Any:
        """Inverse of `half_to_state` (ValueError when malformed)."""
        ...


@runtime_checkable
class PiecewiseFamily(Protocol):
    """A family whose decompositions a plan may run in pieces, ``DECOMP s F i/n unit`` (K-FAC with
    `KFACConfig.split_inverse`): piece i hands a carry to piece i+1, the last makes what `decompose` makes."""

    decomp_pieces: int
    """n: the pieces of every decomposition (1: whole DECOMPs only)."""

    def decompose_piece(self, unit: Any, state: RefreshState, part: str, index: int, carry: Any) -> Any:
        """Piece `index` of `decompose`: the carry for the next piece, or after the last what `decompose` returns
        (piece 0 ignores `carry`; ValueError: not ready or no such piece)."""
        ...

    def carry_to_state(self, carry: Any) -> dict[str, Any] | None:
        """A carry as tensors for a checkpoint."""
        ...

    def carry_from_state(self, saved: Any) -> Any:
        """Inverse of `carry_to_state` (ValueError when malformed)."""
        ...


@runtime_checkable
class SplitApplyFamily(Protocol):
    """A family whose APPLY of one unit is three calls (Muon): the owner's `apply_input` (which updates the unit's
    state), the stateless `apply_core`, which a plan may run on another rank (a streamed APPLY: the input goes as
    LGRAD, the core's output comes back as PGRAD) or in pieces (``APPLY s i/n unit``, in order on one rank), and the
    owner's `apply_output`, the direction. `precondition` is the three in a row, one piece."""

    def apply_input(self, unit: Any, grad: Tensor, state: RefreshState, param: Tensor) -> Tensor:
        """The core's input from the unit's complete gradient (updating `state`)."""
        ...

    def apply_core(self, unit: Any, x: Tensor, index: int, pieces: int) -> Tensor:
        """Piece `index` of `pieces` of the core: piece 0 takes `apply_input`'s output, each hands its result to the
        next, the last returns what `apply_output` takes."""
        ...

    def apply_output(self, unit: Any, core: Tensor, param: Tensor) -> Tensor:
        """The unit's direction (what `precondition` writes into its gradient) from the core's output."""
        ...


@runtime_checkable
class SteppedFamily(Protocol):
    """A family whose per-step work keeps state in the unit: statistics folded from the reduced gradient and the
    optimizer's tensors (Shampoo, SOAP). A helper that runs a streamed unit's per-step work holds that state and
    returns it with each result, so every owner keeps the unit's whole state (docs/STREAMED_APPLY.md, "Stateful
    units")."""

    def step_state(self, unit: Any, state: RefreshState) -> Tensor:
        """The per-step part of `state` (fold counts, statistics, optimizer tensors) as one flat tensor whose size and
        dtype depend on the unit alone."""
        ...

    def load_step_state(self, unit: Any, state: RefreshState, flat: Tensor) -> None:
        """Inverse of `step_state`: replace those tensors of `state` (never mutating them)."""
        ...

    def fold_gradient(self, unit: Any, state: RefreshState, part: str, raw: Tensor) -> None:
        """`Family.fold` of the step's `Family.statistic` of a GRADIENT part from `raw` (the unit's parameter with its
        complete `.grad`), equal up to rounding, where the family can fuse the two (a new tensor in `state`)."""
        ...


def gradient_parts(family: Family) -> frozenset[str]:
    """The parts of `family` fed by the reduced gradient (the others are fed by captures the stages must tap)."""
    return frozenset(part for part in family.parts if family.source(part) is Source.GRADIENT)


def direction_dot(family: Family, p: Tensor, grad: Tensor) -> Tensor:
    """<P, G> of one unit in float64 (a 0-d tensor), what its APPLY adds to its KL-clip group's sum; 0 for a family
    without a KL-clip (Shampoo, SOAP, Muon), whose `clip_scale` reads no sum, so no step pays for it."""
    if family.kl_clip is None:
        return torch.zeros((), dtype=torch.float64, device=p.device)
    return (p.double() * grad.double()).sum()


def fold_gradient(family: Family, unit: Any, state: RefreshState, part: str, raw: Tensor, n: int) -> None:
    """Fold the step's statistic of the GRADIENT part `part` of `unit` from `raw` (its parameter with its complete
    `.grad`; `n`: samples in the global mini-batch): the family's fused `SteppedFamily.fold_gradient` where it has
    one, else its `fold` of its `statistic`."""
    if _is_stepped(type(family)):
        cast(SteppedFamily, family).fold_gradient(unit, state, part, raw)
    else:
        family.fold(state, part, family.statistic(unit, part, None, raw, n))


@functools.cache
def _is_stepped(kind: type) -> bool:
    """Whether a family class implements `SteppedFamily`, checked once per class: the Protocol's runtime check takes
    tens of microseconds, and `fold_gradient` runs for every unit and part at every step."""
    return issubclass(kind, SteppedFamily)
