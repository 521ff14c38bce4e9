"""The batched products of a `Grid` layout (equal dense blocks) equal the per-block loop they replace, for Shampoo's
and SOAP's statistics, folds (the runtime's `fold_gradient`, fused for a grid) and directions (the loop is what the
float64 reference tests check)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fxkfac.planner.problem.analytic import FactorKind, LargeDimMethod
from fxkfac.preconditioner import fold_gradient
from fxkfac.shampoo.config import ShampooConfig, SOAPConfig
from fxkfac.shampoo.family import ShampooFamily
from fxkfac.shampoo.layout import Grid, ParamUnit, make_layout
from fxkfac.shampoo.soap import SOAPFamily

SHAPES = [(8, 4), (4, 12), (6, 6), (2, 2)]
"""4 x 2, 1 x 3, 3 x 3 and 1 x 1 grids of blocks of 2 (rows, columns), and of 4 or 6 with wider blocks."""


def _family(kind: str, max_dim: int) -> ShampooFamily | SOAPFamily:
    common = {"max_preconditioner_dim": max_dim, "preconditioner_dtype": "float64", "use_merge_dims": False}
    if kind == "shampoo":
        return ShampooFamily(ShampooConfig(grafting_type="adam", betas=(0.9, 0.99), momentum=0.5, **common))
    return SOAPFamily(SOAPConfig(**common))


def _run(family: ShampooFamily | SOAPFamily, unit: ParamUnit, grads: list[torch.Tensor], param: torch.Tensor):
    """Three steps of folds, one refresh after the first, and the directions: the statistics and directions made."""
    state, out = family.new_state(unit), []
    for t, g in enumerate(grads):
        raw = param.detach().clone().requires_grad_(True)
        raw.grad = g.clone()
        for part in family.parts:  # the runtime's fold: fused for a grid, the statistic then its fold without
            fold_gradient(family, unit, state, part, raw, 1)
        if t == 1:
            made = family.combine(unit, state, {p: family.decompose(unit, state, p) for p in family.parts})
            state.set_pending(made, t)
        state.activate(t)
        grad = g.clone()
        family.precondition([unit], {unit.name: grad}, {unit.name: state}, {unit.name: param})
        out += [state.L, state.R, grad]
    return out


@pytest.mark.parametrize("kind", ["shampoo", "soap"])
@pytest.mark.parametrize("shape", SHAPES)
def test_grid_equals_the_block_loop(kind: str, shape: tuple[int, int]) -> None:
    max_dim = 2
    unit = ParamUnit("w", shape)
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(3)]
    param = torch.randn(shape, generator=gen, dtype=torch.float64)
    batched, looped = _family(kind, max_dim), _family(kind, max_dim)
    layout = batched.layout(unit)
    assert layout.grid == Grid(shape[0] // 2, shape[1] // 2, 2, 2)
    looped._layouts[unit.name] = dataclasses.replace(layout, grid=None)
    for a, b in zip(_run(batched, unit, grads, param), _run(looped, unit, grads, param), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_no_grid_for_ragged_diagonal_or_1d_layouts() -> None:
    assert make_layout((5, 4), 2, LargeDimMethod.BLOCKING, False, FactorKind).grid is None  # ragged rows
    assert make_layout((8,), 2, LargeDimMethod.BLOCKING, False, FactorKind).grid is None  # a 1-D view
    assert make_layout((8, 2), 2, LargeDimMethod.DIAGONAL, False, FactorKind).grid is None  # a diagonal side
    assert make_layout((4, 4), 2, LargeDimMethod.BLOCKING, False, ()).grid is None  # no factors kept


@pytest.mark.parametrize("kind", ["shampoo", "soap"])
def test_a_stage_apply_equals_each_unit_alone_bit_for_bit(kind: str) -> None:
    """`precondition` of many units runs each elementwise pass as one `torch._foreach_*` op over them all: every
    direction and state tensor equals the unit's own `precondition`, bit for bit (a streamed APPLY runs one unit), over
    steps from the first (no moments yet) through a refresh; one unit has no gradient in one step."""
    shapes = {"w": (8, 4), "v": (6,), "x": (5, 4), "b": (4,)}
    family = _family(kind, 4)
    units = [ParamUnit(n, s) for n, s in shapes.items()]
    gen = torch.Generator().manual_seed(2)
    params = {n: torch.randn(s, generator=gen, dtype=torch.float64) for n, s in shapes.items()}
    together, alone = ({u.name: family.new_state(u) for u in units} for _ in range(2))
    for t in range(3):
        grads = {n: torch.randn(s, generator=gen, dtype=torch.float64) for n, s in shapes.items()}
        if t == 2:
            del grads["x"]
        for states in (together, alone):
            for unit in units:
                raw = params[unit.name].clone().requires_grad_(True)
                raw.grad = grads.get(unit.name, torch.zeros(shapes[unit.name], dtype=torch.float64))
                for part in family.parts:
                    fold_gradient(family, unit, states[unit.name], part, raw, 1)
                if t == 1:
                    made = family.combine(
                        unit, states[unit.name], {p: family.decompose(unit, states[unit.name], p) for p in family.parts}
                    )
                    states[unit.name].set_pending(made, t)
                states[unit.name].activate(t)
        got = {n: g.clone() for n, g in grads.items()}
        family.precondition(units, got, together, params)
        for unit in units:
            want = {n: g.clone() for n, g in grads.items() if n == unit.name}
            family.precondition([unit], want, alone, params)
            if unit.name in grads:
                assert torch.equal(got[unit.name], want[unit.name]), (t, unit.name)
            a, b = together[unit.name].state_dict(), alone[unit.name].state_dict()
            assert a.keys() == b.keys(), (t, unit.name)
            for key, value in a.items():
                assert torch.equal(value, b[key]) if isinstance(value, torch.Tensor) else value == b[key], (t, key)
