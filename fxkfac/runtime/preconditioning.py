"""The runtime of a preconditioner family: the STATS, SYNC_STATS, DECOMP, BCAST, APPLY handlers over the captures
of tapped stage runners (fxkfac/runtime/tapped_runner.py), on one device and on every mesh. The family
(`fxkfac.preconditioner.Family`; K-FAC: fxkfac/kfac/family.py) supplies the math of its parts; this module owns
their life cycle.

[Note: refresh semantics in the runtime] The handlers implement docs/ARCHITECTURE.md's semantics (there
for K-FAC, whose parts are A and B) exactly, whatever step or rank a plan puts each op on (one device runs
the same handlers, with every collective a no-op):
- at step t every local layer with ``t % period == curv_step`` is tapped (fused or deferred) in its
  stage's forward/backward, and a *refresh record* for step t is opened;
- ``STATS s m F layer`` turns micro-batch m's capture into ``A_m`` / ``B_m`` and adds it to the oldest
  open record of the layer (captures wait in FIFOs, so a plan may run curvature steps later);
- ``STATS s F unit`` (no micro-batch) of a part fed by the reduced gradient (Shampoo's L and R) folds the
  step's statistic at *every* step, after the stage's gradient is complete and before its APPLY; at a
  refresh step it also snapshots the folded state into the step's record, which DECOMP decomposes later;
- ``SYNC_STATS s [F] layer`` sums the record's factor over every copy of the stage (dp replicas and
  Chimera's two pipelines) and folds the mean into the running average (a stage held once folds at
  its first DECOMP instead);
- ``DECOMP s F layer`` inverts one factor (damping split as `fxkfac.kfac.inverse.invert` does);
  ``BCAST s F @rR layer`` broadcasts it from rank R to the stage's other copies; once both halves
  are there the layer's inverse is queued to become active at ``t + use_offset``; ``DECOMP s F i/n layer``
  runs piece i of a decomposition the family makes in n (`PiecewiseFamily`), in order, its carry kept in
  the refresh record (and in checkpoints) until the last piece makes the decomposition; a `Family.warm_start`
  family's decomposition starts from the layer's newest preconditioner when its DECOMP runs (not when its
  statistic was snapshot), which a plan made with `Problem.warm_start` makes the previous refresh's, as on one
  device (PipelineError when the previous refresh is not made on the rank by then);
- ``APPLY s`` activates due inverses and preconditions the stage's gradients; an inverse that is due but
  missing is a plan error (PipelineError), never a silent use of an older one;
- a parameter several stages use (tied weights) is a unit of its owner stage alone (planner/problem/costs.py): its
  STATS, APPLY and BCAST_PREC first land the sum of its gradient over those stages, started at each holder's
  ALLREDUCE_GRAD (PipelineError when it has not started), and OPT_STEP gives its other copies the owner's
  direction (`GradSync.send_directions`) before the verdict, so every copy takes the same step;
- OPT_STEP is wrapped: once the gradients are final (collectives settled, tied gradients summed), the
  KL-clip's ``sum <P, G>`` (each stage's share divided by its number of copies) and the NaN/Inf check of the
  step are all-reduced as the family's `KLClipScope` says (GLOBAL: over all ranks; [Note: KL-clip scope] in
  fxkfac/runtime/step_end.py), the K-FAC gradients are scaled by their nu, then the optimizer steps or not.
- a skipped step (NaN/Inf loss or gradients on some rank) leaves no trace: the runtime is an
  interpreter listener, and ``abort_step`` restores the layer states, refresh records, inverse outbox
  and captures as they were when the step began (the single-device trainer's skip, exactly).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from fxkfac.config import KLClipScope
from fxkfac.errors import CheckpointError, PipelineError
from fxkfac.planner.problem import Capture, LayerDistribution, LayerTiming, Op, OpKind
from fxkfac.planner.problem.strategy import grad_workers, keeps_statistics
from fxkfac.preconditioner import (
    Family,
    PiecewiseFamily,
    RefreshState,
    direction_dot,
    fold_gradient,
    gradient_parts,
)
from fxkfac.runtime.apply_pieces import ApplyPieces
from fxkfac.runtime.interpreter import (
    Interpreter,
    StepContext,
    end_gradients,
    local_loss,
    local_nonfinite,
    step_or_skip,
)
from fxkfac.runtime.mesh import StageCopies
from fxkfac.runtime.refresh_record import RefreshRecord
from fxkfac.runtime.step_end import StepEnd
from fxkfac.runtime.streaming import StreamedLayers, Streams
from fxkfac.runtime.sync import TIED_KEY, flat_gradient, grad_key, split_flat
from fxkfac.runtime.tapped_runner import TappedRunner

__all__ = ["StageCopies", "PreconditionerRuntime"]


def _unit_key(name: str, part: str) -> tuple[str, str, str]:
    """The key under which a collective of one part of one layer is in flight (`Transport.settle`)."""
    return ("part", name, part)


def _ignore(_: Tensor) -> None:
    """What the root of a broadcast does with it once sent: nothing (it waits only to free the buffer)."""


class PreconditionerRuntime:
    """A family's state on one rank's stages and the handlers that act on it (see [Note: refresh semantics in
    the runtime])."""

    def __init__(
        self,
        family: Family,
        layers: Mapping[str, Any],
        stage_of: Mapping[str, int],
        timings: Mapping[str, LayerTiming],
        groups: Mapping[int, StageCopies],
        rank: int,
        microbatches_total: int,
        global_batch: int,
        step_end: StepEnd,
        distributions: Mapping[str, LayerDistribution] | None = None,
        subgroups: Mapping[tuple[int, ...], Any] | None = None,
        streamed: StreamedLayers | None = None,
    ) -> None:
        self.family = family
        self.layers = dict(layers)
        self.stage_of = dict(stage_of)
        self.timings = dict(timings)
        self.groups = dict(groups)
        self.rank = rank
        self.total = microbatches_total
        self.n = global_batch
        self.states = {name: family.new_state(layer) for name, layer in self.layers.items()}
        self.gradient_parts = gradient_parts(family)
        where = {n: (distributions or {}).get(n, LayerDistribution()) for n in self.layers}
        self.local = {n for n in self.layers if where[n].strategy.local_factors}
        """Layers whose owner folds the statistics of its own micro-batches (DP-KFAC)."""
        self.workers = {n: grad_workers(self.groups[self.stage_of[n]].ranks, where[n]) for n in self.layers}
        """Each layer's grad workers: the ranks that decompose, hold its preconditioner and apply it."""
        only_gradient = self.gradient_parts == set(family.parts)
        self.keeps = {
            n
            for n in self.layers
            if keeps_statistics(rank, self.groups[self.stage_of[n]].ranks, where[n], only_gradient)
        }
        """Layers whose statistics this rank takes (and whose refreshes it opens)."""
        self.subgroups = dict(subgroups or {})
        """Process groups of the ranks a BCAST or BCAST_PREC names (`Op.group`)."""
        self.refreshes: dict[str, deque[RefreshRecord]] = {name: deque() for name in self.layers}
        self._by_stage = {s: [self.layers[n] for n in self.layers if self.stage_of[n] == s] for s in groups}
        self.step_end = step_end
        """The run's StepEnd, the one its steps' contexts carry (OPT_STEP takes the verdict from the context's): here
        its KL-clip scope, and under STALE the sum a checkpoint keeps."""
        self.clip_groups = dict(stage_of)
        """Each layer's KL-clip group under STAGE: its stage (one device: its stage in the pipelined run it stands
        for, when given; see [Note: KL-clip scope])."""
        self._dots: dict[int, Tensor] = {}
        self._touched: set[int] = set()
        """Stages whose gradients this step preconditioned or received (the KL-clip scales them)."""
        self._outbox: dict[tuple[str, str], deque[Any]] = {}
        """Decompositions this rank made for a stage with several copies, waiting for their BCAST."""
        self._at_begin: Any = None
        """The state `begin_step` remembered, restored by `abort_step`."""
        self.streams = Streams(self, streamed or StreamedLayers())
        """The layers this rank hands to a helper or preconditions for their owner (fxkfac/runtime/streaming.py)."""
        self.pieces = ApplyPieces(rank)
        """The APPLYs of this rank's own units in flight between their pieces (``APPLY s i/n unit``)."""

    def install(self, interpreter: Interpreter) -> None:
        """Register the refresh handlers and the KL-clipping OPT_STEP on `interpreter`."""
        interpreter.register(OpKind.STATS, self.stats)
        interpreter.register(OpKind.SYNC_STATS, self.sync_stats)
        interpreter.register(OpKind.DECOMP, self.decomp)
        interpreter.register(OpKind.BCAST, self.bcast)
        interpreter.register(OpKind.APPLY, self.apply)
        interpreter.register(OpKind.BCAST_PREC, self.bcast_prec)
        interpreter.register(OpKind.OPT_STEP, self.opt_step, self.post_step_end)
        self.streams.install(interpreter)
        interpreter.listeners.append(self)

    def _refreshing(self, step: int, layer_names: Sequence[str]) -> list[str]:
        """The layers among `layer_names` whose refresh step `step` is."""
        return [n for n in layer_names if step % self.timings[n].period == self.timings[n].curv_step]

    def modes_at(self, step: int, layer_names: Sequence[str]) -> dict[str, Capture]:
        """The layers among `layer_names` that step `step` taps, with their capture mode (none when every part
        is fed by the gradient)."""
        if self.gradient_parts == set(self.family.parts):
            return {}
        return {n: self.timings[n].capture for n in self._refreshing(step, layer_names) if n in self.keeps}

    def open_refreshes(self, step: int) -> None:
        """Open a refresh record at `step` for every layer whose statistics this rank takes that refreshes then (none
        for a family without parts: Muon has nothing to refresh)."""
        if not self.family.parts:
            return
        for name in self._refreshing(step, sorted(self.keeps)):
            self.refreshes[name].append(RefreshRecord(step, counts=dict.fromkeys(self.family.parts, 0)))

    # --- handlers -------------------------------------------------------------------------------

    def _layers_of(self, op: Op) -> list[str]:
        if op.layer is not None:
            if op.layer not in self.layers:
                raise PipelineError(
                    f"rank {self.rank}: '{op}' names a layer this rank does not hold; the plan "
                    f"was made for another graph or split (local layers: {sorted(self.layers)})"
                )
            return [op.layer]
        return [layer.name for layer in self._by_stage.get(op.stage, [])] if op.stage is not None else []

    def _parts_of(self, op: Op) -> tuple[str, ...]:
        if op.part is None:
            return self.family.parts
        if op.part not in self.family.parts:
            raise PipelineError(
                f"rank {self.rank}: '{op}' names part {op.part}, but {self.family.name} has parts "
                f"{self.family.parts}: the plan was made for another preconditioner"
            )
        return (op.part,)

    def _record(self, name: str, op: Op, ready: Any) -> RefreshRecord:
        for record in self.refreshes[name]:
            if ready(record):
                return record
        raise PipelineError(
            f"rank {self.rank}: '{op}' has no refresh of {name} to act on: the plan "
            f"does not match the layer's timing {self.timings[name]}"
        )

    def stats(self, ctx: StepContext, op: Op) -> None:
        """Add micro-batch `op.mb`'s statistic of the part(s) to the layer's open refresh; without a micro-batch,
        fold the step's statistic of gradient-fed parts."""
        if op.mb is None:
            self._gradient_stats(ctx, op)
            return
        runner = ctx.runner(op)
        if not isinstance(runner, TappedRunner):
            raise AssertionError("STATS of a micro-batch on a runner without captures")
        for name in self._layers_of(op):
            layer, mode = self.layers[name], self.timings[name].capture
            for part in self._parts_of(op):
                if part in self.gradient_parts:
                    raise PipelineError(
                        f"rank {self.rank}: '{op}' names micro-batch {op.mb}, but part {part} "
                        "is fed by the reduced gradient: its STATS takes no micro-batch"
                    )
                ctx.transport.settle(_unit_key(name, part))
                raw = runner.take(name, part, op.mb, op)
                value = self.family.statistic(layer, part, mode, raw, self.n)
                record = self._record(name, op, lambda r, p=part: p not in r.folded)
                record.sums[part] = value if part not in record.sums else record.sums[part] + value
                record.counts[part] += 1

    def _gradient_stats(self, ctx: StepContext, op: Op) -> None:
        """Fold the step's gradient statistic of each gradient-fed part; at a refresh step, snapshot the state
        into the step's record for its DECOMP."""
        if op.stage is None:
            raise AssertionError("STATS without a stage")
        runner = ctx.stage_runner(op.stage)
        ctx.transport.settle(grad_key(op.stage))
        self._settle_tied(ctx, self._layers_of(op), op)
        for name in self._layers_of(op):
            for part in self._parts_of(op):
                if part not in self.gradient_parts:
                    raise PipelineError(
                        f"rank {self.rank}: '{op}' names no micro-batch, but part {part} of "
                        f"{self.family.name} is fed by a capture per micro-batch"
                    )
                ctx.transport.settle(_unit_key(name, part))
                state = self.states[name]
                fold_gradient(self.family, self.layers[name], state, part, runner.param(name), self.n)
                record = next((r for r in self.refreshes[name] if r.step == ctx.step), None)
                if record is not None:
                    record.snapshots[part] = state.snapshot()
                    self._mark_folded(name, part, record)

    def folded_elsewhere(self, step: int, name: str) -> None:
        """A streamed unit's state after step `step`'s folds came back from its helper (fxkfac/runtime/streaming.py,
        installed in its state): at its refresh step, snapshot it into the step's record for the DECOMPs, as the
        STATS that fold it here would."""
        record = next((r for r in self.refreshes[name] if r.step == step), None)
        if record is None:
            return
        for part in sorted(self.gradient_parts, key=self.family.parts.index):
            record.snapshots[part] = self.states[name].snapshot()
            self._mark_folded(name, part, record)

    def sync_stats(self, ctx: StepContext, op: Op) -> None:
        """Start summing the refresh's statistic(s) over every copy of the stage; once summed (when a reader
        settles the part: [Note: collectives in flight]) they are folded into the running ones."""
        for name in self._layers_of(op):
            group = self.groups[self.stage_of[name]]
            for part in self._parts_of(op):
                ctx.transport.settle(_unit_key(name, part))
                record = self._record(name, op, lambda r, p=part: p not in r.folded)
                shape = self.family.stats_shape(self.layers[name], part)
                local = record.sums.get(part)
                flat = torch.zeros(math.prod(shape) + 1, dtype=getattr(torch, self.family.stats_dtype))
                if local is not None:
                    flat[:-1] = local.reshape(-1)
                flat[-1] = record.counts[part]

                def fold(
                    summed: Tensor,
                    name: str = name,
                    part: str = part,
                    record: RefreshRecord = record,
                    shape: tuple[int, ...] = shape,
                ) -> None:
                    record.sums[part] = summed[:-1].view(shape)
                    record.counts[part] = int(round(float(summed[-1])))
                    self._fold(name, part, record, op)

                if len(group.ranks) > 1:
                    ctx.transport.defer(
                        _unit_key(name, part), ctx.transport.start_all_reduce(flat, group.group, str(op)), fold
                    )
                else:
                    fold(flat)

    def _fold(self, name: str, part: str, record: RefreshRecord, op: Op) -> None:
        copies = len(self.groups[self.stage_of[name]].ranks)
        expected = self.total // copies if name in self.local else self.total
        if record.counts[part] != expected:
            raise PipelineError(
                f"rank {self.rank}: '{op}' folds {part} of {name} from {record.counts[part]} "
                f"micro-batches, expected {expected}: the plan lacks STATS or SYNC_STATS ops"
            )
        self.family.fold(self.states[name], part, record.sums.pop(part) / record.counts[part])
        self._mark_folded(name, part, record)

    def _mark_folded(self, name: str, part: str, record: RefreshRecord) -> None:
        """`part` of the refresh is folded; the layer's refresh count grows once every part is."""
        record.folded.add(part)
        if record.folded == set(self.family.parts):
            self.states[name].refreshes += 1
            if self.rank not in self.workers[name]:  # folded for the replicas' sake; another rank decomposes
                self.refreshes[name].remove(record)

    def decomp(self, ctx: StepContext, op: Op) -> None:
        """Decompose one part (folding it first when the stage has a single copy); piece i of n (`op.piece`) runs
        the family's piece i, and the last piece makes the decomposition."""
        for name in self._layers_of(op):
            for part in self._parts_of(op):
                ctx.transport.settle(_unit_key(name, part))
                record = self._record(name, op, lambda r, p=part: p not in r.halves)
                if self.family.warm_start:
                    self._check_warm_start(ctx, name, record, op)
                if part in self.gradient_parts and part not in record.folded:
                    raise PipelineError(
                        f"rank {self.rank}: '{op}' decomposes {part} of {name} refreshed at step "
                        f"{record.step} before that step's STATS folded it: the plan orders them "
                        "wrongly"
                    )
                if part not in record.folded:
                    self._fold(name, part, record, op)
                live, snapshot = self.states[name], record.snapshots.get(part)
                state = live if snapshot is None else snapshot.with_preconditioners_of(live)
                try:
                    if op.piece is not None and not self._piece(name, part, record, state, op):
                        continue
                    half = (
                        self.family.decompose(self.layers[name], state, part)
                        if op.piece is None
                        else record.carries.pop(part)[1]
                    )
                except ValueError as e:
                    raise PipelineError(f"rank {self.rank}: '{op}': {e}") from e
                record.halves[part] = half
                if len(self.workers[name]) > 1:
                    self._outbox.setdefault((name, part), deque()).append(half)
                self._maybe_combine(name)

    def _check_warm_start(self, ctx: StepContext, name: str, record: RefreshRecord, op: Op) -> None:
        """PipelineError unless every earlier refresh of the layer is made here once its broadcasts in flight
        settle: the decomposition starts from the previous refresh's preconditioner, as on one device."""
        if self.refreshes[name][0] is not record:
            self.settle_layer(ctx, name)
        if self.refreshes[name][0] is not record:
            raise PipelineError(
                f"rank {self.rank}: '{op}' starts {name}'s refresh of step {record.step} before its refresh of "
                f"step {self.refreshes[name][0].step} is made here, but {self.family.name}'s decompositions start "
                "from the previous one (Family.warm_start): the plan was made without Problem.warm_start"
            )

    def _piece(self, name: str, part: str, record: RefreshRecord, state: RefreshState, op: Op) -> bool:
        """Run piece i of n (`op.piece`) of the part's decomposition into `record.carries`; True after the last
        (the carry is then the decomposition). PipelineError when the family makes it in another number of
        pieces or the plan runs the pieces out of order."""
        assert op.piece is not None, "only a DECOMP piece runs here"
        index, count = op.piece
        family = self.family
        made_in = family.decomp_pieces if isinstance(family, PiecewiseFamily) else 1
        if made_in != count or not isinstance(family, PiecewiseFamily):
            raise PipelineError(
                f"rank {self.rank}: '{op}' runs a decomposition in {count} pieces, the {family.name} "
                f"family makes it in {made_in} (KFACConfig.split_inverse, "
                "ShampooConfig.newton_pieces): the plan was made for another configuration"
            )
        done, carry = record.carries.get(part, (0, None))
        if index != done:
            raise PipelineError(
                f"rank {self.rank}: '{op}' runs piece {index} of {part} of {name} refreshed at step "
                f"{record.step} after {done} of its pieces: the plan orders them wrongly"
            )
        record.carries[part] = (index + 1, family.decompose_piece(self.layers[name], state, part, index, carry))
        return index == count - 1

    def _group(self, op: Op, stage: int) -> Any:
        """The process group a broadcast reaches: the ranks it names, else every copy of the stage."""
        if op.group is None:
            return self.groups[stage].group
        if op.group not in self.subgroups:
            raise PipelineError(
                f"rank {self.rank}: '{op}' names ranks {list(op.group)}, for which no process group "
                "was made: the program was not part of the plan the trainer was built with"
            )
        return self.subgroups[op.group]

    def bcast(self, ctx: StepContext, op: Op) -> None:
        """Start broadcasting one part's decomposition from rank `op.root` to the layer's other grad workers; a
        receiver takes it when a reader settles the part ([Note: collectives in flight])."""
        if op.root is None:
            raise PipelineError(f"'{op}' needs the root rank (@rN)")
        for name in self._layers_of(op):
            group, layer = self._group(op, self.stage_of[name]), self.layers[name]
            for part in self._parts_of(op):
                ctx.transport.settle(_unit_key(name, part))
                if op.root == self.rank:
                    outbox = self._outbox.get((name, part))
                    if not outbox:
                        raise PipelineError(
                            f"rank {self.rank}: '{op}' broadcasts a decomposition this rank has not "
                            "computed: the plan lacks the DECOMP before it"
                        )
                    flat = self.family.pack(layer, part, outbox.popleft())
                else:
                    flat = self.family.pack(layer, part, None)
                pending = ctx.transport.start_broadcast(flat, op.root, group, str(op))
                if op.root == self.rank:
                    ctx.transport.defer(_unit_key(name, part), pending, _ignore)
                    continue
                record = self._record(name, op, lambda r, p=part: p not in r.halves)

                def take(received: Tensor, name: str = name, part: str = part, record: RefreshRecord = record) -> None:
                    record.halves[part] = self.family.unpack(self.layers[name], part, received)
                    self._maybe_combine(name)

                ctx.transport.defer(_unit_key(name, part), pending, take)

    def _maybe_combine(self, name: str) -> None:
        """Queue the layer's preconditioner once every part of its oldest refresh is decomposed."""
        queue = self.refreshes[name]
        while queue and set(queue[0].halves) == set(self.family.parts):
            record = queue.popleft()
            made = self.family.combine(self.layers[name], self.states[name], record.halves)
            self.states[name].set_pending(made, record.step + self.timings[name].use_offset)
            if name in self.streams.owned:
                self.streams.made.setdefault(name, deque()).append((record.step, dict(record.halves)))

    def apply(self, ctx: StepContext, op: Op) -> None:
        """Activate due preconditioners and precondition stage `op.stage`'s gradients (of `op.layer` alone when it
        names one); add their share of <P, G> (each layer's divided by its number of grad workers)."""
        if op.stage is None:
            raise AssertionError("APPLY without a stage")
        if all(s != op.stage for s, _ in ctx.runners):  # a streamed layer of a stage held elsewhere
            self.streams.apply(ctx, op)
            return
        runner = ctx.stage_runner(op.stage)
        layers = [self.layers[n] for n in self._layers_of(op)]
        ctx.transport.settle(grad_key(op.stage))
        self._settle_tied(ctx, [layer.name for layer in layers], op)
        for layer in layers:
            self.settle_layer(ctx, layer.name)
            late = [
                r.step for r in self.refreshes[layer.name] if r.step + self.timings[layer.name].use_offset <= ctx.step
            ]
            if late:
                raise PipelineError(
                    f"rank {self.rank}: '{op}' at step {ctx.step} needs the preconditioner of "
                    f"{layer.name} refreshed at step {late[0]}, which the plan has not made yet"
                )
            self.states[layer.name].activate(ctx.step)
        if op.piece is not None:
            self._apply_piece(ctx, op)
            return
        params = dict(runner.module.named_parameters())
        grads = {n: p.grad for n, p in params.items() if p.grad is not None}
        copies = len(self.workers[layers[0].name]) if op.layer is not None else len(self.groups[op.stage].ranks)
        for members in self._by_clip_group(layers).values():
            self.add_dot(members, self.family.precondition(members, grads, self.states, params) / copies, op.stage)

    def _apply_piece(self, ctx: StepContext, op: Op) -> None:
        """Piece ``i/n`` of one unit's APPLY (`SplitApplyFamily`): piece 0 takes the core's input from the unit's
        gradient (updating its state), the last writes the direction into the gradient and adds its <P, G>."""
        family = self.streams.split  # the family when its APPLY splits, looked up once
        if family is None or op.layer is None:
            raise PipelineError(
                f"rank {self.rank}: '{op}' runs a piece of an APPLY, which takes one unit of a family whose APPLY "
                f"splits (Muon); {self.family.name} has none, or the op names no unit"
            )
        assert op.stage is not None, "APPLY names its stage"
        name, unit = op.layer, self.layers[op.layer]
        param = ctx.stage_runner(op.stage).param(name)
        grad = param.grad
        if grad is None:  # the backward did not reach it: no step for it, as without pieces
            return
        core = self.pieces.run(family, unit, op, lambda: family.apply_input(unit, grad, self.states[name], param))
        if core is None:
            return
        p = family.apply_output(unit, core, param)
        dot = direction_dot(self.family, p, grad)
        grad.copy_(p)
        self.add_dot([unit], dot / len(self.workers[name]), op.stage)

    def _settle_tied(self, ctx: StepContext, names: Sequence[str], op: Op) -> None:
        """Land the sums of the tied gradients among `names`' parameters (summed over the stages that share them
        before their owner reads them: planner/problem/costs.py); PipelineError when a sum has not started."""
        tied = [p for n in names for p in self.family.params_of(self.layers[n]) if p in ctx.sync.owned]
        if tied:
            ctx.transport.settle(TIED_KEY)
        for p in tied:
            ctx.sync.require_summed(p, str(op))

    def settle_layer(self, ctx: StepContext, name: str) -> None:
        """Land every collective in flight of the layer's parts (its halves' broadcasts: `_maybe_combine` then
        makes the preconditioner)."""
        for part in self.family.parts:
            ctx.transport.settle(_unit_key(name, part))

    def add_dot(self, layers: Sequence[Any], dot: Tensor, stage: int) -> None:
        """Add the <P, G> of `layers` (of one KL-clip group, all of `stage`) to their group's sum, and mark the
        stage's gradients preconditioned (the KL-clip scales them at OPT_STEP)."""
        group = next(iter(self._by_clip_group(layers)))
        self._dots[group] = self._dots[group] + dot if group in self._dots else dot
        self._touched.add(stage)

    @property
    def scope(self) -> KLClipScope:
        """The KL-clip scope of the run."""
        return self.step_end.scope

    def _by_clip_group(self, layers: Sequence[Any]) -> dict[int, list[Any]]:
        """`layers` by KL-clip group, in order: one group 0 unless the scope is STAGE."""
        out: dict[int, list[Any]] = {}
        for layer in layers:
            out.setdefault(self.clip_groups[layer.name] if self.scope is KLClipScope.STAGE else 0, []).append(layer)
        return out

    def bcast_prec(self, ctx: StepContext, op: Op) -> None:
        """Broadcast one layer's preconditioned gradient from its grad worker `op.root` along the root's row."""
        if op.root is None or op.stage is None or op.layer is None:
            raise AssertionError("BCAST_PREC names its stage, root and layer (planner/problem/ir.py OP_FIELDS)")
        name = self._layers_of(op)[0]
        runner = ctx.stage_runner(op.stage)
        ctx.transport.settle(grad_key(op.stage))
        self._settle_tied(ctx, [name], op)
        params = [runner.param(p) for p in self.family.params_of(self.layers[name])]
        pending = ctx.transport.start_broadcast(flat_gradient(params), op.root, self._group(op, op.stage), str(op))

        def take(received: Tensor) -> None:
            for p, chunk in zip(params, split_flat(received, [p.shape for p in params]), strict=True):
                p.grad = chunk.clone()

        ctx.transport.defer(("preconditioned", name), pending, _ignore if op.root == self.rank else take)
        self._touched.add(op.stage)

    def post_step_end(self, ctx: StepContext, op: Op, _: Sequence[Op]) -> None:
        """The receives of OPT_STEP's sum (`StepEnd.post`), with a <P, G> share of each KL-clip group."""
        ctx.step_end.post(ctx.step_end.groups)

    def opt_step(self, ctx: StepContext, op: Op) -> None:
        """Agree on skipping the step and take each KL-clip group's nu (`StepEnd.finish`: by the scope), scale the
        preconditioned gradients by it; then step unless the verdict is to skip. Tied gradients are summed first (as
        the core OPT_STEP does), so a sum that overflows skips the step on every rank. With
        `PipelineOptions.max_grad_norm`, every gradient is then multiplied by the clip factor of the raw gradient's
        global norm (taken before APPLY, `GradSync.take_sqnorm`): K-FAC's preconditioning is linear in the
        gradient, so this equals clipping before preconditioning, and the nu is already the clipped one's."""
        self.pieces.check_done(f"'{op}'")
        self.streams.pieces.check_done(f"'{op}'")
        end_gradients(ctx, op)
        ctx.sync.send_directions(ctx.transport, str(op))
        end = ctx.step_end
        zero = torch.zeros((), dtype=torch.float64)
        groups = range(end.groups) if self.scope is KLClipScope.STAGE else [0]
        lr = float(ctx.optimizer.param_groups[0]["lr"]) if ctx.optimizer is not None else 0.0
        dots = {g: self._dots.get(g, zero) for g in groups}
        verdict = end.finish(
            dots,
            local_nonfinite(ctx),
            local_loss(ctx),
            lambda dot_sum: self.family.clip_scale(dot_sum, lr),
            ctx.sync.take_sqnorm(),
        )
        ctx.skipped, ctx.loss, nus = verdict.skip, verdict.loss, verdict.nus
        if self.family.kl_clip is not None and not ctx.skipped and ctx.optimizer is not None:
            for stage in sorted(self._touched):
                runner = ctx.stage_runner(stage)
                grads = {n: p.grad for n, p in runner.module.named_parameters() if p.grad is not None}
                for group, members in self._by_clip_group(self._by_stage[stage]).items():
                    self.family.scale(members, grads, nus[group])
        self._dots = {}
        self._touched = set()
        step_or_skip(ctx, verdict.clip if end.max_grad_norm is not None else None)

    # --- skipped steps and checkpoints ------------------------------------------------------------

    def begin_step(self, ctx: StepContext) -> None:
        """Remember the state and the runners' captures (see `abort_step`), then open the step's refreshes."""
        captures = {
            key: {k: deque(q) for k, q in r.captures.items()}
            for key, r in ctx.runners.items()
            if isinstance(r, TappedRunner)
        }
        self._at_begin = (self._copy(), captures, self.streams.snapshot())
        self.streams.begin_step()
        self.pieces.clear()
        self.open_refreshes(ctx.step)

    def abort_step(self, ctx: StepContext) -> None:
        """Restore what `begin_step` remembered: a skipped step leaves no statistic, decomposition or capture."""
        (states, refreshes, outbox), captures, streams = self._at_begin
        self._install(states, refreshes, outbox)
        self.streams.restore(streams)
        self.pieces.clear()
        for key, saved in captures.items():
            runner = ctx.runners[key]
            if isinstance(runner, TappedRunner):
                runner.captures = saved
        self._dots = {}
        self._touched = set()

    def commit_step(self, ctx: StepContext) -> None:
        """The step stood: drop the state `begin_step` remembered (it holds the previous statistics and
        decompositions alive, twice the preconditioner's memory, until the next step began)."""
        self._at_begin = None

    def _copy(
        self,
    ) -> tuple[dict[str, RefreshState], dict[str, deque[RefreshRecord]], dict[tuple[str, str], deque[Any]]]:
        states = {name: state.snapshot() for name, state in self.states.items()}
        refreshes = {n: deque(r.copy() for r in q) for n, q in self.refreshes.items()}
        return states, refreshes, {k: deque(q) for k, q in self._outbox.items()}

    def _install(
        self,
        states: Mapping[str, RefreshState],
        refreshes: Mapping[str, deque[RefreshRecord]],
        outbox: Mapping[tuple[str, str], deque[Any]],
    ) -> None:
        """Take over the given state, keeping the state objects others hold (the trainer's states)."""
        for name, state in states.items():
            vars(self.states[name]).update(vars(state))
        self.refreshes = {n: deque(refreshes.get(n, ())) for n in self.layers}
        self._outbox = dict(outbox)

    def state_dict(self) -> dict[str, Any]:
        """``{"kfac": {layer: state.state_dict()}, "inflight": {...}}``: the layer states (alike on every copy of
        a stage) and this rank's work in flight: open refreshes and decompositions waiting for BCAST."""
        half = self.family.half_to_state
        refreshes = {n: [r.to_state(self.family) for r in q] for n, q in self.refreshes.items() if q}
        outbox = [[n, part, [half(h) for h in q]] for (n, part), q in sorted(self._outbox.items()) if q]
        inflight: dict[str, Any] = {"refreshes": refreshes, "outbox": outbox}
        if self.scope is KLClipScope.STALE:
            inflight["kl_clip_sum"] = self.step_end.state()
        return {"kfac": {n: s.state_dict() for n, s in self.states.items()}, "inflight": inflight}

    def parse_state(self, state: Mapping[str, Any]) -> tuple:
        """`state_dict` output as new layer states, refresh records and outbox, checked against this rank's
        layers; CheckpointError when it names other layers or is malformed. Changes nothing (see `load_parsed`)."""
        saved, inflight = state.get("kfac"), state.get("inflight")
        if not isinstance(saved, Mapping) or set(saved) != set(self.layers) or not isinstance(inflight, Mapping):
            raise CheckpointError(
                f"checkpoint layers {sorted(saved or {})[:6]} differ from this rank's "
                f"{sorted(self.layers)[:6]}; it was written for another model, split or plan"
            )
        states = {}
        for name, layer in self.layers.items():
            states[name] = self.family.new_state(layer)
            states[name].load_state_dict(dict(saved[name]))
        self._drop_unheld(states)
        half = self.family.half_from_state
        try:
            refreshes = {
                n: deque(RefreshRecord.from_state(r, self.family, self._new_state(n)) for r in records)
                for n, records in inflight["refreshes"].items()
            }
            outbox = {(str(n), str(part)): deque(half(h) for h in halves) for n, part, halves in inflight["outbox"]}
            stale = inflight.get("kl_clip_sum")
            stale = None if stale is None else float(stale)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CheckpointError(f"work in flight is malformed in the checkpoint ({e!r})") from e
        unknown = sorted((set(refreshes) | {n for n, _ in outbox}) - set(self.layers))
        if unknown:
            raise CheckpointError(f"checkpoint has work in flight for layers {unknown} this rank does not hold")
        return states, refreshes, outbox, stale

    def _new_state(self, name: str) -> Callable[[], RefreshState]:
        """A maker of `name`'s empty state; called for a layer this rank does not hold it raises KeyError (the
        checkpoint's work in flight is checked against the held layers after parsing)."""
        return lambda: self.family.new_state(self.layers[name])

    def _drop_unheld(self, states: dict[str, RefreshState]) -> None:
        """Keep of each loaded unit state only what this rank holds under its strategy: a checkpoint written under
        another layout or strategy gives every copy the fullest state saved, but only a unit's grad workers keep its
        decompositions, and a rank that neither keeps its statistics nor decomposes it holds nothing of it
        (DP-KFAC's other replicas). A same-layout checkpoint already has this form."""
        for name, state in states.items():
            if self.rank in self.workers[name] or name in self.streams.replicas:
                continue
            if name in self.keeps:
                state.active, state.pending = None, []
            else:
                states[name] = self.family.new_state(self.layers[name])

    def load_parsed(self, parsed: tuple) -> None:
        """Install what `parse_state` returned (STALE: the sum the next step's nu comes from)."""
        states, refreshes, outbox, stale = parsed
        self._install(states, refreshes, outbox)
        self.streams.replica_steps = dict.fromkeys(self.streams.replicas)  # loaded: trusted (Streams.apply)
        if self.scope is KLClipScope.STALE:
            self.step_end.restore(stale)
