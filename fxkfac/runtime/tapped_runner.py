"""A stage runner that also captures its K-FAC-style layers' inputs and output gradients for a preconditioner
family's captured parts; the captures wait in FIFOs for the plan's STATS ops (fxkfac/runtime/preconditioning.py)."""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from fxkfac.errors import CheckpointError, PipelineError
from fxkfac.passes.factor_capture import FactorTaps, insert_factor_capture, new_probes
from fxkfac.passes.split_stages import StageGraph
from fxkfac.planner.problem import Capture, Op, OpKind
from fxkfac.preconditioner import Family, Source
from fxkfac.runtime.precision import LossScale
from fxkfac.runtime.stage import StageRunner, compiled

__all__ = ["TappedRunner", "read_before_w"]


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
    """Per micro-batch whose W waits: the probes whose gradients (captures) W makes ([Note: late captures])."""
    early: set[int] = field(default_factory=set)
    """The micro-batches of this step whose deferred output-gradient captures B makes: the program reads one of them
    between the micro-batch's B and its W (`read_before_w`; set by the trainer each step). W makes the others'."""

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

    def begin_step(self, modes: dict[str, Capture], ops: Sequence[Op]) -> None:
        """A step begins: its capture `modes`, and from its program `ops` the micro-batches whose deferred
        output-gradient captures B makes (`early`, [Note: late captures])."""
        self.modes = modes
        grads = self.sources.get(Source.OUTPUT_GRAD, ())
        self.early = read_before_w(ops, self.stage, self.pipe, grads) if modes and grads else set()

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
            late = [self._late(mb, name) for name in order]
            outs = tuple(
                self.run(mb, variant, taps.gm, fn, [*leaves, *probes], taps.n_outputs, [False] * len(leaves) + late)
            )
        user = self.crossing(outs[: taps.n_outputs])
        self._inputs[mb] = leaves
        self._outputs[mb] = user
        for name, index in taps.a_outputs.items():
            self._keep(name, Source.INPUT, mb, outs[index].detach())
        self._probes[mb] = dict(zip(order, probes))
        return user

    def _late(self, mb: int, name: str) -> bool:
        """Whether W, not B, makes layer `name`'s output-gradient capture of `mb` ([Note: late captures]): a fused
        one's always (the curvature of the output gradient), a deferred one's unless the program reads it before W."""
        mode = self.modes[name]
        return mode is Capture.FUSED or (mode is Capture.DEFERRED and mb not in self.early)

    def backward(self, mb: int, output_grads: Sequence[Tensor] | None, defer_weights: bool = False) -> list[Tensor]:
        """Backpropagate `mb`; the probes' gradients are the output-gradient captures. Where W waits, those W makes
        ([Note: late captures]) are kept when W runs (`backward_weights`)."""
        probes = self._probes.pop(mb, {})
        grads = super().backward(mb, output_grads, defer_weights)
        later = {n: p for n, p in probes.items() if defer_weights and self._late(mb, n)}
        if later:
            self._later[mb] = later
        self._keep_grads(mb, {n: p for n, p in probes.items() if n not in later})
        return grads

    def backward_weights(self, mb: int, layer: str | None = None) -> None:
        """As StageRunner's, then keep the output-gradient captures W made (a piece's as it runs, so that a layer's
        STATS may follow its own W; every one left when the micro-batch's last piece has run)."""
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


# Note [late captures]
# ~~~~~~~~~~~~~~~~~~~~
# On a zero-bubble schedule a refresh step's output-gradient capture of a layer, G (deferred: the gradient of its
# zero probe), is made by W, not B, unless the step's program reads it (a STATS of its part) between the
# micro-batch's B and the W of that layer (`read_before_w`: then B makes it, as the STATS needs it). G is what W reads
# anyway: on a stage whose inputs take no gradient (the first), B makes nothing but for the captures, and made by B
# they cost the stage's whole backward chain in B (the BERT-MLM of benchmarks/pipefisher_overhead.py: stage 0's B
# 11 ms against 0.04 ms, a micro-batch's W 10.5 against 21.6 ms), which the profile and the plan price in W; on the
# other stages B makes G anyway for the input gradient, and W hands the same tensor on. A micro-batch's deferred
# captures go one way together (two variants of the split at most, not one per layer pattern). The planner places
# a STATS of G only after the W that makes it (`planner.plan.window.w_makers`; the validator refuses one before), so
# a planned program reads G after W and B stays as small as on other steps; B making G is for hand-written programs.


def read_before_w(ops: Iterable[Op], stage: int, pipe: int, parts: Iterable[str]) -> set[int]:
    """The micro-batches of (`stage`, `pipe`) whose output-gradient capture of some layer a STATS of `parts` in the
    step's `ops` reads after the micro-batch's BWD and before the BWD_W that makes the layer's weight gradient (one
    naming the layer, or the first whole W): B must make those ([Note: late captures]). A micro-batch without a BWD_W
    in the step runs W with its B: never among them."""
    wanted = set(parts)
    reads: dict[int, set[str | None]] = {}  # per micro-batch since its BWD: layers read whose W has not run
    done: dict[int, set[str | None]] = {}  # per micro-batch: layers whose W has run (None: every layer's)
    early: set[int] = set()
    for op in ops:
        if op.stage != stage or op.pipe != pipe or op.mb is None:
            continue
        if op.kind is OpKind.BWD:
            reads[op.mb], done[op.mb] = set(), set()
        elif op.kind is OpKind.STATS and op.part in wanted and op.mb in reads:
            if None not in done[op.mb] and op.layer not in done[op.mb]:
                reads[op.mb].add(op.layer)
        elif op.kind is OpKind.BWD_W and op.mb in reads:
            if reads[op.mb] and (op.layer is None or op.layer in reads[op.mb]):
                early.add(op.mb)
            done[op.mb].add(op.layer)
    return early
