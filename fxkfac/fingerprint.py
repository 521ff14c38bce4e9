"""A stable hash of what a plan is made for: the preconditioned units (K-FAC layers, parameters) and their shapes,
the stage split, mesh and schedule."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from fxkfac.passes.layers import KFACLayer

__all__ = ["graph_fingerprint"]

_VERSION = "fx1"


def _layer_record(layer: Any) -> list[object]:
    """What identifies a unit: a K-FAC layer's name, kind, widths, bias, tokens and conv; any other unit's name,
    kind and shape."""
    if not isinstance(layer, KFACLayer):
        return [layer.name, type(layer).__name__, list(getattr(layer, "shape", ()))]
    conv = (
        None
        if layer.conv is None
        else [
            list(layer.conv.kernel_size),
            list(layer.conv.stride),
            list(layer.conv.padding),
            list(layer.conv.dilation),
        ]
    )
    return [
        layer.name,
        layer.kind,
        layer.d_in,
        layer.d_out,
        layer.bias is not None,
        layer.tokens_per_sample,
        conv,
        layer.weight_transposed,
    ]


def graph_fingerprint(
    layers: Sequence[Any],
    stage_layers: Mapping[int, Sequence[str]],
    *,
    schedule: str,
    D: int,
    N: int,
    W: int,
    v: int = 1,
    micro_batch_size: int,
) -> str:
    """``"fx1-<16 hex>"``: equal exactly when the layers (names, kinds, widths, bias, tokens), the stage each
    layer is on, the schedule, D, N, W, v and the micro-batch size are equal.

    Independent of process, dict order and Python's hash seed, so every rank (and a laptop making an
    ahead-of-time plan) computes the same string.
    """
    payload = {
        "layers": [_layer_record(layer) for layer in layers],
        "stages": [[int(s), list(stage_layers[s])] for s in sorted(stage_layers)],
        "schedule": str(schedule),
        "D": D,
        "N": N,
        "W": W,
        "v": v,
        "micro_batch_size": micro_batch_size,
    }
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return f"{_VERSION}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"
