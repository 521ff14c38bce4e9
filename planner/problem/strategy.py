"""Distribution strategies: where a layer's preconditioner work and state live across the copies of its stage.

[Note: strategies] A stage's H holders (dp replicas, Chimera's pipelines) share each layer's work as KAISA or DP-KFAC:
KAISA's grad-worker fraction f (COMM_OPT 1, MEM_OPT 1/H, HYBRID between) makes n = H / g columns {c, c + n, ...} of
g = f * H grad workers and g rows {j n, ..., j n + n - 1}; every holder folds the all-reduced statistics, a layer's
column decomposes and preconditions it, and each member broadcasts the result along its row. DP-KFAC: one owner
keeps local factors of its own micro-batches and broadcasts the preconditioned gradient. The planner picks each
layer's column; the runtime derives the same groups (`grad_workers`, `receivers`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from fractions import Fraction
from typing import TypeVar

from fxkfac.planner.problem.errors import ConfigError


class StrategyKind(StrEnum):
    """How a layer's preconditioner is shared by its stage's copies (see [Note: strategies])."""

    COMM_OPT = "comm-opt"
    MEM_OPT = "mem-opt"
    HYBRID = "hybrid"
    DP_KFAC = "dp-kfac"


@dataclass(frozen=True, slots=True)
class Strategy:
    """One strategy: its kind and, for HYBRID, KAISA's grad-worker fraction f in (0, 1)."""

    kind: StrategyKind
    fraction: Fraction | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, StrategyKind):
            object.__setattr__(self, "kind", StrategyKind(self.kind))
        hybrid = self.kind is StrategyKind.HYBRID
        if hybrid != (self.fraction is not None) or (hybrid and not 0 < (self.fraction or 0) < 1):
            raise ConfigError(
                "hybrid, and no other strategy, takes a grad-worker fraction F in (0, 1) (hybrid:F, e.g. hybrid:0.5; "
                f"1 is comm-opt, 1/W mem-opt), got {self.kind.value} with {self.fraction}"
            )

    def __str__(self) -> str:
        return self.kind.value if self.fraction is None else f"{self.kind.value}:{self.fraction}"

    @property
    def local_factors(self) -> bool:
        """Whether the owner keeps factors of its own micro-batches (DP-KFAC) instead of all-reduced ones."""
        return self.kind is StrategyKind.DP_KFAC

    def workers(self, holders: int) -> int:
        """g: how many of a stage's `holders` copies precondition each layer (and hold its decomposition)."""
        if self.fraction is None:
            return holders if self.kind is StrategyKind.COMM_OPT else 1
        g = max(1, round(self.fraction * holders))
        if holders % g:
            raise ConfigError(
                f"{self} gives {g} grad workers of a stage held by {holders} ranks, which does not "
                f"divide them; choose f so that f * {holders} divides {holders}"
            )
        return g


K = TypeVar("K", str, tuple[str, str])
B = TypeVar("B")

COMM_OPT = Strategy(StrategyKind.COMM_OPT)
"""The default: every copy holds every decomposition."""


def parse_strategy(text: str) -> Strategy:
    """``comm-opt``, ``mem-opt``, ``dp-kfac`` or ``hybrid:F`` (F a fraction like 0.5 or 1/4) as a Strategy."""
    name, colon, fraction = text.strip().lower().partition(":")
    try:
        kind = StrategyKind(name)
        value = Fraction(fraction).limit_denominator(1 << 16) if colon else None
    except (ValueError, ZeroDivisionError):
        raise ConfigError(
            f"unknown strategy {text!r}; use comm-opt, mem-opt, hybrid:F (0 < F < 1, e.g. hybrid:0.5) or dp-kfac"
        ) from None
    return Strategy(kind, value)


@dataclass(frozen=True, slots=True)
class LayerDistribution:
    """Where one layer's work lives: its strategy and its column (0..H/g-1) of the holder grid ([Note: strategies])."""

    strategy: Strategy = COMM_OPT
    column: int = 0

    def __str__(self) -> str:
        return f"{self.strategy}@{self.column}"

    @classmethod
    def parse(cls, text: str) -> LayerDistribution:
        """Inverse of `str`."""
        strategy, sep, column = text.rpartition("@")
        if not sep or not column.isdigit():
            raise ConfigError(f"a layer distribution is written STRATEGY@COLUMN, got {text!r}")
        return cls(parse_strategy(strategy), int(column))


def columns(holders: tuple[int, ...], strategy: Strategy) -> int:
    """n = H / g: how many columns (grad-worker groups) the stage's holders form under `strategy`."""
    return len(holders) // strategy.workers(len(holders))


def grad_workers(holders: tuple[int, ...], where: LayerDistribution) -> tuple[int, ...]:
    """The ranks of the layer's column: they decompose, hold the decomposition and precondition the layer."""
    n = columns(holders, where.strategy)
    if not 0 <= where.column < n:
        raise ConfigError(
            f"column {where.column} of {where.strategy} does not exist for a stage held by "
            f"{len(holders)} ranks (columns 0..{n - 1})"
        )
    return holders[where.column :: n]


def receivers(holders: tuple[int, ...], where: LayerDistribution) -> list[tuple[int, tuple[int, ...]]]:
    """Each grad worker with its row, the ranks it broadcasts the preconditioned gradient to (none: all work)."""
    n = columns(holders, where.strategy)
    if n == 1:
        return []
    rows = [holders[j * n : (j + 1) * n] for j in range(len(holders) // n)]
    return [(row[where.column], row) for row in rows]


def keeps_statistics(rank: int, holders: tuple[int, ...], where: LayerDistribution, gradient_fed: bool = False) -> bool:
    """Whether `rank` takes the layer's statistics: every holder, or only grad workers where gradient-fed or local."""
    if gradient_fed or where.strategy.local_factors:
        return rank in grad_workers(holders, where)
    return rank in holders


@dataclass(frozen=True, slots=True)
class Holding:
    """What one copy of a stage keeps of one layer: statistics, decompositions (and state), a BCAST_PREC buffer."""

    statistics: bool
    decompositions: bool
    shares_gradient: bool


def holding(rank: int, holders: tuple[int, ...], where: LayerDistribution, gradient_fed: bool = False) -> Holding:
    """What `rank` keeps of a layer distributed as `where`; `gradient_fed`: statistics all from the gradient."""
    workers = grad_workers(holders, where)
    return Holding(
        statistics=keeps_statistics(rank, holders, where, gradient_fed),
        decompositions=rank in workers,
        shares_gradient=len(workers) < len(holders),
    )


def least_loaded(costs: Mapping[K, float], bins: Sequence[B]) -> dict[K, B]:
    """LPT (KAISA's greedy): each item, costliest first (ties by key), to the least loaded of `bins` (ties: first)."""
    load = dict.fromkeys(bins, 0.0)
    out: dict[K, B] = {}
    for key in sorted(costs, key=lambda key: (-costs[key], key)):
        out[key] = min(bins, key=lambda b: load[b])
        load[out[key]] += costs[key]
    return out


def distribute(
    strategy: Strategy,
    stage_layers: Mapping[int, Sequence[str]],
    holders: Mapping[int, tuple[int, ...]],
    costs: Mapping[str, float],
) -> dict[str, LayerDistribution]:
    """Every layer under `strategy`, each stage's dealt to its columns by `least_loaded` on `costs`."""
    out: dict[str, LayerDistribution] = {}
    for stage, names in stage_layers.items():
        dealt = least_loaded({name: costs[name] for name in names}, range(columns(holders[stage], strategy)))
        out.update({name: LayerDistribution(strategy, column) for name, column in dealt.items()})
    return out
