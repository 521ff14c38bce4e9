"""A factor's damped inverse ``(F + gamma I)^-1`` in pieces that can run apart (`SplitInverse`, issue 14).

Newton-Schulz (`SplitMethod.NEWTON_SCHULZ`): from the previous refresh's inverse ``X``, each iteration takes
``R = I - M X`` (``M = F + gamma I``) and ``X <- X + X R``, i.e. ``X (2I - M X)``; then ``I - M X_new = R^2``, so
``||R||_F^2`` bounds the new residual, and the residual bounds the inverse's relative error. A piece runs
`SplitInverse.iterations` iterations and hands its `Progress` to the next. A residual that does not fall (the
start is too far: the iteration diverges), or a last bound above `SplitInverse.tolerance`, gives the exact
Cholesky inverse instead. Each iteration is two matrix products (about 4 d^3 flops against the Cholesky
inverse's d^3): pieces pay off where products run much faster than a factorization (GPUs).

Blocks (`SplitMethod.BLOCKS`): piece i inverts the i-th of `pieces` diagonal blocks of the damped factor
(sides differ by at most one); the inverse is their block diagonal. Each piece costs about ``(d / pieces)^3``,
but the factor's off-block entries are dropped, as in Shampoo's blocking.

A plan runs the pieces as ``DECOMP s A i/n layer`` ops (fxkfac/runtime/preconditioning.py keeps the carry);
`split_invert_factor`, what one device runs, is their fold, so both make the same inverse from the same start.
Newton-Schulz starts from the layer's newest inverse when piece 0 runs: the previous refresh's on one device,
and in a plan too (planner/search/cpsat.py and the validator finish a layer's refresh before its next first piece).
Known limit (benchmarks/split_inverse.py measures how often): a Newton-Schulz fallback runs its Cholesky in the
last piece, which a plan prices as every other piece (the profiled split's time / n).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fxkfac.config import SplitInverse, SplitMethod
from fxkfac.kfac.inverse import FactorInverse, Inverse, invert_factor
from fxkfac.planner.problem import InverseMethod

__all__ = [
    "Progress",
    "Carry",
    "previous_half",
    "schulz_start",
    "schulz_piece",
    "schulz_accepts",
    "block_bounds",
    "block_piece",
    "first_carry",
    "split_piece",
    "split_finish",
    "split_invert_factor",
    "carry_to_state",
    "carry_from_state",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Progress:
    """A Newton-Schulz inverse between pieces.

    ``measured``: ``||I - M x_prev||_F`` of the last iteration's start (inf before the first), what the next
    residual must fall below. ``bound``: a bound on ``||I - M x||_F`` of ``x`` itself.
    """

    x: Tensor
    measured: float = math.inf
    bound: float = math.inf


def damped(f: Tensor, gamma: float) -> Tensor:
    """``F + gamma I`` (a new tensor)."""
    m = f.clone()
    m.diagonal().add_(gamma)
    return m


def previous_half(latest: Inverse | None, part: str) -> Tensor | None:
    """Factor `part`'s (``"A"`` or ``"B"``) inverse in a layer's newest Cholesky-form Inverse, if any."""
    if latest is None:
        return None
    return latest.a_inv if part == "A" else latest.b_inv


def schulz_start(previous: Tensor | None, dim: int) -> Progress | None:
    """The first Progress: the previous refresh's inverse of this factor; None when there is none of side `dim`."""
    if previous is None or tuple(previous.shape) != (dim, dim):
        return None
    return Progress(previous)


def schulz_piece(m: Tensor, progress: Progress, iterations: int, tolerance: float) -> Progress | None:
    """`iterations` Newton-Schulz steps on the damped factor ``m``; None when a residual does not fall (diverging).

    An iterate whose residual is already at most `tolerance` is kept as it is (the remaining iterations of
    the piece are skipped: they would only stir rounding noise).
    """
    eye = torch.eye(m.shape[0], dtype=m.dtype, device=m.device)
    for _ in range(iterations):
        r = eye - m @ progress.x
        norm = float(torch.linalg.matrix_norm(r))
        if norm <= tolerance:
            return Progress(progress.x, norm, norm)
        if not norm < progress.measured:  # also NaN/Inf
            return None
        progress = Progress(progress.x + progress.x @ r, norm, norm * norm)
    return progress


def schulz_accepts(progress: Progress | None, tolerance: float) -> bool:
    """The iterate is the inverse to within `tolerance` (relative, in the spectral norm) and finite."""
    return progress is not None and progress.bound <= tolerance and bool(torch.isfinite(progress.x.sum()))


def block_bounds(dim: int, pieces: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of each diagonal block: min(pieces, dim) blocks whose sides differ by at most one."""
    n = min(pieces, dim)
    return [(dim * i // n, dim * (i + 1) // n) for i in range(n)]


def block_piece(
    f: Tensor, gamma: float, bounds: tuple[int, int], *, max_retries: int, name: str, side: str
) -> Tensor | None:
    """The damped Cholesky inverse of one diagonal block of `f`; None when it cannot be made."""
    lo, hi = bounds
    half = invert_factor(
        f[lo:hi, lo:hi],
        gamma,
        method=InverseMethod.CHOLESKY,
        max_retries=max_retries,
        name=name,
        side=f"{side}[{lo}:{hi}]",
    )
    return None if half is None else half.inv


Carry = Progress | tuple[Tensor, ...] | None
"""What the pieces so far hand to the next: Newton-Schulz's `Progress`, or the blocks inverted so far; None
once the split has failed (Newton-Schulz: no start or diverged; blocks: a block could not be inverted)."""


def first_carry(split: SplitInverse, previous: Tensor | None, dim: int) -> Carry:
    """The carry piece 0 starts from: the previous inverse (Newton-Schulz), no block yet (blocks)."""
    return () if split.method is SplitMethod.BLOCKS else schulz_start(previous, dim)


def split_piece(
    f: Tensor,
    gamma: float,
    split: SplitInverse,
    index: int,
    carry: Carry,
    *,
    max_retries: int = 3,
    name: str = "",
    side: str = "A",
) -> Carry:
    """Piece `index` (0-based, of `split.pieces`): `iterations` Newton-Schulz steps, or the index-th block.

    A factor of side d < pieces has d blocks: the later pieces hand their carry on unchanged.
    """
    if carry is None:
        return None
    if isinstance(carry, Progress):
        return schulz_piece(damped(f, gamma), carry, split.iterations, split.tolerance)
    bounds = block_bounds(f.shape[0], split.pieces)
    if index >= len(bounds):
        return carry
    block = block_piece(f, gamma, bounds[index], max_retries=max_retries, name=name, side=side)
    return None if block is None else (*carry, block)


def split_finish(
    f: Tensor, gamma: float, split: SplitInverse, carry: Carry, *, max_retries: int = 3, name: str = "", side: str = "A"
) -> FactorInverse | None:
    """The factor's inverse after the last piece (part of that piece's work); None when it cannot be made.

    Newton-Schulz is accepted within its tolerance, else `invert_factor`'s Cholesky (with its retries) is made
    here; blocks give their block diagonal.
    """
    if split.method is SplitMethod.BLOCKS:
        return (
            None
            if not isinstance(carry, tuple)
            else FactorInverse(InverseMethod.CHOLESKY, inv=torch.block_diag(*carry))
        )
    if isinstance(carry, Progress) and schulz_accepts(carry, split.tolerance):
        return FactorInverse(InverseMethod.CHOLESKY, inv=carry.x)
    log.info(
        "K-FAC %s: Newton-Schulz of factor %s had no previous inverse to start from, diverged or missed the "
        "tolerance; exact Cholesky instead",
        name or "<unnamed layer>",
        side,
    )
    return invert_factor(f, gamma, method=InverseMethod.CHOLESKY, max_retries=max_retries, name=name, side=side)


def split_invert_factor(
    f: Tensor,
    gamma: float,
    split: SplitInverse,
    *,
    previous: Tensor | None,
    max_retries: int = 3,
    name: str = "",
    side: str = "A",
) -> FactorInverse | None:
    """One factor's damped inverse, all pieces in a row (`first_carry`, `split_piece` each, `split_finish`):
    exactly what the pieces make when a plan runs them apart. None when it cannot be made."""
    carry = first_carry(split, previous, f.shape[0])
    for index in range(split.pieces):
        carry = split_piece(f, gamma, split, index, carry, max_retries=max_retries, name=name, side=side)
    return split_finish(f, gamma, split, carry, max_retries=max_retries, name=name, side=side)


def carry_to_state(carry: Carry) -> dict[str, Any] | None:
    """A carry as tensors for a checkpoint (pieces of a decomposition may be in flight at a step's end)."""
    if isinstance(carry, Progress):
        return {"x": carry.x, "norms": torch.tensor([carry.measured, carry.bound], dtype=torch.float64)}
    return None if carry is None else {"blocks": list(carry)}


def carry_from_state(saved: Any) -> Carry:
    """Inverse of `carry_to_state`; ValueError when malformed."""
    if saved is None:
        return None
    if isinstance(saved, Mapping) and isinstance(saved.get("x"), Tensor) and isinstance(saved.get("norms"), Tensor):
        measured, bound = (float(v) for v in saved["norms"])
        return Progress(saved["x"], measured, bound)
    if isinstance(saved, Mapping) and all(isinstance(b, Tensor) for b in saved.get("blocks", [None])):
        return tuple(saved["blocks"])
    raise ValueError(f"a split decomposition in flight is malformed: {saved!r}")
