"""Typed configuration of K-FAC and of a compile (frozen dataclasses, validated on entry)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fxkfac.errors import ConfigError

__all__ = ["KFACConfig"]


@dataclass(frozen=True, kw_only=True, slots=True)
class KFACConfig:
    """Hyperparameters of K-FAC; the semantics are those of DESIGN.md ("K-FAC semantics")."""

    damping: float = 1e-3
    """Tikhonov damping gamma added to the Kronecker factors (split sqrt(gamma) each, or pi-split)."""
    factor_decay: float = 0.95
    """Running average: A <- decay * A + (1 - decay) * A_new (decay weights the old value)."""
    kl_clip: float | None = 1e-3
    """kappa of the KL-clip; None disables clipping."""
    inverse: Literal["cholesky", "eigen"] = "cholesky"
    """How factors are inverted: Cholesky of damped factors, or eigendecomposition."""
    pi_damping: bool = False
    """Split damping between A and B by pi = sqrt((tr A / d_A) / (tr B / d_B))."""
    refresh_every: int = 1
    """Curvature and inverses are refreshed every this many steps (a plan overrides it per layer)."""
    skip_layers: tuple[str, ...] = ()
    """Regexes on layer names (module FQNs) that K-FAC leaves to the base optimizer."""
    skip_vocab_head: bool = True
    """Skip a Linear whose output dimension equals the vocabulary size (an LM head)."""
    vocab_size: int | None = None
    """Vocabulary size for `skip_vocab_head`; inferred from the largest embedding when None."""
    capture: Literal["fused", "deferred"] = "fused"
    """Default factor capture when no plan chooses per layer."""
    factor_dtype: str = "float32"
    """dtype the factors are accumulated in."""
    max_cholesky_retries: int = 3
    """Retries with 10x more damping before falling back to float64, then to the previous inverse."""

    def __post_init__(self) -> None:
        if not self.damping > 0:
            raise ConfigError(f"KFACConfig.damping must be > 0, got {self.damping!r}")
        if not 0.0 <= self.factor_decay < 1.0:
            raise ConfigError(f"KFACConfig.factor_decay must be in [0, 1), got {self.factor_decay!r}")
        if self.kl_clip is not None and not self.kl_clip > 0:
            raise ConfigError(f"KFACConfig.kl_clip must be > 0 or None, got {self.kl_clip!r}")
        if self.inverse not in ("cholesky", "eigen"):
            raise ConfigError(f"KFACConfig.inverse must be 'cholesky' or 'eigen', got {self.inverse!r}")
        if self.capture not in ("fused", "deferred"):
            raise ConfigError(f"KFACConfig.capture must be 'fused' or 'deferred', got {self.capture!r}")
        if not (isinstance(self.refresh_every, int) and self.refresh_every >= 1):
            raise ConfigError(f"KFACConfig.refresh_every must be an int >= 1, got {self.refresh_every!r}")
