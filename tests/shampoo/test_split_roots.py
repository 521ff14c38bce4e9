"""Shampoo's coupled-Newton root inverse in pieces (ShampooConfig.newton_pieces, "DECOMP s L i/n"): the pieces run
in order make bit for bit what one task makes, which is the float64 eigh root; the carry survives a checkpoint;
configurations the pieces cannot serve are refused."""

from __future__ import annotations

import io
from dataclasses import replace

import numpy as np
import pytest
import torch

from fxkfac.errors import ConfigError
from fxkfac.planner.problem.analytic import FactorKind, LargeDimMethod
from fxkfac.preconditioner import PiecewiseFamily
from fxkfac.shampoo import ParamUnit, RootInvMethod, ShampooConfig, ShampooFamily, ShampooState, SOAPConfig, SOAPFamily
from fxkfac.shampoo.roots import newton_residual, newton_root_inverse, newton_share, newton_start, newton_steps

EPS = 1e-6
NEWTON = ShampooConfig(
    root_inv_method=RootInvMethod.NEWTON,
    newton_tolerance=1e-10,
    newton_max_iterations=12,
    newton_pieces=4,
    max_preconditioner_dim=4,
    betas=(0.0, 0.99),
    epsilon=EPS,
    preconditioner_dtype="float64",
)
"""Newton converges in 6-8 iterations on these statistics: within piece 1 or 2 of 4 pieces of 3 iterations."""
UNIT = ParamUnit("w", (8, 6))
"""Blocks of side 4 and 2: parts L and R have four dense factors each."""


def _spd(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(n, n + 3, generator=gen, dtype=torch.float64)
    return a @ a.t()


def _grads(shape: tuple[int, ...], steps: int = 3) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(steps)]


def _folded(family: ShampooFamily, unit: ParamUnit, grads: list[torch.Tensor]) -> ShampooState:
    """A state with `grads` folded into L and R, one step each."""
    state = family.new_state(unit)
    for g in grads:
        param = torch.zeros(unit.shape, dtype=torch.float64, requires_grad=True)
        param.grad = g
        for part in family.parts:
            family.fold(state, part, family.statistic(unit, part, "gradient", param, 1))
    assert isinstance(state, ShampooState)
    return state


def _pieces(family: ShampooFamily, unit: ParamUnit, state: ShampooState, part: str) -> torch.Tensor | None:
    """What a plan's DECOMP pieces 0..n-1 make, run one after the other."""
    carry = None
    for index in range(family.decomp_pieces):
        carry = family.decompose_piece(unit, state, part, index, carry)
    assert carry is None or isinstance(carry, torch.Tensor)
    return carry


def _eigh_root(a: np.ndarray, p: int) -> np.ndarray:
    """(a + EPS I)^(-1/p) by NumPy's eigendecomposition (a is positive semi-definite)."""
    w, v = np.linalg.eigh(a + EPS * np.eye(a.shape[0]))
    return (v * w ** (-1.0 / p)) @ v.T


def _reference_roots(
    cfg: ShampooConfig, unit: ParamUnit, grads: list[torch.Tensor], part: str
) -> dict[int, np.ndarray]:
    """Per block of `unit` (ShampooFamily's layout): the bias-corrected EMA of G_b G_b^T (L) or G_b^T G_b (R),
    its inverse p-th root by eigh in float64 (p = 2 * order of the view), or a diagonal factor's root."""
    layout = ShampooFamily(cfg).layout(unit)
    beta2 = cfg.betas[1]
    out = {}
    for factor in layout.factors[part]:
        stat = np.zeros((factor.dim, factor.dim))
        for g in grads:
            block = g.reshape(layout.view)[layout.region(factor.block)].numpy()
            gram = block @ block.T if part == "L" else block.T @ block
            stat = beta2 * stat + (1 - beta2) * gram
        stat /= 1 - beta2 ** len(grads)
        p = 2 * len(layout.view)
        out[factor.block] = (
            (np.diag(stat) + EPS) ** (-1.0 / p) if factor.kind is FactorKind.DIAGONAL else _eigh_root(stat, p)
        )
    return out


CASES = {
    "converges within the pieces": (NEWTON, UNIT),
    "misses the tolerance, eigh in the last piece": (replace(NEWTON, newton_max_iterations=4, newton_pieces=2), UNIT),
    "3 pieces of 12 iterations": (replace(NEWTON, newton_pieces=3), UNIT),
    "a diagonal side beside dense factors": (
        replace(NEWTON, large_dim_method=LargeDimMethod.DIAGONAL),
        ParamUnit("w", (3, 6)),
    ),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("part", ["L", "R"])
def test_pieces_in_order_equal_one_task_and_the_float64_eigh_root(case: str, part: str) -> None:
    cfg, unit = CASES[case]
    grads = _grads(unit.shape)
    split, whole = ShampooFamily(cfg), ShampooFamily(replace(cfg, newton_pieces=1))
    state = _folded(split, unit, grads)
    pieces = _pieces(split, unit, state, part)
    one_task = whole.decompose(unit, _folded(whole, unit, grads), part)
    assert pieces is not None and one_task is not None
    assert torch.equal(pieces, one_task), f"{case}: pieces differ from one task by {(pieces - one_task).abs().max()}"
    assert torch.equal(split.decompose(unit, state, part), pieces), "one device's decompose is not the pieces' fold"
    layout = split.layout(unit)
    for factor in layout.factors[part]:
        want = torch.from_numpy(np.asarray(_reference_roots(cfg, unit, grads, part)[factor.block]))
        torch.testing.assert_close(factor.take(pieces), want, rtol=1e-8, atol=1e-10, msg=f"{case}: {factor}")


def test_the_pieces_really_split_the_iterations() -> None:
    """After piece 0 some factor has not converged yet, and the shares cover newton_max_iterations."""
    split = ShampooFamily(NEWTON)
    state = _folded(split, UNIT, _grads(UNIT.shape))
    carry = split.decompose_piece(UNIT, state, "L", 0, None)
    assert isinstance(carry, tuple) and len(carry) == len(split.layout(UNIT).factors["L"])
    assert max(newton_residual(m) for _, m in carry) >= NEWTON.newton_tolerance
    assert [newton_share(12, 4, i) for i in range(4)] == [3, 3, 3, 3]
    assert [newton_share(7, 3, i) for i in range(3)] == [2, 2, 3]


@pytest.mark.parametrize("pieces", [1, 2, 3, 5, 20])
@pytest.mark.parametrize("max_iterations,seed", [(20, 0), (20, 1), (3, 0)])
def test_newton_steps_in_shares_equal_newton_root_inverse(pieces: int, max_iterations: int, seed: int) -> None:
    """Shares of the iterations, run in a row, give what newton_root_inverse gives: the root, or None when it
    does not converge (3 iterations) or diverges (a NaN statistic)."""
    for a in (_spd(5, seed), torch.full((3, 3), float("nan"), dtype=torch.float64)):
        whole = newton_root_inverse(a, 4, EPS, 1e-10, max_iterations)
        pair = newton_start(a, 4, EPS)
        for index in range(pieces):
            pair = newton_steps(pair, 4, 1e-10, newton_share(max_iterations, pieces, index))
        parted = pair[0] if newton_residual(pair[1]) < 1e-10 and bool(torch.isfinite(pair[0]).all()) else None
        assert (whole is None) == (parted is None)
        assert whole is None or parted is None or torch.equal(whole, parted)
    assert (newton_root_inverse(_spd(5, seed), 4, EPS, 1e-10, max_iterations) is None) == (max_iterations < 6)


def test_a_carry_resumes_from_a_checkpoint_exactly() -> None:
    """A carry saved after piece 1 (carry_to_state, torch.save, carry_from_state) finishes to the same roots."""
    split = ShampooFamily(NEWTON)
    state = _folded(split, UNIT, _grads(UNIT.shape))
    carry = split.decompose_piece(UNIT, state, "R", 1, split.decompose_piece(UNIT, state, "R", 0, None))
    buffer = io.BytesIO()
    torch.save(split.carry_to_state(carry), buffer)
    buffer.seek(0)
    resumed = split.carry_from_state(torch.load(buffer))
    for index in (2, 3):
        carry = split.decompose_piece(UNIT, state, "R", index, carry)
        resumed = split.decompose_piece(UNIT, state, "R", index, resumed)
    assert isinstance(carry, torch.Tensor) and isinstance(resumed, torch.Tensor)
    assert torch.equal(carry, resumed) and torch.equal(carry, _pieces(split, UNIT, state, "R"))
    assert split.carry_to_state(None) is None and split.carry_from_state(None) is None


@pytest.mark.parametrize("saved", [{"x": []}, {"x": [torch.eye(2)], "m": []}, {"x": ["a"], "m": ["b"]}, [1]])
def test_a_malformed_carry_is_refused(saved: object) -> None:
    with pytest.raises(ValueError, match="in flight"):
        ShampooFamily(NEWTON).carry_from_state(saved)


def test_a_carry_of_another_layout_and_a_piece_out_of_range_are_refused() -> None:
    split = ShampooFamily(NEWTON)
    state = _folded(split, UNIT, _grads(UNIT.shape))
    carry = split.decompose_piece(UNIT, state, "L", 2, split.decompose_piece(UNIT, state, "L", 0, None))
    assert isinstance(carry, tuple)
    with pytest.raises(ValueError, match="another layout"):
        split.decompose_piece(UNIT, state, "L", 3, carry[:1])
    for index in (-1, 4):
        with pytest.raises(ValueError, match="made in 4"):
            split.decompose_piece(UNIT, state, "L", index, carry)


def test_before_the_start_step_every_piece_declines() -> None:
    """A statistic folded before start_preconditioning_step: the carry is None and so are the roots."""
    split = ShampooFamily(replace(NEWTON, start_preconditioning_step=5))
    state = _folded(split, UNIT, _grads(UNIT.shape))
    assert split.decompose_piece(UNIT, state, "L", 0, None) is None
    assert _pieces(split, UNIT, state, "L") is None


def test_shampoo_is_piecewise_and_soap_is_not() -> None:
    """Shampoo makes its roots in newton_pieces (1 under eigh); SOAP's eigh/QR bases are one task."""
    assert isinstance(ShampooFamily(NEWTON), PiecewiseFamily) and ShampooFamily(NEWTON).decomp_pieces == 4
    assert ShampooFamily(ShampooConfig()).decomp_pieces == 1
    assert not isinstance(SOAPFamily(SOAPConfig()), PiecewiseFamily)


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"newton_pieces": 2}, "needs root_inv_method='newton'"),
        ({"newton_pieces": 0, "root_inv_method": "newton"}, "newton_pieces must be an int >= 1"),
        ({"newton_pieces": True, "root_inv_method": "newton"}, "newton_pieces must be an int >= 1"),
        ({"newton_pieces": 2.0, "root_inv_method": "newton"}, "newton_pieces must be an int >= 1"),
        (
            {"newton_pieces": 5, "newton_max_iterations": 4, "root_inv_method": "newton"},
            "exceeds newton_max_iterations",
        ),
    ],
)
def test_bad_configs_are_refused(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ShampooConfig(**fields)  # type: ignore[arg-type]  # wrong types on purpose
