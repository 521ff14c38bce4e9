"""K-FAC as a preconditioner family: parts A (layer input) and B (output gradient), damped inverses, KL-clip."""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

import torch
from torch import Tensor, fx

from fxkfac.config import KFACConfig
from fxkfac.kfac.factors import a_rows, e_rows, factor, running_average
from fxkfac.kfac.inverse import FactorInverse, Inverse, combine, combine_shift, factor_dampings, invert_factor
from fxkfac.kfac.precondition import Preconditioner, kl_clip_scale
from fxkfac.kfac.split_inverse import (
    Carry,
    carry_from_state,
    carry_to_state,
    first_carry,
    previous_half,
    split_finish,
    split_invert_factor,
    split_piece,
)
from fxkfac.kfac.state import LayerState
from fxkfac.passes.layers import KFACLayer
from fxkfac.planner.problem import Capture, InverseMethod, LayerCost
from fxkfac.preconditioner import RefreshState, Source
from fxkfac.profiler import kfac_unit_cost

__all__ = ["KFACFamily"]


class KFACFamily:
    """The `fxkfac.preconditioner.Family` of K-FAC with `KFACConfig` (semantics: docs/ARCHITECTURE.md)."""

    name = "kfac"
    parts: tuple[str, ...] = ("A", "B")
    refresh_phase = 0
    max_period: int | None = None
    full_direction = False

    def __init__(self, cfg: KFACConfig) -> None:
        self.cfg = cfg
        self.kl_clip = cfg.kl_clip
        self.kl_clip_scope = cfg.kl_clip_scope
        self.layer_config = cfg
        self.stats_dtype = cfg.factor_dtype
        self.refresh_every = cfg.refresh_every
        self.capture: Capture = cfg.capture
        self.warm_start = cfg.split_inverse is not None  # Newton-Schulz from the previous inverse

    def source(self, part: str) -> Source:
        """A from the layer's input, B from its output gradient."""
        return Source.INPUT if part == "A" else Source.OUTPUT_GRAD

    def units(self, gm: fx.GraphModule, layers: Sequence[KFACLayer]) -> list[KFACLayer]:
        """The K-FAC layers capture found."""
        return list(layers)

    def new_state(self, layer: KFACLayer) -> LayerState:
        """No factors, no inverse."""
        return LayerState(layer.a_dim, layer.b_dim)

    def stats_shape(self, layer: KFACLayer, part: str) -> tuple[int, int]:
        """A is a_dim x a_dim (bias column included), B is b_dim x b_dim."""
        dim = layer.a_dim if part == "A" else layer.b_dim
        return (dim, dim)

    def statistic(self, layer: KFACLayer, part: str, mode: Capture | None, raw: Tensor, n: int) -> Tensor:
        """A_m or B_m: fused captures are the factor already (B scaled by n^2), deferred ones rows to square."""
        dtype = getattr(torch, self.cfg.factor_dtype)
        if mode is Capture.FUSED:
            return raw.to(dtype) if part == "A" else (raw * (n * n)).to(dtype)
        rows = a_rows(raw, layer) if part == "A" else e_rows(raw, layer, n)
        return factor(rows, dtype)

    def fold(self, state: RefreshState, part: str, mean: Tensor) -> None:
        """Running average of the factor: the first refresh takes the mean as it is."""
        if not isinstance(state, LayerState):
            raise AssertionError("a K-FAC part folded into another family's state")
        if part == "A":
            state.A = running_average(state.A, mean, self.cfg.factor_decay)
        else:
            state.B = running_average(state.B, mean, self.cfg.factor_decay)

    def decompose(self, layer: KFACLayer, state: RefreshState, part: str) -> FactorInverse | None:
        """One factor's damped inverse (ValueError when pi-damping lacks the other factor)."""
        f, gamma = self._factor(layer, state, part)
        if self.cfg.split_inverse is not None:
            return split_invert_factor(
                f,
                gamma,
                self.cfg.split_inverse,
                previous=previous_half(state.latest, part),
                max_retries=self.cfg.max_cholesky_retries,
                name=layer.name,
                side=part,
            )
        return invert_factor(
            f, gamma, method=self.cfg.inverse, max_retries=self.cfg.max_cholesky_retries, name=layer.name, side=part
        )

    @property
    def decomp_pieces(self) -> int:
        """How many DECOMP pieces one factor's inverse is made in (`KFACConfig.split_inverse`; 1: one task)."""
        return 1 if self.cfg.split_inverse is None else self.cfg.split_inverse.pieces

    def decompose_piece(self, layer: KFACLayer, state: RefreshState, part: str, index: int, carry: Carry) -> Any:
        """Piece `index` of `decompose` (`fxkfac.kfac.split_inverse`): the carry for the next piece, or after the
        last piece what `decompose` returns. Piece 0 ignores `carry` and starts from the layer's latest inverse."""
        split = self.cfg.split_inverse
        if split is None or not 0 <= index < split.pieces:
            raise ValueError(f"{layer.name} {part}: piece {index} of a decomposition made in {self.decomp_pieces}")
        f, gamma = self._factor(layer, state, part)
        if index == 0:
            carry = first_carry(split, previous_half(state.latest, part), f.shape[0])
        retries = self.cfg.max_cholesky_retries
        carry = split_piece(f, gamma, split, index, carry, max_retries=retries, name=layer.name, side=part)
        if index < split.pieces - 1:
            return carry
        return split_finish(f, gamma, split, carry, max_retries=retries, name=layer.name, side=part)

    def carry_to_state(self, carry: Carry) -> dict[str, Any] | None:
        """A split decomposition in flight as tensors (`fxkfac.kfac.split_inverse.carry_to_state`)."""
        return carry_to_state(carry)

    def carry_from_state(self, saved: Any) -> Carry:
        """Inverse of `carry_to_state`."""
        return carry_from_state(saved)

    def _factor(self, layer: KFACLayer, state: RefreshState, part: str) -> tuple[Tensor, float]:
        """The folded factor `part` and its damping (ValueError when it, or pi-damping's other factor, is missing)."""
        if not isinstance(state, LayerState):
            raise AssertionError("a K-FAC part decomposed from another family's state")
        if self.cfg.pi_damping and (state.A is None or state.B is None):
            raise ValueError(
                f"pi-damping needs both factors of {layer.name} folded before either is inverted; "
                "put both SYNC_STATS ops before the DECOMP ops"
            )
        f = state.A if part == "A" else state.B
        if f is None:
            raise ValueError(f"factor {part} of {layer.name} is inverted before it was ever folded")
        return f, self._gammas(state)[0 if part == "A" else 1]

    def _gammas(self, state: LayerState) -> tuple[float, float, float]:
        """(gamma_A, gamma_B, shift) of `factor_dampings` (pi-damping reads both factors once both exist)."""
        pi = self.cfg.pi_damping and state.A is not None and state.B is not None
        return factor_dampings(state.A, state.B, damping=self.cfg.damping, method=self.cfg.inverse, pi_damping=pi)

    def combine(self, layer: KFACLayer, state: RefreshState, halves: Mapping[str, Any]) -> Inverse | None:
        """The layer's Inverse from both halves; None when either failed (the previous one stays)."""
        a, b = halves["A"], halves["B"]
        if a is None or b is None or not isinstance(state, LayerState):
            return None
        cfg = self.cfg
        return combine(a, b, combine_shift(damping=cfg.damping, method=cfg.inverse, pi_damping=cfg.pi_damping))

    def packed_size(self, layer: KFACLayer, part: str) -> int:
        """[ok, inverse] (Cholesky) or [ok, eigenvectors, eigenvalues] (eigen)."""
        dim = self.stats_shape(layer, part)[0]
        return 1 + dim * dim + (dim if self.cfg.inverse == InverseMethod.EIGEN else 0)

    def pack(self, layer: KFACLayer, part: str, half: FactorInverse | None) -> Tensor:
        """``[ok, payload]``; ok=0 for a failed inversion."""
        dim = self.stats_shape(layer, part)[0]
        out = torch.zeros(self.packed_size(layer, part), dtype=getattr(torch, self.cfg.factor_dtype))
        if half is None:
            return out
        out[0] = 1.0
        if half.inv is not None:
            out[1:] = half.inv.reshape(-1)
        elif half.q is not None and half.l is not None:
            out[1 : 1 + dim * dim] = half.q.reshape(-1)
            out[1 + dim * dim :] = half.l
        return out

    def unpack(self, layer: KFACLayer, part: str, flat: Tensor) -> FactorInverse | None:
        """Inverse of `pack`."""
        if float(flat[0]) == 0.0:
            return None
        dim = self.stats_shape(layer, part)[0]
        if self.cfg.inverse == InverseMethod.CHOLESKY:
            return FactorInverse(InverseMethod.CHOLESKY, inv=flat[1:].view(dim, dim).clone())
        return FactorInverse(
            InverseMethod.EIGEN, q=flat[1 : 1 + dim * dim].view(dim, dim).clone(), l=flat[1 + dim * dim :].clone()
        )

    def precondition(
        self,
        layers: Sequence[KFACLayer],
        grads: MutableMapping[str, Tensor],
        states: Mapping[str, RefreshState],
        params: Mapping[str, Tensor],
    ) -> Tensor:
        """P = B^-1 G A^-1 per layer in place (G where no inverse is active yet); returns sum <P, G>."""
        return Preconditioner(layers)(grads, states)  # type: ignore[arg-type]  # K-FAC states are LayerStates

    def clip_scale(self, dot_sum: float, lr: float) -> float:
        """K-FAC's KL-clip: ``nu = min(1, sqrt(kappa / (lr^2 * dot_sum)))`` (`kl_clip_scale`)."""
        return kl_clip_scale(dot_sum, lr, self.kl_clip)

    def scale(self, layers: Sequence[KFACLayer], grads: MutableMapping[str, Tensor], nu: float) -> None:
        """The KL-clip factor on the layers' gradients."""
        Preconditioner(layers).scale(grads, nu)

    def params_of(self, layer: KFACLayer) -> tuple[str, ...]:
        """The layer's weight and bias."""
        return layer.params

    def unit_cost(
        self, units: Mapping[str, KFACLayer], params: Mapping[str, Tensor]
    ) -> Callable[[str, int], LayerCost]:
        """Each layer timed on random captures of its real shape (`kfac_unit_cost`), on the parameters' device."""
        device = next((p.device for p in params.values()), None)
        return kfac_unit_cost(units, self.cfg, device=device)

    def half_to_state(self, half: FactorInverse | None) -> dict[str, Any] | None:
        """Method and tensors of one inverted factor."""
        if half is None:
            return None
        if half.method == InverseMethod.CHOLESKY:
            return {"method": InverseMethod.CHOLESKY.value, "inv": half.inv}
        return {"method": InverseMethod.EIGEN.value, "q": half.q, "l": half.l}

    def half_from_state(self, saved: Any) -> FactorInverse | None:
        """Inverse of `half_to_state`; ValueError when malformed."""
        if saved is None:
            return None
        if saved["method"] == InverseMethod.CHOLESKY and isinstance(saved["inv"], Tensor):
            return FactorInverse(InverseMethod.CHOLESKY, inv=saved["inv"])
        if saved["method"] == InverseMethod.EIGEN and isinstance(saved["q"], Tensor) and isinstance(saved["l"], Tensor):
            return FactorInverse(InverseMethod.EIGEN, q=saved["q"], l=saved["l"])
        raise ValueError(f"an inverse half has method {saved['method']!r} or lacks its tensors")
