"""Names of the node.meta keys fxkfac passes read and write (one registry, no loose strings)."""

from __future__ import annotations

__all__ = ["LAYER", "TAP", "STAGE", "NN_MODULE_STACK"]

NN_MODULE_STACK = "nn_module_stack"
"""Written by torch.export: {key: (module FQN, module type)} from outermost to innermost."""
LAYER = "fxkfac.layer"
"""The KFACLayer a linear/conv node (or one of its taps) belongs to."""
TAP = "fxkfac.tap"
"""On tap nodes: ("a" | "e", capture mode)."""
STAGE = "fxkfac.stage"
"""The pipeline stage index a node is assigned to."""
