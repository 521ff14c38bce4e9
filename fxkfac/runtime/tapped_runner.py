"""A stage runner that also captures its K-FAC-style layers' inputs and output gradients for a preconditioner
family's captured parts; the captures wait in FIFOs for the plan's STATS ops (fxkfac/runtime/preconditioning.py)."""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from fxkfac.errors import CheckpointError, PipelineError
from fxkfac.passes.factor_capture import FactorTaps, insert_factor_capture, new_probes
from fxkfac.passes.split_stages import StageGraph
from fxkfac.planner.problem import Capture, Op
from fxkfac.preconditioner import Family, Source
from fxkfac.runtime.precision import LossScale
from fxkfac.runtime.stage import StageRunner, compiled

__all__ = ["TappedRunner"]


@dataclass
class TappedRunner(StageRunner):
    """A StageRunner whose forward/backward also capture the layers in `modes` for a family's captured parts.

    `modes` (layer -> how it is captured) is set by the trainer before each step; with no modes the
    plain stage function runs. The input capture feeds the parts `sources[Source.INPUT]`, the output-gradient
    capture `sources[Source.OUTPUT_GRAD]`; captures wait in `captures[(layer, part, mb)]` FIFOs for STATS ops.
    """

    layers: dict[str, Any] = field(default_factory=dict)
    sources: dict[Source, tuple[str, ...]] = field(default_factory=dict)
    modes: dict[str, Capture] = field(default_factory=dict)
    loss_scale: LossScale | None = None
    """float16's loss scale, which output-gradient captures are divided by (None: not scaled)."""
    captures: dict[tuple[str, str, int], deque[Tensor]] = field(default_factory=dict)
    grad_scale: float = 1.0
    """The step's global batch over the one the stage was built for: output-gradient captures are kept as the
    built batch would have made them (deferred ones times this, fused ones times its square), so that the
    family's statistic, scaled by the built batch, weights each of the step's own samples once."""
    _variants: dict[tuple, tuple[FactorTaps, Any]] = field(default_factory=dict)
    _layers_at: dict[Hashable, dict[str, Any]] = field(default_factory=dict)
    _probes: dict[int, dict[str, Tensor]] = field(default_factory=dict)
    _later: dict[int, dict[str, Tensor]] = field(default_factory=dict)
    """Per micro-batch whose W waits: the fused probes whose gradients (captures) W makes."""

    @classmethod
    def wrap(
        cls,
        runner: StageRunner,
        layers: Mapping[str, Any],
        family: Family,
        loss_scale: LossScale | None = None,
    ) -> TappedRunner:
        """The same stage copy (same module and parameters, compiled under the same backend) capturing `layers` for
        `family`'s parts."""
        sources = {src: tuple(p for p in family.parts if family.source(p) is src) for src in Source}
        return cls(
            runner.graph,
            runner.pipe,
            runner.module,
            runner.fn,
            runner.is_last,
            backend=runner.backend,
            layer_params=runner.layer_params,
            recompute=runner.recompute,
            autocast_dtype=runner.autocast_dtype,
            layers=dict(layers),
            sources=sources,
            loss_scale=loss_scale,
        )

    def __post_init__(self) -> None:
        super().__post_init__()
        self._layers_at[None] = self.layers

    def use_shape(
        self, key: Hashable, graph: StageGraph | None = None, layers: Mapping[str, Any] | None = None
    ) -> None:
        """As StageRunner's; `layers`: the records of this stage's layers captured at that shape."""
        super().use_shape(key, graph)
        if layers is not None:
            self._layers_at[key] = dict(layers)
        self.layers = self._layers_at[key]

    def forget_shape(self, key: Hashable) -> None:
        """As StageRunner's, with the capture variants of that shape."""
        super().forget_shape(key)
        if key is not None and key != self.shape:
            self._layers_at.pop(key, None)
            self._variants = {k: v for k, v in self._variants.items() if k[0] != key}

    def _keep(self, name: str, source: Source, mb: int, value: Tensor) -> None:
        """Queue a capture, as float32 (a capture under autocast may be narrower), for every part it feeds (none:
        the family does not use that side)."""
        if value.dtype in (torch.float16, torch.bfloat16):
            value = value.float()
        for part in self.sources.get(source, ()):
            self.captures.setdefault((name, part, mb), deque()).append(value)

    def _variant(self) -> tuple[FactorTaps, Any]:
        key = (self.shape, tuple(sorted(self.modes.items())))
        if key not in self._variants:
            taps = insert_factor_capture(self.gm, list(self.layers.values()), self.modes)
            fn = compiled(taps.gm, self.backend)
            self._variants[key] = (taps, fn)
        return self._variants[key]

    def forward(self, mb: int, inputs: Sequence[Tensor], needs_grad: bool) -> tuple[Tensor, ...]:
        """Run the stage on micro-batch `mb`, keeping the input captures and the output-gradient probes."""
        if not self.modes:
            return super().forward(mb, inputs, needs_grad)
        taps, fn = self._variant()
        order = sorted(taps.probes, key=taps.probes.__getitem__)
        device = inputs[0].device if inputs else torch.device("cpu")
        probes = new_probes(taps, device, self.autocast_dtype)
        leaves = [x.requires_grad_(True) if needs_grad and x.is_floating_point() else x for x in inputs]
        with self.precision():
            variant = ("taps", *sorted(self.modes.items()))  # a recomputed forward's captures are dropped: counted once
            fused = [self.modes[name] is Capture.FUSED for name in order]  # their curvature runs with W
            outs = tuple(
                self.run(mb, variant, taps.gm, fn, [*leaves, *probes], taps.n_outputs, [False] * len(leaves) + fused)
            )
        user = self.crossing(outs[: taps.n_outputs])
        self._inputs[mb] = leaves
        self._outputs[mb] = user
        for name, index in taps.a_outputs.items():
            self._keep(name, Source.INPUT, mb, outs[index].detach())
        self._probes[mb] = dict(zip(order, probes))
        return user

    def backward(self, mb: int, output_grads: Sequence[Tensor] | None, defer_weights: bool = False) -> list[Tensor]:
        """Backpropagate `mb`; the probes' gradients are the output-gradient captures. Where W waits, a fused layer's
        (the curvature of its output gradient) is made by W and kept when W runs (`backward_weights`)."""
        probes = self._probes.pop(mb, {})
        grads = super().backward(mb, output_grads, defer_weights)
        later = {n: p for n, p in probes.items() if defer_weights and self.modes.get(n) is Capture.FUSED}
        if later:
            self._later[mb] = later
        self._keep_grads(mb, {n: p for n, p in probes.items() if n not in later})
        return grads

    def backward_weights(self, mb: int, layer: str | None = None) -> None:
        """As StageRunner's, then keep the fused output-gradient captures W made (a piece's as it runs, so that a
        layer's STATS may follow its own W; every one left when the micro-batch's last piece has run)."""
        super().backward_weights(mb, layer)
        later = self._later.get(mb, {})
        done = mb not in self._weights
        made = {n: p for n, p in later.items() if done or p.grad is not None}
        self._keep_grads(mb, made)
        for name in made:
            del later[name]
        if done:
            self._later.pop(mb, None)

    def _keep_grads(self, mb: int, probes: Mapping[str, Tensor]) -> None:
        """Queue the output-gradient captures of `probes` (their gradients), as the built batch would have made them."""
        for name, probe in probes.items():
            value = probe.grad if probe.grad is not None else torch.zeros_like(probe)
            value = self._unscaled(value, self.modes.get(name))
            if self.grad_scale != 1.0:
                fused = self.modes[name] is Capture.FUSED
                value = value * (self.grad_scale**2 if fused else self.grad_scale)
            self._keep(name, Source.OUTPUT_GRAD, mb, value)

    def _unscaled(self, value: Tensor, mode: Capture | None) -> Tensor:
        """An output-gradient capture made from float16's scaled loss, unscaled: a deferred one (the gradient) divided
        by the scale, a fused one (its Gram matrix) by its square."""
        if self.loss_scale is None:
            return value
        return self.loss_scale.unscale(value, 1 if mode is Capture.DEFERRED else 2)

    def captures_state(self) -> list[list[Any]]:
        """The captures waiting for STATS ops: ``[[layer, part, mb, [tensors, oldest first]], ...]``."""
        return [[layer, part, mb, list(queue)] for (layer, part, mb), queue in sorted(self.captures.items()) if queue]

    def parse_captures(self, saved: Any) -> dict[tuple[str, str, int], deque[Tensor]]:
        """`captures_state` output as capture FIFOs of this stage's layers; CheckpointError when malformed."""
        try:
            out = {(str(layer), str(part), int(mb)): deque(tensors) for layer, part, mb, tensors in saved}
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"captures of stage {self.stage} are malformed ({e!r})") from e
        parts = {p for ps in self.sources.values() for p in ps}
        strange = sorted({k[0] for k in out if k[0] not in self.layers or k[1] not in parts})
        if strange or not all(isinstance(t, Tensor) for q in out.values() for t in q):
            raise CheckpointError(
                f"captures of stage {self.stage} name layers it does not hold ({strange}) "
                "or hold no tensors; the checkpoint was written for another split"
            )
        return out

    def take(self, layer: str, part: str, mb: int, op: Op) -> Tensor:
        """The oldest capture of (layer, part, mb); PipelineError when the plan consumes one never made."""
        queue = self.captures.get((layer, part, mb))
        if not queue:
            raise PipelineError(
                f"'{op}': no capture of {part} for micro-batch {mb} (the layer was not tapped "
                "or its FWD/BWD has not run): the plan orders STATS wrongly for its LayerTiming"
            )
        value = queue.popleft()
        if not queue:
            del self.captures[(layer, part, mb)]
        return value
