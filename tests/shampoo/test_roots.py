"""Inverse roots against NumPy's eigendecomposition: eigh with its shift, coupled Newton, diagonal, protection."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fxkfac.shampoo.roots import (
    diagonal_root_inverse,
    eigh_root_inverse,
    newton_root_inverse,
    protected_eigh_root_inverse,
)


def _spd(n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(n, n + 2, generator=gen, dtype=torch.float64)
    return a @ a.t()


def _numpy_root(a: torch.Tensor, power: float) -> torch.Tensor:
    w, v = np.linalg.eigh(a.numpy())
    return torch.from_numpy((v * w**power) @ v.T)


@pytest.mark.parametrize("p", [1, 2, 4, 6])
def test_eigh_and_newton_give_the_inverse_root(p: int) -> None:
    a = _spd(5)
    eps = 1e-3
    expected = _numpy_root(a + eps * torch.eye(5, dtype=torch.float64), -1.0 / p)
    eigh = eigh_root_inverse(a, 1.0 / p, eps)
    newton = newton_root_inverse(a, p, eps, tolerance=1e-12, max_iterations=100)
    assert eigh is not None and newton is not None
    assert torch.allclose(eigh, expected, rtol=1e-9, atol=1e-12)
    assert torch.allclose(newton, expected, rtol=1e-8, atol=1e-10)


def test_eigh_shifts_a_negative_spectrum() -> None:
    """l - min(l_min, 0) + eps: an indefinite matrix is shifted so its least eigenvalue is eps."""
    a = torch.diag(torch.tensor([-2.0, 1.0, 3.0], dtype=torch.float64))
    root = eigh_root_inverse(a, 0.5, 1e-2)
    assert root is not None
    assert torch.allclose(torch.diagonal(root), torch.tensor([1e-2, 3.01, 5.01], dtype=torch.float64) ** -0.5)


def test_newton_that_does_not_converge_is_none() -> None:
    assert newton_root_inverse(_spd(6), 4, 1e-6, tolerance=1e-12, max_iterations=2) is None


def test_diagonal_root() -> None:
    d = torch.tensor([0.0, 4.0, 16.0], dtype=torch.float64)
    root = diagonal_root_inverse(d, 0.25, 1e-8)
    assert root is not None and torch.allclose(root, (d + 1e-8) ** -0.25)
    assert diagonal_root_inverse(torch.tensor([float("nan")]), 0.25, 1e-8) is None


def test_protected_eigh_retries_in_float64(monkeypatch: pytest.MonkeyPatch) -> None:
    """A float32 eigh that fails is retried in float64 (cast back); unprotected it is None; NaN input is None."""
    real = torch.linalg.eigh

    def fails_in_float32(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if x.dtype == torch.float32:
            raise torch.linalg.LinAlgError("simulated convergence failure")
        return real(x)

    a = _spd(4).float()
    monkeypatch.setattr(torch.linalg, "eigh", fails_in_float32)
    root = protected_eigh_root_inverse(a, 0.25, 1e-6, retry_float64=True)
    assert root is not None and root.dtype == torch.float32
    assert protected_eigh_root_inverse(a, 0.25, 1e-6, retry_float64=False) is None
    monkeypatch.undo()
    assert protected_eigh_root_inverse(a * float("nan"), 0.25, 1e-6, retry_float64=True) is None
