"""A stage's backward split at the graph level into B (input gradients) and W (weight gradients) for zero-bubble
schedules ([Note: B/W split] in docs/ZERO_BUBBLE.md).

The stage's forward and its backward are traced together into one aten graph (`make_fx` of a function calling
`torch.autograd.grad`, on fake tensors: nothing runs, no random number is drawn). That joint graph is cut into three:

- forward: what the stage's outputs need (and side effects such as running statistics), returning the outputs and
  the values the backward reads (saved);
- B: what the input gradients need, from the saved values and the output gradients; it also returns the values W
  reads that only B makes (the gradients flowing into each layer's weight: G);
- W: the rest of what the weight gradients need, from B's values and the saved ones (each layer's input: A), cut
  into pieces ([Note: W pieces]): one per layer the caller names (its parameters' gradients and the curvature
  captures made from the same operands), each run on its own and releasing what only it reads, after a shared piece
  (what several layers or no named layer need).

Each graph runs eagerly or under torch.compile like any stage graph (`stage.compiled`): both halves of the backward
are compiled, which torch's own zero-bubble schedules refuse.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch
from torch import Tensor, fx
from torch.func import functional_call
from torch.fx.experimental.proxy_tensor import make_fx

__all__ = ["ArgGrad", "PendingW", "SplitStage", "WPiece", "split_stage", "accumulating"]


class ArgGrad(StrEnum):
    """Which half of the backward makes the gradient of one of the stage's args."""

    NONE = "none"
    """None: the arg takes no gradient (an integer input, the first stage's inputs)."""
    INPUT = "input"
    """B: the previous stage waits for it (an activation), or a deferred capture of a layer's output gradient that the
    program reads before W ([Note: late captures] in fxkfac/runtime/tapped_runner.py)."""
    WEIGHT = "weight"
    """W: nothing waits for it before the weight gradients (a fused capture's curvature of the output gradient, a
    deferred capture read after W)."""


@dataclass(frozen=True)
class WPiece:
    """One piece of a stage's W ([Note: W pieces]): the gradients of one layer's parameters and of the WEIGHT args
    made from the same operands, or (`layer` None) the shared piece, which runs before the others."""

    layer: str | None
    """The layer the piece belongs to (None: the shared piece)."""
    fn: Callable[..., Any]
    """(*pool[reads]) -> (*grads of `params`, *grads of `weight_args`, *kept)."""
    reads: tuple[int, ...]
    """Indices into W's operand pool (`PendingW.pool`) of what the piece reads."""
    params: tuple[int, ...]
    """Indices into the stage's parameters (`split_stage`'s `params`) of the gradients it returns first."""
    weight_args: tuple[int, ...]
    """Indices into the WEIGHT args of the gradients it returns next."""
    kept: tuple[int, ...] = ()
    """The pool indices the values it returns last go to (the shared piece's values that later pieces read)."""
    into: Callable[..., Any] | None = None
    """(*pool[reads], *the `params`' .grad) -> (*grads of `weight_args`, *kept): the piece adding its parameters'
    gradients into their `.grad` in place (`accumulating`; eager stages only, None otherwise)."""


@dataclass(frozen=True)
class SplitStage:
    """The three graphs of one stage graph at one shape, and how their values pass between them."""

    forward: Callable[..., Any]
    """(*state, *args) -> (*outputs, *saved)."""
    input_grad: Callable[..., Any]
    """(*saved[b_saved], *tangents) -> (*grads of the INPUT args, *kept for W)."""
    pieces: tuple[WPiece, ...]
    """W in pieces, the shared one (if any) first; together they make the gradients of the parameters and of the
    WEIGHT args from W's operands (*saved[w_saved], *kept from B), the first `n_operands` entries of the pool."""
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
    """How many parameters W makes gradients of."""
    n_weight_grads: int
    """How many WEIGHT args W makes gradients of."""
    n_operands: int
    """How many operands W starts from (the saved values it reads, then B's kept values)."""
    n_pool: int
    """The pool's size: the operands, then the values the shared piece keeps for the others."""

    def weights(self, operands: Sequence[Tensor]) -> tuple[list[Tensor | None], list[Tensor | None]]:
        """Every piece run in order on `operands`: the parameters' gradients and the WEIGHT args' (the whole W)."""
        pending = PendingW(self, list(operands))
        params: list[Tensor | None] = [None] * self.n_param_grads
        args: list[Tensor | None] = [None] * self.n_weight_grads
        for piece in pending.take(None):
            out = piece.fn(*pending.operands(piece))
            n, m = len(piece.params), len(piece.weight_args)
            for i, g in zip(piece.params, out[:n], strict=True):
                params[i] = g
            for i, g in zip(piece.weight_args, out[n : n + m], strict=True):
                args[i] = g
            pending.ran(piece, out[n + m :])
        return params, args


class PendingW:
    """One micro-batch's W between its B and its last piece: the pool of values the pieces left read (each dropped
    once no piece left reads it, so a layer's operands live until its piece has run) and the pieces left."""

    def __init__(self, split: SplitStage, operands: list[Tensor]) -> None:
        assert len(operands) == split.n_operands, f"W takes {split.n_operands} operands, got {len(operands)}"
        self.split = split
        self.pool: list[Tensor | None] = [*operands, *[None] * (split.n_pool - split.n_operands)]
        self.left: list[WPiece] = list(split.pieces)

    def take(self, layer: str | None) -> list[WPiece]:
        """The pieces to run now, in order, for `layer` (None: all left): the shared piece first while it has not
        run. Each is left until `ran`."""
        return [p for p in self.left if layer is None or p.layer in (None, layer)]

    def operands(self, piece: WPiece) -> list[Tensor]:
        """What `piece` reads."""
        values = [v for i in piece.reads if (v := self.pool[i]) is not None]
        assert len(values) == len(piece.reads), f"W piece {piece.layer} reads a value already released"
        return values

    def ran(self, piece: WPiece, kept: Sequence[Tensor]) -> None:
        """`piece` has run and returned `kept`: keep those, release what no piece left reads."""
        self.left = [p for p in self.left if p is not piece]
        for i, value in zip(piece.kept, kept, strict=True):
            self.pool[i] = value
        needed = {i for p in self.left for i in p.reads}
        for i in range(len(self.pool)):
            if i not in needed:
                self.pool[i] = None

    @property
    def done(self) -> bool:
        """Whether every piece has run."""
        return not self.left


def split_stage(
    gm: fx.GraphModule,
    state: dict[str, Tensor],
    params: Sequence[str],
    args: Sequence[Tensor],
    arg_grads: Sequence[ArgGrad],
    n_diff_outputs: int,
    compile_fn: Callable[[fx.GraphModule], Callable[..., Any]],
    layers: Mapping[str, Sequence[str]] | None = None,
) -> SplitStage:
    """`gm`'s forward, B and W for `args` at their shapes, each passed through `compile_fn`.

    `state`: the tensors `gm` reads by name (parameters and buffers), `params` the names whose gradients W makes;
    `arg_grads`: which half makes each arg's gradient; the first `n_diff_outputs` outputs take output gradients;
    `layers`: layer -> its parameters' names, one W piece each ([Note: W pieces]; none: W is one piece).
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
    owner = {p: layer for layer, ps in (layers or {}).items() for p in ps}
    param_layers = [owner.get(n) for n in grad_names]
    return _cut(traced, len(names), len(args), counts, tangent_specs, compile_fn, (list(layers or {}), param_layers))


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
    layering: tuple[list[str], list[str | None]],
) -> SplitStage:
    """The joint graph cut into forward, B and W ([Note: B/W split]); `counts`: the INPUT args', the WEIGHT args' and
    the parameters' gradients the joint graph returns after the outputs, in that order; `layering`: the layers W is
    cut by, in order, and each parameter's layer (None: none)."""
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
    order, param_layers = layering
    result_layers = param_layers + _weight_arg_layers(param_grads, param_layers, w_set, reads)
    pieces, pool = _w_pieces(
        traced, w_nodes, w_saved_nodes + from_b, param_grads, (order, result_layers), reads, n_param, compile_fn
    )
    return SplitStage(
        forward=compile_fn(forward),
        input_grad=compile_fn(b_graph),
        pieces=tuple(pieces),
        n_outputs=len(outs),
        tangents=tangents,
        b_saved=tuple(index[n] for n in b_saved_nodes),
        w_saved=tuple(index[n] for n in w_saved_nodes),
        n_arg_grads=n_in,
        n_param_grads=n_param,
        n_weight_grads=n_weight,
        n_operands=len(w_saved_nodes) + len(from_b),
        n_pool=pool,
    )


# Note [W pieces]
# ~~~~~~~~~~~~~~~
# W is cut by layer so that a zero-bubble schedule can run each layer's weight gradient on its own (a per-layer
# BWD_W, "W s0 m1 fc"), and each layer's operands (its input A, the output gradient G B kept for it) are released
# as soon as its piece has run rather than when the stage's whole W ends. Each of W's results has a layer: a
# parameter's gradient the layer that owns the parameter, a WEIGHT arg's gradient (a fused capture's curvature of
# an output gradient) the layer whose gradients read the most of the same values (the G both are made from), or
# none. A node of W goes to the piece of the one layer whose results need it; a node that several layers' results
# need, or results of no layer, goes to the shared piece, which runs first (whichever layer's piece is asked for
# first) and keeps for the later pieces the values they read of it (on the first stage, whose B makes nothing, the
# shared piece is the backward through the stage: every layer's G). Items of a multi-output op stay with it.


def _weight_arg_layers(
    results: Sequence[fx.Node | None],
    param_layers: Sequence[str | None],
    w_set: set[fx.Node],
    reads: dict[fx.Node, list[fx.Node]],
) -> list[str | None]:
    """The layer of each WEIGHT arg's gradient (the results after the parameters' gradients): the one whose
    parameters' gradients share the most of W's nodes and operands with it (None: no layer shares any, or a tie)."""
    n_param = len(param_layers)
    reach = {layer: set[fx.Node]() for layer in param_layers if layer is not None}
    for result, layer in zip(results[:n_param], param_layers, strict=True):
        if result is not None and layer is not None:
            reach[layer] |= _w_ancestors(result, w_set, reads)
    out: list[str | None] = []
    for result in results[n_param:]:
        mine = _w_ancestors(result, w_set, reads) if result is not None else set()
        shares = sorted(((len(mine & r), layer) for layer, r in reach.items()), reverse=True)
        best = shares[0] if shares and shares[0][0] > 0 else None
        tied = best is not None and len(shares) > 1 and shares[1][0] == best[0]
        out.append(best[1] if best is not None and not tied else None)
    return out


def _w_ancestors(root: fx.Node, w_set: set[fx.Node], reads: dict[fx.Node, list[fx.Node]]) -> set[fx.Node]:
    """`root`, the nodes of W it reads, transitively, and the values from outside W they read."""
    return _closure([root], lambda node: reads[node] if node in w_set else ())


def _w_pieces(
    traced: fx.GraphModule,
    w_nodes: Sequence[fx.Node],
    operands: Sequence[fx.Node],
    results: Sequence[fx.Node | None],
    layering: tuple[list[str], list[str | None]],
    reads: dict[fx.Node, list[fx.Node]],
    n_param: int,
    compile_fn: Callable[[fx.GraphModule], Callable[..., Any]],
) -> tuple[list[WPiece], int]:
    """W cut into pieces ([Note: W pieces]) over `operands` (the pool's first entries), each passed through
    `compile_fn`, and the pool's size. `results`: the `n_param` parameters' gradients then the WEIGHT args';
    `layering`: the layers in order and each result's."""
    order, result_layers = layering
    w_set = set(w_nodes)
    owners: dict[fx.Node, set[str | None]] = {}
    for result, layer in zip(results, result_layers, strict=True):
        if result is not None:
            for node in _w_ancestors(result, w_set, reads) & w_set:
                owners.setdefault(node, set()).add(layer)
    home = {n: next(iter(o)) if len(o) == 1 else None for n, o in owners.items()}
    for node in w_nodes:  # items of a multi-output op stay with it
        parent = node.args[0] if node.target is operator.getitem else None
        if isinstance(parent, fx.Node) and parent in w_set and home[parent] is None:
            home[node] = None
    names: list[str | None] = [None, *order]
    members = {layer: [n for n in w_nodes if home[n] == layer] for layer in names}
    mine = {layer: [i for i, r in enumerate(result_layers) if r == layer] for layer in names}
    inputs = {layer: _external(members[layer], [results[i] for i in mine[layer]]) for layer in order}
    shared = set(members[None])
    kept = list(dict.fromkeys(n for layer in order for n in inputs[layer] if n in shared))
    pool = {n: i for i, n in enumerate([*operands, *kept])}
    pieces = []
    for layer in names:
        own = [results[i] for i in mine[layer]]
        if not members[layer] and all(r is None for r in own) and (layer is not None or not kept):
            continue
        outs = own + (kept if layer is None else [])
        ext = _external(members[layer], outs) if layer is None else inputs[layer]
        params = tuple(i for i in mine[layer] if i < n_param)
        pieces.append(
            WPiece(
                layer,
                compile_fn(_graph(traced, members[layer], ext, outs)),
                tuple(pool[n] for n in ext),
                params,
                tuple(i - n_param for i in mine[layer] if i >= n_param),
                tuple(pool[n] for n in kept) if layer is None else (),
            )
        )
    return pieces, len(pool)


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
