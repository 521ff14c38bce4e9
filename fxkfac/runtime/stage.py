"""One stage copy on one rank: forward and backward of micro-batches with autograd, state kept per micro-batch."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Hashable, Sequence
from copy import deepcopy
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import fx
from torch.utils.checkpoint import checkpoint

from fxkfac.errors import PipelineError
from fxkfac.passes.eval_mode import eval_graph
from fxkfac.passes.split_stages import StageGraph, TensorSpec
from fxkfac.runtime.precision import autocast, to_wire, wire_specs
from fxkfac.runtime.split_backward import ArgGrad, PendingW, SplitStage, WPiece, accumulating, split_stage

__all__ = ["StageRunner", "compiled"]


@dataclass
class StageRunner:
    """Stage `graph.index` of pipeline `pipe`: its own parameter copy, autograd per micro-batch.

    Forward keeps each micro-batch's inputs and outputs until its backward; backward
    calls `torch.autograd.backward` on the outputs with the received gradients (or on the
    loss, on the last stage) and returns the gradients of the inputs, which the runtime sends
    to the previous stage. With `recompute` (activation checkpointing) the forward keeps nothing else
    and the backward runs it again first (`torch.utils.checkpoint`, non-reentrant: the same random numbers).
    """

    graph: StageGraph
    """The stage at the shape it runs now (`use_shape`): what a receiver allocates, the parameters it uses."""
    pipe: int
    module: torch.nn.Module
    """The stage as first captured: the owner of this copy's parameters and buffers, whatever the shape."""
    fn: Callable[..., Any]
    is_last: bool
    backend: str | None = None
    """The torch.compile backend the stage's functions run under (None: eagerly)."""
    gm: fx.GraphModule = field(init=False)
    """The graph `fn` runs at the current shape; its parameters and buffers are `module`'s."""
    shape: Hashable = field(default=None, init=False)
    """The key of the shape the stage runs now (None: the shape it was built for)."""
    _shapes: dict[Hashable, tuple[StageGraph, fx.GraphModule, Callable[..., Any]]] = field(
        default_factory=dict, init=False
    )
    autocast_dtype: torch.dtype | None = None
    """The dtype the forward runs under autocast in (None: full precision; [Note: mixed precision] in
    fxkfac/runtime/precision.py)."""
    _inputs: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    _outputs: dict[int, Any] = field(default_factory=dict)
    recompute: bool = False
    """Whether the stage recomputes its forward in its backward (`Problem.recompute`) instead of keeping its
    activations."""
    _eval_fns: dict[Hashable, Callable[..., Any]] = field(default_factory=dict)
    """Evaluation's forward per shape key (`infer`), made on first use."""
    split: bool = False
    """Whether forward and backward run as the split graphs (`split_backward`), so that a backward's weight
    gradients can wait for `backward_weights`: set when the rank's program holds a BWD_W of this stage copy."""
    _splits: dict[Hashable, tuple[SplitStage, list[torch.Tensor], list[torch.Tensor]]] = field(default_factory=dict)
    """Per (shape, variant): the split graphs, the state tensors they read and the parameters W makes gradients of."""
    _saved: dict[
        int, tuple[SplitStage, list[tuple[torch.Tensor, ArgGrad]], tuple[torch.Tensor, ...], list[torch.Tensor]]
    ] = field(default_factory=dict)
    """Per micro-batch after a split forward: its graphs, its args with the half that makes their gradients, the
    values its backward reads, the parameters."""
    _last_outputs: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    """On the last stage, per split micro-batch: its outputs as the autograd leaves its loss was taken from."""
    _weights: dict[int, tuple[PendingW, list[torch.Tensor], list[torch.Tensor]]] = field(default_factory=dict)
    """Per micro-batch whose B ran and whose W has pieces left: those and their operands, the parameters and the args
    whose gradients W makes."""
    layer_params: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """The stage's layers (a preconditioner's units) and their parameters' names: what a per-layer BWD_W names."""
    w_layers: set[str] = field(default_factory=set)
    """The layers the rank's program runs W of one by one ("W s0 m1 fc"): W is cut into their pieces ([Note: W
    pieces] in fxkfac/runtime/split_backward.py); set when the step's BWD_W ops are prepared."""

    @classmethod
    def build(
        cls,
        graph: StageGraph,
        pipe: int,
        is_last: bool,
        backend: str | None,
        *,
        copy: bool,
        recompute: bool = False,
        autocast_dtype: torch.dtype | None = None,
    ) -> StageRunner:
        """A runner of the stage module, compiled when `backend` is set.

        With `copy` it runs on a deep copy: needed when the rank holds several stage copies, which may
        share a parameter (tied weights) that must have one tensor per copy. Without it the stage shares
        its parameters with the captured model, so training updates the user's model in place.
        """
        module: fx.GraphModule = deepcopy(graph.gm) if copy else graph.gm
        for param in module.parameters():
            param.requires_grad_(True)
        fn = compiled(module, backend)
        return cls(graph, pipe, module, fn, is_last, backend, recompute=recompute, autocast_dtype=autocast_dtype)

    def __post_init__(self) -> None:
        assert isinstance(self.module, fx.GraphModule), "a stage runner's module is the split's GraphModule"
        self.gm = self.module
        self._shapes[None] = (self.graph, self.gm, self.fn)

    def use_shape(self, key: Hashable, graph: StageGraph | None = None) -> None:
        """Run from now on the stage at the input shape `key` (None: the shape it was built for): `graph`, the stage
        captured at that shape, reading this copy's parameters and buffers and compiled once, kept until
        `forget_shape`."""
        if key not in self._shapes:
            if graph is None:
                raise AssertionError(f"stage {self.stage}: shape {key} used before its graph was given")
            gm = _sharing(graph.gm, self.module)
            self._shapes[key] = (graph, gm, compiled(gm, self.backend))
        self.graph, self.gm, self.fn = self._shapes[key]
        self.shape = key

    def forget_shape(self, key: Hashable) -> None:
        """Drop what was kept for shape `key` (never the shape it was built for, nor the current one)."""
        if key is not None and key != self.shape:
            self._shapes.pop(key, None)
            self._eval_fns.pop(key, None)

    @property
    def stage(self) -> int:
        """The global stage index."""
        return self.graph.index

    def forward(self, mb: int, inputs: Sequence[torch.Tensor], needs_grad: bool) -> tuple[torch.Tensor, ...]:
        """Run the stage on micro-batch `mb`; float inputs of inner stages become autograd leaves."""
        leaves = [x.requires_grad_(True) if needs_grad and x.is_floating_point() else x for x in inputs]
        with self.precision():
            outputs = self.crossing(self.run(mb, "plain", self.gm, self.fn, leaves, None))
        self._inputs[mb] = leaves
        self._outputs[mb] = outputs
        return outputs

    def infer(self, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The stage's outputs in eval mode (dropout off, batch norm by its running statistics), without autograd
        and keeping nothing: evaluation's forward. Its graph (`passes.eval_mode.eval_graph`, on this copy's
        parameters) is made, and compiled under `backend`, on the first call at each shape (`use_shape`): a run that
        never evaluates pays nothing for it."""
        if self.shape not in self._eval_fns:
            self._eval_fns[self.shape] = compiled(eval_graph(self.gm), self.backend)
        with torch.no_grad(), self.precision():
            return self.crossing(self._eval_fns[self.shape](*inputs))

    def call(self, fn: Callable[..., Any], args: Sequence[Any]) -> Any:
        """`fn(*args)`, checkpointed where the stage recomputes and autograd records: only `args` are saved, and
        the backward runs `fn` again before it needs what `fn` would have saved."""
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(fn, *args, use_reentrant=False)
        return fn(*args)

    def run(
        self,
        mb: int,
        variant: Hashable,
        gm: fx.GraphModule,
        fn: Callable[..., Any],
        args: Sequence[torch.Tensor],
        n_diff_outputs: int | None,
        to_weights: Sequence[bool] = (),
    ) -> Any:
        """The forward of micro-batch `mb`: `fn(*args)` under autograd, or, where the stage runs `split`, `gm`'s split
        forward (`variant` names `gm` among the stage's graphs at this shape; the first `n_diff_outputs` outputs
        take gradients, None: all). Args that require grad are the ones the backward makes gradients of: by B, or
        by W where `to_weights` marks them."""
        if not self.split:
            return self.call(fn, args)
        if self.recompute:
            raise PipelineError(
                f"stage {self.stage}: zero-bubble schedules (BWD_W) do not recompute activations yet; "
                "turn recompute off or use a schedule without BWD_W"
            )
        weights = [*to_weights, *[False] * (len(args) - len(to_weights))]
        sides = tuple(
            ArgGrad.NONE if not a.requires_grad else ArgGrad.WEIGHT if w else ArgGrad.INPUT
            for a, w in zip(args, weights, strict=True)
        )
        key = (self.shape, variant, sides, tuple(sorted(self.w_layers)))
        if key not in self._splits:
            self._splits[key] = self._split(gm, args, sides, n_diff_outputs)
        split, state, params = self._splits[key]
        with torch.no_grad():
            result = split.forward(*state, *args)
        outputs, saved = result[: split.n_outputs], result[split.n_outputs :]
        self._saved[mb] = (split, list(zip(args, sides)), saved, params)
        if self.is_last:  # the loss is taken outside the graph: its gradient reaches the outputs through autograd
            outputs = tuple(o.detach().requires_grad_(True) if o.is_floating_point() else o for o in outputs)
            self._last_outputs[mb] = outputs
        return outputs

    def _split(
        self, gm: fx.GraphModule, args: Sequence[torch.Tensor], sides: Sequence[ArgGrad], n_diff_outputs: int | None
    ) -> tuple[SplitStage, list[torch.Tensor], list[torch.Tensor]]:
        """`gm` split into forward, B and W (compiled under the stage's backend), its state tensors, its parameters."""
        params = dict(gm.named_parameters())
        state = {**params, **dict(gm.named_buffers())}
        n_out = n_diff_outputs if n_diff_outputs is not None else len(self.graph.outputs)
        unknown = sorted(self.w_layers - set(self.layer_params))
        if unknown:
            raise AssertionError(f"stage {self.stage}: the program runs W of layers {unknown} the stage does not hold")
        layers = {n: ps for n, ps in self.layer_params.items() if n in self.w_layers}
        with self.precision():
            split = split_stage(
                gm, state, list(params), args, sides, n_out, lambda g: compiled(g, self.backend), layers
            )
        if self.backend is None:
            split = replace(split, pieces=tuple(_accumulating(p) for p in split.pieces))
        return split, list(state.values()), list(params.values())

    @functools.cached_property
    def param_list(self) -> tuple[torch.nn.Parameter, ...]:
        """The copy's parameters, listed once (`module.parameters()` walks the module tree, ~50 us a step on a
        stage of 8 blocks): a run changes their values and gradients in place, never the tensors."""
        return tuple(self.module.parameters())

    @property
    def device(self) -> torch.device:
        """Where the stage's parameters live (CPU for a stage without any)."""
        return next((p.device for p in self.module.parameters()), torch.device("cpu"))

    def precision(self) -> Any:
        """The autocast context the stage's forward and its loss run in (full precision: a no-op, without looking up
        the device, which walks the module's parameters)."""
        return _FULL_PRECISION if self.autocast_dtype is None else autocast(self.autocast_dtype, self.device)

    def crossing(self, outputs: Any) -> tuple[torch.Tensor, ...]:
        """The stage's outputs as they leave it: at the autocast width, except the last stage's (the loss's)."""
        return tuple(outputs) if self.is_last else to_wire(tuple(outputs), self.autocast_dtype)

    def wire(self, specs: Sequence[TensorSpec]) -> list[TensorSpec]:
        """The specs of tensors that cross into or out of this stage as they travel."""
        return wire_specs(specs, self.autocast_dtype)

    def keep_loss(self, mb: int, loss: torch.Tensor) -> None:
        """On the last stage, backward starts from this (already scaled) loss instead of the outputs."""
        self._outputs[mb] = loss

    def backward(
        self, mb: int, output_grads: Sequence[torch.Tensor] | None, defer_weights: bool = False
    ) -> list[torch.Tensor]:
        """Backpropagate micro-batch `mb`; returns the gradient of every float input that takes one (zeros if unused;
        none on the first stage, whose inputs take none: nothing would read them). With `defer_weights` (a split
        stage) only B runs: the weight gradients wait for `backward_weights`."""
        outputs = self._outputs.pop(mb)
        inputs = self._inputs.pop(mb)
        if mb in self._saved:
            self._backward_input(mb, outputs, output_grads)
            if not defer_weights:
                self.backward_weights(mb)
        elif defer_weights:
            raise AssertionError(f"stage {self.stage} mb {mb}: weights deferred by a stage that does not run split")
        elif self.is_last:
            torch.autograd.backward(outputs)
        else:
            if output_grads is None:
                raise AssertionError(f"stage {self.stage} mb {mb}: backward without output gradients")
            floats = [o for o in outputs if o.is_floating_point()]  # gradients come for float outputs only
            pairs = [(o, g) for o, g in zip(floats, output_grads, strict=True) if o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return [x.grad if x.grad is not None else torch.zeros_like(x) for x in inputs if x.requires_grad]

    def _backward_input(self, mb: int, outputs: Any, output_grads: Sequence[torch.Tensor] | None) -> None:
        """B of a split micro-batch: the gradient of each differentiable arg into its `.grad`; W's operands kept."""
        split, args, saved, params = self._saved.pop(mb)
        if self.is_last:
            leaves = self._last_outputs.pop(mb)
            wrt = [o for o in leaves if o.requires_grad]
            got = iter(torch.autograd.grad(outputs, wrt, allow_unused=True))
            given: list[torch.Tensor | None] = [next(got) if o.requires_grad else None for o in leaves]
        else:
            if output_grads is None:
                raise AssertionError(f"stage {self.stage} mb {mb}: backward without output gradients")
            floats = iter(output_grads)  # gradients come for float outputs only
            given = [next(floats) if spec.is_float else None for spec in self.graph.outputs]
        tangents = [
            torch.zeros(shape, dtype=dtype, device=self.device) if g is None else g.to(dtype)
            for (shape, dtype), g in zip(split.tangents, given)
        ]
        with torch.no_grad():
            result = split.input_grad(*(saved[i] for i in split.b_saved), *tangents)
        grads = iter(result[: split.n_arg_grads])
        for arg, side in args:
            grad = next(grads) if side is ArgGrad.INPUT else None
            if grad is not None:
                arg.grad = grad
        later = [arg for arg, side in args if side is ArgGrad.WEIGHT]
        operands = [*(saved[i] for i in split.w_saved), *result[split.n_arg_grads :]]
        self._weights[mb] = (PendingW(split, operands), params, later)

    def backward_weights(self, mb: int, layer: str | None = None) -> None:
        """W of micro-batch `mb` (its pieces of `layer` alone, after the shared piece if that has not run; None:
        every piece left): its weight gradients, accumulated into the parameters' `.grad`, and the gradients of the
        args W makes into theirs; each piece's operands are released once no piece left reads them."""
        if mb not in self._weights:
            raise AssertionError(f"stage {self.stage} mb {mb}: BWD_W before its BWD (the program orders them wrongly)")
        pending, params, args = self._weights[mb]
        for piece in pending.take(layer):
            self._run_piece(pending, piece, params, args)
        if pending.done:
            del self._weights[mb]

    def _run_piece(
        self, pending: PendingW, piece: WPiece, all_params: list[torch.Tensor], all_args: list[torch.Tensor]
    ) -> None:
        """One piece of W. Where a parameter has hooks, its gradients go through autograd (so the hooks see them as
        a whole backward's); else an eager stage adds each product into `.grad` in place (`accumulating`: a third of
        W on CPU, benchmarks/split_backward.py), or sets or adds it as autograd's AccumulateGrad does."""
        params = [all_params[i] for i in piece.params]
        args = [all_args[i] for i in piece.weight_args]
        operands = pending.operands(piece)
        n = len(args)
        if piece.into is not None and all(p.grad is not None and not _hooked(p) for p in params):
            with torch.no_grad():  # one addmm_ per layer into .grad: no product allocated, no add after it
                out = piece.into(*operands, *(p.grad for p in params))
            self._set_grads(args, out[:n])
            pending.ran(piece, out[n:])
            return
        with torch.no_grad():
            grads = piece.fn(*operands)
        self._set_grads(args, grads[len(params) : len(params) + n])
        pending.ran(piece, grads[len(params) + n :])
        pairs = [(p, g) for p, g in zip(params, grads[: len(params)], strict=True) if g is not None]
        if any(_hooked(p) for p, _ in pairs):  # the parameters are leaves: autograd accumulates and runs their hooks
            torch.autograd.backward([p for p, _ in pairs], [g for _, g in pairs])
            return
        with torch.no_grad():  # without hooks, one engine run (~40 us a W on CPU) does nothing but these adds
            for p, g in pairs:
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad.add_(g)

    @staticmethod
    def _set_grads(args: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
        """The gradients W makes of the WEIGHT args into their `.grad`."""
        for arg, grad in zip(args, grads, strict=True):
            if grad is not None:
                arg.grad = grad

    def waiting_weights(self) -> list[int]:
        """Micro-batches whose B ran and whose W has not."""
        return sorted(self._weights)

    def param(self, name: str) -> torch.nn.Parameter:
        """This copy's parameter `name` (canonical FQN)."""
        return self.module.get_parameter(name)

    def pending(self) -> list[int]:
        """Micro-batches whose forward ran but whose backward (B and W) has not."""
        return sorted(set(self._outputs) | set(self._weights))


def _accumulating(piece: WPiece) -> WPiece:
    """An eager piece with its variant that adds its parameters' gradients into their `.grad` (`accumulating`)."""
    assert isinstance(piece.fn, fx.GraphModule), "an eager stage runs its graphs as they are"
    return replace(piece, into=accumulating(piece.fn, len(piece.params)))


_FULL_PRECISION = contextlib.nullcontext()
"""The context a full-precision stage runs in (reusable: it does nothing)."""


def _hooked(param: torch.Tensor) -> bool:
    """Whether `param` has a gradient hook or a post-accumulate one (`Tensor.register_hook`,
    `register_post_accumulate_grad_hook`: loss-scale unscaling, streaming, the profiler's stamps)."""
    return bool(param._backward_hooks) or bool(param._post_accumulate_grad_hooks)


def compiled(gm: torch.nn.Module, backend: str | None) -> Callable[..., Any]:
    """`gm` itself, or compiled with `backend` for its one shape: how every stage graph, tapped or not, is run."""
    return gm if backend is None else torch.compile(gm, backend=backend, dynamic=False)


def _sharing(gm: fx.GraphModule, owner: torch.nn.Module) -> fx.GraphModule:
    """A copy of `gm` (the stage captured at another input shape) that reads `owner`'s parameters and buffers where
    `owner` has the name, and `gm`'s own attributes (constants the capture lifted) elsewhere."""
    attrs: dict[str, Any] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            target = str(node.target)
            attrs[target] = _attr(owner, target) if _has_attr(owner, target) else _attr(gm, target)
    return fx.GraphModule(attrs, deepcopy(gm.graph), class_name=type(gm).__name__)


def _attr(module: torch.nn.Module, target: str) -> Any:
    """The attribute at dotted path `target`."""
    prefix, _, leaf = target.rpartition(".")
    return getattr(module.get_submodule(prefix), leaf)


def _has_attr(module: torch.nn.Module, target: str) -> bool:
    """Whether `module` has an attribute at dotted path `target`."""
    try:
        _attr(module, target)
    except AttributeError:
        return False
    return True
