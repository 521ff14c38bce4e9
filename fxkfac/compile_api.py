"""fxkfac.compile: the one path from a model to a Trainer.

capture (once, with its checks) -> K-FAC layers (found once, in the captured graph) -> split into stages
(the layers' tags travel with their nodes) -> resolve the plan -> lower to per-rank programs -> build the
rank's runtime. One device (`mesh=None`) takes the same path as a mesh: a 1x1 layout.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from fxkfac.autoplan import Target, resolve_plan
from fxkfac.capture import capture, input_signature, normalize_inputs
from fxkfac.config import KFACConfig, PipelineOptions, PlanOptions
from fxkfac.errors import ConfigError
from fxkfac.fingerprint import graph_fingerprint
from fxkfac.kfac.family import KFACFamily
from fxkfac.passes.layers import KFACLayer
from fxkfac.passes.split_stages import SplitResult, split_stages
from fxkfac.planner.costs import CostTable
from fxkfac.planner.ir import LayerTiming
from fxkfac.planner.lowering import naive_programs
from fxkfac.planner.plan import Plan
from fxkfac.planner.schedules import ScheduleKind, num_stages
from fxkfac.preconditioner import Family
from fxkfac.runtime.mesh import MeshLayout
from fxkfac.runtime.trainer import OptimizerFactory, RunSpec, Trainer, default_optimizer, shard_microbatches

__all__ = ["compile", "layer_timings"]


def compile(  # noqa: A001 - the public name the design card gives
    model: nn.Module,
    mesh: Any = None,
    plan: Any = "auto",
    *,
    example_inputs: Any,
    loss_fn: Callable[[Any, Any], Tensor],
    optimizer: OptimizerFactory | None = None,
    kfac: KFACConfig | None = KFACConfig(),
    schedule: str = "1f1b",
    microbatches: int = 1,
    backend: str | None = "inductor",
    layer_timing: Mapping[str, LayerTiming] | None = None,
    pipeline: PipelineOptions = PipelineOptions(),
    plan_options: PlanOptions = PlanOptions(),
    preconditioner: Family | None = None,
) -> Trainer:
    """Capture ``model``, insert K-FAC into its graph and return the Trainer of this rank.

    ``mesh=None`` trains on one device; a DeviceMesh with dims ("pp", "dp") (or a ``(D, W)`` tuple, with
    torch.distributed initialized) trains pipelined with ``schedule`` and ``microbatches`` per replica.
    ``plan``: "auto" (on a mesh: rank 0 profiles and solves with ``plan_options``, every rank gets the
    plan), a plan file or a ``fxkfac.Plan`` (refused when made for another graph, mesh or schedule), or
    None (K-FAC on the critical path, every layer refreshed by ``layer_timing`` or
    ``kfac.refresh_every``). On one device a plan supplies its layer timings. ``kfac=None`` trains with
    the base ``optimizer`` alone (default AdamW, lr 1e-3). ``preconditioner`` is any
    `fxkfac.preconditioner.Family` in place of K-FAC (then ``kfac`` is ignored). ``backend`` is a
    torch.compile backend, or None for eager stages.
    """
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ConfigError(f"microbatches must be an int >= 1, got {microbatches!r}")
    if kfac is not None and not isinstance(kfac, KFACConfig):
        raise ConfigError(f"kfac must be a KFACConfig or None, got {type(kfac).__name__}")
    family = preconditioner if preconditioner is not None else KFACFamily(kfac) if kfac is not None else None
    layout = MeshLayout.local() if mesh is None else MeshLayout.from_mesh(mesh)
    kind = ScheduleKind.ONE_F_ONE_B if mesh is None else ScheduleKind(schedule)
    N, v = microbatches, pipeline.virtual_stages
    example = normalize_inputs(example_inputs)
    batch = _batch_size(example)
    micro = shard_microbatches(example, batch, layout.W, 0, N)[0]
    captured = capture(model, micro, kfac if family is None or isinstance(family, KFACFamily) else KFACConfig())
    if family is not None and not captured.layers:
        warnings.warn(f"{type(model).__name__} has no Linear/Conv2d layer K-FAC can precondition; it trains with "
                      "the base optimizer alone", stacklevel=2)
    split = split_stages(captured.gm, num_stages(kind, layout.D, v), split_points=pipeline.split_points,
                         layers=captured.layers)
    stage_layers = {st.index: list(st.layers) for st in split.stages}
    target = Target(graph_fingerprint(captured.layers, stage_layers, schedule=kind.value, D=layout.D, N=N,
                                      W=layout.W, v=v, micro_batch_size=batch // (N * layout.W)),
                    kind, layout.D, N, layout.W, v)
    known = {layer.name: layer for layer in captured.layers}
    resolved = _resolve(plan, mesh is None, family, target, plan_options, layout, split, stage_layers, known, micro)
    if resolved is not None and layer_timing:
        raise ConfigError("layer_timing and a plan both set the layer timings on a mesh; pass one of them")
    on_one_device = mesh is None and isinstance(plan, (str, Path, Plan)) and plan != "auto"
    timed_by = _plan_of(plan) if on_one_device else resolved  # one device takes a plan's layer timings only
    given = dict(timed_by.layers) if timed_by is not None else {}
    timings = layer_timings(captured.layers, family, {**given, **dict(layer_timing or {})}) if family else {}
    parts = family.parts if family is not None else ()
    programs = resolved.programs if resolved is not None else naive_programs(kind, layout.D, N, layout.W, timings,
                                                                           stage_layers, v=v, parts=parts)
    startup = dict(resolved.startup) if resolved is not None else {}
    spec = RunSpec(layout, kind, N, v, captured, split, batch, input_signature(example), dict(programs), startup,
                   resolved, family, timings, target.fingerprint)
    return Trainer(spec, loss_fn=loss_fn, optimizer=optimizer or default_optimizer, options=pipeline,
                   backend=backend)


def _resolve(plan: Any, single: bool, family: Family | None, target: Target, options: PlanOptions,
             layout: MeshLayout, split: SplitResult, stage_layers: Mapping[int, list[str]],
             known: Mapping[str, KFACLayer], micro: tuple[Any, ...]) -> Plan | None:
    """The plan whose programs the ranks run: none on one device or without preconditioned layers."""
    if family is None:
        if plan not in (None, "auto"):
            raise ConfigError("kfac=None trains the plain pipeline, which takes no plan; pass plan=None")
        return None
    if single or not known:
        return None

    def profile() -> CostTable:
        from fxkfac.profiler import profile as measure

        if not isinstance(family, KFACFamily):
            raise ConfigError(f"plan='auto' profiles K-FAC's costs only; for {family.name} pass "
                              "PlanOptions(costs=...) or plan=None")

        flat = [x for x in micro if isinstance(x, Tensor)]
        costs = measure(split, stage_layers, known, flat, _surrogate_loss, family.cfg)
        for st in split.stages:  # profiling ran backward on the parameters the runners will train
            for p in st.gm.parameters():
                p.grad = None
        return costs

    return resolve_plan(plan, target, options, rank=layout.rank, world=layout.world_size, profile=profile,
                        stage_layers=stage_layers, layers=known)


def _plan_of(plan: str | Path | Plan) -> Plan:
    """A plan object from a Plan or a plan file (validated against its own problem)."""
    return plan if isinstance(plan, Plan) else Plan.load(plan)


def _surrogate_loss(outputs: Sequence[Tensor]) -> Tensor:
    """A scalar of the last stage's outputs for profiling its backward (no targets are known yet)."""
    return torch.stack([o.float().mean() for o in outputs if o.is_floating_point()]).sum()


def _batch_size(example: tuple[Any, ...]) -> int:
    """Dim 0 of the first tensor of the example inputs: the global mini-batch size."""
    for leaf in torch.utils._pytree.tree_leaves(example):
        if isinstance(leaf, Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    raise ConfigError("example_inputs contain no tensor with a batch dimension to split into micro-batches")


def layer_timings(layers: list[KFACLayer], family: Family, given: Mapping[str, LayerTiming]) -> dict[str, LayerTiming]:
    """Each layer's timing: ``given`` where it names it, else ``LayerTiming(refresh_every, 0, 0, capture)``
    with the family's defaults.

    ConfigError for timings of unknown layers or with invalid fields.
    """
    names = [layer.name for layer in layers]
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise ConfigError(f"layer_timing names layers that are not K-FAC layers of this model: {unknown}; "
                          f"the K-FAC layers are {names}")
    out = {}
    for name in names:
        t = given.get(name, LayerTiming(family.refresh_every, 0, 0, family.capture))
        if (t.period < 1 or not 0 <= t.curv_step < t.period or t.use_offset < 0
                or t.capture not in ("fused", "deferred")):
            raise ConfigError(f"invalid LayerTiming for {name}: {t} (need period >= 1, 0 <= curv_step < period, "
                              "use_offset >= 0, capture 'fused' or 'deferred')")
        out[name] = t
    return out
