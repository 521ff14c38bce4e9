"""The planning problem: schedule, mesh, costs, budget; its base timeline and bubbles (memory: planner/memory.py)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from enum import StrEnum
from functools import cached_property, lru_cache
from typing import Any, TypeVar

from fxkfac.planner.costs import CostTable, StageCost
from fxkfac.planner.errors import ConfigError, PlanError, PlanFormatError
from fxkfac.planner.ir import Op, OpKind
from fxkfac.planner.lowering import add_send_recv, expand_dp, linked_classes, ranks_of_stages, step_applies
from fxkfac.planner.schedules import ScheduleKind, num_stages, schedule_programs, validate_schedule_args
from fxkfac.planner.simulate import Timeline, simulate, utilization
from fxkfac.planner.strategy import (
    LayerDistribution,
    Strategy,
    distribute,
    grad_workers,
    keeps_statistics,
)

__all__ = [
    "StepBarrier",
    "Problem",
    "SolverConfig",
    "SolveProgress",
    "StepTimeline",
    "StageGroup",
    "base_programs",
    "reference_programs",
    "step_timeline",
    "plain_step_time",
    "plain_utilization",
    "stage_groups",
    "copies_of_stage",
    "stages_on_device",
    "refresh_lower_bound",
    "stretch_allowance",
    "format_bytes",
    "gradient_stats",
    "gradient_allreduce_seconds",
    "StageComm",
    "stage_comm",
    "agreement_set",
    "steps_overlap",
    "early_start",
    "window_length",
    "step_begins",
    "slot_seconds",
]

_FIXED_KINDS = frozenset({OpKind.FWD, OpKind.BWD})
_NOT_BUBBLE = frozenset({OpKind.APPLY, OpKind.STATS, OpKind.BCAST_PREC, OpKind.ALLREDUCE_GRAD})
"""Ops besides F/B during which a window places no preconditioner work (the per-step slot's work, and the
gradient all-reduce: planner/window.py `build_window`)."""


class StepBarrier(StrEnum):
    """Which ranks a step's end waits for ([Note: step barrier] in planner/window.py; the runtime's
    `KFACConfig.kl_clip_scope`)."""

    WORLD = "world"
    """Every rank (KL-clip scope global): the idle before and after a step boundary never join."""
    AGREEMENT_SET = "agreement-set"
    """The rank's agreement set only (KL-clip scope stage or stale): the ranks holding copies of the same
    parameters, which the planner takes as the devices of the rank's stage group (tied weights, which can join
    two groups, are not in the planner's data)."""


@dataclass(frozen=True)
class Problem:
    """What to plan: the pipeline, the costs, the device memory and the step-time tolerance.

    schedule/D/N/W/v: the pipeline (pp size D, dp size W, N micro-batches per replica, v virtual
    stages for "interleaved"). costs: one StageCost per (virtual) stage. memory_budget: bytes per
    device, None for unlimited. max_overhead: how much the step may grow over the plain pipeline
    with preconditioning, as a fraction of that reference step (0.0: only bubbles are used); fused
    curvature and idle time appended to every step (see [Note: stretch] in planner/window.py) share
    it. fingerprint: the graph the plan is for
    (opaque here). max_period: the longest refresh period the planner may choose. distributions: where each
    layer's work lives among its stage's copies, as (layer, distribution) pairs sorted by layer (hashable;
    `with_distributions` makes them from a mapping; planner/strategy.py; absent layers: COMM-OPT).
    """

    schedule: str
    D: int
    N: int
    costs: CostTable
    W: int = 1
    v: int = 1
    memory_budget: int | None = None
    max_overhead: float = 0.0
    hardware: str = ""
    fingerprint: str = ""
    max_period: int = 32
    distributions: tuple[tuple[str, LayerDistribution], ...] = ()
    decomp_pieces: int = 1
    """How many DECOMP tasks each part's decomposition is cut into (`KFACConfig.split_inverse.pieces`,
    `ShampooConfig.newton_pieces`): piece i costs 1/n of the part's `decomp` and runs after piece i-1 on the same
    rank ("DECOMP s A i/n layer")."""
    barrier: StepBarrier = StepBarrier.WORLD
    """Which ranks each step's end synchronizes ([Note: step barrier] in planner/window.py)."""

    def __post_init__(self) -> None:
        kind = validate_schedule_args(self.schedule, self.D, self.N, self.v)
        object.__setattr__(self, "schedule", kind.value)
        if not self.hardware:
            object.__setattr__(self, "hardware", self.costs.hardware)
        if not isinstance(self.W, int) or self.W < 1:
            raise PlanError(f"the data-parallel size W must be an int >= 1, got {self.W!r}")
        S = num_stages(kind, self.D, self.v)
        if len(self.costs.stages) != S:
            raise PlanError(f"the cost table has {len(self.costs.stages)} stages but {kind} with D={self.D}, "
                            f"v={self.v} has {S}; make the cost table for {S} stages")
        budget = self.memory_budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0):
            raise PlanError(f"memory_budget must be a positive int (bytes) or None, got {budget!r}")
        if not (isinstance(self.max_overhead, (int, float)) and 0 <= self.max_overhead < 10):
            raise PlanError(f"max_overhead is a fraction in [0, 10), got {self.max_overhead!r}")
        if not isinstance(self.max_period, int) or self.max_period < 1:
            raise PlanError(f"max_period must be an int >= 1, got {self.max_period!r}")
        try:
            object.__setattr__(self, "barrier", StepBarrier(self.barrier))
        except ValueError:
            raise PlanError(f"barrier must be one of {[b.value for b in StepBarrier]}, got {self.barrier!r}") from None
        if isinstance(self.decomp_pieces, bool) or not isinstance(self.decomp_pieces, int) or self.decomp_pieces < 1:
            raise PlanError(f"decomp_pieces must be an int >= 1, got {self.decomp_pieces!r}")
        if [n for n, _ in self.distributions] != sorted({n for n, _ in self.distributions}):
            raise PlanError("Problem.distributions must be (layer, distribution) pairs sorted by distinct layer; "
                            "use Problem.with_distributions")
        unknown = sorted({n for n, _ in self.distributions} - set(self.costs.layer_names))
        if unknown:
            raise PlanError(f"distributions name layers {unknown[:3]} that are not in the cost table")
        for name, where in self.distributions:
            grad_workers(copies_of_stage(self, self.costs.stage_of(name)), where)  # ConfigError for a bad column
            captured = any(p.after is not OpKind.ALLREDUCE_GRAD for p in self.costs.layer(name).parts)
            if where.strategy.local_factors and not captured:
                raise ConfigError(f"{where.strategy} keeps local factors of captures, but {name}'s statistics come "
                                  "from the reduced gradient, the same on every copy; use mem-opt for one owner")

    def __hash__(self) -> int:
        """The fields' hash, computed once: the planner's caches (lru_cache) key on problems millions of times,
        and hashing the cost table each time was most of a data-parallel plan's time."""
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(tuple(getattr(self, f.name) for f in fields(self)))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __getstate__(self) -> dict[str, Any]:
        """The fields alone: the cached hash is of this process's string hashes, not another's."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @cached_property
    def _where(self) -> dict[str, LayerDistribution]:
        return dict(self.distributions)

    def with_distributions(self, distributions: Mapping[str, LayerDistribution]) -> Problem:
        """The same problem with these layer distributions (every other layer COMM-OPT, which is not listed: a
        problem has one form whatever way COMM-OPT is given)."""
        named = sorted((n, d) for n, d in distributions.items() if d != LayerDistribution())
        return replace(self, distributions=tuple(named))

    def with_strategy(self, strategy: Strategy) -> Problem:
        """Every layer under `strategy`, each stage's layers dealt to its columns by KAISA's greedy on their
        decomposition seconds (`planner.strategy.distribute`)."""
        holders = {s: copies_of_stage(self, s) for s in range(self.num_stages)}
        layers = {s: [x.name for x in stage.layers] for s, stage in enumerate(self.costs.stages)}
        costs = {x.name: x.inv for stage in self.costs.stages for x in stage.layers}
        return self.with_distributions(distribute(strategy, layers, holders, costs))

    def where(self, layer: str) -> LayerDistribution:
        """The distribution of `layer` (COMM-OPT unless `distributions` names it)."""
        return self._where.get(layer, LayerDistribution())

    def workers(self, layer: str) -> tuple[int, ...]:
        """The ranks that decompose and apply `layer`'s preconditioner (all copies of its stage under COMM-OPT)."""
        return grad_workers(copies_of_stage(self, self.costs.stage_of(layer)), self.where(layer))

    @property
    def kind(self) -> ScheduleKind:
        """The schedule as an enum."""
        return ScheduleKind(self.schedule)

    @property
    def num_stages(self) -> int:
        """S, the number of (virtual) stages."""
        return len(self.costs.stages)

    @property
    def devices(self) -> tuple[int, ...]:
        """Global ranks 0..D*W-1 (rank = pp * W + dp)."""
        return tuple(range(self.D * self.W))

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able form (the cost table nested in its own schema)."""
        return {"schedule": self.schedule, "D": self.D, "N": self.N, "W": self.W, "v": self.v,
                "costs": self.costs.to_dict(), "memory_budget": self.memory_budget,
                "max_overhead": self.max_overhead, "hardware": self.hardware,
                "fingerprint": self.fingerprint, "max_period": self.max_period,
                **({"distributions": {n: str(d) for n, d in self.distributions}} if self.distributions else {}),
                **({"decomp_pieces": self.decomp_pieces} if self.decomp_pieces > 1 else {}),
                **({"barrier": self.barrier.value} if self.barrier is not StepBarrier.WORLD else {})}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Problem:
        """Inverse of `to_dict`; a malformed entry raises PlanFormatError."""
        try:
            where = sorted((str(n), LayerDistribution.parse(str(d))) for n, d in data.get("distributions", {}).items())
            return cls(**{**data, "costs": CostTable.from_dict(data["costs"]), "distributions": tuple(where)})
        except (KeyError, TypeError, ConfigError) as e:
            raise PlanFormatError(f"the plan's problem is malformed: {e}") from e


@dataclass(frozen=True)
class SolveProgress:
    """What CP-SAT reports while it places one window (planner/cpsat.py): each placement it finds, then the
    call's end. Plain data, so a front can render it without the planner knowing how."""

    window: str
    """The window being solved, in words: its stage group, refresh period k and stretch (ticks added to a step)."""
    status: str
    """CP-SAT's status: FEASIBLE for each placement found while searching (UNKNOWN for a bound before any),
    then the call's own status."""
    objective: float | None
    """The staleness (sum of use offsets) of the best placement so far; None for a search of any placement
    (a refresh period or a stretch tried) or when none was found."""
    bound: float | None
    """The proven lower bound on the staleness while minimizing it (None for a search of any placement)."""
    seconds: float
    """Wall seconds this call has run."""
    done: bool
    """Whether this is the call's end (`status` is then CP-SAT's final status)."""

    @property
    def gap(self) -> float | None:
        """(objective - bound) / objective, 0 when both are 0; None without an objective."""
        if self.objective is None or self.bound is None:
            return None
        return (self.objective - self.bound) / self.objective if self.objective else 0.0


@dataclass(frozen=True)
class SolverConfig:
    """How hard the CP-SAT planner works: a time limit, workers, seed, and the greedy warm start.

    aggregate: one STATS task per (device, micro-batch, side) for all layers of a stage instead of one
    per layer; None decides by size (more than `aggregate_above` per-layer STATS tasks in a group).
    """

    time_limit_s: float = 10.0
    """Seconds of planning (CP-SAT; see [Note: time limit] in planner/solve.py). Deterministic, it becomes a
    budget of CP-SAT deterministic time ([Note: deterministic budget] in planner/budget.py)."""
    num_workers: int = 2
    """CP-SAT threads when not deterministic (a deterministic search runs one)."""
    seed: int = 0
    """CP-SAT's random seed."""
    deterministic: bool = True
    """The same problem and options give the same plan (every field but `SolverStats.wall_time`) on a loaded
    or an idle machine: CP-SAT is budgeted in deterministic time, single-threaded and seeded. False: the
    budget is wall-clock seconds on `num_workers` threads, so a slower machine may return another plan."""
    use_greedy_hint: bool = True
    aggregate: bool | None = None
    aggregate_above: int = 256
    time_resolution: int = 100_000
    """Ticks per step when times are not exact in a decimal unit (see `planner.window`)."""
    stretch: bool = True
    """Let the step grow within `Problem.max_overhead` to make room for K-FAC work ([Note: stretch] in
    planner/window.py); False: max_overhead only pays for fused curvature (bubbles alone)."""
    progress: Callable[[SolveProgress], None] | None = field(default=None, compare=False)
    """Called with every `SolveProgress` of every CP-SAT call (None: nothing reported). It only observes: the
    plan is the same with or without it."""


@dataclass(frozen=True)
class StepTimeline:
    """One step of the pipeline, per device: fixed F/B intervals and the points the K-FAC work uses.

    ops: (op, start, end) of every op of the step in program order (RECV intervals include waits; with
    preconditioning, each stage's gradient STATS and APPLY right after its all-reduce);
    allreduce_end[(device, stage)]: end of ALLREDUCE_GRAD(stage); length: the step time.
    """

    ops: Mapping[int, tuple[tuple[Op, float, float], ...]]
    allreduce_end: Mapping[tuple[int, int], float]
    length: float

    def fixed(self, device: int) -> list[tuple[Op, float, float]]:
        """The device's F/B ops with their times."""
        return [item for item in self.ops[device] if item[0].kind in _FIXED_KINDS]

    def end_of(self, device: int, op: Op) -> float:
        """End time of `op` on `device` (AssertionError when absent)."""
        for item, _, end in self.ops[device]:
            if item == op:
                return end
        raise AssertionError(f"{op} is not on device {device}")


@lru_cache(maxsize=64)
def base_programs(problem: Problem) -> dict[int, list[Op]]:
    """Per global rank, one step of the plain pipeline with its transfers and collectives."""
    kind, D, v = problem.kind, problem.D, problem.v
    return expand_dp(add_send_recv(schedule_programs(kind, D, problem.N, v=v), kind, D, v), problem.W)


def gradient_stats(stage: StageCost, index: int) -> list[tuple[Op, float]]:
    """The STATS ops (with their seconds) of stage `index`'s parts fed by the reduced gradient, in the order every
    step runs them: layer by layer, each layer's parts in their order, right before the stage's APPLY."""
    return [(Op(OpKind.STATS, index, layer=x.name, part=p.part), p.stats)
            for x in stage.layers for p in x.parts if p.after is OpKind.ALLREDUCE_GRAD]


def prec_work(problem: Problem, device: int, stage: int) -> list[tuple[Op, float]]:
    """The per-step preconditioner work of `stage` on `device` in the order it runs, with seconds: the gradient
    statistics of the layers it keeps, then APPLY(stage) where every layer is COMM-OPT; otherwise APPLY of each
    layer it is a grad worker of, then the BCAST_PREC of each layer along its row (planner/strategy.py)."""
    copies = copies_of_stage(problem, stage)
    cost = problem.costs.stages[stage]
    work = [(op, secs) for op, secs in gradient_stats(cost, stage)
            if op.layer is not None and device in problem.workers(op.layer)]
    applies, shares = step_applies(device, stage, [x.name for x in cost.layers], copies, dict(problem.distributions))
    work += [(op, cost.prec if op.layer is None else problem.costs.layer(op.layer).prec) for op in applies]
    return work + [(op, problem.costs.collective_seconds(op, len(op.group or copies))) for op in shares]


@lru_cache(maxsize=64)
def reference_programs(problem: Problem) -> dict[int, list[Op]]:
    """The base programs with the stage's per-step preconditioner work (`prec_work`) right after each
    ALLREDUCE_GRAD(s): the paper's K-FAC step (per-step work on the critical path, refresh work nowhere)."""
    out = {}
    for rank, ops in base_programs(problem).items():
        body: list[Op] = []
        for op in ops:
            body.append(op)
            if op.kind is OpKind.ALLREDUCE_GRAD:
                s = op.stage
                assert s is not None, "the schedules' ALLREDUCE_GRAD names its stage"
                body += [work for work, _ in prec_work(problem, rank, s)]
        out[rank] = body
    return out


def gradient_allreduce_seconds(problem: Problem, stage: int) -> float:
    """Seconds of ALLREDUCE_GRAD(stage): the stage's gradients all-reduced over its copies (`CostTable.comm`)."""
    return problem.costs.collective_seconds(Op(OpKind.ALLREDUCE_GRAD, stage), len(copies_of_stage(problem, stage)))


@dataclass(frozen=True)
class StageComm:
    """What one stage's collectives cost over its `group` copies (seconds, the cost table's comm model): the
    gradient all-reduce and the broadcasts of preconditioned gradients (`share`, strategies other than
    COMM-OPT) at every step, and the SYNC_STATS and BCAST of all its parts at every refresh, each over the ranks
    its layer's strategy names."""

    group: int
    allreduce: float
    sync: float
    bcast: float
    share: float = 0.0

    def per_step(self, period: int) -> float:
        """Seconds of collectives per step when the stage refreshes every `period` steps."""
        return self.allreduce + self.share + (self.sync + self.bcast) / period


def stage_comm(problem: Problem, stage: int) -> StageComm:
    """The collectives of `stage` priced as the step timeline and the window price them."""
    copies = copies_of_stage(problem, stage)
    if len(copies) == 1:
        return StageComm(1, 0.0, 0.0, 0.0)
    price = problem.costs.collective_seconds
    sync = bcast = 0.0
    for x in problem.costs.stages[stage].layers:
        workers, local = problem.workers(x.name), problem.where(x.name).strategy.local_factors
        for p in x.parts:
            if p.after is not OpKind.ALLREDUCE_GRAD and not local:
                sync += price(Op(OpKind.SYNC_STATS, stage, layer=x.name, part=p.part), len(copies))
            if len(workers) > 1:
                bcast += price(Op(OpKind.BCAST, stage, layer=x.name, part=p.part, root=workers[0]), len(workers))
    share = max(sum(secs for op, secs in prec_work(problem, d, stage) if op.kind is OpKind.BCAST_PREC)
                for d in copies)
    return StageComm(len(copies), gradient_allreduce_seconds(problem, stage), sync, bcast, share)


def _duration(problem: Problem, fused: frozenset[str]) -> Callable[[int, Op], float]:
    """Op durations in seconds: F/B from the costs (plus fused curvature), the gradient all-reduce (the comm
    model), gradient statistics, APPLY; nothing else (transfers and OPT_STEP take no time)."""
    stages = problem.costs.stages
    allreduce = [gradient_allreduce_seconds(problem, s) for s in range(len(stages))]
    stats = {(op.layer, op.part): secs for s, stage in enumerate(stages) for op, secs in gradient_stats(stage, s)}

    def fused_curv(stage: StageCost, after: OpKind) -> float:
        return sum(p.stats for x in stage.layers if x.name in fused for p in x.parts if p.after is after)

    fwd = [s.fwd + fused_curv(s, OpKind.FWD) for s in stages]
    bwd = [s.bwd + fused_curv(s, OpKind.BWD) for s in stages]
    per_step = {(d, op): secs for d in problem.devices for s in stages_on_device(problem, d)
                for op, secs in prec_work(problem, d, s)}

    def duration(rank: int, op: Op) -> float:
        if op.kind is OpKind.FWD:
            return fwd[op.stage]  # type: ignore[index]  # a FWD names its stage
        if op.kind is OpKind.BWD:
            return bwd[op.stage]  # type: ignore[index]  # a BWD names its stage
        if op.kind in (OpKind.APPLY, OpKind.BCAST_PREC):
            return per_step[rank, op]
        if op.kind is OpKind.STATS:
            return stats[op.layer, op.part]
        if op.kind is OpKind.ALLREDUCE_GRAD and op.stage is not None:
            return allreduce[op.stage]
        return 0.0

    return duration


@lru_cache(maxsize=256)
def step_timeline(problem: Problem, fused: frozenset[str] = frozenset(), with_prec: bool = True) -> StepTimeline:
    """One simulated step (plain or with APPLY; fused layers' curvature inside F/B): the step a steady run repeats.

    Every step ends with OPT_STEP, a barrier over all ranks (the runtime's KL-clip and non-finite
    all-reduce; the simulator runs it as one), so the next step begins with every rank idle and no
    message in flight: a run repeats this step every `length` seconds, whatever the costs
    (tests/planner/test_step_timeline.py checks it against multi-step simulations). Under
    `StepBarrier.AGREEMENT_SET` this is still the step's timeline, a world barrier's: the planner uses it only
    where a steady run without the world barrier repeats it (`steps_overlap`); an agreement set may then begin
    its next step early (`early_start`), which changes no F/B time.
    """
    programs = reference_programs(problem) if with_prec else base_programs(problem)
    one = simulate(programs, _duration(problem, fused), steps=1)
    return _step_from(one, one.makespan)


def _step_from(timeline: Timeline, length: float) -> StepTimeline:
    ops: dict[int, tuple[tuple[Op, float, float], ...]] = {}
    allreduce: dict[tuple[int, int], float] = {}
    for rank in timeline.ranks:
        items = tuple((iv.op, iv.start, iv.end) for iv in timeline.of_rank(rank))
        ops[rank] = items
        for op, _, end in items:
            if op.kind is OpKind.ALLREDUCE_GRAD:
                allreduce[rank, op.stage] = end  # type: ignore[index]  # an ALLREDUCE_GRAD names its stage
    return StepTimeline(ops, allreduce, length)


def plain_step_time(problem: Problem) -> float:
    """T0: the step time of the plain pipeline (no K-FAC)."""
    return step_timeline(problem, frozenset(), False).length


def plain_utilization(problem: Problem) -> float:
    """The plain pipeline's utilization (no K-FAC): its F/B over every device's step."""
    base = step_timeline(problem, frozenset(), False)
    busy = sum(sum(b - a for _, a, b in base.fixed(d)) for d in problem.devices)
    return utilization(busy, base.length * len(problem.devices))


@dataclass(frozen=True)
class StageGroup:
    """Stages that share devices (Chimera's stage pairs, interleaved chunks) and those devices.

    A group has one refresh period: its devices' K-FAC work repeats with it.
    """

    stages: tuple[int, ...]
    devices: tuple[int, ...]


@lru_cache(maxsize=64)
def _holders(problem: Problem) -> dict[int, tuple[int, ...]]:
    """Stage -> the ranks holding a copy of it, as the runtime deals them (`ranks_of_stages`)."""
    return ranks_of_stages(problem.kind, problem.D, problem.W, problem.v)


def copies_of_stage(problem: Problem, stage: int) -> tuple[int, ...]:
    """The global ranks that run `stage` (dp replicas; both Chimera pipelines)."""
    return _holders(problem)[stage]


def stages_on_device(problem: Problem, device: int) -> tuple[int, ...]:
    """The stages whose F/B run on `device`, ascending."""
    return tuple(s for s, ranks in _holders(problem).items() if device in ranks)


@lru_cache(maxsize=64)
def stage_groups(problem: Problem) -> tuple[StageGroup, ...]:
    """The connected components of 'stage runs on device', ordered by their first stage."""
    linked = linked_classes((stages_on_device(problem, d) for d in problem.devices), problem.num_stages)
    return tuple(StageGroup(stages, tuple(sorted({d for s in stages for d in copies_of_stage(problem, s)})))
                 for stages in linked)


def agreement_set(problem: Problem, device: int) -> tuple[int, ...]:
    """The ranks whose step ends `device`'s step end waits for: every rank under `StepBarrier.WORLD`, else the
    devices of its stage group (ranks linked by holding copies of one stage: the runtime's agreement set; tied
    weights, which may link two groups, are not in the planner's data)."""
    if problem.barrier is StepBarrier.WORLD:
        return problem.devices
    return next(g.devices for g in stage_groups(problem) if device in g.devices)


@lru_cache(maxsize=64)
def steps_overlap(problem: Problem) -> bool:
    """Whether, with each OPT_STEP synchronizing only its agreement set, some op of a steady run ends at another time
    than the one-step timeline repeated every `length` seconds says (a later step overlapping an earlier one):
    checked over 3 simulated steps, plain and refresh-step (every layer's curvature fused) durations alike.
    The window models a step by the one-step timeline, so there the planner keeps the world barrier's step."""
    if problem.barrier is StepBarrier.WORLD:
        return False
    programs = reference_programs(problem)
    barrier = {d: agreement_set(problem, d) for d in problem.devices}
    for fused in (frozenset(), frozenset(problem.costs.layer_names)):
        one = step_timeline(problem, fused)
        run = simulate(programs, _duration(problem, fused), steps=3, barrier=barrier)
        want = {(d, j, n): j * one.length + end for d, items in one.ops.items() for j in range(3)
                for n, (_, _, end) in enumerate(items)}
        seen: dict[tuple[int, int], int] = {}
        for iv in sorted(run.intervals, key=lambda iv: (iv.rank, iv.step, iv.start, iv.end)):
            n = seen[iv.rank, iv.step] = seen.get((iv.rank, iv.step), -1) + 1
            if iv.op.kind is not OpKind.OPT_STEP and abs(iv.end - want[iv.rank, iv.step, n]) > 1e-9 * one.length:
                return True
    return False


Time = TypeVar("Time", int, float)


def window_length(refresh: Time, normal: Time, stretch: Time, k: int) -> Time:
    """The length of a window of k steps: the refresh step lasts `refresh`, the others `normal`, each followed by
    `stretch` idle time ([Note: stretch] in planner/window.py); in ticks or seconds."""
    return refresh + (k - 1) * normal + k * stretch


def step_begins(refresh: Time, normal: Time, stretch: Time, j: int, k: int) -> Time:
    """Where window step j begins after the start of window step 0 (j >= k: a later window, which repeats it),
    before any lead ([Note: step barrier] in planner/window.py): the one step start of the window, the plan's view
    and the validator."""
    within = j % k
    start = 0 if within == 0 else refresh + (within - 1) * normal
    return start + within * stretch + window_length(refresh, normal, stretch, k) * (j // k)


def early_start(problem: Problem, step: StepTimeline, devices: Iterable[int]) -> float:
    """Seconds before the end of `step` at which the step after it may begin on `devices` (an agreement set): once
    each of them has ended its F/B and all-reduces and then run its per-step slots back to back (`slot_seconds`:
    where a plan may put them, not just where the reference step does); 0 under `StepBarrier.WORLD` or where steps
    overlap (`steps_overlap`)."""
    if problem.barrier is StepBarrier.WORLD or steps_overlap(problem):
        return 0.0
    last = max((max((end for op, _, end in step.ops[d] if op.kind not in _SLOT_KINDS), default=0.0)
                + sum(slot_seconds(problem, d, s) for s in stages_on_device(problem, d))) for d in devices)
    return max(0.0, step.length - last)


_SLOT_KINDS = frozenset({OpKind.APPLY, OpKind.STATS, OpKind.BCAST_PREC, OpKind.OPT_STEP})
"""Ops of a step's end that are no fixed work (the per-step slot, which a plan places, and OPT_STEP)."""


def slot_seconds(problem: Problem, device: int, stage: int) -> float:
    """Seconds of `stage`'s per-step slot on `device` (`prec_work`), its broadcasts of preconditioned gradients
    starting together on every copy, after the longest work before them on any copy."""
    work = prec_work(problem, device, stage)
    shares = [secs for op, secs in work if op.kind is OpKind.BCAST_PREC]
    if not shares:
        return sum(secs for _, secs in work)
    before = max(sum(secs for op, secs in prec_work(problem, c, stage) if op.kind is not OpKind.BCAST_PREC)
                 for c in copies_of_stage(problem, stage))
    return before + sum(shares)


def stretch_allowance(problem: Problem, fused: frozenset[str], k: int) -> float:
    """Seconds of idle time the planner may append to every step at refresh period k: max_overhead of
    the reference step, less what the refresh step's fused curvature adds per step of the window."""
    normal = step_timeline(problem).length
    extra = step_timeline(problem, fused).length - normal
    return max(0.0, problem.max_overhead * normal - extra / k)


def refresh_lower_bound(problem: Problem, group: StageGroup, fused: frozenset[str] = frozenset(),
                        stretch: bool = False) -> int:
    """ceil(K-FAC work of the group / its bubble time per step): curvature of every micro-batch on
    every copy that keeps the layer's statistics (unfused layers) plus all inversions, over the idle time of
    the reference step (whose F/B, per-step preconditioner work and gradient all-reduces are busy).

    stretch: the idle time appended to every step within max_overhead (`stretch_allowance`) counts as
    bubble on every device of the group: the least k whose k steps hold the work.
    """
    step = step_timeline(problem, fused)
    work = 0.0
    for device in group.devices:
        for op, _, _ in step.fixed(device):
            assert op.stage is not None, "F/B name their stage"
            copies = copies_of_stage(problem, op.stage)
            work += sum(p.stats for x in problem.costs.stages[op.stage].layers
                        if x.name not in fused and keeps_statistics(device, copies, problem.where(x.name))
                        for p in x.parts if p.after is op.kind)
    work += sum(problem.costs.stages[s].inv for s in group.stages)
    busy = sum(end - start for d in group.devices for op, start, end in step.ops[d]
               if op.kind in _FIXED_KINDS or op.kind in _NOT_BUBBLE)
    bubble = step.length * len(group.devices) - busy
    if work <= 0:
        return 1
    if stretch:
        for k in range(1, problem.max_period + 1):
            if work <= k * (bubble + len(group.devices) * stretch_allowance(problem, fused, k)) * (1 + 1e-9):
                return k
        return problem.max_period + 1
    if bubble <= 1e-9 * step.length * len(group.devices):  # none but float rounding
        return problem.max_period + 1
    return min(problem.max_period + 1, max(1, math.ceil(work / bubble - 1e-9)))


def format_bytes(n: float) -> str:
    """Bytes in binary units with one decimal (whole bytes below 1 KiB): the one spelling of every message and view."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")

