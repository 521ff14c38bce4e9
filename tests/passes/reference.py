"""Reference factors for the tests: a and dL/dy from forward-pre and full-backward module hooks on the eager model."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from fxkfac.kfac.factors import a_rows, e_rows, factor
from fxkfac.passes.layers import KFACLayer

__all__ = ["hook_a_e", "hook_factors"]


def hook_a_e(
    model: nn.Module, layers: Sequence[KFACLayer], run: Callable[[], Tensor]
) -> dict[str, tuple[Tensor, Tensor]]:
    """``{layer: (input a, dL/dy)}`` captured by module hooks around ``run()`` (which returns the loss to backprop)."""
    a: dict[str, Tensor] = {}
    e: dict[str, Tensor] = {}
    handles = []
    for layer in layers:
        module = model.get_submodule(layer.name)
        handles.append(
            module.register_forward_pre_hook(
                lambda mod, inp, name=layer.name: a.__setitem__(name, inp[0].detach().clone())
            )
        )
        handles.append(
            module.register_full_backward_hook(
                lambda mod, gin, gout, name=layer.name: e.__setitem__(name, gout[0].detach().clone())
            )
        )
    try:
        run().backward()
    finally:
        for h in handles:
            h.remove()
    return {name: (a[name], e[name]) for name in a}


def hook_factors(
    model: nn.Module, layers: Sequence[KFACLayer], run: Callable[[], Tensor], n: int, dtype: torch.dtype = torch.float64
) -> dict[str, tuple[Tensor, Tensor]]:
    """``{layer: (A_m, B_m)}`` per ARCHITECTURE.md from hooked a / e; ``n`` samples in the global mini-batch."""
    by_name = {layer.name: layer for layer in layers}
    return {
        name: (factor(a_rows(a, by_name[name]), dtype), factor(e_rows(g, by_name[name], n), dtype))
        for name, (a, g) in hook_a_e(model, layers, run).items()
    }
