"""PipelineTrainer: split the captured model into stages, place them on ranks, interpret each rank's program."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from fxkfac.errors import CheckpointError, ConfigError
from fxkfac.passes.split_stages import SplitResult, split_stages
from fxkfac.planner.ir import Op
from fxkfac.planner.lowering import add_send_recv, expand_dp
from fxkfac.planner.schedules import ScheduleKind, num_stages, schedule_programs, stage_rank, stages_of_rank
from fxkfac.runtime.interpreter import Interpreter, StepContext
from fxkfac.runtime.mesh import MeshLayout
from fxkfac.runtime.param_state import (check_model_state, load_model_state, optimizer_state, param_names,
                                        parse_optimizer_state)
from fxkfac.runtime.p2p import TagSpace, Transport
from fxkfac.runtime.stage import StageRunner
from fxkfac.runtime.sync import GradSync, holder_sets
from fxkfac.runtime.timeline import Timeline, chrome_trace, gather_timelines
from fxkfac.trainer import Checkpointing, check_skip_streak

__all__ = ["PipelineTrainer", "rank_programs", "shard_microbatches"]

log = logging.getLogger(__name__)


def rank_programs(kind: str, D: int, N: int, W: int, v: int = 1) -> dict[int, list[Op]]:
    """Per global rank, one step of the schedule with its transfers (planner lowering)."""
    return expand_dp(add_send_recv(schedule_programs(kind, D, N, v=v), kind, D, v), W)


def shard_microbatches(tree: Any, W: int, dp: int, N: int) -> list[Any]:
    """Replica `dp`'s contiguous shard of the global batch, split into N micro-batches (dim 0)."""
    leaves, spec = pytree.tree_flatten(tree)
    per_mb = []
    for leaf in leaves:
        if leaf.shape[0] % (W * N):
            raise ConfigError(f"batch dimension {leaf.shape[0]} is not divisible by W*N = {W}*{N}")
        shard = leaf.chunk(W, dim=0)[dp]
        per_mb.append(shard.chunk(N, dim=0))
    return [pytree.tree_unflatten([chunks[m] for chunks in per_mb], spec) for m in range(N)]


def _capture(model: torch.nn.Module, example: tuple) -> tuple[fx.GraphModule, pytree.TreeSpec | None]:
    """The trainable graph of `model` at micro-batch shape, and its output structure."""
    gm = torch.export.export(model, example, strict=False).module()
    return gm, getattr(gm, "_out_spec", None)


class PipelineTrainer(Checkpointing):
    """Pipeline-parallel (and data-parallel) training over a ("pp", "dp") mesh.

    Same interface as the single-device trainer: `step(inputs, targets) -> float`,
    `named_parameters()`, `state_dict()`, `load_state_dict()`, `plan`.

    `example_inputs` is a global mini-batch (dim 0 divisible by N*W); the model is captured
    at the micro-batch shape, so every `step` must get the same global batch size.

    A step whose loss or gradients are NaN/Inf on any rank is skipped on every rank (a world
    all-reduce at OPT_STEP): parameters, optimizer and step counter stay as they were, and
    `skipped_steps` counts it; more than `max_skipped_steps` skips in a row raise NonFiniteError.
    """

    def __init__(self, model: torch.nn.Module, mesh: Any, *, plan: Any = None, example_inputs: Sequence[Any],
                 loss_fn: Callable[[Any, Any], torch.Tensor],
                 optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
                 kfac: Any = None, schedule: str = "1f1b", microbatches: int = 4, backend: str | None = None,
                 virtual_stages: int = 1, split_points: Sequence[str] | None = None,
                 stage_cost: Any = "flops", timeout: float = 120.0, record_timeline: bool = False,
                 max_skipped_steps: int | None = 10) -> None:
        if kfac is not None:
            raise ConfigError("PipelineTrainer is the plain pipeline: pass kfac=None, or use fxkfac.compile "
                              "(or fxkfac.runtime.pipefisher.PipeFisherTrainer) for K-FAC in the pipeline")
        self.layout = MeshLayout.from_mesh(mesh)
        self.kind = ScheduleKind(schedule)
        self.N, self.v = microbatches, virtual_stages
        self.plan = plan
        self.loss_fn = loss_fn
        D, W = self.layout.D, self.layout.W
        self.S = num_stages(self.kind, D, self.v)
        example = tuple(example_inputs)
        self.global_batch = int(example[0].shape[0])
        micro = tuple(shard_microbatches(example, W, 0, self.N)[0])
        gm, self.out_spec = _capture(model, micro)
        self.split: SplitResult = split_stages(gm, self.S, split_points=split_points, cost=stage_cost)
        self.programs = plan.programs if plan is not None else {
            r: [ops] for r, ops in rank_programs(self.kind, D, self.N, W, self.v).items()}
        self.pipes = (0, 1) if self.kind is ScheduleKind.CHIMERA else (0,)
        held = stages_of_rank(self.kind, D, self.layout.pp, v=self.v)
        self.runners = {(s, p): StageRunner.build(self.split.stages[s], p, s == self.S - 1, backend) for s, p in held}
        max_tensors = max(len(s.inputs) + len(s.outputs) for s in self.split.stages)
        self.transport = Transport(self.layout.rank, TagSpace(self.S, self.N, max_tensors), timedelta(seconds=timeout))
        self.sync = GradSync.build(self.layout.rank, self._holders(), self.split.shared_params,
                                   list(self.runners.values()))
        self.sync.broadcast_weights(self.transport)
        params = [p for r in self.runners.values() for p in r.module.parameters()]
        self.optimizer = optimizer(params) if params else None  # a stage of only activations holds none
        self.interpreter = Interpreter()
        self.timeline = Timeline(self.layout.rank, enabled=record_timeline)
        self.steps = 0
        self.skipped_steps = 0
        self.max_skipped_steps = max_skipped_steps
        self._skips_in_a_row = 0
        log.info("rank %d: stages %s of %s (D=%d, W=%d, N=%d)", self.layout.rank, sorted(self.runners),
                 self.kind, D, W, self.N)

    def _holders(self) -> dict[str, tuple[int, ...]]:
        ranks_of_stage = {
            s: {self.layout.global_rank(stage_rank(self.kind, self.layout.D, s, p, v=self.v), w)
                for p in self.pipes for w in range(self.layout.W)}
            for s in range(self.S)}
        return holder_sets([st.params for st in self.split.stages], ranks_of_stage)

    def step(self, inputs: Any, targets: Any) -> float:
        """One optimizer step over one global mini-batch; returns the step loss (same on all ranks)."""
        inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        if int(inputs[0].shape[0]) != self.global_batch:
            raise ConfigError(f"global batch size {inputs[0].shape[0]} differs from the example's "
                              f"{self.global_batch}; the pipeline was captured for that size")
        W, dp = self.layout.W, self.layout.dp
        ctx = StepContext(
            rank=self.layout.rank, step=self.steps, runners=self.runners, transport=self.transport,
            sync=self.sync, optimizer=self.optimizer,
            inputs=[list(mb) for mb in shard_microbatches(inputs, W, dp, self.N)],
            targets=shard_microbatches(targets, W, dp, self.N), loss_fn=self.loss_fn,
            out_spec=self.out_spec, scale=1.0 / (self.N * W))
        self.interpreter.run(self._ops_at(self.steps), ctx, self.timeline)
        loss = torch.stack(ctx.losses).sum() if ctx.losses else torch.zeros(())
        self.transport.all_reduce(loss, None, "loss all-reduce")
        if ctx.skipped:
            self.interpreter.abort(ctx)
            self.skipped_steps += 1
            self._skips_in_a_row += 1
            log.warning("rank %d: step %d skipped: loss or gradients are NaN/Inf on some rank (%d skipped so far)",
                        self.layout.rank, self.steps, self.skipped_steps)
            check_skip_streak(self._skips_in_a_row, self.max_skipped_steps, self.steps)
        else:
            self._skips_in_a_row = 0
            self.steps += 1
        return float(loss)

    def _ops_at(self, step: int) -> list[Op]:
        """This rank's ops for global step `step` (its program cycles with the plan's period)."""
        program = self.programs[self.layout.rank]
        return program[step % len(program)]

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """This rank's parameters by canonical FQN (one copy each)."""
        seen: set[str] = set()
        for key in sorted(self.runners):
            for name, param in self.runners[key].module.named_parameters():
                if name not in seen:
                    seen.add(name)
                    yield name, param

    def state_dict(self) -> dict[str, Any]:
        """This rank's parameters (one copy per FQN, detached, not copied), optimizer state by parameter
        FQN, the step and skip counters."""
        return {"model": {n: p.detach() for n, p in self.named_parameters()},
                "optimizer": optimizer_state(self.optimizer, param_names(self.runners.values())),
                "step": self.steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned (on the same layout); CheckpointError, with nothing changed,
        when it holds other parameters or lacks a part."""
        missing = sorted({"model", "optimizer", "step"} - set(state))
        if missing:
            raise CheckpointError(f"trainer state lacks {missing}; it was not written by state_dict()")
        check_model_state(self.runners.values(), state["model"])
        optim = parse_optimizer_state(self.optimizer, param_names(self.runners.values()), state["optimizer"])
        load_model_state(self.runners.values(), state["model"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(optim)
        self.steps = int(state["step"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self._skips_in_a_row = 0

    def trace(self, path: str | None = None) -> dict | None:
        """Gather every rank's recorded timeline to rank 0 and return (and write) a Chrome trace."""
        events = gather_timelines(self.timeline)
        return None if events is None else chrome_trace(events, path)
