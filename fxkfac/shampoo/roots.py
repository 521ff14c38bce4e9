"""Inverse roots of a factor: shifted eigh (optionally retried in float64), coupled inverse Newton, diagonal.

The coupled Newton iteration is also exposed in its parts (`newton_start`, `newton_steps`, `newton_result`) so
that a plan may run its iterations in pieces apart (`ShampooConfig.newton_pieces`); `newton_root_inverse` is
their fold. All return None on failure (the caller keeps the previous roots, paper §3.2.3) and never change their input.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "eigh_root_inverse",
    "protected_eigh_root_inverse",
    "NewtonIterate",
    "newton_start",
    "newton_residual",
    "newton_steps",
    "newton_result",
    "newton_share",
    "newton_root_inverse",
    "diagonal_root_inverse",
]


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


NewtonIterate = tuple[Tensor, Tensor]
"""The coupled Newton iteration's pair (X_k, M_k): X_k tends to (a + eps I)^(-1/p), M_k to I."""


def newton_start(a: Tensor, root: int, eps: float) -> NewtonIterate:
    """(X_0, M_0) = (I/c, (a + eps I)/c^p), c = (2 ||a + eps I||_F / (p + 1))^(1/p) (paper eq. 40)."""
    eye = torch.eye(a.shape[0], dtype=a.dtype, device=a.device)
    shifted = a + eps * eye
    c = (2.0 * float(torch.linalg.matrix_norm(shifted)) / (root + 1)) ** (1.0 / root)
    return eye / c, shifted / c**root


def newton_residual(m: Tensor) -> float:
    """max row sum |M - I|: the iteration's stopping measure."""
    eye = torch.eye(m.shape[0], dtype=m.dtype, device=m.device)
    return float((m - eye).abs().sum(1).max())


def newton_steps(iterate: NewtonIterate, root: int, tolerance: float, iterations: int) -> NewtonIterate:
    """Up to `iterations` coupled Newton steps (paper eqs. 41-42); none once the residual is below `tolerance`
    or not finite, so a converged or diverged pair passes through unchanged and runs of steps compose exactly."""
    x, m = iterate
    eye = torch.eye(m.shape[0], dtype=m.dtype, device=m.device)
    for _ in range(iterations):
        if not tolerance <= newton_residual(m) < float("inf"):  # converged, or diverged (also NaN)
            break
        step = ((root + 1) * eye - m) / root
        x, m = x @ step, torch.linalg.matrix_power(step, root) @ m
    return x, m


def newton_result(iterate: NewtonIterate, tolerance: float) -> Tensor | None:
    """X when the residual is below `tolerance` and X is finite, else None (not converged or diverged)."""
    x, m = iterate
    return _finite(x) if newton_residual(m) < tolerance else None


def newton_share(max_iterations: int, pieces: int, index: int) -> int:
    """The iterations piece `index` of `pieces` runs: shares of `max_iterations` that differ by at most one."""
    return max_iterations * (index + 1) // pieces - max_iterations * index // pieces


def newton_root_inverse(a: Tensor, root: int, eps: float, tolerance: float, max_iterations: int) -> Tensor | None:
    """(a + eps I)^(-1/root) by the coupled inverse Newton iteration (paper eqs. 40-42): from `newton_start`,
    stops when max row sum |M - I| < tolerance; None if it does not within `max_iterations` (or diverges)."""
    return newton_result(newton_steps(newton_start(a, root, eps), root, tolerance, max_iterations), tolerance)


def diagonal_root_inverse(d: Tensor, exponent: float, eps: float) -> Tensor | None:
    """The diagonal factor's (d - min(d_min, 0) + eps)^-exponent, the same shift as eigh; None if not finite."""
    return _finite((d - d.min().clamp(max=0.0) + eps).pow(-exponent))
