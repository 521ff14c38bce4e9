"""Precondition a group of K-FAC layers: gradients by parameter name -> natural gradients, and sum <P, G>."""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence

import torch
from torch import Tensor

from fxkfac.kfac.precondition import grad_matrix, precondition, split_grad
from fxkfac.kfac.state import LayerState
from fxkfac.passes.layers import KFACLayer

__all__ = ["Preconditioner", "make_preconditioner"]


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
        """Precondition ``grads`` (parameter FQN -> gradient) in place; returns ``sum_l <P_l, G_l>``."""
        total = torch.zeros((), dtype=torch.float64)
        for layer in self.layers:
            weight_grad = grads.get(layer.weight)
            if weight_grad is None:
                continue
            bias_grad = grads.get(layer.bias) if layer.bias is not None else None
            w = weight_grad.t() if layer.weight_transposed else weight_grad
            G = grad_matrix(layer, w, bias_grad)
            P = precondition(G, states[layer.name].active)
            total = total + (P.double() * G.double()).sum().cpu()
            new_w, new_b = split_grad(layer, P)
            weight_grad.copy_(new_w.t() if layer.weight_transposed else new_w)
            if bias_grad is not None and new_b is not None:
                bias_grad.copy_(new_b)
        return total

    def scale(self, grads: MutableMapping[str, Tensor], nu: float) -> None:
        """Multiply the K-FAC layers' gradients by the KL-clip factor ``nu`` (in place)."""
        if nu == 1.0:
            return
        for layer in self.layers:
            for key in (layer.weight, layer.bias):
                if key is not None and grads.get(key) is not None:
                    grads[key].mul_(nu)


def make_preconditioner(layers: Sequence[KFACLayer]) -> Preconditioner:
    """The precondition function of ``layers`` (see `Preconditioner`)."""
    return Preconditioner(layers)
