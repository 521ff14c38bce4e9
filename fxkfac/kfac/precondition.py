"""Natural gradient of one layer, P = B^-1 G A^-1 (or the eigen form), and the KL-clip scale over all layers."""

from __future__ import annotations

import math
from collections.abc import Mapping, MutableMapping, Sequence

import torch
from torch import Tensor

from fxkfac.errors import ConfigError
from fxkfac.kfac.inverse import Inverse
from fxkfac.kfac.state import LayerState
from fxkfac.passes.layers import KFACLayer, LayerKind
from fxkfac.planner.problem import InverseMethod

__all__ = ["grad_matrix", "split_grad", "precondition", "kl_clip_scale", "Preconditioner"]


def grad_matrix(layer: KFACLayer, weight_grad: Tensor, bias_grad: Tensor | None) -> Tensor:
    """The layer's gradient as ``G: [d_out, a_dim]``: weight (conv reshaped to ``[C_out, C_in*kh*kw]``), bias last.

    A layer with a bias whose gradient is None (e.g. a frozen bias) gets a zero bias column, so G keeps
    the shape of the factors. A weight stored transposed (``layer.weight_transposed``, HF Conv1D) is
    passed as ``weight.grad.t()``: this function takes the ``[d_out, ...]`` layout only.
    """
    if weight_grad.dim() < 2 or weight_grad.shape[0] != layer.d_out or weight_grad[0].numel() != layer.d_in:
        hint = " (a transposed weight must be passed as weight.grad.t())" if layer.weight_transposed else ""
        raise ConfigError(
            f"layer {layer.name!r}: weight gradient {tuple(weight_grad.shape)} is not "
            f"[d_out={layer.d_out}, d_in={layer.d_in}] (conv: [C_out, C_in, kh, kw]){hint}"
        )
    g = weight_grad.reshape(layer.d_out, layer.d_in)
    if layer.bias is None:
        if bias_grad is not None:
            raise ConfigError(f"layer {layer.name!r} has no bias but a bias gradient was given")
        return g
    col = g.new_zeros(layer.d_out) if bias_grad is None else bias_grad.reshape(layer.d_out).to(g.dtype)
    return torch.cat([g, col.unsqueeze(1)], dim=1)


def split_grad(layer: KFACLayer, P: Tensor) -> tuple[Tensor, Tensor | None]:
    """Inverse of `grad_matrix`: ``(weight-shaped, bias-shaped or None)``.

    The weight comes back as ``[d_out, d_in]`` (Linear) or ``[C_out, C_in, kh, kw]`` (Conv2d); a weight
    stored transposed (``layer.weight_transposed``) is transposed back by the caller.
    """
    w, bias = _split_views(layer, P)
    return w.contiguous(), None if bias is None else bias.contiguous()


def _split_views(layer: KFACLayer, P: Tensor) -> tuple[Tensor, Tensor | None]:
    """`split_grad` without the copies: views of P (what `Preconditioner` copies into the gradients)."""
    if tuple(P.shape) != (layer.d_out, layer.a_dim):
        raise ConfigError(f"layer {layer.name!r}: expected [{layer.d_out}, {layer.a_dim}], got {tuple(P.shape)}")
    w = P[:, : layer.d_in]
    if layer.kind is LayerKind.CONV2D:
        if layer.conv is None:
            raise ConfigError(f"layer {layer.name!r} is a conv2d without a ConvSpec")
        kh, kw = layer.conv.kernel_size
        w = w.reshape(layer.d_out, layer.d_in // (kh * kw), kh, kw)
    return w, P[:, layer.d_in] if layer.bias is not None else None


def precondition(G: Tensor, inv: Inverse | None) -> Tensor:
    """``P`` for gradient matrix ``G``; ``inv is None`` (no inverse yet, or none could be made) returns G itself.

    Computed in the inverse's dtype, returned in G's dtype.
    """
    if inv is None:
        return G
    g = G.to(_dtype_of(inv))
    if inv.method == InverseMethod.CHOLESKY:
        assert inv.a_inv is not None and inv.b_inv is not None, "the cholesky form holds a_inv and b_inv"
        p = inv.b_inv @ g @ inv.a_inv
    else:
        assert inv.q_a is not None and inv.l_a is not None and inv.q_b is not None and inv.l_b is not None, (
            "the eigen form holds q_a, l_a, q_b and l_b"
        )
        rotated = inv.q_b.t() @ g @ inv.q_a
        p = inv.q_b @ rotated.div_(inv.eigen_divisor) @ inv.q_a.t()
    return p.to(G.dtype)


def kl_clip_scale(dot_sum: float, lr: float, kappa: float | None) -> float:
    """``nu = min(1, sqrt(kappa / (lr^2 * dot_sum)))``, with ``dot_sum = sum_l <P_l, G_l>`` over all layers.

    Returns 1 (no clipping) when ``kappa`` is None, or when ``dot_sum <= 0``, ``lr == 0`` or ``dot_sum``
    is NaN: the bound is then vacuous or undefined. An infinite ``dot_sum`` gives 0.
    """
    if kappa is None or lr == 0 or math.isnan(dot_sum) or dot_sum <= 0:
        return 1.0
    return min(1.0, math.sqrt(kappa / (lr * lr * dot_sum)))


def _dtype_of(inv: Inverse) -> torch.dtype:
    """dtype of the inverse's tensors."""
    t = inv.a_inv if inv.method == InverseMethod.CHOLESKY else inv.q_a
    assert t is not None, "an Inverse holds the tensors of its form"
    return t.dtype


class Preconditioner:
    """Preconditions the gradients of a fixed group of layers (one stage's, or the whole model's).

    ``__call__`` replaces each layer's weight/bias gradient in place by ``P = B^-1 G A^-1`` (or by G
    itself when the layer has no active inverse yet) and returns ``sum_l <P_l, G_l>`` as a float64
    scalar tensor, so the caller can all-reduce it across stages before the KL-clip. `scale` then
    multiplies the same gradients by the clip factor ``nu``; other parameters are never touched.
    """

    def __init__(self, layers: Sequence[KFACLayer]) -> None:
        self.layers = tuple(layers)

    def __call__(self, grads: MutableMapping[str, Tensor], states: Mapping[str, LayerState]) -> Tensor:
        """Precondition ``grads`` (parameter FQN -> gradient) in place; returns ``sum_l <P_l, G_l>``.

        Each ``<P_l, G_l>`` multiplies in the gradients' dtype and sums in float64.
        """
        dots: list[Tensor] = []
        for layer in self.layers:
            weight_grad = grads.get(layer.weight)
            if weight_grad is None:
                continue
            bias_grad = grads.get(layer.bias) if layer.bias is not None else None
            w = weight_grad.t() if layer.weight_transposed else weight_grad
            G = grad_matrix(layer, w, bias_grad)
            P = precondition(G, states[layer.name].active)
            dots.append(torch.sum(P * G, dtype=torch.float64))
            if P is G:  # no inverse: the gradients stay as they are
                continue
            new_w, new_b = _split_views(layer, P)
            weight_grad.copy_(new_w.t() if layer.weight_transposed else new_w)
            if bias_grad is not None and new_b is not None:
                bias_grad.copy_(new_b)
        total = torch.zeros((), dtype=torch.float64)
        for dot in dots:  # one by one, in layer order, as the sum was always made
            total = total + dot.cpu()
        return total

    def scale(self, grads: MutableMapping[str, Tensor], nu: float) -> None:
        """Multiply the K-FAC layers' gradients by the KL-clip factor ``nu`` (in place)."""
        if nu == 1.0:
            return
        for layer in self.layers:
            for key in (layer.weight, layer.bias):
                if key is not None and grads.get(key) is not None:
                    grads[key].mul_(nu)
