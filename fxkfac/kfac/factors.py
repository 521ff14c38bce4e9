"""Kronecker factors of one layer: rows of a and e (tokens flattened, conv im2col, bias column),
A = rows^T rows / rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from fxkfac.errors import ConfigError
from fxkfac.passes.factor_capture import gram
from fxkfac.passes.layers import KFACLayer, LayerKind

__all__ = ["a_rows", "e_rows", "factor", "running_average"]


def a_rows(a: Tensor, layer: KFACLayer) -> Tensor:
    """The layer input as rows of A's sum: ``[rows, a_dim]``.

    Linear: every leading dimension (samples, tokens) is a row. Conv2d: im2col with the layer's
    geometry (``F.unfold``), one row per sample and output position, columns ordered (C_in, kh, kw)
    like ``weight.reshape(C_out, -1)``. With a bias, a column of ones is appended last, matching the
    bias column that `grad_matrix` appends to the gradient.
    """
    if layer.kind is LayerKind.CONV2D:
        rows = _im2col(a, layer)
    else:
        rows = a.reshape(-1, a.shape[-1])
    if rows.shape[-1] != layer.d_in:
        raise ConfigError(
            f"layer {layer.name!r}: input gives {rows.shape[-1]} columns, expected d_in={layer.d_in}; "
            "the KFACLayer record does not match the tensor captured for it"
        )
    if layer.bias is not None:
        rows = torch.cat([rows, rows.new_ones(rows.shape[0], 1)], dim=1)
    return rows


def e_rows(e: Tensor, layer: KFACLayer, n: int) -> Tensor:
    """The output gradient dL/dy as rows of B's sum, ``[rows, d_out]``, multiplied by ``n``.

    ``n`` is the number of samples in the *global* mini-batch: the loss is a mean over samples, so
    ``n * dL/dy`` is each sample's own loss gradient. Conv2d ``[N, C, H, W]`` becomes ``[N*H*W, C]``
    (rows in the same sample-major, position-minor order as `a_rows`).
    """
    if layer.kind is LayerKind.CONV2D:
        if e.dim() != 4:
            raise ConfigError(
                f"layer {layer.name!r}: conv2d output gradient must be [N, C, H, W], got {tuple(e.shape)}"
            )
        rows = e.permute(0, 2, 3, 1).reshape(-1, e.shape[1])
    else:
        rows = e.reshape(-1, e.shape[-1])
    if rows.shape[-1] != layer.d_out:
        raise ConfigError(
            f"layer {layer.name!r}: output gradient has {rows.shape[-1]} columns, expected d_out={layer.d_out}"
        )
    return rows * n


def factor(rows: Tensor, dtype: torch.dtype | str = torch.float32) -> Tensor:
    """``rows^T rows / rows.shape[0]`` computed in ``dtype`` (float32 by default, whatever the rows' dtype).

    ``dtype`` may be a name such as ``KFACConfig.factor_dtype`` ("float32", "float64").
    """
    if rows.dim() != 2 or rows.shape[0] == 0:
        raise ConfigError(f"factor() needs a non-empty [rows, dim] matrix, got shape {tuple(rows.shape)}")
    return gram(rows.to(_as_dtype(dtype)))


def running_average(old: Tensor | None, new: Tensor, decay: float) -> Tensor:
    """``decay * old + (1 - decay) * new``; the first refresh (``old is None``) takes ``new`` as is."""
    if old is None:
        return new
    if old.dtype != new.dtype or old.shape != new.shape:
        return old * decay + new * (1.0 - decay)
    return (old * decay).add_(new * (1.0 - decay))  # the same roundings, one temporary fewer


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A torch floating dtype from itself or its name."""
    resolved = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ConfigError(f"factor dtype must be a floating dtype such as 'float32', got {dtype!r}")
    return resolved


def _im2col(a: Tensor, layer: KFACLayer) -> Tensor:
    """Conv2d input ``[N, C, H, W]`` -> patches ``[N * L, C * kh * kw]`` (L output positions)."""
    spec = layer.conv
    if spec is None:
        raise ConfigError(f"layer {layer.name!r} is a conv2d without a ConvSpec; the capture must record its geometry")
    if a.dim() != 4:
        raise ConfigError(f"layer {layer.name!r}: conv2d input must be [N, C, H, W], got {tuple(a.shape)}")
    cols = F.unfold(a, spec.kernel_size, dilation=spec.dilation, padding=spec.padding, stride=spec.stride)
    return cols.transpose(1, 2).reshape(-1, cols.shape[1])
