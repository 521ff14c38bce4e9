"""Grafting (paper §2.4): the diagonal method whose per-block step length the Shampoo direction takes.

The accumulator is updated with the raw gradient G (L2 weight decay included) every step; the direction is
taken along the filtered, bias-corrected gradient. RMSProp and Adam share the accumulator (an EMA of G^2 with
grafting_beta2, from zero); only Adam bias-corrects it (when use_bias_correction), as the reference code does.
SGD's direction is the gradient itself.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from fxkfac.shampoo.config import GraftType
from fxkfac.shampoo.layout import running_squares

__all__ = ["accumulate", "direction"]


def accumulate(
    kind: GraftType, accs: Sequence[Tensor | None], grads: Sequence[Tensor], beta2: float
) -> list[Tensor] | list[None]:
    """The new accumulators of parameters' gradients (new tensors): sum of G^2 (AdaGrad), its EMA (RMSProp, Adam),
    none (SGD)."""
    if kind is GraftType.SGD:
        return [None] * len(grads)
    return running_squares(accs, grads, 1.0 if kind is GraftType.ADAGRAD else beta2)


def direction(
    kind: GraftType,
    accs: Sequence[Tensor | None],
    grads: Sequence[Tensor],
    counts: Sequence[int],
    *,
    eps: float,
    beta2: float,
    bias_correction: bool,
) -> list[Tensor]:
    """The graft directions of parameters' filtered gradients: G (SGD) or G / (sqrt(A) + eps), A bias-corrected for
    Adam; `counts` = steps folded so far (t + 1) per parameter. One `torch._foreach_*` op per pass."""
    if kind is GraftType.SGD or not grads:
        return list(grads)
    present = [acc for acc in accs if acc is not None]
    if len(present) != len(grads):
        raise AssertionError(f"the {kind} graft direction is taken before its accumulator was ever updated")
    denoms = torch._foreach_sqrt(present)
    if kind is GraftType.ADAM and bias_correction and beta2 < 1.0:  # sqrt(A / c) as sqrt(A) / sqrt(c): no A / c
        torch._foreach_mul_(denoms, [1.0 / math.sqrt(1.0 - beta2**count) for count in counts])
    torch._foreach_add_(denoms, eps)
    return list(torch._foreach_div(list(grads), denoms))
