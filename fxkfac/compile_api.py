"""fxkfac.compile: the one path from a model to a Trainer.

capture (once, with its checks) -> the family's units (found once, in the captured graph) -> split into stages
(the layers' tags travel with their nodes) -> resolve the plan -> lower to per-rank programs -> build the
rank's runtime. One device (`mesh=None`) takes the same path as a mesh: a 1x1 layout.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from fxkfac.autoplan import Cut, Target, resolve_plan, resumed_plan
from fxkfac.capture import Captured, capture, input_signature, normalize_inputs
from fxkfac.checkpoint import found
from fxkfac.cli_schedule import AUTO_SCHEDULE, auto_candidates
from fxkfac.config import ActivationCheckpointing, CheckpointMode, KFACConfig, PipelineOptions, PlanOptions
from fxkfac.errors import ConfigError
from fxkfac.families import family_of
from fxkfac.fingerprint import graph_fingerprint
from fxkfac.passes.split_stages import SplitResult, split_stages
from fxkfac.planner.plan import Plan
from fxkfac.planner.problem import (
    CostTable,
    LayerDistribution,
    LayerTiming,
    PreconditionerKind,
    Programs,
    ScheduleKind,
    StepBarrier,
)
from fxkfac.planner.problem.costs import tied_owner
from fxkfac.planner.problem.lowering import naive_programs, ranks_of_stages
from fxkfac.planner.problem.problem import format_bytes
from fxkfac.planner.problem.schedules import ZERO_BUBBLE_KINDS, num_stages, stages_of_rank
from fxkfac.planner.problem.strategy import distribute
from fxkfac.planner.search import ScheduleCandidate
from fxkfac.planner.validate import load_plan
from fxkfac.preconditioner import Family, PiecewiseFamily, SteppedFamily, gradient_parts
from fxkfac.progress import PlanProgress, plan_progress
from fxkfac.runtime.mesh import MeshLayout
from fxkfac.runtime.trainer import OptimizerFactory, RunSpec, Trainer, default_optimizer, plain_sgd, shard_microbatches
from fxkfac.shapes import Recapture, batch_size

__all__ = ["compile", "prepare", "Prepared", "layer_timings", "stage_units", "auto_budget", "device_memory"]


class _Omitted(Enum):
    """The default of `compile`'s `preconditioner` and `kfac`: told apart from None, which means no preconditioner."""

    OMITTED = "omitted"


OMITTED = _Omitted.OMITTED

SOLVING = "solving with CP-SAT (objective: staleness, the steps a layer runs on an older decomposition)"
"""plan="auto"'s solving phase, in words: what the objective of the solver's reports counts."""


def compile(  # noqa: A001 - the public name the design card gives
    model: nn.Module,
    mesh: Any = None,
    plan: Any = "auto",
    *,
    example_inputs: Any,
    loss_fn: Callable[[Any, Any], Tensor],
    optimizer: OptimizerFactory | None = None,
    preconditioner: Any = OMITTED,
    schedule: str = "1f1b",
    microbatches: int = 1,
    backend: str | None = "inductor",
    layer_timing: Mapping[str, LayerTiming] | None = None,
    pipeline: PipelineOptions = PipelineOptions(),
    plan_options: PlanOptions = PlanOptions(),
    resume_from: str | os.PathLike | None = None,
    kfac: Any = OMITTED,
) -> Trainer:
    """Capture ``model``, insert the preconditioner (K-FAC by default) into its graph and return this rank's Trainer.

    ``mesh=None`` trains on one device; a DeviceMesh with dims ("pp", "dp") (or a ``(D, W)`` tuple, with
    torch.distributed initialized) trains pipelined with ``schedule`` and ``microbatches`` per replica; ``schedule``
    "auto" (with plan="auto" and a preconditioner) is the planner's choice among every schedule the mesh allows
    (`auto_candidates`; ``virtual_stages`` > 1 keeps those of that many stages per rank): one capture, cut once per
    stage count the candidates run (one and two stages per rank), each cut profiled, each candidate planned on its
    own cut's profile; the least step at the freshest curvature wins, logged with why
    (planner/search/plan_search.py), and the run keeps the chosen schedule's cut.
    ``plan``: "auto" (on a mesh: every rank profiles, rank 0 solves with ``plan_options``, showing what it does
    (fxkfac/progress.py), every rank gets the plan; on a GPU without ``plan_options.memory_budget`` the
    device's free memory is the budget, on CPU there is none), a plan file or a ``fxkfac.Plan`` (refused
    when made for another graph, mesh or schedule), or None (the preconditioner on the critical path, every layer
    refreshed by ``layer_timing`` or its config's ``refresh_every``). On one device a plan supplies its layer
    timings. ``preconditioner``: a KFACConfig (omitted: ``KFACConfig()``), ShampooConfig, SOAPConfig or MuonConfig
    (docs/MUON.md), any `fxkfac.preconditioner.Family`, or None: the base ``optimizer`` alone (default AdamW, lr
    1e-3), the plain pipeline. Shampoo, SOAP and Muon make the whole update direction, so their base optimizer is
    plain SGD (default lr 1e-3). ``kfac=``: deprecated alias of ``preconditioner=`` (a FutureWarning). ``backend`` is a
    torch.compile backend, or None for eager stages. ``plan_options.strategy`` says how the copies of a stage
    share each layer's work (comm-opt, mem-opt, hybrid:F, dp-kfac; planner/problem/strategy.py) under ``plan="auto"``
    (None: the planner chooses) and ``plan=None`` (None: comm-opt); a loaded plan brings its own.
    ``resume_from``: a checkpoint directory (`Trainer.save_checkpoint`) the run resumes from when one is there, so
    that one script serves the first launch and every relaunch. plan="auto" then adopts the plan the checkpoint was
    saved with, when that plan was made for this graph, mesh and schedule (no profile, no solve: the relaunch
    continues bit for bit, work in flight included), and the trainer is loaded from the checkpoint
    (`load_checkpoint`) before it is returned; on another layout plan="auto" plans anew and the load follows the
    state (fxkfac/checkpoint.py, [Note: resharding]). Without a checkpoint there the run starts afresh.
    """
    _check_arguments(microbatches)
    family = _family(_chosen(preconditioner, kfac))
    auto_schedule = mesh is not None and schedule == AUTO_SCHEDULE
    if auto_schedule:
        _check_auto_schedule(plan, family)
    layout = MeshLayout.local() if mesh is None else MeshLayout.from_mesh(mesh)
    N, v, single = microbatches, pipeline.virtual_stages, mesh is None
    candidates = _cuttable(auto_candidates(layout.D, N, v), layout.D, pipeline.split_points) if auto_schedule else ()
    kind = ScheduleKind.ONE_F_ONE_B if mesh is None or auto_schedule else ScheduleKind(schedule)
    kind, v = (candidates[0].kind, candidates[0].v) if candidates else (kind, v)  # re-chosen after the plan
    resume = resume_from if resume_from is not None and found(resume_from, collective=not single) else None
    _check_checkpointing(pipeline.checkpointing, num_stages(kind, layout.D, v))
    prepared, known, resolved = _prepare_and_resolve(
        model,
        example_inputs,
        plan,
        single,
        family,
        kind,
        layout,
        N,
        pipeline,
        plan_options,
        backend,
        resume,
        candidates=candidates,
    )
    kind, v = prepared.target.schedule, prepared.target.v  # schedule="auto": the chosen schedule
    timings = _timings(plan, single, resolved, family, prepared.units, layer_timing)
    distributions = _distributions(resolved, family, plan_options, prepared.stage_layers, known, kind, layout, v)
    recompute = _recomputed(pipeline.checkpointing, resolved)
    spec = _run_spec(prepared, resolved, family, known, layout, kind, N, v, timings, distributions, recompute)
    spec = replace(spec, recapture=Recapture(model, family, N, layout.W, prepared.split, spec.stage_units))
    base = optimizer or (plain_sgd if family is not None and family.full_direction else default_optimizer)
    trainer = Trainer(spec, loss_fn=loss_fn, optimizer=base, options=pipeline, backend=backend)
    if resume is not None:
        trainer.load_checkpoint(resume)
    return trainer


def _check_auto_schedule(plan: Any, family: Family | None) -> None:
    """ConfigError unless schedule="auto" can be chosen: by plan="auto" (the planner) with a preconditioner."""
    if family is None or not (isinstance(plan, str) and plan == "auto"):
        raise ConfigError(
            "schedule='auto' is the planner's choice: it needs plan='auto' and a preconditioner; name a schedule"
        )


def _cuttable(
    candidates: tuple[ScheduleCandidate, ...], D: int, split_points: Sequence[str] | None
) -> tuple[ScheduleCandidate, ...]:
    """The `candidates` whose stages `split_points` cut (all without them); ConfigError when none is left."""
    if split_points is None:
        return candidates
    S = len(split_points) + 1
    kept = tuple(c for c in candidates if num_stages(c.kind, D, c.v) == S)
    if not kept:
        raise ConfigError(
            f"schedule='auto' with {len(split_points)} split points cuts {S} stages, which none of "
            f"{', '.join(map(str, candidates))} runs on D={D}; pass split_points for D or 2D stages, or none"
        )
    return kept


def _cut_for(prepared: Prepared, S: int, split_points: Sequence[str] | None) -> Prepared:
    """`prepared`'s captured graph and units cut again into S stages (no re-capture), for schedule="auto"'s
    candidates of another stage count; its target is `prepared`'s with no schedule chosen yet."""
    if len(prepared.split.stages) == S:
        return prepared
    layers = prepared.captured.layers
    split = split_stages(prepared.captured.gm, S, split_points=split_points, layers=layers)
    return replace(prepared, split=split, stage_layers=stage_units(split, prepared.units))


def _auto_cuts(
    prepared: Prepared, candidates: Sequence[ScheduleCandidate], N: int, split_points: Sequence[str] | None
) -> dict[int, Prepared]:
    """One cut per stage count the `candidates` run (D, 2D, vD), keyed by it, each with its candidates in
    `Target.choices` (each with the graph fingerprint of the run under it)."""
    t = prepared.target
    cuts: dict[int, Prepared] = {}
    for c in candidates:
        S = num_stages(c.kind, t.D, c.v)
        cut = cuts.get(S) or _cut_for(prepared, S, split_points)
        fingerprint = graph_fingerprint(
            cut.units,
            cut.stage_layers,
            schedule=c.kind.value,
            D=t.D,
            N=N,
            W=t.W,
            v=c.v,
            micro_batch_size=cut.batch // (N * t.W),
        )
        cuts[S] = replace(cut, target=replace(cut.target, choices=(*cut.target.choices, (c, fingerprint))))
    return cuts


def _check_arguments(microbatches: Any) -> None:
    """ConfigError for a `microbatches` that is no int >= 1: refused before any capture."""
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ConfigError(f"microbatches must be an int >= 1, got {microbatches!r}")


def _chosen(preconditioner: Any, kfac: Any) -> Any:
    """The preconditioner `compile` was given: `preconditioner`, else the deprecated alias `kfac` (warned, and
    only a KFACConfig or None), else the default KFACConfig(). ConfigError when both are given."""
    if kfac is OMITTED:
        return KFACConfig() if preconditioner is OMITTED else preconditioner
    if preconditioner is not OMITTED:
        raise ConfigError("kfac= is an old name of preconditioner=; pass preconditioner= alone")
    warnings.warn("compile(kfac=...) is deprecated; pass preconditioner=... instead", FutureWarning, stacklevel=3)
    if kfac is not None and not isinstance(kfac, KFACConfig):
        raise ConfigError(f"kfac must be a KFACConfig or None, got {type(kfac).__name__}")
    return kfac


def _check_checkpointing(checkpointing: ActivationCheckpointing, S: int) -> None:
    """ConfigError for a recomputing stage the run does not have (S stages), before any capture."""
    missing = [s for s in checkpointing.stages if s >= S]
    if missing:
        raise ConfigError(
            f"activation_checkpointing names stages {missing}, but the run has stages 0..{S - 1} "
            "(D * virtual_stages, twice under Chimera)"
        )


def _recomputed(checkpointing: ActivationCheckpointing, resolved: Plan | None) -> tuple[int, ...]:
    """The stages that recompute their forward: the plan's where there is one (plan="auto" planned with
    `checkpointing`; a loaded plan brings its own, which named stages must equal), else the named stages;
    ConfigError for AUTO where no planner runs."""
    if resolved is not None:
        planned = resolved.problem.recompute
        if checkpointing.mode is CheckpointMode.STAGES and planned != checkpointing.stages:
            raise ConfigError(
                f"activation_checkpointing names stages {list(checkpointing.stages)}, but the plan recomputes "
                f"stages {list(planned)}; pass the plan's stages (or 'off' to take them from the plan)"
            )
        return planned
    if checkpointing.mode is CheckpointMode.AUTO:
        raise ConfigError(
            "activation_checkpointing='auto' is chosen by the planner, which runs under plan='auto' on a mesh with "
            "a preconditioner; here name the stages that recompute, e.g. activation_checkpointing=(0,)"
        )
    return checkpointing.stages


def _family(choice: Any) -> Family | None:
    """The family of the chosen preconditioner; None (the base optimizer alone) for None."""
    return None if choice is None else family_of(choice)


def _prepare_and_resolve(
    model: nn.Module,
    example_inputs: Any,
    plan: Any,
    single: bool,
    family: Family | None,
    kind: ScheduleKind,
    layout: MeshLayout,
    N: int,
    pipeline: PipelineOptions,
    options: PlanOptions,
    backend: str | None,
    resume: str | os.PathLike | None,
    *,
    candidates: Sequence[ScheduleCandidate] = (),
) -> tuple[Prepared, dict[str, Any], Plan | None]:
    """`prepare`, the units by name and the resolved plan, with rank 0 showing what plan="auto" does on a mesh;
    warns (at `compile`'s caller) when the family finds nothing to precondition. `resume`: the checkpoint the run
    resumes from, whose plan plan="auto" adopts when it fits. `candidates` (schedule="auto"): the plan's schedule is
    the planner's choice among them, each profiled on its own cut (`_auto_cuts`; `Target.choices`), and the returned
    Prepared is the chosen schedule's cut, kept from the choice (no re-capture)."""
    auto = not single and family is not None and isinstance(plan, str) and plan == "auto"
    with plan_progress(auto and layout.rank == 0) as progress:  # rank 0 says what plan="auto" is doing
        progress.phase("capturing the model and splitting it into stages")
        prepared = prepare(
            model,
            example_inputs,
            family,
            kind=kind,
            D=layout.D,
            W=layout.W,
            N=N,
            v=pipeline.virtual_stages,
            split_points=pipeline.split_points,
            compiled=backend is not None,
        )
        cuts = _auto_cuts(prepared, candidates, N, pipeline.split_points) if candidates else {}
        if cuts:
            prepared = cuts[len(prepared.split.stages)]
            every = tuple(choice for cut in cuts.values() for choice in cut.target.choices)
            prepared = replace(prepared, target=replace(prepared.target, choices=every))
        if family is not None and not prepared.units:
            warnings.warn(
                f"{type(model).__name__} has nothing {family.name} can precondition (K-FAC: no Linear/Conv2d "
                "layer); it trains with the base optimizer alone",
                stacklevel=3,
            )
        known = {unit.name: unit for unit in prepared.units}
        resolved = _resolve(
            plan,
            single,
            family,
            prepared,
            known,
            options,
            layout,
            progress,
            resume,
            pipeline.checkpointing,
            autocast_dtype=pipeline.autocast_dtype,
            cuts=cuts,
        )
    if cuts and resolved is not None:  # the run is the schedule the planner chose, on its own cut
        chosen = _chosen_cut(resolved, cuts, prepared.target.D)
        return chosen, {unit.name: unit for unit in chosen.units}, resolved
    return prepared, known, resolved


def _chosen_cut(plan: Plan, cuts: Mapping[int, Prepared], D: int) -> Prepared:
    """The cut of the schedule `plan` was made for, its target that schedule's (one of `_auto_cuts`)."""
    kind, v = ScheduleKind(plan.problem.schedule), plan.problem.v
    cut = cuts[num_stages(kind, D, v)]
    return next(at for at in _at_each_choice(cut) if (at.target.schedule, at.target.v) == (kind, v))


def _at_each_choice(cut: Prepared) -> list[Prepared]:
    """`cut` (one of `_auto_cuts`) as the run of each of its candidates: its target that schedule's."""
    return [
        replace(cut, target=replace(cut.target, schedule=c.kind, v=c.v, fingerprint=fingerprint, choices=()))
        for c, fingerprint in cut.target.choices
    ]


def _timings(
    plan: Any,
    single: bool,
    resolved: Plan | None,
    family: Family | None,
    units: Sequence[Any],
    layer_timing: Mapping[str, LayerTiming] | None,
) -> dict[str, LayerTiming]:
    """Each unit's timing: `layer_timing` over the plan's (on one device a given plan only supplies timings);
    ConfigError when a plan on a mesh and `layer_timing` both set them. Empty without a family."""
    if resolved is not None and layer_timing:
        raise ConfigError("layer_timing and a plan both set the layer timings on a mesh; pass one of them")
    on_one_device = single and isinstance(plan, (str, Path, Plan)) and plan != "auto"
    timed_by = _plan_of(plan) if on_one_device else resolved  # one device takes a plan's layer timings only
    given = dict(timed_by.layers) if timed_by is not None else {}
    return layer_timings(units, family, {**given, **dict(layer_timing or {})}) if family else {}


def _distributions(
    resolved: Plan | None,
    family: Family | None,
    options: PlanOptions,
    stage_layers: Mapping[int, list[str]],
    known: Mapping[str, Any],
    kind: ScheduleKind,
    layout: MeshLayout,
    v: int,
) -> dict[str, LayerDistribution]:
    """Where each unit's work lives across its stage's copies: the plan's, else the forced strategy's on the
    critical path (none without a family)."""
    if resolved is not None:
        return dict(resolved.problem.distributions)
    if family is None:
        return {}
    return critical_path_distributions(options, family, stage_layers, known, kind, layout, v)


def _critical_path_programs(
    family: Family | None,
    kind: ScheduleKind,
    layout: MeshLayout,
    N: int,
    v: int,
    timings: Mapping[str, LayerTiming],
    stage_layers: Mapping[int, list[str]],
    distributions: Mapping[str, LayerDistribution],
) -> Programs:
    """The programs without a plan: `naive_programs` over the family's parts (no part without a family)."""
    parts = family.parts if family is not None else ()
    fed_by_gradient = gradient_parts(family) if family is not None else frozenset()
    return naive_programs(
        kind,
        layout.D,
        N,
        layout.W,
        timings,
        stage_layers,
        v=v,
        parts=parts,
        gradient_parts=fed_by_gradient,
        distributions=distributions,
    )


def _run_spec(
    prepared: Prepared,
    resolved: Plan | None,
    family: Family | None,
    known: Mapping[str, Any],
    layout: MeshLayout,
    kind: ScheduleKind,
    N: int,
    v: int,
    timings: dict[str, LayerTiming],
    distributions: dict[str, LayerDistribution],
    recompute: tuple[int, ...],
) -> RunSpec:
    """What every rank runs, the same on each: the split and the programs (the plan's with its start-up steps,
    else the critical path's)."""
    programs = (
        resolved.programs
        if resolved is not None
        else _critical_path_programs(family, kind, layout, N, v, timings, prepared.stage_layers, distributions)
    )
    startup = dict(resolved.startup) if resolved is not None else {}
    stage_names = {s: tuple(names) for s, names in prepared.stage_layers.items()}
    return RunSpec(
        layout,
        kind,
        N,
        v,
        prepared.captured,
        prepared.split,
        prepared.batch,
        input_signature(prepared.example),
        dict(programs),
        startup,
        resolved,
        family,
        known,
        stage_names,
        timings,
        prepared.target.fingerprint,
        distributions,
        recompute,
    )


@dataclass(frozen=True)
class Prepared:
    """A model captured and split as `compile` does it, and the Target a plan for it must be made for."""

    captured: Captured
    units: list[Any]
    split: SplitResult
    stage_layers: dict[int, list[str]]
    target: Target
    example: tuple[Any, ...]
    batch: int
    micro: tuple[Any, ...]


def prepare(
    model: nn.Module,
    example_inputs: Any,
    family: Family | None,
    *,
    kind: ScheduleKind,
    D: int,
    W: int,
    N: int,
    v: int = 1,
    split_points: Sequence[str] | None = None,
    compiled: bool = False,
) -> Prepared:
    """Capture `model` on one micro-batch of the global mini-batch `example_inputs`, find the family's units once,
    split into the schedule's stages and fingerprint the result: `compile`'s first steps, which `fxkfac plan
    path.py:factory` takes too, so that a plan it exports is one `compile` accepts. `compiled`: the stages will run
    under torch.compile (`Target.compiled`)."""
    example = normalize_inputs(example_inputs)
    batch = batch_size(example, "example_inputs")
    micro = shard_microbatches(example, batch, W, 0, N)[0]
    captured = capture(model, micro, family.layer_config if family is not None else KFACConfig())
    units = family.units(captured.gm, captured.layers) if family is not None else []
    split = split_stages(captured.gm, num_stages(kind, D, v), split_points=split_points, layers=captured.layers)
    stage_layers = stage_units(split, units)
    target = Target(
        graph_fingerprint(
            units, stage_layers, schedule=kind.value, D=D, N=N, W=W, v=v, micro_batch_size=batch // (N * W)
        ),
        kind,
        D,
        N,
        W,
        v,
        family.max_period if family is not None else None,
        family.decomp_pieces if isinstance(family, PiecewiseFamily) else 1,
        family.kl_clip_scope.barrier if family is not None else StepBarrier.WORLD,
        warm_start=family is not None and family.warm_start,
        compiled=compiled,
        tied_state=bool(split.shared_params) and isinstance(family, SteppedFamily) and bool(gradient_parts(family)),
    )
    return Prepared(captured, units, split, stage_layers, target, example, batch, micro)


def _resolve(
    plan: Any,
    single: bool,
    family: Family | None,
    prepared: Prepared,
    known: Mapping[str, Any],
    options: PlanOptions,
    layout: MeshLayout,
    progress: PlanProgress,
    resume: str | os.PathLike | None,
    checkpointing: ActivationCheckpointing,
    *,
    autocast_dtype: torch.dtype | None = None,
    cuts: Mapping[int, Prepared] | None = None,
) -> Plan | None:
    """The plan whose programs the ranks run for the `prepared` model (`known`: its units by name): none on one
    device or without preconditioned layers; `progress` shows plan="auto"'s phases, solver and plan on rank 0.
    plan="auto" adopts the plan of the checkpoint it resumes from (`resume`) when that was made for this run (under
    schedule="auto": for any of its candidates, on that candidate's cut), else
    plans with `checkpointing`'s stages, or chooses them under AUTO; a profile runs under the run's
    `autocast_dtype`; schedule="auto" plans each candidate on its own cut of `cuts` (`_auto_cuts`)."""
    if family is None:
        if plan not in (None, "auto"):
            raise ConfigError("preconditioner=None trains the plain pipeline, which takes no plan; pass plan=None")
        return None
    if single or not known:
        return None
    auto = isinstance(plan, str) and plan == "auto"
    adopted = None
    if auto and resume is not None:  # schedule="auto": the plan of any candidate it was saved with
        runs = [at for cut in cuts.values() for at in _at_each_choice(cut)] if cuts else [prepared]
        for run in runs:
            adopted = resumed_plan(resume, run.target, run.stage_layers, rank=layout.rank, world=layout.world_size)
            if adopted is not None:
                break
    if adopted is not None:
        progress.note(f"adopting the plan checkpoint {resume} was saved with (made for this graph, mesh and schedule)")
        progress.done(adopted)
        return adopted
    if auto and layout.rank == 0:  # rank 0 plans: its device's memory is the default budget
        budgeted = auto_budget(
            options, lambda: device_memory(_held_parameters(prepared.split, prepared.target, layout.pp))
        )
        if budgeted is not options:
            progress.note(
                f"memory budget {format_bytes(budgeted.memory_budget or 0)} per device: what the GPU has "
                "free (PlanOptions(memory_budget=...) sets another)"
            )
        options = budgeted
    made = _resolve_on_mesh(
        plan,
        family,
        prepared,
        known,
        options,
        layout,
        progress,
        checkpointing,
        autocast_dtype=autocast_dtype,
        cuts=cuts,
    )
    if made is not None and auto:
        progress.done(made)
    return made


def _splits_backward(target: Target) -> bool:
    """Whether a plan for `target` may run a zero-bubble schedule (its own, or one `schedule="auto"` chooses among),
    whose planner takes each stage's W out of its backward: the profile then times W (`profile`'s split_backward)."""
    kinds = {target.schedule, *(c.kind for c, _ in target.choices)}
    return bool(kinds & ZERO_BUBBLE_KINDS)


def _resolve_on_mesh(
    plan: Any,
    family: Family,
    prepared: Prepared,
    known: Mapping[str, Any],
    options: PlanOptions,
    layout: MeshLayout,
    progress: PlanProgress,
    checkpointing: ActivationCheckpointing,
    *,
    autocast_dtype: torch.dtype | None = None,
    cuts: Mapping[int, Prepared] | None = None,
) -> Plan | None:
    """`resolve_plan` with plan="auto"'s profile (links and stages measured by every rank), each phase
    and the solver's reports shown by `progress`; schedule="auto"'s `cuts` (`_auto_cuts`) each profiled alike, W
    timed on those a zero-bubble candidate runs."""
    from fxkfac.comm_profile import measure_comm

    profiles = isinstance(plan, str) and plan == "auto" and options.costs is None
    if profiles:
        progress.phase("measuring the links between ranks")
    comm = measure_comm() if profiles else None  # collective: every rank, before every rank profiles the stages

    def profile_of(cut: Prepared) -> Callable[[], CostTable]:
        return lambda: _profiled(cut, family, known, progress, comm, autocast_dtype)

    own = len(prepared.split.stages)
    more = {S: Cut(cut.stage_layers, profile_of(cut)) for S, cut in (cuts or {}).items() if S != own}
    if isinstance(plan, str) and plan == "auto" and not profiles:
        progress.phase(SOLVING)
    return resolve_plan(
        plan,
        prepared.target,
        options,
        rank=layout.rank,
        world=layout.world_size,
        profile=profile_of((cuts or {}).get(own, prepared)),
        stage_layers=prepared.stage_layers,
        layers=known,
        progress=progress.solver if progress.shown else None,
        checkpointing=checkpointing,
        cuts=more,
    )


def _profiled(
    prepared: Prepared,
    family: Family,
    known: Mapping[str, Any],
    progress: PlanProgress,
    comm: Any,
    autocast_dtype: torch.dtype | None,
) -> CostTable:
    """The profile of `prepared`'s stages (`fxkfac.profiler.profile`, W timed where its target may run a zero-bubble
    schedule) with the links' `comm`, as the planner plans `family`."""
    from fxkfac.profiler import profile as measure

    split, stage_layers = prepared.split, prepared.stage_layers
    progress.phase(f"profiling the {len(split.stages)} stage(s)")
    flat = [x for x in prepared.micro if isinstance(x, Tensor)]
    tapped = gradient_parts(family) != frozenset(family.parts)  # a refresh step taps the captured layers
    captured = {s: [known[n] for n in names] for s, names in stage_layers.items()} if tapped else {}
    params = {n: p for st in split.stages for n, p in st.gm.named_parameters()}
    unit_cost = family.unit_cost(known, params)
    costs = measure(
        split,
        stage_layers,
        unit_cost,
        flat,
        _surrogate_loss,
        captured=captured,
        autocast_dtype=autocast_dtype,
        split_backward=_splits_backward(prepared.target),
        unit_params={n: family.params_of(known[n]) for names in stage_layers.values() for n in names},
    )
    for st in split.stages:  # profiling ran backward on the parameters the runners will train
        for p in st.gm.parameters():
            p.grad = None
    progress.phase(SOLVING)
    return replace(costs, comm=comm, family=planned_kind(family, costs.family))


def planned_kind(family: Family, profiled: PreconditionerKind) -> PreconditionerKind:
    """The kind the planner plans a profile of `family` as: Muon's (no refresh; its APPLYs, every step, streamed to
    and dealt over idle ranks, in pieces by iterations; planner/problem/analytic.py) for Muon, else what the profiler
    tagged (`profiled`)."""
    return PreconditionerKind.MUON if family.name == PreconditionerKind.MUON.value else profiled


def auto_budget(options: PlanOptions, available: Callable[[], int | None]) -> PlanOptions:
    """`options` with the device's memory as the budget when the user set none (`available()`: bytes a plan may
    use there, None on CPU: unlimited); the user's budget always wins, and a plan that cannot meet either is
    refused with the least that fits."""
    if options.memory_budget is not None:
        return options
    found = available()
    return options if found is None else replace(options, memory_budget=found)


def device_memory(params: Sequence[Tensor]) -> int | None:
    """Bytes a plan may use on the GPU that holds `params`: what it reports free, plus those parameters (the plan
    counts them itself). None when they are not on a GPU (no default budget on CPU)."""
    on_gpu = [p for p in params if p.device.type == "cuda"]
    if not on_gpu:
        return None
    free, _ = torch.cuda.mem_get_info(on_gpu[0].device)
    return free + sum(p.numel() * p.element_size() for p in on_gpu if p.device == on_gpu[0].device)


def _held_parameters(split: SplitResult, target: Target, rank: int) -> list[Tensor]:
    """The parameters of the stages pipeline rank `rank` holds (each once)."""
    held = {s for s, _ in stages_of_rank(target.schedule, target.D, rank, v=target.v)}
    unique = {id(p): p for s in sorted(held) for p in split.stages[s].gm.parameters()}
    return list(unique.values())


def critical_path_distributions(
    options: PlanOptions,
    family: Family,
    stage_layers: Mapping[int, list[str]],
    units: Mapping[str, Any],
    kind: ScheduleKind,
    layout: MeshLayout,
    v: int,
) -> dict[str, LayerDistribution]:
    """The forced strategy (`PlanOptions.strategy`) on every unit of the critical-path programs, columns dealt
    by KAISA's greedy on each unit's statistic sizes^1.5 (a square factor's dim^3); COMM-OPT when none is forced."""
    strategy = options.forced_strategy
    if strategy is None:
        return {}
    if strategy.local_factors and gradient_parts(family):
        raise ConfigError(
            f"dp-kfac keeps local factors of captures, but {family.name}'s statistics come from the "
            "reduced gradient, the same on every copy; use mem-opt for one owner per unit"
        )
    costs = {
        name: sum(math.prod(family.stats_shape(unit, part)) ** 1.5 for part in family.parts)
        for name, unit in units.items()
    }
    return distribute(strategy, stage_layers, ranks_of_stages(kind, layout.D, layout.W, v), costs)


def _plan_of(plan: str | Path | Plan) -> Plan:
    """A plan object from a Plan or a plan file (validated against its own problem)."""
    return plan if isinstance(plan, Plan) else load_plan(plan)


def _surrogate_loss(outputs: Sequence[Tensor]) -> Tensor:
    """A scalar of the last stage's outputs for profiling its backward (no targets are known yet)."""
    return torch.stack([o.float().mean() for o in outputs if o.is_floating_point()]).sum()


def stage_units(split: SplitResult, units: Sequence[Any]) -> dict[int, list[str]]:
    """The names of the units each stage preconditions: a layer on the stage its split tags name, a parameter on the
    stage that holds it; a parameter several stages share (tied weights) once, on its owner (`tied_owner`)."""
    owner = {name: tied_owner(stages) for name, stages in split.shared_params.items()}
    return {
        st.index: [
            u.name
            for u in units
            if u.name in st.layers or (u.name in st.params and owner.get(u.name, st.index) == st.index)
        ]
        for st in split.stages
    }


def layer_timings(units: Sequence[Any], family: Family, given: Mapping[str, LayerTiming]) -> dict[str, LayerTiming]:
    """Each unit's timing: ``given`` where it names it, else ``LayerTiming(refresh_every, refresh_phase, 0,
    capture)`` with the family's defaults.

    ConfigError for timings of unknown units or with invalid fields.
    """
    names = [unit.name for unit in units]
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise ConfigError(
            f"layer_timing names layers that {family.name} does not precondition in this model: "
            f"{unknown}; its units are {names}"
        )
    out = {}
    for name in names:
        t = given.get(name, LayerTiming(family.refresh_every, family.refresh_phase, 0, family.capture))
        if t.period < 1 or not 0 <= t.curv_step < t.period or t.use_offset < 0:
            raise ConfigError(
                f"invalid LayerTiming for {name}: {t} (need period >= 1, 0 <= curv_step < period, use_offset >= 0)"
            )
        out[name] = t
    return out
