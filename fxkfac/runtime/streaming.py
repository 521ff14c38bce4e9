"""Streamed preconditioning (docs/STREAMED_APPLY.md): a stage's owner hands each streamed layer's gradient to a
helper rank the moment its last backward of the step makes it final, the helper preconditions it with its replica
of the layer's preconditioner and sends it back with its <P, G>, which the owner adds to its KL-clip sum as its own
APPLY would have. The result is the owner's APPLY, exactly; only the rank that computes it moves.

A unit whose statistics come from the reduced gradient (Shampoo, SOAP: `fxkfac.preconditioner.SteppedFamily`) has its
whole per-step work moved: the owner sends its parameter with the gradient (weight decay reads it), the helper folds
the statistics into its copy of the unit's state, preconditions, and returns the state with the result and its <P, G>;
each way one message of bytes (`Packing`), which travels in the stage's buckets like a split APPLY's; every owner
installs it, so its copy stays the unit's whole state (checkpoints, skipped steps, reshards as without
streaming), and at a refresh step it snapshots the returned statistics for its DECOMP.

Each streamed layer's transfers use their own tags (`TagSpace.of_layer`): the gradient (LGRAD), the preconditioned
gradient and its <P, G> (PGRAD), and at each refresh the parts of the made preconditioner with its refresh step
(REPLICA), sent by the owner right after the DECOMP that completes it and combined by the helper as the owner did.

A `SplitApplyFamily` (Muon) streams its APPLY's stateless core instead: the owner keeps the unit's state, runs
`apply_input` (momentum, the Nesterov blend) the moment the gradient is final and sends that as LGRAD; the helper runs
`apply_core` (Newton-Schulz, whole or in pieces) and returns its output as PGRAD; the owner's `apply_output` makes the
direction (lr adjustment, weight decay) and its <P, G>, so no PDOT travels. No REPLICA: there is nothing to refresh.
The stage must have one copy (its gradient is final at its last backward; with copies only after their all-reduce).

[Note: streamed buckets]
A lone gloo send costs its caller about 0.1 ms of CPU however small, what 0.7 MB more add to it; a split APPLY streams
one matrix a message, dozens a step, each way, a stateful unit one packed message each way (`Packing`). So where the
programs allow (`bucketable`), the units one owner streams to one helper from one stage travel together: both ends cut
the step's units of that pair and stage, in descending unit order (the order the backward finishes them in), into
buckets of at least `BUCKET_BYTES` (`buckets`), and each bucket is one message each way. The owner writes each unit's
message (a core input; a stateful unit's packed gradient and parameter) into its bucket's flat buffer as its hook makes
it and sends the bucket with its last unit; the helper takes a bucket at the first of its units' RECV_LGRAD, writes
each result into the return bucket at its SEND_PGRAD and sends it with the last; the owner takes it at the first of its
RECV_PGRADs. A bucket waits for its last unit, so the programs must not wait between a bucket's first and last op
(`bucketable` checks every rank's programs, which every rank holds, so both ends agree). The rule and the cut are
planner/problem/buckets.py's, which the planner prices the same buckets by.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from fxkfac.errors import PipelineError
from fxkfac.planner.problem import LayerTiming, Op, OpKind
from fxkfac.planner.problem.buckets import BUCKET_BYTES, cut
from fxkfac.preconditioner import (
    Family,
    RefreshState,
    SplitApplyFamily,
    SteppedFamily,
    direction_dot,
    fold_gradient,
    gradient_parts,
)
from fxkfac.runtime.apply_pieces import ApplyPieces
from fxkfac.runtime.interpreter import Interpreter, StepContext
from fxkfac.runtime.mesh import StageCopies
from fxkfac.runtime.sync import flat_gradient, grad_key, split_flat

__all__ = ["ParamShape", "StreamedLayers", "StreamOwner", "Streams", "Bucket", "buckets"]


class StreamOwner(Protocol):
    """The rank's preconditioner runtime as `Streams` sees it (fxkfac/runtime/preconditioning.py is the one): its
    layers with their states and timings, each stage's copies, and the two calls a streamed APPLY makes for the
    owner's own APPLY."""

    @property
    def rank(self) -> int: ...

    @property
    def family(self) -> Family: ...

    @property
    def layers(self) -> Mapping[str, Any]: ...

    @property
    def states(self) -> Mapping[str, RefreshState]: ...

    @property
    def timings(self) -> Mapping[str, LayerTiming]: ...

    @property
    def groups(self) -> Mapping[int, StageCopies]: ...

    @property
    def n(self) -> int: ...

    def folded_elsewhere(self, step: int, name: str) -> None: ...

    def settle_layer(self, ctx: StepContext, name: str) -> None: ...

    def add_dot(self, layers: Sequence[Any], dot: Tensor, stage: int) -> None: ...


_LGRAD, _PGRAD, _PDOT, _REPLICA_STEP, _REPLICA_PARTS = 0, 1, 2, 3, 4
"""Each streamed layer's messages, numbered within its tags (`TagSpace.of_layer`); the replica's parts follow."""

_ALIGN = 8
"""Bytes each piece of a packed message starts at a multiple of (any dtype's view of it is then aligned)."""


@dataclass(frozen=True)
class Packing:
    """The pieces (elements, dtype) of one stateful unit's message, packed as bytes into one flat uint8 tensor, each
    piece at an `_ALIGN` boundary: one message where there were one per piece (a gloo send's fixed cost once)."""

    pieces: tuple[tuple[int, torch.dtype], ...]

    @property
    def spans(self) -> tuple[int, ...]:
        """Each piece's first byte."""
        out, at = [], 0
        for numel, dtype in self.pieces:
            out.append(at)
            at += -(-numel * dtype.itemsize // _ALIGN) * _ALIGN
        return tuple(out)

    @property
    def nbytes(self) -> int:
        """Bytes of the packed message."""
        numel, dtype = self.pieces[-1]
        return self.spans[-1] + -(-numel * dtype.itemsize // _ALIGN) * _ALIGN

    def pack(self, values: Sequence[Tensor], out: Tensor | None = None) -> Tensor:
        """`values` (one a piece, any shape) written into `out` (a new uint8 tensor when None)."""
        flat = torch.empty(self.nbytes, dtype=torch.uint8, device=values[0].device) if out is None else out
        for at, (numel, dtype), value in zip(self.spans, self.pieces, values, strict=True):
            flat[at : at + numel * dtype.itemsize].view(dtype).copy_(value.reshape(-1))
        return flat

    def unpack(self, flat: Tensor) -> list[Tensor]:
        """The pieces of a packed message, flat views of it."""
        return [flat[at : at + n * d.itemsize].view(d) for at, (n, d) in zip(self.spans, self.pieces, strict=True)]


@dataclass(frozen=True)
class ParamShape:
    """One parameter of a replicated layer as its helper sees it (the helper holds no copy of the stage)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        """Elements of the parameter (its share of the layer's flat gradient)."""
        return math.prod(self.shape)


@dataclass(frozen=True)
class Bucket:
    """Units of one stage that one owner and one helper exchange in one message each way ([Note: streamed
    buckets]): each unit's span (offset, elements) in the flat message, which its first unit's tags name."""

    peer: int
    """The other end."""
    stage: int
    units: tuple[str, ...]
    spans: Mapping[str, tuple[int, int]]
    numel: int
    dtype: torch.dtype

    @property
    def key(self) -> tuple[int, int, str]:
        """(peer, stage, first unit): what names the bucket's receives and buffers."""
        return (self.peer, self.stage, self.units[0])

    def part(self, flat: Tensor, unit: str) -> Tensor:
        """`unit`'s span of the bucket's flat message."""
        start, numel = self.spans[unit]
        return flat[start : start + numel]


def _flat(tensors: Sequence[Tensor]) -> Tensor:
    """`tensors` as one flat tensor (a view of a lone one: `Packing.pack` copies it once)."""
    return tensors[0].reshape(-1) if len(tensors) == 1 else torch.cat([t.reshape(-1) for t in tensors])


def buckets(
    units: Sequence[tuple[int, int, str, int, torch.dtype]], order: Mapping[str, int], cap: int = BUCKET_BYTES
) -> dict[tuple[int, str], Bucket]:
    """Each (peer, unit)'s bucket, given the step's (peer, stage, unit, elements, dtype) of one end, cut as the planner
    prices them (`planner.problem.buckets.cut`): per peer and stage, the units in descending `order`, a bucket closed
    once it holds `cap` bytes (a helper of a stage with copies exchanges a unit with each). Both ends of a transfer
    list the same units, so they cut the same buckets."""
    found = {unit: (numel, dtype) for _, _, unit, numel, dtype in units}
    out: dict[tuple[int, str], Bucket] = {}
    cuts = cut(
        [((peer, stage), unit, numel * dtype.itemsize, dtype) for peer, stage, unit, numel, dtype in units], order, cap
    )
    for (peer, stage), names in cuts:
        spans: dict[str, tuple[int, int]] = {}
        size = 0
        for name in names:
            spans[name] = (size, found[name][0])
            size += found[name][0]
        bucket = Bucket(peer, stage, names, spans, size, found[names[0]][1])
        out.update(dict.fromkeys(((peer, name) for name in names), bucket))
    return out


@dataclass(frozen=True)
class StreamedLayers:
    """What one rank streams, read from its programs by the trainer: the layers of its stages whose replicas it sends
    (`owned`: it holds the stage's first copy), the layers of other stages it preconditions (`replicas`, with their
    parameters), and every unit of the model numbered the same on every rank (`tags`: the tags of their
    transfers)."""

    tags: Mapping[str, int] = field(default_factory=dict)
    owned: frozenset[str] = frozenset()
    replicas: Mapping[str, tuple[ParamShape, ...]] = field(default_factory=dict)
    bucketed: frozenset[tuple[int, int, int]] = frozenset()
    """(owner, helper, stage) whose split-APPLY transfers travel in buckets (`bucketable`)."""


class Streams:
    """One rank's streamed layers: those of its stages it hands off (every SEND_LGRAD's layer; their replicas it
    sends: `owned`), and those it preconditions for their owners (`replicas`, with their parameters' shapes)."""

    def __init__(self, runtime: StreamOwner, streamed: StreamedLayers) -> None:
        self.runtime = runtime
        self.tags = dict(streamed.tags)
        self.owned = streamed.owned
        """Layers whose replicas this rank sends (their made preconditioners are kept for SEND_REPLICA)."""
        self.replicas = dict(streamed.replicas)
        family = runtime.family
        self.stepped = isinstance(family, SteppedFamily) and bool(gradient_parts(family))
        """Whether a streamed unit's whole per-step work moves: the helper folds its gradient-fed statistics, keeps its
        optimizer state and returns it with each result (`SteppedFamily`)."""
        self.split: SplitApplyFamily | None = family if isinstance(family, SplitApplyFamily) else None
        """The family when its APPLY splits (its core is what is streamed), else None (looked up once: an isinstance of
        a runtime-checkable Protocol takes ~10 us)."""
        self._layer_params: dict[tuple[int, str], tuple[Any, list[torch.nn.Parameter]]] = {}
        self._packings: dict[tuple[OpKind, str], Packing] = {}
        """A stateful unit's message each way by (LGRAD or PGRAD kind, unit) (`packing`), made once."""
        """(stage, layer) -> the stage copy and its parameters of the layer (`_params`), looked up once."""
        self.bucketed = streamed.bucketed if self.split is not None or self.stepped else frozenset()
        """(owner, helper, stage) whose transfers travel in buckets ([Note: streamed buckets])."""
        self._buckets: dict[OpKind, dict[tuple[int, str], Bucket]] | None = None
        """The step's buckets by the kind of the transfer and unit (`_step_buckets`; None: not cut yet this step)."""
        self._filling: dict[tuple[OpKind, tuple[int, int, str]], tuple[Tensor, set[str]]] = {}
        """Buckets this rank is writing, by kind and key: the flat message and the units not written yet."""
        self._posted: set[tuple[OpKind, tuple[int, int, str]]] = set()
        """Buckets whose receive this step posted, by kind and key."""
        self._landed: dict[tuple[OpKind, tuple[int, int, str]], Tensor] = {}
        """Buckets received this step, by kind and key."""
        self._params_in: dict[str, Tensor] = {}
        self._hooks: dict[str, list[Any]] = {}
        self._sent: set[str] = set()
        self._inbox: dict[str, Tensor] = {}
        self._outbox: dict[str, tuple[Tensor, ...]] = {}
        self.made: dict[str, deque[tuple[int, dict[str, Any]]]] = {}
        """Preconditioners made here of layers a helper replicates, (refresh step, parts) waiting for SEND_REPLICA."""
        self.pieces = ApplyPieces(runtime.rank)
        """The cores this rank runs for their owners in flight between their pieces (a `SplitApplyFamily`)."""
        self.replica_steps: dict[str, int | None] = {}
        """The refresh step of each replica's newest preconditioner received (checked at its APPLY); None for a
        replica loaded from a checkpoint, trusted until the next arrives, so that checkpoints carry no streaming state
        and reshard onto any layout."""

    def install(self, interpreter: Interpreter) -> None:
        """Register the handlers of the streamed transfers (and what each needs when its step begins)."""
        interpreter.register(OpKind.SEND_LGRAD, self.send_gradient, self.arm)
        interpreter.register(OpKind.RECV_LGRAD, self.recv_gradient, self.post_gradient)
        interpreter.register(OpKind.SEND_PGRAD, self.send_preconditioned)
        interpreter.register(OpKind.RECV_PGRAD, self.recv_preconditioned, self.post_preconditioned)
        interpreter.register(OpKind.SEND_REPLICA, self.send_replica)
        interpreter.register(OpKind.RECV_REPLICA, self.recv_replica, self.post_replica)

    def _step_buckets(self, ctx: StepContext, ops: Sequence[Op]) -> dict[OpKind, dict[tuple[int, str], Bucket]]:
        """The step's buckets of each streamed transfer kind this rank runs, cut once per step from its ops."""
        if self._buckets is not None:
            return self._buckets
        units: dict[OpKind, list[tuple[int, int, str, int, torch.dtype]]] = {}
        for op in ops:
            if op.kind not in (OpKind.SEND_LGRAD, OpKind.RECV_LGRAD, OpKind.SEND_PGRAD, OpKind.RECV_PGRAD):
                continue
            assert op.peer is not None and op.stage is not None and op.layer is not None, "streamed ops name them"
            owns = op.kind in (OpKind.SEND_LGRAD, OpKind.RECV_PGRAD)
            pair = (self.runtime.rank, op.peer, op.stage) if owns else (op.peer, self.runtime.rank, op.stage)
            if pair not in self.bucketed:
                continue
            if self.stepped:
                numel, dtype = self.packing(ctx, op).nbytes, torch.uint8
            elif owns:
                (param,) = self._params(ctx, op)
                numel, dtype = param.numel(), param.dtype
            else:
                (shape,) = self._replica(op)
                numel, dtype = shape.numel, shape.dtype
            units.setdefault(op.kind, []).append((op.peer, op.stage, op.layer, numel, dtype))
        self._buckets = {kind: buckets(found, self.tags, BUCKET_BYTES) for kind, found in units.items()}
        return self._buckets

    def packing(self, ctx: StepContext, op: Op) -> Packing:
        """A stateful unit's message in the direction of `op`: its gradient and parameter to the helper; its result,
        <P, G> and per-step state (`SteppedFamily.step_state`) back."""
        assert op.layer is not None, "a streamed transfer names its layer"
        out = op.kind in (OpKind.SEND_LGRAD, OpKind.RECV_LGRAD)
        key = (OpKind.SEND_LGRAD if out else OpKind.SEND_PGRAD, op.layer)
        known = self._packings.get(key)
        if known is not None:
            return known
        if op.kind in (OpKind.SEND_LGRAD, OpKind.RECV_PGRAD):
            params = self._params(ctx, op)
            numel, dtype = sum(p.numel() for p in params), params[0].dtype
        else:
            shapes = self._replica(op)
            numel, dtype = sum(s.numel for s in shapes), shapes[0].dtype
        if out:
            packing = Packing(((numel, dtype), (numel, dtype)))
        else:
            family, layer = self.runtime.family, self.runtime.layers[op.layer]
            assert isinstance(family, SteppedFamily), "only a stepped family returns a state"
            state = family.step_state(layer, family.new_state(layer))
            packing = Packing(((numel, dtype), (1, torch.float64), (state.numel(), state.dtype)))
        self._packings[key] = packing
        return packing

    def _bucket(self, kind: OpKind, op: Op) -> Bucket | None:
        """The bucket `op`'s unit travels in this step (None: alone)."""
        assert op.layer is not None and op.peer is not None, "a streamed transfer names its layer and peer"
        return None if self._buckets is None else self._buckets.get(kind, {}).get((op.peer, op.layer))

    def _fill(self, ctx: StepContext, kind: OpKind, bucket: Bucket, unit: str, value: Tensor, message: int) -> None:
        """Write `unit`'s `value` into its bucket's flat message; send the bucket once every unit is in."""
        flat, waiting = self._filling.get((kind, bucket.key)) or (
            torch.empty(bucket.numel, dtype=bucket.dtype, device=value.device),
            set(bucket.units),
        )
        bucket.part(flat, unit).copy_(value.reshape(-1))
        waiting.discard(unit)
        if waiting:
            self._filling[(kind, bucket.key)] = (flat, waiting)
            return
        self._filling.pop((kind, bucket.key), None)
        tag = ctx.transport.tags.of_layer(self.tags[bucket.units[0]], message)
        ctx.transport.send_tagged(flat, bucket.peer, tag, f"{kind.value} bucket {bucket.key}")

    def _post_bucket(self, ctx: StepContext, kind: OpKind, bucket: Bucket, message: int) -> None:
        """Post the receive of `bucket` (once a step, at the first of its units)."""
        key = (kind, bucket.key)
        if key in self._posted:
            return
        self._posted.add(key)
        flat = torch.empty(bucket.numel, dtype=bucket.dtype, device=ctx.transport.device)
        tag = ctx.transport.tags.of_layer(self.tags[bucket.units[0]], message)
        ctx.transport.post_tagged(key, [flat], bucket.peer, [tag])

    def _landed_part(self, ctx: StepContext, kind: OpKind, bucket: Bucket, unit: str, what: str) -> Tensor:
        """`unit`'s span of the received `bucket`, waiting for it at the first of its units."""
        key = (kind, bucket.key)
        if key not in self._landed:
            (self._landed[key],) = ctx.transport.take(key, what)
        return bucket.part(self._landed[key], unit)

    def _tag(self, ctx: StepContext, op: Op, message: int) -> int:
        """The tag of `message` of the layer `op` names (both ends number it alike)."""
        assert op.layer is not None, "a streamed transfer names its layer (planner/problem/ir.py OP_FIELDS)"
        return ctx.transport.tags.of_layer(self.tags[op.layer], message)

    # --- the owner --------------------------------------------------------------------------------

    def _params(self, ctx: StepContext, op: Op) -> list[torch.nn.Parameter]:
        """This rank's parameters of the layer `op` names, in the family's order (the flat gradient's); looked up
        once per stage copy."""
        assert op.stage is not None and op.layer is not None, "a streamed transfer names its stage and layer"
        runner = ctx.stage_runner(op.stage)
        known = self._layer_params.get((op.stage, op.layer))
        if known is not None and known[0] is runner:
            return known[1]
        params = [runner.param(p) for p in self.runtime.family.params_of(self.runtime.layers[op.layer])]
        self._layer_params[(op.stage, op.layer)] = (runner, params)
        return params

    def arm(self, ctx: StepContext, op: Op, ops: Sequence[Op]) -> None:
        """Hook the layer's parameters so that the stage's last backward of the step sends the gradient as soon as
        it is final (each parameter accumulated once per backward of the stage in `ops`)."""
        assert op.layer is not None, "SEND_LGRAD names its layer"
        self._step_buckets(ctx, ops)
        backwards = sum(1 for o in ops if o.kind is OpKind.BWD and o.stage == op.stage)
        params = self._params(ctx, op)
        tied = [p for p in self.runtime.family.params_of(self.runtime.layers[op.layer]) if p in ctx.sync.owned]
        if tied and self.stepped:
            raise PipelineError(
                f"rank {self.runtime.rank}: '{op}' streams {op.layer}, whose parameters {tied} other stages share: "
                "its gradient is complete only once their sum lands, after the backward; the plan must not stream it"
            )
        seen = [0] * len(params)
        final = [0]  # parameters accumulated by every backward of the stage
        name = op.layer

        def hook(index: int) -> Callable[[Tensor], None]:
            def count(_: Tensor) -> None:
                seen[index] += 1
                if seen[index] == backwards:
                    final[0] += 1
                    if final[0] == len(params) and name not in self._sent:
                        self._send_gradient(ctx, op, params)

            return count

        self._hooks[name] = [p.register_post_accumulate_grad_hook(hook(i)) for i, p in enumerate(params)]

    def _send_gradient(self, ctx: StepContext, op: Op, params: Sequence[torch.nn.Parameter]) -> None:
        """Send the layer's flat gradient (zeros for a parameter without one) to its helper: for a split APPLY, the
        core's input the owner makes of it (`_core_input`); for a stateful unit, its parameter too."""
        assert op.layer is not None and op.peer is not None, "SEND_LGRAD names its layer and helper"
        split = self.split
        if self.stepped:  # one copy each: into the message
            grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
            flat = self.packing(ctx, op).pack([_flat(grads), _flat([p.detach() for p in params])])
        else:
            flat = flat_gradient(params) if split is None else self._core_input(split, op, params)
        bucket = self._bucket(OpKind.SEND_LGRAD, op)
        if bucket is not None:
            self._fill(ctx, OpKind.SEND_LGRAD, bucket, op.layer, flat, _LGRAD)
        else:
            ctx.transport.send_tagged(flat, op.peer, self._tag(ctx, op, _LGRAD), str(op))
        self._sent.add(op.layer)

    def _core_input(self, family: SplitApplyFamily, op: Op, params: Sequence[torch.nn.Parameter]) -> Tensor:
        """The owner's `apply_input` of the unit's final gradient, flat (it updates the unit's state here)."""
        assert op.layer is not None and op.stage is not None, "SEND_LGRAD names its stage and layer"
        if len(self.runtime.groups[op.stage].ranks) > 1:
            raise PipelineError(
                f"rank {self.runtime.rank}: '{op}' streams the APPLY core of {op.layer}, whose stage has copies: its "
                f"gradient is final only after their all-reduce; {self.runtime.family.name} streams single-copy stages"
            )
        (param,) = params
        grad = torch.zeros_like(param) if param.grad is None else param.grad
        x = family.apply_input(self.runtime.layers[op.layer], grad, self.runtime.states[op.layer], param)
        return x.reshape(-1).to(param.dtype)

    def send_gradient(self, ctx: StepContext, op: Op) -> None:
        """The layer's gradient went to its helper during the backward (`arm`); else (a parameter the backward did
        not reach) it goes now."""
        assert op.layer is not None, "SEND_LGRAD names its layer"
        for handle in self._hooks.pop(op.layer, []):
            handle.remove()
        if op.layer not in self._sent:
            self._send_gradient(ctx, op, self._params(ctx, op))
        self._sent.discard(op.layer)

    def post_preconditioned(self, ctx: StepContext, op: Op, ops: Sequence[Op]) -> None:
        """Post the receive of the layer's preconditioned gradient and its <P, G> (none for a split APPLY: the owner
        takes it)."""
        assert op.peer is not None, "RECV_PGRAD names its helper"
        self._step_buckets(ctx, ops)
        bucket = self._bucket(OpKind.RECV_PGRAD, op)
        if bucket is not None:
            self._post_bucket(ctx, OpKind.RECV_PGRAD, bucket, _PGRAD)
            return
        params = self._params(ctx, op)
        size, first = sum(p.numel() for p in params), params[0]
        if self.stepped:
            size, dtype = self.packing(ctx, op).nbytes, torch.uint8
        else:
            dtype = first.dtype
        buffers = [torch.empty(size, dtype=dtype, device=first.device)]
        tags = [self._tag(ctx, op, _PGRAD)]
        if self.split is None and not self.stepped:
            buffers.append(torch.empty(1, dtype=torch.float64, device=first.device))
            tags.append(self._tag(ctx, op, _PDOT))
        ctx.transport.post_tagged(("pgrad", op.layer), buffers, op.peer, tags)

    def recv_preconditioned(self, ctx: StepContext, op: Op) -> None:
        """Write the preconditioned gradient into the layer's `.grad` and add its share of <P, G> (divided by the
        stage's copies, each of which adds its own) to the layer's KL-clip group, as the owner's APPLY would have."""
        assert op.stage is not None and op.layer is not None, "RECV_PGRAD names its stage and layer"
        bucket = self._bucket(OpKind.RECV_PGRAD, op)
        received = (
            [self._landed_part(ctx, OpKind.RECV_PGRAD, bucket, op.layer, str(op))]
            if bucket is not None
            else ctx.transport.take(("pgrad", op.layer), str(op))
        )
        ctx.transport.settle(grad_key(op.stage))  # the copies' all-reduce lands first: the result replaces it
        params = self._params(ctx, op)
        split = self.split
        if split is not None:
            (flat,) = received
            (param,) = params
            grad = torch.zeros_like(param) if param.grad is None else param.grad
            p = split.apply_output(self.runtime.layers[op.layer], flat.reshape(param.shape), param)
            param.grad = p
            self.runtime.add_dot([self.runtime.layers[op.layer]], direction_dot(self.runtime.family, p, grad), op.stage)
            return
        if self.stepped:
            flat, dot, *state = self.packing(ctx, op).unpack(received[0])
        else:
            flat, dot = received
            state = []
        for p, chunk in zip(params, split_flat(flat, [p.shape for p in params]), strict=True):
            p.grad = chunk
        copies = len(self.runtime.groups[op.stage].ranks)
        layer = self.runtime.layers[op.layer]
        self.runtime.add_dot([layer], dot[0] / copies, op.stage)
        if self.stepped:  # the helper's state after this step's folds and APPLY becomes the unit's here too
            family, unit = self.runtime.family, self.runtime.states[op.layer]
            assert isinstance(family, SteppedFamily), "only a stepped family returns a state"
            unit.activate(ctx.step)
            family.load_step_state(layer, unit, state[0])
            self.runtime.folded_elsewhere(ctx.step, op.layer)

    def send_replica(self, ctx: StepContext, op: Op) -> None:
        """Send the helper the layer's preconditioner made here (the parts the owner combined, and its refresh)."""
        assert op.layer is not None and op.peer is not None, "SEND_REPLICA names its layer and helper"
        self.runtime.settle_layer(ctx, op.layer)  # halves broadcast from the stage's other copies land first
        waiting = self.made.get(op.layer)
        if not waiting:
            raise PipelineError(
                f"rank {self.runtime.rank}: '{op}' sends a preconditioner of {op.layer} this rank has not made: "
                "the plan lacks the DECOMP before it"
            )
        step, halves = waiting.popleft()
        family, layer = self.runtime.family, self.runtime.layers[op.layer]
        device = ctx.transport.device
        ctx.transport.send_tagged(
            torch.tensor([step], device=device), op.peer, self._tag(ctx, op, _REPLICA_STEP), str(op)
        )
        for i, part in enumerate(family.parts):
            packed = family.pack(layer, part, halves[part]).to(device)
            ctx.transport.send_tagged(packed, op.peer, self._tag(ctx, op, _REPLICA_PARTS + i), str(op))

    # --- the helper -------------------------------------------------------------------------------

    def _replica(self, op: Op) -> tuple[ParamShape, ...]:
        """The parameters of the replica `op` names; PipelineError for a layer this rank holds none of."""
        if op.layer not in self.replicas:
            raise PipelineError(
                f"rank {self.runtime.rank}: '{op}' names a layer this rank holds no replica of (replicas: "
                f"{sorted(self.replicas)}): the program was made for another plan"
            )
        return self.replicas[op.layer]

    def post_gradient(self, ctx: StepContext, op: Op, ops: Sequence[Op]) -> None:
        """Post the receive of the layer's gradient (of its bucket, at the first of its units)."""
        assert op.peer is not None, "RECV_LGRAD names the owner"
        self._step_buckets(ctx, ops)
        bucket = self._bucket(OpKind.RECV_LGRAD, op)
        if bucket is not None:
            self._post_bucket(ctx, OpKind.RECV_LGRAD, bucket, _LGRAD)
            return
        shapes = self._replica(op)
        size, dtype = sum(s.numel for s in shapes), shapes[0].dtype
        if self.stepped:
            size, dtype = self.packing(ctx, op).nbytes, torch.uint8
        buffers = [torch.empty(size, dtype=dtype, device=ctx.transport.device)]
        ctx.transport.post_tagged(("lgrad", op.layer, op.peer), buffers, op.peer, [self._tag(ctx, op, _LGRAD)])

    def recv_gradient(self, ctx: StepContext, op: Op) -> None:
        """Take one owner's gradient of the layer for its APPLY here, summed with the other copies' in program order:
        the gradient their all-reduce makes."""
        assert op.layer is not None, "RECV_LGRAD names its layer"
        bucket = self._bucket(OpKind.RECV_LGRAD, op)
        if bucket is not None:
            received = self._landed_part(ctx, OpKind.RECV_LGRAD, bucket, op.layer, str(op))
        else:
            (received,) = ctx.transport.take(("lgrad", op.layer, op.peer), str(op))
        param: list[Tensor] = []
        if self.stepped:
            received, *param = self.packing(ctx, op).unpack(received)
        self._inbox[op.layer] = self._inbox[op.layer] + received if op.layer in self._inbox else received
        if param:  # every copy's parameter is the same
            self._params_in[op.layer] = param[0]

    def apply(self, ctx: StepContext, op: Op) -> None:
        """Precondition a received gradient with the replica due at this step (PipelineError when a refresh is due
        and none arrived, or an older one than due is the newest received), keeping the result and its <P, G> for
        SEND_PGRAD."""
        assert op.layer is not None, "an APPLY of a stage held elsewhere names its layer"
        shapes, name = self._replica(op), op.layer
        if self.split is not None:
            self._apply_core(self.split, op, shapes)
            return
        if name not in self._inbox:
            raise PipelineError(f"rank {self.runtime.rank}: '{op}' before the RECV_LGRAD of {name}")
        timing, state = self.runtime.timings[name], self.runtime.states[name]
        due = ctx.step - timing.use_offset
        newest = due - (due - timing.curv_step) % timing.period if due >= timing.curv_step else None
        received = self.replica_steps.get(name, -1)  # None: loaded from a checkpoint, trusted
        if newest is not None and received is not None and received < newest:
            raise PipelineError(
                f"rank {self.runtime.rank}: '{op}' at step {ctx.step} needs the replica of {name}'s refresh at step "
                f"{newest}, which has not arrived: the plan lacks its SEND_REPLICA / RECV_REPLICA"
            )
        state.activate(ctx.step)
        flat = self._inbox.pop(name)
        grads = {s.name: chunk for s, chunk in zip(shapes, split_flat(flat, [s.shape for s in shapes]), strict=True)}
        layer, family = self.runtime.layers[name], self.runtime.family
        params = dict(grads)
        if self.stepped:
            params = self._fold(ctx, name, shapes, grads)
        dot = family.precondition([layer], grads, self.runtime.states, params)  # in place: in flat
        extra: tuple[Tensor, ...] = ()
        if self.stepped:
            assert isinstance(family, SteppedFamily), "only a stepped family returns a state"
            extra = (family.step_state(layer, state).to(ctx.transport.device),)
        self._outbox[name] = (flat, dot.detach().to(torch.float64).reshape(1), *extra)

    def _fold(
        self, ctx: StepContext, name: str, shapes: Sequence[ParamShape], grads: Mapping[str, Tensor]
    ) -> dict[str, Tensor]:
        """Fold the step's statistics of a stateful unit into this rank's copy of its state, as the owner's STATS
        would (counting a refresh at its refresh step); returns the unit's parameter by name for its APPLY."""
        if len(shapes) != 1 or name not in self._params_in:
            raise PipelineError(
                f"rank {self.runtime.rank}: the streamed unit {name} came without its one parameter: the program was "
                "made for another family"
            )
        (shape,) = shapes
        raw = self._params_in.pop(name).view(shape.shape)
        raw.grad = grads[shape.name].clone()  # what the family's statistic reads; APPLY then overwrites grads
        family, layer, state = self.runtime.family, self.runtime.layers[name], self.runtime.states[name]
        for part in sorted(gradient_parts(family), key=family.parts.index):
            fold_gradient(family, layer, state, part, raw, self.runtime.n)
        timing = self.runtime.timings[name]
        if ctx.step % timing.period == timing.curv_step:
            state.refreshes += 1
        return {shape.name: raw}

    def _apply_core(self, family: SplitApplyFamily, op: Op, shapes: tuple[ParamShape, ...]) -> None:
        """Run the core (or the piece of it `op` names) of the unit on the input its owner sent; after the last piece
        keep the output, flat in the parameter's dtype, for SEND_PGRAD (<P, G> is the owner's to take)."""
        assert op.layer is not None, "an APPLY of a stage held elsewhere names its layer"
        name, (shape,) = op.layer, shapes
        if (op.piece or (0, 1))[0] == 0 and name not in self._inbox:
            raise PipelineError(f"rank {self.runtime.rank}: '{op}' before the RECV_LGRAD of {name}")
        unit = self.runtime.layers[name]
        core = self.pieces.run(family, unit, op, lambda: self._inbox.pop(name).reshape(shape.shape))
        if core is not None:
            flat = core.reshape(-1).to(shape.dtype)
            self._outbox[name] = (flat,)

    def send_preconditioned(self, ctx: StepContext, op: Op) -> None:
        """Send the owner the layer's preconditioned gradient and its <P, G> (a split APPLY's core output alone)."""
        assert op.layer is not None and op.peer is not None, "SEND_PGRAD names its layer and the owner"
        if op.layer not in self._outbox:
            raise PipelineError(f"rank {self.runtime.rank}: '{op}' before the APPLY of {op.layer}")
        flat, *rest = self._outbox[op.layer]  # one SEND_PGRAD per copy of the stage; the step's start clears it
        if self.stepped:
            flat, rest = self.packing(ctx, op).pack([flat, *rest]), []
        bucket = self._bucket(OpKind.SEND_PGRAD, op)
        if bucket is not None:
            self._fill(ctx, OpKind.SEND_PGRAD, bucket, op.layer, flat, _PGRAD)
            return
        ctx.transport.send_tagged(flat, op.peer, self._tag(ctx, op, _PGRAD), str(op))
        for message, tensor in zip((_PDOT,), rest):
            ctx.transport.send_tagged(tensor, op.peer, self._tag(ctx, op, message), str(op))

    def post_replica(self, ctx: StepContext, op: Op, _: Sequence[Op]) -> None:
        """Post the receives of a replica: its refresh step and each part."""
        assert op.layer is not None and op.peer is not None, "RECV_REPLICA names its layer and the owner"
        self._replica(op)
        family, layer = self.runtime.family, self.runtime.layers[op.layer]
        device = ctx.transport.device
        parts = [torch.empty_like(family.pack(layer, part, None), device=device) for part in family.parts]
        tags = [self._tag(ctx, op, _REPLICA_PARTS + i) for i in range(len(parts))]
        step = torch.zeros(1, dtype=torch.int64, device=device)
        buffers, tags = [step, *parts], [self._tag(ctx, op, _REPLICA_STEP), *tags]
        ctx.transport.post_tagged(("replica", op.layer), buffers, op.peer, tags)

    def recv_replica(self, ctx: StepContext, op: Op) -> None:
        """Combine the received parts as the owner did and queue the result for the step its timing says."""
        assert op.layer is not None, "RECV_REPLICA names its layer"
        step, *packed = ctx.transport.take(("replica", op.layer), str(op))
        family, layer, name = self.runtime.family, self.runtime.layers[op.layer], op.layer
        halves = {p: family.unpack(layer, p, flat) for p, flat in zip(family.parts, packed, strict=True)}
        refreshed = int(step[0])
        made = family.combine(layer, self.runtime.states[name], halves)
        self.runtime.states[name].set_pending(made, refreshed + self.runtime.timings[name].use_offset)
        self.replica_steps[name] = refreshed

    # --- skipped steps and checkpoints ------------------------------------------------------------

    def begin_step(self) -> None:
        """Forget the last step's gradients and results (each step receives and applies its own)."""
        self._inbox, self._outbox, self._params_in = {}, {}, {}
        self._buckets, self._filling, self._posted, self._landed = None, {}, set(), {}
        self.pieces.clear()

    def snapshot(self) -> tuple[dict[str, deque[tuple[int, dict[str, Any]]]], dict[str, int | None]]:
        """What a skipped step restores (`restore`)."""
        return {n: deque(q) for n, q in self.made.items()}, dict(self.replica_steps)

    def restore(self, saved: tuple[dict[str, deque[tuple[int, dict[str, Any]]]], dict[str, int | None]]) -> None:
        """Go back to a `snapshot`; what was in flight of the step is dropped."""
        made, steps = saved
        self.made = {n: deque(q) for n, q in made.items()}
        self.replica_steps = dict(steps)
        self._inbox, self._outbox, self._sent, self._params_in = {}, {}, set(), {}
        self._buckets, self._filling, self._posted, self._landed = None, {}, set(), {}
        self.pieces.clear()
        for handles in self._hooks.values():
            for handle in handles:
                handle.remove()
        self._hooks = {}
