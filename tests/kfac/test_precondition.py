"""Preconditioned gradients of Linear and Conv2d against dense float64 Kronecker references; KL-clip."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fxkfac.errors import ConfigError
from fxkfac.kfac import a_rows, e_rows, factor, grad_matrix, invert, kl_clip_scale, precondition, split_grad
from fxkfac.passes.layers import KFACLayer
from tests.kfac.helpers import capture_a_e, dense_kron_solve, layer_of, unvec, vec

DAMPING = 3e-2
N = 6


def _linear(bias: bool) -> tuple[nn.Module, torch.Tensor]:
    return nn.Linear(7, 4, bias=bias), torch.randn(N, 7)


def _linear_tokens(bias: bool) -> tuple[nn.Module, torch.Tensor]:
    return nn.Linear(5, 3, bias=bias), torch.randn(N, 4, 5)


def _conv(bias: bool) -> tuple[nn.Module, torch.Tensor]:
    return nn.Conv2d(3, 4, 3, stride=2, padding=1, dilation=2, bias=bias), torch.randn(N, 3, 9, 9)


def _conv_plain(bias: bool) -> tuple[nn.Module, torch.Tensor]:
    return nn.Conv2d(2, 3, (2, 3), bias=bias), torch.randn(N, 2, 5, 6)


CASES = {"linear": _linear, "linear_tokens": _linear_tokens, "conv_s2_p1_d2": _conv, "conv_rect": _conv_plain}


def _factors_and_grad(case: str, bias: bool, seed: int = 0):
    """Layer record, float64 factors A, B, the gradient matrix G, and the raw weight/bias grads of one backward."""
    torch.manual_seed(seed)
    mod, x = CASES[case](bias)
    mod, x = mod.double(), x.double().requires_grad_(True)
    target = torch.randn_like(mod(x))
    run = lambda: ((torch.tanh(mod(x)) - target) ** 2).flatten(1).sum(1).mean()  # noqa: E731 - mean over samples
    ((a, e),) = capture_a_e(mod, {"layer": mod}, run).values()
    layer = layer_of(mod)
    A = factor(a_rows(a, layer), torch.float64)
    B = factor(e_rows(e, layer, N), torch.float64)
    G = grad_matrix(layer, mod.weight.grad, None if mod.bias is None else mod.bias.grad)
    return layer, A, B, G, a, e, mod


def _pi_split(A: torch.Tensor, B: torch.Tensor) -> tuple[float, float]:
    pi = math.sqrt((A.diagonal().sum().item() / A.shape[0]) / (B.diagonal().sum().item() / B.shape[0]))
    return pi * math.sqrt(DAMPING), math.sqrt(DAMPING) / pi


def _assert_rel(p: torch.Tensor, ref: torch.Tensor, rtol: float = 1e-6) -> None:
    err = (p.double() - ref).abs().max().item()
    assert err <= rtol * ref.abs().max().item(), f"max abs error {err:.3g} vs scale {ref.abs().max().item():.3g}"


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("case", list(CASES))
def test_rows_reproduce_the_weight_gradient(case: str, bias: bool) -> None:
    """sum_rows e a^T / n is the autograd gradient: a_rows and e_rows pair up the same rows in the same order."""
    layer, _, _, G, a, e, _ = _factors_and_grad(case, bias)
    from_rows = e_rows(e, layer, N).t() @ a_rows(a, layer) / N
    _assert_rel(from_rows, G.double(), 1e-10)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("pi", [False, True])
def test_cholesky_form_is_the_damped_factor_kronecker_inverse(case: str, bias: bool, pi: bool) -> None:
    layer, A, B, G, *_ = _factors_and_grad(case, bias)
    g_a, g_b = _pi_split(A, B) if pi else (math.sqrt(DAMPING), math.sqrt(DAMPING))
    inv = invert(A, B, damping=DAMPING, method="cholesky", pi_damping=pi)
    eye_a, eye_b = torch.eye(A.shape[0], dtype=torch.float64), torch.eye(B.shape[0], dtype=torch.float64)
    K = torch.kron(A + g_a * eye_a, B + g_b * eye_b)
    ref = unvec(torch.linalg.inv(K) @ vec(G.double()), *G.shape)
    _assert_rel(precondition(G, inv), ref)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("case", list(CASES))
def test_eigen_form_is_the_damped_kronecker_product_inverse(case: str, bias: bool) -> None:
    """Eigen without pi-damping: (A kron B + gamma I)^-1 vec(G), the damping added to the whole product."""
    _, A, B, G, *_ = _factors_and_grad(case, bias)
    inv = invert(A, B, damping=DAMPING, method="eigen")
    _assert_rel(precondition(G, inv), dense_kron_solve(A, B, G, shift=DAMPING))


@pytest.mark.parametrize("case", list(CASES))
def test_eigen_form_with_pi_damping_damps_each_factor(case: str) -> None:
    """Eigen with pi-damping is the factored damping (A + gamma_A I) kron (B + gamma_B I), as the Cholesky form."""
    _, A, B, G, *_ = _factors_and_grad(case, True)
    g_a, g_b = _pi_split(A, B)
    inv = invert(A, B, damping=DAMPING, method="eigen", pi_damping=True)
    eye_a, eye_b = torch.eye(A.shape[0], dtype=torch.float64), torch.eye(B.shape[0], dtype=torch.float64)
    _assert_rel(precondition(G, inv), dense_kron_solve(A + g_a * eye_a, B + g_b * eye_b, G))


@pytest.mark.parametrize("method", ["cholesky", "eigen"])
def test_float32_factors_agree_with_float64_reference(method: str) -> None:
    """The production dtype (float32 factors and gradients) stays close to the float64 result."""
    layer, A, B, G, *_ = _factors_and_grad("conv_s2_p1_d2", True)
    ref = dense_kron_solve(A, B, G, shift=DAMPING) if method == "eigen" else None
    inv32 = invert(A.float(), B.float(), damping=DAMPING, method=method)
    p32 = precondition(G.float(), inv32)
    assert p32.dtype == torch.float32
    if ref is None:
        ref = precondition(G, invert(A, B, damping=DAMPING, method=method))
    _assert_rel(p32, ref.double(), 1e-4)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("case", list(CASES))
def test_split_grad_inverts_grad_matrix(case: str, bias: bool) -> None:
    layer, *_, mod = _factors_and_grad(case, bias)
    w, b = split_grad(layer, grad_matrix(layer, mod.weight.grad, None if mod.bias is None else mod.bias.grad))
    assert torch.equal(w, mod.weight.grad)
    assert (b is None) == (mod.bias is None)
    if b is not None:
        assert torch.equal(b, mod.bias.grad)


def test_no_inverse_leaves_the_gradient_unchanged() -> None:
    G = torch.randn(3, 4)
    assert precondition(G, None) is G


@pytest.mark.parametrize(
    ("dot_sum", "lr", "kappa", "expected"),
    [
        (4.0, 0.1, 1e-3, math.sqrt(1e-3 / (0.01 * 4.0))),  # clipped
        (1e-3, 0.1, 1e-3, 1.0),  # bound not reached
        (4.0, 0.1, None, 1.0),  # disabled
        (0.0, 0.1, 1e-3, 1.0),  # nothing to clip
        (-2.0, 0.1, 1e-3, 1.0),  # indefinite sum: no clipping
        (float("inf"), 0.1, 1e-3, 0.0),
    ],
)
def test_kl_clip_scale_matches_formula(dot_sum: float, lr: float, kappa: float | None, expected: float) -> None:
    assert kl_clip_scale(dot_sum, lr, kappa) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("kappa", [1e-6, 1e-3, 10.0])
def test_kl_clipped_update_respects_the_trust_region(kappa: float) -> None:
    """The update's KL estimate lr^2 nu^2 sum_l <P_l, F_l P_l> stays <= kappa (equality when clipping is active).

    F_l is the damped Kronecker Fisher (B + g_B I) kron (A + g_A I), applied directly here, so F_l P_l = G_l
    is checked rather than assumed.
    """
    lr = 0.3
    quad, dot_sum = 0.0, 0.0
    for seed, (case, bias) in enumerate([("linear", True), ("conv_s2_p1_d2", False), ("linear_tokens", True)]):
        _, A, B, G, *_ = _factors_and_grad(case, bias, seed)
        P = precondition(G, invert(A, B, damping=DAMPING))
        root = math.sqrt(DAMPING)
        FP = (B + root * torch.eye(B.shape[0], dtype=B.dtype)) @ P @ (A + root * torch.eye(A.shape[0], dtype=A.dtype))
        quad += float((P * FP).sum())
        dot_sum += float((P * G).sum())
    assert dot_sum > 0 and quad == pytest.approx(dot_sum, rel=1e-9)
    nu = kl_clip_scale(dot_sum, lr, kappa)
    kl = lr**2 * nu**2 * quad
    assert kl <= kappa * (1 + 1e-9)
    if nu < 1.0:
        assert kl == pytest.approx(kappa, rel=1e-9)
    else:
        assert lr**2 * dot_sum <= kappa


def test_grad_matrix_rejects_a_weight_in_the_wrong_layout() -> None:
    """An HF Conv1D weight is [d_in, d_out]; passing its raw gradient must fail, not be silently reshaped."""
    layer = KFACLayer("c_fc", "linear", "c_fc.weight", "c_fc.bias", 6, 4, weight_transposed=True)
    raw = torch.randn(6, 4)
    with pytest.raises(ConfigError, match=r"weight.grad.t\(\)"):
        grad_matrix(layer, raw, torch.randn(4))
    G = grad_matrix(layer, raw.t(), torch.randn(4))
    assert G.shape == (4, 7) and torch.equal(G[:, :6], raw.t())


@pytest.mark.parametrize("pi", [False, True])
def test_eigen_divisor_is_made_once_and_changes_no_number(pi: bool) -> None:
    """The cached ``l_b l_a^T + damping`` gives bit for bit what dividing by a fresh outer product gives."""
    layer, A, B, G, *_ = _factors_and_grad("linear_tokens", True)
    inv = invert(A.float(), B.float(), damping=DAMPING, method="eigen", pi_damping=pi)
    g = G.float()
    rotated = inv.q_b.t() @ g @ inv.q_a
    fresh = inv.q_b @ (rotated / (torch.outer(inv.l_b, inv.l_a) + inv.damping)) @ inv.q_a.t()
    assert torch.equal(precondition(g, inv), fresh)
    assert inv.eigen_divisor is inv.eigen_divisor  # made once per Inverse
    assert torch.equal(precondition(g, inv), fresh)  # and the cached divisor is not changed by use
    assert "eigen_divisor" not in inv.to_dict()
    with pytest.raises(ConfigError, match="eigen form only"):
        _ = invert(A, B, damping=DAMPING, method="cholesky").eigen_divisor
