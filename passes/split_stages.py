"""Cut a captured GraphModule into pipeline stage GraphModules at layer (block) boundaries.

The pass walks the graph in topological order, groups nodes into *blocks* (a Transformer
block, a top-level child, a Sequential element: see `block_key`), and cuts the block sequence
into S contiguous stages. Cutting in topological order guarantees that a stage only reads
values of earlier stages. Every value a later stage needs (activations, but also original
inputs or masks computed early) is passed down the chain stage by stage, so a stage only
ever talks to its two neighbours.

Reads node.meta: NN_MODULE_STACK (written by torch.export), "val" (fake tensors), LAYER.
Writes node.meta[STAGE] on the input graph's nodes.

Parameters. Stage graphs reference parameters by their *canonical* FQN (the first name
`gm.named_parameters()` gives an object). A parameter used by several stages (tied
embedding / LM head) appears in each of them; `SplitResult.shared_params` lists those, and
the runtime sums their gradients over all copies before the optimizer steps (the same sum
it does for data-parallel and Chimera copies), so the copies stay identical.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import torch
from torch import fx

from fxkfac.passes.layers import KFACLayer
from fxkfac.passes.meta import LAYER, NN_MODULE_STACK, STAGE
from fxkfac.planner.problem import ConfigError

__all__ = ["SplitCost", "TensorSpec", "StageGraph", "SplitResult", "block_key", "split_stages"]


class SplitCost(StrEnum):
    """The static estimate stages are balanced by when no measured block costs are given."""

    FLOPS = "flops"
    """FLOPs of matmul-like and conv ops (output numel x inner size), numel of the others."""
    PARAMS = "params"
    """The parameters each node reads."""


_MATMUL_TARGETS = {"mm", "addmm", "bmm", "baddbmm", "linear", "matmul"}


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Shape and dtype of one tensor crossing a stage boundary (what a receiver allocates)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def is_float(self) -> bool:
        """Whether gradients flow through this tensor (floating point)."""
        return self.dtype.is_floating_point or self.dtype.is_complex


@dataclass(slots=True)
class StageGraph:
    """One stage: a GraphModule `gm(*inputs) -> tuple(outputs)` plus what it holds."""

    index: int
    gm: fx.GraphModule
    inputs: tuple[TensorSpec, ...]
    """The previous stage's outputs, in order (stage 0: the model's flat inputs)."""
    outputs: tuple[TensorSpec, ...]
    """Values the next stage needs (last stage: the model's flat outputs)."""
    params: tuple[str, ...]
    """Canonical FQNs of the parameters this stage uses."""
    layers: tuple[str, ...] = ()
    """Names of the K-FAC layers whose weight this stage holds (when known)."""
    blocks: tuple[str, ...] = ()
    """The block keys (see `block_key`) this stage covers, in order."""


@dataclass(slots=True)
class SplitResult:
    """The stages of a split and the facts the runtime needs across them."""

    stages: list[StageGraph]
    shared_params: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Canonical FQN -> the stages that use it, for parameters used by more than one stage."""
    param_aliases: dict[str, str] = field(default_factory=dict)
    """Every parameter name of the captured module -> its canonical FQN (tied weights)."""

    def stage_of_param(self, name: str) -> tuple[int, ...]:
        """The stages holding parameter `name` (any alias accepted)."""
        canonical = self.param_aliases.get(name, name)
        return tuple(s.index for s in self.stages if canonical in s.params)


def block_key(node: fx.Node) -> str | None:
    """The block a node belongs to: the outermost numbered module (a ModuleList/Sequential
    element such as "bert.encoder.layer.3") on its module stack, else its module at depth 2
    ("bert.embeddings", "transformer.ln_f"), else depth 1; None without a module stack."""
    stack = node.meta.get(NN_MODULE_STACK)
    if not stack:
        return None
    fqns = [value[0] for value in stack.values() if value[0]]
    if not fqns:
        return None
    for fqn in fqns:
        if fqn.rsplit(".", 1)[-1].isdigit():
            return fqn
    return fqns[min(1, len(fqns) - 1)]


def _module_path(node: fx.Node) -> list[str]:
    stack = node.meta.get(NN_MODULE_STACK) or {}
    return [value[0] for value in stack.values() if value[0]]


def _is_skipped(node: fx.Node) -> bool:
    """Export's guard call (`_guards_fn`) is not model computation; stages drop it."""
    return node.op == "call_module" and not node.users and str(node.target).startswith("_guards")


def _compute_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module") and not _is_skipped(n)]


def _node_cost(node: fx.Node, mode: SplitCost, param_numel: Mapping[str, int]) -> float:
    """A static cost: FLOPs of matmul-like/conv ops (output numel x inner size), numel else,
    or the parameter count the node reads."""
    if mode is SplitCost.PARAMS:
        return float(sum(param_numel.get(str(a.target), 0) for a in node.all_input_nodes if a.op == "get_attr"))
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return 0.0
    numel = float(val.numel())
    name = getattr(getattr(node.target, "_overloadpacket", None), "__name__", str(node.target))
    inputs = [a.meta.get("val") for a in node.all_input_nodes]
    tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
    if name in _MATMUL_TARGETS and tensors:
        inner = tensors[1].shape[-1] if name == "addmm" and len(tensors) >= 2 else tensors[0].shape[-1]
        return 2.0 * numel * float(inner)
    if name in ("convolution", "conv2d") and len(tensors) >= 2:
        weight = tensors[1]
        return 2.0 * numel * float(weight.numel() // max(weight.shape[0], 1))
    return numel


def _segments(nodes: Sequence[fx.Node]) -> list[tuple[str, list[fx.Node]]]:
    """Contiguous runs of nodes with the same block key; keyless nodes join the current run."""
    segments: list[tuple[str, list[fx.Node]]] = []
    for node in nodes:
        key = block_key(node)
        if segments and (key is None or key == segments[-1][0]):
            segments[-1][1].append(node)
        else:
            segments.append((key or "<input>", [node]))
    return segments


def _balance(costs: Sequence[float], parts: int) -> list[int]:
    """Indices where each of `parts` contiguous groups starts, minimizing the largest group sum
    (linear-partition dynamic program; ties prefer earlier cuts)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    starts, i = [], n
    for k in range(parts, 0, -1):
        i = cut[k][i]
        starts.append(i)
    return starts[::-1]


def _stage_starts(
    segments: list[tuple[str, list[fx.Node]]], num_stages: int, split_points: Sequence[str] | None, costs: list[float]
) -> list[int]:
    if split_points is None:
        if len(segments) < num_stages:
            raise ConfigError(
                f"cannot cut {len(segments)} blocks ({[k for k, _ in segments]}) into {num_stages} stages; "
                "use fewer stages or a model with more blocks"
            )
        return _balance(costs, num_stages)
    starts = [0]
    for point in split_points:
        index = next((i for i, (_, nodes) in enumerate(segments) if any(point in _module_path(n) for n in nodes)), None)
        if index is None or index <= starts[-1]:
            raise ConfigError(
                f"split point {point!r} is not a block boundary after the previous one; "
                f"blocks in order: {[k for k, _ in segments]}"
            )
        starts.append(index)
    return starts


def _assign_stages(
    gm: fx.GraphModule, starts: list[int], segments: list[tuple[str, list[fx.Node]]]
) -> dict[fx.Node, int]:
    stage_of: dict[fx.Node, int] = {}
    for index, (_, nodes) in enumerate(segments):
        stage = max(s for s, start in enumerate(starts) if start <= index)
        for node in nodes:
            stage_of[node] = stage
    for node in gm.graph.nodes:  # a tuple's getitem stays with the tuple: only tensors cross
        if node.op == "call_function" and node.target is operator.getitem and node.args[0] in stage_of:
            stage_of[node] = stage_of[node.args[0]]
    return stage_of


def _spec(node: fx.Node) -> TensorSpec:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise AssertionError(
            f"stage boundary value {node.format_node()} is not a tensor ({type(val).__name__}); cut at another block"
        )
    return TensorSpec(node.name, tuple(int(d) for d in val.shape), val.dtype)


def _boundaries(gm: fx.GraphModule, stage_of: Mapping[fx.Node, int], num_stages: int) -> list[list[fx.Node]]:
    """boundaries[s]: values defined in stages <= s (or inputs) read by stages > s, in graph order."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    last_use: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        user_stage = num_stages - 1 if node.op == "output" else stage_of.get(node)
        if user_stage is None:
            continue
        for value in node.all_input_nodes:
            if value.op in ("placeholder",) or value in stage_of:
                last_use[value] = max(last_use.get(value, -1), user_stage)
    result = []
    for s in range(num_stages - 1):
        crossing = [v for v, use in last_use.items() if use > s and (v.op == "placeholder" or stage_of[v] <= s)]
        result.append(sorted(crossing, key=order.__getitem__))
    return result


def _canonical_params(gm: fx.GraphModule) -> dict[str, str]:
    """Every parameter/buffer name -> the first name of the same tensor object."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, tensor in [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]:
        aliases[name] = first.setdefault(id(tensor), name)
    return aliases


def _build_stage(
    gm: fx.GraphModule,
    s: int,
    nodes: list[fx.Node],
    inputs: list[fx.Node],
    outputs: list[fx.Node] | None,
    aliases: Mapping[str, str],
) -> tuple[fx.GraphModule, set[str]]:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    attrs: dict[str, fx.Node] = {}
    for value in inputs:
        env[value] = graph.placeholder(value.name)
        env[value].meta = dict(value.meta)

    def lookup(value: fx.Node) -> fx.Node:
        if value in env:
            return env[value]
        if value.op != "get_attr":
            raise AssertionError(f"stage {s} reads {value.format_node()} that is not one of its inputs")
        target = aliases.get(str(value.target), str(value.target))
        if target not in attrs:
            attrs[target] = graph.get_attr(target)
            attrs[target].meta = dict(value.meta)
        return attrs[target]

    for node in nodes:
        env[node] = graph.node_copy(node, lookup)
    if outputs is None:
        out_node = next(n for n in gm.graph.nodes if n.op == "output")
        flat = out_node.args[0]
        graph.output(tuple(fx.map_arg(flat, lookup)))
    else:
        graph.output(tuple(lookup(v) for v in outputs))
    stage_gm = fx.GraphModule(gm, graph, class_name=f"Stage{s}")
    return stage_gm, set(attrs)


def split_stages(
    gm: fx.GraphModule,
    num_stages: int,
    *,
    split_points: Sequence[str] | None = None,
    cost: SplitCost | Mapping[str, float] = SplitCost.FLOPS,
    layers: Sequence[KFACLayer] = (),
) -> SplitResult:
    """Cut `gm` (a torch.export GraphModule, flat inputs, flat tuple outputs) into stages.

    Args:
        num_stages: S, the number of (global, virtual) stages.
        split_points: module FQNs; stage k+1 starts at the first node of split_points[k].
            When given, `len(split_points) + 1` must equal `num_stages`.
        cost: a static estimate (`SplitCost`: FLOPs, the default, or parameters read), or a mapping block
            key -> measured forward+backward seconds (keys from `block_key`).
        layers: the K-FAC layers; each is listed on the stage that holds its weight.
    Returns:
        SplitResult; `stage.gm(*stage.inputs)` returns `stage.outputs`, and chaining the
        stages computes what `gm` computes (same outputs, same parameter gradients).
    """
    _check_stage_count(num_stages, split_points)
    aliases = _canonical_params(gm)
    param_numel = {name: t.numel() for name, t in gm.named_parameters(remove_duplicate=False)}
    nodes = _compute_nodes(gm)
    segments = _segments(nodes)
    costs = _segment_costs(segments, cost, param_numel)
    stage_of = _assign_stages(gm, _stage_starts(segments, num_stages, split_points, costs), segments)
    _tag_stages(gm, stage_of)
    bounds = _boundaries(gm, stage_of, num_stages)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    canonical = {name for name, _ in gm.named_parameters()}
    stages = []
    for s in range(num_stages):
        ins = placeholders if s == 0 else bounds[s - 1]
        outs = bounds[s] if s < num_stages - 1 else None
        own = [n for n in nodes if stage_of[n] == s]
        stage_gm, used = _build_stage(gm, s, own, ins, outs, aliases)
        params = tuple(sorted(p for p in used if p in canonical))
        returned = outs if outs is not None else _model_outputs(gm)
        stages.append(
            StageGraph(
                s,
                stage_gm,
                tuple(_spec(v) for v in ins),
                tuple(_spec(v) for v in returned),
                params,
                _stage_layers(own, params, layers, aliases),
                _stage_blocks(segments, stage_of, s),
            )
        )
    return SplitResult(stages, _shared_params(stages), {k: v for k, v in aliases.items() if k in param_numel})


def _check_stage_count(num_stages: int, split_points: Sequence[str] | None) -> None:
    """ConfigError unless the split points (when given) make `num_stages` stages and there is at least one."""
    if split_points is not None and len(split_points) + 1 != num_stages:
        raise ConfigError(
            f"{len(split_points)} split points make {len(split_points) + 1} stages, not num_stages={num_stages}"
        )
    if num_stages < 1:
        raise ConfigError(f"num_stages must be >= 1, got {num_stages}")


def _segment_costs(
    segments: Sequence[tuple[str, list[fx.Node]]],
    cost: SplitCost | Mapping[str, float],
    param_numel: Mapping[str, int],
) -> list[float]:
    """Each block's cost for balancing the stages: measured seconds by block key, or a static `_node_cost` sum."""
    if isinstance(cost, Mapping):
        return [float(cost.get(key, 0.0)) for key, _ in segments]
    if cost in set(SplitCost):
        return [sum(_node_cost(n, SplitCost(cost), param_numel) for n in seg) for _, seg in segments]
    raise ConfigError(
        f"cost must be one of {[c.value for c in SplitCost]} or a mapping of block -> seconds, got {cost!r}"
    )


def _tag_stages(gm: fx.GraphModule, stage_of: Mapping[fx.Node, int]) -> None:
    """Write each staged node's stage into its meta (STAGE), for the passes that run after the split."""
    for node in gm.graph.nodes:
        if node in stage_of:
            node.meta[STAGE] = stage_of[node]


def _model_outputs(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes among the model's flat outputs: what the last stage returns."""
    flat = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    return [a for a in fx.node.map_arg(flat, lambda x: x) if isinstance(a, fx.Node)]


def _stage_layers(
    own: Sequence[fx.Node], params: Sequence[str], layers: Sequence[KFACLayer], aliases: Mapping[str, str]
) -> tuple[str, ...]:
    """The K-FAC layers of a stage: those whose weight it holds, then those tapped in its nodes (each once)."""
    held = tuple(layer.name for layer in layers if aliases.get(layer.weight, layer.weight) in params)
    tapped = {n.meta[LAYER].name for n in own if LAYER in n.meta}
    return tuple(dict.fromkeys(held + tuple(sorted(tapped))))


def _stage_blocks(
    segments: Sequence[tuple[str, list[fx.Node]]], stage_of: Mapping[fx.Node, int], s: int
) -> tuple[str, ...]:
    """The block keys stage `s` covers, in order (each once)."""
    return tuple(dict.fromkeys(key for key, nodes in segments if stage_of[nodes[0]] == s))


def _shared_params(stages: Sequence[StageGraph]) -> dict[str, tuple[int, ...]]:
    """The parameters more than one stage uses (tied weights) -> those stages: the runtime sums their gradients."""
    users: dict[str, list[int]] = {}
    for stage in stages:
        for p in stage.params:
            users.setdefault(p, []).append(stage.index)
    return {p: tuple(ss) for p, ss in users.items() if len(ss) > 1}
