"""The inference form of a captured (train-mode) graph: what ``module.eval()`` would have exported.

torch.export bakes the mode into the graph: a train-mode export calls ``aten.dropout(x, p, True)`` and
``aten.batch_norm(..., training=True, ...)`` beside an in-place ``num_batches_tracked += 1``, and calling
``.eval()`` on the GraphModule changes none of them. `eval_graph` rewrites a copy of the graph: dropout becomes
the identity, batch norm with running statistics normalizes by them (and updates nothing), and the counter's
increment goes. The copy shares the module's parameters and buffers (the same tensor objects), so it always
computes with the weights training has reached.
"""

from __future__ import annotations

import copy

import torch
from torch import fx

__all__ = ["eval_graph", "DROPOUTS"]

_aten = torch.ops.aten
DROPOUTS = (_aten.dropout.default, _aten.feature_dropout.default, _aten.alpha_dropout.default)
"""Dropout ops whose arguments are (input, p, train): the identity in eval mode."""
_BATCH_NORM_TRAINING = 5
"""The index of `training` in aten.batch_norm's arguments (input, weight, bias, running_mean, running_var,
training, momentum, eps, cudnn_enabled)."""


def _is_counter_increment(node: fx.Node) -> bool:
    """``num_batches_tracked.add_(1)``: the batch-norm counter a train-mode forward advances."""
    if node.op != "call_function" or node.target is not _aten.add_.Tensor or not node.args:
        return False
    target = node.args[0]
    return (
        isinstance(target, fx.Node) and target.op == "get_attr" and str(target.target).endswith("num_batches_tracked")
    )


def eval_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """A GraphModule computing `gm` in eval mode, on `gm`'s own parameters and buffers (`gm` is unchanged)."""
    graph = copy.deepcopy(gm.graph)
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in DROPOUTS:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
        elif node.target is _aten.batch_norm.default and node.args[3] is not None:  # running statistics kept
            args = list(node.args)
            args[_BATCH_NORM_TRAINING] = False
            node.args = tuple(args)
        elif _is_counter_increment(node) and not node.users:
            graph.erase_node(node)
    return fx.GraphModule(gm, graph)
