"""Damped inverses of a layer's Kronecker factors: damping split, Cholesky with fallbacks, eigendecomposition."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from fxkfac.config import member_of
from fxkfac.errors import CheckpointError, ConfigError
from fxkfac.planner.problem import InverseMethod

__all__ = [
    "Inverse",
    "FactorInverse",
    "damping_split",
    "factor_dampings",
    "combine_shift",
    "invert",
    "invert_factor",
    "combine",
]

log = logging.getLogger(__name__)

_CHOLESKY_KEYS = ("a_inv", "b_inv")
_EIGEN_KEYS = ("q_a", "l_a", "q_b", "l_b", "damping")


@dataclass(frozen=True, eq=False)
class Inverse:
    """The preconditioner of one layer.

    Cholesky form: ``a_inv = (A + gamma_A I)^-1``, ``b_inv = (B + gamma_B I)^-1``, applied as
    ``b_inv @ G @ a_inv``. Eigen form: ``A = q_a diag(l_a) q_a^T`` and ``B = q_b diag(l_b) q_b^T``
    (eigenvalues clamped at 0), applied as ``q_b ((q_b^T G q_a) / (l_b l_a^T + damping)) q_a^T``.
    With pi-damping the eigen form stores ``l_a + gamma_A``, ``l_b + gamma_B`` and ``damping = 0``,
    which is the same operator as the Cholesky form.

    The eigen form's divisor ``l_b l_a^T + damping`` is made once per Inverse, at its first use
    (`eigen_divisor`), and kept with it: one gradient-sized tensor per layer (kfac-pytorch keeps the same with
    its default ``compute_eigenvalue_outer_product``). It is not part of `to_dict`.
    """

    method: InverseMethod
    a_inv: Tensor | None = None
    b_inv: Tensor | None = None
    q_a: Tensor | None = None
    l_a: Tensor | None = None
    q_b: Tensor | None = None
    l_b: Tensor | None = None
    damping: float = 0.0

    @cached_property
    def eigen_divisor(self) -> Tensor:
        """``l_b l_a^T + damping``, ``[d_out, a_dim]``: what the rotated gradient is divided by (eigen form only).

        The damping is the Inverse's own, fixed when it was made, so caching changes no number: the same
        tensor is computed as each step would compute it.
        """
        if self.method != InverseMethod.EIGEN or self.l_a is None or self.l_b is None:
            raise ConfigError("eigen_divisor is defined for the eigen form only")
        return torch.outer(self.l_b, self.l_a).add_(self.damping)

    def to_dict(self) -> dict[str, Tensor]:
        """Flat dict of tensors (for a state_dict); the keys present tell the method."""
        if self.method == InverseMethod.CHOLESKY:
            assert self.a_inv is not None and self.b_inv is not None, "the cholesky form holds a_inv and b_inv"
            return {"a_inv": self.a_inv, "b_inv": self.b_inv}
        assert self.q_a is not None and self.l_a is not None and self.q_b is not None and self.l_b is not None, (
            "the eigen form holds q_a, l_a, q_b and l_b"
        )
        out = {"q_a": self.q_a, "l_a": self.l_a, "q_b": self.q_b, "l_b": self.l_b}
        out["damping"] = torch.tensor(self.damping, dtype=torch.float64)
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Tensor]) -> Inverse:
        """Inverse of `to_dict`; raises CheckpointError when the keys are neither form's."""
        keys = set(d)
        if keys == set(_CHOLESKY_KEYS):
            return cls(InverseMethod.CHOLESKY, a_inv=d["a_inv"], b_inv=d["b_inv"])
        if keys == set(_EIGEN_KEYS):
            return cls(
                InverseMethod.EIGEN, q_a=d["q_a"], l_a=d["l_a"], q_b=d["q_b"], l_b=d["l_b"], damping=float(d["damping"])
            )
        raise CheckpointError(
            f"an inverse in the checkpoint has keys {sorted(keys)}; expected {list(_CHOLESKY_KEYS)} (cholesky) "
            f"or {list(_EIGEN_KEYS)} (eigen): the checkpoint is corrupt or from another version"
        )


def damping_split(A: Tensor | None, B: Tensor | None, damping: float, pi_damping: bool) -> tuple[float, float]:
    """``(gamma_A, gamma_B)``: ``sqrt(gamma)`` each, or with pi-damping ``pi*sqrt(gamma)`` and ``sqrt(gamma)/pi``.

    ``pi = sqrt((tr A / d_A) / (tr B / d_B))`` balances the damping to the factors' average eigenvalues.
    When either mean trace is not a positive finite number pi is undefined and 1 is used (plain split).
    The plain split reads no factor (they may be None).
    """
    root = math.sqrt(damping)
    if not pi_damping:
        return root, root
    if A is None or B is None:
        raise ValueError("pi-damping needs both factors")
    mean_a = float(torch.trace(A)) / A.shape[0]
    mean_b = float(torch.trace(B)) / B.shape[0]
    if not (math.isfinite(mean_a) and math.isfinite(mean_b) and mean_a > 0 and mean_b > 0):
        return root, root
    pi = math.sqrt(mean_a / mean_b)
    return pi * root, root / pi


def invert(
    A: Tensor,
    B: Tensor,
    *,
    damping: float,
    method: InverseMethod = InverseMethod.CHOLESKY,
    pi_damping: bool = False,
    max_retries: int = 3,
    previous: Inverse | None = None,
    name: str = "",
) -> Inverse | None:
    """The damped inverse of the factors ``A`` (input side) and ``B`` (output side), never with a NaN.

    Cholesky: ``(A + gamma_A I)^-1`` and ``(B + gamma_B I)^-1`` (see `invert_factor` for the retries).
    Eigen: without pi-damping ``gamma`` is added to the product of eigenvalues, ``(A kron B + gamma I)^-1``;
    with pi-damping each factor is damped (``gamma_A``, ``gamma_B``), the only form in which pi means
    anything, and the operator equals the Cholesky one. When either factor cannot be inverted (NaN/Inf in
    it, or every retry failed) ``previous`` is returned (possibly None: the layer then goes
    unpreconditioned) and a warning names ``name``.
    """
    if not damping > 0:
        raise ConfigError(f"damping must be > 0, got {damping!r}")
    method = member_of(InverseMethod, method, "method")
    label = name or "<unnamed layer>"
    gamma_a, gamma_b, shift = factor_dampings(A, B, damping=damping, method=method, pi_damping=pi_damping)
    part_a = invert_factor(A, gamma_a, method=method, max_retries=max_retries, name=label, side="A")
    part_b = invert_factor(B, gamma_b, method=method, max_retries=max_retries, name=label, side="B")
    if part_a is None or part_b is None:
        log.warning(
            "K-FAC %s: no inverse could be made; %s",
            label,
            "keeping the previous inverse" if previous is not None else "layer stays unpreconditioned",
        )
        return previous
    return combine(part_a, part_b, shift)


def factor_dampings(
    A: Tensor | None, B: Tensor | None, *, damping: float, method: InverseMethod, pi_damping: bool
) -> tuple[float, float, float]:
    """``(gamma_A, gamma_B, shift)``: what `invert_factor` gets for each factor and what `combine` gets.

    Cholesky, and eigen with pi-damping: the `damping_split` per factor, shift 0. Eigen without
    pi-damping: factors undamped, ``shift = damping`` added to the products of eigenvalues.
    """
    shift = combine_shift(damping=damping, method=method, pi_damping=pi_damping)
    if shift:
        return 0.0, 0.0, shift
    gamma_a, gamma_b = damping_split(A, B, damping, pi_damping)
    return gamma_a, gamma_b, 0.0


def combine_shift(*, damping: float, method: InverseMethod, pi_damping: bool) -> float:
    """What `combine` adds to the products of eigenvalues: the damping for eigen without pi-damping, else 0 (the
    factors' halves hold it). Set by the configuration alone, so a rank holding none of the factors (a streamed
    layer's helper) combines the halves it receives as their owner did."""
    return damping if method == InverseMethod.EIGEN and not pi_damping else 0.0


@dataclass(frozen=True, eq=False)
class FactorInverse:
    """One factor's half of an `Inverse`, so that A and B can be inverted on different ranks.

    Cholesky: ``inv = (f + gamma I)^-1``. Eigen: eigenvectors ``q`` of f and ``l = max(eigenvalues, 0) + gamma``
    (the damping folded into the eigenvalues; gamma = 0 keeps them undamped).
    """

    method: InverseMethod
    inv: Tensor | None = None
    q: Tensor | None = None
    l: Tensor | None = None  # noqa: E741 - the paper's lambda


def invert_factor(
    f: Tensor,
    gamma: float,
    *,
    method: InverseMethod = InverseMethod.CHOLESKY,
    max_retries: int = 3,
    name: str = "",
    side: str = "A",
) -> FactorInverse | None:
    """Invert one factor with damping ``gamma``; None when it cannot be done without NaN/Inf.

    A factor holding NaN/Inf is hopeless and returns None at once. Cholesky works in f's dtype; when the
    damped factor is not positive definite (or its inverse is not finite) the damping is multiplied by 10,
    up to ``max_retries`` times, then the last damping is tried in float64 (the result is cast back).
    Eigen: ``eigh`` in f's dtype, then in float64; eigenvalues are clamped at 0 (a Fisher factor is PSD).
    """
    label = name or "<unnamed layer>"
    if not _finite(f):
        log.warning("K-FAC %s: factor %s has NaN/Inf and cannot be inverted", label, side)
        return None
    if method == InverseMethod.CHOLESKY:
        inv = _damped_inverse(f, gamma, max_retries, label, side)
        return None if inv is None else FactorInverse(InverseMethod.CHOLESKY, inv=inv)
    eig = _eigh(f, label, side)
    return None if eig is None else FactorInverse(InverseMethod.EIGEN, q=eig[1], l=eig[0] + gamma)


def combine(a: FactorInverse, b: FactorInverse, damping: float = 0.0) -> Inverse:
    """The layer's `Inverse` from its two halves; ``damping`` is the eigen form's shift of ``l_b l_a^T``."""
    if a.method != b.method:
        raise ConfigError(f"cannot combine a {a.method} inverse of A with a {b.method} inverse of B")
    if a.method == InverseMethod.CHOLESKY:
        return Inverse(InverseMethod.CHOLESKY, a_inv=a.inv, b_inv=b.inv)
    return Inverse(InverseMethod.EIGEN, q_a=a.q, l_a=a.l, q_b=b.q, l_b=b.l, damping=damping)


def _damped_inverse(f: Tensor, gamma: float, max_retries: int, label: str, side: str) -> Tensor | None:
    """``(f + gamma I)^-1`` by Cholesky: 10x damping per retry, then float64 at the last damping; None if all fail."""
    attempts = [(f.dtype, gamma * 10.0**i) for i in range(max_retries + 1)]
    if f.dtype != torch.float64:
        attempts.append((torch.float64, attempts[-1][1]))
    for i, (dtype, g) in enumerate(attempts):
        inv = _try_cholesky_inverse(f.to(dtype), g)
        if inv is not None and dtype != f.dtype:
            inv = inv.to(f.dtype)
            inv = inv if _finite(inv) else None
        if inv is not None:
            if i > 0:
                log.warning(
                    "K-FAC %s: Cholesky of factor %s needed damping %.3g in %s (asked %.3g)",
                    label,
                    side,
                    g,
                    dtype,
                    gamma,
                )
            return inv
    log.warning(
        "K-FAC %s: Cholesky of factor %s failed up to damping %.3g, also in float64", label, side, attempts[-1][1]
    )
    return None


def _try_cholesky_inverse(f: Tensor, gamma: float) -> Tensor | None:
    """``(f + gamma I)^-1`` via Cholesky, or None when the matrix is not numerically positive definite."""
    damped = f.clone()
    damped.diagonal().add_(gamma)
    chol, info = torch.linalg.cholesky_ex(damped)
    if int(info) != 0:
        return None
    inv = torch.cholesky_inverse(chol)
    return inv if _finite(inv) else None


def _eigh(f: Tensor, label: str, side: str) -> tuple[Tensor, Tensor] | None:
    """Eigenvalues (clamped at 0: a Fisher factor is PSD) and eigenvectors, in f's dtype then float64."""
    for dtype in dict.fromkeys((f.dtype, torch.float64)):
        try:
            vals, vecs = torch.linalg.eigh(f.to(dtype))
        except torch.linalg.LinAlgError:
            log.warning("K-FAC %s: eigh of factor %s failed in %s", label, side, dtype)
            continue
        vals, vecs = vals.clamp(min=0).to(f.dtype), vecs.to(f.dtype)
        if _finite(vals) and _finite(vecs):
            return vals, vecs
    return None


def _finite(t: Tensor) -> bool:
    """No NaN/Inf in t, checked through its sum (NaN and Inf propagate; one reduction instead of a mask).

    A sum that overflows although every entry is finite also reads as non-finite: such a matrix is as
    unusable as a preconditioner, and the caller's fallback applies.
    """
    return bool(torch.isfinite(t.sum()))
