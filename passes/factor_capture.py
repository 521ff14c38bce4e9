"""Factor capture in the graph: the insert_factor_capture pass, and the fxkfac::tap_a / fxkfac::tap_e custom ops
that make fused captures (deferred ones are plain graph values: the layer input, and the gradient of a zero probe
added to the layer output, so they cost no copy).

[Note: factor scaling] The ops never see ``n`` (samples in the global mini-batch). With ``a`` the layer
input and ``g`` the raw gradient of the layer output that reaches the tap (the gradient of whatever
loss the caller backpropagates), both flattened to rows as in ``fxkfac.kfac.factors``:
- fused A: ``A_m = a_rows^T a_rows / rows`` (bias column included): already the K-FAC ``A_m``;
- fused B: ``g_rows^T g_rows / rows``: the caller multiplies by ``n**2`` to get ``B_m``
  (``e_rows`` multiplies the rows by ``n``);
- deferred A: the layer input itself (as the layer sees it); the caller applies ``a_rows``/``factor``;
- deferred B: ``g`` itself (the output's shape); the caller applies ``e_rows(g, layer, n)``/``factor``.
Fused factors are float32 for half/bfloat16 inputs and in the input's dtype otherwise.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, fx

from fxkfac.passes.find_layers import layer_input
from fxkfac.passes.layers import KFACLayer, LayerKind
from fxkfac.passes.meta import LAYER, NN_MODULE_STACK, TAP
from fxkfac.planner.problem import Capture

__all__ = ["FactorTaps", "gram", "insert_factor_capture", "new_probes", "tap_a", "tap_e", "probe_shape"]

_GRAM_PANELS, _GRAM_MIN_WIDTH = 8, 128
"""`gram`'s column panels: at most 8, each at least 128 columns wide."""


def _factor_dtype(t: Tensor) -> torch.dtype:
    """float32 for low-precision tensors, else the tensor's own dtype."""
    return torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else t.dtype


def _a_rows(
    x: Tensor, bias: bool, kernel: Sequence[int], stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int]
) -> Tensor:
    """Rows of A's sum: tokens flattened, or conv im2col (``kernel`` non-empty); bias column of ones last."""
    if kernel:
        cols = F.unfold(x, tuple(kernel), dilation=tuple(dilation), padding=tuple(padding), stride=tuple(stride))
        rows = cols.transpose(1, 2).reshape(-1, cols.shape[1])
    else:
        rows = x.reshape(-1, x.shape[-1])
    rows = rows.to(_factor_dtype(x))
    if bias:
        rows = torch.cat([rows, rows.new_ones(rows.shape[0], 1)], dim=1)
    return rows


def gram(rows: Tensor) -> Tensor:
    """``rows^T rows / rows.shape[0]`` of ``[rows, dim]``, exactly symmetric, with fewer multiply-adds than one GEMM.

    A syrk, which torch does not expose: the columns are cut into k panels (up to 8, each at least 128 wide),
    panel i's GEMM makes its block row up to the diagonal and the blocks above are copied from their transposes,
    ``(k + 1) / 2k`` of the GEMM's work (56% at k = 8). Under 256 columns: the one GEMM ``(rows^T rows) / rows``.
    In the rows' dtype even under autocast (a capture runs inside the stage's autocast, and compiled, its backward
    too): a factor is never formed narrower than its rows.
    """
    with torch.autocast(rows.device.type, enabled=False):
        return _gram(rows)


def _gram(rows: Tensor) -> Tensor:
    """`gram` outside autocast."""
    n = rows.shape[1]
    panels = min(_GRAM_PANELS, n // _GRAM_MIN_WIDTH)
    if panels < 2:
        return (rows.t() @ rows).div_(rows.shape[0])
    width = -(-n // panels)
    out = rows.new_empty(n, n)
    for start in range(0, n, width):
        stop = min(start + width, n)
        out[start:stop, :stop] = rows[:, start:stop].t() @ rows[:, :stop]
        out[:start, start:stop] = out[start:stop, :start].t()
        _mirror_lower(out[start:stop, start:stop])
    return out.div_(rows.shape[0])


def _mirror_lower(block: Tensor) -> None:
    """Copy a square block's strict lower triangle onto its upper one, in place (a GEMM's ``r^T r`` may differ
    from its transpose in the last bit)."""
    block.copy_(block.tril().add_(block.tril(-1).t()))


@torch.library.custom_op("fxkfac::tap_a", mutates_args=())
def tap_a(
    x: Tensor, bias: bool, kernel: list[int], stride: list[int], padding: list[int], dilation: list[int]
) -> Tensor:
    """Fused capture of a layer input ``x``: ``A_m`` (see [Note: factor scaling]).

    ``kernel`` empty means a Linear; otherwise the Conv2d geometry used for im2col.
    """
    return gram(_a_rows(x, bias, kernel, stride, padding, dilation))


@tap_a.register_fake
def _tap_a_fake(
    x: Tensor, bias: bool, kernel: list[int], stride: list[int], padding: list[int], dilation: list[int]
) -> Tensor:
    d = (x.shape[1] * kernel[0] * kernel[1] if kernel else x.shape[-1]) + int(bias)
    return x.new_empty((d, d), dtype=_factor_dtype(x))


def _tap_a_backward(ctx: Any, grad: Tensor) -> tuple[None, ...]:
    """The capture carries no gradient back to the activation."""
    return (None,) * 6


tap_a.register_autograd(_tap_a_backward)


@torch.library.custom_op("fxkfac::tap_e", mutates_args=())
def tap_e(y: Tensor, probe: Tensor, channels_first: bool) -> Tensor:
    """Identity on the layer output ``y`` (a copy: custom ops may not alias); the fused capture happens in backward.

    Backward passes ``grad_y`` through and returns, as the gradient of ``probe``, ``g^T g / rows``;
    ``channels_first`` marks a conv output ``[N, C, H, W]``.
    """
    return y.clone()


@tap_e.register_fake
def _tap_e_fake(y: Tensor, probe: Tensor, channels_first: bool) -> Tensor:
    return torch.empty_like(y)


def _tap_e_setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    ctx.channels_first = inputs[2]


def _tap_e_backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
    rows = (
        grad.permute(0, 2, 3, 1).reshape(-1, grad.shape[1]) if ctx.channels_first else grad.reshape(-1, grad.shape[-1])
    )
    return grad, gram(rows.to(_factor_dtype(grad))), None


tap_e.register_autograd(_tap_e_backward, setup_context=_tap_e_setup)


@dataclass(frozen=True)
class FactorTaps:
    """A graph with factor capture, and which of its extra inputs/outputs belong to which layer.

    Call ``gm(*user_inputs, *new_probes(taps, device))``: one zero probe per entry of ``probes`` (in that order)
    of ``probe_shapes[name]`` and ``probe_dtypes[name]``, with ``requires_grad=True``. Outputs: the ``n_outputs`` user
    outputs, then the A-side captures at ``a_outputs[name]``. After backward, ``probe.grad`` is the
    B-side capture. Values as in [Note: factor scaling].
    """

    gm: fx.GraphModule
    layers: tuple[KFACLayer, ...]
    modes: Mapping[str, Capture]
    n_outputs: int
    a_outputs: Mapping[str, int]
    probes: Mapping[str, int]
    """Layer name -> position of its probe among the probes (after the user inputs)."""
    probe_shapes: Mapping[str, tuple[int, ...]]
    probe_dtypes: Mapping[str, torch.dtype]
    """The dtype of each probe: the layer output's (deferred: it is added to it) or the fused factor's."""


def new_probes(taps: FactorTaps, device: torch.device, output_dtype: torch.dtype | None = None) -> list[Tensor]:
    """Zero probes for one call of ``taps.gm``, in its order, each requiring grad. A deferred probe is a zero
    expanded to the layer output's shape: its gradient is the capture, and no memory is written for it.
    `output_dtype`: the dtype the layers' outputs have when it differs from the traced one (under autocast), which a
    deferred probe takes so that adding it changes no dtype."""
    order = sorted(taps.probes, key=taps.probes.__getitem__)
    return [
        (
            torch.zeros((), device=device, dtype=output_dtype or taps.probe_dtypes[n]).expand(taps.probe_shapes[n])
            if taps.modes[n] is Capture.DEFERRED
            else torch.zeros(taps.probe_shapes[n], device=device, dtype=taps.probe_dtypes[n])
        ).requires_grad_()
        for n in order
    ]


def probe_shape(layer: KFACLayer, mode: Capture, output_shape: Sequence[int]) -> tuple[int, ...]:
    """Shape of ``layer``'s probe: ``[d_out, d_out]`` when fused, the layer output's shape when deferred."""
    return (layer.d_out, layer.d_out) if mode is Capture.FUSED else tuple(int(s) for s in output_shape)


def insert_factor_capture(gm: fx.GraphModule, layers: Sequence[KFACLayer], modes: Mapping[str, Capture]) -> FactorTaps:
    """A copy of ``gm`` with a ``tap_a`` on the input and a ``tap_e`` on the output of each layer in ``modes``.

    ``gm`` must have a plain (flat) codegen whose output node returns a tuple/list, as
    ``fxkfac.capture`` makes it; ``gm`` itself is not changed. Layers not in ``modes`` (each a Capture, or its
    text) are left alone.
    Reads ``node.meta[LAYER]`` (from `find_kfac_layers`) and ``node.meta["val"]``; writes
    ``node.meta[LAYER]``, ``node.meta[TAP] = ("a" | "e", mode)`` and ``nn_module_stack`` on the taps
    and probe placeholders.
    """
    bad = {name: mode for name, mode in modes.items() if mode not in set(Capture)}
    if bad:
        raise ValueError(f"capture modes must be one of {[c.value for c in Capture]}, got {bad}")
    modes = {name: Capture(mode) for name, mode in modes.items()}
    graph = fx.Graph()
    graph._codegen = copy.copy(gm.graph._codegen)
    outputs = graph.graph_copy(gm.graph, {})
    if not isinstance(outputs, (tuple, list)):
        raise AssertionError("insert_factor_capture needs a flat graph whose output is a tuple/list")
    n_outputs = len(outputs)
    out_node = graph.output(tuple(outputs))
    a_caps: list[fx.Node] = []
    by_name = {layer.name: layer for layer in layers}
    targets = [n for n in _layer_nodes(graph) if n.meta[LAYER].name in modes and n.meta[LAYER].name in by_name]
    missing = set(modes) - {n.meta[LAYER].name for n in targets}
    if missing:
        raise ValueError(f"no layer node in the graph for {sorted(missing)}; run find_kfac_layers first")
    last_input = [n for n in graph.nodes if n.op == "placeholder"][-1]
    a_outputs: dict[str, int] = {}
    probes: dict[str, int] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, torch.dtype] = {}
    for node in targets:
        layer: KFACLayer = node.meta[LAYER]
        mode = modes[layer.name]
        a_caps.append(_insert_tap_a(graph, node, layer, mode))
        a_outputs[layer.name] = n_outputs + len(a_caps) - 1
        with graph.inserting_after(last_input):
            probe = graph.placeholder(f"probe_{len(probes)}")
        probe.meta.update({LAYER: layer, TAP: ("e", mode)})
        last_input = probe
        probes[layer.name] = len(probes)
        shapes[layer.name] = probe_shape(layer, mode, node.meta["val"].shape)
        out_dtype = node.meta["val"].dtype
        dtypes[layer.name] = out_dtype if mode is Capture.DEFERRED else _factor_dtype(node.meta["val"])
        _insert_tap_e(graph, node, probe, layer, mode)
    out_node.args = (tuple(out_node.args[0]) + tuple(a_caps),)
    graph.lint()
    new_gm = fx.GraphModule(gm, graph)
    return FactorTaps(
        new_gm,
        tuple(by_name[n.meta[LAYER].name] for n in targets),
        dict(modes),
        n_outputs,
        a_outputs,
        probes,
        shapes,
        dtypes,
    )


def _layer_nodes(graph: fx.Graph) -> list[fx.Node]:
    """Layer nodes of a bare graph (see `layer_nodes`)."""
    return [n for n in graph.nodes if n.op == "call_function" and LAYER in n.meta]


def _conv_args(layer: KFACLayer) -> tuple[list[int], list[int], list[int], list[int]]:
    """(kernel, stride, padding, dilation) lists for tap_a; all empty for a Linear."""
    if layer.conv is None:
        return [], [], [], []
    c = layer.conv
    return list(c.kernel_size), list(c.stride), list(c.padding), list(c.dilation)


def _insert_tap_a(graph: fx.Graph, node: fx.Node, layer: KFACLayer, mode: Capture) -> fx.Node:
    """The node of the layer's A capture: fused, ``tap_a(a, ...)`` right before the layer node; deferred, the layer
    input node itself, returned as an extra output (no copy: the graph is functional, nothing changes it later)."""
    if mode is Capture.DEFERRED:
        return layer_input(node)
    with graph.inserting_before(node):
        tap = graph.call_function(
            torch.ops.fxkfac.tap_a.default, (layer_input(node), layer.bias is not None, *_conv_args(layer))
        )
    _annotate(tap, node, layer, ("a", mode))
    return tap


def _insert_tap_e(graph: fx.Graph, node: fx.Node, probe: fx.Node, layer: KFACLayer, mode: Capture) -> fx.Node:
    """Right after the layer node, taking over all of its uses: fused, ``tap_e(y, probe, ...)``; deferred,
    ``y + probe``, whose gradient with respect to the (zero) probe is the output gradient itself."""
    with graph.inserting_after(node):
        tap = (
            graph.call_function(torch.ops.aten.add.Tensor, (node, probe))
            if mode is Capture.DEFERRED
            else graph.call_function(torch.ops.fxkfac.tap_e.default, (node, probe, layer.kind is LayerKind.CONV2D))
        )
    node.replace_all_uses_with(tap, delete_user_cb=lambda user: user is not tap)
    _annotate(tap, node, layer, ("e", mode))
    if "val" in node.meta:
        tap.meta["val"] = node.meta["val"]
    return tap


def _annotate(tap: fx.Node, node: fx.Node, layer: KFACLayer, tag: tuple[str, str]) -> None:
    """Copy the layer node's module stack onto a tap and record its layer and role."""
    tap.meta[LAYER] = layer
    tap.meta[TAP] = tag
    if NN_MODULE_STACK in node.meta:
        tap.meta[NN_MODULE_STACK] = node.meta[NN_MODULE_STACK]
