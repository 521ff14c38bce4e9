"""One stage copy on one rank: forward and backward of micro-batches with autograd, state kept per micro-batch."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from copy import deepcopy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from fxkfac.passes.split_stages import StageGraph, TensorSpec
from fxkfac.runtime.precision import autocast, to_wire, wire_specs

__all__ = ["StageRunner"]


@dataclass
class StageRunner:
    """Stage `graph.index` of pipeline `pipe`: its own parameter copy, autograd per micro-batch.

    Forward keeps each micro-batch's inputs and outputs until its backward; backward
    calls `torch.autograd.backward` on the outputs with the received gradients (or on the
    loss, on the last stage) and returns the gradients of the inputs, which the runtime sends
    to the previous stage.
    """

    graph: StageGraph
    pipe: int
    module: torch.nn.Module
    fn: Callable[..., Any]
    is_last: bool
    autocast_dtype: torch.dtype | None = None
    """The dtype the forward runs under autocast in (None: full precision; [Note: mixed precision] in
    fxkfac/runtime/precision.py)."""
    _inputs: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    _outputs: dict[int, Any] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        graph: StageGraph,
        pipe: int,
        is_last: bool,
        backend: str | None,
        *,
        copy: bool,
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
        fn = module if backend is None else torch.compile(module, backend=backend, dynamic=False)
        return cls(graph, pipe, module, fn, is_last, autocast_dtype)

    @property
    def stage(self) -> int:
        """The global stage index."""
        return self.graph.index

    def forward(self, mb: int, inputs: Sequence[torch.Tensor], needs_grad: bool) -> tuple[torch.Tensor, ...]:
        """Run the stage on micro-batch `mb`; float inputs of inner stages become autograd leaves."""
        leaves = [x.requires_grad_(True) if needs_grad and x.is_floating_point() else x for x in inputs]
        with self.precision():
            outputs = self.crossing(self.fn(*leaves))
        self._inputs[mb] = leaves
        self._outputs[mb] = outputs
        return outputs

    @property
    def device(self) -> torch.device:
        """Where the stage's parameters live (CPU for a stage without any)."""
        return next((p.device for p in self.module.parameters()), torch.device("cpu"))

    def precision(self) -> Any:
        """The autocast context the stage's forward and its loss run in."""
        return autocast(self.autocast_dtype, self.device)

    def crossing(self, outputs: Any) -> tuple[torch.Tensor, ...]:
        """The stage's outputs as they leave it: at the autocast width, except the last stage's (the loss's)."""
        return tuple(outputs) if self.is_last else to_wire(tuple(outputs), self.autocast_dtype)

    def wire(self, specs: Sequence[TensorSpec]) -> list[TensorSpec]:
        """The specs of tensors that cross into or out of this stage as they travel."""
        return wire_specs(specs, self.autocast_dtype)

    def keep_loss(self, mb: int, loss: torch.Tensor) -> None:
        """On the last stage, backward starts from this (already scaled) loss instead of the outputs."""
        self._outputs[mb] = loss

    def backward(self, mb: int, output_grads: Sequence[torch.Tensor] | None) -> list[torch.Tensor]:
        """Backpropagate micro-batch `mb`; returns the gradient of every float input (zeros if unused)."""
        outputs = self._outputs.pop(mb)
        inputs = self._inputs.pop(mb)
        if self.is_last:
            torch.autograd.backward(outputs)
        else:
            if output_grads is None:
                raise AssertionError(f"stage {self.stage} mb {mb}: backward without output gradients")
            floats = [o for o in outputs if o.is_floating_point()]  # gradients come for float outputs only
            pairs = [(o, g) for o, g in zip(floats, output_grads, strict=True) if o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return [x.grad if x.grad is not None else torch.zeros_like(x) for x in inputs if x.is_floating_point()]

    def param(self, name: str) -> torch.nn.Parameter:
        """This copy's parameter `name` (canonical FQN)."""
        return self.module.get_parameter(name)

    def pending(self) -> list[int]:
        """Micro-batches whose forward ran but whose backward has not."""
        return sorted(self._outputs)
