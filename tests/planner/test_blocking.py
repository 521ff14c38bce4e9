"""Shampoo/SOAP blocking: merging, matrix views, ragged blocks and factor sides, against hand-worked cases."""

from __future__ import annotations

import itertools
import math
import subprocess
import sys

import pytest

from fxkfac.planner.problem.analytic import (
    Block,
    FactorKind,
    LargeDimMethod,
    block_ranges,
    matrix_view,
    merge_dims,
    partition,
)

D, G = FactorKind.DENSE, FactorKind.DIAGONAL


@pytest.mark.parametrize(
    ("shape", "b", "merged"),
    [
        ((10, 2, 2, 4), 8, (10, 4, 4)),  # the paper's example
        ((2, 2, 2), 8, (8,)),  # everything merges: a vector
        ((3, 1, 5), 100, (15,)),  # size-1 dims dropped
        ((), 4, (1,)),  # a scalar
        ((1, 1), 4, (1,)),
        ((64, 3, 3, 3), 27, (64, 27)),
        ((7,), 2, (7,)),  # longer than b stays (blocking cuts it)
    ],
)
def test_merge_dims(shape: tuple[int, ...], b: int, merged: tuple[int, ...]) -> None:
    assert merge_dims(shape, b) == merged


@pytest.mark.parametrize(
    ("shape", "b", "merge", "view"),
    [
        ((10, 2, 2, 4), 8, True, (10, 16)),  # order 3 after merging -> (d0, rest)
        ((10, 2, 2, 4), 8, False, (10, 16)),
        ((64, 3, 3, 3), 1024, True, (576, 3)),  # 576*3 > 1024
        ((64, 3, 3, 3), 2048, True, (1728,)),
        ((64, 3, 3, 3), 1024, False, (64, 27)),
        ((5, 1, 7), 4, False, (5, 7)),
        ((), 4, False, (1,)),
    ],
)
def test_matrix_view(shape: tuple[int, ...], b: int, merge: bool, view: tuple[int, ...]) -> None:
    assert matrix_view(shape, b, merge) == view


def test_ragged_blocks_cover_the_view_row_major() -> None:
    assert block_ranges((25, 7), 10) == [((0, 10), (0, 7)), ((10, 20), (0, 7)), ((20, 25), (0, 7))]
    assert [Block(r, ()).shape for r in block_ranges((12, 12), 5)] == [
        (5, 5), (5, 5), (5, 2), (5, 5), (5, 5), (5, 2), (2, 5), (2, 5), (2, 2)
    ]  # fmt: skip
    assert [Block(r, ()).shape for r in block_ranges((3,), 2)] == [(2,), (1,)]
    assert block_ranges((0, 4), 2) == []


@pytest.mark.parametrize("shape", [(25, 7), (12, 12), (9,), (1, 30), (4, 4, 4)])
@pytest.mark.parametrize("b", [1, 3, 10])
def test_blocks_tile_the_view_exactly(shape: tuple[int, ...], b: int) -> None:
    blocks = block_ranges(shape, b)
    assert sum(math.prod(e - s for s, e in r) for r in blocks) == math.prod(shape)
    assert all(0 < e - s <= b for r in blocks for s, e in r)
    cells = {tuple(i) for r in blocks for i in _cells(r)}
    assert len(cells) == math.prod(shape)


def _cells(ranges: tuple[tuple[int, int], ...]) -> list[tuple[int, ...]]:
    return list(itertools.product(*(range(s, e) for s, e in ranges)))


def test_partition_per_method() -> None:
    view, blocks = partition((25, 7), 10, LargeDimMethod.BLOCKING)
    assert view == (25, 7) and [b.kinds for b in blocks] == [(D, D)] * 3
    assert partition((25, 7), 10, LargeDimMethod.DIAGONAL)[1] == [Block(((0, 25), (0, 7)), (G, D))]
    assert partition((25, 7), 10, LargeDimMethod.ADAGRAD)[1] == [Block(((0, 25), (0, 7)), ())]
    assert partition((9, 7), 10, LargeDimMethod.ADAGRAD)[1] == [Block(((0, 9), (0, 7)), (D, D))]


def factor_sides(shape: tuple[int, ...], b: int, method: LargeDimMethod, merge: bool = True) -> list[tuple[int, int]]:
    """The (L, R) factor sides of each block `partition` cuts."""
    return [block.sides for block in partition(shape, b, method, merge)[1]]


def test_factor_sides() -> None:
    assert factor_sides((25, 7), 10, LargeDimMethod.BLOCKING) == [(10, 7), (10, 7), (5, 7)]
    assert factor_sides((25,), 10, LargeDimMethod.BLOCKING) == [(10, 0), (10, 0), (5, 0)]
    assert factor_sides((25, 7), 10, LargeDimMethod.DIAGONAL) == [(0, 7)]
    assert factor_sides((25, 7), 10, LargeDimMethod.ADAGRAD) == [(0, 0)]
    assert factor_sides((10, 2, 2, 4), 8, LargeDimMethod.BLOCKING) == [(8, 8), (8, 8), (2, 8), (2, 8)]
    assert factor_sides((10, 2, 2, 4), 8, LargeDimMethod.BLOCKING, merge=False) == factor_sides(
        (10, 16), 8, LargeDimMethod.BLOCKING
    )


def test_bad_arguments_name_themselves() -> None:
    with pytest.raises(ValueError, match="max_dim must be >= 1"):
        merge_dims((3,), 0)
    with pytest.raises(ValueError, match="negative"):
        block_ranges((3, -1), 4)


def test_blocking_imports_no_torch() -> None:
    code = (
        "import sys, fxkfac.planner.problem.analytic\n"
        "assert not [m for m in sys.modules if m == 'torch' or m.startswith('torch.')], 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
