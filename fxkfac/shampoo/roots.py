"""Inverse roots of a factor: shifted eigh (optionally retried in float64), coupled inverse Newton, diagonal.

All return None on failure (the caller keeps the previous roots, paper §3.2.3) and never change their input.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["eigh_root_inverse", "protected_eigh_root_inverse", "newton_root_inverse", "diagonal_root_inverse"]


def _finite(t: Tensor | None) -> Tensor | None:
    """`t` when every entry is finite, else None."""
    return t if t is not None and bool(torch.isfinite(t).all()) else None


def eigh_root_inverse(a: Tensor, exponent: float, eps: float) -> Tensor | None:
    """Q diag((l - min(l_min, 0) + eps)^-exponent) Q^T with l, Q = eigh(a) (paper §3.2.1): the shift keeps the
    spectrum positive; None when eigh fails or the result is not finite."""
    try:
        eigenvalues, q = torch.linalg.eigh(a)
    except torch.linalg.LinAlgError:
        return None
    shifted = eigenvalues - eigenvalues.min().clamp(max=0.0) + eps
    return _finite((q * shifted.pow(-exponent)) @ q.t())


def protected_eigh_root_inverse(a: Tensor, exponent: float, eps: float, retry_float64: bool) -> Tensor | None:
    """`eigh_root_inverse` in a's dtype, then (when `retry_float64`) in float64 cast back; None when both fail."""
    out = eigh_root_inverse(a, exponent, eps)
    if out is None and retry_float64 and a.dtype != torch.float64:
        wide = eigh_root_inverse(a.double(), exponent, eps)
        out = None if wide is None else _finite(wide.to(a.dtype))
    return out


def newton_root_inverse(a: Tensor, root: int, eps: float, tolerance: float, max_iterations: int) -> Tensor | None:
    """(a + eps I)^(-1/root) by the coupled inverse Newton iteration (paper eqs. 40-42): X0 = I/c, M0 = A/c^p,
    c = (2 ||A||_F / (p + 1))^(1/p); stops when max row sum |M - I| < tolerance; None if it does not within
    `max_iterations` (or diverges)."""
    eye = torch.eye(a.shape[0], dtype=a.dtype, device=a.device)
    shifted = a + eps * eye
    c = (2.0 * float(torch.linalg.matrix_norm(shifted)) / (root + 1)) ** (1.0 / root)
    x, m = eye / c, shifted / c**root
    for _ in range(max_iterations):
        residual = float((m - eye).abs().sum(1).max())
        if residual < tolerance:
            return _finite(x)
        if not residual < float("inf"):
            return None
        step = ((root + 1) * eye - m) / root
        x, m = x @ step, torch.linalg.matrix_power(step, root) @ m
    return _finite(x) if float((m - eye).abs().sum(1).max()) < tolerance else None


def diagonal_root_inverse(d: Tensor, exponent: float, eps: float) -> Tensor | None:
    """The diagonal factor's (d - min(d_min, 0) + eps)^-exponent, the same shift as eigh; None if not finite."""
    return _finite((d - d.min().clamp(max=0.0) + eps).pow(-exponent))
