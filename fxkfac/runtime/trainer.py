"""Trainer: one rank's part of a compiled run: its stage copies, its program, and the preconditioner state its ops
act on.

One class serves one device (`mesh=None`: a 1x1 layout, no process group) and every mesh. A step
shards the global mini-batch over the replicas and micro-batches, then the interpreter runs the ops the
plan gives this rank for that step (`Trainer.ops_at`); preconditioner ops act on the family's runtime. Nothing here
decides what runs: `fxkfac.compile` resolved the programs (planner/problem/lowering.py, planner/search/attempt.py).
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from fxkfac.capture import Captured, input_signature, normalize_inputs
from fxkfac.checkpoint import Checkpointing, digest
from fxkfac.config import KLClipScope, PipelineOptions, StepAgreement
from fxkfac.errors import CheckpointError, ConfigError, NonFiniteError
from fxkfac.passes.split_stages import SplitResult
from fxkfac.planner.plan import Plan
from fxkfac.planner.problem import LayerDistribution, LayerTiming, Op, OpKind, Programs, ScheduleKind
from fxkfac.planner.problem.buckets import bucketable
from fxkfac.planner.problem.ir import ops_at
from fxkfac.planner.problem.lowering import ranks_of_stages
from fxkfac.planner.problem.schedules import stages_of_rank
from fxkfac.preconditioner import Family, RefreshState, gradient_parts
from fxkfac.progress import Display, training_progress
from fxkfac.runtime.host_memory import keep_freed_host_memory
from fxkfac.runtime.interpreter import EVAL_HANDLERS, Interpreter, StepContext, forward_only, local_loss
from fxkfac.runtime.mesh import MeshLayout, StageCopies
from fxkfac.runtime.p2p import TagSpace, Transport, collective_device
from fxkfac.runtime.param_state import (
    check_model_state,
    load_model_state,
    optimizer_state,
    param_names,
    parse_optimizer_state,
)
from fxkfac.runtime.precision import LossScale
from fxkfac.runtime.preconditioning import PreconditionerRuntime
from fxkfac.runtime.stage import StageRunner
from fxkfac.runtime.step_end import StepEnd, StepLoss
from fxkfac.runtime.streaming import ParamShape, StreamedLayers
from fxkfac.runtime.sync import GradSync, holder_sets, named_groups
from fxkfac.runtime.tapped_runner import TappedRunner
from fxkfac.runtime.timeline import Recorder, as_timeline, gather_timelines
from fxkfac.shapes import Recapture, ShapeVariant, Signature, batch_size, check_signature, elements
from fxkfac.show import chrome_trace

__all__ = ["RunSpec", "Trainer", "OptimizerFactory", "default_optimizer", "plain_sgd", "shard_microbatches"]

log = logging.getLogger(__name__)

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def default_optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW with lr 1e-3: the base optimizer when none is given."""
    return torch.optim.AdamW(params, lr=1e-3)


def plain_sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """SGD with lr 1e-3 and nothing else: the base optimizer of a family that makes the whole direction."""
    return torch.optim.SGD(params, lr=1e-3)


def _check_base(optimizer: torch.optim.Optimizer | None, family: Family | None) -> None:
    """ConfigError when a family that makes the whole update direction would get momentum or weight decay twice."""
    if optimizer is None or family is None or not family.full_direction:
        return
    extra = [
        f"{key}={group[key]}"
        for group in optimizer.param_groups
        for key in ("momentum", "weight_decay")
        if group.get(key)
    ]
    if type(optimizer) is not torch.optim.SGD or extra:
        raise ConfigError(
            f"{family.name} makes the whole update direction (grafting, momentum and weight decay "
            f"included), so its base optimizer must be torch.optim.SGD(params, lr) without momentum "
            f"or weight decay; got {type(optimizer).__name__} {' '.join(extra)}".rstrip()
        )


def shard_microbatches(tree: Any, batch: int, W: int, dp: int, N: int) -> list[Any]:
    """Replica `dp`'s contiguous shard of the global batch, split into N micro-batches along dim 0.

    Tensors whose dim 0 is the global `batch` are split; other leaves go to every micro-batch unchanged.
    """
    if batch % (W * N):
        raise ConfigError(
            f"microbatches={N} x {W} replica(s) does not divide the mini-batch of {batch} samples (every "
            f"micro-batch of a step has one shape); use batch sizes that are multiples of {W * N}, drop an "
            "incomplete last batch (DataLoader(drop_last=True)), or use another number of micro-batches"
        )
    size = batch // (W * N)
    leaves, spec = pytree.tree_flatten(tree)
    start = dp * N * size
    parts = []
    for m in range(N):
        lo = start + m * size
        chunk = [
            leaf[lo : lo + size] if isinstance(leaf, Tensor) and leaf.dim() > 0 and leaf.shape[0] == batch else leaf
            for leaf in leaves
        ]
        parts.append(pytree.tree_unflatten(chunk, spec))
    return parts


@dataclass(frozen=True)
class RunSpec:
    """What `fxkfac.compile` resolved for a run, the same on every rank: layout, split, programs, family."""

    layout: MeshLayout
    kind: ScheduleKind
    N: int
    v: int
    captured: Captured
    """The model captured once at the micro-batch shape (its layers, input structure and output spec)."""
    split: SplitResult
    global_batch: int
    signature: tuple
    """Shapes and dtypes of the global mini-batch's tensors: every step must match them."""
    programs: Programs
    startup: Programs
    plan: Plan | None
    family: Family | None
    """The preconditioner family (None: the base optimizer alone)."""
    units: Mapping[str, Any]
    """The family's units by name (K-FAC: its layers; Shampoo: parameters)."""
    stage_units: Mapping[int, tuple[str, ...]]
    """The names of the units each stage preconditions."""
    timings: Mapping[str, LayerTiming]
    fingerprint: str
    distributions: Mapping[str, LayerDistribution] = field(default_factory=dict)
    """Where each unit's work lives across its stage's copies (absent: COMM-OPT; planner/problem/strategy.py)."""
    recompute: tuple[int, ...] = ()
    """The stages that recompute their forward in their backward (activation checkpointing)."""
    recapture: Recapture | None = None
    """How a step of another input shape gets its stages (None: only `signature` trains; fxkfac/shapes.py)."""


def _runners(
    spec: RunSpec, backend: str | None, autocast_dtype: torch.dtype | None
) -> dict[tuple[int, int], StageRunner]:
    """This rank's stage copies by (stage, pipe), each running its stage graph (a copy of it where the rank holds
    several, so that their parameters are their own) under autocast of `autocast_dtype` (None: full precision)."""
    held = stages_of_rank(spec.kind, spec.layout.D, spec.layout.pp, v=spec.v)
    last = len(spec.split.stages) - 1
    runners = {
        (s, p): StageRunner.build(
            spec.split.stages[s],
            p,
            s == last,
            backend,
            copy=len(held) > 1,
            recompute=s in spec.recompute,
            autocast_dtype=autocast_dtype,
        )
        for s, p in held
    }
    family = spec.family
    if family is not None:  # what a per-layer BWD_W names ("W s0 m1 fc")
        for (s, _), runner in runners.items():
            runner.layer_params = {n: family.params_of(spec.units[n]) for n in spec.stage_units.get(s, ())}
    return runners


def _check_precision(options: PipelineOptions, family: Family | None, barrier_free: bool) -> None:
    """ConfigError where float16's loss scale or gradient clipping cannot be what the user asked: both need every
    rank to read one world verdict per step, and clipping before preconditioning needs a preconditioner linear in
    the gradient."""
    wants = [
        what
        for what, on in (
            ("autocast_dtype=torch.float16", options.scales_loss),
            ("max_grad_norm", options.max_grad_norm),
        )
        if on
    ]
    if wants and barrier_free:
        raise ConfigError(
            f"PipelineOptions.{' and '.join(wants)} needs one world verdict per step (the loss scale and the global "
            "gradient norm must be the same on every rank): use KFACConfig.kl_clip_scope='global' and "
            "PipelineOptions.step_agreement=StepAgreement.WORLD"
        )
    if options.max_grad_norm is not None and family is not None and family.full_direction:
        raise ConfigError(
            f"PipelineOptions.max_grad_norm is not supported with {family.name}: its statistics, momentum and "
            "grafting are not linear in the gradient, so the clip cannot be applied after its preconditioning; "
            "use K-FAC or the base optimizer alone, or max_grad_norm=None"
        )


def _transport(spec: RunSpec, timeout: float) -> Transport:
    """This rank's sends, receives and collectives, each wait bounded by `timeout` seconds."""
    max_tensors = max(len(s.inputs) + len(s.outputs) for s in spec.split.stages)
    tags = TagSpace(len(spec.split.stages), spec.N, max_tensors)
    return Transport(spec.layout.rank, spec.layout.world_size, tags, timedelta(seconds=timeout), collective_device())


def _streamed_layers(spec: RunSpec, rank: int, local: Sequence[int]) -> StreamedLayers:
    """The layers `rank`'s programs stream (docs/STREAMED_APPLY.md): those whose replicas it sends (SEND_REPLICA) and
    those of stages it does not hold that it applies (an APPLY naming the layer), with their parameters' shapes."""
    family = spec.family
    assert family is not None, "only a family's programs stream layers"
    ops = [op for programs in (spec.programs, spec.startup) for step in programs.get(rank, []) for op in step]
    owned = frozenset(op.layer for op in ops if op.kind is OpKind.SEND_REPLICA and op.layer is not None)
    replicas: dict[str, tuple[ParamShape, ...]] = {}
    for op in ops:
        if op.kind is OpKind.APPLY and op.stage is not None and op.stage not in local and op.layer is not None:
            gm = spec.split.stages[op.stage].gm
            params = {n: gm.get_parameter(n) for n in family.params_of(spec.units[op.layer])}
            replicas[op.layer] = tuple(ParamShape(n, tuple(p.shape), p.dtype) for n, p in params.items())
    programs = {r: [*spec.startup.get(r, []), *steps] for r, steps in spec.programs.items()}
    tags = {name: i for i, name in enumerate(spec.units)}
    return StreamedLayers(tags, owned, replicas, bucketable(programs))


class Trainer(Checkpointing):
    """One rank of a run: `step(inputs, targets) -> loss` over the global mini-batch, `evaluate(inputs, targets)`,
    state dicts, traces.

    The step loss is the mean over all N*W micro-batches of ``loss_fn(outputs_m, targets_m)`` (the same on
    every rank). A step whose loss or gradients are NaN/Inf on any rank is skipped on every rank:
    parameters, optimizer, preconditioner state and the step counter stay as they were, and `skipped_steps`
    counts it; more than `max_skipped_steps` skips in a row raise NonFiniteError.
    """

    def __init__(
        self,
        spec: RunSpec,
        *,
        loss_fn: Callable[[Any, Any], Tensor],
        optimizer: OptimizerFactory,
        options: PipelineOptions,
        backend: str | None,
    ) -> None:
        self.spec = spec
        self.layout = spec.layout
        self.plan = spec.plan
        self.loss_fn = loss_fn
        self.options = options
        self.units: list[Any] = list(spec.units.values())
        """The units the family preconditions (K-FAC: its layers; Shampoo: parameters); empty without one."""
        self.timings = dict(spec.timings)
        self.runners = _runners(spec, backend, options.autocast_dtype)
        if any(r.device.type == "cpu" for r in self.runners.values()):
            keep_freed_host_memory()  # [Note: host memory] in fxkfac/runtime/host_memory.py
        self.loss_scale = LossScale.build(options.loss_scaling, options.scales_loss)
        """float16's dynamic loss scale ([Note: mixed precision] in fxkfac/runtime/precision.py)."""
        self._unscale_gradients()
        self.transport = _transport(spec, options.timeout)
        holders = ranks_of_stages(spec.kind, self.layout.D, self.layout.W, spec.v)
        owner = {n: s for s, names in spec.stage_units.items() for n in names if n in spec.split.shared_params}
        self.sync = GradSync.build(
            self.layout.rank,
            self.layout.world_size,
            holder_sets([st.params for st in spec.split.stages], holders),
            spec.split.shared_params,
            list(self.runners.values()),
            {n: (s, min(holders[s])) for n, s in owner.items()},
        )
        self.sync.broadcast_weights(self.transport)
        if options.max_grad_norm is not None:
            self.sync.sqnorms = []
        self.interpreter = Interpreter()
        self.evaluator = Interpreter(EVAL_HANDLERS)
        """Runs `evaluate`'s forward-only programs."""
        self.step_end = self._step_end(holders)
        _check_precision(options, spec.family if spec.units else None, self.step_end.barrier_free)
        self.preconditioning = self._preconditioning(holders) if spec.units else None
        params = [p for r in self.runners.values() for p in r.module.parameters()]
        self.optimizer = optimizer(params) if params else None  # a stage of only activations holds none
        _check_base(self.optimizer, spec.family if spec.units else None)
        self.timeline = Recorder(self.layout.rank, enabled=options.record_timeline)
        self.shapes: OrderedDict[Signature, ShapeVariant] = OrderedDict()
        """Input shapes other than the example's, captured so far, least recently used first."""
        self.steps = 0
        self.skipped_steps = 0
        self._skips_in_a_row = 0
        self.progress = training_progress(options.progress, self.layout.rank)
        log.info(
            "rank %d: stages %s of %s (D=%d, W=%d, N=%d), %d preconditioned units here, program period %d",
            self.layout.rank,
            sorted(self.runners),
            spec.kind.value,
            self.layout.D,
            self.layout.W,
            spec.N,
            len(self.layer_states),
            len(spec.programs[self.layout.rank]),
        )

    def _preconditioning(self, holders: Mapping[int, tuple[int, ...]]) -> PreconditionerRuntime:
        """Tap this rank's stage copies and install the family's handlers on the interpreter."""
        spec = self.spec
        if spec.family is None:
            raise AssertionError("a preconditioner runtime without a family")
        stage_of = {name: s for s, names in spec.stage_units.items() for name in names}
        local = sorted({s for s, _ in self.runners})
        if gradient_parts(spec.family) != set(spec.family.parts):  # some part is fed by captures: tap the stages
            for key, runner in list(self.runners.items()):
                held = {n: spec.units[n] for n in spec.stage_units[runner.stage]}
                scale = self.loss_scale if self.loss_scale.enabled else None
                self.runners[key] = TappedRunner.wrap(runner, held, spec.family, scale)
        streamed = _streamed_layers(spec, self.layout.rank, local)
        groups = {s: StageCopies(holders[s], self.sync.group_of(holders[s])) for s in local}
        groups |= {stage_of[n]: StageCopies(holders[stage_of[n]], None) for n in streamed.replicas}
        mine = {n: spec.units[n] for s in local for n in spec.stage_units[s]}
        mine |= {n: spec.units[n] for n in streamed.replicas}
        subgroups = named_groups([spec.programs, spec.startup], self.layout.rank, self.layout.world_size)
        runtime = PreconditionerRuntime(
            spec.family,
            mine,
            {n: stage_of[n] for n in mine},
            self.timings,
            groups,
            self.layout.rank,
            spec.N * self.layout.W,
            spec.global_batch,
            self.step_end,
            spec.distributions,
            subgroups,
            streamed,
        )
        runtime.install(self.interpreter)
        return runtime

    def _step_end(self, ranks_of_stage: Mapping[int, tuple[int, ...]]) -> StepEnd:
        """How this rank's steps end: with a preconditioner as its KL-clip scope says (K-FAC's option; other
        families clip globally), without one as `PipelineOptions.step_agreement` says (COPIES: over the agreement
        set, as the STAGE scope with nothing to clip). Collective: makes the process groups it needs."""
        agreement = self.options.step_agreement
        if self.spec.units and agreement is not StepAgreement.WORLD:
            raise ConfigError(
                f"PipelineOptions.step_agreement={agreement.name} is for runs without a "
                "preconditioner; with one, KFACConfig.kl_clip_scope (stage or stale) ends a step "
                "without a world barrier"
            )
        if self.spec.units and self.spec.family is not None:
            scope = self.spec.family.kl_clip_scope
        else:
            scope = KLClipScope.STAGE if agreement is StepAgreement.COPIES else KLClipScope.GLOBAL
        return StepEnd.build(
            scope, self.transport, self.sync.holders.values(), ranks_of_stage, self.options.max_grad_norm
        )

    def _unscale_gradients(self) -> None:
        """Under float16's loss scale: divide every parameter's gradient by the scale as autograd hands it over
        (before it is accumulated or read: [Note: mixed precision] in fxkfac/runtime/precision.py)."""
        if not self.loss_scale.enabled:
            return
        for runner in self.runners.values():
            for param in runner.module.parameters():
                param.register_hook(self.loss_scale.hook)

    @property
    def layer_states(self) -> dict[str, RefreshState]:
        """This rank's layer states of the family by layer name (empty without a preconditioner)."""
        return self.preconditioning.states if self.preconditioning is not None else {}

    def ops_at(self, step: int) -> list[Op]:
        """The ops this rank runs at global step `step`: its start-up steps, then its program's period."""
        return ops_at(self.spec.programs, self.spec.startup, self.layout.rank, step)

    def _use_shape(self, inputs: tuple[Any, ...]) -> int:
        """Make every local stage copy run at the mini-batch's input shape, capturing the model at a new one
        (bounded by `PipelineOptions.shape_cache_size`); returns the mini-batch's samples."""
        got, spec = input_signature(inputs), self.spec
        if got == spec.signature:
            self._activate(None, spec.global_batch, None)
            return spec.global_batch
        check_signature(got, spec.signature)
        if spec.recapture is None or self.options.shape_cache_size == 0:
            raise ConfigError(
                f"inputs have shapes {_words(got)}, but the model was compiled for example_inputs of "
                f"{_words(spec.signature)} and PipelineOptions.shape_cache_size=0; pass mini-batches shaped like "
                "example_inputs or allow other shapes with shape_cache_size >= 1"
            )
        variant = self.shapes.get(got)
        if variant is None:
            variant = self._capture_shape(inputs, got)
        self.shapes.move_to_end(got)
        self._activate(got, variant.batch, variant)
        while len(self.shapes) > self.options.shape_cache_size:
            old, _ = self.shapes.popitem(last=False)
            for runner in self.runners.values():
                runner.forget_shape(old)
        return variant.batch

    def _capture_shape(self, inputs: tuple[Any, ...], got: Signature) -> ShapeVariant:
        """The model captured at a new input shape (fxkfac/shapes.py), kept; logs how its cost differs from the
        example's, which the plan was made for."""
        spec = self.spec
        assert spec.recapture is not None, "only a run that can recapture captures a new shape"
        batch = batch_size(inputs)
        micro = shard_microbatches(inputs, batch, self.layout.W, 0, spec.N)[0]
        variant = spec.recapture(micro, got, batch)
        self.shapes[got] = variant
        ratio = elements(got) / max(elements(spec.signature), 1)
        log.log(
            logging.WARNING if ratio > MUCH_MORE_WORK else logging.INFO,
            "rank %d: captured the model for inputs %s (%.0f%% of example_inputs' %s elements); the plan made "
            "for example_inputs is kept%s",
            self.layout.rank,
            _words(got),
            100 * ratio,
            _words(spec.signature),
            ": its bubbles and memory were sized for less work, compile with example_inputs of the largest shape"
            if ratio > MUCH_MORE_WORK
            else "",
        )
        return variant

    def _activate(self, key: Signature | None, batch: int, variant: ShapeVariant | None) -> None:
        """Point every local stage copy at shape `key`'s graph (None: the example's) and its captures at its
        batch."""
        for runner in self.runners.values():
            graph = variant.split.stages[runner.stage] if variant is not None else None
            if isinstance(runner, TappedRunner):
                runner.use_shape(key, graph, variant.stage_units[runner.stage] if variant is not None else None)
                runner.grad_scale = batch / self.spec.global_batch
            else:
                runner.use_shape(key, graph)

    def step(self, inputs: Any, targets: Any) -> float | StepLoss:
        """One optimizer step over one global mini-batch; returns the step loss (the same on every rank): a float,
        or on a mesh whose steps end without a world barrier (KLClipScope STAGE or STALE; without a preconditioner,
        StepAgreement.COPIES) a StepLoss, which waits for the loss's world sum when read."""
        ctx = self._context(inputs, targets)
        ops = self.ops_at(self.steps)
        if self.preconditioning is not None:
            for runner in self.runners.values():
                if isinstance(runner, TappedRunner):
                    runner.begin_step(self.preconditioning.modes_at(self.steps, list(runner.layers)), ops)
        with self._one_cast_per_step():
            self.interpreter.run(ops, ctx, self.timeline)
        loss = self._loss(ctx)
        self.loss_scale.update(bool(ctx.skipped))
        if ctx.skipped:
            self.interpreter.abort(ctx)
            self._skip()
        else:
            self.interpreter.commit(ctx)
            self._skips_in_a_row = 0
            self.steps += 1
        if self.progress.display is not Display.OFF:  # reading a StepLoss waits for its sum: only to show it
            self.progress.update(self.steps, float(loss))
        return loss

    def _context(self, inputs: Any, targets: Any) -> StepContext:
        """The context of a step (or an evaluation) over one global mini-batch: this replica's micro-batches of it,
        its stages set to run at its shape (`_use_shape`)."""
        inputs = normalize_inputs(inputs)
        batch = self._use_shape(inputs)
        spec, W = self.spec, self.layout.W
        flat = spec.captured.flat_inputs(inputs)  # flattened once, then sharded: a pytree walk per step, not per mb
        shards = shard_microbatches((flat, targets), batch, W, self.layout.dp, spec.N)
        return StepContext(
            rank=self.layout.rank,
            step=self.steps,
            runners=self.runners,
            transport=self.transport,
            sync=self.sync,
            optimizer=self.optimizer,
            inputs=[args for args, _ in shards],
            targets=[t for _, t in shards],
            loss_fn=self.loss_fn,
            out_spec=spec.captured.out_spec,
            scale=1.0 / (spec.N * W),
            step_end=self.step_end,
            loss_scale=self.loss_scale.scale,
        )

    def evaluate(self, inputs: Any, targets: Any) -> float:
        """The model's loss on one global mini-batch in eval mode (dropout off, batch norm by its running
        statistics), reduced as a step's: the mean over the N*W micro-batches of ``loss_fn``, the same on every rank.

        Collective: every rank calls it between steps. The forward half of this rank's program runs over the
        training's stages, ranks and transport (`forward_only`), each stage's eval-mode graph made on the first
        call (`StageRunner.infer`); no capture, statistic, gradient, optimizer or preconditioner state, step count or
        random draw changes, so training goes on as if it had not run."""
        ctx = self._context(inputs, targets)
        with torch.no_grad():
            self.evaluator.run(forward_only(self.spec.programs[self.layout.rank][0]), ctx)
            total = local_loss(ctx).to(torch.float64).reshape(1)
            self.transport.sum_at(total, range(self.layout.world_size), 0, "evaluate (loss sum)")
            self.transport.flush()
        return float(total)

    def _one_cast_per_step(self) -> Any:
        """Under autocast, a context around the step (autocast itself, off) that keeps autocast's cache of its
        weight casts alive from one micro-batch's forward to the next, so each weight is cast once per step
        rather than once per micro-batch (eager stages; the cache empties when the step ends, after OPT_STEP)."""
        if self.options.autocast_dtype is None:
            return contextlib.nullcontext()
        device = next(iter(self.runners.values())).device
        return torch.autocast(device.type, enabled=False)

    def _loss(self, ctx: StepContext) -> float | StepLoss:
        """The step loss over the world: the float OPT_STEP's world sum made, or under a barrier-free
        KL-clip scope a StepLoss whose sum runs on while the next step trains ([Note: KL-clip scope] in
        fxkfac/runtime/step_end.py)."""
        if ctx.loss is not None:
            return ctx.loss
        assert self.step_end.barrier_free, "only a barrier-free step end leaves the loss to be summed here"
        return self.step_end.loss(local_loss(ctx))

    def _skip(self) -> None:
        """Count a skipped step; NonFiniteError when more than `max_skipped_steps` were skipped in a row."""
        self.skipped_steps += 1
        self._skips_in_a_row += 1
        log.warning(
            "rank %d: step %d skipped: loss or gradients are NaN/Inf on some rank (%d skipped so far)%s",
            self.layout.rank,
            self.steps,
            self.skipped_steps,
            f"; float16 loss scale backed off to {self.loss_scale.scale:g}" if self.loss_scale.enabled else "",
        )
        limit = self.options.max_skipped_steps
        if limit is not None and self._skips_in_a_row > limit:
            raise NonFiniteError(
                f"{self._skips_in_a_row} steps in a row had NaN/Inf loss or gradients "
                f"(max_skipped_steps={limit}); the state is that of step {self.steps}: lower the "
                "learning rate, check the data, or raise max_skipped_steps"
            )

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters by canonical FQN (one copy each)."""
        seen: set[str] = set()
        for key in sorted(self.runners):
            for name, param in self.runners[key].module.named_parameters():
                if name not in seen:
                    seen.add(name)
                    yield name, param

    # --- checkpoints ---------------------------------------------------------------------------------

    @property
    def timeout(self) -> timedelta:
        """How long a checkpoint barrier waits for the other ranks."""
        return self.transport.timeout

    def state_dict(self) -> dict[str, Any]:
        """Parameters (one copy per FQN, detached), optimizer state by parameter FQN, counters; under float16 also
        ``loss_scale`` (the scale and its growth tracker, alike on every rank); with a preconditioner also ``kfac``
        (unit states by unit name) and ``inflight`` (refreshes, decompositions and captures held here)."""
        state: dict[str, Any] = {
            "model": {n: p.detach() for n, p in self.named_parameters()},
            "optimizer": optimizer_state(self.optimizer, param_names(self.runners.values())),
            "step": self.steps,
            "skipped_steps": self.skipped_steps,
        }
        if self.loss_scale.enabled:
            state["loss_scale"] = self.loss_scale.state_dict()
        if self.preconditioning is not None:
            state.update(self.preconditioning.state_dict())
            state["inflight"]["captures"] = {
                f"{s}.{p}": r.captures_state()
                for (s, p), r in sorted(self.runners.items())
                if isinstance(r, TappedRunner)
            }
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict` output; every part is checked (CheckpointError) before anything changes."""
        missing = sorted({"model", "optimizer", "step"} - set(state))
        if missing:
            raise CheckpointError(f"trainer state lacks {missing}; it was not written by state_dict()")
        check_model_state(self.runners.values(), state["model"])
        optim = parse_optimizer_state(self.optimizer, param_names(self.runners.values()), state["optimizer"])
        restore_kfac = self._parse_kfac(state) if self.preconditioning is not None else None
        if self.loss_scale.enabled and "loss_scale" in state:
            self.loss_scale.load_state_dict(state["loss_scale"])
        load_model_state(self.runners.values(), state["model"])
        if self.optimizer is not None:
            assert optim is not None, "parse_optimizer_state returns a state for an optimizer"
            self.optimizer.load_state_dict(optim)
        if restore_kfac is not None:
            restore_kfac()
        self.steps = int(state["step"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self._skips_in_a_row = 0

    def _parse_kfac(self, state: Mapping[str, Any]) -> Callable[[], None]:
        """Check the preconditioner part of `state`; returns what installs it."""
        runtime = self.preconditioning
        if runtime is None:
            raise AssertionError("preconditioner state parsed without a preconditioner runtime")
        parsed = runtime.parse_state(state)
        saved = state["inflight"].get("captures")
        tapped = {f"{s}.{p}": r for (s, p), r in self.runners.items() if isinstance(r, TappedRunner)}
        if not isinstance(saved, dict) or set(saved) != set(tapped):
            raise CheckpointError(
                f"checkpoint captures are for stage copies {sorted(saved or {})}, this rank holds "
                f"{sorted(tapped)}; it was written for another layout"
            )
        captures = {key: r.parse_captures(saved[key]) for key, r in tapped.items()}

        def install() -> None:
            runtime.load_parsed(parsed)
            for key, r in tapped.items():
                r.captures = captures[key]

        return install

    def describe_run(self) -> dict[str, Any]:
        """What a checkpoint of this run is made for (JSON): the family, parameters and units its state belongs
        to, and the layout it was written under (see fxkfac/checkpoint.py, [Note: resharding])."""
        spec, layout = self.spec, self.layout
        programs = {str(r): [[str(op) for op in ops] for ops in p] for r, p in sorted(spec.programs.items())}
        return {
            "params": {n: list(p.shape) for st in spec.split.stages for n, p in st.gm.named_parameters()},
            "units": self._unit_shapes(),
            "timings": {n: [t.period, t.curv_step, t.use_offset, t.capture] for n, t in sorted(self.timings.items())},
            "plan": None if spec.plan is None else f"{spec.plan.fingerprint}#{digest(spec.plan.to_dict())}",
            "trainer": spec.family.name if spec.units and spec.family else "plain",
            "mesh": [layout.D, layout.W],
            "schedule": spec.kind.value,
            "microbatches": spec.N,
            "virtual_stages": spec.v,
            "global_batch": spec.global_batch,
            "stages": [list(st.params) for st in spec.split.stages],
            "graph": spec.fingerprint,
            "programs": digest(programs),
        }

    def _unit_shapes(self) -> dict[str, list[list[int]]]:
        """Each preconditioned unit's statistic shapes by part: what its state is made of, whatever the layout."""
        family = self.spec.family
        if family is None:
            return {}
        held = sorted({n for names in self.spec.stage_units.values() for n in names})
        return {n: [list(family.stats_shape(self.spec.units[n], part)) for part in family.parts] for n in held}

    def trace(self, path: str | None = None) -> dict | None:
        """Gather every rank's recorded timeline to rank 0 and return (and write) a Chrome trace."""
        events = gather_timelines(self.timeline, self.layout.world_size)
        return None if events is None else chrome_trace(as_timeline(events), path)


MUCH_MORE_WORK = 1.25
"""A shape with this many times the example's input elements is logged as a warning: the plan did not size for it."""


def _words(signature: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> str:
    """Shapes and dtypes as a user writes them."""
    return ", ".join(f"{list(shape)} {str(dtype).removeprefix('torch.')}" for shape, dtype in signature) or "no tensors"
