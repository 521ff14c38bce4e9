"""Grafting (paper §2.4): the diagonal method whose per-block step length the Shampoo direction takes.

The accumulator is updated with the raw gradient G (L2 weight decay included) every step; the direction is
taken along the filtered, bias-corrected gradient. RMSProp and Adam share the accumulator (an EMA of G^2 with
grafting_beta2, from zero); only Adam bias-corrects it (when use_bias_correction), as the reference code does.
SGD's direction is the gradient itself.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from fxkfac.shampoo.config import GraftType
from fxkfac.shampoo.layout import running_sum

__all__ = ["accumulate", "direction"]


def accumulate(kind: GraftType, acc: Tensor | None, grad: Tensor, beta2: float) -> Tensor | None:
    """The new accumulator (a new tensor): sum of G^2 (AdaGrad), its EMA (RMSProp, Adam), none (SGD)."""
    if kind is GraftType.SGD:
        return None
    beta = 1.0 if kind is GraftType.ADAGRAD else beta2
    if acc is None or beta == 1.0:
        return running_sum(acc, grad * grad, beta)
    return torch.addcmul(acc * beta, grad, grad, value=1.0 - beta)  # beta A + (1 - beta) G^2 in two passes


def direction(
    kind: GraftType, acc: Tensor | None, grad: Tensor, count: int, *, eps: float, beta2: float, bias_correction: bool
) -> Tensor:
    """The graft direction of `grad` (filtered): G (SGD) or G / (sqrt(A) + eps), A bias-corrected for Adam;
    `count` = steps folded so far (t + 1)."""
    if kind is GraftType.SGD:
        return grad
    if acc is None:
        raise AssertionError(f"the {kind} graft direction is taken before its accumulator was ever updated")
    denom = acc.sqrt()
    if kind is GraftType.ADAM and bias_correction and beta2 < 1.0:
        denom.mul_(1.0 / math.sqrt(1.0 - beta2**count))  # sqrt(A / c) as sqrt(A) / sqrt(c): no pass over A / c
    return grad / denom.add_(eps)
