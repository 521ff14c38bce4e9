"""A parameter as Shampoo and SOAP see it: its 1-D/2-D view, its blocks, and the factors of parts L and R.

The statistic of a part is one flat tensor: the factors of that side of every block, concatenated in block
order (dense: G_b G_b^T for L, G_b^T G_b for R, row-major; diagonal: the row or column sums of G_b^2).
Roots (Shampoo) and bases (SOAP) of a part use the same flat layout.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from fxkfac.planner.problem.analytic import Block, FactorKind, LargeDimMethod, partition

__all__ = [
    "PARTS",
    "ParamUnit",
    "Factor",
    "Grid",
    "Layout",
    "make_layout",
    "side_statistic",
    "running_sum",
    "running_sums",
    "running_squares",
]

PARTS: tuple[str, str] = ("L", "R")
"""Part L is side 0 (rows) of every block, R side 1 (columns; 1-D blocks have none)."""


@dataclass(frozen=True, slots=True)
class ParamUnit:
    """What Shampoo and SOAP precondition: one trainable parameter, by FQN, with its shape."""

    name: str
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Factor:
    """One side of one block: its kind, its side length and where it lies in its part's flat tensor."""

    block: int
    kind: FactorKind
    dim: int
    offset: int

    @property
    def size(self) -> int:
        """Elements in the flat layout: dim^2 (dense) or dim (diagonal)."""
        return self.dim * self.dim if self.kind is FactorKind.DENSE else self.dim

    def take(self, flat: Tensor) -> Tensor:
        """This factor's tensor (a view) in a part's flat tensor: dim x dim or dim."""
        piece = flat[self.offset : self.offset + self.size]
        return piece.view(self.dim, self.dim) if self.kind is FactorKind.DENSE else piece


@dataclass(frozen=True, slots=True)
class Grid:
    """Blocks of one shape b1 x b2, each with dense L and R factors, tiling a 2-D view as `rows` x `cols` in
    row-major order: the per-block products of such a layout run batched (one `torch.bmm` for all blocks)."""

    rows: int
    cols: int
    b1: int
    b2: int

    def split(self, x: Tensor) -> Tensor:
        """The blocks of a view-shaped `x` as a (blocks, b1, b2) stack, in block order (a view where the strides
        allow: one block row or one block column)."""
        return x.reshape(self.rows, self.b1, self.cols, self.b2).transpose(1, 2).reshape(-1, self.b1, self.b2)

    def join(self, blocks: Tensor) -> Tensor:
        """Inverse of `split`: the view-shaped tensor of a (blocks, b1, b2) stack."""
        x = blocks.reshape(self.rows, self.cols, self.b1, self.b2).transpose(1, 2)
        return x.reshape(self.rows * self.b1, self.cols * self.b2)

    def factors(self, flat: Tensor, part: str) -> Tensor:
        """A part's flat tensor (statistic, roots, bases) as the (blocks, b, b) stack of its factors (a view)."""
        side = self.b1 if part == "L" else self.b2
        return flat.view(-1, side, side)


@dataclass(frozen=True, slots=True)
class Layout:
    """A parameter's view shape, blocks, and per part the factors of its blocks (`sides[block]`: L and R
    factor of the block, None where it has none); `grid` when the blocks form one (`Grid`), else None."""

    view: tuple[int, ...]
    blocks: tuple[Block, ...]
    factors: dict[str, tuple[Factor, ...]]
    sides: tuple[tuple[Factor | None, Factor | None], ...]
    grid: Grid | None = None

    def size(self, part: str) -> int:
        """Elements of the part's flat statistic (0: the part is trivial)."""
        return sum(f.size for f in self.factors[part])

    def region(self, block: int) -> tuple[slice, ...]:
        """Index of a block in a tensor of the view shape."""
        return tuple(slice(start, end) for start, end in self.blocks[block].ranges)


def make_layout(
    shape: tuple[int, ...], max_dim: int, method: LargeDimMethod, merge: bool, kept: Iterable[FactorKind]
) -> Layout:
    """The layout of a parameter of `shape`; factor kinds not in `kept` get no factor (SOAP: identity basis)."""
    keep = frozenset(kept)
    view, blocks = partition(shape, max_dim, method, merge)
    factors: dict[str, list[Factor]] = {part: [] for part in PARTS}
    offsets = dict.fromkeys(PARTS, 0)
    sides: list[tuple[Factor | None, Factor | None]] = []
    for index, block in enumerate(blocks):
        pair: list[Factor | None] = [None, None]
        for side, (kind, dim) in enumerate(zip(block.kinds, block.shape)):
            if kind in keep:
                part = PARTS[side]
                factor = Factor(index, kind, dim, offsets[part])
                pair[side] = factor
                factors[part].append(factor)
                offsets[part] += factor.size
        sides.append((pair[0], pair[1]))
    return Layout(view, tuple(blocks), {p: tuple(fs) for p, fs in factors.items()}, tuple(sides), _grid(view, sides))


def _grid(view: tuple[int, ...], sides: list[tuple[Factor | None, Factor | None]]) -> Grid | None:
    """The `Grid` of a 2-D view whose blocks (in row-major order, as fxkfac.planner.problem.analytic cuts them) all
    have the same shape and two dense factors; None otherwise (ragged edges, diagonal or missing factors, 1-D)."""
    if len(view) != 2 or not all(
        lf is not None and rf is not None and lf.kind is rf.kind is FactorKind.DENSE for lf, rf in sides
    ):
        return None
    first = sides[0]
    assert first[0] is not None and first[1] is not None
    b1, b2 = first[0].dim, first[1].dim
    if view[0] % b1 or view[1] % b2 or len(sides) != (view[0] // b1) * (view[1] // b2):
        return None
    if any(lf is None or rf is None or (lf.dim, rf.dim) != (b1, b2) for lf, rf in sides):
        return None
    return Grid(view[0] // b1, view[1] // b2, b1, b2)


def side_statistic(layout: Layout, part: str, grad: Tensor) -> Tensor:
    """The flat statistic of `part` from `grad` (view shape, already in the statistics dtype)."""
    if layout.grid is not None:
        blocks = layout.grid.split(grad)
        left = blocks if part == "L" else blocks.transpose(1, 2)
        return torch.bmm(left, left.transpose(1, 2)).reshape(-1)
    side = PARTS.index(part)
    pieces = []
    for f in layout.factors[part]:
        g = grad[layout.region(f.block)]
        g = g.reshape(-1, 1) if g.dim() == 1 else (g if side == 0 else g.t())
        pieces.append((g @ g.t()).reshape(-1) if f.kind is FactorKind.DENSE else (g * g).sum(1))
    if len(pieces) == 1:  # one factor: its tensor is the flat statistic (no copy)
        return pieces[0]
    return torch.cat(pieces) if pieces else grad.new_zeros(0)


def running_sum(old: Tensor | None, new: Tensor, beta: float) -> Tensor:
    """beta * old + (1 - beta) * new (from zero), or old + new when beta is 1: a new tensor, never in place. One
    pass over the tensors (`torch.lerp`: old + (1 - beta) (new - old), equal up to rounding)."""
    if beta == 1.0:
        return new.clone() if old is None else old + new
    return (1.0 - beta) * new if old is None else torch.lerp(old, new, 1.0 - beta)


def running_sums(olds: Sequence[Tensor | None], news: Sequence[Tensor], beta: float) -> list[Tensor]:
    """`running_sum` of each pair (new tensors, never in place), the pairs with an old tensor as one
    `torch._foreach_lerp`: the same lerp per tensor, without a Python op per tensor."""
    pairs = zip(olds, news, strict=True)
    out = [running_sum(old, new, beta) if old is None or beta == 1.0 else new for old, new in pairs]
    ema = [(i, old) for i, old in enumerate(olds) if old is not None and beta != 1.0]
    if ema:
        lerped = torch._foreach_lerp([old for _, old in ema], [news[i] for i, _ in ema], 1.0 - beta)
        for (i, _), value in zip(ema, lerped, strict=True):
            out[i] = value
    return out


def running_squares(olds: Sequence[Tensor | None], news: Sequence[Tensor], beta: float) -> list[Tensor]:
    """`running_sum` of each new tensor's square (beta A + (1 - beta) G^2, from zero; beta = 1: sums), new tensors,
    the EMAs of the old ones in two `torch._foreach_*` passes in all (no G^2 made)."""
    pairs = zip(olds, news, strict=True)
    out = [running_sum(old, new * new, beta) if old is None or beta == 1.0 else new for old, new in pairs]
    ema = [(i, old) for i, old in enumerate(olds) if old is not None and beta != 1.0]
    if ema:
        squared = [news[i] for i, _ in ema]
        summed = torch._foreach_mul([old for _, old in ema], beta)
        torch._foreach_addcmul_(summed, squared, squared, value=1.0 - beta)
        for (i, _), value in zip(ema, summed, strict=True):
            out[i] = value
    return out
