"""A second preconditioner family for the tests: AdaGrad-like diagonal statistics of the output gradient.

It exists to show that a family is addable through `fxkfac.preconditioner.Family` alone: one part "D" fed by
the output-gradient capture, a "decompose" that takes (D + eps)^-1/2, and rows of each weight gradient scaled
by it. Nothing in the interpreter, the runtime or the planner names it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

import torch
from torch import Tensor, fx

from fxkfac.config import KFACConfig, KLClipScope
from fxkfac.errors import ConfigError
from fxkfac.kfac.factors import e_rows, running_average
from fxkfac.kfac.precondition import kl_clip_scale
from fxkfac.passes.layers import KFACLayer
from fxkfac.planner.problem.costs import LayerCost
from fxkfac.preconditioner import RefreshState, Source


class DiagonalState(RefreshState):
    """The running mean square of a layer's output gradients, and pending/active (D + eps)^-1/2."""

    def __init__(self) -> None:
        super().__init__()
        self.D: Tensor | None = None

    def state_dict(self) -> dict[str, Any]:
        """Tensors and ints."""
        out: dict[str, Any] = {"refreshes": self.refreshes, "pending_count": len(self.pending)}
        if self.D is not None:
            out["D"] = self.D
        if self.active is not None:
            out["active"] = self.active
        for i, (at, value) in enumerate(self.pending):
            out[f"pending.{i}.step"], out[f"pending.{i}.value"] = at, value
        return out

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Inverse of `state_dict`."""
        self.refreshes, self.D, self.active = int(sd["refreshes"]), sd.get("D"), sd.get("active")
        self.pending = [(int(sd[f"pending.{i}.step"]), sd[f"pending.{i}.value"]) for i in range(sd["pending_count"])]


def row_scale(layer: KFACLayer, grads: MutableMapping[str, Tensor], scale: Tensor) -> Tensor:
    """Multiply each output row of the layer's weight (and bias) gradient by `scale`; returns <P, G>."""
    weight = grads[layer.weight]
    w = weight.t() if layer.weight_transposed else weight
    dot = (w.double() ** 2 * scale.double().view(-1, *([1] * (w.dim() - 1)))).sum()
    w.mul_(scale.view(-1, *([1] * (w.dim() - 1))).to(w.dtype))
    if layer.bias is not None and grads.get(layer.bias) is not None:
        bias = grads[layer.bias]
        dot = dot + (bias.double() ** 2 * scale.double()).sum()
        bias.mul_(scale.to(bias.dtype))
    return dot


class DiagonalFamily:
    """`Family` with one part, D = running mean of squared per-sample output gradients; P = (D + eps)^-1/2 G."""

    name = "diagonal"
    parts: tuple[str, ...] = ("D",)
    stats_dtype = "float32"
    capture: str = "deferred"
    refresh_phase = 0
    max_period: int | None = None
    full_direction = False
    warm_start = False
    kl_clip_scope = KLClipScope.GLOBAL
    layer_config = KFACConfig()

    def __init__(
        self, eps: float = 1e-2, decay: float = 0.9, refresh_every: int = 1, kl_clip: float | None = None
    ) -> None:
        self.eps, self.decay, self.refresh_every, self.kl_clip = eps, decay, refresh_every, kl_clip

    def source(self, part: str) -> Source:
        """The output gradient."""
        return Source.OUTPUT_GRAD

    def units(self, gm: fx.GraphModule, layers: Sequence[KFACLayer]) -> list[KFACLayer]:
        """The layers K-FAC would precondition."""
        return list(layers)

    def new_state(self, layer: KFACLayer) -> DiagonalState:
        """Nothing seen yet."""
        return DiagonalState()

    def stats_shape(self, layer: KFACLayer, part: str) -> tuple[int, ...]:
        """One value per output unit."""
        return (layer.d_out,)

    def statistic(self, layer: KFACLayer, part: str, mode: str, raw: Tensor, n: int) -> Tensor:
        """Mean over rows of the squared per-sample output gradient (the diagonal of K-FAC's B_m)."""
        if mode == "fused":
            return (torch.diagonal(raw) * (n * n)).float()
        return (e_rows(raw, layer, n).float() ** 2).mean(0)

    def fold(self, state: RefreshState, part: str, mean: Tensor) -> None:
        """Running average."""
        assert isinstance(state, DiagonalState)
        state.D = running_average(state.D, mean, self.decay)

    def decompose(self, layer: KFACLayer, state: RefreshState, part: str) -> Tensor | None:
        """(D + eps)^-1/2, None when D is not finite."""
        assert isinstance(state, DiagonalState) and state.D is not None
        root = (state.D + self.eps).rsqrt()
        return root if bool(torch.isfinite(root).all()) else None

    def pack(self, layer: KFACLayer, part: str, half: Tensor | None) -> Tensor:
        """[ok, values]."""
        out = torch.zeros(layer.d_out + 1)
        if half is not None:
            out[0], out[1:] = 1.0, half
        return out

    def unpack(self, layer: KFACLayer, part: str, flat: Tensor) -> Tensor | None:
        """Inverse of `pack`."""
        return flat[1:].clone() if float(flat[0]) else None

    def combine(self, layer: KFACLayer, state: RefreshState, halves: Mapping[str, Any]) -> Tensor | None:
        """The one part is the whole preconditioner."""
        return halves["D"]

    def precondition(
        self,
        layers: Sequence[KFACLayer],
        grads: MutableMapping[str, Tensor],
        states: Mapping[str, RefreshState],
        params: Mapping[str, Tensor],
    ) -> Tensor:
        """Rows scaled by the active (D + eps)^-1/2; layers without one keep G."""
        dot = torch.zeros((), dtype=torch.float64)
        for layer in layers:
            if grads.get(layer.weight) is None:
                continue
            active = states[layer.name].active
            scale = active if active is not None else torch.ones(layer.d_out)
            dot = dot + row_scale(layer, grads, scale)
        return dot

    def params_of(self, layer: KFACLayer) -> tuple[str, ...]:
        """The layer's weight and bias."""
        return (layer.weight,) if layer.bias is None else (layer.weight, layer.bias)

    def clip_scale(self, dot_sum: float, lr: float) -> float:
        """K-FAC's KL-clip formula with this family's kappa."""
        return kl_clip_scale(dot_sum, lr, self.kl_clip)

    def unit_cost(self, units: Mapping[str, Any], params: Mapping[str, Tensor]) -> Callable[[str, int], LayerCost]:
        """Not profiled: the tests give plan="auto" a cost table."""
        raise ConfigError(
            "plan='auto' cannot profile diagonal, whose part is fed by captures: pass PlanOptions(costs=...)"
        )

    def scale(self, layers: Sequence[KFACLayer], grads: MutableMapping[str, Tensor], nu: float) -> None:
        """The KL-clip factor."""
        for layer in layers:
            for key in (layer.weight, layer.bias):
                if key is not None and grads.get(key) is not None:
                    grads[key].mul_(nu)

    def half_to_state(self, half: Tensor | None) -> dict[str, Any] | None:
        """The values."""
        return None if half is None else {"d": half}

    def half_from_state(self, saved: Any) -> Tensor | None:
        """Inverse of `half_to_state`."""
        return None if saved is None else saved["d"]
