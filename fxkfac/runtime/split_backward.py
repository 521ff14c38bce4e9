"""A stage's backward split at the graph level into B (input gradients) and W (weight gradients) for zero-bubble
schedules ([Note: B/W split] in docs/ZERO_BUBBLE.md).

The stage's forward and its backward are traced together into one aten graph (`make_fx` of a function calling
`torch.autograd.grad`, on fake tensors: nothing runs, no random number is drawn). That joint graph is cut into three:

- forward: what the stage's outputs need (and side effects such as running statistics), returning the outputs and
  the values the backward reads (saved);
- B: what the input gradients need, from the saved values and the output gradients; it also returns the values W
  reads that only B makes (the gradients flowing into each layer's weight: G);
- W: the rest of what the weight gradients need, from B's values and the saved ones (each layer's input: A).

Each graph runs eagerly or under torch.compile like any stage graph (`stage.compiled`): both halves of the backward
are compiled, which torch's own zero-bubble schedules refuse.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch
from torch import Tensor, fx
from torch.func import functional_call
from torch.fx.experimental.proxy_tensor import make_fx

__all__ = ["ArgGrad", "SplitStage", "split_stage", "accumulating"]


class ArgGrad(StrEnum):
    """Which half of the backward makes the gradient of one of the stage's args."""

    NONE = "none"
    """None: the arg takes no gradient (an integer input, the first stage's inputs)."""
    INPUT = "input"
    """B: the previous stage waits for it (an activation), or a deferred capture of a layer's output gradient."""
    WEIGHT = "weight"
    """W: nothing waits for it before the weight gradients (a fused capture's curvature of the output gradient)."""


@dataclass(frozen=True)
class SplitStage:
    """The three graphs of one stage graph at one shape, and how their values pass between them."""

    forward: Callable[..., Any]
    """(*state, *args) -> (*outputs, *saved)."""
    input_grad: Callable[..., Any]
    """(*saved[b_saved], *tangents) -> (*grads of the INPUT args, *kept for W)."""
    weight_grad: Callable[..., Any]
    """(*saved[w_saved], *kept) -> (*grads of the parameters, *grads of the WEIGHT args)."""
    n_outputs: int
    """How many outputs the forward returns before its saved values."""
    tangents: tuple[tuple[torch.Size, torch.dtype], ...]
    """Shape and dtype of the output gradient of each of the first `len(tangents)` outputs (zeros where none comes)."""
    b_saved: tuple[int, ...]
    """Indices into the saved values of what B reads."""
    w_saved: tuple[int, ...]
    """Indices into the saved values of what W reads."""
    n_arg_grads: int
    """How many arg gradients B returns (one per INPUT arg, None where the arg does not matter)."""
    n_param_grads: int
    """How many parameter gradients W returns before the WEIGHT args' gradients."""
    weight_grad_into: Callable[..., Any] | None = None
    """(*saved[w_saved], *kept, *the parameters' .grad) -> (*grads of the WEIGHT args): W adding the parameters'
    gradients into their `.grad` in place (`accumulating`; eager stages only, None otherwise)."""


def split_stage(
    gm: fx.GraphModule,
    state: dict[str, Tensor],
    params: Sequence[str],
    args: Sequence[Tensor],
    arg_grads: Sequence[ArgGrad],
    n_diff_outputs: int,
    compile_fn: Callable[[fx.GraphModule], Callable[..., Any]],
) -> SplitStage:
    """`gm`'s forward, B and W for `args` at their shapes, each passed through `compile_fn`.

    `state`: the tensors `gm` reads by name (parameters and buffers), `params` the names whose gradients W makes;
    `arg_grads`: which half makes each arg's gradient; the first `n_diff_outputs` outputs take output gradients.
    """
    names = list(state)
    grad_names = [n for n in names if n in set(params)]
    example_state = [state[n].detach() for n in names]
    example_args = [a.detach() for a in args]

    def run(state_values: list[Tensor], arg_values: list[Tensor]) -> tuple[Tensor, ...]:
        outs = functional_call(gm, dict(zip(names, state_values, strict=True)), tuple(arg_values))
        return (outs,) if isinstance(outs, Tensor) else tuple(outs)

    metas = make_fx(run, tracing_mode="fake")(example_state, example_args)
    out_node = next(n for n in metas.graph.nodes if n.op == "output")
    vals = [n.meta["val"] for n in out_node.args[0][:n_diff_outputs]]
    tangent_specs = tuple((v.shape, v.dtype) for v in vals)
    example_tangents = [torch.zeros(s, dtype=d, device=a.device) for (s, d), a in zip(tangent_specs, _devices(vals))]

    def joint(
        state_values: list[Tensor], arg_values: list[Tensor], tangents: list[Tensor]
    ) -> tuple[tuple[Tensor, ...], tuple[Tensor | None, ...]]:
        leaves = {n: (v.detach().requires_grad_(True) if n in grad_names else v) for n, v in zip(names, state_values)}
        arg_leaves = [
            a if g is ArgGrad.NONE else a.detach().requires_grad_(True) for a, g in zip(arg_values, arg_grads)
        ]
        outs = functional_call(gm, leaves, tuple(arg_leaves))
        outs = (outs,) if isinstance(outs, Tensor) else tuple(outs)
        pairs = [(o, t) for o, t in zip(outs[:n_diff_outputs], tangents) if o.requires_grad]
        wrt = [a for side in (ArgGrad.INPUT, ArgGrad.WEIGHT) for a, g in zip(arg_leaves, arg_grads) if g is side]
        wrt += [leaves[n] for n in grad_names]
        grads: tuple[Tensor | None, ...] = (None,) * len(wrt)
        if pairs:
            grads = torch.autograd.grad([o for o, _ in pairs], wrt, [t for _, t in pairs], allow_unused=True)
        return outs, grads

    traced = make_fx(joint, tracing_mode="fake")(example_state, example_args, example_tangents)
    _drop_no_ops(traced)
    counts = (arg_grads.count(ArgGrad.INPUT), arg_grads.count(ArgGrad.WEIGHT), len(grad_names))
    return _cut(traced, len(names), len(args), counts, tangent_specs, compile_fn)


def accumulating(weight_grad: fx.GraphModule, n_params: int) -> fx.GraphModule:
    """An eager W graph that adds the parameters' gradients into buffers it takes after its operands (their `.grad`),
    in place, instead of returning them: a product into its buffer by one `addmm_` (no product allocated and added
    after), anything else by `add_`. It returns the WEIGHT args' gradients alone. The sums are autograd's up to
    float32 rounding (BLAS adds the product to the buffer inside its kernel)."""
    aten = torch.ops.aten
    gm = fx.GraphModule(weight_grad, _copy_graph(weight_grad.graph))
    graph = gm.graph
    output = next(n for n in graph.nodes if n.op == "output")
    results = list(output.args[0])
    with graph.inserting_before(next(n for n in graph.nodes if n.op != "placeholder")):
        buffers = [graph.placeholder(f"grad{i}") for i in range(n_params)]
    with graph.inserting_before(output):
        for buffer, result in zip(buffers, results[:n_params], strict=True):
            if result is None:
                continue
            if result.target is aten.mm.default and len(result.users) == 1 and results.count(result) == 1:
                result.target, result.args = aten.addmm_.default, (buffer, *result.args)
            else:
                graph.call_function(aten.add_.Tensor, (buffer, result))
    output.args = (tuple(results[n_params:]),)
    gm.recompile()
    return gm


def _copy_graph(graph: fx.Graph) -> fx.Graph:
    """A copy of `graph` (its nodes new, the same targets)."""
    new = fx.Graph()
    out = new.graph_copy(graph, {})
    new.output(out)
    return new


def _devices(vals: Sequence[Tensor]) -> list[Tensor]:
    """Something with each value's device (fake tensors report the real one)."""
    return [torch.empty(0, device=v.device) for v in vals]


def _cut(
    traced: fx.GraphModule,
    n_state: int,
    n_args: int,
    counts: tuple[int, int, int],
    tangents: tuple[tuple[torch.Size, torch.dtype], ...],
    compile_fn: Callable[[fx.GraphModule], Callable[..., Any]],
) -> SplitStage:
    """The joint graph cut into forward, B and W ([Note: B/W split]); `counts`: the INPUT args', the WEIGHT args' and
    the parameters' gradients the joint graph returns after the outputs, in that order."""
    nodes = list(traced.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    tangent_nodes = placeholders[n_state + n_args :]
    output = nodes[-1]
    flat = list(output.args[0])  # make_fx flattens (outputs, grads)
    n_in, n_weight, n_param = counts
    split = len(flat) - n_in - n_weight - n_param
    outs, arg_grads = flat[:split], flat[split : split + n_in]
    param_grads = flat[split + n_in + n_weight :] + flat[split + n_in : split + n_in + n_weight]
    calls = [n for n in nodes if n.op == "call_function"]
    reads = _reads(nodes)

    after_tangents = _descendants(tangent_nodes, reads)
    fwd = _ancestors([o for o in outs if isinstance(o, fx.Node)], reads) | {n for n in calls if _impure(n)}
    fwd = {n for n in fwd if n.op == "call_function" and n not in after_tangents}
    fwd |= {n for n in calls if n.target is operator.getitem and n.args[0] in fwd}  # save parts, not tuples
    backward = [n for n in calls if n not in fwd]
    b_set = _ancestors([g for g in arg_grads if g is not None], reads) & set(backward)
    b_set |= {n for n in backward if n.target is operator.getitem and n.args[0] in b_set}
    w_set = (_ancestors([g for g in param_grads if g is not None], reads) & set(backward)) - b_set

    b_nodes = [n for n in backward if n in b_set]
    w_nodes = [n for n in backward if n in w_set]
    b_ext = _external(b_nodes, arg_grads)
    w_ext = _external(w_nodes, param_grads)
    from_b = [n for n in w_ext if n in b_set or n in tangent_nodes]
    b_saved_nodes = [n for n in b_ext if n not in tangent_nodes]
    w_saved_nodes = [n for n in w_ext if n not in from_b]
    saved = list(dict.fromkeys(b_saved_nodes + w_saved_nodes))
    index = {n: i for i, n in enumerate(saved)}

    forward = _graph(traced, [n for n in calls if n in fwd], placeholders[: n_state + n_args], list(outs) + saved)
    b_graph = _graph(traced, b_nodes, b_saved_nodes + tangent_nodes, arg_grads + from_b)
    w_graph = _graph(traced, w_nodes, w_saved_nodes + from_b, param_grads)
    return SplitStage(
        forward=compile_fn(forward),
        input_grad=compile_fn(b_graph),
        weight_grad=compile_fn(w_graph),
        n_outputs=len(outs),
        tangents=tangents,
        b_saved=tuple(index[n] for n in b_saved_nodes),
        w_saved=tuple(index[n] for n in w_saved_nodes),
        n_arg_grads=n_in,
        n_param_grads=n_param,
    )


def _drop_no_ops(traced: fx.GraphModule) -> None:
    """Remove what the trace adds that does nothing where the graphs run (under no_grad): detaches, and a transpose
    of a transpose (a weight gradient is traced as t(t(mm))); each is a Python call per op in an eager graph."""
    aten = torch.ops.aten
    for node in list(traced.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten.detach.default:
            node.replace_all_uses_with(node.args[0])
        elif node.target is aten.t.default and getattr(node.args[0], "target", None) is aten.t.default:
            node.replace_all_uses_with(node.args[0].args[0])
    traced.graph.eliminate_dead_code()
    traced.recompile()


def _impure(node: fx.Node) -> bool:
    """An op that writes into a tensor (a buffer's running statistics): it stays in the forward."""
    schema = getattr(node.target, "_schema", None)
    return schema is not None and schema.is_mutable


def _reads(nodes: Sequence[fx.Node]) -> dict[fx.Node, list[fx.Node]]:
    """What each node of a graph (`nodes`, in order) reads: its inputs, and the in-place writes before it into the
    tensors those inputs are or view. A tensor filled by writes into its views (`gram`'s panels: slices of a
    `new_empty` written by `copy_`) is read after them, though no write is an input of its readers."""
    writes: dict[fx.Node, list[fx.Node]] = {}
    out: dict[fx.Node, list[fx.Node]] = {}
    for node in nodes:
        inputs = node.all_input_nodes
        out[node] = inputs + [w for base in dict.fromkeys(map(_base, inputs)) for w in writes.get(base, ())]
        for written in _schema_args(node, write=True):
            writes.setdefault(_base(written), []).append(node)
    return out


def _schema_args(node: fx.Node, *, write: bool) -> list[fx.Node]:
    """The tensor args of an aten op that it writes into (`write`), or that its result aliases (a view's base, an
    in-place op's self)."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None:
        return []
    aliased = {a for r in schema.returns if r.alias_info is not None for a in r.alias_info.before_set}
    out = []
    for i, arg in enumerate(schema.arguments):
        info = arg.alias_info
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        if info is not None and isinstance(value, fx.Node) and (info.is_write if write else info.before_set & aliased):
            out.append(value)
    return out


def _base(node: fx.Node) -> fx.Node:
    """The tensor whose memory `node` is: through views, in-place ops and items of their results, the first node
    that aliases nothing it reads."""
    while True:
        if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node):
            node = node.args[0]
            continue
        aliased = _schema_args(node, write=False)
        if not aliased:
            return node
        node = aliased[0]


def _ancestors(roots: Sequence[fx.Node], reads: dict[fx.Node, list[fx.Node]]) -> set[fx.Node]:
    """`roots` and every node they read (`reads`), transitively."""
    return _closure(roots, lambda node: reads[node])


def _descendants(roots: Sequence[fx.Node], reads: dict[fx.Node, list[fx.Node]]) -> set[fx.Node]:
    """`roots` and every node that reads them (`reads`), transitively."""
    readers: dict[fx.Node, list[fx.Node]] = {}
    for node, inputs in reads.items():
        for read in inputs:
            readers.setdefault(read, []).append(node)
    return _closure(roots, lambda node: readers.get(node, ()))


def _closure(roots: Sequence[fx.Node], step: Callable[[fx.Node], Iterable[fx.Node]]) -> set[fx.Node]:
    """`roots` and every node `step` reaches from them, transitively."""
    seen: set[fx.Node] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(step(node))
    return seen


def _external(nodes: Sequence[fx.Node], results: Sequence[fx.Node | None]) -> list[fx.Node]:
    """The values a graph of `nodes` returning `results` reads from outside (constants excepted), in first-use
    order."""
    inside = set(nodes)
    out: dict[fx.Node, None] = {}
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg not in inside and arg.op != "get_attr":
                out[arg] = None
    for result in results:
        if result is not None and result not in inside and result.op != "get_attr":
            out[result] = None
    return list(out)


def _graph(
    traced: fx.GraphModule, nodes: Sequence[fx.Node], inputs: Sequence[fx.Node], results: Sequence[fx.Node | None]
) -> fx.GraphModule:
    """A graph of `nodes` (in order) taking `inputs` and returning `results` (None stays None); the constants it
    reads are copied from `traced`."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, node in enumerate(inputs):
        env[node] = graph.placeholder(f"in{i}")

    def lookup(node: fx.Node) -> fx.Node:
        if node not in env:  # a constant lifted by the trace
            assert node.op == "get_attr", f"{node} is read before it is made"
            env[node] = graph.node_copy(node)
        return env[node]

    for node in nodes:
        env[node] = graph.node_copy(node, lookup)
    graph.output(tuple(lookup(r) if r is not None else None for r in results))
    return fx.GraphModule(traced, graph)
