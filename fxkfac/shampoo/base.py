"""What Shampoo and SOAP share as `fxkfac.preconditioner.Family`s: units (trainable parameters), the gradient-fed
parts L and R, their statistics and running sums, the step count, broadcast packing and checkpoint halves."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any, cast

import torch
from torch import Tensor, fx

from fxkfac.config import KFACConfig, KLClipScope
from fxkfac.errors import ConfigError
from fxkfac.passes.layers import KFACLayer
from fxkfac.planner.problem import Capture, LayerCost
from fxkfac.preconditioner import Family, RefreshState, Source, direction_dot
from fxkfac.profiler import gradient_unit_cost
from fxkfac.shampoo.layout import PARTS, Layout, ParamUnit, running_sum, side_statistic
from fxkfac.shampoo.state import BlockState

_COUNT_BYTES = 16
"""Bytes of `step_state`'s two fold counts (int64, carried bit for bit in the family's dtype)."""

__all__ = ["BlockFamily", "block_side"]


def block_side(max_preconditioner_dim: int | str, max_dim: int | None, default: int) -> int:
    """The block side: the config's int, else (for "auto") the planner's `max_dim`, else `default`."""
    if max_preconditioner_dim == "auto":
        return default if max_dim is None else max_dim
    if max_dim is not None and max_dim != max_preconditioner_dim:
        raise ConfigError(
            f"max_dim={max_dim} was given for a config whose max_preconditioner_dim is "
            f"{max_preconditioner_dim}; set max_preconditioner_dim='auto' to let the planner choose"
        )
    return int(max_preconditioner_dim)


class BlockFamily(ABC):
    """The shared half of Shampoo and SOAP. Subclasses set `name`, build `_make_layout`, `_new_state`, and the
    refresh math (decompose, combine, precondition). Refreshes happen at t = start (mod frequency)."""

    name: str
    parts: tuple[str, ...] = PARTS
    kl_clip: float | None = None
    kl_clip_scope: KLClipScope = KLClipScope.GLOBAL
    layer_config: KFACConfig = KFACConfig()
    capture: Capture = Capture.FUSED
    full_direction: bool = True
    warm_start: bool = False

    def __init__(self, *, dtype: str, frequency: int, start: int, stat_beta: float) -> None:
        self.stats_dtype = dtype
        self.refresh_every = frequency
        self.refresh_phase = start % frequency
        self.max_period: int | None = frequency  # a plan may refresh more often than asked, never less
        self.start = start
        self.stat_beta = stat_beta
        self._layouts: dict[str, Layout] = {}

    @property
    def dtype(self) -> torch.dtype:
        """The torch dtype of statistics, roots and bases."""
        dtype: torch.dtype = getattr(torch, self.stats_dtype)
        return dtype

    def layout(self, unit: ParamUnit) -> Layout:
        """The unit's layout (made once per unit)."""
        if unit.name not in self._layouts:
            self._layouts[unit.name] = self._make_layout(unit)
        return self._layouts[unit.name]

    @abstractmethod
    def _make_layout(self, unit: ParamUnit) -> Layout:
        """The unit's view, blocks and factors under the family's config."""

    @abstractmethod
    def _new_state(self, layout: Layout) -> BlockState:
        """An empty state of the family's kind for a unit of this layout."""

    def source(self, part: str) -> Source:
        """Both parts come from the parameter's complete gradient."""
        return Source.GRADIENT

    def units(self, gm: fx.GraphModule, layers: Sequence[KFACLayer]) -> list[ParamUnit]:
        """One unit per trainable parameter of `gm`, by FQN."""
        return [ParamUnit(n, tuple(p.shape)) for n, p in gm.named_parameters() if p.requires_grad]

    def new_state(self, unit: ParamUnit) -> BlockState:
        """Nothing folded, no roots or bases."""
        return self._new_state(self.layout(unit))

    def stats_shape(self, unit: ParamUnit, part: str) -> tuple[int, ...]:
        """The flat statistic of the part (all its blocks' factors, see fxkfac/shampoo/layout.py)."""
        return (self.layout(unit).size(part),)

    def gradient(self, unit: ParamUnit, grad: Tensor | None, param: Tensor) -> Tensor:
        """The gradient the statistics see, in the view shape (a missing one is zero); Shampoo adds L2 decay."""
        g = torch.zeros_like(param) if grad is None else grad
        return g.detach().reshape(self.layout(unit).view)

    def statistic(self, unit: ParamUnit, part: str, mode: Capture | None, raw: Tensor, n: int) -> Tensor:
        """The step's flat statistic of `part` from the parameter `raw` and its complete `.grad`."""
        grad = self.gradient(unit, raw.grad, raw.detach())
        return side_statistic(self.layout(unit), part, grad.to(self.dtype))

    def fold(self, state: RefreshState, part: str, mean: Tensor) -> None:
        """Running sum of the part (EMA with the family's beta, plain sum at 1), counted per part."""
        if not isinstance(state, BlockState):
            raise AssertionError(f"a {self.name} part folded into another family's state")
        state.folds = {**state.folds, part: state.folds[part] + 1}
        if part == "L":
            state.L = running_sum(state.L, mean, self.stat_beta)
        else:
            state.R = running_sum(state.R, mean, self.stat_beta)

    def fold_gradient(self, unit: ParamUnit, state: RefreshState, part: str, raw: Tensor) -> None:
        """`fold` of the step's `statistic` of `part` from `raw`: for a `Grid` layout folded by the statistic's own
        batched product (beta old + (1 - beta) G G^T as one `torch.baddbmm`, no pass over the statistic alone); a part
        without factors (the R of a vector, SOAP's identity sides) only counts the fold."""
        layout, old = self.layout(unit), getattr(state, part, None)
        if old is not None and layout.size(part) == 0 and isinstance(state, BlockState):  # a trivial part (no factor)
            state.folds = {**state.folds, part: state.folds[part] + 1}  # stays empty: only its count moves
            return
        grid = layout.grid
        if grid is None or old is None or self.stat_beta == 1.0 or not isinstance(state, BlockState):
            self.fold(state, part, self.statistic(unit, part, None, raw, 1))
            return
        blocks = grid.split(self.gradient(unit, raw.grad, raw.detach()).to(self.dtype))
        side = blocks if part == "L" else blocks.transpose(1, 2)
        beta = self.stat_beta
        new = torch.baddbmm(grid.factors(old, part), side, side.transpose(1, 2), beta=beta, alpha=1.0 - beta)
        state.folds = {**state.folds, part: state.folds[part] + 1}
        setattr(state, part, new.reshape(-1))

    def statistic_to_decompose(self, unit: ParamUnit, state: RefreshState, part: str) -> Tensor | None:
        """The folded statistic of `part` in `state` (a snapshot after the part's fold), or None when it was taken
        at a step before start_preconditioning_step (nothing to decompose yet); ValueError if never folded."""
        if not isinstance(state, BlockState):
            raise AssertionError(f"a {self.name} part decomposed from another family's state")
        if state.folds[part] - 1 < self.start:
            return None
        stats = state.L if part == "L" else state.R
        if stats is None:
            raise ValueError(f"part {part} of {unit.name} is decomposed before it was ever folded")
        return stats

    def pack(self, unit: ParamUnit, part: str, half: Tensor | None) -> Tensor:
        """``[ok, flat]`` of the part's layout size; ok=0 for a failed or unwanted decomposition."""
        out = torch.zeros(1 + self.layout(unit).size(part), dtype=self.dtype)
        if half is not None:
            out[0], out[1:] = 1.0, half
        return out

    def unpack(self, unit: ParamUnit, part: str, flat: Tensor) -> Tensor | None:
        """Inverse of `pack`."""
        return flat[1:].clone() if float(flat[0]) != 0.0 else None

    def params_of(self, unit: ParamUnit) -> tuple[str, ...]:
        """The unit's parameter."""
        return (unit.name,)

    def clip_scale(self, dot_sum: float, lr: float) -> float:
        """1.0: these families have no KL-clip."""
        return 1.0

    def unit_cost(self, units: Mapping[str, Any], params: Mapping[str, Tensor]) -> Callable[[str, int], LayerCost]:
        """Each parameter's statistics, roots and preconditioning timed through this family's own methods on a
        random gradient of its shape (`gradient_unit_cost`)."""
        return gradient_unit_cost(cast(Family, self), units, params)  # each concrete subclass is a Family

    def write_directions(
        self, units: Sequence[ParamUnit], directions: Sequence[Tensor], grads: MutableMapping[str, Tensor]
    ) -> Tensor:
        """Replace each unit's gradient by its direction P; returns sum <P, G>, left at 0 without a KL-clip (which
        alone reads it)."""
        dot = torch.zeros((), dtype=torch.float64)
        for unit, p in zip(units, directions, strict=True):
            grad = grads[unit.name]
            p = p.reshape(grad.shape)
            if self.kl_clip is not None:
                dot = dot + direction_dot(cast(Family, self), p, grad)
            grad.copy_(p)
        return dot

    def scale(self, units: Sequence[Any], grads: MutableMapping[str, Tensor], nu: float) -> None:
        """Multiply the directions by `nu` (unused: these families have no KL-clip)."""
        for unit in units:
            if grads.get(unit.name) is not None:
                grads[unit.name].mul_(nu)

    def step_tensors(self, state: BlockState) -> tuple[str, ...]:
        """The tensors of `state` that the per-step work may make: all its `TENSORS` (Shampoo leaves out those its
        config never makes)."""
        return state.TENSORS

    def step_state(self, unit: ParamUnit, state: RefreshState) -> Tensor:
        """``[folds.L, folds.R (their int64 bytes), present flag per tensor, each tensor flat (zeros when absent)]``
        in the family's dtype (the tensors' own: exact, half float64's bytes), over the `step_tensors` alone (its size
        depends on the unit and the config): what a helper that folds and applies a streamed unit returns to its
        owners."""
        if not isinstance(state, BlockState):
            raise AssertionError(f"a {self.name} state packed from another family's state")
        shapes, names = self.new_state(unit).shapes, self.step_tensors(state)
        values = [getattr(state, k) for k in names]
        sizes = [math.prod(shapes[k]) for k in names]
        counts = torch.tensor([state.folds["L"], state.folds["R"]], dtype=torch.int64).view(self.dtype)
        head = _COUNT_BYTES // self.dtype.itemsize
        out = torch.empty(head + len(values) + sum(sizes), dtype=self.dtype)  # one buffer: each tensor copied in
        out[:head] = counts
        at = head + len(values)
        for i, (value, size) in enumerate(zip(values, sizes, strict=True)):
            out[head + i] = 0.0 if value is None else 1.0
            if value is None:
                out[at : at + size].zero_()
            else:
                out[at : at + size].copy_(value.reshape(-1))
            at += size
        return out

    def load_step_state(self, unit: ParamUnit, state: RefreshState, flat: Tensor) -> None:
        """Inverse of `step_state`, each tensor a copy (`flat` may be a view of a received message; the others, which
        stay None, untouched)."""
        if not isinstance(state, BlockState):
            raise AssertionError(f"a {self.name} state unpacked into another family's state")
        shapes, names = self.new_state(unit).shapes, self.step_tensors(state)
        flat = flat.cpu()
        head = _COUNT_BYTES // self.dtype.itemsize
        left, right = flat[:head].view(torch.int64).tolist()
        state.folds = {"L": left, "R": right}
        at = head + len(names)
        for i, k in enumerate(names):
            size = math.prod(shapes[k])
            value = flat[at : at + size].reshape(shapes[k]).clone() if float(flat[head + i]) != 0.0 else None
            setattr(state, k, value)
            at += size

    def half_to_state(self, half: Tensor | None) -> dict[str, Any] | None:
        """The flat roots or bases of one part."""
        return None if half is None else {"flat": half}

    def half_from_state(self, saved: Any) -> Tensor | None:
        """Inverse of `half_to_state`; ValueError when malformed."""
        if saved is None:
            return None
        if not isinstance(saved, dict) or not isinstance(saved.get("flat"), Tensor):
            raise ValueError(f"a {self.name} decomposition must be {{'flat': tensor}}, got {type(saved).__name__}")
        return saved["flat"]
