"""How Shampoo and SOAP cut a parameter into preconditioned blocks (torch-free: the planner counts them too).

The paper's rules (Shi et al., Distributed Shampoo, §4.2, Table 1) under one hyperparameter ``max_dim`` (b):

- *view*: size-1 dimensions are dropped; with merging, consecutive dimensions are merged while their product
  stays <= b (b=8: (10, 2, 2, 4) -> (10, 4, 4)); a tensor still of order > 2 is then viewed as the matrix
  (d0, d1*...*dk). The paper keeps one factor per dimension with root 2*order; fxkfac's families have two
  parts, L (rows) and R (columns), so a view is always 1-D or 2-D. A scalar (or all-ones shape) is (1,).
- ``LargeDimMethod.BLOCKING``: the view is cut into blocks of side <= b, ragged at the far edges, in row-major
  order; every side of every block gets a dense factor.
- ``LargeDimMethod.DIAGONAL``: one block (the whole view); a side longer than b keeps only the diagonal of its
  factor (matdiag), the others a dense factor.
- ``LargeDimMethod.ADAGRAD``: one block; when any side of the view is longer than b, the block has no factors
  (the parameter follows the diagonal graft method); otherwise every side gets a dense factor.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

__all__ = [
    "DEFAULT_MAX_DIM",
    "LargeDimMethod",
    "FactorKind",
    "Block",
    "merge_dims",
    "matrix_view",
    "block_ranges",
    "block_shapes",
    "partition",
    "factor_sides",
]

DEFAULT_MAX_DIM = 1024
"""The block side used when ``max_preconditioner_dim="auto"`` and no plan chooses one (paper: 1024-8192)."""


class LargeDimMethod(StrEnum):
    """What happens to a side of the view longer than ``max_dim`` (see the module doc)."""

    BLOCKING = "blocking"
    ADAGRAD = "adagrad"
    DIAGONAL = "diagonal"


class FactorKind(StrEnum):
    """The statistic kept for one side of a block: a dense d x d matrix or only its diagonal (d values)."""

    DENSE = "dense"
    DIAGONAL = "diagonal"


@dataclass(frozen=True, slots=True)
class Block:
    """One block of a view: ``(start, end)`` per dimension of the view and the factor kind of each side
    (``kinds`` is empty when the block has no factors: ``LargeDimMethod.ADAGRAD`` on a large view)."""

    ranges: tuple[tuple[int, int], ...]
    kinds: tuple[FactorKind, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        """Side lengths of the block."""
        return tuple(end - start for start, end in self.ranges)

    @property
    def sides(self) -> tuple[int, int]:
        """(m, n): the sides of its dense L and R factors, 0 where that side has none (a 1-D block's R, a
        diagonal factor, no factors at all)."""
        dense = [d if kind is FactorKind.DENSE else 0 for d, kind in zip(self.shape, self.kinds)]
        dense += [0] * (2 - len(dense))
        return dense[0], dense[1]


def _check(shape: Sequence[int], max_dim: int) -> None:
    """ValueError naming the bad argument (negative or zero sizes are not parameter shapes)."""
    if max_dim < 1:
        raise ValueError(f"max_dim must be >= 1, got {max_dim}")
    if any(d < 0 for d in shape):
        raise ValueError(f"shape {tuple(shape)} has a negative dimension")


def merge_dims(shape: Sequence[int], max_dim: int) -> tuple[int, ...]:
    """Drop size-1 dims, then merge consecutive dims while their product stays <= `max_dim` (a scalar: (1,))."""
    _check(shape, max_dim)
    merged: list[int] = []
    for d in (d for d in shape if d != 1):
        if merged and merged[-1] * d <= max_dim:
            merged[-1] *= d
        else:
            merged.append(d)
    return tuple(merged) or (1,)


def matrix_view(shape: Sequence[int], max_dim: int, merge: bool = True) -> tuple[int, ...]:
    """The 1-D or 2-D shape a parameter is preconditioned as: size-1 dims dropped, merged when `merge`, and an
    order > 2 result viewed as (d0, d1*...*dk) (L on the first dimension, R on the rest)."""
    _check(shape, max_dim)
    dims = merge_dims(shape, max_dim) if merge else (tuple(d for d in shape if d != 1) or (1,))
    return dims if len(dims) <= 2 else (dims[0], math.prod(dims[1:]))


def _chunks(d: int, max_dim: int) -> list[tuple[int, int]]:
    """[0, d) cut into pieces of length `max_dim`, the last one ragged (none for d = 0)."""
    return [(start, min(start + max_dim, d)) for start in range(0, d, max_dim)]


def block_ranges(shape: Sequence[int], max_dim: int) -> list[tuple[tuple[int, int], ...]]:
    """Blocks of side <= `max_dim` covering `shape` (a view), ragged at the far edges, in row-major order:
    ``(start, end)`` per dimension. (25, 7) with max_dim 10: rows (0,10) (10,20) (20,25) x cols (0,7)."""
    _check(shape, max_dim)
    return list(itertools.product(*(_chunks(d, max_dim) for d in shape)))


def block_shapes(shape: Sequence[int], max_dim: int) -> list[tuple[int, ...]]:
    """The side lengths of `block_ranges(shape, max_dim)`, in the same order."""
    return [tuple(end - start for start, end in ranges) for ranges in block_ranges(shape, max_dim)]


def partition(
    shape: Sequence[int], max_dim: int, method: LargeDimMethod, merge: bool = True
) -> tuple[tuple[int, ...], list[Block]]:
    """The view of a parameter of `shape` and its blocks under `method` (see the module doc)."""
    view = matrix_view(shape, max_dim, merge)
    large = any(d > max_dim for d in view)
    whole = tuple((0, d) for d in view)
    if method is LargeDimMethod.BLOCKING:
        return view, [Block(r, (FactorKind.DENSE,) * len(view)) for r in block_ranges(view, max_dim)]
    if method is LargeDimMethod.DIAGONAL:
        kinds = tuple(FactorKind.DIAGONAL if d > max_dim else FactorKind.DENSE for d in view)
        return view, [Block(whole, kinds)]
    if method is LargeDimMethod.ADAGRAD:
        return view, [Block(whole, () if large else (FactorKind.DENSE,) * len(view))]
    raise ValueError(f"unknown large_dim_method {method!r}; use one of {[m.value for m in LargeDimMethod]}")


def factor_sides(
    shape: Sequence[int], max_dim: int, method: LargeDimMethod, merge: bool = True
) -> list[tuple[int, int]]:
    """(m, n) per block of a parameter of `shape`: the sides of its dense L and R factors (what eigh and the
    preconditioning matmuls cost), 0 where a side has none (`Block.sides`). Block sizes: `partition`."""
    return [block.sides for block in partition(shape, max_dim, method, merge)[1]]
