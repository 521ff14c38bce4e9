"""invert(): damping split, fallbacks (indefinite, NaN, singular), the float64 retry, and Inverse round trips."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fxkfac.errors import CheckpointError, ConfigError
from fxkfac.kfac import Inverse, combine, damping_split, factor_dampings, invert, invert_factor, precondition


def _spd(d: int, seed: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(d, 2 * d, generator=g, dtype=dtype)
    return m @ m.t() / (2 * d)


def test_damping_split_plain_and_pi() -> None:
    A, B = torch.diag(torch.tensor([4.0, 8.0])), torch.diag(torch.tensor([1.0, 1.0, 1.0]))
    assert damping_split(A, B, 1e-2, False) == pytest.approx((0.1, 0.1))
    pi = math.sqrt((12.0 / 2) / (3.0 / 3))
    assert damping_split(A, B, 1e-2, True) == pytest.approx((0.1 * pi, 0.1 / pi))


def test_pi_damping_falls_back_to_plain_split_when_a_trace_vanishes() -> None:
    A, B = torch.zeros(2, 2), torch.eye(3)
    assert damping_split(A, B, 1e-2, True) == pytest.approx((0.1, 0.1))


def test_indefinite_factor_returns_previous_or_none_and_warns(caplog: pytest.LogCaptureFixture) -> None:
    A = torch.diag(torch.tensor([1.0, -5.0, 2.0]))  # -5 survives three 10x retries: gamma_A = 1e-4 .. 0.1
    B = _spd(2, 0).float()
    G = torch.randn(2, 3)
    with caplog.at_level(logging.WARNING, logger="fxkfac.kfac.inverse"):
        assert invert(A, B, damping=1e-8, name="enc.fc") is None
    assert "enc.fc" in caplog.text
    assert torch.equal(precondition(G, None), G)
    previous = invert(_spd(3, 1).float(), B, damping=1e-8)
    assert invert(A, B, damping=1e-8, previous=previous) is previous


def test_slightly_indefinite_factor_is_repaired_by_more_damping() -> None:
    """Eigenvalue -1e-3 with gamma_A = 1e-4: 10x retries reach 1e-2, and the result is that damped inverse."""
    A = torch.diag(torch.tensor([1.0, -1e-3, 2.0], dtype=torch.float64))
    B = torch.eye(2, dtype=torch.float64)
    inv = invert(A, B, damping=1e-8)
    assert inv is not None
    torch.testing.assert_close(inv.a_inv, torch.linalg.inv(A + 1e-2 * torch.eye(3, dtype=torch.float64)))
    torch.testing.assert_close(inv.b_inv, torch.linalg.inv(B + 1e-4 * torch.eye(2, dtype=torch.float64)))


@pytest.mark.parametrize("method", ["cholesky", "eigen"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_factor_keeps_previous(method: str, bad: float) -> None:
    A, B = _spd(3, 0).float(), _spd(2, 1).float()
    previous = invert(A, B, damping=1e-3, method=method)
    A_bad = A.clone()
    A_bad[1, 2] = bad
    assert invert(A_bad, B, damping=1e-3, method=method, previous=previous) is previous
    assert invert(B, A_bad, damping=1e-3, method=method) is None


def test_singular_float32_factor_falls_back_to_float64() -> None:
    """float32 rounds [[1, 1-1e-10], ...] to the singular all-ones matrix: only float64 can add gamma=1e-12."""
    A = torch.tensor([[1.0, 1 - 1e-10], [1 - 1e-10, 1.0]], dtype=torch.float64).float()
    inv = invert(A, A, damping=1e-24, max_retries=0)
    assert inv is not None and inv.a_inv.dtype == torch.float32
    expected = torch.linalg.inv(A.double() + 1e-12 * torch.eye(2, dtype=torch.float64))
    torch.testing.assert_close(inv.a_inv.double(), expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("method", ["cholesky", "eigen"])
def test_singular_factor_with_tiny_damping_gives_finite_preconditioner(method: str) -> None:
    """Rank one in float32: rounding leaves eigenvalues near -1e-4, beyond gamma_A = 1e-10 even after 1000x.

    Cholesky then cannot succeed and falls back to `previous`; eigen clamps the eigenvalues and succeeds.
    """
    v = torch.randn(16, 1, generator=torch.Generator().manual_seed(0)) * 30
    A = v @ v.t()
    B = _spd(4, 2).float()
    previous = invert(_spd(16, 3).float(), B, damping=1e-3)
    inv = invert(A, B, damping=1e-20, method=method, previous=previous)
    assert inv is not None
    assert (inv is previous) == (method == "cholesky")
    assert all(torch.isfinite(t).all() for t in inv.to_dict().values())
    assert torch.isfinite(precondition(torch.randn(4, 16), inv)).all()


@settings(max_examples=40, deadline=None)
@given(
    vals=st.lists(st.floats(-10, 10) | st.just(float("nan")), min_size=9, max_size=9),
    damping=st.sampled_from([1e-12, 1e-3, 1.0]),
    method=st.sampled_from(["cholesky", "eigen"]),
)
def test_invert_never_returns_nonfinite(vals: list[float], damping: float, method: str) -> None:
    """Any symmetric 3x3 factor, indefinite or NaN: either None or a preconditioner with finite output."""
    m = torch.tensor(vals, dtype=torch.float32).reshape(3, 3)
    A = (m + m.t()) / 2
    inv = invert(A, torch.eye(2), damping=damping, method=method)
    if inv is not None:
        assert all(torch.isfinite(t).all() for t in inv.to_dict().values())
        assert torch.isfinite(precondition(torch.randn(2, 3), inv)).all()


@pytest.mark.parametrize("method", ["cholesky", "eigen"])
def test_inverse_dict_round_trip(method: str) -> None:
    inv = invert(_spd(3, 0), _spd(2, 1), damping=1e-2, method=method)
    back = Inverse.from_dict(inv.to_dict())
    G = torch.randn(2, 3, dtype=torch.float64)
    assert back.method == method
    assert torch.equal(precondition(G, back), precondition(G, inv))


def test_inverse_from_dict_rejects_unknown_keys() -> None:
    with pytest.raises(CheckpointError, match="corrupt"):
        Inverse.from_dict({"a_inv": torch.eye(2)})


def test_invert_rejects_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="damping"):
        invert(torch.eye(2), torch.eye(2), damping=0.0)
    with pytest.raises(ConfigError, match="method"):
        invert(torch.eye(2), torch.eye(2), damping=1e-3, method="svd")  # type: ignore[arg-type]  # a wrong value on purpose: the test checks the error


@pytest.mark.parametrize(("method", "pi"), [("cholesky", False), ("cholesky", True), ("eigen", False), ("eigen", True)])
def test_factor_halves_combine_to_the_whole_inverse(method: str, pi: bool) -> None:
    """What the runtime does when DECOMP l,A and DECOMP l,B run on different ranks: the same operator as invert()."""
    A, B, G = _spd(4, 0), _spd(3, 1), torch.randn(3, 4, dtype=torch.float64)
    gamma_a, gamma_b, shift = factor_dampings(A, B, damping=1e-2, method=method, pi_damping=pi)
    if method == "eigen" and not pi:
        assert (gamma_a, gamma_b, shift) == (0.0, 0.0, 1e-2)
    else:
        assert (gamma_a, gamma_b, shift) == (*damping_split(A, B, 1e-2, pi), 0.0)
    halves = combine(invert_factor(A, gamma_a, method=method), invert_factor(B, gamma_b, method=method), shift)
    whole = invert(A, B, damping=1e-2, method=method, pi_damping=pi)
    torch.testing.assert_close(precondition(G, halves), precondition(G, whole), rtol=1e-12, atol=0)


def test_combine_rejects_mixed_methods() -> None:
    with pytest.raises(ConfigError, match="combine"):
        combine(invert_factor(torch.eye(2), 0.1), invert_factor(torch.eye(2), 0.1, method="eigen"))
