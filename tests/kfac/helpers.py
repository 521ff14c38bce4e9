"""Test helpers: KFACLayer records for nn modules, a/e capture by plain module hooks, dense Kronecker references."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from fxkfac.passes.layers import ConvSpec, KFACLayer

__all__ = ["layer_of", "capture_a_e", "vec", "unvec", "dense_kron_solve"]


def layer_of(module: nn.Module, name: str = "layer") -> KFACLayer:
    """The KFACLayer record of an nn.Linear or nn.Conv2d (what the capture pass would produce)."""
    bias = f"{name}.bias" if module.bias is not None else None
    if isinstance(module, nn.Conv2d):
        spec = ConvSpec(tuple(module.kernel_size), tuple(module.stride), tuple(module.padding), tuple(module.dilation))
        d_in = module.in_channels * module.kernel_size[0] * module.kernel_size[1]
        return KFACLayer(name, "conv2d", f"{name}.weight", bias, d_in, module.out_channels, conv=spec)
    return KFACLayer(name, "linear", f"{name}.weight", bias, module.in_features, module.out_features)


def capture_a_e(
    model: nn.Module, modules: dict[str, nn.Module], run: Callable[[], Tensor]
) -> dict[str, tuple[Tensor, Tensor]]:
    """``{name: (a, dL/dy)}`` for each module, from a forward-pre hook and a full-backward hook around ``run()``.

    ``run`` computes the loss; its backward is done here.
    """
    a: dict[str, Tensor] = {}
    e: dict[str, Tensor] = {}
    handles = []
    for name, mod in modules.items():
        handles.append(mod.register_forward_pre_hook(lambda m, args, name=name: a.__setitem__(name, args[0].detach())))
        handles.append(
            mod.register_full_backward_hook(lambda m, gin, gout, name=name: e.__setitem__(name, gout[0].detach()))
        )
    try:
        model.zero_grad()
        run().backward()
    finally:
        for h in handles:
            h.remove()
    return {name: (a[name], e[name]) for name in modules}


def vec(m: Tensor) -> Tensor:
    """Column-major vectorization: vec(B X A) = (A^T kron B) vec(X)."""
    return m.t().reshape(-1)


def unvec(v: Tensor, rows: int, cols: int) -> Tensor:
    """Inverse of `vec`."""
    return v.reshape(cols, rows).t()


def dense_kron_solve(A: Tensor, B: Tensor, G: Tensor, shift: float = 0.0) -> Tensor:
    """``unvec((A kron B + shift I)^-1 vec(G))`` with a dense Kronecker product, in float64."""
    A64, B64, G64 = A.double(), B.double(), G.double()
    K = torch.kron(A64, B64) + shift * torch.eye(A.shape[0] * B.shape[0], dtype=torch.float64)
    return unvec(torch.linalg.solve(K, vec(G64)), G.shape[0], G.shape[1])
