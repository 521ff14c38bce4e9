"""The planning problem: schedule, mesh, costs, budget; its stage copies and groups."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from enum import StrEnum
from functools import cached_property, lru_cache
from typing import Any

from fxkfac.planner.problem.costs import CostTable, PreconditionerKind
from fxkfac.planner.problem.errors import ConfigError, PlanError, PlanFormatError
from fxkfac.planner.problem.ir import LAYER_TRANSFER_KINDS, NS_STEPS, Op, OpKind, piece_share
from fxkfac.planner.problem.lowering import Streaming, can_stream, linked_classes, ranks_of_stages
from fxkfac.planner.problem.schedules import ScheduleKind, num_stages, validate_schedule_args
from fxkfac.planner.problem.strategy import (
    LayerDistribution,
    Strategy,
    distribute,
    grad_workers,
)


class StepBarrier(StrEnum):
    """Which ranks a step's end waits for ([Note: step barrier] in planner/plan/window.py; the runtime's
    `kl_clip_scope`): every rank, or the rank's agreement set, the devices of its stage group."""

    WORLD = "world"
    AGREEMENT_SET = "agreement-set"


@dataclass(frozen=True)
class Problem:
    """What to plan: the pipeline (pp size D, dp size W, N micro-batches, v stages a rank), its costs, bytes a device
    (None: unlimited), the fraction the step may grow (0.0: bubbles only), and non-COMM-OPT layer distributions."""

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
    decomp_pieces: int = 1  # how many DECOMP ops each decomposition is cut into (Muon: its APPLY, `apply_pieces`)
    warm_start: bool = False  # each decomposition starts from its layer's newest preconditioner
    barrier: StepBarrier = StepBarrier.WORLD
    streaming: Streaming | None = None  # layers whose APPLY a helper rank runs, fed during the owner's last backward
    recompute: tuple[int, ...] = ()  # stages recomputing their forward in their BWD, ascending

    def __post_init__(self) -> None:
        kind = validate_schedule_args(self.schedule, self.D, self.N, self.v)
        object.__setattr__(self, "schedule", kind.value)
        if not self.hardware:
            object.__setattr__(self, "hardware", self.costs.hardware)
        for name in ("W", "max_period", "decomp_pieces", "memory_budget"):
            value = getattr(self, name)
            bad = isinstance(value, bool) or not isinstance(value, int) or value < 1
            if bad and (name != "memory_budget" or value is not None):
                raise PlanError(f"{name} must be an int >= 1 (memory_budget: bytes, or None), got {value!r}")
        S = num_stages(kind, self.D, self.v)
        if len(self.costs.stages) != S:
            raise PlanError(
                f"the cost table has {len(self.costs.stages)} stages but {kind} with D={self.D}, "
                f"v={self.v} has {S}; make the cost table for {S} stages"
            )
        if not (isinstance(self.max_overhead, (int, float)) and 0 <= self.max_overhead < 10):
            raise PlanError(f"max_overhead is a fraction in [0, 10), got {self.max_overhead!r}")
        try:
            object.__setattr__(self, "barrier", StepBarrier(self.barrier))
        except ValueError:
            raise PlanError(f"barrier must be one of {[b.value for b in StepBarrier]}, got {self.barrier!r}") from None
        if self.costs.family is PreconditionerKind.MUON and self.decomp_pieces > NS_STEPS:
            raise PlanError(
                f"Muon's APPLY pieces run its {NS_STEPS} Newton-Schulz iterations; {self.decomp_pieces} pieces "
                f"would leave some empty (at most {NS_STEPS})"
            )
        if not isinstance(self.warm_start, bool):
            raise PlanError(f"warm_start must be a bool, got {self.warm_start!r}")
        if [n for n, _ in self.distributions] != sorted({n for n, _ in self.distributions}):
            raise PlanError(
                "Problem.distributions must be (layer, distribution) pairs sorted by distinct layer; "
                "use Problem.with_distributions"
            )
        unknown = sorted({n for n, _ in self.distributions} - set(self.costs.layer_names))
        if unknown:
            raise PlanError(f"distributions name layers {unknown[:3]} that are not in the cost table")
        for name, where in self.distributions:
            grad_workers(self.holders[self.costs.stage_of(name)], where)  # ConfigError for a bad column
            captured = any(p.after is not OpKind.ALLREDUCE_GRAD for p in self.costs.layer(name).parts)
            if where.strategy.local_factors and not captured:
                raise ConfigError(
                    f"{where.strategy} keeps local factors of captures, but {name}'s statistics come "
                    "from the reduced gradient, the same on every copy; use mem-opt for one owner"
                )
        if self.streaming is not None:
            self._check_streaming(self.streaming)
        stages = self.recompute
        ints = isinstance(stages, tuple) and all(type(s) is int and 0 <= s < S for s in stages)
        if not ints or list(stages) != sorted(set(stages)):
            raise PlanError(f"recompute must be a tuple of distinct stages of 0..{S - 1}, ascending, got {stages!r}")

    def _check_streaming(self, streaming: Streaming) -> None:
        """PlanError unless no helper holds the streamed stage and each streamed layer may stream, under COMM-OPT."""
        if not streaming.stage < self.num_stages:
            raise PlanError(f"streaming names stage {streaming.stage}, which this problem does not have")
        for helper in streaming.ranks:
            if helper not in self.devices or helper in self.stream_owners:
                raise PlanError(f"a streaming helper holds no copy of stage {streaming.stage}, got rank {helper}")
        held = {x.name: x for x in self.costs.stages[streaming.stage].layers}
        for name in streaming.layers:
            layer = held.get(name)
            if layer is None:
                raise PlanError(f"streaming names {name!r}, which is not a layer of stage {streaming.stage}")
            if not can_stream(self.costs.family, layer):
                raise PlanError(
                    f"{name}'s APPLY keeps state besides statistics fed by the gradient: only a layer whose APPLY "
                    "reads its preconditioner alone (K-FAC), whose statistics come from the gradient alone "
                    "(Shampoo, SOAP) or a Muon matrix streams"
                )
            if self.where(name) != LayerDistribution():
                raise PlanError(f"{name} streams, so every copy applies it (COMM-OPT), not {self.where(name)}")

    @property
    def apply_pieces(self) -> int:
        """Pieces each layer's APPLY is cut into: Muon's `decomp_pieces` (by iterations), one for other families."""
        return self.decomp_pieces if self.costs.family is PreconditionerKind.MUON else 1

    @property
    def stream_owners(self) -> tuple[int, ...]:
        """The ranks holding the streamed stage, ascending (the first also sends the replicas)."""
        assert self.streaming is not None, "only a problem with streaming has owners"
        return self.holders[self.streaming.stage]

    @property
    def chains_refreshes(self) -> bool:
        """Whether each refresh is made before the next one's first DECOMP (warm starts, pieces)."""
        return self.warm_start or self.decomp_pieces > 1

    def __hash__(self) -> int:
        """The fields' hash, computed once: the planner's caches key on problems millions of times."""
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

    @cached_property
    def holders(self) -> dict[int, tuple[int, ...]]:
        """Stage -> the ranks holding a copy of it, ascending (dp replicas; both Chimera pipelines), computed once."""
        return ranks_of_stages(self.schedule, self.D, self.W, self.v)

    def with_distributions(self, distributions: Mapping[str, LayerDistribution]) -> Problem:
        """The same problem with these layer distributions (COMM-OPT and streamed layers left out: one form)."""
        streamed = set(self.streaming.layers) if self.streaming is not None else set()
        named = sorted((n, d) for n, d in distributions.items() if d != LayerDistribution() and n not in streamed)
        return replace(self, distributions=tuple(named))

    def with_strategy(self, strategy: Strategy) -> Problem:
        """Every layer under `strategy`, dealt to columns by `distribute` on its decomposition (Muon: APPLY) seconds."""
        layers = {s: [x.name for x in stage.layers] for s, stage in enumerate(self.costs.stages)}
        costs = {x.name: x.inv if x.parts else x.prec for x in self.costs.layers}
        return self.with_distributions(distribute(strategy, layers, self.holders, costs))

    def where(self, layer: str) -> LayerDistribution:
        """The distribution of `layer` (COMM-OPT unless `distributions` names it)."""
        return self._where.get(layer, LayerDistribution())

    def workers(self, layer: str) -> tuple[int, ...]:
        """The ranks that decompose and apply `layer`'s preconditioner (all copies of its stage under COMM-OPT)."""
        return grad_workers(self.holders[self.costs.stage_of(layer)], self.where(layer))

    def recomputes(self, stage: int) -> bool:
        """Whether `stage` recomputes its forward in its backward (`recompute`)."""
        return stage in self.recompute

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
        """Plain JSON-able form (the cost table nested in its own schema; fields from `distributions` on when set)."""
        every = fields(self)
        first = next(i for i, f in enumerate(every) if f.name == "distributions")
        data = {
            f.name: getattr(self, f.name)
            for i, f in enumerate(every)
            if i < first or getattr(self, f.name) != f.default
        }
        encoded = {
            "costs": self.costs.to_dict(),
            "distributions": {n: str(d) for n, d in self.distributions},
            "barrier": self.barrier.value,
            "streaming": self.streaming.to_dict() if self.streaming is not None else None,
            "recompute": list(self.recompute),
        }
        return data | {n: v for n, v in encoded.items() if n in data}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Problem:
        """Inverse of `to_dict`; a malformed entry raises PlanFormatError."""
        try:
            where = sorted((str(n), LayerDistribution.parse(str(d))) for n, d in data.get("distributions", {}).items())
            streaming = Streaming.from_dict(data["streaming"]) if data.get("streaming") is not None else None
            body = {**data, "costs": CostTable.from_dict(data["costs"]), "distributions": tuple(where)}
            return cls(**{**body, "streaming": streaming, "recompute": tuple(data.get("recompute", ()))})
        except (KeyError, TypeError, ConfigError) as e:
            raise PlanFormatError(f"the plan's problem is malformed: {e}") from e


@dataclass(frozen=True)
class SolveProgress:
    """What CP-SAT reports while it places one window, for a front to render (objective None: any placement)."""

    window: str
    status: str
    objective: float | None
    bound: float | None
    seconds: float
    done: bool

    @property
    def gap(self) -> float | None:
        """(objective - bound) / objective, 0 when both are 0; None without an objective."""
        if self.objective is None or self.bound is None:
            return None
        return (self.objective - self.bound) / self.objective if self.objective else 0.0


@dataclass(frozen=True)
class SolverConfig:
    """How hard the CP-SAT planner works."""

    time_limit_s: float = 10.0  # seconds of planning ([Note: deterministic budget] in planner/search/budget.py)
    num_workers: int = 2  # CP-SAT threads when not deterministic (a deterministic search runs one)
    seed: int = 0  # CP-SAT's random seed
    deterministic: bool = True  # the same plan on any machine (deterministic time, one thread)
    stats_chunk: int | None = None  # at most this many layers in one STATS task (None: by `max_stats_tasks`)
    max_stats_tasks: int = 1536  # with stats_chunk None: STATS tasks per layer up to this many a group
    time_resolution: int = 100_000  # ticks a step when times are not exact ([Note: time grid])
    stretch: bool = True  # let the step grow within `Problem.max_overhead` ([Note: stretch] in planner/plan/window.py)
    progress: Callable[[SolveProgress], None] | None = field(default=None, compare=False)  # sees every CP-SAT call


@dataclass(frozen=True)
class StageGroup:
    """Stages that share devices (Chimera's stage pairs, interleaved chunks) and those devices: one refresh period."""

    stages: tuple[int, ...]
    devices: tuple[int, ...]


def stages_on_device(problem: Problem, device: int) -> tuple[int, ...]:
    """The stages whose F/B run on `device`, ascending."""
    return tuple(s for s, ranks in problem.holders.items() if device in ranks)


def streamed_stats(problem: Problem, layer: str) -> bool:
    """Whether `layer` streams with gradient-fed parts, whose statistics its helper folds (docs/STREAMED_APPLY.md)."""
    streaming = problem.streaming
    return (
        streaming is not None
        and layer in streaming.layers
        and any(p.after is OpKind.ALLREDUCE_GRAD for p in problem.costs.layer(layer).parts)
    )


def streamed_seconds(problem: Problem, op: Op) -> float:
    """Seconds of a streamed layer's APPLY (or piece) on its helper, with `streamed_stats` its folds and packing."""
    cost = problem.costs.layer(op.layer_name)
    stepped = streamed_stats(problem, op.layer_name)
    folds = cost.curv + cost.take_back if stepped else 0.0
    return cost.prec * piece_share(op.piece) + folds


def returned(problem: Problem, layer: str) -> Op:
    """The owners' RECV_PGRAD of a streamed `layer`, where its result lands."""
    assert problem.streaming is not None, "only a streamed layer is returned"
    return Op(OpKind.RECV_PGRAD, problem.streaming.stage, peer=problem.streaming.helper_of(layer), layer=layer)


def is_streamed(problem: Problem, device: int, op: Op) -> bool:
    """Whether `op` on `device` is a streamed layer's hand-off (a transfer, the helper's APPLY), fixed by the step."""
    return op.kind in LAYER_TRANSFER_KINDS or (
        op.kind is OpKind.APPLY and op.stage not in stages_on_device(problem, device)
    )


@lru_cache(maxsize=64)
def stage_groups(problem: Problem) -> tuple[StageGroup, ...]:
    """The connected components of 'stage runs on device', ordered by their first stage."""
    linked = linked_classes((stages_on_device(problem, d) for d in problem.devices), problem.num_stages)
    return tuple(
        StageGroup(stages, tuple(sorted({d for s in stages for d in problem.holders[s]}))) for stages in linked
    )


def agreement_set(problem: Problem, device: int) -> tuple[int, ...]:
    """The ranks whose step ends `device`'s waits for: all under `StepBarrier.WORLD`, else its stage group's."""
    if problem.barrier is StepBarrier.WORLD:
        return problem.devices
    return next(g.devices for g in stage_groups(problem) if device in g.devices)


def format_bytes(n: float) -> str:
    """Bytes in binary units with one decimal (whole bytes below 1 KiB): the one spelling of every message and view."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
