"""Preconditioner: natural gradients by parameter name equal a dense Kronecker solve, and <P, G> is returned."""

from __future__ import annotations

import torch

from fxkfac.kfac.inverse import invert
from fxkfac.kfac.precondition import Preconditioner
from fxkfac.kfac.state import LayerState
from fxkfac.passes.layers import ConvSpec, KFACLayer

GAMMA = 0.1


def _spd(d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(d, 2 * d, generator=g, dtype=torch.float64)
    return m @ m.t() / (2 * d)


def _dense_natural_gradient(A: torch.Tensor, B: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """((A + sqrt(g) I) kron (B + sqrt(g) I))^-1 vec(G), vec column-major, as a matrix again."""
    r = GAMMA**0.5
    K = torch.kron(A + r * torch.eye(A.shape[0], dtype=A.dtype), B + r * torch.eye(B.shape[0], dtype=B.dtype))
    vec = G.t().reshape(-1)
    return torch.linalg.solve(K, vec).reshape(G.shape[1], G.shape[0]).t()


def test_linear_conv1d_conv2d_and_untouched_parameters() -> None:
    layers = [
        KFACLayer("fc", "linear", "fc.weight", "fc.bias", 3, 4),
        KFACLayer("c1d", "linear", "c1d.weight", None, 5, 2, weight_transposed=True),
        KFACLayer("conv", "conv2d", "conv.weight", "conv.bias", 2 * 3 * 3, 3, conv=ConvSpec((3, 3))),
        KFACLayer("fresh", "linear", "fresh.weight", None, 2, 2),
    ]
    g = torch.Generator().manual_seed(0)
    grads = {
        "fc.weight": torch.randn(4, 3, generator=g, dtype=torch.float64),
        "fc.bias": torch.randn(4, generator=g, dtype=torch.float64),
        "c1d.weight": torch.randn(5, 2, generator=g, dtype=torch.float64),
        "conv.weight": torch.randn(3, 2, 3, 3, generator=g, dtype=torch.float64),
        "conv.bias": torch.randn(3, generator=g, dtype=torch.float64),
        "fresh.weight": torch.randn(2, 2, generator=g, dtype=torch.float64),
        "other.weight": torch.randn(7, generator=g, dtype=torch.float64),
    }
    original = {k: v.clone() for k, v in grads.items()}
    states = {}
    for i, layer in enumerate(layers):
        state = LayerState(layer.a_dim, layer.b_dim)
        state.A, state.B = _spd(layer.a_dim, 2 * i), _spd(layer.b_dim, 2 * i + 1)
        if layer.name != "fresh":  # "fresh" has no inverse yet: P = G
            state.set_pending(invert(state.A, state.B, damping=GAMMA), 0)
            state.activate(0)
        states[layer.name] = state
    dot = Preconditioner(layers)(grads, states)

    G_fc = torch.cat([original["fc.weight"], original["fc.bias"][:, None]], 1)
    P_fc = _dense_natural_gradient(states["fc"].A, states["fc"].B, G_fc)
    torch.testing.assert_close(grads["fc.weight"], P_fc[:, :3])
    torch.testing.assert_close(grads["fc.bias"], P_fc[:, 3])
    G_c1d = original["c1d.weight"].t()
    P_c1d = _dense_natural_gradient(states["c1d"].A, states["c1d"].B, G_c1d)
    torch.testing.assert_close(grads["c1d.weight"], P_c1d.t())
    G_conv = torch.cat([original["conv.weight"].reshape(3, -1), original["conv.bias"][:, None]], 1)
    P_conv = _dense_natural_gradient(states["conv"].A, states["conv"].B, G_conv)
    torch.testing.assert_close(grads["conv.weight"], P_conv[:, :18].reshape(3, 2, 3, 3))
    torch.testing.assert_close(grads["fresh.weight"], original["fresh.weight"])
    assert torch.equal(grads["other.weight"], original["other.weight"])
    expected = sum(
        float((P * G).sum())
        for P, G in [(P_fc, G_fc), (P_c1d, G_c1d), (P_conv, G_conv), (original["fresh.weight"],) * 2]
    )
    assert abs(float(dot) - expected) < 1e-9 * abs(expected)

    pre = Preconditioner(layers)
    before = {k: v.clone() for k, v in grads.items()}
    pre.scale(grads, 0.25)
    torch.testing.assert_close(grads["conv.bias"], before["conv.bias"] * 0.25)
    assert torch.equal(grads["other.weight"], before["other.weight"])


def test_float32_gradients_equal_split_precondition_and_dot_to_float_rounding() -> None:
    """In float32 the written gradients are exactly split_grad(precondition(G)) and <P, G> is the float64 sum of
    the products to float32 rounding (each product is rounded to float32 before the float64 sum)."""
    from fxkfac.kfac.precondition import grad_matrix, precondition, split_grad

    layer = KFACLayer("fc", "linear", "fc.weight", "fc.bias", 40, 30)
    g = torch.Generator().manual_seed(1)
    grads = {"fc.weight": torch.randn(30, 40, generator=g), "fc.bias": torch.randn(30, generator=g)}
    state = LayerState(layer.a_dim, layer.b_dim)
    state.A, state.B = _spd(layer.a_dim, 0).float(), _spd(layer.b_dim, 1).float()
    for method in ("cholesky", "eigen"):
        state.set_pending(invert(state.A, state.B, damping=GAMMA, method=method), 0)  # type: ignore[arg-type]  # method: a Literal, the loop variable a str
        state.activate(0)
        work = {k: v.clone() for k, v in grads.items()}
        G = grad_matrix(layer, grads["fc.weight"], grads["fc.bias"])
        P = precondition(G, state.active)
        w, b = split_grad(layer, P)
        dot = Preconditioner([layer])(work, {"fc": state})
        assert torch.equal(work["fc.weight"], w) and torch.equal(work["fc.bias"], b)
        exact = float((P.double() * G.double()).sum())
        assert dot.dtype == torch.float64 and abs(float(dot) - exact) <= 1e-6 * abs(exact)
