"""The plan a run uses: plan="auto" (profile, solve, share) | a plan file | a Plan, checked against the graph."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from fxkfac import errors
from fxkfac.config import ActivationCheckpointing, CheckpointMode, PlanOptions
from fxkfac.errors import ConfigError, FxkfacError
from fxkfac.passes.layers import KFACLayer
from fxkfac.planner import (
    Budget,
    CostTable,
    Distributions,
    Overhead,
    Plan,
    PlanError,
    PlanMismatchError,
    Problem,
    ScheduleKind,
    SearchOptions,
    SolveProgress,
    SolverConfig,
    StepBarrier,
    TimeLimit,
    check_plan,
    parse_plan,
    read_plan,
)
from fxkfac.planner import plan as plan_search
from fxkfac.planner.problem import load_cost_table
from fxkfac.planner.problem.costs import median_of, words_of
from fxkfac.planner.problem.schedules import num_stages
from fxkfac.planner.search import ScheduleCandidate, StreamApply, choose_schedule

__all__ = [
    "Target",
    "Cut",
    "resolve_plan",
    "solve_for",
    "check_matches",
    "check_costs",
    "load_plan_for",
    "resumed_plan",
    "share_plan",
    "gathered_profile",
]


log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Target:
    """What a plan must be made for: the graph fingerprint, schedule, D, N, W and v of the run, the longest
    refresh period the family accepts (None: the planner's own limit) and the pieces it makes each decomposition
    in (`KFACConfig.split_inverse`, `ShampooConfig.newton_pieces`; 1: whole)."""

    fingerprint: str
    schedule: ScheduleKind
    D: int
    N: int
    W: int
    v: int = 1
    max_period: int | None = None
    decomp_pieces: int = 1
    barrier: StepBarrier = StepBarrier.WORLD
    """Which ranks each step's end waits for (the family's `kl_clip_scope.barrier`)."""
    warm_start: bool = False
    """Whether the family's decompositions start from the previous one (`Family.warm_start`)."""
    compiled: bool = False
    """Whether the stages run compiled (`compile(backend=...)`): each backward then makes every gradient at its end,
    so a streamed APPLY overlaps nothing of it (`planner.problem.lowering.Streaming.whole_backward`)."""
    choices: tuple[tuple[ScheduleCandidate, str], ...] = ()
    """compile(schedule="auto"): the schedules plan="auto" chooses among (`planner.search.plan_search`), each with the
    graph fingerprint of the run under it (on its own cut: `Cut`); empty: `schedule` is the run's."""
    tied_state: bool = False
    """Whether a parameter several stages share (tied weights) is a unit whose per-step work keeps state (Shampoo,
    SOAP): its gradient is complete only once the stages' sum lands, after the backward that would stream it, so
    nothing streams (docs/STREAMED_APPLY.md, "Stateful units")."""

    def describe(self) -> str:
        """The run in words, for error messages."""
        return f"{self.schedule.value} D={self.D} N={self.N} W={self.W} v={self.v}, graph {self.fingerprint}"


@dataclass(frozen=True)
class Cut:
    """One more cut of the model into stages that schedule="auto" plans candidates on (those of `Target.choices` that
    run its stage count): its stages' units and its profile, both as `resolve_plan` takes the run's own."""

    stage_layers: Mapping[int, Sequence[str]]
    profile: Callable[[], CostTable]


CutCosts = Mapping[int, Callable[[], CostTable]]
"""The cost table of each more cut, by its stage count; the call raises where it has none (a profile failed, a given
cost table of another stage count), which leaves that cut's candidates out of the choice with the reason."""


def resolve_plan(
    plan: Any,
    target: Target,
    options: PlanOptions,
    *,
    rank: int,
    world: int,
    profile: Callable[[], CostTable],
    stage_layers: Mapping[int, Sequence[str]],
    layers: Mapping[str, KFACLayer],
    progress: Callable[[SolveProgress], None] | None = None,
    checkpointing: ActivationCheckpointing = ActivationCheckpointing(),
    cuts: Mapping[int, Cut] | None = None,
) -> Plan | None:
    """The Plan every rank runs: None, a checked Plan, a loaded file, or the auto plan rank 0 makes and shares.

    `plan="auto"` plans with `options.costs` (a CostTable, a cost file, or a callable
    ``(stage_layers, layers) -> CostTable``), or with `profile()` times scaled by `options.kfac_margin`: every
    rank profiles at once and rank 0 plans with the median of their tables (`gathered_profile`);
    `progress` observes the solver (`SolverConfig.progress`); `checkpointing` says which stages recompute
    (`solve_for`). `cuts` (schedule="auto"): the other cuts the candidates of `target.choices` run, by stage count,
    each profiled as the run's own (every rank, in the order given) and planned with its own table.
    """
    if plan is None:
        return None
    if isinstance(plan, str) and plan == "auto":
        more = dict(cuts or {})
        if world == 1:
            lazy = {S: _later(options, cut.profile, cut.stage_layers, layers) for S, cut in more.items()}
            costs = _costs(options, profile, stage_layers, layers)
            return solve_for(target, costs, options, progress, checkpointing, lazy)
        gather = options.costs is None
        profiled = gathered_profile(profile, rank) if gather else None
        others = {S: gathered_profile(cut.profile, rank) if gather else None for S, cut in more.items()}
        made: Plan | FxkfacError | None = None
        if rank == 0:
            try:
                cut_costs = {
                    S: _later(options, _measured(cut.profile, others[S]), cut.stage_layers, layers)
                    for S, cut in more.items()
                }
                costs = _costs(options, _measured(profile, profiled), stage_layers, layers)
                made = solve_for(target, costs, options, progress, checkpointing, cut_costs)
            except FxkfacError as e:  # every rank raises it, instead of waiting for a plan that never comes
                made = e
        return share_plan(made)
    if isinstance(plan, (str, Path)):
        return load_plan_for(plan, target, stage_layers)
    if isinstance(plan, Plan):
        check_matches(plan, target)
        return plan
    raise ConfigError(f"plan must be 'auto', None, a plan file path or a fxkfac.Plan, got {type(plan).__name__}")


def _measured(profile: Callable[[], CostTable], gathered: CostTable | FxkfacError | None) -> Callable[[], CostTable]:
    """The profile rank 0 plans with: the ranks' `gathered` table (`gathered_profile`), its error raised, or
    `profile` itself where none was gathered (`PlanOptions.costs` given)."""
    if gathered is None:
        return profile

    def table() -> CostTable:
        if isinstance(gathered, FxkfacError):
            raise gathered
        return gathered

    return table


def _later(
    options: PlanOptions,
    profile: Callable[[], CostTable],
    stage_layers: Mapping[int, Sequence[str]],
    layers: Mapping[str, KFACLayer],
) -> Callable[[], CostTable]:
    """`_costs` of one more cut when the choice first asks for it, then the same table (one profile per cut)."""
    made: list[CostTable] = []

    def costs() -> CostTable:
        if not made:
            made.append(_costs(options, profile, stage_layers, layers))
        return made[0]

    return costs


def _costs(
    options: PlanOptions,
    profile: Callable[[], CostTable],
    stage_layers: Mapping[int, Sequence[str]],
    layers: Mapping[str, KFACLayer],
) -> CostTable:
    """The cost table to plan with (see `resolve_plan`), checked against the split."""
    source = options.costs
    if source is None:
        log.info(
            "planning K-FAC from the stages' profile (K-FAC times planned %.0f%% longer)",
            100 * (options.kfac_margin - 1),
        )
        return profile().scale_kfac_times(options.kfac_margin)
    if isinstance(source, (str, Path)):
        costs = load_cost_table(source)
    elif isinstance(source, CostTable):
        costs = source
    elif callable(source):
        costs = source(stage_layers, layers)
    else:
        raise ConfigError(
            f"PlanOptions.costs must be a CostTable, a cost file or a callable, got {type(source).__name__}"
        )
    check_costs(costs, stage_layers)
    return costs


def solve_for(
    target: Target,
    costs: CostTable,
    options: PlanOptions,
    progress: Callable[[SolveProgress], None] | None = None,
    checkpointing: ActivationCheckpointing = ActivationCheckpointing(),
    cut_costs: CutCosts | None = None,
) -> Plan:
    """Plan `target` with CP-SAT over `costs` (the planner's `plan`: one search, one time limit), stamped with the
    target's fingerprint; with `Target.choices`, the plan of the schedule the planner chooses among them
    (`planner.search.plan_search.choose_schedule`: the least step at the freshest curvature), the choice logged,
    each candidate planned over `costs` where it runs their stage count, else over its cut's (`cut_costs`).

    With `options.max_overhead` None the bubbles are tried alone first; when they cannot hold the work, the
    least max_overhead the planner found to place it is used (its refusal names that value), and logged.
    `options.strategy` forces a distribution strategy; None lets the planner choose (planner/search/choose.py).
    `progress` observes the solver (`SolverConfig.progress`). The stages `checkpointing` names recompute their
    forward; under AUTO the planner chooses them for the memory budget (`planner.search.plan_search.choose_recompute`).
    """
    strict = options.max_overhead is not None
    problem = Problem(
        target.schedule.value,
        target.D,
        target.N,
        costs,
        W=target.W,
        v=target.v,
        memory_budget=options.memory_budget,
        max_overhead=options.max_overhead or 0.0,
        fingerprint=target.fingerprint,
        decomp_pieces=target.decomp_pieces,
        warm_start=target.warm_start,
        barrier=target.barrier,
        recompute=checkpointing.stages,
    )
    if target.max_period is not None:
        problem = replace(problem, max_period=target.max_period)
    search = SearchOptions(
        solver=SolverConfig(time_limit_s=options.time_limit_s, deterministic=options.deterministic, progress=progress),
        strategy=Distributions.CHOSEN if options.forced_strategy is None else options.forced_strategy,
        stream_apply=StreamApply.OFF if target.tied_state else options.stream_apply,
        whole_backward=target.compiled,
        choose_recompute=checkpointing.mode is CheckpointMode.AUTO,
        overhead=Overhead.STRICT if strict else Overhead.LEAST,
        time_limit=TimeLimit.WHOLE_SEARCH,  # as `fxkfac plan`: the time limit bounds the whole search
    )
    log.info("solving the plan of %s", target.describe())
    made = plan_search(problem, search) if not target.choices else _chosen_schedule(target, problem, search, cut_costs)
    if not strict and made.problem.max_overhead > 0:
        log.warning(
            "plan='auto': the bubbles alone cannot hold the %s work; planning with max_overhead=%.4g, the least the "
            "planner found that places it (pass PlanOptions(max_overhead=...) to decide yourself)",
            words_of(costs).name,
            made.problem.max_overhead,
        )
    return made


def _chosen_schedule(target: Target, problem: Problem, search: SearchOptions, cut_costs: CutCosts | None) -> Plan:
    """The plan of the schedule the planner chooses among `target.choices`, each over the costs of its own cut, all of
    it in one budget of `search`'s time limit (`planner.search.choose_schedule`)."""
    fingerprints = dict(target.choices)
    tables = {problem.num_stages: lambda: problem.costs, **(cut_costs or {})}

    def problem_for(candidate: ScheduleCandidate) -> Problem:
        S = num_stages(candidate.kind, target.D, candidate.v)
        if S not in tables:
            raise PlanError(f"no cost table of its {S} stages to plan it with")
        return replace(
            problem,
            costs=tables[S](),
            schedule=candidate.kind.value,
            v=candidate.v,
            fingerprint=fingerprints[candidate],
        )

    whole = Budget.of(search.solver, whole=True)  # PlanOptions.time_limit_s bounds the whole choice
    choice = choose_schedule(
        list(fingerprints), problem_for, lambda p, part: plan_search(p, search, budget=part), whole
    )
    log.warning("schedule='auto': %s", choice.reason)
    return choice.plan


def check_matches(plan: Any, target: Target, where: str = "the plan") -> None:
    """PlanMismatchError unless `plan` was made for `target` (mesh and schedule first: the clearer message)."""
    p = plan.problem
    made = (str(p.schedule), p.D, p.N, p.W, p.v)
    want = (target.schedule.value, target.D, target.N, target.W, target.v)
    if made != want:
        raise PlanMismatchError(
            f"{where} was made for {made[0]} D={made[1]} N={made[2]} W={made[3]} v={made[4]}, "
            f"but this run is {target.describe()}; make a plan for this mesh and schedule "
            "(fxkfac plan ... --export) or pass plan='auto'"
        )
    if plan.problem.decomp_pieces != target.decomp_pieces:
        raise PlanMismatchError(
            f"{where} makes each decomposition in {plan.problem.decomp_pieces} piece(s), this run "
            f"in {target.decomp_pieces} (KFACConfig.split_inverse, ShampooConfig.newton_pieces); "
            "make a plan with this configuration or pass plan='auto'"
        )
    if target.warm_start and not plan.problem.chains_refreshes:
        raise PlanMismatchError(
            f"{where} was made for decompositions that start from scratch, but this run's start from the "
            "layer's previous one (SOAP's BasisMethod.QR, KFACConfig.split_inverse), so each refresh must be "
            "made before the next one's decomposition starts; make a plan with this configuration (fxkfac plan "
            "--preconditioner soap) or pass plan='auto'"
        )
    if plan.fingerprint != target.fingerprint:
        raise PlanMismatchError(
            f"{where} was made for graph {plan.fingerprint!r}, not this model's "
            f"{target.fingerprint!r} (other layers, widths or stage split); make a new plan "
            "for this model or pass plan='auto'"
        )


def check_costs(costs: CostTable, stage_layers: Mapping[int, Sequence[str]]) -> None:
    """PlanMismatchError unless `costs` has one stage per stage graph with exactly that stage's K-FAC layers."""
    if len(costs.stages) != len(stage_layers):
        raise PlanMismatchError(
            f"the cost table has {len(costs.stages)} stages, the split model has "
            f"{len(stage_layers)}; make the cost table for this split"
        )
    for s, stage in enumerate(costs.stages):
        have, want = sorted(x.name for x in stage.layers), sorted(stage_layers[s])
        if have != want:
            raise PlanMismatchError(
                f"stage {s} of the cost table has K-FAC layers {have}, the split model "
                f"{want}; make the cost table for this model and split"
            )


def load_plan_for(path: str | Path, target: Target, stage_layers: Mapping[int, Sequence[str]]) -> Plan:
    """Read a plan file once, refuse one made for another graph/mesh/schedule or for other K-FAC layers than
    the split model's `stage_layers`, then validate it; every error names the file."""
    plan = read_plan(path)
    check_matches(plan, target, f"the plan file {path}")
    have = {s: sorted(x.name for x in stage.layers) for s, stage in enumerate(plan.problem.costs.stages)}
    want = {s: sorted(names) for s, names in stage_layers.items()}
    if have != want:
        wrong = sorted(set().union(*have.values()) - set().union(*want.values()))
        raise PlanMismatchError(
            f"the plan file {path} times K-FAC layers per stage {have}, but this model's "
            f"are {want}"
            + (f" (it has no layers {wrong})" if wrong else "")
            + "; make a new plan for this model (fxkfac plan ... --export) or pass plan='auto'"
        )
    try:
        check_plan(plan.problem, plan)
    except PlanError as e:
        raise PlanError(f"the plan file {path}: {e}") from e
    return plan


def resumed_plan(
    path: str | os.PathLike, target: Target, stage_layers: Mapping[int, Sequence[str]], *, rank: int, world: int
) -> Plan | None:
    """The plan checkpoint `path` was saved with, for plan="auto" to adopt on a relaunch (`compile(resume_from=...)`):
    rank 0 reads it with `load_plan_for`'s checks and every rank gets it (collective). None, so that plan="auto" plans
    anew, when there is no checkpoint or no plan there, or the plan was made for another graph, mesh or schedule
    (logged: the load then follows the state onto the new plan, [Note: resharding] in fxkfac/checkpoint.py)."""
    from fxkfac.checkpoint import plan_file

    made: Plan | FxkfacError | None = None
    if rank == 0:
        file = plan_file(path)
        try:
            made = None if file is None else load_plan_for(file, target, stage_layers)
        except PlanMismatchError as e:
            log.info("plan='auto' plans anew: the plan of checkpoint %s is not this run's (%s)", path, e)
        except FxkfacError as e:  # every rank raises it, instead of waiting for a plan that never comes
            made = e
    if world > 1:
        import torch.distributed as dist

        box: list[Any] = [
            made.to_json(indent=None) if isinstance(made, Plan) else None if made is None else _sent(made)
        ]
        dist.broadcast_object_list(box, src=0)
        made = _unpacked(box[0], f"rank 0 could not read the plan of checkpoint {path}")
    if isinstance(made, FxkfacError):
        raise made
    return made


def _unpacked(sent: str | list[str] | None, context: str) -> Plan | FxkfacError | None:
    """What `resumed_plan`'s broadcast carried: a plan's JSON, an error (`_sent`) or nothing."""
    if isinstance(sent, list):
        return _received(sent, context)
    return None if sent is None else parse_plan(sent)


def gathered_profile(profile: Callable[[], CostTable], rank: int, dst: int = 0) -> CostTable | FxkfacError | None:
    """Every rank's `profile()` at once, as every rank computes in training, combined on rank `dst` into one table
    of each figure's median over the ranks (`planner.problem.costs.median_of`), or the first rank's error; None on the
    other ranks (collective over the default group)."""
    import torch.distributed as dist

    mine: list[str] | str
    try:
        mine = profile().to_json(indent=None)
    except FxkfacError as e:  # sent, so that no rank waits for a table that never comes
        mine = _sent(e)
    box: list[Any] | None = [None] * dist.get_world_size() if rank == dst else None
    dist.gather_object(mine, box, dst=dst)
    if box is None:
        return None
    failed = [got for got in box if isinstance(got, list)]
    if failed:
        return _received(failed[0], f"rank {box.index(failed[0])} could not profile")
    return median_of([CostTable.from_json(text) for text in box])


def _sent(error: object) -> list[str]:
    """An error as a collective carries it: its type's name and its message."""
    return [type(error).__name__, str(error)]


def _received(sent: list[str], context: str) -> FxkfacError:
    """The error `_sent` carried, of the same type (FxkfacError when unknown here), its message after `context`."""
    return getattr(errors, str(sent[0]), FxkfacError)(f"{context}: {sent[1]}")


def share_plan(plan: Plan | FxkfacError | None, src: int = 0) -> Plan:
    """Every rank gets rank `src`'s plan (its JSON broadcast over the default group; collective), or raises the
    error rank `src` met making it (same type and message on every rank)."""
    import torch.distributed as dist

    box: list[Any] = [None]
    if dist.get_rank() == src:
        box = [plan.to_json(indent=None) if isinstance(plan, Plan) else _sent(plan)]
    dist.broadcast_object_list(box, src=src)
    text = box[0]
    if isinstance(text, list):
        raise _received(text, f"rank {src} could not plan")
    if not isinstance(text, str):
        raise AssertionError("plan broadcast delivered no JSON text")
    return parse_plan(text)
