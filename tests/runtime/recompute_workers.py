"""Rank functions of the activation checkpointing tests (importable by spawned ranks)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import fxkfac
import fxkfac.runtime.stage as stage_module
from fxkfac.compile_api import prepare
from fxkfac.config import PipelineOptions, PlanOptions
from fxkfac.kfac.family import KFACFamily
from fxkfac.planner.problem.problem import Problem
from fxkfac.planner.problem.schedules import ScheduleKind
from fxkfac.planner.problem.step_timeline import min_memory_bytes
from tests.e2e import workers as e2e
from tests.runtime import workers as rt

__all__ = ["ACT", "checkpointed_worker", "heavy_costs", "auto_budget_of"]

ACT = 64 << 20
"""Activation bytes per micro-batch of every stage in `heavy_costs`: what makes a budget need checkpointing."""


def heavy_costs(stage_layers: Any, layers: Any) -> Any:
    """`e2e.synthetic_costs` with 64 MiB of activations per micro-batch and a 64 KiB boundary per stage."""
    table = e2e.synthetic_costs(stage_layers, layers)
    stages = tuple(dataclasses.replace(s, act_bytes=ACT, boundary_bytes=1 << 16) for s in table.stages)
    return dataclasses.replace(table, stages=stages)


def auto_budget_of(case: e2e.Case) -> int:
    """A memory budget half a micro-batch's activations under what `case` needs without checkpointing."""
    data = e2e.batches(case)
    kind = ScheduleKind(case.schedule)
    prepared = prepare(e2e.make_model(), (data[0][0],), KFACFamily(case.kfac), kind=kind, D=case.D, W=case.W, N=case.N)
    costs = heavy_costs(prepared.stage_layers, {u.name: u for u in prepared.units})
    return min_memory_bytes(Problem(case.schedule, case.D, case.N, costs, W=case.W)) - ACT // 2


def _counting() -> dict[int, int]:
    """Count the checkpointed calls of stage functions (`torch.utils.checkpoint.checkpoint`, as the runners call
    it), keyed by call: the runtime really takes the recomputing path."""
    calls = {0: 0}
    real: Callable[..., Any] = stage_module.checkpoint

    @functools.wraps(real)
    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(*args, **kwargs)

    stage_module.checkpoint = counted
    return calls


def _params(trainer: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.named_parameters()}


def checkpointed_worker(
    rank: int, world: int, plain: list[rt.Config], kfac: list[e2e.Case], auto: list[tuple[e2e.Case, int]]
) -> dict[str, list]:
    """Every stage recomputing: `plain` runs (AdamW or SGD alone) and `kfac` runs (critical-path K-FAC at
    `e2e.timings_for`); then `auto` runs planned with activation_checkpointing="auto" under their budget. Returns
    per run this rank's parameters, losses and checkpointed calls (and, for `auto`, the plan's recompute and
    layers and the steps trained)."""
    calls = _counting()
    out: dict[str, list] = {"plain": [], "kfac": [], "auto": []}
    everything = PipelineOptions(timeout=60.0, activation_checkpointing=(0, 1))
    for cfg in plain:
        calls[0] = 0
        batches = rt.make_batches(cfg)
        trainer = fxkfac.compile(
            rt.make_model(cfg.model),
            (cfg.D, cfg.W),
            None,
            example_inputs=(batches[0][0],),
            loss_fn=rt.loss_for(cfg.model),
            optimizer=rt.make_optimizer(cfg.opt),
            preconditioner=None,
            schedule=cfg.schedule,
            microbatches=cfg.N,
            backend=None,
            pipeline=everything,
        )
        losses = [float(trainer.step(x, y)) for x, y in batches]
        out["plain"].append((_params(trainer), losses, calls[0]))
        dist.barrier()
    for case in kfac:
        calls[0] = 0
        data = e2e.batches(case)
        trainer = fxkfac.compile(
            e2e.make_model(),
            (case.D, case.W),
            None,
            preconditioner=e2e.KFAC,
            example_inputs=(data[0][0],),
            loss_fn=e2e.loss_fn,
            optimizer=e2e.optimizer,
            schedule=case.schedule,
            backend=None,
            microbatches=case.N,
            layer_timing=e2e.timings_for(e2e._names_for(case)),
            pipeline=everything,
        )
        losses = [float(trainer.step((ids,), y)) for ids, y in data]
        out["kfac"].append((_params(trainer), losses, calls[0]))
        dist.barrier()
    for case, budget in auto:
        calls[0] = 0
        data = e2e.batches(case)
        options = PlanOptions(costs=heavy_costs, time_limit_s=1.5, max_overhead=0.0, memory_budget=budget)
        trainer = fxkfac.compile(
            e2e.make_model(),
            (case.D, case.W),
            "auto",
            preconditioner=case.kfac,
            example_inputs=(data[0][0],),
            loss_fn=e2e.loss_fn,
            optimizer=e2e.optimizer,
            schedule=case.schedule,
            backend=None,
            microbatches=case.N,
            pipeline=PipelineOptions(timeout=60.0, activation_checkpointing="auto"),
            plan_options=options,
        )
        steps = 2 * max(t.period for t in trainer.plan.layers.values())
        losses = [float(trainer.step((ids,), y)) for ids, y in (data * steps)[:steps]]
        recompute = trainer.plan.problem.recompute
        out["auto"].append((_params(trainer), losses, calls[0], recompute, dict(trainer.plan.layers), steps))
        dist.barrier()
    return out
