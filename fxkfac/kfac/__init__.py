"""K-FAC layer math: factors, damped inverses, preconditioning and per-layer state (torch only, no graphs)."""

from __future__ import annotations

from fxkfac.kfac.factors import a_rows, e_rows, factor, running_average
from fxkfac.kfac.inverse import FactorInverse, Inverse, combine, damping_split, factor_dampings, invert, invert_factor
from fxkfac.kfac.precondition import grad_matrix, kl_clip_scale, precondition, split_grad
from fxkfac.kfac.state import LayerState

__all__ = [
    "a_rows",
    "e_rows",
    "factor",
    "running_average",
    "Inverse",
    "FactorInverse",
    "damping_split",
    "factor_dampings",
    "invert",
    "invert_factor",
    "combine",
    "grad_matrix",
    "split_grad",
    "precondition",
    "kl_clip_scale",
    "LayerState",
]
