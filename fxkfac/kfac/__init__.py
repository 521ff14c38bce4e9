"""K-FAC layer math: factors, damped inverses, preconditioning and per-layer state (torch only, no graphs)."""

from __future__ import annotations

from fxkfac.kfac.factors import a_rows, e_rows, factor, running_average
from fxkfac.kfac.inverse import Inverse, damping_split, invert
from fxkfac.kfac.precondition import grad_matrix, kl_clip_scale, precondition, split_grad
from fxkfac.kfac.state import LayerState

__all__ = [
    "a_rows", "e_rows", "factor", "running_average",
    "Inverse", "damping_split", "invert",
    "grad_matrix", "split_grad", "precondition", "kl_clip_scale",
    "LayerState",
]
