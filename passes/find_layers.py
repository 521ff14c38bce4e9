"""K-FAC layer discovery on a captured ATen graph: Linear / Conv1D / Conv2d nodes named by module FQN, skip rules."""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import fx

from fxkfac.passes.layers import ConvSpec, KFACLayer, LayerKind
from fxkfac.passes.meta import LAYER, NN_MODULE_STACK

__all__ = ["LAYER_OPS", "find_kfac_layers", "layer_nodes", "layer_input"]

_aten = torch.ops.aten
LAYER_OPS = (_aten.linear.default, _aten.addmm.default, _aten.conv2d.default, _aten.convolution.default)
"""ATen ops that can be K-FAC layers (addmm: HF Conv1D or a decomposed Linear; convolution: generic conv)."""


@dataclass(frozen=True, slots=True)
class _Candidate:
    """What one layer node says about itself before the skip rules run."""

    node: fx.Node
    layer: KFACLayer | None
    reason: str | None


def find_kfac_layers(
    gm: fx.GraphModule,
    *,
    skip: Iterable[str] = (),
    skip_vocab_head: bool = True,
    vocab_size: int | None = None,
) -> tuple[list[KFACLayer], dict[str, str]]:
    """The K-FAC layers of ``gm`` in graph order, and the skipped ones with the reason.

    A layer is an ``aten.linear`` / ``aten.addmm`` / ``aten.conv2d`` / ``aten.convolution`` node whose
    weight is a parameter of ``gm``; it is named by the innermost ``nn_module_stack`` entry (the
    module FQN; a weight of a submodule that is not called itself, as nn.MultiheadAttention's ``out_proj``, names
    its layer by that submodule). Skipped (with the reason): names matching a regex of ``skip``; a head whose output
    width equals the vocabulary (``vocab_size``, inferred from the largest ``aten.embedding`` weight
    when None); frozen weights; weights used by more than one node (tied/shared); grouped,
    transposed or non-2D convolutions (these also warn). The vocabulary rule applies to output
    layers only (no other layer op between them and the graph output), so that an inner layer that
    happens to be as wide as the vocabulary stays.

    Reads ``node.meta["val"]`` and ``nn_module_stack``; writes ``node.meta[LAYER]`` on kept layer
    nodes (and removes a stale one from skipped nodes).
    """
    patterns = [re.compile(p) for p in skip]
    uses = _weight_uses(gm)
    vocab = vocab_size if vocab_size is not None else _infer_vocab(gm)
    batch = _batch_size(gm)
    heads = _output_layers(gm)
    layers: list[KFACLayer] = []
    skipped: dict[str, str] = {}
    for cand in _candidates(gm, batch):
        cand.node.meta.pop(LAYER, None)
        name = cand.layer.name if cand.layer is not None else _node_name(cand.node)
        vocab_head = skip_vocab_head and cand.node in heads and vocab is not None
        if cand.layer is None:
            reason = cand.reason
        else:
            reason = cand.reason or _skip_reason(cand.layer, gm, uses, patterns, vocab if vocab_head else None)
        if reason is not None:
            skipped[name] = reason
            continue
        if any(existing.name == name for existing in layers):
            skipped[name] = "the module is called more than once (shared weights)"
            layers = [existing for existing in layers if existing.name != name]
            continue
        assert cand.layer is not None, "a candidate without a layer has a reason"
        cand.node.meta[LAYER] = cand.layer
        layers.append(cand.layer)
    for node in layer_nodes(gm):
        if node.meta[LAYER].name in skipped:
            del node.meta[LAYER]
    return layers, skipped


def layer_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes that `find_kfac_layers` marked with ``node.meta[LAYER]``, in graph order."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and LAYER in n.meta]


def layer_input(node: fx.Node) -> fx.Node:
    """The activation input ``a`` of a layer node (addmm: ``mat1``; others: the first argument)."""
    arg = node.args[1] if node.target is _aten.addmm.default else node.args[0]
    if not isinstance(arg, fx.Node):
        raise AssertionError(f"layer node {node.format_node()} has a non-tensor input {arg!r}")
    return arg


def _candidates(gm: fx.GraphModule, batch: int | None) -> list[_Candidate]:
    """Every layer-op node whose weight is a parameter, described (or with the reason it cannot be)."""
    out = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in LAYER_OPS:
            continue
        weight = _weight_node(node)
        if weight is None:
            continue
        out.append(_describe(node, weight, gm, batch))
    return out


def _weight_node(node: fx.Node) -> tuple[fx.Node, bool] | None:
    """``(get_attr node of the weight, stored [d_in, d_out])``, or None when the weight is not a parameter."""
    if node.target is _aten.addmm.default:
        w = node.args[2]
        if isinstance(w, fx.Node) and w.op == "call_function" and w.target in (_aten.t.default, _aten.permute.default):
            inner = w.args[0]
            return (inner, False) if isinstance(inner, fx.Node) and inner.op == "get_attr" else None
        return (w, True) if isinstance(w, fx.Node) and w.op == "get_attr" else None
    w = node.args[1]
    return (w, False) if isinstance(w, fx.Node) and w.op == "get_attr" else None


def _describe(node: fx.Node, weight: tuple[fx.Node, bool], gm: fx.GraphModule, batch: int | None) -> _Candidate:
    """A KFACLayer for ``node`` or the reason it cannot be one."""
    w_node, transposed = weight
    name = _layer_name(node, str(w_node.target))
    w = _param(gm, str(w_node.target))
    if w is None:
        return _Candidate(node, None, "its weight is a buffer or constant, not a parameter")
    bias_arg = node.args[0] if node.target is _aten.addmm.default else (node.args[2] if len(node.args) > 2 else None)
    if bias_arg is not None and not (isinstance(bias_arg, fx.Node) and bias_arg.op == "get_attr"):
        return _Candidate(node, None, "its bias is computed in forward, not a parameter")
    bias = str(bias_arg.target) if bias_arg is not None else None
    is_conv = node.target in (_aten.conv2d.default, _aten.convolution.default)
    if is_conv:
        conv, reason = _conv_spec(node, w)
        if conv is None:
            warnings.warn(f"K-FAC skips {name}: {reason}", stacklevel=3)
            return _Candidate(node, None, reason)
        d_out, d_in = w.shape[0], math.prod(w.shape[1:])
    else:
        conv = None
        d_out, d_in = (w.shape[1], w.shape[0]) if transposed else (w.shape[0], w.shape[1])
    layer = KFACLayer(
        name=name,
        kind=LayerKind.CONV2D if is_conv else LayerKind.LINEAR,
        weight=str(w_node.target),
        bias=bias,
        d_in=int(d_in),
        d_out=int(d_out),
        tokens_per_sample=_tokens(node, batch, is_conv),
        conv=conv,
        weight_transposed=transposed,
    )
    return _Candidate(node, layer, None)


def _conv_spec(node: fx.Node, w: torch.Tensor) -> tuple[ConvSpec | None, str]:
    """ConvSpec of a 2-D, ungrouped, non-transposed convolution node, or None and why not."""
    args = list(node.args) + [None] * 9
    if node.target is _aten.convolution.default:
        stride, padding, dilation, transposed, groups = args[3], args[4], args[5], args[6], args[8]
    else:
        stride, padding, dilation, groups = args[3] or [1, 1], args[4] or [0, 0], args[5] or [1, 1], args[6] or 1
        transposed = False
    if w.dim() != 4:
        return None, f"a {w.dim() - 2}-D convolution (only Conv2d is supported)"
    if transposed:
        return None, "a transposed convolution (not supported by K-FAC here)"
    if groups != 1:
        return None, f"a grouped convolution (groups={groups}; only groups=1 is supported)"
    pair = lambda v: (int(v[0]), int(v[-1])) if isinstance(v, (list, tuple)) else (int(v), int(v))  # noqa: E731
    return ConvSpec(
        kernel_size=(int(w.shape[2]), int(w.shape[3])),
        stride=pair(stride),
        padding=pair(padding),
        dilation=pair(dilation),
    ), ""


def _tokens(node: fx.Node, batch: int | None, is_conv: bool) -> int:
    """Rows each sample contributes: conv output positions, or the tokens of a Linear's output."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return 1
    if is_conv:
        return int(math.prod(val.shape[2:]))
    if val.dim() > 2 or batch is None:
        return int(math.prod(val.shape[1:-1])) if val.dim() > 2 else 1
    rows = int(val.shape[0])
    return rows // batch if batch > 0 and rows % batch == 0 else 1


def _skip_reason(
    layer: KFACLayer, gm: fx.GraphModule, uses: dict[str, int], patterns: list[re.Pattern[str]], head_vocab: int | None
) -> str | None:
    """Why a well-formed layer is left to the base optimizer, or None to keep it.

    ``head_vocab`` is the vocabulary size when the layer is an output layer subject to the vocab rule.
    """
    for p in patterns:
        if p.search(layer.name):
            return f"matches skip pattern {p.pattern!r}"
    if uses.get(layer.weight, 0) > 1:
        return f"weight {layer.weight} is used by {uses[layer.weight]} nodes (tied or shared weights)"
    w = _param(gm, layer.weight)
    if w is not None and not w.requires_grad:
        return "weight is frozen (requires_grad=False)"
    if head_vocab is not None and layer.d_out == head_vocab:
        return (
            f"an output layer whose width equals the vocabulary size {head_vocab} (an LM head; "
            "set KFACConfig(skip_vocab_head=False) to keep it)"
        )
    return None


def _output_layers(gm: fx.GraphModule) -> set[fx.Node]:
    """Layer-op nodes whose output reaches the graph output without passing through another layer op."""
    reached: set[fx.Node] = set()
    todo = [n for n in gm.graph.nodes if n.op == "output"]
    while todo:
        node = todo.pop()
        for inp in node.all_input_nodes:
            if inp in reached:
                continue
            reached.add(inp)
            if not (inp.op == "call_function" and inp.target in LAYER_OPS):
                todo.append(inp)
    return {n for n in reached if n.op == "call_function" and n.target in LAYER_OPS}


def _weight_uses(gm: fx.GraphModule) -> dict[str, int]:
    """How many compute nodes use each parameter (through get_attr nodes and transposes)."""
    counts: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        users = 0
        for user in node.users:
            is_view = user.target in (_aten.t.default, _aten.permute.default)
            users += len(user.users) if is_view else 1
        counts[str(node.target)] = counts.get(str(node.target), 0) + users
    return counts


def _infer_vocab(gm: fx.GraphModule) -> int | None:
    """Rows of the largest weight used by ``aten.embedding`` (the token vocabulary), or None."""
    sizes = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is _aten.embedding.default:
            w = node.args[0]
            if isinstance(w, fx.Node) and w.op == "get_attr":
                t = _param(gm, str(w.target))
                if t is not None:
                    sizes.append(int(t.shape[0]))
    return max(sizes) if sizes else None


def _batch_size(gm: fx.GraphModule) -> int | None:
    """Dim 0 of the first tensor input: the samples of the example batch (to turn addmm rows into tokens)."""
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder" and isinstance(val, torch.Tensor) and val.dim() > 0:
            return int(val.shape[0])
    return None


def _layer_name(node: fx.Node, weight: str) -> str:
    """A layer's name: its module's FQN (`_node_name`), or the module that owns the weight where that module sits
    inside it and was never called itself: nn.MultiheadAttention's ``out_proj`` (a Linear whose weight
    F.multi_head_attention_forward uses directly, which kfac-pytorch misses, their #267)."""
    name = _node_name(node)
    owner = weight.rpartition(".")[0]
    return owner if owner.startswith(f"{name}.") else name


def _node_name(node: fx.Node) -> str:
    """Innermost module FQN from ``nn_module_stack``, else the node's own name."""
    stack = node.meta.get(NN_MODULE_STACK) or {}
    if stack:
        return str(list(stack.values())[-1][0])
    return node.name


def _param(gm: fx.GraphModule, target: str) -> torch.Tensor | None:
    """The parameter at ``target`` in ``gm``, or None when it is a buffer/constant/missing."""
    try:
        return gm.get_parameter(target)
    except AttributeError:
        return None
