"""The Newton-Schulz orthogonalization of Muon as small pure functions, cut so that a plan may run its iterations in
pieces: `ns_start` (cast, wide orientation, Frobenius normalization), `ns_iterate` (some of the iterations),
`ns_end` (back to the matrix's orientation). `orthogonalize` is the three in a row, torch.optim.Muon's
`_zeropower_via_newtonschulz` op for op."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["ns_start", "ns_iterate", "ns_end", "orthogonalize", "iterations_of_piece"]


def ns_start(x: Tensor, dtype: torch.dtype, eps: float) -> Tensor:
    """X_0: `x` in `dtype`, transposed when it has more rows than columns (so X X^T is the smaller Gram matrix),
    divided by max(||X||_F, eps) so that its spectral norm is at most 1."""
    out = x.to(dtype)
    if x.size(0) > x.size(1):
        out = out.T
    return out / out.norm().clamp(min=eps)


def ns_iterate(x: Tensor, coefficients: tuple[float, float, float], steps: int) -> Tensor:
    """`steps` quintic iterations X <- a X + (b A + c A A) X, A = X X^T (a new tensor; `x` is not changed). `x` may
    be a (k, m, n) stack of equally shaped matrices, iterated together: one batched product per term for all k."""
    a, b, c = coefficients
    if x.dim() == 3:
        for _ in range(steps):
            gram = torch.bmm(x, x.mT)
            x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        return x
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x


def ns_end(x: Tensor, shape: tuple[int, ...]) -> Tensor:
    """The last iterate in the orientation of a matrix of `shape`."""
    return x.T if shape[0] > shape[1] else x


def orthogonalize(
    x: Tensor, coefficients: tuple[float, float, float], steps: int, eps: float, dtype: torch.dtype
) -> Tensor:
    """U S' V^T with S' near the identity for x = U S V^T, in `dtype` (torch.optim.Muon runs bfloat16)."""
    return ns_end(ns_iterate(ns_start(x, dtype, eps), coefficients, steps), tuple(x.shape))


def iterations_of_piece(steps: int, index: int, pieces: int) -> int:
    """How many of `steps` iterations piece `index` of `pieces` runs: those in [i*S//n, (i+1)*S//n)."""
    if not 0 <= index < pieces:
        raise ValueError(f"piece {index} of {pieces}")
    return (index + 1) * steps // pieces - index * steps // pieces
