"""Typed configuration of Muon (a frozen dataclass validated on entry; the lr adjustment is an enum).

Defaults follow `torch.optim.Muon` (torch 2.13) and its AdamW companion for the parameters Muon does not take;
every difference is listed in docs/MUON.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from fxkfac.config import member_of
from fxkfac.errors import ConfigError

__all__ = ["LrAdjust", "MuonConfig", "NS_DTYPES", "QUINTIC"]

QUINTIC: tuple[float, float, float] = (3.4445, -4.775, 2.0315)
"""Keller Jordan's quintic Newton-Schulz coefficients (a, b, c), torch.optim.Muon's default."""

NS_DTYPES = ("bfloat16", "float32", "float64")
"""The dtypes the Newton-Schulz iteration may run in."""


class LrAdjust(StrEnum):
    """How a matrix's learning rate is scaled by its shape (rows A, columns B): the original Muon's
    ``sqrt(max(1, A / B))``, or Moonlight's ``0.2 * sqrt(max(A, B))``, which matches AdamW's update RMS so that
    AdamW's learning rate and weight decay carry over."""

    ORIGINAL = "original"
    MATCH_RMS_ADAMW = "match_rms_adamw"


def _require(ok: bool, field: str, what: str, value: Any) -> None:
    """ConfigError "MuonConfig.<field> must be <what>, got <value>" unless `ok`."""
    if not ok:
        raise ConfigError(f"MuonConfig.{field} must be {what}, got {value!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True, kw_only=True, slots=True)
class MuonConfig:
    """Hyperparameters of Muon on the hidden matrices and of AdamW on every other parameter (semantics:
    fxkfac/muon/family.py). The learning rate is the base optimizer's (plain SGD, as for Shampoo): Muon's matrices
    step by it, the AdamW parameters by it times `adamw_lr_ratio`."""

    momentum: float = 0.95
    """mu of the momentum buffer B <- mu B + (1 - mu) G (torch's lerp form)."""
    nesterov: bool = True
    """Orthogonalize (1 - mu) G + mu B instead of B."""
    ns_steps: int = 5
    """Newton-Schulz iterations per step (torch refuses >= 100)."""
    ns_coefficients: tuple[float, float, float] = QUINTIC
    """(a, b, c) of X <- a X + (b A + c A^2) X, A = X X^T."""
    eps: float = 1e-7
    """The input is divided by max(||X||_F, eps) before the iterations."""
    adjust_lr_fn: LrAdjust = LrAdjust.ORIGINAL
    """The matrix's lr scale (None is taken as ORIGINAL, as torch does)."""
    weight_decay: float = 0.1
    """Decoupled weight decay of the matrices: W <- W - lr * weight_decay * W (the unadjusted lr, as torch)."""
    ns_dtype: str = "bfloat16"
    """dtype the iteration runs in: torch's bfloat16, or float32/float64 (a run then equals another layout's to
    float rounding instead of bfloat16's)."""
    adamw_lr_ratio: float = 1.0
    """AdamW's learning rate over the base optimizer's (1: Moonlight's one lr, with MATCH_RMS_ADAMW)."""
    adamw_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's (beta1, beta2) for embeddings, the output head and parameters that are not matrices."""
    adamw_eps: float = 1e-8
    """AdamW's epsilon."""
    adamw_weight_decay: float = 0.01
    """AdamW's decoupled weight decay (torch.optim.AdamW's default)."""

    def __post_init__(self) -> None:
        if self.adjust_lr_fn is None:
            object.__setattr__(self, "adjust_lr_fn", LrAdjust.ORIGINAL)
        object.__setattr__(self, "adjust_lr_fn", member_of(LrAdjust, self.adjust_lr_fn, "MuonConfig.adjust_lr_fn"))
        _require(_is_number(self.momentum) and 0.0 <= self.momentum < 1.0, "momentum", "in [0, 1)", self.momentum)
        _require(isinstance(self.nesterov, bool), "nesterov", "a bool", self.nesterov)
        _require(_is_int(self.ns_steps) and 0 <= self.ns_steps < 100, "ns_steps", "an int in [0, 100)", self.ns_steps)
        coeffs = self.ns_coefficients
        _require(
            isinstance(coeffs, tuple) and len(coeffs) == 3 and all(map(_is_number, coeffs)),
            "ns_coefficients",
            "a tuple of three numbers (a, b, c)",
            coeffs,
        )
        _require(_is_number(self.eps) and self.eps > 0, "eps", "> 0", self.eps)
        _require(_is_number(self.weight_decay) and self.weight_decay >= 0, "weight_decay", ">= 0", self.weight_decay)
        _require(self.ns_dtype in NS_DTYPES, "ns_dtype", f"one of {NS_DTYPES}", self.ns_dtype)
        _require(
            _is_number(self.adamw_lr_ratio) and self.adamw_lr_ratio > 0, "adamw_lr_ratio", "> 0", self.adamw_lr_ratio
        )
        betas = self.adamw_betas
        _require(
            isinstance(betas, tuple) and len(betas) == 2 and all(_is_number(b) and 0.0 <= b < 1.0 for b in betas),
            "adamw_betas",
            "a pair (beta1, beta2) in [0, 1)",
            betas,
        )
        _require(_is_number(self.adamw_eps) and self.adamw_eps > 0, "adamw_eps", "> 0", self.adamw_eps)
        _require(
            _is_number(self.adamw_weight_decay) and self.adamw_weight_decay >= 0,
            "adamw_weight_decay",
            ">= 0",
            self.adamw_weight_decay,
        )
