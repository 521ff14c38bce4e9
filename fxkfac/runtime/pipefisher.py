"""PipeFisherTrainer: the pipelined runtime with K-FAC ops (curvature, inversion, precondition) in its programs."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fxkfac.autoplan import (Target, check_costs, check_matches, load_plan, naive_programs, ranks_of_stages, share_plan,
                             solve_for, startup_program)
from fxkfac.capture import capture
from fxkfac.config import KFACConfig
from fxkfac.errors import CheckpointError, ConfigError
from fxkfac.fingerprint import graph_fingerprint
from fxkfac.passes.find_layers import find_kfac_layers
from fxkfac.passes.layers import KFACLayer
from fxkfac.planner.costs import CostTable, load_cost_table
from fxkfac.planner.ir import LayerTiming, Op
from fxkfac.runtime.kfac_ops import KFACRuntime, StageGroup, TappedRunner
from fxkfac.runtime.trainer import PipelineTrainer, shard_microbatches
from fxkfac.trainer import layer_timings

__all__ = ["PipeFisherTrainer", "vocab_size_of"]

log = logging.getLogger(__name__)


def vocab_size_of(model: nn.Module, cfg: KFACConfig) -> int | None:
    """The vocabulary size for the LM-head skip rule: the config's, else the largest nn.Embedding."""
    if cfg.vocab_size is not None:
        return cfg.vocab_size
    sizes = [m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)]
    return max(sizes) if sizes else None


def _stage_layer_names(gm: torch.fx.GraphModule, cfg: KFACConfig, vocab: int | None,
                       known: Mapping[str, KFACLayer]) -> list[str]:
    """Names of the model's K-FAC layers found in one stage graph (writes node.meta[LAYER] there)."""
    found, _ = find_kfac_layers(gm, skip=cfg.skip_layers, skip_vocab_head=cfg.skip_vocab_head, vocab_size=vocab)
    return [layer.name for layer in found if layer.name in known]


def _surrogate_loss(outputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """A scalar of the last stage's outputs for profiling its backward (no targets are known yet)."""
    return sum(o.float().mean() for o in outputs if o.is_floating_point())  # type: ignore[return-value]


def _startup_programs(plan: Any, rank: int) -> dict[int, list[Op]]:
    """The first steps' programs that differ from the steady state (`startup_program`), computed once."""
    if plan is None:
        return {}
    last = max((p.step for p in plan.placements if p.device == rank), default=0)
    firsts = {t: startup_program(plan, rank, t) for t in range(last)}
    return {t: ops for t, ops in firsts.items() if ops is not None}


PROFILE_MARGIN = 1.2
"""Profiled K-FAC times are planned 20% longer: timed on rank 0 alone they ran 10-20% faster than in
training, where every rank computes at once (benchmarks/pipefisher_overhead.py), and a bubble planned
full spills every excess onto the critical path."""


class PipeFisherTrainer(PipelineTrainer):
    """Pipeline-parallel K-FAC: every rank runs its plan program with the K-FAC handlers installed.

    Same interface as PipelineTrainer. `plan` is "auto" (rank 0 profiles the split model, solves, and
    broadcasts the plan), a plan file path or a Plan (refused with PlanMismatchError when made for
    another graph, mesh or schedule; see `fxkfac.fingerprint`), whose `programs` and `layers` run as
    they are. `plan_options` go to the planner (memory_budget, max_overhead, time_limit_s) and may name
    the cost table to plan with (`costs`: a CostTable, a file, or a callable; default: profile here,
    K-FAC times scaled by `kfac_margin`, default PROFILE_MARGIN).
    Or None; then `layer_timing` (default: `KFACConfig.refresh_every` for every layer) and
    `programs` (default: `fxkfac.autoplan.naive_programs`, all K-FAC work on the critical path) apply.
    `kfac_states` holds this rank's layers' LayerState (by layer name), as the single-device trainer's.
    """

    def __init__(self, model: nn.Module, mesh: Any, *, kfac: KFACConfig, example_inputs: Sequence[Any],
                 loss_fn: Callable[[Any, Any], torch.Tensor], plan: Any = None,
                 layer_timing: Mapping[str, LayerTiming] | None = None,
                 programs: Mapping[int, list[list[Op]]] | None = None, backend: str | None = None,
                 plan_options: Mapping[str, Any] | None = None, **kw: Any) -> None:
        if not isinstance(kfac, KFACConfig):
            raise ConfigError(f"kfac must be a KFACConfig, got {type(kfac).__name__}")
        super().__init__(model, mesh, plan=None, example_inputs=example_inputs, loss_fn=loss_fn, kfac=None,
                         backend=backend, **kw)
        W, D = self.layout.W, self.layout.D
        example = tuple(example_inputs)
        micro = tuple(shard_microbatches(example, W, 0, self.N)[0])
        self.layers: list[KFACLayer] = capture(model, micro, kfac).layers
        known = {layer.name: layer for layer in self.layers}
        vocab = vocab_size_of(model, kfac)
        self.stage_layers = {st.index: _stage_layer_names(st.gm, kfac, vocab, known) for st in self.split.stages}
        stage_of = {name: s for s, names in self.stage_layers.items() for name in names}
        missing = sorted(set(known) - set(stage_of))
        if missing:
            raise AssertionError(f"K-FAC layers {missing} were found in the model but in no stage graph")
        self.target = Target(graph_fingerprint(self.layers, self.stage_layers, schedule=self.kind.value, D=D, N=self.N,
                                               W=W, v=self.v, micro_batch_size=int(micro[0].shape[0])),
                             self.kind.value, D, self.N, W, self.v)
        plan = self._resolve(plan, micro, kfac, known, plan_options or {})
        given = dict(plan.layers) if plan is not None else dict(layer_timing or {})
        self.timings = layer_timings(self.layers, kfac, given)
        self.holders = ranks_of_stages(self.kind, D, W, self.S, self.v)
        local = sorted({s for s, _ in self.runners})
        groups = {s: self._group(self.holders[s]) for s in local}
        local_layers = {n: known[n] for s in local for n in self.stage_layers[s]}
        for key, runner in list(self.runners.items()):
            mine = {n: known[n] for n in _stage_layer_names(runner.module, kfac, vocab, known)}
            self.runners[key] = TappedRunner.wrap(runner, mine, backend)
        self.kfac = kfac
        self.kfac_runtime = KFACRuntime(kfac, local_layers, {n: stage_of[n] for n in local_layers}, self.timings,
                                        groups, self.layout.rank, self.N * W, self.global_batch)
        self.kfac_runtime.install(self.interpreter)
        self.kfac_states = self.kfac_runtime.states
        if plan is not None:
            self.plan, self.programs = plan, plan.programs
        else:
            self.programs = dict(programs) if programs is not None else naive_programs(
                self.kind, D, self.N, W, self.timings, self.stage_layers, v=self.v)
        self._startup = _startup_programs(plan, self.layout.rank)
        log.info("rank %d: K-FAC on %d local layers, program period %d", self.layout.rank, len(local_layers),
                 len(self.programs[self.layout.rank]))

    def _resolve(self, plan: Any, micro: tuple, kfac: KFACConfig, known: Mapping[str, KFACLayer],
                 options: Mapping[str, Any]) -> Any:
        """The Plan every rank runs: None, a checked Plan, a loaded file, or the auto plan shared by rank 0."""
        if plan is None:
            return None
        if isinstance(plan, str) and plan == "auto":
            options = dict(options)
            source = options.pop("costs", None)
            margin = float(options.pop("kfac_margin", PROFILE_MARGIN))
            made = None
            if self.layout.rank == 0:
                costs = self._costs(source, micro, kfac, known)
                if source is None:
                    costs = costs.scale_kfac_times(margin)
                made = solve_for(self.target, costs, **options)
            return share_plan(made)
        if isinstance(plan, (str, Path)):
            return load_plan(plan, self.target)
        check_matches(plan, self.target)
        return plan

    def _costs(self, source: Any, micro: tuple, kfac: KFACConfig, known: Mapping[str, KFACLayer]) -> CostTable:
        """The cost table to plan with: profiled here (None), a CostTable, a .json/.csv file, or
        `source(stage_layers, layers)` for a cost model of the caller's; checked against the split."""
        if source is None:
            from fxkfac.profiler import profile

            flat = [x for x in micro if isinstance(x, torch.Tensor)]
            return profile(self.split, self.stage_layers, known, flat, _surrogate_loss, kfac)
        if isinstance(source, (str, Path)):
            costs = load_cost_table(source)
        elif isinstance(source, CostTable):
            costs = source
        elif callable(source):
            costs = source(self.stage_layers, known)
        else:
            raise ConfigError(f"plan_options['costs'] must be a CostTable, a cost file or a callable, got "
                              f"{type(source).__name__}")
        check_costs(costs, self.stage_layers)
        return costs

    def _group(self, ranks: tuple[int, ...]) -> StageGroup:
        if len(ranks) <= 1:
            return StageGroup(ranks, None)
        if ranks not in self.sync.groups:
            raise AssertionError(f"no process group for the stage holders {ranks} on rank {self.layout.rank}")
        return StageGroup(ranks, self.sync.groups[ranks])

    def step(self, inputs: Any, targets: Any) -> float:
        """One optimizer step; the layers refreshing at this step are tapped in their stages (their refresh
        records are opened by the K-FAC runtime when the step's program begins)."""
        for runner in self.runners.values():
            if isinstance(runner, TappedRunner):
                runner.modes = self.kfac_runtime.modes_at(self.steps, list(runner.layers))
        return super().step(inputs, targets)

    def _ops_at(self, step: int) -> list[Op]:
        """The plan's ops, without the work of refreshes before step 0 in the first steps."""
        return self._startup[step] if step in self._startup else super()._ops_at(step)

    def state_dict(self) -> dict[str, Any]:
        """PipelineTrainer's state plus ``kfac`` (this rank's LayerStates by layer FQN) and ``inflight``
        (refreshes, inverse halves and captures this rank holds between steps; see KFACRuntime.state_dict)."""
        state = super().state_dict()
        state.update(self.kfac_runtime.state_dict())
        state["inflight"]["captures"] = {f"{s}.{p}": r.captures_state() for (s, p), r in sorted(self.runners.items())
                                         if isinstance(r, TappedRunner)}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict` output; every part is checked (CheckpointError) before anything changes."""
        parsed = self.kfac_runtime.parse_state(state)
        saved = state["inflight"].get("captures")
        tapped = {f"{s}.{p}": r for (s, p), r in self.runners.items() if isinstance(r, TappedRunner)}
        if not isinstance(saved, dict) or set(saved) != set(tapped):
            raise CheckpointError(f"checkpoint captures are for stage copies {sorted(saved or {})}, this rank holds "
                                  f"{sorted(tapped)}; it was written for another layout")
        captures = {key: r.parse_captures(saved[key]) for key, r in tapped.items()}
        super().load_state_dict(state)
        self.kfac_runtime.load_parsed(parsed)
        for key, r in tapped.items():
            r.captures = captures[key]
